//! Ratio-to-peer checks: each test measures one of our services and a
//! reference peer on the same bytes in the same run, iterations interleaved
//! (the order alternates), and asserts that the ratio of medians stays above
//! a floor set well below what this machine measures, so machine noise does
//! not fail them but a gross regression does. Every test prints what it
//! measured, so a CI log shows the trend: to the process's stderr
//! ([`show`]), which the test harness does not capture, so the figures
//! appear in a passing run too.
//!
//! The tests of this binary take one lock each: nothing else of this binary
//! runs while one measures. cargo runs test binaries one after another, so
//! nothing else of the test command does either.
//!
//! Conditions: one machine, everything on 127.0.0.1 or in-process; the
//! figures are ratios, not absolute speeds.

use crate::vmc::common as plasmavmc_common;

use aws_credential_types::Credentials;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use plasmavmc_common::{Stack, qemu_img, qemu_io};
use serde_json::Value;
use stack_tests::{bin, require};
use std::process::Command;
use std::time::Instant;

/// Every test here measures: each runs alone in the binary.
fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    crate::gate::exclusive()
}

/// Prints one line of figures past the test harness's capture (it captures
/// `println!` and `eprintln!`, not writes to the stderr handle), so a
/// passing run's log carries them too.
fn show(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The median of `v` (the upper one for an even count).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.1} [{lo:.1}..{hi:.1}]", median(v))
}

/// Checks every `(what, ratio)` against `floor` after printing them all, so
/// one failure does not hide the other figures.
fn check_floor(test: &str, floor: f64, ratios: &[(String, f64)]) {
    for (what, r) in ratios {
        show(&format!("ratio {test}: {what} = {r:.2}x (floor {floor:.2}x)"));
    }
    let low: Vec<String> = ratios.iter().filter(|(_, r)| !(*r >= floor)).map(|(w, r)| format!("{w} {r:.2}x")).collect();
    assert!(low.is_empty(), "{test}: below the {floor:.2}x floor: {}", low.join(", "));
}

/// CoronaFS against nbdkit's file plugin: fio's nbd engine on the same 1 GiB
/// file served by each, through `bench nbd-compare` (which interleaves the
/// servers within each iteration). Floors on the median of the
/// per-iteration IOPS ratios (the same ratio as MiB/s for the 1M jobs):
/// 0.7x for 4k QD32 and pinned 4k QD1, 0.5x for 1M read and write, 0.35x
/// for unpinned 4k QD1 (placement decides it).
#[test]
fn coronafs_keeps_up_with_nbdkit_on_the_same_file() {
    let _alone = alone();
    for tool in ["fio", "nbdkit"] {
        require(tool);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("nbd.json");
    let out = Command::new(bin("bench", "bench"))
        .args(["nbd-compare", "--size", "1G", "--iterations", "3", "--runtime", "2"])
        .args(["--engines", "threads", "--peers", "nbdkit", "--json"])
        .arg(&json)
        .output()
        .expect("run bench nbd-compare");
    assert!(
        out.status.success(),
        "bench nbd-compare failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&std::fs::read(&json).expect("read report")).expect("json");
    assert_eq!(report["iterations"], 3, "{report}");
    let mut ratios = Vec::new();
    for w in report["workloads"].as_array().expect("workloads") {
        let name = w["workload"]["name"].as_str().expect("name");
        // 1M jobs by bandwidth, 4k jobs by operations: the same ratio, in
        // the unit the job is about.
        let key = if w["workload"]["bs"] == "1m" { "mib_s" } else { "iops" };
        let figure = |label: &str| -> f64 {
            let p = w["peers"]
                .as_array()
                .expect("peers")
                .iter()
                .find(|p| p["peer"].as_str().is_some_and(|l| l.starts_with(label)))
                .unwrap_or_else(|| panic!("{name}: no {label} figures in {w}"));
            p[key]["median"].as_f64().unwrap_or_else(|| panic!("{name}: no median in {p}"))
        };
        let (ours, theirs) = (figure("coronafs"), figure("nbdkit"));
        assert!(ours > 0.0 && theirs > 0.0, "{name}: a zero figure ({ours} vs {theirs})");
        // The ratio held to the floor pairs the two servers' runs of each
        // iteration (back to back), so a drift of the machine's speed
        // between iterations, which moves both runs of one alike, does not
        // decide it (the ratio of the two medians can pair a slow
        // iteration of one with a fast one of the other).
        let paired = w["paired"]
            .as_array()
            .expect("paired")
            .iter()
            .find(|p| {
                p["ours"].as_str().is_some_and(|l| l.starts_with("coronafs"))
                    && p["peer"].as_str().is_some_and(|l| l.starts_with("nbdkit"))
            })
            .unwrap_or_else(|| panic!("{name}: no paired ratio in {w}"));
        let (median, min, max) = (
            paired["ratio"]["median"].as_f64().expect("median"),
            paired["ratio"]["min"].as_f64().expect("min"),
            paired["ratio"]["max"].as_f64().expect("max"),
        );
        assert_eq!(paired["ratio"]["n"], 3, "{name}: paired ratios of 3 iterations: {paired}");
        show(&format!(
            "{name}: coronafs {ours:.1} nbdkit {theirs:.1} {key} (medians of 3, ratio {:.2}x); per-iteration ratios {median:.2}x [{min:.2}..{max:.2}]",
            ours / theirs
        ));
        ratios.push((name.to_owned(), median));
    }
    // The four jobs, and 4k QD1 pinned (fio on one CPU, the server on
    // another) wherever there are two CPUs.
    let two_cpus = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    assert_eq!(ratios.len(), if two_cpus { 5 } else { 4 }, "nbd-compare's jobs: {ratios:?}");
    // 1M write and read straddle 0.7x on this machine (write 0.69x-1.11x
    // in quiet runs; read 1.25x-1.71x on an earlier day, 0.70x-0.83x on
    // 2026-11-26): floor 0.5x, so a gross regression still fails and noise
    // does not.
    // Unpinned 4k QD1 is decided by where the scheduler wakes fio and the
    // server (0.54x-0.92x in one day's quiet runs; both pinned to one CPU,
    // each server is about 6x faster than pinned apart): floor 0.35x. The
    // servers' own cost per request is the pinned row's (1.03x-1.09x),
    // held to 0.7x.
    let floor = |name: &str| match name {
        "seq-write-1m-qd16" | "seq-read-1m-qd16" => 0.5,
        "rand-read-4k-qd1" => 0.35,
        _ => 0.7,
    };
    for f in [0.7, 0.5, 0.35] {
        let at: Vec<_> = ratios.iter().filter(|(n, _)| floor(n) == f).cloned().collect();
        check_floor("coronafs/nbdkit", f, &at);
    }
}

const AK: &str = "ratio-access-key";
const SK: &str = "ratio-secret-key-0123456789";

fn client(service: s3s::service::S3Service) -> Client {
    let conf = aws_sdk_s3::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(AK, SK, None, None, "ratios"))
        .endpoint_url("http://localhost:9000")
        .force_path_style(true)
        .http_client(testkit::sdk::InProcess::from(service))
        .build();
    Client::from_conf(conf)
}

/// One S3 server under test, its client, and what it measured.
struct S3Side {
    name: &'static str,
    client: Client,
    put_small: Vec<f64>,
    get_small: Vec<f64>,
    put_large: Vec<f64>,
    get_large: Vec<f64>,
}

const SMALL: usize = 4096;
const SMALL_OPS: usize = 800;
const CLIENTS: usize = 16;
const LARGE: usize = 64 << 20;

/// `SMALL_OPS` operations of 4 KiB from `CLIENTS` concurrent tasks; ops/s.
async fn small_round(c: &Client, iteration: usize, put: bool) -> f64 {
    let body = Bytes::from(vec![iteration as u8; SMALL]);
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|t| {
            let c = c.clone();
            let body = body.clone();
            tokio::spawn(async move {
                for i in (t..SMALL_OPS).step_by(CLIENTS) {
                    let key = format!("small/{i:05}");
                    if put {
                        c.put_object().bucket("ratio").key(&key).body(ByteStream::from(body.clone())).send().await?;
                    } else {
                        let got = c.get_object().bucket("ratio").key(&key).send().await?;
                        let bytes = got.body.collect().await?.into_bytes();
                        anyhow::ensure!(bytes.len() == SMALL, "{key}: {} bytes", bytes.len());
                    }
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("join").expect("small op");
    }
    SMALL_OPS as f64 / t0.elapsed().as_secs_f64()
}

/// One 64 MiB PUT or GET; MiB/s.
async fn large_round(c: &Client, body: &Bytes, put: bool) -> f64 {
    let t0 = Instant::now();
    if put {
        c.put_object().bucket("ratio").key("large").body(ByteStream::from(body.clone())).send().await.expect("put");
    } else {
        let got = c.get_object().bucket("ratio").key("large").send().await.expect("get");
        let bytes = got.body.collect().await.expect("body").into_bytes();
        assert!(bytes == *body, "the 64 MiB object came back different");
    }
    (LARGE >> 20) as f64 / t0.elapsed().as_secs_f64()
}

/// LightningStor (single node, its default fsync-before-acknowledge on)
/// against s3s-fs (which does not fsync), both in this process behind the
/// same aws-sdk-s3 client code, the SDK's HTTP client replaced by the
/// service itself: 4 KiB PUT/GET ops/s from 16 tasks and 64 MiB PUT/GET
/// MiB/s, five iterations after a warm-up, interleaved. Floor 0.7x.
#[test]
fn lightningstor_keeps_up_with_s3s_fs_in_process() {
    let _alone = alone();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let ls_dir = tempfile::tempdir().expect("tempdir");
        let store = lightningstor::Store::open(lightningstor::Config::new(ls_dir.path()).with_keys(AK, SK))
            .expect("open lightningstor");
        let ours = lightningstor::server::service(store.clone());
        let fs_dir = tempfile::tempdir().expect("tempdir");
        let fs = s3s_fs::FileSystem::new(fs_dir.path()).expect("s3s-fs");
        let theirs = {
            let mut b = s3s::service::S3ServiceBuilder::new(fs);
            b.set_auth(s3s::auth::SimpleAuth::from_single(AK, SK));
            b.build()
        };
        let mut sides = [("lightningstor", ours), ("s3s-fs", theirs)].map(|(name, svc)| S3Side {
            name,
            client: client(svc),
            put_small: Vec::new(),
            get_small: Vec::new(),
            put_large: Vec::new(),
            get_large: Vec::new(),
        });
        for s in &sides {
            s.client.create_bucket().bucket("ratio").send().await.expect("create bucket");
        }
        let large = Bytes::from(stack_tests::pattern(LARGE, 9));
        // Iteration 0 warms both up and is not counted.
        for it in 0..=5usize {
            let order: [usize; 2] = if it % 2 == 0 { [0, 1] } else { [1, 0] };
            for &i in &order {
                let s = &mut sides[i];
                let ps = small_round(&s.client, it, true).await;
                let gs = small_round(&s.client, it, false).await;
                let pl = large_round(&s.client, &large, true).await;
                let gl = large_round(&s.client, &large, false).await;
                if it > 0 {
                    s.put_small.push(ps);
                    s.get_small.push(gs);
                    s.put_large.push(pl);
                    s.get_large.push(gl);
                }
            }
        }
        for s in &sides {
            show(&format!(
                "{:<14} PUT 4 KiB {} ops/s  GET 4 KiB {} ops/s  PUT 64 MiB {} MiB/s  GET 64 MiB {} MiB/s",
                s.name,
                spread(&s.put_small),
                spread(&s.get_small),
                spread(&s.put_large),
                spread(&s.get_large)
            ));
        }
        let [ls, fs] = &sides;
        let ratio = |f: fn(&S3Side) -> &Vec<f64>| median(f(ls)) / median(f(fs));
        check_floor(
            "lightningstor/s3s-fs",
            0.7,
            &[
                ("PUT 4 KiB ops/s".to_owned(), ratio(|s| &s.put_small)),
                ("GET 4 KiB ops/s".to_owned(), ratio(|s| &s.get_small)),
                ("PUT 64 MiB MiB/s".to_owned(), ratio(|s| &s.put_large)),
                ("GET 64 MiB MiB/s".to_owned(), ratio(|s| &s.get_large)),
            ],
        );
    });
}

/// PlasmaVMC: once an image's base is cached, CreateVolume is a CoronaFS
/// clone and must stay fast at any virtual size. A 4 GiB qcow2 with data at
/// both ends; 21 warm creates, p50 under 100 ms (no peer: a fixed ceiling
/// far above the few milliseconds a clone takes here).
#[test]
fn warm_create_volume_p50_stays_under_100ms_at_4gib_virtual() {
    let _alone = alone();
    require("qemu-img");
    require("qemu-io");
    let st = Stack::start();
    let q = st.work().join("warm4g.qcow2");
    let qs = q.to_str().expect("utf-8 path");
    qemu_img(&["create", "-f", "qcow2", qs, "4G"]);
    qemu_io(&["-f", "qcow2", "-c", "write -P 0x11 0 16M", "-c", "write -P 0x22 4080M 16M", qs]);
    let img = st.upload_ok("warm4g", &q);
    let id = img.id.as_str();
    let t0 = Instant::now();
    let cold = st.create_volume(id, None);
    let cold_s = t0.elapsed().as_secs_f64();
    assert!(!cold.cache_hit, "{cold:?}");
    let mut times = Vec::new();
    for _ in 0..21 {
        let t0 = Instant::now();
        let v = st.create_volume(id, None);
        times.push(t0.elapsed().as_secs_f64() * 1000.0);
        assert_eq!((v.status, v.cache_hit), (plasmavmc::model::Status::Available, true), "{v:?}");
    }
    let p50 = median(&times);
    show(&format!(
        "warm CreateVolume 4 GiB virtual: p50 {} ms over 21; the cold one took {cold_s:.2} s",
        spread(&times)
    ));
    assert!(p50 < 100.0, "warm CreateVolume p50 {p50:.1} ms at 4 GiB virtual, over the 100 ms ceiling");
}
