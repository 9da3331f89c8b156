//! Ceph as a reference peer: `bench peers ceph up` stands a one-host Ceph up
//! from Debian's packages (CI installs them), `bench run --target rbd://`
//! and `bench nbd-compare --peers ceph` measure it, and `down` leaves no
//! daemon and no file behind. An interrupted `up` cleans up too.
//!
//! One Ceph at a time on this machine: the tests of this binary take turns.

use stack_tests::{bin, require};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ONE_CEPH: Mutex<()> = Mutex::new(());

fn bench() -> Command {
    Command::new(bin("bench", "bench"))
}

fn require_ceph() {
    for tool in ["ceph-mon", "ceph-osd", "ceph-mgr", "radosgw", "radosgw-admin", "ceph", "rbd", "nbdkit", "fio"] {
        require(tool);
    }
}

/// Ceph daemons whose command line names `dir` (our conf lives there).
fn daemons_of(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .filter(|c| {
                    c.contains(&needle) && ["ceph-mon", "ceph-osd", "ceph-mgr", "radosgw"].iter().any(|d| c.contains(d))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{o}\n{e}", out.status);
    o.into_owned()
}

/// Stops the cluster even when the test fails.
struct Down<'a>(&'a Path);

impl Drop for Down<'_> {
    fn drop(&mut self) {
        if self.0.join("bench-ceph.json").exists() {
            let _ = bench().args(["peers", "ceph", "down", "--dir"]).arg(self.0).status();
        }
    }
}

#[test]
fn ceph_up_measured_through_librbd_and_nbd_then_down_leaves_nothing() {
    let _gate = crate::gate::shared();
    let _turn = ONE_CEPH.lock().unwrap_or_else(|e| e.into_inner());
    require_ceph();
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("ceph");
    let _down = Down(&dir);
    let t = Instant::now();
    let up = run_ok(bench().args(["peers", "ceph", "up", "--osd-size", "2G", "--dir"]).arg(&dir));
    eprintln!("ceph: up in {:.0} s\n{up}", t.elapsed().as_secs_f64());
    assert!(up.contains("rbd (size 3)") && up.contains("rbd1 (size 1)"), "{up}");
    let status = run_ok(bench().args(["peers", "ceph", "status", "--dir"]).arg(&dir));
    assert!(status.contains("HEALTH_OK") && status.contains("3 of 3 OSDs up"), "{status}");
    assert!(status.contains("osd.2") && status.contains("client.rgw.a"), "{status}");
    // A second `up` on the same directory is refused, and touches nothing.
    let again = bench().args(["peers", "ceph", "up", "--dir"]).arg(&dir).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a Ceph"));

    // seed-002 (its 4k random read at QD64 and 4k 70/30 mix among its jobs)
    // on an RBD image at three copies, through fio's rbd engine.
    let conf = dir.join("ceph.conf");
    let json = base.path().join("rbd.json");
    let target = format!("rbd://rbd/seed002?conf={}", conf.display());
    run_ok(
        bench()
            .args(["run", "--profile", "seed-002", "--target", &target, "--runtime", "2s", "--size", "64M"])
            .args(["--iterations", "1", "--json"])
            .arg(&json),
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["target"], target.as_str());
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 4, "{v}");
    for j in jobs {
        for side in ["read", "write"] {
            if let Some(s) = j.get(side) {
                let iops = s["iops"]["median"].as_f64().unwrap_or(0.0);
                assert!(iops > 0.0, "{} {side}: {iops} IOPS", j["name"]);
            }
        }
    }
    // The image was laid out with data first: a sequential read of a thin,
    // never written image would come back from librbd as zeroes at memory
    // speed, not from the OSDs.
    let du = run_ok(Command::new("rbd").args(["-c"]).arg(&conf).args(["du", "rbd/seed002", "--format", "json"]));
    let du: serde_json::Value = serde_json::from_str(&du).unwrap();
    assert!(du["images"][0]["used_size"].as_u64().unwrap_or(0) >= 64 << 20, "{du}");

    // The block peers: CoronaFS beside RBD through librbd and through an NBD export.
    let out = run_ok(
        bench()
            .args(["nbd-compare", "--size", "64M", "--iterations", "1", "--runtime", "1", "--engines", "threads"])
            .args(["--peers", "ceph", "--ceph-dir"])
            .arg(&dir),
    );
    for peer in ["ceph-rbd-3x", "ceph-rbd-3x-nbd", "ceph-rbd-1x", "ceph-rbd-1x-nbd"] {
        let row = format!("| rand-read-4k-qd32 | {peer} | ");
        let rows: Vec<&str> = out.lines().filter(|l| l.starts_with(&row)).collect();
        assert_eq!(rows.len(), 1, "{peer}:\n{out}");
        let iops: f64 = rows[0].split('|').nth(4).unwrap().trim().parse().unwrap();
        assert!(iops > 0.0, "{}", rows[0]);
    }

    run_ok(bench().args(["peers", "ceph", "down", "--dir"]).arg(&dir));
    assert!(!dir.exists(), "down left {}", dir.display());
    assert_eq!(daemons_of(&dir), Vec::<String>::new(), "daemons left running");
    // `down` refuses a directory that is not a Ceph of ours.
    let refused = bench().args(["peers", "ceph", "down", "--dir"]).arg(base.path()).output().unwrap();
    assert!(!refused.status.success());
    assert!(base.path().exists());
}

#[test]
fn an_interrupted_up_stops_what_it_started_and_removes_its_directory() {
    let _gate = crate::gate::shared();
    let _turn = ONE_CEPH.lock().unwrap_or_else(|e| e.into_inner());
    require_ceph();
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("ceph");
    let _down = Down(&dir);
    let child = bench()
        .args(["peers", "ceph", "up", "--osd-size", "2G", "--dir"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupt once the monitor runs (its pid file exists).
    let t = Instant::now();
    while !dir.join("run/mon.a.pid").exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "the monitor did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: a plain signal to our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "up was interrupted but succeeded: {err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(!dir.exists(), "the directory was left: {err}");
    assert_eq!(daemons_of(&dir), Vec::<String>::new(), "daemons left running: {err}");
}
