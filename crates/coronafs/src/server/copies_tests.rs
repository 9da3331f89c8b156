//! Deleting, growing, cloning and flattening replicated volumes end to end:
//! three `coronafs serve` nodes in one process over loopback (the resync
//! tests' [`Nodes`]), a volume `vm` with three copies, primary n1. Every
//! copy follows; a copy that was down catches up (growth) or is deleted
//! when it is back (deletion); a refused or failed request changes no copy.

use super::resync_tests::{MIB, Nodes, all_in_sync, data, until};
use crate::backend::BlockBackend;
use crate::client::NbdClient;
use crate::dto::CreateVolume;
use crate::error::CoronaError;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

const SIZE: u64 = 8 * MIB;

/// Export `name` (`VOL` or `VOL@SNAP`) of node `i`, read whole.
async fn read(c: &Nodes, i: usize, name: &str) -> Vec<u8> {
    let e = c.up(i).volumes.open(name).expect("open");
    let (r, buf) = e.backend.read_at(vec![0; e.backend.size() as usize], 0).await;
    r.expect("read");
    buf
}

fn status(e: CoronaError) -> Option<u16> {
    match e {
        CoronaError::Api { status, .. } => status,
        e => panic!("not an API error: {e}"),
    }
}

/// Files under node `i`'s `layers/` directory.
fn layer_files(c: &Nodes, i: usize) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(c.t.dirs[i].path().join("layers"))
        .expect("layers dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Polls `ok` every 20 ms for at most 30 s.
async fn eventually(what: &str, ok: impl Fn() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: not within 30 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn create(name: &str, from: Option<&str>, replicas: usize) -> CreateVolume {
    CreateVolume {
        name: name.into(),
        size: from.is_none().then_some(SIZE),
        from_snapshot: from.map(str::to_owned),
        replicas: Some(replicas),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_replicated_volume_deletes_every_copy_with_its_snapshots_and_files() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.api(0).snapshot("vm", "s1").await.expect("snapshot on 3 of 3");
    let e = c.api(0).delete("vm", false).await.expect_err("in use");
    assert_eq!(status(e), Some(409));
    for i in 0..3 {
        assert!(c.up(i).volumes.info("vm").is_ok(), "a refused deletion reached node {i}");
        assert!(!layer_files(&c, i).is_empty());
    }
    drop(client);

    c.api(0).delete("vm", true).await.expect("delete on the primary");
    for i in 0..3 {
        assert!(c.up(i).volumes.info("vm").is_err(), "node {i} kept its copy");
        assert!(c.up(i).volumes.info("vm@s1").is_err(), "node {i} kept the snapshot");
        assert_eq!(layer_files(&c, i), Vec::<String>::new(), "node {i} kept files");
        c.up(i).volumes.verify().expect("catalog and files agree");
    }
    assert!(c.up(0).volumes.pending_deletions().is_empty());
    let e = NbdClient::connect(c.t.file.nodes[1].nbd, "vm").await.expect_err("a deleted copy serves nothing");
    assert!(e.to_string().contains("vm"), "{e}");
    // The name is free on every node again.
    c.api(0).create_volume(&create("vm", None, 3)).await.expect("a new vm with 3 copies");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_down_when_its_volume_is_deleted_is_deleted_once_it_is_back() {
    let mut c = Nodes::start().await;
    drop(c.volume(SIZE).await);
    let n3_files = layer_files(&c, 2);
    assert!(!n3_files.is_empty());
    c.take(2).shutdown().await;

    let started = Instant::now();
    c.api(0).delete("vm", true).await.expect("delete with n3 down");
    assert!(started.elapsed() < Duration::from_secs(3), "the deletion waited for the copy that is down");
    assert!(c.up(1).volumes.info("vm").is_err(), "n2 kept its copy");
    assert_eq!(c.up(0).volumes.pending_deletions(), [("vm".to_owned(), vec!["n3".to_owned()])]);
    // A new volume of the name would meet n3's old copy: refused meanwhile.
    let e = c.api(0).create_volume(&create("vm", None, 3)).await.expect_err("n3 not deleted yet");
    assert_eq!(status(e), Some(409));
    assert!(c.up(0).volumes.info("vm").is_err() && c.up(1).volumes.info("vm").is_err());

    c.restart(2).await;
    eventually("n3's copy is deleted", || c.up(2).volumes.info("vm").is_err()).await;
    eventually("the primary forgets the deletion", || c.up(0).volumes.pending_deletions().is_empty()).await;
    assert_eq!(layer_files(&c, 2), Vec::<String>::new(), "n3 kept files of {n3_files:?}");
    c.up(2).volumes.verify().expect("n3's catalog and files agree");
    c.api(0).create_volume(&create("vm", None, 3)).await.expect("the name is free again");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_that_fails_on_the_primary_changes_no_copy_and_the_volume_goes_on() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.up(0).volumes.faults.arm(0, libc::EIO);
    let e = c.api(0).delete("vm", true).await.expect_err("the commit fails");
    assert_eq!(status(e), Some(500));
    assert_eq!(c.up(0).volumes.faults.disarm(), Some("commit catalog"));
    for i in 0..3 {
        assert!(c.up(i).volumes.info("vm").is_ok(), "node {i} lost its copy");
    }
    assert!(c.up(0).volumes.pending_deletions().is_empty(), "a deletion was recorded");
    client.write(MIB, &data(4096, 77), true).await.expect("fua write on 3 of 3");
    let v = c.api(0).get("vm").await.expect("show");
    assert!(all_in_sync(&v) && v.stale_replicas.is_empty(), "{v:?}");
    let want = read(&c, 0, "vm").await;
    for i in 1..3 {
        assert!(read(&c, i, "vm").await == want, "node {i} differs");
    }
    drop(client);
    c.shutdown().await;
}

/// The block the writer below puts at block `k`: `k`, then zeroes.
fn block(k: u64) -> Vec<u8> {
    let mut b = vec![0; 4096];
    b[..8].copy_from_slice(&k.to_be_bytes());
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_volume_grows_under_a_writer_on_every_copy_and_a_write_past_the_old_end_survives_a_failover() {
    const BIG: u64 = 2 * SIZE;
    const BLOCKS: u64 = SIZE / 4096;
    let mut c = Nodes::start().await;
    let client = Arc::new(c.volume(SIZE).await);
    let done = Arc::new(AtomicU64::new(0));
    let writer = {
        let (client, done) = (client.clone(), done.clone());
        tokio::spawn(async move {
            // Three passes over the old size: block k at (k mod N) * 4 KiB.
            for k in 0..3 * BLOCKS {
                client.write(k % BLOCKS * 4096, &block(k), false).await.expect("write while growing");
                done.store(k + 1, SeqCst);
            }
        })
    };
    while done.load(SeqCst) < 50 {
        tokio::task::yield_now().await;
    }
    let v = c.api(0).resize("vm", BIG, false).await.expect("grow under writes");
    assert_eq!(v.size, BIG);
    assert!(done.load(SeqCst) < 3 * BLOCKS, "the writer ended before the growth: it proves nothing");
    writer.await.expect("writer");
    client.flush().await.expect("flush on 3 of 3");
    // A client connected after the growth sees it and writes past the old end.
    let grown = NbdClient::connect(c.t.file.nodes[0].nbd, "vm").await.expect("connect");
    assert_eq!(grown.size(), BIG);
    grown.write(SIZE + 3 * MIB, &data(64 * 1024, 90), true).await.expect("fua write past the old end");

    let want = read(&c, 0, "vm").await;
    assert_eq!(want.len() as u64, BIG);
    assert!((0..BLOCKS).all(|k| want[(k * 4096) as usize..][..4096] == block(k + 2 * BLOCKS)[..]));
    assert!(want[SIZE as usize..][..3 * MIB as usize].iter().all(|&b| b == 0), "the grown part is not zero");
    for i in 0..3 {
        assert_eq!(c.up(i).volumes.info("vm").expect("info").size, BIG, "node {i}");
        assert!(read(&c, i, "vm").await == want, "node {i}'s copy differs");
    }
    let v = c.api(0).get("vm").await.expect("show");
    assert!(all_in_sync(&v) && v.stale_replicas.is_empty(), "a copy was dropped: {v:?}");
    // Shrinking a replicated volume is refused, with nothing changed.
    let e = c.api(0).resize("vm", SIZE, true).await.expect_err("shrink");
    assert_eq!(status(e), Some(400));
    // A copy takes its size only from the stream.
    let e = c.api(1).resize("vm", 3 * SIZE, false).await.expect_err("asked of a copy");
    assert_eq!(status(e), Some(409));
    for i in 0..3 {
        assert_eq!(c.up(i).volumes.info("vm").expect("info").size, BIG, "node {i}");
    }

    drop((client, grown));
    c.take(0).shutdown().await;
    let v = c.api(1).promote("vm").await.expect("promote n2");
    assert_eq!(v.size, BIG);
    let after = NbdClient::connect(c.t.file.nodes[1].nbd, &format!("vm;epoch={}", v.epoch)).await.expect("connect n2");
    assert_eq!(after.size(), BIG);
    let got = after.read(SIZE + 3 * MIB, 64 * 1024).await.expect("read past the old end on n2");
    assert!(got == data(64 * 1024, 90), "the write past the old end is not on the new primary");
    drop(after);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_down_while_its_volume_grows_grows_when_it_catches_up() {
    let mut c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.take(2).shutdown().await;
    c.api(0).resize("vm", 2 * SIZE, false).await.expect("grow on 2 of 3");
    let grown = NbdClient::connect(c.t.file.nodes[0].nbd, "vm").await.expect("connect");
    grown.write(SIZE + MIB, &data(8192, 61), false).await.expect("write past the old end");
    grown.flush().await.expect("flush on 2 of 3");
    // Below the write quorum a growth is refused before anything changes.
    c.take(1).shutdown().await;
    let e = c.api(0).resize("vm", 3 * SIZE, false).await.expect_err("grow on 1 of 3");
    assert_eq!(status(e), Some(502));
    assert_eq!(c.up(0).volumes.info("vm").expect("info").size, 2 * SIZE, "the primary grew alone");

    c.restart(1).await;
    c.restart(2).await;
    until(&c.api(0), "n2 and n3 caught up", |v| all_in_sync(v) && v.stale_replicas.is_empty()).await;
    let want = read(&c, 0, "vm").await;
    assert_eq!(want.len() as u64, 2 * SIZE);
    for i in 1..3 {
        assert_eq!(c.up(i).volumes.info("vm").expect("info").size, 2 * SIZE, "node {i}");
        assert!(read(&c, i, "vm").await == want, "node {i} differs after catching up");
    }
    drop((client, grown));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_with_three_copies_is_made_on_every_copy_leaves_its_source_alone_and_survives_a_failover() {
    let mut c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    let gold = read(&c, 0, "vm").await;
    c.api(0).snapshot("vm", "gold").await.expect("snapshot");
    client.write(0, &data(4096, 33), true).await.expect("write to the source after the snapshot");
    let source = read(&c, 0, "vm").await;

    // A node that cannot make its copy (a volume of that name is there)
    // fails the clone, and the copies already made are undone.
    c.api(2).create_volume(&create("c1", None, 1)).await.expect("a plain c1 on n3");
    let e = c.api(0).create_volume(&create("c1", Some("vm@gold"), 3)).await.expect_err("n3 has a c1");
    assert_eq!(status(e), Some(502));
    assert!(c.up(0).volumes.info("c1").is_err() && c.up(1).volumes.info("c1").is_err(), "a clone was left");
    assert_eq!(c.up(2).volumes.info("c1").expect("n3's own c1").parent, None, "n3's volume was replaced");
    c.api(2).delete("c1", false).await.expect("delete n3's c1");

    let v = c.api(0).create_volume(&create("c1", Some("vm@gold"), 3)).await.expect("clone with 3 copies");
    assert_eq!(v.replicas, ["n2", "n3"]);
    for i in 0..3 {
        let info = c.up(i).volumes.info("c1").expect("a copy of the clone");
        assert_eq!((info.parent.as_deref(), info.allocated_bytes), (Some("vm@gold"), 0), "node {i}: not O(1)");
    }
    let clone = NbdClient::connect(c.t.file.nodes[0].nbd, "c1").await.expect("connect to the clone");
    clone.write(MIB, &data(100_000, 34), false).await.expect("write to the clone");
    clone.write(5 * MIB, &data(4096, 35), false).await.expect("write to the clone");
    clone.flush().await.expect("flush on 3 of 3");
    let mut want = gold.clone();
    want[MIB as usize..][..100_000].copy_from_slice(&data(100_000, 34));
    want[5 * MIB as usize..][..4096].copy_from_slice(&data(4096, 35));
    for i in 0..3 {
        assert!(read(&c, i, "c1").await == want, "node {i}'s clone differs");
        assert!(read(&c, i, "vm@gold").await == gold, "node {i}'s snapshot changed");
        assert!(read(&c, i, "vm").await == source, "node {i}'s source volume changed");
    }
    let s = c.api(0).get("c1").await.expect("show the clone");
    assert!(all_in_sync(&s), "{s:?}");

    // The clone fails over like any replicated volume.
    drop((client, clone));
    c.take(0).shutdown().await;
    let v = c.api(1).promote("c1").await.expect("promote the clone's copy on n2");
    let after =
        NbdClient::connect(c.t.file.nodes[1].nbd, &format!("c1;epoch={}", v.epoch)).await.expect("connect to n2");
    assert!(after.read(0, SIZE as usize).await.expect("read") == want, "the clone's data changed in the failover");
    after.write(2 * MIB, &data(4096, 36), true).await.expect("fua write on n2 and n3");
    drop(after);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_with_copies_goes_only_where_its_snapshot_is_and_says_where_it_is_missing() {
    let mut c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.take(2).shutdown().await;
    let s = c.api(0).snapshot("vm", "s1").await.expect("snapshot on 2 of 3");
    assert_eq!(s.missing_on, ["n3"]);
    c.restart(2).await;
    until(&c.api(0), "n3 caught up", |v| all_in_sync(v) && v.stale_replicas.is_empty()).await;

    let e = c.api(0).create_volume(&create("c1", Some("vm@s1"), 3)).await.expect_err("n3 lacks s1");
    let msg = e.to_string();
    assert_eq!(status(e), Some(409));
    assert!(msg.contains("missing on n3"), "{msg}");
    // Asked of a copy: only the primary knows where the snapshot is.
    let e = c.api(1).create_volume(&create("c1", Some("vm@s1"), 2)).await.expect_err("asked of a copy");
    assert_eq!(status(e), Some(409));
    for i in 0..3 {
        assert!(c.up(i).volumes.info("c1").is_err(), "node {i} kept a part of a refused clone");
    }
    let v = c.api(0).create_volume(&create("c1", Some("vm@s1"), 2)).await.expect("2 copies where s1 is");
    assert_eq!(v.replicas, ["n2"]);
    assert!(c.up(2).volumes.info("c1").is_err(), "n3 got a copy of a clone of a snapshot it lacks");
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flattening_a_replicated_clone_flattens_every_copy_and_keeps_its_bytes() {
    let c = Nodes::start().await;
    let client = c.volume(SIZE).await;
    c.api(0).snapshot("vm", "gold").await.expect("snapshot");
    c.api(0).create_volume(&create("c1", Some("vm@gold"), 3)).await.expect("clone with 3 copies");
    let clone = NbdClient::connect(c.t.file.nodes[0].nbd, "c1").await.expect("connect to the clone");
    clone.write(3 * MIB, &data(65536, 44), true).await.expect("fua write to the clone");
    let want = read(&c, 0, "c1").await;

    let v = c.api(0).flatten("c1").await.expect("flatten on the primary");
    assert_eq!(v.parent, None);
    clone.write(4 * MIB, &data(4096, 45), true).await.expect("fua write after the flatten");
    let mut want = want;
    want[4 * MIB as usize..][..4096].copy_from_slice(&data(4096, 45));
    for i in 1..3 {
        eventually("the copy flattens", || c.up(i).volumes.info("c1").is_ok_and(|v| v.parent.is_none())).await;
    }
    for i in 0..3 {
        assert!(read(&c, i, "c1").await == want, "node {i}'s clone changed");
        assert!(c.up(i).volumes.snapshots("vm").expect("list")[0].clones.is_empty(), "node {i}");
    }
    // No clone left: the snapshot goes without force, on every copy.
    c.api(0).delete_snapshot("vm", "gold", false).await.expect("delete the snapshot");
    for i in 0..3 {
        assert!(read(&c, i, "c1").await == want, "node {i}'s clone changed with its snapshot gone");
        c.up(i).volumes.verify().expect("catalog and files agree");
    }
    let s = c.api(0).get("c1").await.expect("show");
    assert!(all_in_sync(&s), "{s:?}");
    drop((client, clone));
    c.shutdown().await;
}
