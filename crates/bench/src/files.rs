//! File targets: a regular file, a block device or a directory (one file
//! per job, like fio's `--directory`), opened with `O_DIRECT` when the job
//! asks for direct I/O, with page-aligned buffers.
//!
//! Some filesystems (tmpfs, some FUSE mounts) refuse `O_DIRECT`; the run
//! then goes on buffered and says so once, since its figures then include
//! the page cache.

use crate::job::Job;
use anyhow::{Context, bail};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Alignment of every buffer (covers 512 and 4096-byte logical blocks).
pub const ALIGN: usize = 4096;

/// A heap buffer aligned to [`ALIGN`], as `O_DIRECT` requires.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> anyhow::Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), ALIGN)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).context("out of memory for an I/O buffer")?;
        Ok(AlignedBuf { ptr, len })
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len.max(1), ALIGN) {
            // SAFETY: allocated in `new` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// Reads exactly `buf.len()` bytes at `off`.
pub fn pread_full(f: &File, buf: &mut [u8], off: u64) -> anyhow::Result<()> {
    f.read_exact_at(buf, off).with_context(|| format!("read of {} bytes at {off}", buf.len()))
}

/// Writes all of `buf` at `off`.
pub fn pwrite_full(f: &File, buf: &[u8], off: u64) -> anyhow::Result<()> {
    f.write_all_at(buf, off).with_context(|| format!("write of {} bytes at {off}", buf.len()))
}

/// One open file for one job.
#[derive(Debug)]
pub struct Handle {
    pub file: File,
    pub size: u64,
}

/// A path target.
#[derive(Debug, Clone)]
pub struct FileTarget {
    path: PathBuf,
    dir: bool,
    /// Files this run created in a directory target, removed at cleanup.
    created: Arc<Mutex<Vec<PathBuf>>>,
    /// Paths already reported as refusing O_DIRECT.
    warned: Arc<Mutex<Vec<PathBuf>>>,
}

impl FileTarget {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let dir = match std::fs::metadata(path) {
            Ok(m) => m.is_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
                if !parent.is_dir() {
                    bail!("{}: neither it nor its directory exists", path.display());
                }
                false
            }
            Err(e) => return Err(e).with_context(|| path.display().to_string()),
        };
        Ok(FileTarget { path: path.to_owned(), dir, created: Arc::default(), warned: Arc::default() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens (and lays out, where needed) the file of each job.
    pub fn prepare(&self, job: &Job) -> anyhow::Result<Vec<Handle>> {
        let mut v = Vec::new();
        for j in 0..job.numjobs {
            let path = if self.dir { self.path.join(format!("bench.{}.{j}", job.name)) } else { self.path.clone() };
            v.push(self.prepare_one(&path, job)?);
        }
        Ok(v)
    }

    fn prepare_one(&self, path: &Path, job: &Job) -> anyhow::Result<Handle> {
        let existed = path.exists();
        let block_dev = std::fs::metadata(path).map(|m| m.file_type().is_block_device()).unwrap_or(false);
        if !block_dev {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .with_context(|| path.display().to_string())?;
            if !existed && self.dir {
                self.created.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push(path.to_owned());
            }
            let len = f.metadata()?.len();
            if len < job.size {
                // Like fio: lay the file out with real data so reads are not of holes.
                lay_out(&f, len, job.size).with_context(|| format!("laying out {}", path.display()))?;
            }
        }
        let file = self.open_rw(path, job.direct)?;
        let size = file.metadata()?.len();
        let size = if block_dev { device_size(&file)? } else { size };
        Ok(Handle { file, size })
    }

    fn open_rw(&self, path: &Path, direct: bool) -> anyhow::Result<File> {
        let open = |flags: i32| OpenOptions::new().read(true).write(true).custom_flags(flags).open(path);
        if !direct {
            return open(0).with_context(|| path.display().to_string());
        }
        match open(libc::O_DIRECT) {
            Ok(f) => Ok(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let mut warned = self.warned.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                if !warned.iter().any(|p| p == path) {
                    eprintln!(
                        "bench: {}: the filesystem refuses O_DIRECT (EINVAL); running buffered, \
                         so the figures include the page cache",
                        path.display()
                    );
                    warned.push(path.to_owned());
                }
                open(0).with_context(|| path.display().to_string())
            }
            Err(e) => Err(e).with_context(|| path.display().to_string()),
        }
    }

    /// Whether a file of this target refused `O_DIRECT`, so a job asked to
    /// bypass the page cache ran buffered.
    pub fn direct_refused(&self) -> bool {
        self.warned.lock().map(|w| !w.is_empty()).unwrap_or(false)
    }

    /// Removes the job files this run created in a directory target.
    pub fn cleanup(&self) {
        if let Ok(mut v) = self.created.lock() {
            for p in v.drain(..) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

fn lay_out(f: &File, from: u64, to: u64) -> anyhow::Result<()> {
    let mut chunk = vec![0u8; 1 << 20];
    crate::loadgen::fill(&mut chunk, from ^ 0x5EED);
    let mut off = from;
    while off < to {
        let n = (to - off).min(chunk.len() as u64) as usize;
        chunk[..8].copy_from_slice(&off.to_le_bytes());
        f.write_all_at(&chunk[..n], off)?;
        off += n as u64;
    }
    f.sync_all()?;
    Ok(())
}

fn device_size(f: &File) -> anyhow::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut f = f;
    Ok(f.seek(SeekFrom::End(0))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::parse_profile;

    fn job(text: &str) -> Job {
        parse_profile("t", &format!("[[job]]\nname = \"j\"\n{text}")).unwrap().jobs.remove(0)
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        for len in [512, 4096, 65536, 1 << 20] {
            let b = AlignedBuf::new(len).unwrap();
            assert_eq!(b.as_ref().as_ptr() as usize % ALIGN, 0);
            assert_eq!(b.as_ref().len(), len);
        }
    }

    #[test]
    fn a_directory_gets_one_laid_out_file_per_job_and_cleanup_removes_them() {
        let d = tempfile::tempdir().unwrap();
        let t = FileTarget::open(d.path()).unwrap();
        let j = job("rw = \"randread\"\nsize = \"1M\"\nnumjobs = 3\ndirect = false");
        let hs = t.prepare(&j).unwrap();
        assert_eq!(hs.len(), 3);
        for h in &hs {
            assert_eq!(h.size, 1 << 20);
            let mut b = vec![0u8; 4096];
            pread_full(&h.file, &mut b, 4096).unwrap();
            assert!(b.iter().any(|&x| x != 0), "laid out with data, not zeroes");
        }
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 3);
        t.cleanup();
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_missing_parent_directory_is_a_clear_error() {
        let e = FileTarget::open(Path::new("/nonexistent-dir-xyz/file")).unwrap_err();
        assert!(e.to_string().contains("neither it nor its directory exists"), "{e}");
    }
}
