//! The `threads` engine: a sparse file driven by positional syscalls.
//!
//! Reads and plain writes first try `preadv2`/`pwritev2` with `RWF_NOWAIT`
//! right on the async thread: when the pages are cached (the common case for
//! a hot VM disk) that costs one syscall and no thread hand-off. Anything that
//! would block goes to tokio's blocking pool.
//!
//! Some filesystems (ext4) refuse `RWF_NOWAIT` for buffered writes. There a
//! plain write of at most [`INLINE_WRITE_MAX`] is made on the async thread
//! when `cachestat(2)` says every page of its range is cached and none is
//! under writeback, one such write at a time in the process. That check
//! cannot see every wait a `RWF_NOWAIT` write would have refused: a page
//! still being read in (readahead counts as cached), the file's lock held by
//! a blocking-pool call on the same file (a punch or another write), the
//! journal, dirty-memory throttling, a frozen filesystem. So each such write
//! counts the thread's voluntary context switches (`getrusage`): one that
//! slept sends every write of the process to the blocking pool for
//! [`INLINE_BACKOFF`], and only one async thread can be held at a time.
//! Replica appliers take the same path (`try_write_now`).

use super::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use crate::proto::state;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct FileBackend {
    file: Arc<File>,
    size: u64,
    nowait_write: Arc<AtomicBool>,
}

impl FileBackend {
    pub fn new(file: File) -> io::Result<Self> {
        let size = file.metadata()?.len();
        Ok(FileBackend { file: Arc::new(file), size, nowait_write: Arc::new(AtomicBool::new(true)) })
    }

    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    pub(crate) fn nowait_write_supported(&self) -> &AtomicBool {
        &self.nowait_write
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&File) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        let file = self.file.clone();
        match tokio::task::spawn_blocking(move || f(&file)).await {
            Ok(r) => r,
            Err(e) => Err(io::Error::other(format!("I/O worker failed: {e}"))),
        }
    }
}

/// One `preadv2`/`pwritev2` call; `Ok(n)` may be short.
fn rw2(fd: i32, buf: *mut u8, len: usize, offset: u64, flags: i32, write: bool) -> io::Result<usize> {
    let iov = libc::iovec { iov_base: buf.cast(), iov_len: len };
    // SAFETY: `iov` points into a live buffer of `len` bytes owned by the caller
    // for the duration of the call.
    let n = unsafe {
        if write {
            libc::pwritev2(fd, &iov, 1, offset as libc::off_t, flags)
        } else {
            libc::preadv2(fd, &iov, 1, offset as libc::off_t, flags)
        }
    };
    if n < 0 { Err(io::Error::last_os_error()) } else { Ok(n as usize) }
}

fn would_block(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EOPNOTSUPP))
}

/// Reads as much of `buf` as the page cache holds, without blocking.
/// Returns the bytes read (0 when it would block).
pub(crate) fn nowait_read(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    match rw2(file.as_raw_fd(), buf.as_mut_ptr(), buf.len(), offset, libc::RWF_NOWAIT, false) {
        Ok(n) => Ok(n),
        Err(e) if would_block(&e) || e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// Writes as much of `buf` into the page cache as can be done without
/// blocking. Returns the bytes written (0 when it would block); clears
/// `supported` when the filesystem cannot do non-blocking buffered writes.
pub(crate) fn nowait_write(file: &File, buf: &[u8], offset: u64, supported: &AtomicBool) -> io::Result<usize> {
    if !supported.load(Ordering::Relaxed) {
        return Ok(0);
    }
    match rw2(file.as_raw_fd(), buf.as_ptr() as *mut u8, buf.len(), offset, libc::RWF_NOWAIT, true) {
        Ok(n) => Ok(n),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
            supported.store(false, Ordering::Relaxed);
            Ok(0)
        }
        Err(e) if would_block(&e) || e.kind() == io::ErrorKind::Interrupted => Ok(0),
        Err(e) => Err(e),
    }
}

/// Largest write made with a plain `pwrite` on the async thread where the
/// filesystem has no `RWF_NOWAIT` buffered writes (about 100 µs of copying).
const INLINE_WRITE_MAX: usize = 1 << 20;
/// How long a plain write that slept keeps the process's writes off the
/// async threads.
const INLINE_BACKOFF: Duration = Duration::from_secs(1);

/// Who may make a plain write on an async thread: one at a time, and none
/// for [`INLINE_BACKOFF`] after one slept. Times are nanoseconds on the
/// caller's monotonic clock.
#[derive(Debug)]
struct InlineGate {
    busy: AtomicBool,
    off_until: AtomicU64,
}

impl InlineGate {
    const fn new() -> Self {
        InlineGate { busy: AtomicBool::new(false), off_until: AtomicU64::new(0) }
    }

    /// Takes the one slot if no write holds it and no back-off runs.
    fn enter(&self, now: u64) -> bool {
        if now < self.off_until.load(Ordering::Relaxed) {
            return false;
        }
        self.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Gives the slot back; a write that slept starts the back-off.
    fn leave(&self, now: u64, slept: bool) {
        if slept {
            self.off_until.store(now + INLINE_BACKOFF.as_nanos() as u64, Ordering::Relaxed);
        }
        self.busy.store(false, Ordering::Release);
    }
}

static INLINE: InlineGate = InlineGate::new();

fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Voluntary context switches of the calling thread so far (times it slept).
fn voluntary_switches() -> Option<libc::c_long> {
    // SAFETY: `getrusage` fills the zeroed struct it is given and nothing else.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        (libc::getrusage(libc::RUSAGE_THREAD, &mut ru) == 0).then_some(ru.ru_nvcsw)
    }
}

/// Writes all of `buf` at `offset` if that needs no waiting, and says
/// whether it did (a partial write is harmless: the caller writes the whole
/// buffer again). With `RWF_NOWAIT` where the filesystem has it; elsewhere
/// with a plain write of at most [`INLINE_WRITE_MAX`] over a range whose
/// pages are all cached and none under writeback, when [`INLINE`] allows
/// (see the module's notes).
pub(crate) fn write_now(file: &File, buf: &[u8], offset: u64, nowait: &AtomicBool) -> bool {
    if nowait.load(Ordering::Relaxed) {
        let done = matches!(nowait_write(file, buf, offset, nowait), Ok(n) if n == buf.len());
        // Unless the filesystem has just turned out to lack RWF_NOWAIT.
        if done || nowait.load(Ordering::Relaxed) {
            return done;
        }
    }
    if buf.is_empty() || buf.len() > INLINE_WRITE_MAX || !INLINE.enter(now_ns()) {
        return false;
    }
    if !range_cached_clean(file, offset, buf.len() as u64) {
        INLINE.leave(now_ns(), false);
        return false;
    }
    let before = voluntary_switches();
    let written = file.write_all_at(buf, offset).is_ok();
    // Without a count, assume the worst.
    let slept = before.is_none() || voluntary_switches() != before;
    INLINE.leave(now_ns(), slept);
    written
}

/// Reads `buf[done..]` at `offset + done`, blocking; bytes past the end of the
/// file read as zeroes (the file may be shorter than the volume while sparse).
pub(crate) fn read_rest(file: &File, buf: &mut [u8], offset: u64, mut done: usize) -> io::Result<()> {
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` at `offset`, then makes it durable if `fua`.
pub(crate) fn write_all(file: &File, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
    if fua {
        let mut done = 0;
        while done < buf.len() {
            let p = buf[done..].as_ptr() as *mut u8;
            match rw2(file.as_raw_fd(), p, buf.len() - done, offset + done as u64, libc::RWF_DSYNC, true) {
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        return Ok(());
    }
    file.write_all_at(buf, offset)
}

pub(crate) fn fallocate(file: &File, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as libc::off_t, len as libc::off_t) };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// Zeroes a range: by punching a hole or by `FALLOC_FL_ZERO_RANGE`, falling
/// back to writing zero buffers unless only a fast method is allowed.
pub(crate) fn zero_range(file: &File, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let mode = if punch {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    } else {
        libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
    };
    match fallocate(file, mode, offset, len) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) && !fast_only => {
            let zeros = vec![0u8; (len.min(1 << 20)) as usize];
            let mut pos = offset;
            while pos < offset + len {
                let n = (offset + len - pos).min(zeros.len() as u64) as usize;
                file.write_all_at(&zeros[..n], pos)?;
                pos += n as u64;
            }
            Ok(())
        }
        Err(e) => Err(e),
    }
}

pub(crate) fn fdatasync(file: &File) -> io::Result<()> {
    file.sync_data()
}

pub(crate) fn fadvise_willneed(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, libc::POSIX_FADV_WILLNEED)
    };
    if r != 0 { Err(io::Error::from_raw_os_error(r)) } else { Ok(()) }
}

fn lseek(file: &File, pos: u64, whence: i32) -> io::Result<Option<u64>> {
    // SAFETY: plain syscall; the returned offset is only used as a number.
    let r = unsafe { libc::lseek(file.as_raw_fd(), pos as libc::off_t, whence) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) }
    } else {
        Ok(Some(r as u64))
    }
}

/// Whether every page of `[offset, offset+len)` is in the page cache, asked
/// with `cachestat(2)` (Linux 6.5+). Kernels without it answer `false` from
/// then on, so callers fall back to copying reads.
pub(crate) fn range_cached(file: &File, offset: u64, len: u64) -> bool {
    cached_pages(file, offset, len).is_some()
}

/// Whether every page of the range is cached and none is being written
/// back (a write into such a page may have to wait for the disk).
fn range_cached_clean(file: &File, offset: u64, len: u64) -> bool {
    cached_pages(file, offset, len).is_some_and(|st| st.nr_writeback == 0)
}

/// `cachestat(2)` of a non-empty range, when every page of it is cached.
fn cached_pages(file: &File, offset: u64, len: u64) -> Option<super::pagecache::CacheStat> {
    const PAGE: u64 = 4096;
    if len == 0 {
        return None;
    }
    let st = super::pagecache::cachestat(file, offset, len)?;
    let pages = (offset + len).div_ceil(PAGE) - offset / PAGE;
    (st.nr_cache >= pages).then_some(st)
}

/// Allocation map from `SEEK_DATA`/`SEEK_HOLE`. Holes read as zeroes.
pub(crate) fn seek_extents(file: &File, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
    let end = offset + len;
    let file_len = file.metadata()?.len();
    let mut out: Vec<Extent64> = Vec::new();
    let mut pos = offset;
    while pos < end && out.len() < max {
        let (next, flags) = if pos >= file_len {
            (end, state::HOLE | state::ZERO)
        } else {
            match lseek(file, pos, libc::SEEK_DATA) {
                Ok(Some(d)) if d == pos => (lseek(file, pos, libc::SEEK_HOLE)?.unwrap_or(file_len), 0),
                Ok(Some(d)) => (d, state::HOLE | state::ZERO),
                Ok(None) => (end, state::HOLE | state::ZERO),
                // A filesystem without SEEK_DATA: report everything as data.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (end, 0),
                Err(e) => return Err(e),
            }
        };
        let next = next.clamp(pos + 1, end);
        match out.last_mut() {
            Some(last) if last.flags == flags => last.length += next - pos,
            _ => out.push(Extent64 { length: next - pos, flags }),
        }
        pos = next;
    }
    Ok(out)
}

impl BlockBackend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read_at(&self, mut buf: Vec<u8>, offset: u64) -> BufResult {
        let done = match nowait_read(&self.file, &mut buf, offset) {
            Ok(n) if n == buf.len() => return (Ok(()), buf),
            Ok(n) => n,
            Err(e) => return (Err(e), buf),
        };
        let file = self.file.clone();
        match tokio::task::spawn_blocking(move || {
            let r = read_rest(&file, &mut buf, offset, done);
            (r, buf)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => (Err(io::Error::other(format!("I/O worker failed: {e}"))), Vec::new()),
        }
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let mut done = 0;
        if !fua {
            match nowait_write(&self.file, &buf, offset, &self.nowait_write) {
                Ok(n) if n == buf.len() => return (Ok(()), buf),
                Ok(n) => done = n,
                Err(e) => return (Err(e), buf),
            }
        }
        let file = self.file.clone();
        match tokio::task::spawn_blocking(move || {
            let r = write_all(&file, &buf[done..], offset + done as u64, fua);
            (r, buf)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => (Err(io::Error::other(format!("I/O worker failed: {e}"))), Vec::new()),
        }
    }

    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        self.blocking(move |f| zero_range(f, offset, len, punch, fast_only)).await
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.blocking(move |f| match zero_range(f, offset, len, true, true) {
            // Trim is advisory: a filesystem that cannot punch holes just keeps the data.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r,
        })
        .await
    }

    async fn flush(&self) -> io::Result<()> {
        self.blocking(fdatasync).await
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        fadvise_willneed(&self.file, offset, len)
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.blocking(move |f| seek_extents(f, offset, len, max)).await
    }

    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        offset + buf.len() as u64 <= self.size
            && matches!(nowait_read(&self.file, buf, offset), Ok(n) if n == buf.len())
    }

    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        offset + buf.len() as u64 <= self.size && write_now(&self.file, buf, offset, &self.nowait_write)
    }

    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        (offset + len <= self.size && range_cached(&self.file, offset, len))
            .then(|| SpliceSource { file: self.file.clone(), offset })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Retries `f` for up to 10 s: the plain-write path may be busy (another
    /// test's write holds the one slot), backing off (one of them slept), or
    /// the range may be under writeback.
    pub(crate) fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The plain-write fallback (what ext4 gets): only a cached range of
    /// at most `INLINE_WRITE_MAX` is written now; anything else is left
    /// untouched for the blocking pool.
    #[test]
    fn without_nowait_only_cached_ranges_up_to_the_limit_are_written_now() {
        const MIB: usize = 1 << 20;
        let dir = tempfile::tempdir().expect("tempdir");
        let file = File::options().read(true).write(true).create(true).open(dir.path().join("f")).expect("file");
        file.set_len(4 * MIB as u64).expect("size");
        assert!(
            super::super::pagecache::cachestat(&file, 0, 0).is_some(),
            "cachestat(2) is refused (Linux older than 6.5, or a seccomp filter): the plain-write path is off"
        );
        let nowait = AtomicBool::new(false);
        let read = |off: u64, len: usize| {
            let mut b = vec![0xAA; len];
            file.read_exact_at(&mut b, off).expect("read");
            b
        };
        // Nothing of the sparse file is cached yet.
        assert!(!write_now(&file, &[7; 4096], 0, &nowait), "uncached range written now");
        file.write_all_at(&vec![1; 2 * MIB], 0).expect("cache 2 MiB");
        assert!(eventually(|| write_now(&file, &[7; 4096], 4096, &nowait)), "cached 4 KiB");
        assert!(eventually(|| write_now(&file, &vec![8; MIB], MIB as u64, &nowait)), "cached 1 MiB");
        // Over the limit, partly uncached, empty: declined and not written
        // (checked before any read, whose readahead would cache more).
        assert!(!write_now(&file, &vec![9; MIB + 4096], 0, &nowait), "over the limit");
        assert!(!write_now(&file, &[5; 8192], 2 * MIB as u64 - 4096, &nowait), "partly uncached");
        assert!(!write_now(&file, &[], 0, &nowait), "empty");
        assert_eq!(read(4096, 4096), vec![7; 4096]);
        assert_eq!(read(MIB as u64, MIB), vec![8; MIB]);
        assert_eq!(read(0, 4096), vec![1; 4096]);
        assert_eq!(read(2 * MIB as u64 - 4096, 4096), vec![8; 4096]);
        assert_eq!(read(3 * MIB as u64, 4096), vec![0; 4096]);
    }

    #[test]
    fn one_plain_write_at_a_time_and_none_for_the_back_off_after_one_slept() {
        let gate = InlineGate::new();
        let backoff = INLINE_BACKOFF.as_nanos() as u64;
        assert!(gate.enter(100));
        assert!(!gate.enter(100), "a second writer while one holds the slot");
        gate.leave(200, false);
        assert!(gate.enter(300), "the slot is free again");
        gate.leave(400, true);
        assert!(!gate.enter(401), "backing off after a write that slept");
        assert!(!gate.enter(400 + backoff - 1), "still backing off");
        assert!(gate.enter(400 + backoff), "the back-off is over");
        gate.leave(400 + backoff, false);
    }
}
