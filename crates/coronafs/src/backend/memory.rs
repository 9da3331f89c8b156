//! An in-memory backend with a 4 KiB allocation map: the reference the
//! other backends are tested against, and a fast device for protocol tests.

use super::traits::{BlockBackend, BufResult, Extent64};
use crate::proto::state;
use std::io;
use std::sync::RwLock;

/// Allocation granularity of the memory backend.
pub const BLOCK: u64 = 4096;

#[derive(Debug)]
pub struct MemBackend {
    inner: RwLock<Inner>,
    size: u64,
}

#[derive(Debug)]
struct Inner {
    data: Vec<u8>,
    allocated: Vec<bool>,
}

impl MemBackend {
    pub fn new(size: u64) -> Self {
        let blocks = size.div_ceil(BLOCK) as usize;
        MemBackend { inner: RwLock::new(Inner { data: vec![0; size as usize], allocated: vec![false; blocks] }), size }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> io::Result<T> {
        let mut g = self.inner.write().map_err(|_| io::Error::other("memory backend lock poisoned"))?;
        Ok(f(&mut g))
    }

    fn check(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

impl Inner {
    fn mark(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in offset / BLOCK..=(offset + len - 1) / BLOCK {
            self.allocated[b as usize] = true;
        }
    }

    /// Zeroes the range and frees whole blocks inside it.
    fn punch(&mut self, offset: u64, len: u64) {
        self.data[offset as usize..(offset + len) as usize].fill(0);
        let first = offset.div_ceil(BLOCK);
        let end = (offset + len) / BLOCK;
        for b in first..end {
            self.allocated[b as usize] = false;
        }
    }
}

impl BlockBackend for MemBackend {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read_at(&self, mut buf: Vec<u8>, offset: u64) -> BufResult {
        let r = self.check(offset, buf.len() as u64).and_then(|()| {
            let g = self.inner.read().map_err(|_| io::Error::other("memory backend lock poisoned"))?;
            let n = buf.len();
            buf.copy_from_slice(&g.data[offset as usize..offset as usize + n]);
            Ok(())
        });
        (r, buf)
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, _fua: bool) -> BufResult {
        let r = self.check(offset, buf.len() as u64).and_then(|()| {
            self.with(|g| {
                g.data[offset as usize..offset as usize + buf.len()].copy_from_slice(&buf);
                g.mark(offset, buf.len() as u64);
            })
        });
        (r, buf)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, _fast_only: bool) -> io::Result<()> {
        self.check(offset, len)?;
        self.with(|g| {
            g.punch(offset, len);
            if !punch {
                g.mark(offset, len);
            }
        })
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        self.with(|g| g.punch(offset, len))
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.check(offset, len)?;
        let g = self.inner.read().map_err(|_| io::Error::other("memory backend lock poisoned"))?;
        let mut out: Vec<Extent64> = Vec::new();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let b = pos / BLOCK;
            let next = ((b + 1) * BLOCK).min(end);
            let flags = if g.allocated[b as usize] { 0 } else { state::HOLE | state::ZERO };
            let full = out.len() == max;
            match out.last_mut() {
                Some(last) if last.flags == flags => last.length += next - pos,
                _ if full => break,
                _ => out.push(Extent64 { length: next - pos, flags }),
            }
            pos = next;
        }
        Ok(out)
    }
}
