//! What the page cache holds of a file, and dropping it from there.
//!
//! The server asks `cachestat(2)` (Linux 6.5+) whether a READ can be
//! answered with `sendfile` from cached pages ([`super::file::range_cached`]),
//! and the control API's evict call measures a volume's files before and
//! after it drops them. Where `cachestat` is missing, residency is counted
//! with `mincore(2)` over a read-only mapping of the file instead.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once `cachestat` has been refused (old kernel, seccomp).
static NO_CACHESTAT: AtomicBool = AtomicBool::new(false);

/// The counters `cachestat(2)` fills in, in pages.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CacheStat {
    pub nr_cache: u64,
    pub nr_dirty: u64,
    pub nr_writeback: u64,
    pub nr_evicted: u64,
    pub nr_recently_evicted: u64,
}

/// `cachestat(2)` over `[offset, offset + len)`; `len == 0` means up to the
/// end of the file. `None` when the kernel lacks the call (remembered) or
/// refuses it for this file.
pub(crate) fn cachestat(file: &File, offset: u64, len: u64) -> Option<CacheStat> {
    const SYS_CACHESTAT: libc::c_long = 451;
    if NO_CACHESTAT.load(Ordering::Relaxed) {
        return None;
    }
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    let range = Range { off: offset, len };
    let mut st = CacheStat::default();
    // SAFETY: both structs match the kernel ABI and outlive the call.
    let r =
        unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &range as *const Range, &mut st as *mut CacheStat, 0) };
    if r < 0 {
        if matches!(io::Error::last_os_error().raw_os_error(), Some(libc::ENOSYS) | Some(libc::EPERM)) {
            NO_CACHESTAT.store(true, Ordering::Relaxed);
        }
        return None;
    }
    Some(st)
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

/// Bytes of `file` in the page cache (whole pages, so a partly cached
/// last page counts as a page).
pub fn resident_bytes(file: &File) -> io::Result<u64> {
    match cachestat(file, 0, 0) {
        Some(st) => Ok(st.nr_cache * page_size()),
        None => resident_bytes_mincore(file),
    }
}

/// Mapping size per `mincore` call: bounds the residency vector (64 KiB of
/// it per GiB) whatever the file's size.
const MINCORE_CHUNK: u64 = 1 << 30;

/// [`resident_bytes`] by `mincore(2)` over a read-only shared mapping of
/// the file, one chunk at a time. Mapping reads nothing in and touches no
/// page, so the measurement does not change what it measures.
pub fn resident_bytes_mincore(file: &File) -> io::Result<u64> {
    let len = file.metadata()?.len();
    let page = page_size();
    let mut resident = 0u64;
    let mut off = 0u64;
    let mut vec: Vec<u8> = Vec::new();
    while off < len {
        let n = (len - off).min(MINCORE_CHUNK);
        let pages = n.div_ceil(page) as usize;
        vec.clear();
        vec.resize(pages, 0);
        // SAFETY: a fresh read-only mapping of an fd we hold; the kernel
        // picks the address. It is unmapped below and never dereferenced.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                off as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `addr..addr+n` is the mapping made above, and `vec` has
        // one byte per page of it.
        let r = unsafe { libc::mincore(addr, n as usize, vec.as_mut_ptr()) };
        let err = (r < 0).then(io::Error::last_os_error);
        // SAFETY: unmaps exactly the mapping made above.
        unsafe { libc::munmap(addr, n as usize) };
        if let Some(e) = err {
            return Err(e);
        }
        resident += vec.iter().filter(|&&b| b & 1 != 0).count() as u64 * page;
        off += n;
    }
    Ok(resident)
}

/// Drops `file`'s pages from the page cache: `fdatasync` first, because
/// `POSIX_FADV_DONTNEED` skips dirty pages and pages under writeback, then
/// the advice over the whole file.
pub fn evict(file: &File) -> io::Result<()> {
    file.sync_data()?;
    // SAFETY: plain syscall on an fd we hold.
    let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 { Err(io::Error::from_raw_os_error(r)) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_written_file_is_resident_until_evicted_and_both_counts_agree() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("f");
        let mut f = std::fs::OpenOptions::new().create(true).read(true).write(true).open(&path).expect("open");
        f.write_all(&vec![7u8; 4 << 20]).expect("write");
        let fs = hostinfo::fs_of(dir.path()).fs_type;
        let before = resident_bytes(&f).expect("resident");
        assert_eq!(before, resident_bytes_mincore(&f).expect("mincore"), "cachestat and mincore disagree");
        if fs == "tmpfs" {
            // tmpfs pages are the file itself: nothing to drop.
            return;
        }
        assert!(before >= 4 << 20, "{before} bytes resident right after writing 4 MiB (dirty pages count)");
        evict(&f).expect("evict");
        let after = resident_bytes(&f).expect("resident");
        assert_eq!(after, resident_bytes_mincore(&f).expect("mincore"));
        assert!(after <= 64 << 10, "{after} bytes still resident after eviction on {fs}");
        let empty = std::fs::File::create(dir.path().join("empty")).expect("create");
        assert_eq!(resident_bytes_mincore(&empty).expect("mincore of an empty file"), 0);
    }
}
