//! Linux native asynchronous I/O (`io_setup`, `io_submit`, `io_getevents`):
//! the kernel interface fio's `libaio` engine drives. The file engine uses it
//! so that one job is one thread keeping `iodepth` requests in flight, as a
//! fio job is, instead of one thread per request slot (which, on a busy
//! machine, gets a job more CPU share than fio's single thread gets).
//!
//! Only the raw system calls and the kernel's structures live here; the loop
//! that drives them is in `loadgen`. On a buffered file the kernel performs
//! the request inside `io_submit` (as it does for fio's libaio), so there the
//! depth is effectively one; with `O_DIRECT` the requests really overlap.

use std::io;
use std::time::Duration;

/// `IOCB_CMD_PREAD`.
pub const CMD_PREAD: u16 = 0;
/// `IOCB_CMD_PWRITE`.
pub const CMD_PWRITE: u16 = 1;

/// `struct iocb` of `<linux/aio_abi.h>` (little-endian field order).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Iocb {
    pub data: u64,
    pub key: u32,
    pub rw_flags: u32,
    pub opcode: u16,
    pub reqprio: i16,
    pub fildes: u32,
    pub buf: u64,
    pub nbytes: u64,
    pub offset: i64,
    pub reserved2: u64,
    pub flags: u32,
    pub resfd: u32,
}

/// `struct io_event`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IoEvent {
    /// The `data` of the completed [`Iocb`].
    pub data: u64,
    pub obj: u64,
    /// Bytes transferred, or a negated errno.
    pub res: i64,
    pub res2: i64,
}

const _: () = assert!(std::mem::size_of::<Iocb>() == 64 && std::mem::size_of::<IoEvent>() == 32);
#[cfg(not(target_endian = "little"))]
compile_error!("Iocb's field order is that of little-endian machines");

/// One AIO context; destroying it cancels and waits for what is in flight.
#[derive(Debug)]
pub struct Context {
    id: libc::c_ulong,
}

impl Context {
    /// A context for up to `depth` requests in flight. Fails with the
    /// kernel's error where AIO is unavailable (ENOSYS, or EPERM under a
    /// seccomp profile that refuses it).
    pub fn new(depth: u32) -> io::Result<Context> {
        let mut id: libc::c_ulong = 0;
        // SAFETY: io_setup writes one aio_context_t to the valid pointer.
        let rc = unsafe { libc::syscall(libc::SYS_io_setup, depth as libc::c_long, &raw mut id) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Context { id })
    }

    /// Submits the requests; returns how many the kernel took (the rest
    /// must be submitted again, e.g. after EAGAIN).
    ///
    /// # Safety
    /// Every buffer an iocb names must stay valid, and not be touched by the
    /// caller, until its completion is reaped or the context is dropped.
    pub unsafe fn submit(&self, iocbs: &mut [*mut Iocb]) -> io::Result<usize> {
        if iocbs.is_empty() {
            return Ok(0);
        }
        // SAFETY: the pointers are valid iocbs (the caller's contract) and
        // the array holds `len` of them.
        let rc =
            unsafe { libc::syscall(libc::SYS_io_submit, self.id, iocbs.len() as libc::c_long, iocbs.as_mut_ptr()) };
        if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(rc as usize) }
    }

    /// Waits for at least `min` completions (or `timeout`), filling `out`.
    pub fn reap(&self, min: usize, out: &mut [IoEvent], timeout: Duration) -> io::Result<usize> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        loop {
            // SAFETY: `out` has room for `out.len()` events; ts is valid.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_io_getevents,
                    self.id,
                    min.min(out.len()) as libc::c_long,
                    out.len() as libc::c_long,
                    out.as_mut_ptr(),
                    &raw const ts,
                )
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the id came from io_setup; io_destroy waits for requests in flight.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.id) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::AlignedBuf;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn writes_and_reads_complete_with_their_data() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).open(d.path().join("f")).unwrap();
        let ctx = Context::new(4).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..4).map(|_| AlignedBuf::new(4096).unwrap()).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            b.as_mut().fill(i as u8 + 1);
        }
        let mut cbs: Vec<Iocb> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| Iocb {
                data: i as u64,
                opcode: CMD_PWRITE,
                fildes: f.as_raw_fd() as u32,
                buf: b.as_ref().as_ptr() as u64,
                nbytes: 4096,
                offset: i as i64 * 4096,
                ..Iocb::default()
            })
            .collect();
        let mut ptrs: Vec<*mut Iocb> = cbs.iter_mut().map(|c| c as *mut Iocb).collect();
        // SAFETY: the buffers outlive the context's requests (reaped below).
        assert_eq!(unsafe { ctx.submit(&mut ptrs) }.unwrap(), 4);
        let mut ev = [IoEvent::default(); 4];
        let mut done = 0;
        while done < 4 {
            let n = ctx.reap(1, &mut ev, Duration::from_secs(5)).unwrap();
            assert!(n > 0, "no completion within 5 s");
            for e in &ev[..n] {
                assert_eq!(e.res, 4096, "request {}", e.data);
            }
            done += n;
        }
        let mut b = vec![0u8; 4096];
        f.read_exact_at(&mut b, 2 * 4096).unwrap();
        assert!(b.iter().all(|&x| x == 3));
        // A read past the end completes with 0 bytes, an error is a negated errno.
        let mut rb = AlignedBuf::new(4096).unwrap();
        let mut cb = Iocb {
            opcode: CMD_PREAD,
            fildes: u32::MAX,
            buf: rb.as_mut().as_mut_ptr() as u64,
            nbytes: 4096,
            ..Iocb::default()
        };
        let mut p = [&raw mut cb];
        // SAFETY: rb outlives the request.
        let r = unsafe { ctx.submit(&mut p) };
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EBADF));
    }
}
