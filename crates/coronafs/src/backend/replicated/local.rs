//! [`DynBackend`]: any backend behind a box, for the local copy of a
//! replicated volume. `AnyBackend` holds the replicated backend, which holds
//! an `AnyBackend` again; with the local copy's type named directly, the
//! futures of `AnyBackend` would contain themselves. Boxing one level
//! (one allocation per request of a replicated volume) breaks the cycle.

use crate::backend::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use futures::future::BoxFuture;
use std::io;

/// The dyn-compatible twin of [`BlockBackend`].
pub trait ObjectBackend: Send + Sync + std::fmt::Debug + 'static {
    fn size(&self) -> u64;
    fn read_at(&self, buf: Vec<u8>, offset: u64) -> BoxFuture<'_, BufResult>;
    fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BoxFuture<'_, BufResult>;
    fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> BoxFuture<'_, io::Result<()>>;
    fn trim(&self, offset: u64, len: u64) -> BoxFuture<'_, io::Result<()>>;
    fn flush(&self) -> BoxFuture<'_, io::Result<()>>;
    fn cache(&self, offset: u64, len: u64) -> BoxFuture<'_, io::Result<()>>;
    fn extents(&self, offset: u64, len: u64, max: usize) -> BoxFuture<'_, io::Result<Vec<Extent64>>>;
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool;
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource>;
}

impl<B: BlockBackend + std::fmt::Debug> ObjectBackend for B {
    fn size(&self) -> u64 {
        BlockBackend::size(self)
    }
    fn read_at(&self, buf: Vec<u8>, offset: u64) -> BoxFuture<'_, BufResult> {
        Box::pin(BlockBackend::read_at(self, buf, offset))
    }
    fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BoxFuture<'_, BufResult> {
        Box::pin(BlockBackend::write_at(self, buf, offset, fua))
    }
    fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(BlockBackend::write_zeroes(self, offset, len, punch, fast_only))
    }
    fn trim(&self, offset: u64, len: u64) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(BlockBackend::trim(self, offset, len))
    }
    fn flush(&self) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(BlockBackend::flush(self))
    }
    fn cache(&self, offset: u64, len: u64) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(BlockBackend::cache(self, offset, len))
    }
    fn extents(&self, offset: u64, len: u64, max: usize) -> BoxFuture<'_, io::Result<Vec<Extent64>>> {
        Box::pin(BlockBackend::extents(self, offset, len, max))
    }
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        BlockBackend::try_read_now(self, buf, offset)
    }
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        BlockBackend::splice_source(self, offset, len)
    }
}

/// Any backend, boxed (see the module doc).
#[derive(Debug)]
pub struct DynBackend(pub Box<dyn ObjectBackend>);

impl DynBackend {
    pub fn new(b: impl BlockBackend + std::fmt::Debug) -> Self {
        DynBackend(Box::new(b))
    }
}

impl BlockBackend for DynBackend {
    fn size(&self) -> u64 {
        self.0.size()
    }
    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        self.0.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        self.0.write_at(buf, offset, fua).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        self.0.write_zeroes(offset, len, punch, fast_only).await
    }
    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.0.trim(offset, len).await
    }
    async fn flush(&self) -> io::Result<()> {
        self.0.flush().await
    }
    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.0.cache(offset, len).await
    }
    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.0.extents(offset, len, max).await
    }
    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        self.0.try_read_now(buf, offset)
    }
    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        self.0.splice_source(offset, len)
    }
}
