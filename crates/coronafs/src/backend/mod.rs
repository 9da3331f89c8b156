//! Block backends: where a volume's bytes live.
//!
//! [`BlockBackend`] ([`traits`]) is the small trait the NBD server is
//! written against; the engines implement it and [`AnyBackend`] picks one.
//! Buffers are owned and handed back with the result, so an io_uring engine can
//! keep them while the kernel works and the server can return them to its pool
//! without copying.
//!
//! Implementations: [`file::FileBackend`] (thread-pool pread/pwrite with an
//! inline `RWF_NOWAIT` fast path), [`uring::UringBackend`] (tokio-uring) and
//! [`memory::MemBackend`] (tests, models and the bench's gate).
//! [`layered::Layered`] composes any of them into copy-on-write chains.
//! [`replicated::Replicated`] forwards a local backend's writes to replicas
//! on other nodes (docs/design/replication-volumes.md).
//! [`AnyBackend`] lets the server pick one at run time without dynamic
//! dispatch.
//!
//! Test doubles, compiled only for the crate's tests or with the `testing`
//! feature: `crash::CrashBackend` (separate live and durable images, crash
//! at a chosen write) and `fault::FaultBackend` (delays and errors on
//! chosen operations and ranges, served as `AnyBackend::Fault`).

use std::io;

#[cfg(any(test, feature = "testing"))]
pub mod crash;
#[cfg(any(test, feature = "testing"))]
pub mod fault;
pub mod file;
pub mod layered;
pub mod memory;
pub mod pagecache;
pub mod replicated;
pub mod traits;
pub mod uring;

pub use traits::{BlockBackend, BufResult, Extent64, SpliceSource};

/// One of the backends, chosen at run time.
#[derive(Debug)]
pub enum AnyBackend {
    File(file::FileBackend),
    Uring(uring::UringBackend),
    Memory(memory::MemBackend),
    /// A local backend whose writes also go to replicas on other nodes.
    Replicated(Box<replicated::Replicated<replicated::DynBackend>>),
    #[cfg(any(test, feature = "testing"))]
    Fault(fault::FaultBackend),
}

macro_rules! dispatch {
    ($self:ident, $b:ident => $e:expr) => {
        match $self {
            AnyBackend::File($b) => $e,
            AnyBackend::Uring($b) => $e,
            AnyBackend::Memory($b) => $e,
            AnyBackend::Replicated($b) => $e,
            #[cfg(any(test, feature = "testing"))]
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
