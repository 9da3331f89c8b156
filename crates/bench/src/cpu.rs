//! CPU placement: how many CPUs this process may use and pinning a thread
//! to some of them. `bench accuracy` pins the target's threads and the two
//! load generators to different CPUs so that both generators meet the same
//! scheduling (on a 2-CPU machine an unpinned QD1 run swings by 5x with
//! where the scheduler happens to put client and server).

use std::io;

/// The CPUs this process may run on, in order.
pub fn allowed() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain old data; zeroed is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to one cpu_set_t of the given size.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &raw mut set) };
    if rc != 0 {
        return vec![0];
    }
    // SAFETY: CPU_ISSET reads the set; i < CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize).filter(|&i| unsafe { libc::CPU_ISSET(i, &set) }).collect()
}

/// Restricts the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &[usize]) -> io::Result<()> {
    pin_thread(0, cpus)
}

/// Restricts every thread of process `pid` to `cpus`: those it has, and (as
/// a thread inherits its creator's mask) those it starts later. A thread
/// that ends between the listing and the call is skipped.
pub fn pin_process(pid: u32, cpus: &[usize]) -> io::Result<()> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Some(tid) = t?.file_name().to_str().and_then(|n| n.parse::<libc::pid_t>().ok()) else { continue };
        match pin_thread(tid, cpus) {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            r => r?,
        }
    }
    Ok(())
}

/// Restricts thread `tid` (0: the calling thread) to `cpus`.
fn pin_thread(tid: libc::pid_t, cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no CPU to pin to"));
    }
    // SAFETY: as above.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {c} out of range")));
        }
        // SAFETY: c < CPU_SETSIZE.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: a valid pointer to one cpu_set_t of the given size.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &raw const set) };
    if rc != 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// A CPU list as `taskset` and fio's `--cpus_allowed` write it: `0,2-3`.
pub fn list(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// Where `bench accuracy` puts the target and the generators: the
/// generators share the last allowed CPU, the target gets the others.
/// `None` with fewer than two CPUs.
pub fn split() -> Option<(Vec<usize>, Vec<usize>)> {
    let mut all = allowed();
    let last = all.pop()?;
    if all.is_empty() {
        return None;
    }
    Some((all, vec![last]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_thread_runs_only_where_it_was_pinned() {
        let all = allowed();
        assert!(!all.is_empty());
        let one = *all.last().unwrap();
        let seen = std::thread::spawn(move || {
            pin_current_thread(&[one]).unwrap();
            allowed()
        })
        .join()
        .unwrap();
        assert_eq!(seen, vec![one]);
        assert!(pin_current_thread(&[]).is_err());
        assert_eq!(list(&[0, 3]), "0,3");
    }
}
