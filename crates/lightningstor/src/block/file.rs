//! Blocks as files: `blocks/<first byte in hex>/<hash in hex>`.
//!
//! A block is written to `blocks/tmp/`, and it is renamed into place and
//! remembered as *unsynced*. Where the filesystem takes `O_DIRECT` (probed
//! when the store opens), a durable store writes block files with it, from
//! an aligned buffer: the bytes go to the device in the write itself,
//! without the page cache's allocation, writeback and reclaim, which on a
//! virtual disk cost several times the copy (a replicated cluster writes
//! every block three times). Elsewhere the write is buffered and its
//! writeback is started at once (`sync_file_range`). The next
//! [`BlockStore::flush`] — which the metadata layer calls before it commits
//! any row — `fdatasync`s every unsynced block and then the
//! shard directories. Data therefore reaches the disk in the background while
//! the upload goes on, and the one journal commit at flush covers every
//! rename of the batch instead of one commit per block.
//!
//! A crash before the flush can leave a block file that is incomplete; no
//! committed row can reference it (commits happen after the flush), so the
//! startup garbage collection deletes it. A block found already present by a
//! later upload (deduplication) is either durable or still on the unsynced
//! list, so that upload's flush makes it durable too.

use super::{BlockHash, BlockStore};
use crate::error::{LightningError, Result};
use bytes::Bytes;
use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, IoSlice, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// A [`BlockStore`] on the local filesystem.
#[derive(Debug)]
pub struct FileBlockStore {
    root: PathBuf,
    tmp: PathBuf,
    fsync: bool,
    /// Shard directories with renames or unlinks not yet fsynced.
    dirty: Mutex<BTreeSet<u8>>,
    /// Block files renamed into place whose data is not yet fsynced.
    unsynced: Mutex<Vec<PathBuf>>,
    /// Emptied files in `tmp/` kept for reuse: creating an inode per block
    /// costs ext4 an inode-table scan that reusing one avoids.
    free: Mutex<Vec<PathBuf>>,
    seq: AtomicU64,
    /// Block files are written with `O_DIRECT`.
    direct: AtomicBool,
    /// A direct write was refused after the probe said yes (then `direct`
    /// went false).
    fell_back: AtomicBool,
}

/// Emptied block files kept for reuse.
const FREE_POOL: usize = 256;

/// Buffer address and length alignment `O_DIRECT` needs (the logical block
/// size of any disk we meet is at most this).
const ALIGN: usize = 4096;

thread_local! {
    /// Each blocking-pool thread's aligned staging buffer for direct writes.
    static DIRECT_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How block files are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// `O_DIRECT` when the store is durable and the filesystem takes it.
    Auto,
    /// Through the page cache, always.
    Buffered,
}

impl FileBlockStore {
    /// Opens (creating if needed) a store under `root`, clearing stale temp files.
    pub fn open(root: &Path, fsync: bool) -> Result<Self> {
        Self::open_with(root, fsync, WriteMode::Auto)
    }

    /// [`FileBlockStore::open`] with the write path chosen.
    pub fn open_with(root: &Path, fsync: bool, mode: WriteMode) -> Result<Self> {
        let tmp = root.join("tmp");
        fs::create_dir_all(&tmp)?;
        for entry in fs::read_dir(&tmp)? {
            let entry = entry?;
            let _ = fs::remove_file(entry.path());
        }
        for shard in 0..=255u8 {
            fs::create_dir_all(root.join(format!("{shard:02x}")))?;
        }
        if fsync {
            File::open(root)?.sync_all()?;
        }
        let direct = fsync && mode == WriteMode::Auto && direct_io_works(&tmp);
        tracing::debug!(root = %root.display(), direct, "block store opened");
        Ok(FileBlockStore {
            root: root.to_owned(),
            tmp,
            fsync,
            dirty: Mutex::new(BTreeSet::new()),
            unsynced: Mutex::new(Vec::new()),
            free: Mutex::new(Vec::new()),
            seq: AtomicU64::new(0),
            direct: AtomicBool::new(direct),
            fell_back: AtomicBool::new(false),
        })
    }

    /// Whether block files are written with `O_DIRECT`.
    pub fn writes_direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    fn options(&self) -> OpenOptions {
        let mut o = OpenOptions::new();
        o.write(true);
        if self.writes_direct() {
            o.custom_flags(libc::O_DIRECT);
        }
        o
    }

    fn path(&self, hash: &BlockHash) -> PathBuf {
        let hex = hash.to_hex();
        self.root.join(&hex[..2]).join(hex)
    }

    /// A file in `tmp/` to write a block into: a recycled one if any.
    fn temp_file(&self) -> std::io::Result<(PathBuf, File)> {
        let recycled = self.free.lock().ok().and_then(|mut f| f.pop());
        if let Some(p) = recycled
            && let Ok(f) = self.options().truncate(true).open(&p)
        {
            return Ok((p, f));
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let p = self.tmp.join(format!("b.{seq}"));
        let f = self.options().create_new(true).open(&p)?;
        Ok((p, f))
    }

    /// Moves a block file to the free pool (emptied), if the pool has room.
    fn recycle(&self, path: &Path) -> std::io::Result<bool> {
        let room = self.free.lock().map(|f| f.len() < FREE_POOL).unwrap_or(false);
        if !room {
            return Ok(false);
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let dst = self.tmp.join(format!("b.{seq}"));
        fs::rename(path, &dst)?;
        OpenOptions::new().write(true).open(&dst)?.set_len(0)?;
        if let Ok(mut f) = self.free.lock() {
            f.push(dst);
        }
        Ok(true)
    }

    fn mark_dirty(&self, hash: &BlockHash) {
        if let Ok(mut d) = self.dirty.lock() {
            d.insert(hash.0[0]);
        }
    }
}

impl BlockStore for FileBlockStore {
    fn direct_io(&self) -> super::DirectIo {
        super::DirectIo { o_direct: self.writes_direct(), o_direct_fell_back: self.fell_back.load(Ordering::Relaxed) }
    }

    fn put_parts(&self, hash: &BlockHash, parts: &[Bytes]) -> Result<()> {
        let path = self.path(hash);
        if path.exists() {
            return Ok(());
        }
        let (tmp, mut f) = self.temp_file()?;
        let res = (|| {
            let written = match self.writes_direct().then(|| write_direct(&mut f, parts)) {
                Some(Ok(())) => true,
                // Refused after all (a file moved to another mount?):
                // buffered from now on.
                Some(Err(e)) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(error = %e, "O_DIRECT block write refused; writing through the page cache");
                    self.direct.store(false, Ordering::Relaxed);
                    self.fell_back.store(true, Ordering::Relaxed);
                    f = OpenOptions::new().write(true).truncate(true).open(&tmp)?;
                    false
                }
                Some(Err(e)) => return Err(e),
                None => false,
            };
            if !written {
                write_all_parts(&mut f, parts)?;
                if self.fsync {
                    start_writeback(&f);
                }
            }
            if self.fsync {
                // Listed before it becomes visible under its final name, so a
                // flush after any upload that finds it will sync it.
                if let Ok(mut u) = self.unsynced.lock() {
                    u.push(path.clone());
                }
            }
            fs::rename(&tmp, &path)
        })();
        if let Err(e) = res {
            let _ = fs::remove_file(&tmp);
            return Err(e.into());
        }
        self.mark_dirty(hash);
        Ok(())
    }

    fn read_raw(&self, hash: &BlockHash) -> Result<Vec<u8>> {
        match fs::read(self.path(hash)) {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == ErrorKind::NotFound => Err(LightningError::MissingBlock { hash: hash.to_hex() }),
            Err(e) => Err(e.into()),
        }
    }

    fn delete(&self, hash: &BlockHash) -> Result<()> {
        // No directory fsync for deletes: a block that reappears after a
        // crash is unreferenced and collected at startup.
        let path = self.path(hash);
        match self.recycle(&path) {
            Ok(true) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Ok(false) | Err(_) => {}
        }
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn contains(&self, hash: &BlockHash) -> Result<bool> {
        Ok(self.path(hash).exists())
    }

    fn list(&self) -> Result<Vec<BlockHash>> {
        let mut out = Vec::new();
        for shard in 0..=255u8 {
            for entry in fs::read_dir(self.root.join(format!("{shard:02x}")))? {
                let entry = entry?;
                if let Some(h) = entry.file_name().to_str().and_then(BlockHash::from_hex) {
                    out.push(h);
                }
            }
        }
        Ok(out)
    }

    fn flush(&self) -> Result<()> {
        if !self.fsync {
            return Ok(());
        }
        let files = match self.unsynced.lock() {
            Ok(mut u) => std::mem::take(&mut *u),
            Err(_) => Vec::new(),
        };
        for (i, path) in files.iter().enumerate() {
            let r = match File::open(path) {
                Ok(f) => f.sync_data(),
                // Deleted since (unreferenced): nothing to make durable.
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                if let Ok(mut u) = self.unsynced.lock() {
                    u.extend_from_slice(&files[i..]);
                }
                return Err(e.into());
            }
        }
        let shards = match self.dirty.lock() {
            Ok(mut d) => std::mem::take(&mut *d),
            Err(_) => (0..=255u8).collect(),
        };
        for shard in shards {
            let dir = self.root.join(format!("{shard:02x}"));
            if let Err(e) = File::open(&dir).and_then(|f| f.sync_all()) {
                // Keep it dirty so the next flush retries.
                self.mark_dirty(&BlockHash([shard; 32]));
                return Err(e.into());
            }
        }
        Ok(())
    }
}

/// `write_all` for several buffers, one `writev` at a time.
fn write_all_parts(f: &mut File, parts: &[Bytes]) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    let mut bufs = slices.as_mut_slice();
    while !bufs.is_empty() {
        match f.write_vectored(bufs) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `parts` to the start of `f` (opened with `O_DIRECT`) through this
/// thread's aligned buffer, padded to [`ALIGN`] and then cut to length.
fn write_direct(f: &mut File, parts: &[Bytes]) -> std::io::Result<()> {
    let len: usize = parts.iter().map(Bytes::len).sum();
    let padded = len.next_multiple_of(ALIGN);
    DIRECT_BUF.with(|cell| {
        let mut v = cell.borrow_mut();
        if v.len() < padded + ALIGN {
            v.resize(padded + ALIGN, 0);
        }
        let off = v.as_ptr().align_offset(ALIGN);
        let buf = &mut v[off..off + padded];
        let mut at = 0;
        for p in parts {
            buf[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        buf[len..].fill(0);
        let mut done = 0;
        while done < padded {
            // A short direct write ends on a sector boundary; go on from it.
            match f.write_at(&buf[done..], done as u64) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) if n % ALIGN != 0 && done + n < padded => {
                    return Err(std::io::Error::other("a direct write stopped off a sector boundary"));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })?;
    if padded != len {
        f.set_len(len as u64)?;
    }
    Ok(())
}

/// Whether a file in `dir` can be written with `O_DIRECT` (tmpfs on older
/// kernels, and some network and FUSE filesystems, refuse it).
fn direct_io_works(dir: &Path) -> bool {
    let probe = dir.join("direct-probe");
    let r = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .and_then(|mut f| write_direct(&mut f, &[Bytes::from_static(&[0x5a; 100])]));
    let _ = fs::remove_file(&probe);
    r.is_ok()
}

/// Asks the kernel to start writing `f` back now, without waiting.
fn start_writeback(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is valid for the duration of the call; the
    // syscall only schedules writeback of the file's dirty pages.
    let _ = unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_store_passes_the_block_store_suite_in_both_write_modes() {
        for mode in [WriteMode::Auto, WriteMode::Buffered] {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = FileBlockStore::open_with(dir.path(), true, mode).expect("open");
            super::super::suite::run(&store);
        }
    }

    #[test]
    fn direct_writes_are_used_where_the_filesystem_takes_them_and_keep_odd_lengths() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileBlockStore::open(dir.path(), true).expect("open");
        // The CI machine's disk takes O_DIRECT; the buffered path is the
        // fallback for filesystems that do not.
        assert!(store.writes_direct(), "O_DIRECT refused on {}", dir.path().display());
        assert!(!FileBlockStore::open_with(dir.path(), true, WriteMode::Buffered).expect("open").writes_direct());
        assert!(!FileBlockStore::open(dir.path(), false).expect("open").writes_direct(), "only durable stores");
        for len in [1, 4095, 4096, 4097, 1 << 20, (1 << 20) + 3] {
            let parts: Vec<Bytes> =
                (0..3u8).map(|i| Bytes::from(vec![i.wrapping_mul(37); len / 3 + usize::from(i)])).collect();
            let h = BlockHash::of_parts(&parts);
            store.put_parts(&h, &parts).expect("put");
            store.flush().expect("flush");
            assert_eq!(
                fs::metadata(store.path(&h)).expect("stat").len() as usize,
                parts.iter().map(Bytes::len).sum::<usize>()
            );
            assert_eq!(store.get(&h).expect("get").as_ref(), parts.concat().as_slice());
        }
        let mode = store.direct_io();
        assert!(mode.o_direct && !mode.o_direct_fell_back, "{mode:?}");
    }

    #[test]
    fn a_flipped_bit_on_disk_is_detected_on_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileBlockStore::open(dir.path(), false).expect("open");
        let data = vec![7u8; 5000];
        let h = BlockHash::of(&data);
        store.put(&h, &data).expect("put");
        let path = store.path(&h);
        let mut raw = fs::read(&path).expect("read");
        raw[100] ^= 1;
        fs::write(&path, raw).expect("write");
        assert!(matches!(store.get(&h), Err(LightningError::CorruptBlock { .. })));
    }

    #[test]
    fn blocks_written_in_parts_read_back_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileBlockStore::open(dir.path(), true).expect("open");
        let parts: Vec<Bytes> =
            (0..300u32).map(|i| Bytes::from(vec![(i % 251) as u8; 1 + (i as usize % 17)])).collect();
        let h = BlockHash::of_parts(&parts);
        store.put_parts(&h, &parts).expect("put");
        store.flush().expect("flush");
        assert_eq!(store.get(&h).expect("get").as_ref(), parts.concat().as_slice());
    }

    #[test]
    fn deleted_block_files_are_recycled_for_new_blocks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FileBlockStore::open(dir.path(), true).expect("open");
        let a = vec![1u8; 10_000];
        let ha = BlockHash::of(&a);
        store.put(&ha, &a).expect("put");
        store.delete(&ha).expect("delete");
        assert!(!store.contains(&ha).expect("contains"));
        assert_eq!(store.free.lock().expect("lock").len(), 1);
        let b = vec![2u8; 500];
        let hb = BlockHash::of(&b);
        store.put(&hb, &b).expect("put reuses the file");
        assert!(store.free.lock().expect("lock").is_empty());
        store.flush().expect("flush");
        assert_eq!(store.get(&hb).expect("get").as_ref(), b.as_slice());
        assert_eq!(store.list().expect("list"), vec![hb]);
    }

    #[test]
    fn stale_temp_files_are_removed_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        drop(FileBlockStore::open(dir.path(), false).expect("open"));
        fs::write(dir.path().join("tmp").join("half-written"), b"xx").expect("write");
        let _store = FileBlockStore::open(dir.path(), false).expect("reopen");
        assert_eq!(fs::read_dir(dir.path().join("tmp")).expect("ls").count(), 0);
    }
}
