//! The bench end to end: the embedded cluster's life cycle, `bench run`
//! against NBD, a directory and S3, `bench compare`'s exit status, the
//! accuracy check against fio, and `fresh-bench-storage --quick`.

use bench::cluster::Cluster;
use bench::shaper::LinkSpec;
use serde_json::Value;
use stack_tests::{Corona, ENGINES, bin, require};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn bench() -> Command {
    Command::new(bin("bench", "bench"))
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map(|d| d.count()).unwrap_or(0)
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One start-use-stop cycle on a fresh runtime; returns what must be gone.
fn cycle(link: LinkSpec) -> (std::path::PathBuf, Vec<std::net::SocketAddr>) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let out = rt.block_on(async {
        let c = Cluster::embedded(link).await.unwrap();
        let dir = c.data_dir().unwrap();
        assert!(dir.is_dir());
        // Use every service through its real interface before stopping it.
        let corona = c.endpoints.coronafs.clone().unwrap();
        bench::cluster::create_volume(&corona.api, "v", 1 << 20).await.unwrap();
        let nbd = coronafs::client::NbdClient::connect(corona.nbd.as_str(), "v").await.unwrap();
        nbd.write(0, &[7u8; 4096], false).await.unwrap();
        assert_eq!(nbd.read(0, 4096).await.unwrap(), vec![7u8; 4096]);
        let s3e = c.endpoints.lightningstor.clone().unwrap();
        let s3 = bench::storage::measure::s3(&s3e, 0);
        bench::storage::measure::ensure_bucket(&s3, "cycle-bucket").await.unwrap();
        s3.put_object().bucket("cycle-bucket").key("k").body(vec![1u8; 100].into()).send().await.unwrap();
        let addrs = c.listen_addrs();
        drop(nbd);
        c.shutdown().await;
        (dir, addrs)
    });
    rt.shutdown_timeout(Duration::from_secs(10));
    out
}

#[test]
fn the_embedded_cluster_starts_and_stops_cleanly_many_times() {
    // The first cycle warms process-wide pools; later ones must not grow.
    cycle(LinkSpec::default());
    let (t0, f0) = (threads(), fds());
    for i in 0..6 {
        let link = if i % 2 == 0 {
            LinkSpec::default()
        } else {
            LinkSpec { rate: Some(64 << 20), delay: Duration::from_millis(1) }
        };
        let (dir, addrs) = cycle(link);
        assert!(!dir.exists(), "cycle {i}: {} left behind", dir.display());
        assert!(addrs.len() >= 3, "cycle {i}: {addrs:?}");
        for a in addrs {
            assert!(
                TcpStream::connect_timeout(&a, Duration::from_millis(200)).is_err(),
                "cycle {i}: {a} still accepts connections"
            );
        }
    }
    // Give detached OS threads (blocking pools) a moment to exit.
    std::thread::sleep(Duration::from_millis(200));
    let (t1, f1) = (threads(), fds());
    assert!(t1 <= t0 + 2, "threads grew from {t0} to {t1} over six cycles");
    assert!(f1 <= f0 + 4, "open descriptors grew from {f0} to {f1} over six cycles");
}

const SMALL_JOBS: &str = r#"
description = "small mixed job for tests"
iterations = 2
[global]
size = "16M"
runtime = "700ms"
[[job]]
name = "randrw-4k-qd8"
rw = "randrw"
bs = "4k"
iodepth = 8
rwmixread = 70
[[job]]
name = "seqwrite-1m-fsync4"
rw = "write"
bs = "1M"
iodepth = 2
numjobs = 2
fsync = 4
"#;

fn check_run_json(path: &Path, target_kind: &str) -> Value {
    let v = json(path);
    assert_eq!(v["iterations"], 2, "{target_kind}");
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 2);
    let mixed = &jobs[0];
    assert_eq!(mixed["name"], "randrw-4k-qd8");
    for side in ["read", "write"] {
        let s = &mixed[side];
        for f in ["iops", "bw_bytes", "lat_p50_us", "lat_p99_us"] {
            assert!(s[f]["mean"].as_f64().unwrap() > 0.0, "{target_kind} {side}.{f} = {}", s[f]);
            assert!(s[f]["stddev"].as_f64().is_some(), "{target_kind} {side}.{f} has no stddev");
        }
        // bw = iops * bs, within rounding: a broken unit would show here.
        let (iops, bw) = (s["iops"]["mean"].as_f64().unwrap(), s["bw_bytes"]["mean"].as_f64().unwrap());
        assert!((bw / (iops * 4096.0) - 1.0).abs() < 1e-6, "{target_kind}: bw {bw} vs iops {iops}");
        assert!(s["lat_p99_us"]["mean"].as_f64() >= s["lat_p50_us"]["mean"].as_f64());
    }
    // 70 % reads, within noise.
    let r = mixed["read"]["iops"]["mean"].as_f64().unwrap();
    let w = mixed["write"]["iops"]["mean"].as_f64().unwrap();
    let share = r / (r + w);
    assert!((0.6..0.8).contains(&share), "{target_kind}: read share {share:.2} for rwmixread = 70");
    assert!(jobs[1].get("read").is_none(), "a write-only job has no read side");
    assert!(jobs[1]["write"]["bw_bytes"]["mean"].as_f64().unwrap() > 0.0);
    v
}

#[test]
fn bench_run_measures_an_nbd_export_and_a_directory() {
    let d = tempfile::tempdir().unwrap();
    let jobfile = d.path().join("small.toml");
    std::fs::write(&jobfile, SMALL_JOBS).unwrap();
    let c = Corona::start(ENGINES[0]);
    c.create("vol", 32 << 20);
    let out = d.path().join("nbd.json");
    let st = bench()
        .args(["run", "--profile"])
        .arg(&jobfile)
        .args(["--target", &c.uri("vol"), "--json"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    check_run_json(&out, "nbd");

    let dir = d.path().join("files");
    std::fs::create_dir(&dir).unwrap();
    let out = d.path().join("dir.json");
    let st = bench()
        .args(["run", "--profile"])
        .arg(&jobfile)
        .arg("--target")
        .arg(&dir)
        .arg("--json")
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    check_run_json(&out, "directory");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "job files are removed after the run");
}

#[test]
fn bench_run_measures_an_s3_bucket() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cluster = rt.block_on(Cluster::embedded(LinkSpec::default())).unwrap();
    let s3 = cluster.endpoints.lightningstor.clone().unwrap();
    let d = tempfile::tempdir().unwrap();
    let jobfile = d.path().join("s3.toml");
    std::fs::write(
        &jobfile,
        "iterations = 1\n[[job]]\nname = \"objects\"\nrw = \"randrw\"\nbs = \"64k\"\niodepth = 4\nsize = \"4M\"\nruntime = \"700ms\"\nrwmixread = 50\n",
    )
    .unwrap();
    let out = d.path().join("s3.json");
    let output = bench()
        .args(["run", "--profile"])
        .arg(&jobfile)
        .args(["--target", &format!("s3://bucket-x?endpoint={}", s3.endpoints[0]), "--json"])
        .arg(&out)
        .env("AWS_ACCESS_KEY_ID", &s3.access_key)
        .env("AWS_SECRET_ACCESS_KEY", &s3.secret_key)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let v = json(&out);
    for side in ["read", "write"] {
        assert!(v["jobs"][0][side]["iops"]["mean"].as_f64().unwrap() > 0.0, "{side}");
    }
    // Without keys the run is refused with a clear message.
    let output = bench()
        .args(["run", "--profile"])
        .arg(&jobfile)
        .args(["--target", &format!("s3://bucket-x?endpoint={}", s3.endpoints[0])])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("AWS_ACCESS_KEY_ID"));
    rt.block_on(cluster.shutdown());
}

#[test]
fn bad_job_files_are_refused_with_a_clear_message() {
    let d = tempfile::tempdir().unwrap();
    for (text, want) in [
        ("[[job]]\nname = \"a\"\nrw = \"read\"\nblock_size = 4096\n", "block_size"),
        ("[[job]]\nname = \"a\"\nrw = \"randread\"\niodepth = 0\n", "iodepth 0"),
        ("[[job]]\nname = \"a\"\nrw = \"read\"\nfsync = 8\n", "needs a job that writes"),
    ] {
        let p = d.path().join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let out = bench().args(["run", "--profile"]).arg(&p).args(["--target"]).arg(d.path()).output().unwrap();
        assert!(!out.status.success(), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{text}: {err}");
    }
}

#[test]
fn bench_compare_exits_non_zero_only_on_a_real_regression() {
    let d = tempfile::tempdir().unwrap();
    let fig = |m: f64, sd: f64| serde_json::json!({"mean": m, "stddev": sd, "median": m, "min": m, "max": m, "n": 3});
    let doc = |iops: f64, sd: f64| serde_json::json!({"profile": "p", "jobs": [{"name": "j", "read": {"iops": fig(iops, sd), "lat_p99_us": fig(100.0, 2.0)}}]});
    let write = |name: &str, v: Value| {
        let p = d.path().join(name);
        std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
        p
    };
    let old = write("old.json", doc(1000.0, 10.0));
    let same = write("same.json", doc(980.0, 12.0));
    let worse = write("worse.json", doc(700.0, 10.0));
    let noisy = write("noisy.json", doc(850.0, 400.0));
    let run = |a: &Path, b: &Path, extra: &[&str]| {
        let out = bench().arg("compare").arg(a).arg(b).args(extra).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, table) = run(&old, &same, &[]);
    assert_eq!(code, Some(0), "{table}");
    let (code, table) = run(&old, &worse, &[]);
    assert_eq!(code, Some(1), "{table}");
    assert!(table.contains("REGRESSION") && table.contains("jobs.j.read.iops"), "{table}");
    assert_eq!(run(&old, &worse, &["--max-regression", "40%"]).0, Some(0), "30 % is within a 40 % bound");
    assert_eq!(run(&old, &noisy, &[]).0, Some(0), "15 % worse but within its own spread");
}

#[test]
fn our_load_generator_agrees_with_fio_on_the_same_export() {
    require("fio");
    // Behind an emulated link (64 MiB/s, 2 ms each way) the export, not
    // either generator's CPU, sets the pace, so the two must agree. CI bound:
    // loose enough for a busy 2-core runner, tight enough that a wrong unit,
    // a lost queue depth or a miscounted direction fails.
    let out = bench()
        .args(["accuracy", "--profiles", "seed-002,seed-003", "--runtime", "2s", "--size", "64M"])
        .args(["--iterations", "1", "--tolerance", "30%", "--link-rate", "64MiB", "--link-delay", "2ms"])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(table.matches("| yes |").count(), 7, "every figure compared: {table}");
}

#[test]
fn fresh_bench_storage_quick_reports_every_available_section() {
    let d = tempfile::tempdir().unwrap();
    let out = bench().args(["fresh-bench-storage", "--quick", "--out-dir"]).arg(d.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v = json(&d.path().join("results.json"));
    let measured = |s: &str| {
        assert_eq!(v[s]["status"], "measured", "{s}: {}", v[s]);
        &v[s]
    };
    let pos = |s: &str, f: &str| {
        let x = measured(s)[f]["median"].as_f64().unwrap_or(0.0);
        assert!(x > 0.0 && x.is_finite(), "{s}.{f} = {x}");
        x
    };
    let tcp = pos("network", "tcp_mib_s");
    assert!(tcp > 50.0, "loopback TCP at {tcp} MiB/s is implausible");
    for s in ["local_disk", "coronafs"] {
        for f in ["seq_write_mib_s", "seq_read_mib_s", "rand_read_4k_iops", "depth32_write_mib_s", "depth32_read_mib_s"]
        {
            pos(s, f);
        }
    }
    pos("cross_worker", "read_mib_s");
    assert_eq!(v["cross_worker"]["verified"], true);
    for s in ["s3_large_object", "s3_small_batch", "s3_parallel_batch"] {
        for f in ["upload_mib_s", "download_mib_s", "put_per_s", "get_per_s"] {
            pos(s, f);
        }
    }
    assert_eq!(v["s3_parallel_batch"]["jobs"], 8);
    assert_eq!(v["vm_image"]["status"], "not_available");
    let keys: Vec<&str> = v["assessment"].as_array().unwrap().iter().filter_map(|a| a["key"].as_str()).collect();
    for k in [
        "coronafs_seq_read_vs_local",
        "coronafs_rand_read_4k_vs_local",
        "cross_worker_read_vs_local_seq_read",
        "coronafs_seq_read_vs_tcp",
        "coronafs_depth32_read_vs_local",
        "s3_large_download_vs_tcp",
    ] {
        assert!(keys.contains(&k), "assessment lacks {k}: {keys:?}");
    }
    let md = std::fs::read_to_string(d.path().join("storage-benchmarks.md")).unwrap();
    for h in ["## CoronaFS", "## LightningStor", "### Large-object path", "## VM Image Path", "## Assessment"] {
        assert!(md.contains(h), "report lacks {h}");
    }
    for svg in ["throughput.svg", "coronafs.svg", "lightningstor.svg"] {
        assert!(md.contains(svg), "report does not embed {svg}");
        assert!(std::fs::read_to_string(d.path().join(svg)).unwrap().contains("<svg"));
    }
}
