//! Resync over in-memory replicas ([`MemConnector`]): a replica that was
//! away gets only the regions written meanwhile (also while it catches up)
//! and rejoins; one with no known history gets everything; the log's record
//! gains a region before the first write there is answered, once, and a
//! clean close says who is in sync.

use super::drl::{History, MIN_REGION};
use super::mem::MemConnector;
use super::resync::MemStore;
use super::*;
use crate::backend::memory::MemBackend;
use std::time::Instant;

const SIZE: u64 = 64 * MIN_REGION;
const MIB: u64 = MIN_REGION;

struct Fixture {
    backend: Replicated<MemBackend>,
    replicas: Vec<Arc<MemBackend>>,
    connector: Arc<MemConnector<MemBackend>>,
    store: Arc<MemStore>,
    metrics: Arc<Metrics>,
}

/// Primary and replicas n2, n3; `behind` start out of the live set.
fn fixture(rate: u64, behind: Vec<(String, History)>) -> Fixture {
    fixture_with(rate, behind, DEFAULT_ACK_TIMEOUT, &[])
}

/// The same with `ack_timeout`, and the replicas of `hanging` taking
/// frames and never answering from the start.
fn fixture_with(rate: u64, behind: Vec<(String, History)>, ack_timeout: Duration, hanging: &[&str]) -> Fixture {
    let replicas: Vec<_> = (0..2).map(|_| Arc::new(MemBackend::new(SIZE))).collect();
    let names = ["n2".to_owned(), "n3".to_owned()];
    let connector = Arc::new(MemConnector::new(names.iter().cloned().zip(replicas.iter().cloned())));
    connector.hanging.lock().expect("lock").extend(hanging.iter().map(|h| h.to_string()));
    let links = names
        .iter()
        .filter(|n| !behind.iter().any(|(b, _)| b == *n))
        .map(|n| connector.connect(n, false, 1, 0, 0).expect("link"))
        .collect();
    let metrics = Arc::new(Metrics::default());
    let store = Arc::new(MemStore::default());
    let policy = ReplicationPolicy { write_quorum: 2, epoch: 0, ack_timeout };
    let resync = Resync { connector: connector.clone(), store: store.clone(), rate, retry: Duration::from_millis(20) };
    let backend = Replicated::new(MemBackend::new(SIZE), links, policy, 1, metrics.clone())
        .with_resync(resync, behind, Default::default())
        .start();
    Fixture { backend, replicas, connector, store, metrics }
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed) | 1).collect()
}

async fn image<B: BlockBackend>(b: &B) -> Vec<u8> {
    let (r, buf) = b.read_at(vec![0; SIZE as usize], 0).await;
    r.expect("read");
    buf
}

async fn write(f: &Fixture, offset: u64, len: u64, seed: u8) {
    let (r, _) = f.backend.write_at(data(len as usize, seed), offset, false).await;
    r.expect("write");
}

/// Waits (at most 20 s) until `peer` is live again.
async fn until_live(f: &Fixture, peer: &str) {
    let start = Instant::now();
    while !f.backend.live_replicas().await.iter().any(|p| p == peer) {
        assert!(start.elapsed() < Duration::from_secs(20), "{peer} did not rejoin");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Takes `peer` away: unreachable, and its live link dies.
fn take_away(f: &Fixture, peer: &str) {
    f.connector.set_offline(peer, true);
    for (p, _, l) in f.connector.opened.lock().expect("lock").iter() {
        if p == peer {
            l.kill();
        }
    }
}

async fn state(f: &Fixture, peer: &str) -> PeerState {
    let states = f.backend.handle().states().await;
    states.into_iter().find(|(p, _)| p == peer).expect("a replica of that name").1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_was_away_gets_only_the_three_regions_written_meanwhile_and_then_equals_the_primary() {
    let f = fixture(0, Vec::new());
    for g in 0..64 {
        write(&f, g * MIB, MIB, g as u8).await;
    }
    f.backend.flush().await.expect("flush on 3 of 3");
    take_away(&f, "n2");
    // Three regions change while n2 is away (one write spans two of them).
    write(&f, 5 * MIB + 100, 4096, 101).await;
    write(&f, 21 * MIB - 2048, 4096, 102).await;
    f.backend.flush().await.expect("flush on 2 of 3");
    assert_eq!(f.backend.live_replicas().await, ["n3"]);
    assert_eq!(state(&f, "n2").await, PeerState::Stale);
    assert_eq!(f.metrics.resync_bytes.load(Relaxed), 0);

    f.connector.set_offline("n2", false);
    until_live(&f, "n2").await;
    assert_eq!(f.metrics.resync_bytes.load(Relaxed), 3 * MIB, "regions 5, 20 and 21, not the 64 of the volume");
    assert_eq!(f.metrics.replicas_rejoined.load(Relaxed), 1);
    assert_eq!(state(&f, "n2").await, PeerState::InSync);
    // Live again: a new write reaches it with the stream.
    write(&f, 40 * MIB, 8192, 103).await;
    f.backend.flush().await.expect("flush on 3 of 3");
    let want = image(f.backend.local()).await;
    assert!(image(&*f.replicas[0]).await == want, "the returning replica differs from the primary");
    assert!(image(&*f.replicas[1]).await == want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_while_a_replica_catches_up_are_copied_in_a_later_pass_and_nothing_newer_is_overwritten() {
    // 24 MiB/s: the first pass over 24 regions takes about a second.
    let f = fixture(24 * MIB, Vec::new());
    f.backend.flush().await.expect("flush");
    take_away(&f, "n3");
    for g in 0..24 {
        write(&f, g * MIB, MIB, g as u8).await;
    }
    f.backend.flush().await.expect("flush on 2 of 3");
    f.connector.set_offline("n3", false);
    let start = Instant::now();
    while !matches!(state(&f, "n3").await, PeerState::CatchingUp { .. }) {
        assert!(start.elapsed() < Duration::from_secs(10), "no resync started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // During the pass: a region already copied (0), one not yet (23) and
    // one outside the first pass (50), each rewritten twice.
    for seed in [200, 201] {
        for g in [0, 23, 50] {
            write(&f, g * MIB + 512, 65536, seed + g as u8).await;
        }
    }
    until_live(&f, "n3").await;
    let copied = f.metrics.resync_bytes.load(Relaxed);
    assert!((24 * MIB..=27 * MIB).contains(&copied), "copied {copied} bytes for 24 regions and 3 rewritten");
    f.backend.flush().await.expect("flush on 3 of 3");
    assert!(image(&*f.replicas[1]).await == image(f.backend.local()).await, "the caught-up replica differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_no_known_history_gets_a_full_copy_and_is_then_tracked() {
    let f = fixture(0, vec![("n2".to_owned(), History::Unknown)]);
    // Garbage on n2 that no log knows about.
    let (r, _) = f.replicas[0].write_at(vec![0xEE; 3 * MIB as usize], 7 * MIB, false).await;
    r.expect("garbage");
    assert_eq!(f.backend.live_replicas().await, ["n3"]);
    write(&f, 0, MIB, 9).await;
    until_live(&f, "n2").await;
    let copied = f.metrics.resync_bytes.load(Relaxed);
    // Every region, zero ones included; region 0 once more if the write
    // above came while the first pass ran.
    assert!((SIZE..=SIZE + MIB).contains(&copied), "copied {copied}");
    f.backend.flush().await.expect("flush");
    assert!(image(&*f.replicas[0]).await == image(f.backend.local()).await);
    let rec = f.store.last.lock().expect("lock").clone().expect("a record");
    assert!(rec.untracked.is_empty(), "n2 is tracked after its full copy: {rec:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_is_recorded_once_before_its_first_write_is_answered_and_dropped_after_a_flush_of_every_copy() {
    let f = fixture(0, Vec::new());
    write(&f, 3 * MIB + 10, 100, 1).await;
    let rec = f.store.last.lock().expect("lock").clone().expect("recorded before the answer");
    assert!(rec.open);
    assert_eq!(rec.regions(SIZE), (3..11).collect(), "region 3 and the 7 after it, in one record write");
    let saves = f.store.saves.load(Relaxed);
    for i in 0..50 {
        write(&f, 3 * MIB + i * 4096, 4096, i as u8).await;
    }
    // A sequential writer through regions 4..=10 needs no record write either.
    for g in 4..11 {
        write(&f, g * MIB, MIB, g as u8).await;
    }
    assert_eq!(f.store.saves.load(Relaxed), saves, "rewriting a recorded region costs no record write");
    write(&f, 11 * MIB, 4096, 11).await;
    assert_eq!(f.store.saves.load(Relaxed), saves + 1, "region 11 is new: one record write");
    // Trimming runs at most once a second, after a flush every copy answered.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    f.backend.flush().await.expect("flush");
    let rec = f.store.last.lock().expect("lock").clone().expect("a record");
    assert!(rec.regions(SIZE).is_empty(), "every copy holds every region written: {rec:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_close_records_who_holds_everything_and_the_regions_the_others_lack() {
    let f = fixture(0, Vec::new());
    write(&f, 0, 4096, 1).await;
    f.backend.flush().await.expect("flush");
    take_away(&f, "n3");
    write(&f, 9 * MIB, 4096, 2).await;
    f.backend.handle().close().await.expect("close");
    let rec = f.store.last.lock().expect("lock").clone().expect("a record");
    assert!(!rec.open, "the mark is cleared");
    assert_eq!(rec.in_sync, ["n2"]);
    assert_eq!(rec.regions(SIZE), [9].into_iter().collect(), "what n3 lacks");
    let (r, _) = f.backend.write_at(data(10, 1), 0, false).await;
    assert!(r.is_err(), "a closed volume takes no write");
}

/// How many links were opened to `peer` so far (the first one included).
fn links_to(f: &Fixture, peer: &str) -> usize {
    f.connector.epochs.lock().expect("lock").iter().filter(|(p, _)| p == peer).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_opened_after_a_fence_carry_the_fenced_epoch() {
    let f = fixture(0, Vec::new());
    f.backend.raise_epoch(5);
    take_away(&f, "n3");
    write(&f, 0, 4096, 1).await;
    f.connector.set_offline("n3", false);
    until_live(&f, "n3").await;
    let epochs = f.connector.epochs.lock().expect("lock").clone();
    let later: Vec<u64> = epochs.iter().filter(|(p, _)| p == "n3").skip(1).map(|(_, e)| *e).collect();
    assert!(!later.is_empty() && later.iter().all(|&e| e == 5), "OPEN below the fence: {epochs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_keeps_failing_is_retried_with_growing_pauses() {
    // A retry every 20 ms without backoff would try about 75 times in 1.5 s.
    let f = fixture(0, Vec::new());
    take_away(&f, "n3");
    write(&f, 0, 4096, 1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // 20, 40, 80, 160, 320, 640 ms (jittered to half of each at least).
    let tries = links_to(&f, "n3") - 1;
    assert!((2..=12).contains(&tries), "{tries} attempts in 1.5 s");
    // Back in reach, it is taken back within the longest pause (640 ms).
    f.connector.set_offline("n3", false);
    until_live(&f, "n3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_a_copy_refuses_as_fenced_above_it_takes_no_write_and_stops_resyncing() {
    let f = fixture(0, Vec::new());
    write(&f, 0, 4096, 1).await;
    f.backend.flush().await.expect("flush on 3 of 3");
    // n3 voted in an election at epoch 5: it refuses this primary's stream.
    f.connector.fences.lock().expect("lock").insert("n3".into(), 5);
    for (p, _, l) in f.connector.opened.lock().expect("lock").iter() {
        if p == "n3" {
            l.refuse_fenced();
        }
    }
    let (r, _) = f.backend.write_at(data(4096, 2), 0, false).await;
    assert!(r.is_err(), "a deposed primary took a write");
    assert!(f.backend.handle().deposed());
    assert!(f.backend.flush().await.is_err(), "a deposed primary flushed");
    // n2 is still reachable, but the resync stops: n3 is not tried again.
    let tries = links_to(&f, "n3");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(links_to(&f, "n3") <= tries + 1, "the deposed primary kept resyncing");
}

#[test]
fn a_region_larger_than_a_frame_is_sent_in_pieces_of_at_most_a_frame() {
    use crate::replica::wire::MAX_PAYLOAD;
    // Above 32 TiB a region is larger than the largest frame.
    let region = super::drl::region_size(64 << 40);
    assert_eq!(region, 64 << 20);
    let p: Vec<(u64, u64)> = super::resync::pieces(7 * region, region).collect();
    assert_eq!(p, [(7 * region, MAX_PAYLOAD), (7 * region + MAX_PAYLOAD, MAX_PAYLOAD)]);
    // A region that fits is one piece; the last region may be short.
    assert_eq!(super::resync::pieces(0, MIB).collect::<Vec<_>>(), [(0, MIB)]);
    let p: Vec<(u64, u64)> = super::resync::pieces(0, MAX_PAYLOAD + 5).collect();
    assert_eq!(p, [(0, MAX_PAYLOAD), (MAX_PAYLOAD, 5)]);
    assert!(super::resync::pieces(0, 0).next().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_catches_up_while_a_writer_keeps_dirtying_more_regions_than_a_last_pass_takes() {
    let f = Arc::new(fixture(0, Vec::new()));
    take_away(&f, "n3");
    write(&f, 0, 4096, 1).await;
    // A writer that never pauses, over 40 regions round robin: every pass
    // finds all 40 dirty again, more than the 16 of a last pass.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (f, stop) = (f.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Relaxed) {
                let g = 10 + n % 40;
                write(&f, g * MIB + (n % 200) * 4096, 4096, n as u8).await;
                n += 1;
                if n % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            n
        })
    };
    f.connector.set_offline("n3", false);
    let start = Instant::now();
    while !f.backend.live_replicas().await.iter().any(|p| p == "n3") {
        assert!(start.elapsed() < Duration::from_secs(20), "n3 never caught up under the writer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Writes go on with n3 live; then everything flushed is on every copy.
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Relaxed);
    let n = writer.await.expect("writer");
    assert!(n > 100, "the writer barely ran ({n} writes)");
    f.backend.flush().await.expect("flush on 3 of 3");
    let want = image(f.backend.local()).await;
    assert!(image(&*f.replicas[1]).await == want, "the caught-up replica differs");
}

#[test]
fn the_last_pass_grows_only_while_passes_stop_shrinking_and_never_past_its_bound() {
    use super::resync::final_limit;
    assert_eq!(final_limit(16, usize::MAX, 1000, 64), 16, "a first pass says nothing");
    assert_eq!(final_limit(16, 1000, 40, 64), 16, "halved: writers fall behind the copy");
    assert_eq!(final_limit(16, 40, 40, 64), 50, "as many as before: the limit rises");
    assert_eq!(final_limit(16, 200, 200, 64), 64, "never past the bound");
    assert_eq!(final_limit(50, 40, 30, 64), 50, "never falls");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_is_back_rejoins_without_waiting_behind_one_that_hangs_and_a_flush_meanwhile_succeeds() {
    // As after a failover: both copies out of the live set, histories
    // unknown, one live copy of the two the quorum needs. n2, first in the
    // volume's order, takes the stream and never answers (the dead old
    // primary's node); n3 is there and gets a full copy (64 MiB, unthrottled).
    let ack = Duration::from_secs(2);
    let behind = vec![("n2".to_owned(), History::Unknown), ("n3".to_owned(), History::Unknown)];
    let f = fixture_with(0, behind, ack, &["n2"]);
    let t = Instant::now();
    f.backend.flush().await.expect("the flush waits for n3's catch-up, not behind n2's attempt");
    let took = t.elapsed();
    assert!(took < ack, "the flush took {took:?}, the ack timeout is {ack:?}");
    assert_eq!(f.backend.live_replicas().await, ["n3"]);
    assert_eq!(state(&f, "n2").await, PeerState::Stale, "n2 never answered its first FLUSH");
    assert!(image(&*f.replicas[1]).await == image(f.backend.local()).await, "n3 rejoined without the primary's bytes");
    write(&f, 3 * MIB, 4096, 7).await;
    f.backend.flush().await.expect("flush on 2 of 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_catch_up_at_once_and_share_the_volumes_throttle() {
    // Two full copies of 64 MiB at 64 MiB/s for the volume: about 2 s
    // together (1 s if each had a throttle of its own), both under way at once.
    let behind = vec![("n2".to_owned(), History::Unknown), ("n3".to_owned(), History::Unknown)];
    let start = Instant::now();
    let f = fixture(64 * MIB, behind);
    let mut both = false;
    while f.backend.live_replicas().await.len() < 2 {
        let s = f.backend.handle().states().await;
        both |= s.iter().all(|(_, s)| matches!(s, PeerState::CatchingUp { .. }));
        assert!(start.elapsed() < Duration::from_secs(20), "the copies did not rejoin: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = start.elapsed();
    assert!(both, "the two copies were never caught up at the same time");
    assert_eq!(f.metrics.resync_bytes.load(Relaxed), 2 * SIZE);
    assert!(took >= Duration::from_millis(1800), "128 MiB copied in {took:?}: faster than the volume's 64 MiB/s");
    f.backend.flush().await.expect("flush on 3 of 3");
    let want = image(f.backend.local()).await;
    assert!(image(&*f.replicas[0]).await == want && image(&*f.replicas[1]).await == want);
}
