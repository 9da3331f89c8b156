//! A reference Ceph on this machine: the seeds' own system (seeds 001 and
//! 002 measure Ceph RBD with fio), stood up from Debian's packages to be
//! measured beside CoronaFS and LightningStor in the same run.
//!
//! `bench peers ceph up` writes a minimal `ceph.conf` (cephx, one monitor on
//! 127.0.0.1, small memory targets, `osd_crush_chooseleaf_type = 0` so that
//! three OSDs on one host hold three copies), creates the monitor, a
//! manager, `--osds` BlueStore OSDs on files of `--osd-size`, the pools
//! `rbd` (size 3) and `rbd1` (size 1), a radosgw with a user, and waits for
//! HEALTH_OK with every placement group active+clean. Everything lives under
//! one directory; the daemons write pid files there, and `down` stops
//! exactly those daemons and removes the directory. Nothing is installed:
//! a missing tool is named with the package that ships it.

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The Debian packages a Ceph peer needs.
pub const PACKAGES: &str = "ceph-mon ceph-osd ceph-mgr radosgw ceph-common";

/// Tool -> the Debian package that ships it.
const TOOLS: [(&str, &str); 9] = [
    ("ceph-mon", "ceph-mon"),
    ("ceph-osd", "ceph-osd"),
    ("ceph-mgr", "ceph-mgr"),
    ("radosgw", "radosgw"),
    ("radosgw-admin", "radosgw"),
    ("ceph", "ceph-common"),
    ("rbd", "ceph-common"),
    ("ceph-authtool", "ceph-common"),
    ("monmaptool", "ceph-common"),
];

/// The file that marks a directory as one `up` made (and `down` may remove).
const STATE: &str = "bench-ceph.json";

/// The pool of three copies and the pool of one.
pub const POOL_REPLICATED: &str = "rbd";
pub const POOL_SINGLE: &str = "rbd1";

/// What `up` asks for.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub dir: PathBuf,
    pub osds: u32,
    /// Bytes of each OSD's block file (sparse).
    pub osd_size: u64,
    /// How long to wait for HEALTH_OK.
    pub timeout: Duration,
}

/// A running Ceph made by `up`, as recorded in its directory.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ceph {
    pub dir: PathBuf,
    /// `ceph.conf` (for `CEPH_CONF`, fio's rbd engine and `rbd://...?conf=`).
    pub conf: PathBuf,
    /// `ceph --version`.
    pub version: String,
    pub osds: u32,
    pub osd_size: u64,
    /// The monitor's messenger v2 address.
    pub mon: String,
    /// radosgw's S3 endpoint, `http://127.0.0.1:PORT`.
    pub rgw: String,
    pub access_key: String,
    pub secret_key: String,
    /// (pool, copies).
    pub pools: Vec<(String, u32)>,
    /// The settings a report should name.
    pub settings: Vec<String>,
}

impl Ceph {
    /// One line for a report.
    pub fn describe(&self) -> String {
        format!(
            "{} on this host: 1 mon, 1 mgr, {} BlueStore OSDs on {} GiB files in {}, radosgw at {}; pools {}; {}",
            self.version,
            self.osds,
            self.osd_size >> 30,
            self.dir.display(),
            self.rgw,
            self.pools.iter().map(|(p, n)| format!("{p} (size {n})")).collect::<Vec<_>>().join(", "),
            self.settings.join(", ")
        )
    }
}

/// The tools that are not installed, each with its package.
pub fn missing_tools() -> Vec<(&'static str, &'static str)> {
    TOOLS.iter().copied().filter(|(t, _)| which(t).is_none()).collect()
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(tool)).find(|f| f.is_file()))
}

/// Fails with the packages to install when a tool is missing.
pub fn check_tools() -> anyhow::Result<()> {
    let missing = missing_tools();
    if missing.is_empty() {
        return Ok(());
    }
    let mut pkgs: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    pkgs.sort_unstable();
    pkgs.dedup();
    bail!(
        "Ceph is not installed here: {} missing; install the Debian packages with \
         `apt-get install {}` (all of them: {PACKAGES})",
        missing.iter().map(|(t, _)| *t).collect::<Vec<_>>().join(", "),
        pkgs.join(" ")
    )
}

/// Where `up` puts the cluster unless told otherwise.
pub fn default_dir() -> PathBuf {
    std::env::temp_dir().join("bench-ceph")
}

/// Runs `cmd`, waiting at most `timeout`; its stdout, or an error with its
/// stderr.
fn run(cmd: &mut Command, timeout: Duration) -> anyhow::Result<String> {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{what} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn random_hex(bytes: usize) -> anyhow::Result<String> {
    let mut b = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn uuid() -> anyhow::Result<String> {
    let h = random_hex(16)?;
    Ok(format!("{}-{}-4{}-8{}-{}", &h[0..8], &h[8..12], &h[13..16], &h[17..20], &h[20..32]))
}

/// `ceph.conf` for a one-host cluster under `dir`.
fn conf_text(dir: &Path, fsid: &str, mon_v2: u16, mon_v1: u16, rgw: u16) -> String {
    let d = dir.display();
    format!(
        "# Written by `bench peers ceph up`: a one-host reference Ceph for the bench.
[global]
fsid = {fsid}
mon_host = [v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]
mon_initial_members = a
auth_cluster_required = cephx
auth_service_required = cephx
auth_client_required = cephx
keyring = {d}/admin.keyring
run_dir = {d}/run
pid_file = {d}/run/$name.pid
admin_socket = {d}/run/$name.asok
log_file = {d}/log/$name.log
public_addr = 127.0.0.1
ms_bind_ipv4 = true
ms_bind_ipv6 = false
# three OSDs on one host hold three copies
osd_crush_chooseleaf_type = 0
osd_pool_default_size = 3
osd_pool_default_min_size = 2
osd_pool_default_pg_autoscale_mode = off
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
[mon]
keyring = {d}/mon.keyring
mon_data = {d}/mon/$id
mon_data_avail_warn = 1
mon_warn_on_insecure_global_id_reclaim_allowed = false
mon_warn_on_pool_no_redundancy = false
[mgr]
keyring = {d}/mgr/$id/keyring
mgr_data = {d}/mgr/$id
[osd]
keyring = {d}/osd/$id/keyring
osd_data = {d}/osd/$id
osd_objectstore = bluestore
bluestore_block_path = {d}/blocks/osd.$id
bluestore_block_create = true
# small memory targets: the smallest osd_memory_target Ceph takes, a fixed cache
osd_memory_target = 939524096
bluestore_cache_autotune = false
bluestore_cache_size = 134217728
[client.rgw.a]
keyring = {d}/rgw/keyring
rgw_data = {d}/rgw
rgw_frontends = beast endpoint=127.0.0.1:{rgw}
"
    )
}

/// The settings of [`conf_text`] a report should name.
fn settings() -> Vec<String> {
    [
        "cephx",
        "osd_crush_chooseleaf_type 0 (copies on OSDs of one host)",
        "osd_memory_target 896 MiB",
        "bluestore_cache_size 128 MiB (autotune off)",
        "pg autoscale off, 32 PGs per pool",
        "radosgw beast frontend",
    ]
    .map(String::from)
    .to_vec()
}

/// Stands a cluster up under `o.dir` (which must not hold one already).
/// On an error, or when `stop` is set between steps, everything started
/// so far is stopped and the directory removed.
pub fn up(o: &UpOptions, stop: &AtomicBool, progress: &dyn Fn(&str)) -> anyhow::Result<Ceph> {
    check_tools()?;
    anyhow::ensure!((1..=8).contains(&o.osds), "--osds must be 1..=8");
    anyhow::ensure!(o.osd_size >= 2 << 30, "--osd-size must be at least 2G (BlueStore's metadata needs room)");
    if o.dir.join(STATE).exists() {
        bail!("{} already holds a Ceph made by `bench peers ceph up`; `bench peers ceph down` first", o.dir.display());
    }
    if o.dir.exists() && std::fs::read_dir(&o.dir)?.next().is_some() {
        bail!("{} exists and is not empty; give another --dir", o.dir.display());
    }
    std::fs::create_dir_all(&o.dir).with_context(|| o.dir.display().to_string())?;
    let dir = o.dir.canonicalize()?;
    // The marker first: from here on `down` may clean this directory.
    std::fs::write(dir.join(STATE), b"{}")?;
    match build(o, &dir, stop, progress) {
        Ok(c) => Ok(c),
        Err(e) => {
            progress("stopping what was started and removing the directory");
            if let Err(d) = down(&dir) {
                tracing::warn!(error = %d, "cleaning up after a failed `up`");
            }
            Err(e)
        }
    }
}

fn build(o: &UpOptions, dir: &Path, stop: &AtomicBool, progress: &dyn Fn(&str)) -> anyhow::Result<Ceph> {
    let step = |what: &str| -> anyhow::Result<()> {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        progress(what);
        Ok(())
    };
    let t = Duration::from_secs(60);
    for sub in ["run", "log", "mon/a", "mgr/x", "rgw", "blocks"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let ports = crate::ports::free_loopback_addrs(3)?;
    let [mon_v2, mon_v1, rgw_port] = [ports[0].port(), ports[1].port(), ports[2].port()];
    let fsid = uuid()?;
    let conf = dir.join("ceph.conf");
    std::fs::write(&conf, conf_text(dir, &fsid, mon_v2, mon_v1, rgw_port))?;
    let c = conf.to_str().context("the directory's path is not UTF-8")?.to_owned();
    let ceph = |args: &[&str]| -> anyhow::Result<String> {
        run(Command::new("ceph").args(["-c", &c, "--connect-timeout", "20"]).args(args), t)
    };
    let version = run(Command::new("ceph").arg("--version"), t)?.trim().to_owned();

    step("monitor: keys, monmap, mkfs, start")?;
    let mon_kr = dir.join("mon.keyring");
    let admin_kr = dir.join("admin.keyring");
    run(
        Command::new("ceph-authtool").arg("--create-keyring").arg(&mon_kr).args([
            "--gen-key",
            "-n",
            "mon.",
            "--cap",
            "mon",
            "allow *",
        ]),
        t,
    )?;
    run(
        Command::new("ceph-authtool").arg("--create-keyring").arg(&admin_kr).args([
            "--gen-key",
            "-n",
            "client.admin",
            "--cap",
            "mon",
            "allow *",
            "--cap",
            "osd",
            "allow *",
            "--cap",
            "mgr",
            "allow *",
            "--cap",
            "mds",
            "allow *",
        ]),
        t,
    )?;
    run(Command::new("ceph-authtool").arg(&mon_kr).arg("--import-keyring").arg(&admin_kr), t)?;
    let monmap = dir.join("monmap");
    run(
        Command::new("monmaptool")
            .args(["--create", "--addv", "a", &format!("[v2:127.0.0.1:{mon_v2},v1:127.0.0.1:{mon_v1}]")])
            .args(["--fsid", &fsid])
            .arg(&monmap),
        t,
    )?;
    run(
        Command::new("ceph-mon")
            .args(["-c", &c, "--mkfs", "-i", "a", "--monmap"])
            .arg(&monmap)
            .arg("--keyring")
            .arg(&mon_kr),
        t,
    )?;
    run(Command::new("ceph-mon").args(["-c", &c, "-i", "a"]), t)?;
    ceph(&["mon", "stat"]).context("the monitor does not answer")?;

    step("manager")?;
    let mgr_key =
        ceph(&["auth", "get-or-create", "mgr.x", "mon", "allow profile mgr", "osd", "allow *", "mds", "allow *"])?;
    std::fs::write(dir.join("mgr/x/keyring"), mgr_key)?;
    run(Command::new("ceph-mgr").args(["-c", &c, "-i", "x"]), t)?;

    for n in 0..o.osds {
        step(&format!("OSD {} of {}: BlueStore on a {} GiB file", n + 1, o.osds, o.osd_size >> 30))?;
        let id_uuid = uuid()?;
        let id = ceph(&["osd", "new", &id_uuid])?.trim().to_owned();
        id.parse::<u32>().with_context(|| format!("`ceph osd new` answered {id:?}"))?;
        let osd_dir = dir.join("osd").join(&id);
        std::fs::create_dir_all(&osd_dir)?;
        let key = ceph(&[
            "auth",
            "get-or-create",
            &format!("osd.{id}"),
            "mon",
            "allow profile osd",
            "mgr",
            "allow profile osd",
            "osd",
            "allow *",
        ])?;
        std::fs::write(osd_dir.join("keyring"), key)?;
        run(
            Command::new("ceph-osd")
                .args(["-c", &c, "-i", &id, "--mkfs", "--osd-uuid", &id_uuid])
                .arg(format!("--bluestore_block_size={}", o.osd_size)),
            Duration::from_secs(120),
        )?;
        run(Command::new("ceph-osd").args(["-c", &c, "-i", &id]), t)?;
    }

    step("pools: rbd (size 3) and rbd1 (size 1)")?;
    let size3 = o.osds.min(3);
    for (pool, size) in [(POOL_REPLICATED, size3), (POOL_SINGLE, 1)] {
        ceph(&["osd", "pool", "create", pool, "32", "32"])?;
        let s = size.to_string();
        if size == 1 {
            ceph(&["osd", "pool", "set", pool, "size", "1", "--yes-i-really-mean-it"])?;
        } else {
            ceph(&["osd", "pool", "set", pool, "size", &s])?;
        }
        run(Command::new("rbd").args(["-c", &c, "pool", "init", pool]), t)?;
    }

    step("radosgw and its S3 user")?;
    let rgw_key = ceph(&["auth", "get-or-create", "client.rgw.a", "mon", "allow rw", "osd", "allow rwx"])?;
    std::fs::write(dir.join("rgw/keyring"), rgw_key)?;
    run(Command::new("radosgw").args(["-c", &c, "-n", "client.rgw.a"]), t)?;
    let (access_key, secret_key) = (format!("BENCH{}", random_hex(6)?.to_uppercase()), random_hex(20)?);
    let rgw = format!("http://127.0.0.1:{rgw_port}");
    wait(Duration::from_secs(120), stop, || {
        Ok(std::net::TcpStream::connect_timeout(&format!("127.0.0.1:{rgw_port}").parse()?, Duration::from_secs(1))
            .is_ok())
    })
    .context("radosgw did not listen")?;
    run(
        Command::new("radosgw-admin")
            .args(["-c", &c, "user", "create", "--uid", "bench", "--display-name", "bench"])
            .args(["--access-key", &access_key, "--secret-key", &secret_key]),
        t,
    )?;

    step("waiting for HEALTH_OK and every placement group active+clean")?;
    let started = Instant::now();
    let mut last = String::new();
    wait(o.timeout, stop, || {
        let s = health(&c)?;
        if s != last {
            progress(&format!("{:.0} s: {s}", started.elapsed().as_secs_f64()));
            last = s.clone();
        }
        Ok(s.starts_with("HEALTH_OK") && s.contains("all active+clean"))
    })
    .with_context(|| format!("not healthy after {:?}: {last}", o.timeout))?;

    let cluster = Ceph {
        dir: dir.to_owned(),
        conf,
        version,
        osds: o.osds,
        osd_size: o.osd_size,
        mon: format!("127.0.0.1:{mon_v2}"),
        rgw,
        access_key,
        secret_key,
        pools: vec![(POOL_REPLICATED.into(), size3), (POOL_SINGLE.into(), 1)],
        settings: settings(),
    };
    std::fs::write(dir.join(STATE), serde_json::to_vec_pretty(&cluster)?)?;
    Ok(cluster)
}

/// Calls `ready` every 0.5 s until it says true, `timeout` passes or `stop` is set.
fn wait(timeout: Duration, stop: &AtomicBool, mut ready: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last_err = None;
    while Instant::now() < deadline {
        if stop.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        match ready() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => last_err = Some(e),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    match last_err {
        Some(e) => Err(e.context(format!("gave up after {timeout:?}"))),
        None => bail!("gave up after {timeout:?}"),
    }
}

/// `HEALTH_x; N OSDs up of M; P PGs: all active+clean` (or the states).
fn health(conf: &str) -> anyhow::Result<String> {
    let out = run(
        Command::new("ceph").args(["-c", conf, "--connect-timeout", "10", "status", "-f", "json"]),
        Duration::from_secs(30),
    )?;
    let v: serde_json::Value = serde_json::from_str(&out).context("`ceph status` JSON")?;
    let status = v.pointer("/health/status").and_then(|s| s.as_str()).unwrap_or("?");
    let up = v.pointer("/osdmap/num_up_osds").and_then(|s| s.as_u64()).unwrap_or(0);
    let all = v.pointer("/osdmap/num_osds").and_then(|s| s.as_u64()).unwrap_or(0);
    let pgs = v.pointer("/pgmap/num_pgs").and_then(|s| s.as_u64()).unwrap_or(0);
    let states: Vec<(String, u64)> = v
        .pointer("/pgmap/pgs_by_state")
        .and_then(|s| s.as_array())
        .map(|a| {
            a.iter()
                .map(|x| (x["state_name"].as_str().unwrap_or("?").to_owned(), x["count"].as_u64().unwrap_or(0)))
                .collect()
        })
        .unwrap_or_default();
    let clean = states.iter().filter(|(s, _)| s == "active+clean").map(|(_, n)| n).sum::<u64>();
    let pg = if pgs > 0 && clean == pgs {
        format!("{pgs} PGs: all active+clean")
    } else {
        format!("{pgs} PGs: {}", states.iter().map(|(s, n)| format!("{n} {s}")).collect::<Vec<_>>().join(", "))
    };
    Ok(format!("{status}; {up} of {all} OSDs up; {pg}"))
}

/// The cluster recorded in `dir` by `up`.
pub fn load(dir: &Path) -> anyhow::Result<Ceph> {
    let state = dir.join(STATE);
    let text = std::fs::read(&state)
        .with_context(|| format!("no Ceph made by `bench peers ceph up` in {} (no {STATE})", dir.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("{}: not written by a finished `up`", state.display()))
}

/// One paragraph: what runs, its health, its daemons.
pub fn status(dir: &Path) -> anyhow::Result<String> {
    let c = load(dir)?;
    let conf = c.conf.to_str().context("path")?;
    let alive =
        daemons(dir).into_iter().map(|(n, pid)| format!("{n} (pid {pid}{})", if alive(pid) { "" } else { ", gone" }));
    Ok(format!(
        "{}\nhealth: {}\ndaemons: {}\nconf: {}  (CEPH_CONF for fio's rbd engine and rbd://POOL/IMAGE targets)\n\
         S3: {} access key {} secret key {}",
        c.describe(),
        health(conf).unwrap_or_else(|e| format!("no answer: {e:#}")),
        alive.collect::<Vec<_>>().join(", "),
        c.conf.display(),
        c.rgw,
        c.access_key,
        c.secret_key
    ))
}

/// (daemon name, pid) from the pid files under `dir/run`.
pub fn daemons(dir: &Path) -> Vec<(String, i32)> {
    let Ok(rd) = std::fs::read_dir(dir.join("run")) else { return Vec::new() };
    let mut v: Vec<(String, i32)> = rd
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.strip_suffix(".pid")?.to_owned();
            let pid = std::fs::read_to_string(e.path()).ok()?.trim().parse().ok()?;
            Some((name, pid))
        })
        .collect();
    v.sort();
    v
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// Stops the daemons whose pid files are under `dir` (SIGTERM, then
/// SIGKILL after 15 s) and removes `dir`. Refuses a directory that `up`
/// did not make.
pub fn down(dir: &Path) -> anyhow::Result<()> {
    if !dir.join(STATE).exists() {
        bail!("{} holds no Ceph made by `bench peers ceph up` (no {STATE}); nothing stopped", dir.display());
    }
    let ds = daemons(dir);
    // Only processes that are still Ceph daemons (a pid may be reused).
    let ours: Vec<i32> = ds
        .iter()
        .filter(|(_, pid)| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| ["ceph-mon", "ceph-mgr", "ceph-osd", "radosgw"].iter().any(|d| c.trim().starts_with(d)))
        })
        .map(|(_, pid)| *pid)
        .collect();
    for &pid in &ours {
        // SAFETY: plain signal to a pid we just checked.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while ours.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    for &pid in ours.iter().filter(|&&p| alive(p)) {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while ours.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))
}

/// Makes `pool/image` at least `size` bytes and holding data over all of
/// it: creates or grows it, and when `rbd du` shows fewer bytes in use than
/// that, writes it once through with fio (4 MiB writes, untimed), the way fio
/// lays out a file before reading it. Without that, reads of an unwritten
/// (thin) image are answered by librbd with zeroes that never reach an OSD.
pub fn ensure_image(conf: &Path, pool: &str, image: &str, size: u64) -> anyhow::Result<()> {
    let c = conf.to_str().context("conf path")?;
    let t = Duration::from_secs(60);
    let spec = format!("{pool}/{image}");
    let mib = format!("{}M", size.div_ceil(1 << 20));
    match run(Command::new("rbd").args(["-c", c, "info", &spec, "--format", "json"]), t) {
        Ok(info) => {
            let v: serde_json::Value = serde_json::from_str(&info).context("`rbd info` JSON")?;
            if v["size"].as_u64().unwrap_or(0) < size {
                run(Command::new("rbd").args(["-c", c, "resize", &spec, "--size", &mib]), t)?;
            }
        }
        Err(_) => {
            run(Command::new("rbd").args(["-c", c, "create", &spec, "--size", &mib]), t)
                .with_context(|| format!("creating RBD image {spec}"))?;
        }
    }
    let du = run(Command::new("rbd").args(["-c", c, "du", &spec, "--format", "json"]), t)?;
    let v: serde_json::Value = serde_json::from_str(&du).context("`rbd du` JSON")?;
    let used = v.pointer("/images/0/used_size").and_then(|x| x.as_u64()).unwrap_or(0);
    if used >= size {
        return Ok(());
    }
    tracing::info!(image = %spec, size, used, "filling the RBD image with data before measuring");
    run(
        Command::new("fio")
            .args(["--name=fill", "--ioengine=rbd", "--clientname=admin", &format!("--pool={pool}")])
            .args([&format!("--rbdname={image}"), "--rw=write", "--bs=4M", "--iodepth=16"])
            .args([&format!("--size={size}"), "--refill_buffers", "--output-format=terse"])
            .env("CEPH_CONF", conf),
        Duration::from_secs(600),
    )
    .with_context(|| format!("filling RBD image {spec} with fio"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conf_keeps_everything_in_the_directory_and_three_copies_on_one_host() {
        let t = conf_text(Path::new("/x/y"), "f", 1, 2, 3);
        for line in t.lines().filter(|l| l.contains('/') && !l.starts_with('#')) {
            assert!(line.contains("/x/y/"), "a path outside the directory: {line}");
        }
        assert!(t.contains("osd_crush_chooseleaf_type = 0"));
        assert!(t.contains("mon_host = [v2:127.0.0.1:1,v1:127.0.0.1:2]"));
        assert!(t.contains("beast endpoint=127.0.0.1:3"));
        assert!(t.contains("pid_file = /x/y/run/$name.pid"));
    }

    #[test]
    fn down_refuses_a_directory_up_did_not_make() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("precious"), b"x").unwrap();
        let e = down(d.path()).unwrap_err();
        assert!(e.to_string().contains("no Ceph made by"), "{e}");
        assert!(d.path().join("precious").exists());
    }

    #[test]
    fn uuids_have_the_canonical_shape() {
        let u = uuid().unwrap();
        let parts: Vec<usize> = u.split('-').map(str::len).collect();
        assert_eq!(parts, [8, 4, 4, 4, 12], "{u}");
        assert_ne!(u, uuid().unwrap());
    }
}
