//! Snapshots of replicated volumes end to end: three `coronafs serve` nodes
//! in one process over loopback (the resync tests' [`Nodes`]), a volume
//! with three copies on n1, n2, n3. A snapshot is taken at one point of the
//! write stream on every live copy; a copy that was down is named as
//! missing it; refused requests change no copy; a clone of such a snapshot
//! with one copy is an ordinary volume on the primary (with more copies:
//! `copies_tests.rs`).

use super::resync_tests::{MIB, Nodes, all_in_sync, data, until};
use crate::backend::BlockBackend;
use crate::dto::CreateVolume;
use crate::error::CoronaError;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

const SIZE: u64 = 8 * MIB;

/// Export `name` (`VOL` or `VOL@SNAP`) of node `i`, read whole.
async fn read(c: &Nodes, i: usize, name: &str) -> Vec<u8> {
    let e = c.up(i).volumes.open(name).expect("open");
    let (r, buf) = e.backend.read_at(vec![0; e.backend.size() as usize], 0).await;
    r.expect("read");
    buf
}

fn snapshot_names(c: &Nodes, i: usize) -> Vec<String> {
    c.up(i).volumes.snapshots("vm").expect("snapshots").into_iter().map(|s| s.name).collect()
}

fn status(e: CoronaError) -> Option<u16> {
    match e {
        CoronaError::Api { status, .. } => status,
        e => panic!("not an API error: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_a_replicated_volume_holds_the_same_writes_on_every_copy_and_each_head_goes_on() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    let a = read(&c, 0, "vm").await;
    // The flush before the snapshot also trims the dirty-region log (at
    // most once a second), which holds writes out as the snapshot does.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;

    let info = c.api(0).snapshot("vm", "s1").await.expect("snapshot on 3 of 3");
    assert!(info.missing_on.is_empty(), "{info:?}");
    client.write(0, &data(2 * MIB as usize, 200), false).await.expect("write after the snapshot");
    client.write(5 * MIB, &data(4096, 201), false).await.expect("write after the snapshot");
    client.flush().await.expect("flush on 3 of 3");
    let b = read(&c, 0, "vm").await;
    assert!(a != b);
    for i in 0..3 {
        assert_eq!(snapshot_names(&c, i), ["s1"], "node {i}");
        assert!(read(&c, i, "vm@s1").await == a, "node {i}'s snapshot is not the volume as it was");
        assert!(read(&c, i, "vm").await == b, "node {i}'s head is not the volume as it is");
    }
    assert!(all_in_sync(&c.api(0).get("vm").await.expect("show")), "no copy was dropped");

    // Deleting it on the primary deletes it on every copy.
    c.api(0).delete_snapshot("vm", "s1", false).await.expect("delete");
    for i in 0..3 {
        assert!(snapshot_names(&c, i).is_empty(), "node {i} still has s1");
    }
    client.write(MIB, &data(4096, 202), true).await.expect("fua write on 3 of 3 after the deletion");
    assert!(all_in_sync(&c.api(0).get("vm").await.expect("show")));
    drop(client);
    c.shutdown().await;
}

/// The block the writer below puts at block `k`: `k`, then zeroes (the
/// volume's first contents, [`data`], has no zero byte).
fn block(k: u64) -> Vec<u8> {
    let mut b = vec![0; 4096];
    b[..8].copy_from_slice(&k.to_be_bytes());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_taken_while_a_client_writes_is_the_same_point_of_the_stream_on_every_copy() {
    const BIG: u64 = 32 * MIB;
    const BLOCKS: u64 = BIG / 4096;
    let c = Nodes::start().await;
    let client = Arc::new(c.volume(BIG).await);
    let before = read(&c, 0, "vm").await;
    // A writer puts block k at 4 KiB * k, one after the other, each
    // answered before the next is sent: every point of its stream is a
    // prefix of the blocks.
    let done = Arc::new(AtomicU64::new(0));
    let writer = {
        let (client, done) = (client.clone(), done.clone());
        tokio::spawn(async move {
            for k in 0..BLOCKS {
                client.write(k * 4096, &block(k), false).await.expect("write");
                done.store(k + 1, SeqCst);
            }
        })
    };
    while done.load(SeqCst) < 50 {
        tokio::task::yield_now().await;
    }
    let answered_before = done.load(SeqCst);
    c.api(0).snapshot("vm", "s1").await.expect("snapshot under writes");
    let answered_at = done.load(SeqCst);
    writer.await.expect("writer");
    client.flush().await.expect("flush on 3 of 3");

    let snap = read(&c, 0, "vm@s1").await;
    for i in 1..3 {
        assert!(read(&c, i, "vm@s1").await == snap, "node {i}'s snapshot is another point of the stream");
    }
    let at = |img: &[u8], k: u64| img[(k * 4096) as usize..][..4096].to_vec();
    let n = (0..BLOCKS).take_while(|&k| at(&snap, k) == block(k)).count() as u64;
    assert!(
        (answered_before..=answered_at + 1).contains(&n),
        "the snapshot holds the first {n} writes, not {answered_before}..={}",
        answered_at + 1
    );
    for k in n..BLOCKS {
        assert!(
            at(&snap, k) == at(&before, k),
            "block {k} of the snapshot is neither written nor as it was: not a point of the stream"
        );
    }
    let head = read(&c, 0, "vm").await;
    assert!((0..BLOCKS).all(|k| at(&head, k) == block(k)));
    for i in 1..3 {
        assert!(read(&c, i, "vm").await == head, "node {i}'s head differs");
    }
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_while_a_replica_is_down_stands_on_the_quorum_and_names_the_copy_that_missed_it() {
    let mut c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    let a = read(&c, 0, "vm").await;
    c.take(2).shutdown().await;

    let info = c.api(0).snapshot("vm", "s1").await.expect("snapshot on 2 of 3");
    assert_eq!(info.missing_on, ["n3"]);
    let listed = c.api(0).snapshots("vm").await.expect("list");
    assert_eq!(
        listed.iter().map(|s| (s.name.as_str(), s.missing_on.clone())).collect::<Vec<_>>(),
        [("s1", vec!["n3".to_owned()])]
    );
    assert!(read(&c, 1, "vm@s1").await == a);
    client.write(3 * MIB, &data(4096, 90), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");

    // n3 comes back through the resync: its head, not the snapshot.
    c.restart(2).await;
    until(&c.api(0), "n3 caught up", |v| all_in_sync(v) && v.stale_replicas.is_empty()).await;
    assert!(read(&c, 2, "vm").await == read(&c, 0, "vm").await, "n3's head differs from the primary's");
    assert!(snapshot_names(&c, 2).is_empty(), "n3 got a snapshot it was down for");
    assert_eq!(c.api(0).snapshots("vm").await.expect("list")[0].missing_on, ["n3"]);
    // The next snapshot reaches all three; deleting the first is done on
    // the copy that lacks it too.
    c.api(0).snapshot("vm", "s2").await.expect("snapshot on 3 of 3");
    c.api(0).delete_snapshot("vm", "s1", false).await.expect("delete s1");
    for i in 0..3 {
        assert_eq!(snapshot_names(&c, i), ["s2"], "node {i}");
    }
    assert!(
        all_in_sync(&c.api(0).get("vm").await.expect("show")),
        "a copy was dropped by a deletion it had nothing to do for"
    );
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_snapshot_requests_change_nothing_on_any_copy() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.api(0).snapshot("vm", "s1").await.expect("snapshot");
    for bad in ["", "no/slash", ".hidden", "a b"] {
        let e = c.api(0).snapshot("vm", bad).await.expect_err("a bad name");
        assert!(matches!(status(e), Some(400 | 404 | 405)), "{bad:?}");
    }
    assert_eq!(status(c.api(0).snapshot("vm", "s1").await.expect_err("taken twice")), Some(409));
    // A replica's copy takes snapshots only through its primary's stream.
    let e = c.api(1).snapshot("vm", "s2").await.expect_err("snapshot asked of a copy");
    assert_eq!(status(e), Some(409));
    let e = c.api(1).delete_snapshot("vm", "s1", true).await.expect_err("deletion asked of a copy");
    assert_eq!(status(e), Some(409));
    for i in 0..3 {
        assert_eq!(snapshot_names(&c, i), ["s1"], "node {i}");
    }
    client.write(0, &data(4096, 7), true).await.expect("fua write on 3 of 3");
    assert!(all_in_sync(&c.api(0).get("vm").await.expect("show")), "a refusal dropped a copy");
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_of_a_replicated_volumes_snapshot_is_an_ordinary_volume_on_the_primary() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    let a = read(&c, 0, "vm").await;
    c.api(0).snapshot("vm", "gold").await.expect("snapshot");
    client.write(0, &data(4096, 33), true).await.expect("write after the snapshot");

    let v = c.api(0).clone_snapshot("c1", "vm@gold", None).await.expect("clone");
    assert!(v.replicas.is_empty(), "{v:?}");
    assert_eq!(v.allocated_bytes, 0, "a clone copies nothing");
    assert!(read(&c, 0, "c1").await == a);
    let e = c.up(0).volumes.open("c1").expect("open the clone");
    let (r, _) = e.backend.write_at(vec![9; 4096], MIB, false).await;
    r.expect("write to the clone");
    assert!(read(&c, 0, "vm@gold").await == a, "a write to the clone changed the snapshot");
    for i in 1..3 {
        assert!(c.up(i).volumes.info("c1").is_err(), "node {i} got a copy of the clone");
    }
    // Asked for one copy explicitly: the same.
    let req = CreateVolume { name: "c2".into(), size: None, from_snapshot: Some("vm@gold".into()), replicas: Some(1) };
    let v = c.api(0).create_volume(&req).await.expect("a clone with one copy");
    assert!(v.replicas.is_empty(), "{v:?}");
    assert!(c.up(1).volumes.info("c2").is_err());
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_kept_a_snapshot_deleted_while_it_was_down_takes_the_next_one_of_that_name() {
    let mut c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.api(0).snapshot("vm", "s1").await.expect("snapshot on 3 of 3");
    c.take(2).shutdown().await;
    c.api(0).delete_snapshot("vm", "s1", false).await.expect("delete on 2 of 3");
    client.write(4 * MIB, &data(4096, 120), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    c.restart(2).await;
    until(&c.api(0), "n3 caught up", |v| all_in_sync(v) && v.stale_replicas.is_empty()).await;
    assert_eq!(snapshot_names(&c, 2), ["s1"], "n3 was down for the deletion");

    let info = c.api(0).snapshot("vm", "s1").await.expect("s1 again, on 3 of 3");
    assert!(info.missing_on.is_empty(), "{info:?}");
    let want = read(&c, 0, "vm@s1").await;
    assert_eq!(want[4 * MIB as usize..][..4096], data(4096, 120)[..]);
    assert!(read(&c, 2, "vm@s1").await == want, "n3 kept its old s1");
    assert!(all_in_sync(&c.api(0).get("vm").await.expect("show")));
    drop(client);
    c.shutdown().await;
}
