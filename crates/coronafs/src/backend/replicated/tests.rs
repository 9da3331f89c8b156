//! The replicated backend over in-memory replicas ([`MemLink`]): FLUSH and
//! FUA put every answered write on every live replica, one dead replica of
//! three is survived, two are not (and nothing is written then), a stalled
//! replica is dropped after the timeout, an older epoch is refused, and a
//! model test of random writes, flushes and failures.

use super::mem::MemLink;
use super::*;
use crate::backend::memory::MemBackend;
use proptest::prelude::*;

const SIZE: u64 = 1 << 20;

struct Fixture {
    backend: Replicated<MemBackend>,
    replicas: Vec<Arc<MemBackend>>,
    links: Vec<Arc<MemLink>>,
    metrics: Arc<Metrics>,
}

fn fixture(copies: usize, quorum: usize, replica_fence: u64, timeout: Duration) -> Fixture {
    let replicas: Vec<_> = (1..copies).map(|_| Arc::new(MemBackend::new(SIZE))).collect();
    let links: Vec<_> = replicas
        .iter()
        .enumerate()
        .map(|(i, r)| Arc::new(MemLink::new(&format!("n{}", i + 2), r.clone(), 1, replica_fence)))
        .collect();
    let dyn_links = links.iter().map(|l| l.clone() as Arc<dyn ReplicaLink>).collect();
    let metrics = Arc::new(Metrics::default());
    let policy = ReplicationPolicy { write_quorum: quorum, epoch: 3, ack_timeout: timeout };
    let backend = Replicated::new(MemBackend::new(SIZE), dyn_links, policy, 1, metrics.clone());
    Fixture { backend, replicas, links, metrics }
}

fn three() -> Fixture {
    fixture(3, 2, 0, DEFAULT_ACK_TIMEOUT)
}

async fn image<B: BlockBackend>(b: &B) -> Vec<u8> {
    let (r, buf) = b.read_at(vec![0; SIZE as usize], 0).await;
    r.expect("read");
    buf
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_puts_every_answered_write_on_every_replica() {
    let f = three();
    for i in 0..50u64 {
        let (r, _) = f.backend.write_at(data(4096 + i as usize, i as u8), i * 9000, false).await;
        r.expect("write");
    }
    f.backend.write_zeroes(100, 5000, true, false).await.expect("zeroes");
    f.backend.trim(200_000, 8192).await.expect("trim");
    f.backend.flush().await.expect("flush");
    let want = image(f.backend.local()).await;
    assert!(want.iter().any(|&b| b != 0));
    for r in &f.replicas {
        assert!(image(&**r).await == want, "a replica differs from the primary after FLUSH");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_only_zero_is_refused_before_any_copy_changes() {
    let f = three();
    let (r, _) = f.backend.write_at(data(8192, 3), 0, false).await;
    r.expect("write");
    f.backend.flush().await.expect("flush");
    let before = image(f.backend.local()).await;
    let e = f.backend.write_zeroes(0, 8192, false, true).await.expect_err("fast only");
    assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
    f.backend.flush().await.expect("flush");
    assert!(image(f.backend.local()).await == before, "the primary changed");
    for r in &f.replicas {
        assert!(image(&**r).await == before, "a replica was zeroed by a refused fast zero");
    }
    // Without fast-only the same zeroes go everywhere.
    f.backend.write_zeroes(0, 8192, false, false).await.expect("zeroes");
    f.backend.flush().await.expect("flush");
    for r in &f.replicas {
        let (res, got) = r.read_at(vec![1; 8192], 0).await;
        res.expect("read");
        assert!(got.iter().all(|&b| b == 0));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fua_write_is_on_every_replica_when_it_is_answered() {
    let f = three();
    let (r, _) = f.backend.write_at(data(65536, 7), 4096, true).await;
    r.expect("fua write");
    for r in &f.replicas {
        let (res, got) = r.read_at(vec![0; 65536], 4096).await;
        res.expect("read");
        assert_eq!(got, data(65536, 7));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_replica_of_three_dead_writes_and_flushes_still_succeed() {
    let f = three();
    f.links[0].kill();
    let (r, _) = f.backend.write_at(data(4096, 1), 0, false).await;
    r.expect("write on 2 of 3");
    f.backend.flush().await.expect("flush on 2 of 3");
    assert_eq!(f.backend.live_replicas().await, vec!["n3".to_owned()]);
    assert_eq!(f.metrics.replicas_dropped.load(Relaxed), 1);
    assert_eq!(image(&*f.replicas[1]).await, image(f.backend.local()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_of_three_dead_writes_and_flushes_fail_and_nothing_is_written() {
    let f = three();
    let (r, _) = f.backend.write_at(data(4096, 1), 0, false).await;
    r.expect("write on 3 of 3");
    f.links[0].kill();
    f.links[1].kill();
    let before = image(f.backend.local()).await;
    let (r, _) = f.backend.write_at(data(4096, 2), 0, false).await;
    assert_eq!(r.expect_err("below the quorum").raw_os_error(), Some(libc::EIO));
    let (r, _) = f.backend.write_at(data(4096, 2), 8192, true).await;
    assert_eq!(r.expect_err("fua below the quorum").raw_os_error(), Some(libc::EIO));
    assert_eq!(f.backend.write_zeroes(0, 100, false, false).await.expect_err("zeroes").raw_os_error(), Some(libc::EIO));
    assert_eq!(f.backend.trim(0, 4096).await.expect_err("trim").raw_os_error(), Some(libc::EIO));
    assert_eq!(f.backend.flush().await.expect_err("flush").raw_os_error(), Some(libc::EIO));
    assert_eq!(image(f.backend.local()).await, before, "a refused write touched the primary");
    assert_eq!(f.metrics.replicas_dropped.load(Relaxed), 2);
    // Reads still work.
    let (r, _) = f.backend.read_at(vec![0; 4096], 0).await;
    r.expect("read below the quorum");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_answering_is_dropped_when_a_flush_times_out() {
    let f = fixture(3, 2, 0, Duration::from_millis(200));
    f.links[1].stall();
    let (r, _) = f.backend.write_at(data(4096, 1), 0, false).await;
    r.expect("write");
    let start = std::time::Instant::now();
    f.backend.flush().await.expect("flush on the two copies that answer");
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert_eq!(f.backend.live_replicas().await, vec!["n2".to_owned()]);
    // With quorum 3 the same stall fails the flush.
    let g = fixture(3, 3, 0, Duration::from_millis(100));
    g.links[0].stall();
    assert_eq!(g.backend.flush().await.expect_err("2 of 3 < 3").raw_os_error(), Some(libc::EIO));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_fenced_at_a_newer_epoch_refuse_the_primary() {
    // The primary writes at epoch 3; both replicas were fenced at 5.
    let f = fixture(3, 2, 5, DEFAULT_ACK_TIMEOUT);
    let (r, _) = f.backend.write_at(data(4096, 1), 0, false).await;
    r.expect("answered before the replicas refuse it");
    assert!(f.backend.flush().await.is_err(), "a flush no replica accepted");
    assert!(image(&*f.replicas[0]).await.iter().all(|&b| b == 0), "the fenced replica applied nothing");
    let (r, _) = f.backend.write_at(data(4096, 1), 0, false).await;
    assert!(r.is_err(), "no live replica is left");
}

#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, len: usize, seed: u8, fua: bool },
    Zeroes { offset: u64, len: u64 },
    Flush,
    Kill(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SIZE - 70_000, 1usize..70_000, any::<u8>(), any::<bool>())
            .prop_map(|(offset, len, seed, fua)| Op::Write { offset, len, seed, fua }),
        1 => (0..SIZE - 70_000, 1u64..70_000).prop_map(|(offset, len)| Op::Zeroes { offset, len }),
        2 => Just(Op::Flush),
        1 => (0usize..2).prop_map(Op::Kill),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Against a `Vec<u8>`: answered writes are what the primary reads;
    /// refused ones change nothing; after every successful FLUSH or FUA
    /// write, every live replica equals the model; operations succeed
    /// exactly when at least 2 of the 3 copies are live.
    #[test]
    fn random_writes_flushes_and_failures_match_a_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(async {
            let f = three();
            let mut model = vec![0u8; SIZE as usize];
            let mut dead = [false; 2];
            for op in ops {
                let live = 1 + dead.iter().filter(|d| !**d).count();
                let (ok, durable) = match op {
                    Op::Write { offset, len, seed, fua } => {
                        let (r, _) = f.backend.write_at(data(len, seed), offset, fua).await;
                        if r.is_ok() {
                            model[offset as usize..offset as usize + len].copy_from_slice(&data(len, seed));
                        }
                        (r.is_ok(), fua)
                    }
                    Op::Zeroes { offset, len } => {
                        let r = f.backend.write_zeroes(offset, len, true, false).await;
                        if r.is_ok() {
                            model[offset as usize..(offset + len) as usize].fill(0);
                        }
                        (r.is_ok(), false)
                    }
                    Op::Flush => (f.backend.flush().await.is_ok(), true),
                    Op::Kill(i) => {
                        f.links[i].kill();
                        dead[i] = true;
                        continue;
                    }
                };
                prop_assert_eq!(ok, live >= 2, "live copies {}", live);
                prop_assert!(image(f.backend.local()).await == model, "the primary differs from the model");
                if ok && durable {
                    for (i, r) in f.replicas.iter().enumerate() {
                        if !dead[i] {
                            prop_assert!(image(&**r).await == model, "live replica {} differs after a flush", i);
                        }
                    }
                }
            }
            Ok(())
        })?;
    }
}
