//! The block device trait every engine implements, apart from the engines
//! (as TiKV keeps `engine_traits` apart from its engines): the engines
//! import it from here, and `backend/mod.rs` above them chooses one.

use std::fs::File;
use std::future::Future;
use std::io;
use std::sync::Arc;

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

/// A shared backend is one: a replicated volume's primary keeps its local
/// copy shared, so that a snapshot can swap that copy's head.
impl<B: BlockBackend> BlockBackend for Arc<B> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn read_at(&self, buf: Vec<u8>, offset: u64) -> impl Future<Output = BufResult> + Send {
        (**self).read_at(buf, offset)
    }
    fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> impl Future<Output = BufResult> + Send {
        (**self).write_at(buf, offset, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        punch: bool,
        fast_only: bool,
    ) -> impl Future<Output = io::Result<()>> + Send {
        (**self).write_zeroes(offset, len, punch, fast_only)
    }
    fn trim(&self, offset: u64, len: u64) -> impl Future<Output = io::Result<()>> + Send {
        (**self).trim(offset, len)
    }
    fn flush(&self) -> impl Future<Output = io::Result<()>> + Send {
        (**self).flush()
    }
    fn cache(&self, offset: u64, len: u64) -> impl Future<Output = io::Result<()>> + Send {
        (**self).cache(offset, len)
    }
    fn extents(&self, offset: u64, len: u64, max: usize) -> impl Future<Output = io::Result<Vec<Extent64>>> + Send {
        (**self).extents(offset, len, max)
    }
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        (**self).try_read_now(buf, offset)
    }
    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        (**self).try_write_now(buf, offset)
    }
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        (**self).splice_source(offset, len)
    }
}
