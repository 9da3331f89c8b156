//! Facts about the machine a process runs on, for reports that must say
//! what they measured under: kernel, CPU model and count, memory, the file
//! system and device under a directory, and whether `O_DIRECT` works there.
//!
//! Every service reports these for its data dir and the bench records them
//! for each agent, so a figure is never separated from its conditions.
//! Nothing here fails: an unknown fact is the string `"unknown"`.

use serde::{Deserialize, Serialize};
use std::path::Path;

const UNKNOWN: &str = "unknown";

/// The host: what `uname`, `/proc/cpuinfo` and `/proc/meminfo` say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Host {
    /// Host name (in a container: the container's).
    pub hostname: String,
    /// `uname -srm`, e.g. `Linux 6.1.0-18-amd64 x86_64`.
    pub kernel: String,
    /// The first `model name` of `/proc/cpuinfo`.
    pub cpu_model: String,
    /// CPUs this process may run on (its affinity mask, like `nproc`).
    pub cpus: usize,
    /// `MemTotal` in bytes.
    pub memory_bytes: u64,
}

fn c_str(field: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = field.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Reads the host's facts.
pub fn host() -> Host {
    // SAFETY: utsname is plain old data; zeroed is a valid value, and uname
    // only writes into the struct we pass.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable utsname.
    let ok = unsafe { libc::uname(&mut u) } == 0;
    let (hostname, kernel) = if ok {
        (c_str(&u.nodename), format!("{} {} {}", c_str(&u.sysname), c_str(&u.release), c_str(&u.machine)))
    } else {
        (UNKNOWN.into(), UNKNOWN.into())
    };
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_owned()))
        .unwrap_or_else(|| UNKNOWN.into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_bytes = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024);
    Host {
        hostname,
        kernel,
        cpu_model,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        memory_bytes,
    }
}

/// The file system a directory lives on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsInfo {
    /// The directory asked about.
    pub path: String,
    /// Where that file system is mounted.
    pub mount_point: String,
    /// File system type (`ext4`, `xfs`, `tmpfs`, `overlay`, ...).
    pub fs_type: String,
    /// What is mounted: a device (`/dev/vda`), or a pseudo source (`tmpfs`, `overlay`).
    pub device: String,
}

/// Undoes the octal escapes `/proc/self/mountinfo` uses for spaces and the like.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount (point, type, source) of `path` among `mountinfo` lines: the
/// longest mount point that contains it (the last one wins on a tie, as
/// later mounts hide earlier ones).
pub fn mount_of(mountinfo: &str, path: &Path) -> Option<(String, String, String)> {
    let mut best: Option<(String, String, String)> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let Some(point) = left.split(' ').nth(4).map(unescape) else { continue };
        let mut r = right.split(' ');
        let (Some(fs_type), Some(source)) = (r.next(), r.next()) else { continue };
        if !path.starts_with(&point) {
            continue;
        }
        if best.as_ref().is_none_or(|(p, _, _)| point.len() >= p.len()) {
            best = Some((point, fs_type.to_owned(), unescape(source)));
        }
    }
    best
}

/// The file system under `dir` (resolved through symlinks).
pub fn fs_of(dir: &Path) -> FsInfo {
    let real = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let (mount_point, fs_type, device) =
        mount_of(&mountinfo, &real).unwrap_or_else(|| (UNKNOWN.into(), UNKNOWN.into(), UNKNOWN.into()));
    FsInfo { path: dir.display().to_string(), mount_point, fs_type, device }
}

/// Whether a file in `dir` can be opened with `O_DIRECT` and written with an
/// aligned 4 KiB block (tmpfs and some overlay set-ups refuse). The probe
/// file is removed.
pub fn o_direct_works(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(format!(".o_direct_probe_{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let layout = std::alloc::Layout::from_size_align(4096, 4096).map_err(std::io::Error::other)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(std::io::Error::other("out of memory"));
        }
        // SAFETY: `ptr` points at 4096 initialised (zeroed) bytes we own until dealloc below.
        let buf = unsafe { std::slice::from_raw_parts(ptr, 4096) };
        let r = std::os::unix::fs::FileExt::write_at(&f, buf, 0);
        // SAFETY: allocated above with the same layout, not freed before.
        unsafe { std::alloc::dealloc(ptr, layout) };
        r.map(|_| ())
    })();
    let _ = std::fs::remove_file(&path);
    result.is_ok()
}

/// Now, in UTC, as RFC 3339 / ISO 8601 (`2026-11-25T12:37:12Z`).
pub fn now_iso8601() -> String {
    let now = time::OffsetDateTime::now_utc().replace_nanosecond(0).unwrap_or_else(|_| time::OffsetDateTime::now_utc());
    now.format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| UNKNOWN.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:30 / /tmp rw - tmpfs tmpfs rw
31 27 254:16 / /var/lib/my\\040data rw - xfs /dev/vdb rw
32 27 0:40 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw
";

    #[test]
    fn the_longest_mount_point_that_contains_the_path_wins() {
        let m = |p: &str| mount_of(MOUNTINFO, Path::new(p)).unwrap();
        assert_eq!(m("/var/lib/coronafs"), ("/".into(), "ext4".into(), "/dev/vda".into()));
        assert_eq!(m("/tmp/x"), ("/tmp".into(), "tmpfs".into(), "tmpfs".into()));
        assert_eq!(m("/var/lib/my data/v1"), ("/var/lib/my data".into(), "xfs".into(), "/dev/vdb".into()));
        // A path that merely shares a prefix string is not under the mount.
        assert_eq!(m("/tmpfoo").0, "/");
        assert_eq!(mount_of("garbage\n\n", Path::new("/x")), None);
    }

    #[test]
    fn the_host_and_a_real_directory_are_described() {
        let h = host();
        assert!(h.cpus >= 1);
        assert!(h.kernel.starts_with("Linux "), "{}", h.kernel);
        assert!(h.memory_bytes > 0);
        let dir = tempfile::tempdir().unwrap();
        let fs = fs_of(dir.path());
        assert_ne!(fs.fs_type, UNKNOWN, "{fs:?}");
        assert!(dir.path().starts_with(&fs.mount_point), "{fs:?}");
        // tmpfs refuses O_DIRECT; ext4 and xfs take it.
        match fs.fs_type.as_str() {
            "tmpfs" => assert!(!o_direct_works(dir.path())),
            "ext4" | "xfs" => assert!(o_direct_works(dir.path())),
            _ => {}
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the probe file is removed");
    }

    #[test]
    fn time_is_iso8601_utc() {
        let t = now_iso8601();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T', "{t}");
    }
}
