//! A backend that wraps [`MemBackend`] and injects delays and errors on
//! chosen operations and ranges, so tests can make requests finish out of
//! order or fail with a given errno, deterministically.

use super::memory::MemBackend;
use super::traits::{BlockBackend, BufResult, Extent64};
use std::io;
use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

/// Which operations a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Flush,
    Any,
}

/// What happens to a matching operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Sleep before doing the operation.
    Delay(Duration),
    /// Fail with this host errno without doing it.
    Fail(i32),
}

#[derive(Debug, Clone)]
pub struct FaultRule {
    pub op: FaultOp,
    /// Byte range the operation must overlap (ignored for flush).
    pub range: Range<u64>,
    pub action: FaultAction,
}

#[derive(Debug)]
pub struct FaultBackend {
    inner: MemBackend,
    rules: Mutex<Vec<FaultRule>>,
}

impl FaultBackend {
    pub fn new(size: u64, rules: Vec<FaultRule>) -> Self {
        FaultBackend { inner: MemBackend::new(size), rules: Mutex::new(rules) }
    }

    /// Replaces the rules.
    pub fn set_rules(&self, rules: Vec<FaultRule>) {
        if let Ok(mut r) = self.rules.lock() {
            *r = rules;
        }
    }

    async fn apply(&self, op: FaultOp, offset: u64, len: u64) -> io::Result<()> {
        let action = self.rules.lock().ok().and_then(|rules| {
            rules
                .iter()
                .find(|r| {
                    (r.op == op || r.op == FaultOp::Any)
                        && (op == FaultOp::Flush || (offset < r.range.end && offset + len.max(1) > r.range.start))
                })
                .map(|r| r.action)
        });
        match action {
            Some(FaultAction::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            Some(FaultAction::Fail(errno)) => Err(io::Error::from_raw_os_error(errno)),
            None => Ok(()),
        }
    }
}

impl BlockBackend for FaultBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        if let Err(e) = self.apply(FaultOp::Read, offset, buf.len() as u64).await {
            return (Err(e), buf);
        }
        self.inner.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        if let Err(e) = self.apply(FaultOp::Write, offset, buf.len() as u64).await {
            return (Err(e), buf);
        }
        self.inner.write_at(buf, offset, fua).await
    }
    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        self.apply(FaultOp::Write, offset, len).await?;
        self.inner.write_zeroes(offset, len, punch, fast_only).await
    }
    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.apply(FaultOp::Write, offset, len).await?;
        self.inner.trim(offset, len).await
    }
    async fn flush(&self) -> io::Result<()> {
        self.apply(FaultOp::Flush, 0, 0).await?;
        self.inner.flush().await
    }
    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.cache(offset, len).await
    }
    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.inner.extents(offset, len, max).await
    }
}
