//! Turning an artifact into guest bytes while it downloads.
//!
//! The artifact is fetched with parallel range GETs in offset order. A raw
//! artifact's chunks go straight to the volume. A qcow2 artifact's chunks land
//! in a scratch file, and a blocking thread runs imago over a [`Streamed`]
//! storage that waits for exactly the chunks each read needs: the conversion
//! trails the download instead of waiting for its end. Either way the result
//! is a stream of [`Piece`]s (data, or a zero range) that [`crate::sink`]
//! writes through NBD.

use crate::error::{PlasmaError, Result};
use crate::probe::{self, ProbeError};
use imago::io_buffers::{IoVector, IoVectorMut};
use imago::qcow2::Qcow2;
use imago::storage::drivers::CommonStorageHelper;
use imago::{DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, Mapping, Storage};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Largest data piece handed to the sink.
pub const PIECE: usize = 4 << 20;
/// How long a reader waits for a chunk before giving up.
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(600);

/// A unit of output: guest bytes at an offset, or a range that reads as zero.
#[derive(Debug)]
pub enum Piece {
    Data { offset: u64, data: bytes::Bytes },
    Zero { offset: u64, len: u64 },
}

/// Which fixed-size chunks of the artifact have arrived.
#[derive(Debug)]
pub struct Arrivals {
    chunk: u64,
    state: Mutex<(Vec<bool>, Option<String>)>,
    cv: Condvar,
}

impl Arrivals {
    pub fn new(len: u64, chunk: u64) -> Self {
        let n = len.div_ceil(chunk) as usize;
        Arrivals { chunk, state: Mutex::new((vec![false; n], None)), cv: Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<bool>, Option<String>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Chunk `i` is on disk.
    pub fn mark(&self, i: usize) {
        if let Some(b) = self.lock().0.get_mut(i) {
            *b = true;
        }
        self.cv.notify_all();
    }

    /// The download failed; wake every reader with the reason.
    pub fn fail(&self, why: String) {
        self.lock().1.get_or_insert(why);
        self.cv.notify_all();
    }

    /// Blocks until bytes `[start, end)` have arrived.
    pub fn wait(&self, start: u64, end: u64) -> std::io::Result<()> {
        let deadline = Instant::now() + ARRIVAL_TIMEOUT;
        let mut g = self.lock();
        loop {
            if let Some(why) = &g.1 {
                return Err(std::io::Error::other(format!("download failed: {why}")));
            }
            let first = (start / self.chunk) as usize;
            let last = (end.saturating_sub(1) / self.chunk) as usize;
            if end <= start
                || g.0.get(first..=last.min(g.0.len().saturating_sub(1))).is_some_and(|r| r.iter().all(|b| *b))
            {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "artifact chunk never arrived"));
            }
            g = self.cv.wait_timeout(g, left).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// An imago storage over a scratch file that is still being downloaded:
/// every read first waits for the chunks it covers. Read-only.
#[derive(Debug)]
pub struct Streamed {
    file: std::fs::File,
    len: u64,
    arrivals: Arc<Arrivals>,
    helper: CommonStorageHelper,
}

impl Streamed {
    pub fn new(file: std::fs::File, len: u64, arrivals: Arc<Arrivals>) -> Self {
        Streamed { file, len, arrivals, helper: CommonStorageHelper::default() }
    }

    /// Reads `buf.len()` bytes at `offset`; bytes past the end read as zero
    /// (what imago expects from a storage).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let end = offset.saturating_add(buf.len() as u64).min(self.len);
        if offset >= self.len {
            buf.fill(0);
            return Ok(());
        }
        self.arrivals.wait(offset, end)?;
        let n = (end - offset) as usize;
        self.file.read_exact_at(&mut buf[..n], offset)?;
        buf[n..].fill(0);
        Ok(())
    }
}

impl std::fmt::Display for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "artifact stream ({} bytes)", self.len)
    }
}

impl Storage for Streamed {
    fn size(&self) -> std::io::Result<u64> {
        Ok(self.len)
    }

    unsafe fn pure_readv(&self, bufv: IoVectorMut<'_>, mut offset: u64) -> std::io::Result<()> {
        for mut slice in bufv.into_inner() {
            self.read_at(&mut slice, offset)?;
            offset += slice.len() as u64;
        }
        Ok(())
    }

    unsafe fn pure_writev(&self, _bufv: IoVector<'_>, _offset: u64) -> std::io::Result<()> {
        Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "artifact storage is read-only"))
    }

    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }

    unsafe fn invalidate_cache(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn get_storage_helper(&self) -> &CommonStorageHelper {
        &self.helper
    }
}

fn corrupt(e: impl std::fmt::Display) -> PlasmaError {
    PlasmaError::Corrupt(e.to_string())
}

/// Checks every L1 entry against the file length before imago follows them.
fn check_l1(storage: &Streamed, head: &[u8], cluster_size: u64) -> Result<()> {
    let Some((l1_off, l1_len)) = probe::l1_location(head) else {
        return Err(corrupt("no qcow2 header"));
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut i = 0u64;
    while i < l1_len {
        let n = ((l1_len - i) as usize * 8).min(buf.len());
        storage.read_at(&mut buf[..n], l1_off + i * 8).map_err(corrupt)?;
        probe::check_l1_entries(&buf[..n], i, cluster_size, storage.len).map_err(PlasmaError::Probe)?;
        i += (n / 8) as u64;
    }
    Ok(())
}

/// Converts a qcow2 artifact to pieces. Blocking: run it off the async
/// threads. `done` counts guest bytes handled.
pub fn qcow2_to_pieces(storage: Streamed, tx: mpsc::Sender<Piece>, done: &AtomicU64) -> Result<()> {
    let mut head = vec![0u8; probe::PROBE_LEN.min(storage.len as usize)];
    storage.read_at(&mut head, 0).map_err(corrupt)?;
    let limits = probe::Limits { max_virtual_size: u64::MAX };
    let found = probe::probe(&head, storage.len, Some(probe::DiskFormat::Qcow2), limits)?;
    check_l1(&storage, &head, found.cluster_size)?;
    let file_len = storage.len;
    let q = Qcow2::<Streamed, FormatAccess<Streamed>>::builder(storage)
        .write(false)
        .open(DenyImplicitOpenGate::default())
        .map_err(corrupt)?;
    let fa = FormatAccess::new(q);
    let size = fa.size();
    if size != found.virtual_size {
        return Err(corrupt(format!("imago reads virtual size {size}, header says {}", found.virtual_size)));
    }
    let send = |p: Piece| tx.blocking_send(p).map_err(|_| PlasmaError::Volume("volume writer stopped".into()));
    let mut off = 0u64;
    while off < size {
        let (kind, len) = {
            let (m, len) = fa.get_mapping(off, size - off).map_err(corrupt)?;
            let len = len.min(size - off);
            let kind = match m {
                // The whole run must be in the file: a run cut short by the
                // end of the file would read its missing part as zeros.
                Mapping::Raw { offset, .. } if offset.checked_add(len).is_none_or(|end| end > file_len) => {
                    return Err(PlasmaError::Probe(ProbeError::PastEnd {
                        what: "data cluster",
                        offset,
                        len,
                        file_len,
                    }));
                }
                Mapping::Raw { .. } | Mapping::Special { .. } => true,
                Mapping::Zero { .. } => false,
                Mapping::Eof { .. } => break,
                _ => return Err(corrupt(format!("unexpected mapping at guest offset {off}"))),
            };
            (kind, len)
        };
        if len == 0 {
            return Err(corrupt(format!("zero-length mapping at guest offset {off}")));
        }
        if kind {
            let mut at = off;
            while at < off + len {
                let n = ((off + len - at) as usize).min(PIECE);
                let mut buf = vec![0u8; n];
                fa.read(&mut buf[..], at).map_err(corrupt)?;
                send(Piece::Data { offset: at, data: buf.into() })?;
                at += n as u64;
                done.fetch_add(n as u64, Ordering::Relaxed);
            }
        } else {
            send(Piece::Zero { offset: off, len })?;
            done.fetch_add(len, Ordering::Relaxed);
        }
        off += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_waits_for_its_chunks_and_sees_failures() {
        let a = Arc::new(Arrivals::new(100, 10));
        let a2 = a.clone();
        let t = std::thread::spawn(move || a2.wait(15, 35));
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "must wait for chunks 1..=3");
        for i in 1..=3 {
            a.mark(i);
        }
        t.join().expect("join").expect("arrived");
        let a2 = a.clone();
        let t = std::thread::spawn(move || a2.wait(90, 100));
        a.fail("boom".into());
        let e = t.join().expect("join").unwrap_err();
        assert!(e.to_string().contains("boom"));
    }
}
