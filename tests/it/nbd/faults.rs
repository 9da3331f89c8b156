//! A replicated CoronaFS volume under a seeded, randomized schedule of
//! faults: three `coronafs serve` nodes as child processes on loopback (the
//! bench's failover cluster: heartbeat 250 ms, failover and lease 1.5 s),
//! one volume with 3 copies, four writers of self-describing 4 KiB blocks
//! with a FLUSH every ~20 writes and some FUA writes, each reconnecting to
//! whichever node is primary. One fault at a time: SIGKILL of the primary
//! (restarted 3-8 s later), SIGKILL of a copy, SIGSTOP of a node for 2-5 s
//! (longer than the lease when it is the primary), and the primary killed
//! again while a copy it just restarted catches up. Afterwards every node
//! runs again, and the whole history is checked: every block holds its last
//! flushed write or a later one of its writer, whole (no torn or foreign
//! content), and every copy holds the same bytes.
//!
//! `CORONAFS_FAULT_SEED` replays a schedule (the seed is printed);
//! `CORONAFS_FAULT_SECS` runs it longer (60 s by default).

use bench::cluster::corona_procs::CoronaProcs;
use bench::fault::{Fault, FaultDriver, FaultKind};
use coronafs::client::NbdClient;
use stack_tests::bin;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;
const WRITERS: u64 = 4;
/// Blocks each writer owns (writer `w` owns blocks `w, w + 4, w + 8, ...`).
const OWN: u64 = 64;
const SIZE: u64 = 16 << 20;

/// A small, seedable generator (splitmix64): the schedule must replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo))
    }
}

/// A block's content: block, writer, sequence number, a checksum of those,
/// then a fill derived from them.
fn block(b: u64, writer: u64, seq: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    v[0..8].copy_from_slice(&b.to_be_bytes());
    v[8..16].copy_from_slice(&writer.to_be_bytes());
    v[16..24].copy_from_slice(&seq.to_be_bytes());
    let sum = b.wrapping_mul(31).wrapping_add(writer.wrapping_mul(17)).wrapping_add(seq.wrapping_mul(7)) ^ 0x5a5a;
    v[24..32].copy_from_slice(&sum.to_be_bytes());
    for (i, x) in v[32..].iter_mut().enumerate() {
        *x = (i as u64).wrapping_mul(seq | 1).wrapping_add(b) as u8;
    }
    v
}

/// What a block read back says: `(writer, seq)`, `None` for never written
/// (zeroes); `Err` for anything else (torn, foreign, another block's).
fn decode(b: u64, v: &[u8]) -> Result<Option<(u64, u64)>, String> {
    if v.iter().all(|x| *x == 0) {
        return Ok(None);
    }
    let word = |i: usize| u64::from_be_bytes(v[i..i + 8].try_into().expect("8 bytes"));
    let (at, writer, seq) = (word(0), word(8), word(16));
    if at != b || writer != b % WRITERS || block(b, writer, seq) != v {
        return Err(format!("block {b}: torn or foreign content (says block {at}, writer {writer}, seq {seq})"));
    }
    Ok(Some((writer, seq)))
}

/// Per block: the last sequence number a FLUSH or FUA acknowledged, and
/// the highest one ever sent.
#[derive(Debug, Default, Clone, Copy)]
struct Known {
    flushed: u64,
    sent: u64,
}

#[derive(Default)]
struct History {
    blocks: Mutex<BTreeMap<u64, Known>>,
    acked_writes: AtomicU64,
    acked_flushes: AtomicU64,
    failed: AtomicU64,
    /// (since the run started, ms) of every acknowledged flush.
    flush_times: Mutex<Vec<u64>>,
}

/// The export to open on the node some reachable API names the primary:
/// `vm;epoch=N` with the primary's epoch.
async fn export(procs: &CoronaProcs) -> Option<String> {
    for n in &procs.file.nodes {
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", n.api));
        let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(1), api.cluster_map()).await else { continue };
        let Some(vm) = m.volumes.get("vm") else { continue };
        let Some(p) = procs.file.nodes.iter().find(|x| x.name == vm.primary) else { continue };
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", p.api));
        if let Ok(Ok(info)) = tokio::time::timeout(Duration::from_secs(1), api.get("vm")).await {
            return Some(format!("vm;epoch={}", info.epoch));
        }
    }
    None
}

async fn writer(w: u64, seed: u64, procs: Arc<CoronaProcs>, hist: Arc<History>, stop: Arc<AtomicBool>, t0: Instant) {
    let mut rng = Rng(seed ^ (w + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let nodes: Vec<std::net::SocketAddr> = procs.file.nodes.iter().map(|n| n.nbd).collect();
    let mut seq = 0u64;
    let mut client: Option<NbdClient> = None;
    // Written on this connection since its last acknowledged flush.
    let mut pending: Vec<(u64, u64)> = Vec::new();
    while !stop.load(SeqCst) {
        let c = match &client {
            Some(c) => c,
            None => {
                pending.clear();
                let conn = match export(&procs).await {
                    Some(e) => {
                        tokio::time::timeout(Duration::from_secs(5), NbdClient::connect_primary(&nodes, &e)).await
                    }
                    None => Ok(Err(coronafs::CoronaError::Disconnected)),
                };
                match conn {
                    Ok(Ok((c, _))) => client.insert(c),
                    _ => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
            }
        };
        let b = w + WRITERS * rng.below(OWN);
        seq += 1;
        let fua = rng.below(10) == 0;
        {
            let mut blocks = hist.blocks.lock().expect("history");
            let k = blocks.entry(b).or_default();
            k.sent = k.sent.max(seq);
        }
        let r = tokio::time::timeout(Duration::from_secs(10), c.write(b * BLOCK as u64, &block(b, w, seq), fua)).await;
        match r {
            Ok(Ok(())) => {
                hist.acked_writes.fetch_add(1, SeqCst);
                pending.push((b, seq));
                if fua {
                    let mut blocks = hist.blocks.lock().expect("history");
                    let k = blocks.entry(b).or_default();
                    k.flushed = k.flushed.max(seq);
                }
            }
            _ => {
                hist.failed.fetch_add(1, SeqCst);
                client = None;
                continue;
            }
        }
        if rng.below(20) == 0 {
            match tokio::time::timeout(Duration::from_secs(10), c.flush()).await {
                Ok(Ok(())) => {
                    hist.acked_flushes.fetch_add(1, SeqCst);
                    hist.flush_times.lock().expect("times").push(t0.elapsed().as_millis() as u64);
                    let mut blocks = hist.blocks.lock().expect("history");
                    for (b, s) in pending.drain(..) {
                        let k = blocks.entry(b).or_default();
                        k.flushed = k.flushed.max(s);
                    }
                }
                _ => {
                    hist.failed.fetch_add(1, SeqCst);
                    client = None;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // A last flush so the end state is known.
    if let Some(c) = client
        && let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(10), c.flush()).await
    {
        let mut blocks = hist.blocks.lock().expect("history");
        for (b, s) in pending.drain(..) {
            let k = blocks.entry(b).or_default();
            k.flushed = k.flushed.max(s);
        }
    }
}

/// The primary's index as some node's map names it.
async fn primary(procs: &CoronaProcs) -> Option<usize> {
    for n in &procs.file.nodes {
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", n.api));
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_secs(1), api.cluster_map()).await
            && let Some(vm) = m.volumes.get("vm")
        {
            return procs.file.nodes.iter().position(|x| x.name == vm.primary);
        }
    }
    None
}

fn fault(kind: FaultKind, procs: &CoronaProcs, i: usize) -> Fault {
    Fault::new(kind, "coronafs", &procs.file.nodes[i].name).expect("fault")
}

#[test]
fn under_a_seeded_schedule_of_kills_and_pauses_no_flushed_write_is_lost_and_the_copies_agree() {
    let _gate = crate::gate::shared();
    bin("bench", "bench");
    let seed: u64 = std::env::var("CORONAFS_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(20_261_202);
    let secs: u64 = std::env::var("CORONAFS_FAULT_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    eprintln!("fault schedule: seed {seed}, {secs} s (CORONAFS_FAULT_SEED / CORONAFS_FAULT_SECS to replay or extend)");
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let procs = Arc::new(rt.block_on(CoronaProcs::start(dir.path())).expect("start 3 CoronaFS nodes"));
    let hist = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut rng = Rng(seed);
    let t0 = Instant::now();
    let mut log = Vec::new();
    rt.block_on(async {
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", procs.file.nodes[0].api));
        let req =
            coronafs::dto::CreateVolume { name: "vm".into(), size: Some(SIZE), from_snapshot: None, replicas: Some(3) };
        api.create_volume(&req).await.expect("a volume with 3 copies");
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| tokio::spawn(writer(w, seed, procs.clone(), hist.clone(), stop.clone(), t0)))
            .collect();
        let until = t0 + Duration::from_secs(secs);
        let mut faults = 0;
        tokio::time::sleep(Duration::from_secs(2)).await;
        while Instant::now() + Duration::from_secs(8) < until {
            let p = primary(&procs).await.unwrap_or(0);
            let other = (p + 1 + rng.below(2) as usize) % 3;
            let at = t0.elapsed().as_secs_f64();
            match rng.below(4) {
                0 => {
                    let f = fault(FaultKind::Kill, &procs, p);
                    procs.inject(&f).await.expect("kill");
                    let down = rng.millis(3_000, 8_000);
                    log.push(format!("{at:.1}s kill primary n{} for {down:?}", p + 1));
                    tokio::time::sleep(down).await;
                    procs.heal(&f).await.expect("restart");
                }
                1 => {
                    let f = fault(FaultKind::Kill, &procs, other);
                    procs.inject(&f).await.expect("kill");
                    let down = rng.millis(3_000, 8_000);
                    log.push(format!("{at:.1}s kill copy n{} for {down:?}", other + 1));
                    tokio::time::sleep(down).await;
                    procs.heal(&f).await.expect("restart");
                }
                2 => {
                    let who = if rng.below(2) == 0 { p } else { other };
                    let f = fault(FaultKind::Pause, &procs, who);
                    procs.inject(&f).await.expect("pause");
                    let down = rng.millis(2_000, 5_000);
                    log.push(format!(
                        "{at:.1}s pause n{}{} for {down:?}",
                        who + 1,
                        if who == p { " (primary)" } else { "" }
                    ));
                    tokio::time::sleep(down).await;
                    procs.heal(&f).await.expect("resume");
                }
                _ => {
                    // A copy restarted, and the primary killed while it catches up.
                    let f = fault(FaultKind::Kill, &procs, other);
                    procs.inject(&f).await.expect("kill");
                    tokio::time::sleep(rng.millis(2_000, 4_000)).await;
                    procs.heal(&f).await.expect("restart");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let g = fault(FaultKind::Kill, &procs, p);
                    procs.inject(&g).await.expect("kill");
                    let down = rng.millis(3_000, 8_000);
                    log.push(format!(
                        "{at:.1}s kill copy n{}, restart it, kill primary n{} during its catch-up for {down:?}",
                        other + 1,
                        p + 1
                    ));
                    tokio::time::sleep(down).await;
                    procs.heal(&g).await.expect("restart");
                }
            }
            faults += 1;
            tokio::time::sleep(rng.millis(3_000, 6_000)).await;
        }
        // Healed: writes go on for a while, then stop.
        tokio::time::sleep(Duration::from_secs(5)).await;
        stop.store(true, SeqCst);
        for w in writers {
            w.await.expect("writer");
        }
        assert!(faults >= 3, "only {faults} faults in {secs} s");
    });
    for l in &log {
        eprintln!("  {l}");
    }
    let known = hist.blocks.lock().expect("history").clone();
    let flushes = hist.flush_times.lock().expect("times").clone();
    let longest = flushes.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    eprintln!(
        "history: {} writes and {} flushes acknowledged, {} requests failed (a fault's window); {} blocks written; \
         longest gap between acknowledged flushes {longest} ms",
        hist.acked_writes.load(SeqCst),
        hist.acked_flushes.load(SeqCst),
        hist.failed.load(SeqCst),
        known.len()
    );
    assert!(hist.acked_flushes.load(SeqCst) > 20, "too few flushes acknowledged to say anything");
    // The volume is writable at the end: flushes were acknowledged in the
    // healed tail.
    let end = t0.elapsed().as_millis() as u64;
    assert!(flushes.last().is_some_and(|t| end - t < 15_000), "no flush acknowledged in the last 15 s");
    // Every copy in sync, then every copy's bytes read from its data dir.
    rt.block_on(async {
        let t = Instant::now();
        loop {
            let mut all = true;
            for n in &procs.file.nodes {
                let api = coronafs::api_client::ApiClient::new(&format!("http://{}", n.api));
                let in_sync = api.cluster_map().await.ok().and_then(|m| m.volumes.get("vm").map(|v| v.in_sync.len()));
                all &= in_sync == Some(3);
            }
            if all {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(90), "the copies were not all in sync 90 s after the faults");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let procs = Arc::into_inner(procs).expect("no writer holds the cluster");
    rt.block_on(procs.stop());
    let mut images = Vec::new();
    for n in &procs_names(dir.path()) {
        let v =
            coronafs::volume::Volumes::load(n.clone(), coronafs::backend::Opener::Threads, true).expect("load copy");
        let e = v.open("vm").expect("open the copy");
        let (r, buf) = rt.block_on(coronafs::backend::BlockBackend::read_at(&e.backend, vec![0; SIZE as usize], 0));
        r.expect("read the copy");
        images.push((n.display().to_string(), buf));
    }
    assert_eq!(images.len(), 3, "three data dirs");
    let mut lost = Vec::new();
    for (b, k) in &known {
        let at = *b as usize * BLOCK;
        match decode(*b, &images[0].1[at..at + BLOCK]) {
            Err(e) => lost.push(e),
            Ok(got) => {
                let seq = got.map_or(0, |(_, s)| s);
                if seq < k.flushed {
                    lost.push(format!("block {b}: holds seq {seq}, older than its last flushed write {}", k.flushed));
                }
                if seq > k.sent {
                    lost.push(format!("block {b}: holds seq {seq}, never sent (last sent {})", k.sent));
                }
            }
        }
    }
    assert!(lost.is_empty(), "seed {seed}: {} anomalies: {lost:#?}", lost.len());
    for (name, img) in &images[1..] {
        assert!(*img == images[0].1, "seed {seed}: the copy in {name} differs from the one in {}", images[0].0);
    }
}

/// The data dirs of the failover cluster under `base` (the last attempt's).
fn procs_names(base: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut attempts: Vec<_> = std::fs::read_dir(base).expect("base").flatten().map(|e| e.path()).collect();
    attempts.sort();
    let last = attempts.pop().expect("an attempt");
    let mut dirs: Vec<_> =
        std::fs::read_dir(&last).expect("attempt").flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    dirs
}
