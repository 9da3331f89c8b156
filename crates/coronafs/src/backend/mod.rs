//! Block backends: where a volume's bytes live.
//!
//! [`BlockBackend`] is the small trait the NBD server is written against.
//! Buffers are owned and handed back with the result, so an io_uring engine can
//! keep them while the kernel works and the server can return them to its pool
//! without copying.
//!
//! Implementations: [`file::FileBackend`] (thread-pool pread/pwrite with an
//! inline `RWF_NOWAIT` fast path), [`uring::UringBackend`] (tokio-uring) and
//! [`memory::MemBackend`] (tests and models), [`crash::CrashBackend`] (crash
//! injection). [`layered::Layered`] composes any of them into copy-on-write
//! chains. [`AnyBackend`] lets the server pick one at run time without
//! dynamic dispatch.

use std::fs::File;
use std::future::Future;
use std::io;
use std::sync::Arc;

pub mod crash;
pub mod fault;
pub mod file;
pub mod layered;
pub mod memory;
pub mod pagecache;
pub mod uring;

/// A range of the device and its `base:allocation` state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent64 {
    pub length: u64,
    /// `proto::state` bits: HOLE and/or ZERO, or 0 for allocated data.
    pub flags: u32,
}

/// A file range whose bytes are already in the page cache, so the server can
/// `sendfile` them to the socket instead of copying them through a buffer.
#[derive(Debug, Clone)]
pub struct SpliceSource {
    pub file: Arc<File>,
    pub offset: u64,
}

/// The result of an operation that borrowed a buffer.
pub type BufResult = (io::Result<()>, Vec<u8>);

/// A block device: byte-addressed, fixed size, crash-consistent on `flush`.
///
/// Contract shared by every implementation (and checked by one test suite):
/// - `read_at` fills the whole buffer (`buf.len()` bytes) or fails;
/// - a completed `write_at` is visible to every later `read_at`, from any caller;
/// - after `flush` (or a `write_at` with `fua`) returns Ok, every write that
///   completed before the call survives a crash;
/// - `write_zeroes` makes the range read as zeroes; with `punch` it may free
///   the space, and with `fast_only` it fails with `EOPNOTSUPP` rather than
///   doing slow work;
/// - `trim` may free the space; the contents are then undefined (here: zero).
pub trait BlockBackend: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;
    fn read_at(&self, buf: Vec<u8>, offset: u64) -> impl Future<Output = BufResult> + Send;
    fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> impl Future<Output = BufResult> + Send;
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        punch: bool,
        fast_only: bool,
    ) -> impl Future<Output = io::Result<()>> + Send;
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = io::Result<()>> + Send;
    fn flush(&self) -> impl Future<Output = io::Result<()>> + Send;
    /// A hint to bring the range into cache.
    fn cache(&self, offset: u64, len: u64) -> impl Future<Output = io::Result<()>> + Send;
    /// Allocation of `[offset, offset+len)`, at most `max` extents, in order,
    /// covering a prefix of the range (at least one extent unless `len` is 0).
    fn extents(&self, offset: u64, len: u64, max: usize) -> impl Future<Output = io::Result<Vec<Extent64>>> + Send;
    /// Reads all of `buf` at `offset` right now if that needs no waiting
    /// (data in the page cache); `false` means "use `read_at`" and leaves
    /// `buf` unspecified. The server uses it to answer without a task hand-off.
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        let _ = (buf, offset);
        false
    }
    /// Writes all of `buf` at `offset` right now if that needs no waiting
    /// (a page-cache write); `false` means "use `write_at`", which must then
    /// write the whole buffer again (a partial write here is harmless).
    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        let _ = (buf, offset);
        false
    }
    /// Where `[offset, offset+len)` can be sent from without a copy, when the
    /// whole range is one cached file range. `None` (the default) means
    /// "use `read_at`"; it is only ever an optimisation.
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        let _ = (offset, len);
        None
    }
}

/// One of the backends, chosen at run time.
#[derive(Debug)]
pub enum AnyBackend {
    File(file::FileBackend),
    Uring(uring::UringBackend),
    Memory(memory::MemBackend),
    Fault(fault::FaultBackend),
}

macro_rules! dispatch {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::File($b) => $e,
            AnyBackend::Uring($b) => $e,
            AnyBackend::Memory($b) => $e,
            AnyBackend::Fault($b) => $e,
        }
    };
}

impl BlockBackend for AnyBackend {
    fn size(&self) -> u64 {
        dispatch!(self, b => b.size())
    }
    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        dispatch!(self, b => b.read_at(buf, offset).await)
    }
    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        dispatch!(self, b => b.write_at(buf, offset, fua).await)
    }
    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        dispatch!(self, b => b.write_zeroes(offset, len, punch, fast_only).await)
    }
    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        dispatch!(self, b => b.trim(offset, len).await)
    }
    async fn flush(&self) -> io::Result<()> {
        dispatch!(self, b => b.flush().await)
    }
    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        dispatch!(self, b => b.cache(offset, len).await)
    }
    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        dispatch!(self, b => b.extents(offset, len, max).await)
    }
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        dispatch!(self, b => b.try_read_now(buf, offset))
    }
    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        dispatch!(self, b => b.try_write_now(buf, offset))
    }
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        dispatch!(self, b => b.splice_source(offset, len))
    }
}

/// Which engine serves file-backed volumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IoEngine {
    /// io_uring through tokio-uring; falls back to `threads` when the kernel
    /// or a seccomp profile refuses io_uring.
    Uring,
    /// pread/pwrite on a thread pool, with an inline `RWF_NOWAIT` fast path
    /// for data already in the page cache.
    Threads,
}

impl std::fmt::Display for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IoEngine::Uring => "uring",
            IoEngine::Threads => "threads",
        })
    }
}

/// Opens file-backed volumes with the chosen engine.
#[derive(Debug, Clone)]
pub enum Opener {
    Threads,
    Uring(uring::UringEngine),
}

impl Opener {
    /// Starts the engine. Asking for `uring` where io_uring is refused logs a
    /// warning and falls back to `threads`; [`Opener::engine`] says which one runs.
    pub fn start(engine: IoEngine) -> Self {
        match engine {
            IoEngine::Threads => Opener::Threads,
            IoEngine::Uring => match uring::UringEngine::start() {
                Ok(e) => Opener::Uring(e),
                Err(err) => {
                    tracing::warn!(%err, "io_uring is not available here; falling back to the threads engine");
                    Opener::Threads
                }
            },
        }
    }

    /// The engine actually in use.
    pub fn engine(&self) -> IoEngine {
        match self {
            Opener::Threads => IoEngine::Threads,
            Opener::Uring(_) => IoEngine::Uring,
        }
    }

    /// Opens `file` (already opened read-write or read-only) as a backend.
    pub fn open(&self, file: std::fs::File) -> io::Result<AnyBackend> {
        let fb = file::FileBackend::new(file)?;
        Ok(match self {
            Opener::Threads => AnyBackend::File(fb),
            Opener::Uring(engine) => AnyBackend::Uring(uring::UringBackend::new(engine.clone(), fb)?),
        })
    }
}

#[cfg(test)]
pub(crate) mod suite;
