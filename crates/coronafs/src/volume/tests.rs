//! The volume manager against an in-memory model: random writes, snapshots,
//! clones, flattens, resizes, deletes and restarts over real files and redb.

use super::*;
use crate::backend::BlockBackend;
use proptest::prelude::*;
use std::collections::BTreeMap;

const KIB: u64 = 1024;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn load(dir: &Path) -> Volumes {
    Volumes::load(dir.to_path_buf(), Opener::Threads, false).expect("load volumes")
}

async fn read_all(v: &Volumes, export: &str) -> Vec<u8> {
    let e = v.open(export).expect("open export");
    let size = e.backend.size();
    let (r, buf) = e.backend.read_at(vec![0; size as usize], 0).await;
    r.expect("read");
    buf
}

async fn write(v: &Volumes, vol: &str, off: u64, data: Vec<u8>) {
    let e = v.open(vol).expect("open");
    e.backend.write_at(data, off, false).await.0.expect("write");
}

#[derive(Debug, Clone)]
enum Op {
    Write { vol: usize, off: u64, len: u64, seed: u8 },
    Snapshot { vol: usize },
    Clone { snap: usize, grow: u64 },
    Flatten { vol: usize },
    Resize { vol: usize, size: u64 },
    DeleteSnapshot { snap: usize },
    DeleteVolume { vol: usize },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<usize>(), 0..512 * KIB, 1..150 * KIB, any::<u8>()).prop_map(|(vol, off, len, seed)| Op::Write { vol, off, len, seed }),
        3 => any::<usize>().prop_map(|vol| Op::Snapshot { vol }),
        3 => (any::<usize>(), prop_oneof![Just(0u64), 1..200 * KIB]).prop_map(|(snap, grow)| Op::Clone { snap, grow }),
        1 => any::<usize>().prop_map(|vol| Op::Flatten { vol }),
        1 => (any::<usize>(), 64 * KIB..768 * KIB).prop_map(|(vol, size)| Op::Resize { vol, size }),
        1 => any::<usize>().prop_map(|snap| Op::DeleteSnapshot { snap }),
        1 => any::<usize>().prop_map(|vol| Op::DeleteVolume { vol }),
        1 => Just(Op::Restart),
    ]
}

fn pick(m: &BTreeMap<String, Vec<u8>>, i: usize) -> Option<&String> {
    if m.is_empty() { None } else { m.keys().nth(i % m.len()) }
}

fn files_match_the_catalog(v: &Volumes) {
    if let Err(e) = v.verify() {
        panic!("{e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn volumes_snapshots_and_clones_match_the_model(ops in prop::collection::vec(op(), 1..30)) {
        let dir = tempfile::tempdir().expect("tmp");
        let rt = rt();
        rt.block_on(async {
            let mut v = load(dir.path());
            let mut vols: BTreeMap<String, Vec<u8>> = BTreeMap::new();
            let mut snaps: BTreeMap<String, Vec<u8>> = BTreeMap::new();
            v.create("base", 512 * KIB).await.expect("create");
            vols.insert("base".into(), vec![0; 512 * KIB as usize]);
            for (n, op) in ops.iter().enumerate() {
                match *op {
                    Op::Write { vol, off, len, seed } => {
                        let Some(name) = pick(&vols, vol).cloned() else { continue };
                        let m = vols.get_mut(&name).expect("model");
                        let off = off.min(m.len() as u64 - 1);
                        let len = len.min(m.len() as u64 - off);
                        let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_add(seed) | 1).collect();
                        m[off as usize..(off + len) as usize].copy_from_slice(&data);
                        write(&v, &name, off, data).await;
                    }
                    Op::Snapshot { vol } => {
                        let Some(name) = pick(&vols, vol).cloned() else { continue };
                        let s = format!("s{n}");
                        let info = v.snapshot(&name, &s).await.expect("snapshot");
                        assert_eq!(info.nbd_export, snap_key(&name, &s));
                        snaps.insert(snap_key(&name, &s), vols[&name].clone());
                    }
                    Op::Clone { snap, grow } => {
                        let Some(key) = pick(&snaps, snap).cloned() else { continue };
                        let c = format!("c{n}");
                        let mut m = snaps[&key].clone();
                        let size = m.len() as u64 + grow;
                        let info = v.clone_snapshot(&c, &key, Some(size)).await.expect("clone");
                        assert_eq!(info.parent.as_deref(), Some(key.as_str()));
                        m.resize(size as usize, 0);
                        vols.insert(c, m);
                    }
                    Op::Flatten { vol } => {
                        let Some(name) = pick(&vols, vol).cloned() else { continue };
                        let info = v.flatten(&name).await.expect("flatten");
                        assert!(info.parent.is_none());
                    }
                    Op::Resize { vol, size } => {
                        let Some(name) = pick(&vols, vol).cloned() else { continue };
                        v.resize(&name, size, true).await.expect("resize");
                        vols.get_mut(&name).expect("model").resize(size as usize, 0);
                    }
                    Op::DeleteSnapshot { snap } => {
                        let Some(key) = pick(&snaps, snap).cloned() else { continue };
                        let (vol, s) = parse_snap(&key).expect("key");
                        v.delete_snapshot(vol, s, true).await.expect("delete snapshot");
                        snaps.remove(&key);
                    }
                    Op::DeleteVolume { vol } => {
                        let Some(name) = pick(&vols, vol).cloned() else { continue };
                        v.delete(&name, true).await.expect("delete");
                        vols.remove(&name);
                        snaps.retain(|k, _| !k.starts_with(&format!("{name}@")));
                    }
                    Op::Restart => {
                        v.flush_all().await;
                        drop(v);
                        v = load(dir.path());
                    }
                }
                files_match_the_catalog(&v);
            }
            for (name, m) in &vols {
                assert!(read_all(&v, name).await == *m, "volume {name} differs from the model");
            }
            for (key, m) in &snaps {
                assert!(read_all(&v, key).await == *m, "snapshot {key} differs from the model");
            }
            v.flush_all().await;
            drop(v);
            let v = load(dir.path());
            files_match_the_catalog(&v);
            for (name, m) in &vols {
                assert!(read_all(&v, name).await == *m, "volume {name} differs after a restart");
            }
        });
    }
}

#[test]
fn errors_name_the_problem() {
    let dir = tempfile::tempdir().expect("tmp");
    rt().block_on(async {
        let v = load(dir.path());
        v.create("a", 1 << 20).await.expect("create");
        let status = |r: Result<VolumeInfo>| r.expect_err("must fail").http_status();
        assert_eq!(status(v.create("a", 1 << 20).await), 409);
        assert_eq!(status(v.create("../x", 1 << 20).await), 400);
        assert_eq!(status(v.create("b", 0).await), 400);
        assert_eq!(status(v.clone_snapshot("b", "a@none", None).await), 404);
        assert_eq!(status(v.clone_snapshot("b", "no-at-sign", None).await), 400);
        v.snapshot("a", "s").await.expect("snapshot");
        assert_eq!(v.snapshot("a", "s").await.expect_err("dup").http_status(), 409);
        assert_eq!(status(v.clone_snapshot("b", "a@s", Some(1000)).await), 400, "smaller than the snapshot");
        v.clone_snapshot("b", "a@s", None).await.expect("clone");
        assert_eq!(status(v.resize("a", 4096, false).await), 400, "shrink needs allow_shrink");
        let e = v.delete("a", false).await.expect_err("has clones");
        assert_eq!(e.http_status(), 409);
        assert!(e.to_string().contains("has clones (b)"), "{e}");
        let e = v.delete_snapshot("a", "s", false).await.expect_err("has clones");
        assert!(e.to_string().contains("has clones"), "{e}");
        let held = v.open("b").expect("open");
        held.connections.fetch_add(1, Ordering::Relaxed);
        let e = v.delete("b", false).await.expect_err("in use");
        assert!(e.to_string().contains("in use"), "{e}");
        // Force: the parent goes, the clone keeps reading through its layers.
        write(&v, "a", 0, vec![7; 4096]).await;
        v.delete("a", true).await.expect("forced delete");
        assert_eq!(read_all(&v, "b").await[..4096], [0; 4096]);
        assert_eq!(status(v.info("a")), 404);
        v.delete("b", true).await.expect("delete in use with force");
        let (r, _) = held.backend.read_at(vec![0; 512], 0).await;
        assert!(r.is_err(), "a deleted volume's connections get errors");
        files_match_the_catalog(&v);
        assert!(v.catalog().expect("cat").layers.is_empty(), "everything freed");
    });
}

#[test]
fn a_4_gib_clone_is_made_in_well_under_100_ms() {
    let dir = tempfile::tempdir().expect("tmp");
    rt().block_on(async {
        let v = load(dir.path());
        v.create("img", 4 << 30).await.expect("create");
        write(&v, "img", 1 << 30, vec![5; 1 << 20]).await;
        v.snapshot("img", "gold").await.expect("snapshot");
        let t = std::time::Instant::now();
        let info = v.clone_snapshot("vm", "img@gold", None).await.expect("clone");
        let took = t.elapsed();
        assert!(took < std::time::Duration::from_millis(100), "clone took {took:?}");
        assert_eq!(info.size, 4 << 30);
        assert!(info.allocated_bytes < 64 << 10, "a clone costs no data space");
        let e = v.open("vm").expect("open");
        let (r, b) = e.backend.read_at(vec![0; 4096], 1 << 30).await;
        r.expect("read");
        assert_eq!(b, vec![5; 4096], "reads fall through to the snapshot");
    });
}

#[test]
fn a_fence_is_persisted_never_goes_back_and_survives_snapshots_and_restarts() {
    let dir = tempfile::tempdir().expect("tmp");
    let rt = rt();
    rt.block_on(async {
        let v = load(dir.path());
        v.create("vm", 256 * KIB).await.expect("create");
        assert_eq!(v.info("vm").expect("info").epoch, 0);
        // Open first: the raise reaches the open export too.
        let (e, declared) = v.open_export("vm;epoch=3").expect("open with an epoch");
        assert_eq!(declared, Some(3));
        assert_eq!(v.fence("vm", 3).await.expect("fence").epoch, 3);
        assert_eq!(e.fence.current(), 3);
        assert!(matches!(v.fence("vm", 2).await, Err(CoronaError::Conflict(_))));
        assert_eq!(v.fence("vm", 3).await.expect("same epoch again").epoch, 3);
        v.snapshot("vm", "s").await.expect("snapshot");
        assert_eq!(v.info("vm").expect("info").epoch, 3, "a snapshot keeps the epoch");
        assert!(v.open_export("vm@s;epoch=3").is_err(), "snapshots take no epoch");
        assert!(v.open_export("vm;epoch=x").is_err());
        assert!(matches!(v.fence("nope", 1).await, Err(CoronaError::NotFound(_))));
        v.clone_snapshot("c", "vm@s", None).await.expect("clone");
        assert_eq!(v.info("c").expect("info").epoch, 0, "a clone starts its own epochs");
    });
    let v = load(dir.path());
    assert_eq!(v.info("vm").expect("info").epoch, 3, "the epoch survives a restart");
    assert_eq!(v.open("vm").expect("open").fence.current(), 3);
}

/// Every volume and snapshot with its size and bytes: what a change that
/// failed must leave as it was.
async fn state(v: &Volumes) -> BTreeMap<String, Vec<u8>> {
    let cat = v.catalog().expect("catalog");
    let mut s = BTreeMap::new();
    for name in cat.volumes.keys().chain(cat.snapshots.keys()) {
        s.insert(name.clone(), read_all(v, name).await);
    }
    s
}

/// Volume `a` with data and snapshot `a@s`, clone `c` of it with data of its own.
async fn fault_fixture(v: &Volumes) {
    v.create("a", 256 * KIB).await.expect("create");
    write(v, "a", 1000, vec![1; 70 * KIB as usize]).await;
    v.snapshot("a", "s").await.expect("snapshot");
    write(v, "a", 0, vec![2; 4096]).await;
    v.clone_snapshot("c", "a@s", None).await.expect("clone");
    write(v, "c", 128 * KIB, vec![3; 4096]).await;
}

type Change = for<'a> fn(&'a Volumes) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + 'a>>;

const CHANGES: [(&str, Change); 7] = [
    ("create", |v| Box::pin(async { v.create("n", 128 * KIB).await.map(|_| ()) })),
    ("clone", |v| Box::pin(async { v.clone_snapshot("n", "a@s", Some(300 * KIB)).await.map(|_| ()) })),
    ("snapshot", |v| Box::pin(async { v.snapshot("c", "t").await.map(|_| ()) })),
    ("flatten", |v| Box::pin(async { v.flatten("c").await.map(|_| ()) })),
    ("resize", |v| Box::pin(async { v.resize("a", 192 * KIB, true).await.map(|_| ()) })),
    ("delete", |v| Box::pin(async { v.delete("a", true).await })),
    ("delete snapshot", |v| Box::pin(async { v.delete_snapshot("a", "s", true).await })),
];

#[test]
fn a_change_failing_at_any_step_leaves_catalog_and_files_in_agreement_and_blocks_nothing() {
    let rt = rt();
    for (what, change) in CHANGES {
        let mut fired_somewhere = false;
        for step in 0.. {
            let dir = tempfile::tempdir().expect("tmp");
            let (fired, seen) = rt.block_on(async {
                let v = load(dir.path());
                fault_fixture(&v).await;
                let before = state(&v).await;
                v.faults.arm(step, libc::EIO);
                let r = change(&v).await;
                let seen = v.faults.seen();
                let Some(at) = v.faults.disarm() else {
                    r.unwrap_or_else(|e| panic!("{what} failed without a fault: {e}"));
                    return (None, seen);
                };
                let ctx = format!("{what}, fault at step {step} ({at}), steps {seen:?}");
                if let Err(e) = v.verify() {
                    panic!("{ctx}: {e}");
                }
                let after = state(&v).await;
                match &r {
                    Err(_) => assert!(after == before, "{ctx}: a failed change altered volumes or snapshots"),
                    // A fault after the commit point: the change is done.
                    Ok(()) => assert!(after != before || what == "flatten", "{ctx}: reported done but not done"),
                }
                // Later changes go through, and the same change can be retried.
                v.create("later", 64 * KIB).await.unwrap_or_else(|e| panic!("{ctx}: later create: {e}"));
                v.snapshot("later", "x").await.unwrap_or_else(|e| panic!("{ctx}: later snapshot: {e}"));
                v.clone_snapshot("later2", "later@x", None).await.unwrap_or_else(|e| panic!("{ctx}: later clone: {e}"));
                if r.is_err() {
                    change(&v).await.unwrap_or_else(|e| panic!("{ctx}: retry: {e}"));
                }
                if let Err(e) = v.verify() {
                    panic!("{ctx}, after later changes: {e}");
                }
                let live = state(&v).await;
                v.flush_all().await;
                drop(v);
                let v = load(dir.path());
                if let Err(e) = v.verify() {
                    panic!("{ctx}, after a restart: {e}");
                }
                assert!(state(&v).await == live, "{ctx}: a restart changed what the volumes hold");
                (Some(at), seen)
            });
            match fired {
                Some(_) => fired_somewhere = true,
                None => {
                    assert!(fired_somewhere, "{what}: no step could fail ({seen:?})");
                    break;
                }
            }
        }
    }
}

#[test]
fn a_volume_too_large_for_the_file_system_is_refused_with_507_and_leaves_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    rt().block_on(async {
        let v = load(dir.path());
        // ext4 refuses files over 16 TiB with EFBIG at the sizing step.
        v.faults.arm(1, libc::EFBIG);
        let e = v.create("big", 17 << 40).await.expect_err("too large");
        assert_eq!(v.faults.disarm(), Some("size data file"));
        assert_eq!(e.http_status(), 507, "{e}");
        assert!(e.to_string().contains("file system"), "the message says why: {e}");
        if let Err(e) = v.verify() {
            panic!("{e}");
        }
        v.create("big", 1 << 20).await.expect("a later create");
        v.snapshot("big", "s").await.expect("a later snapshot");
        v.clone_snapshot("c", "big@s", None).await.expect("a later clone");
        if let Err(e) = v.verify() {
            panic!("{e}");
        }
    });
}
