//! A crash-injecting backend: every device keeps a "live" image (what reads
//! see) and a "durable" image (what survives a crash). `flush` and FUA
//! writes copy live to durable. A [`CrashClock`] shared by several devices
//! counts syncs across all of them and, at a chosen one, "pulls the plug":
//! that sync is lost, and every device applies a random subset of its
//! unsynced writes, page by page, to its durable image (the page cache
//! writing back on its own, including torn multi-page writes). After that
//! every call fails with EIO, and tests reopen from [`CrashBackend::durable`].

use super::traits::{BlockBackend, BufResult, Extent64};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Page size for torn writes.
const PAGE: u64 = 4096;

/// Counts syncs over a group of devices and decides when the crash happens.
#[derive(Debug)]
pub struct CrashClock {
    syncs: AtomicU64,
    crash_at: u64,
    crashed: AtomicBool,
    seed: AtomicU64,
    devices: Mutex<Vec<Arc<Mutex<Images>>>>,
}

#[derive(Debug)]
struct Images {
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Unsynced writes: offset and length.
    pending: Vec<(u64, u64)>,
}

impl CrashClock {
    /// A clock that crashes at sync number `crash_at` (0-based), with `seed`
    /// choosing which unsynced pages reach the disk.
    pub fn new(crash_at: u64, seed: u64) -> Arc<Self> {
        Arc::new(CrashClock {
            syncs: AtomicU64::new(0),
            crash_at,
            crashed: AtomicBool::new(false),
            seed: AtomicU64::new(seed | 1),
            devices: Mutex::new(Vec::new()),
        })
    }

    pub fn crashed(&self) -> bool {
        self.crashed.load(Ordering::Acquire)
    }

    /// Syncs done so far.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Acquire)
    }

    fn rand(&self) -> u64 {
        let mut x = self.seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.store(x, Ordering::Relaxed);
        x
    }

    /// Pulls the plug now (if not already): random writeback, then freeze.
    pub fn crash(&self) {
        if self.crashed.swap(true, Ordering::AcqRel) {
            return;
        }
        let devices = self.devices.lock().map(|d| d.clone()).unwrap_or_default();
        for d in devices {
            let Ok(mut img) = d.lock() else { continue };
            let pending = std::mem::take(&mut img.pending);
            for (off, len) in pending {
                let mut p = off;
                while p < off + len {
                    let end = ((p / PAGE + 1) * PAGE).min(off + len);
                    if self.rand().is_multiple_of(2) {
                        let (a, b) = (p as usize, end as usize);
                        let src = img.live[a..b].to_vec();
                        img.durable[a..b].copy_from_slice(&src);
                    }
                    p = end;
                }
            }
        }
    }

    /// Counts one sync; false if the plug is pulled at (or before) it.
    fn sync(&self) -> bool {
        if self.crashed() {
            return false;
        }
        if self.syncs.fetch_add(1, Ordering::AcqRel) == self.crash_at {
            self.crash();
            return false;
        }
        true
    }
}

/// One device on a [`CrashClock`].
#[derive(Debug)]
pub struct CrashBackend {
    img: Arc<Mutex<Images>>,
    clock: Arc<CrashClock>,
    size: u64,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl CrashBackend {
    /// A device whose live and durable images start as `image`.
    pub fn new(clock: &Arc<CrashClock>, image: Vec<u8>) -> Self {
        let size = image.len() as u64;
        let img = Arc::new(Mutex::new(Images { live: image.clone(), durable: image, pending: Vec::new() }));
        if let Ok(mut d) = clock.devices.lock() {
            d.push(img.clone());
        }
        CrashBackend { img, clock: clock.clone(), size }
    }

    /// What survived (call after the crash).
    pub fn durable(&self) -> Vec<u8> {
        self.img.lock().map(|i| i.durable.clone()).unwrap_or_default()
    }

    fn with<T>(&self, off: u64, len: u64, f: impl FnOnce(&mut Images) -> T) -> io::Result<T> {
        if self.clock.crashed() {
            return Err(eio());
        }
        if off.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut g = self.img.lock().map_err(|_| eio())?;
        Ok(f(&mut g))
    }

    fn sync(&self) -> io::Result<()> {
        // Hold the image lock so a crash on another device cannot interleave.
        if !self.clock.sync() {
            return Err(eio());
        }
        let mut g = self.img.lock().map_err(|_| eio())?;
        let Images { live, durable, pending } = &mut *g;
        for (off, len) in pending.drain(..) {
            let r = off as usize..(off + len) as usize;
            durable[r.clone()].copy_from_slice(&live[r]);
        }
        Ok(())
    }

    fn put(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.with(off, data.len() as u64, |img| {
            img.live[off as usize..off as usize + data.len()].copy_from_slice(data);
            img.pending.push((off, data.len() as u64));
        })
    }
}

impl BlockBackend for CrashBackend {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read_at(&self, mut buf: Vec<u8>, offset: u64) -> BufResult {
        let n = buf.len();
        let r = self.with(offset, n as u64, |img| buf.copy_from_slice(&img.live[offset as usize..offset as usize + n]));
        (r, buf)
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let mut r = self.put(offset, &buf);
        if r.is_ok() && fua {
            r = self.sync();
        }
        (r, buf)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, _punch: bool, _fast_only: bool) -> io::Result<()> {
        self.put(offset, &vec![0; len as usize])
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.put(offset, &vec![0; len as usize])
    }

    async fn flush(&self) -> io::Result<()> {
        self.sync()
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.with(offset, len, |_| ())
    }

    /// Everything is reported as data: the crash tests check contents.
    async fn extents(&self, offset: u64, len: u64, _max: usize) -> io::Result<Vec<Extent64>> {
        self.with(offset, len, |_| vec![Extent64 { length: len, flags: 0 }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_crash_keeps_synced_writes_and_freezes_the_device() {
        let clock = CrashClock::new(1, 42);
        let d = CrashBackend::new(&clock, vec![0; 64 << 10]);
        d.write_at(vec![1; 4096], 0, false).await.0.expect("write");
        d.flush().await.expect("first sync happens");
        d.write_at(vec![2; 8192], 4096, false).await.0.expect("write");
        assert!(d.flush().await.is_err(), "the second sync is the crash");
        assert!(d.read_at(vec![0; 1], 0).await.0.is_err(), "frozen after the crash");
        let img = d.durable();
        assert!(img[..4096].iter().all(|&b| b == 1), "synced data survives");
        for page in img[4096..12288].chunks(4096) {
            assert!(page.iter().all(|&b| b == 2) || page.iter().all(|&b| b == 0), "a page is old or new");
        }
    }
}
