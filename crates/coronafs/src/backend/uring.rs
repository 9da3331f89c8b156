//! The `uring` engine: reads, writes and syncs go through io_uring on one
//! dedicated thread running a tokio-uring runtime.
//!
//! The NBD server runs on tokio's multi-threaded runtime. Reads and plain
//! writes first try the page cache inline with `RWF_NOWAIT` (one syscall, no
//! thread hop: the 4 KiB QD1 latency would otherwise double); whatever would
//! block is sent to the ring thread with its owned buffer and comes back
//! through a oneshot channel. Metadata operations (hole punching, SEEK_DATA) reuse the
//! `threads` engine's code on the same open file.
//!
//! [`UringEngine::start`] fails (and the caller falls back to `threads`) when
//! `io_uring_setup` is refused, as under Docker's default seccomp profile.

use super::file::{self, FileBackend};
use super::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use std::collections::HashMap;
use std::io;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{mpsc, oneshot};
use tokio_uring::buf::BoundedBuf;

enum Job {
    Open {
        id: u64,
        file: std::fs::File,
    },
    Close {
        id: u64,
    },
    /// Read into `buf[start..]` from `offset + start`.
    Read {
        id: u64,
        buf: Vec<u8>,
        offset: u64,
        start: usize,
        tx: oneshot::Sender<BufResult>,
    },
    /// Write `buf[start..]` at `offset + start`.
    Write {
        id: u64,
        buf: Vec<u8>,
        offset: u64,
        start: usize,
        fua: bool,
        tx: oneshot::Sender<BufResult>,
    },
    Flush {
        id: u64,
        tx: oneshot::Sender<io::Result<()>>,
    },
}

/// Handle to the ring thread. Cloning is cheap; the thread ends when the last
/// handle and the last volume opened through it are dropped.
#[derive(Debug, Clone)]
pub struct UringEngine {
    tx: mpsc::UnboundedSender<Job>,
    next_id: Arc<AtomicU64>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Job")
    }
}

impl UringEngine {
    /// Starts the ring thread, or reports why io_uring cannot be used.
    pub fn start() -> io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new().name("coronafs-uring".into()).spawn(move || {
            let mut builder = tokio_uring::builder();
            builder.entries(512);
            match tokio_uring::Runtime::new(&builder) {
                Ok(rt) => {
                    let _ = ready_tx.send(Ok(()));
                    rt.block_on(run(rx));
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(UringEngine { tx, next_id: Arc::new(AtomicU64::new(1)) }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::other("io_uring thread exited during start-up")),
        }
    }

    fn send(&self, job: Job) -> io::Result<()> {
        self.tx.send(job).map_err(|_| io::Error::other("io_uring thread has stopped"))
    }
}

async fn run(mut rx: mpsc::UnboundedReceiver<Job>) {
    let mut files: HashMap<u64, Rc<tokio_uring::fs::File>> = HashMap::new();
    while let Some(job) = rx.recv().await {
        match job {
            Job::Open { id, file } => {
                files.insert(id, Rc::new(tokio_uring::fs::File::from_std(file)));
            }
            Job::Close { id } => {
                files.remove(&id);
            }
            Job::Read { id, buf, offset, start, tx } => match files.get(&id).cloned() {
                Some(f) => {
                    tokio_uring::spawn(async move {
                        let _ = tx.send(read_full(&f, buf, offset, start).await);
                    });
                }
                None => {
                    let _ = tx.send((Err(closed()), buf));
                }
            },
            Job::Write { id, buf, offset, start, fua, tx } => match files.get(&id).cloned() {
                Some(f) => {
                    tokio_uring::spawn(async move {
                        let len = buf.len();
                        let (r, s) = f.write_all_at(buf.slice(start..len), offset + start as u64).await;
                        let r = match r {
                            Ok(()) if fua => f.sync_data().await,
                            r => r,
                        };
                        let _ = tx.send((r, s.into_inner()));
                    });
                }
                None => {
                    let _ = tx.send((Err(closed()), buf));
                }
            },
            Job::Flush { id, tx } => match files.get(&id).cloned() {
                Some(f) => {
                    tokio_uring::spawn(async move {
                        let _ = tx.send(f.sync_data().await);
                    });
                }
                None => {
                    let _ = tx.send(Err(closed()));
                }
            },
        }
    }
}

fn closed() -> io::Error {
    io::Error::other("volume is closed")
}

async fn read_full(f: &tokio_uring::fs::File, mut buf: Vec<u8>, offset: u64, start: usize) -> BufResult {
    let len = buf.len();
    let mut done = start;
    while done < len {
        let (r, s) = f.read_at(buf.slice(done..len), offset + done as u64).await;
        buf = s.into_inner();
        match r {
            Ok(0) => {
                // Past the end of a short sparse file: zeroes.
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// A file-backed volume whose data path runs on the ring thread.
#[derive(Debug)]
pub struct UringBackend {
    engine: UringEngine,
    id: u64,
    meta: FileBackend,
}

impl UringBackend {
    pub fn new(engine: UringEngine, meta: FileBackend) -> io::Result<Self> {
        let id = engine.next_id.fetch_add(1, Ordering::Relaxed);
        engine.send(Job::Open { id, file: meta.file().try_clone()? })?;
        Ok(UringBackend { engine, id, meta })
    }

    async fn data_op(&self, make: impl FnOnce(oneshot::Sender<BufResult>) -> Job) -> BufResult {
        let (tx, rx) = oneshot::channel();
        if let Err(e) = self.engine.send(make(tx)) {
            return (Err(e), Vec::new());
        }
        rx.await.unwrap_or_else(|_| (Err(io::Error::other("io_uring thread dropped a request")), Vec::new()))
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        let _ = self.engine.send(Job::Close { id: self.id });
    }
}

impl BlockBackend for UringBackend {
    fn size(&self) -> u64 {
        self.meta.size()
    }

    async fn read_at(&self, mut buf: Vec<u8>, offset: u64) -> BufResult {
        let start = match file::nowait_read(self.meta.file(), &mut buf, offset) {
            Ok(n) if n == buf.len() => return (Ok(()), buf),
            Ok(n) => n,
            Err(e) => return (Err(e), buf),
        };
        self.data_op(|tx| Job::Read { id: self.id, buf, offset, start, tx }).await
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let mut start = 0;
        if !fua {
            match file::nowait_write(self.meta.file(), &buf, offset, self.meta.nowait_write_supported()) {
                Ok(n) if n == buf.len() => return (Ok(()), buf),
                Ok(n) => start = n,
                Err(e) => return (Err(e), buf),
            }
        }
        self.data_op(|tx| Job::Write { id: self.id, buf, offset, start, fua, tx }).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        self.meta.write_zeroes(offset, len, punch, fast_only).await
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.meta.trim(offset, len).await
    }

    async fn flush(&self) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.engine.send(Job::Flush { id: self.id, tx })?;
        rx.await.unwrap_or_else(|_| Err(io::Error::other("io_uring thread dropped a request")))
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.meta.cache(offset, len).await
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.meta.extents(offset, len, max).await
    }

    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        self.meta.try_read_now(buf, offset)
    }

    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        self.meta.try_write_now(buf, offset)
    }

    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        self.meta.splice_source(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{IoEngine, Opener};

    /// Installs a seccomp filter on the calling thread (inherited by threads it
    /// spawns) that makes `io_uring_setup` fail with EPERM, as Docker's default
    /// profile does.
    fn deny_io_uring_on_this_thread() {
        const IO_URING_SETUP: u32 = 425; // same number on x86_64 and aarch64
        let filter = [
            // A = seccomp_data.nr
            libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 },
            // if A == io_uring_setup: next, else skip one
            libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: IO_URING_SETUP },
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 },
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 },
        ];
        let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut _ };
        // SAFETY: prctl with a valid, live BPF program; it only restricts this thread.
        unsafe {
            assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
            assert_eq!(libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const _), 0);
        }
    }

    #[test]
    fn uring_falls_back_to_threads_when_seccomp_refuses_io_uring() {
        let engine = std::thread::spawn(|| {
            deny_io_uring_on_this_thread();
            assert!(UringEngine::start().is_err(), "io_uring_setup should be refused under the filter");
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let opener = Opener::start(IoEngine::Uring);
                let dir = tempfile::tempdir().expect("tempdir");
                let f = tempfile::tempfile_in(dir.path()).expect("file");
                f.set_len(1 << 20).expect("set_len");
                let b = opener.open(f).expect("open");
                let (r, _) = b.write_at(vec![7; 4096], 8192, true).await;
                r.expect("write through the fallback engine");
                let (r, buf) = b.read_at(vec![0; 4096], 8192).await;
                r.expect("read");
                assert!(buf.iter().all(|&x| x == 7));
                opener.engine()
            })
        })
        .join()
        .expect("thread");
        assert_eq!(engine, IoEngine::Threads);
    }
}
