//! LightningStor replication driven by aws-sdk-s3: in-process clusters with
//! faults injected through the transport trait, and spawned node processes
//! killed with SIGKILL.

use super::common as s3_common;

use aws_sdk_s3::primitives::ByteStream;
use lightningstor::cluster::NodeId;
use lightningstor::meta::types::{ObjectMeta, Row};
use s3_common::*;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

type R = anyhow::Result<()>;

async fn put(c: &aws_sdk_s3::Client, b: &str, k: &str, data: &[u8]) -> anyhow::Result<()> {
    match c.put_object().bucket(b).key(k).body(ByteStream::from(data.to_vec())).send().await {
        Ok(_) => Ok(()),
        Err(e) => anyhow::bail!("put {b}/{k}: {}: {e:?}", code(&e)),
    }
}

async fn get(c: &aws_sdk_s3::Client, b: &str, k: &str) -> anyhow::Result<Vec<u8>> {
    let out = c.get_object().bucket(b).key(k).send().await?;
    Ok(out.body.collect().await?.into_bytes().to_vec())
}

/// The row node `id` holds locally for a key.
fn local_row(s: &InCluster, id: NodeId, b: &str, k: &str) -> Option<Row> {
    s.cluster.node(id).store.meta.get_row(b, k.as_bytes()).expect("local row")
}

/// Waits until `f` holds, up to `secs`.
async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {secs} s waiting for: {what}");
}

/// The row a replica holds once its commit has landed. A write is
/// acknowledged at the write quorum, so the last replica (the coordinator's
/// own copy included) may commit a moment after the client hears back.
async fn landed_row(s: &InCluster, id: NodeId, b: &str, k: &str) -> Row {
    eventually(10, &format!("node {id} commits {b}/{k}"), || local_row(s, id, b, k).is_some()).await;
    local_row(s, id, b, k).expect("row just seen")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_object_lands_on_exactly_its_replicas_with_one_version() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(5);
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    for i in 0..40 {
        let data = pseudo_random(if i % 4 == 0 { 1_500_000 } else { 3000 }, i);
        put(&c, "bkt", &format!("k{i}"), &data).await?;
    }
    for i in 0..40 {
        let k = format!("k{i}");
        let replicas = s.cluster.node(1).replicas("bkt", k.as_bytes());
        assert_eq!(replicas.len(), 3);
        let mut versions = Vec::new();
        for id in s.cluster.ids() {
            if replicas.contains(&id) {
                versions.push(landed_row(&s, id, "bkt", &k).await.version());
            } else {
                assert!(local_row(&s, id, "bkt", &k).is_none(), "node {id} is not a replica of {k} but holds it");
            }
        }
        versions.dedup();
        assert_eq!(versions.len(), 1, "replicas disagree on {k}");
        let data = pseudo_random(if i % 4 == 0 { 1_500_000 } else { 3000 }, i);
        assert_eq!(get(&c, "bkt", &k).await?, data);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_node_misses_writes_then_catches_up_after_healing() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    put(&c, "bkt", "before", b"old").await?;
    put(&c, "bkt", "doomed", b"to be deleted").await?;
    s.cluster.faults.isolate(3);
    // W=2 of 3: writes through node 1 still succeed.
    let mut want = BTreeMap::new();
    for i in 0..30u64 {
        let data = pseudo_random(if i % 5 == 0 { 1_200_000 } else { 777 }, i);
        put(&c, "bkt", &format!("p{i}"), &data).await?;
        want.insert(format!("p{i}"), data);
    }
    put(&c, "bkt", "before", b"new").await?;
    c.delete_object().bucket("bkt").key("doomed").send().await?;
    // Node 3 cannot reach a read quorum on its own.
    let e = get(&s.client_of(3), "bkt", "before").await.expect_err("isolated node has no quorum");
    assert!(format!("{e:?}").contains("ServiceUnavailable") || format!("{e:?}").contains("503"), "{e:?}");
    assert!(local_row(&s, 3, "bkt", "p1").is_none(), "isolated node got a write");
    assert!(s.cluster.node(1).resync.len() > 0, "missed replicas are queued");
    // Everything acknowledged is readable from the majority side meanwhile.
    for (k, v) in &want {
        assert_eq!(&get(&s.client_of(2), "bkt", k).await?, v);
    }
    s.cluster.faults.heal();
    eventually(60, "node 3 converges through the resync queue", || {
        want.keys().all(|k| local_row(&s, 3, "bkt", k).is_some()) && s.cluster.node(1).resync.is_empty()
    })
    .await;
    for (k, v) in &want {
        assert_eq!(local_row(&s, 3, "bkt", k), local_row(&s, 1, "bkt", k), "{k} differs");
        assert_eq!(&get(&s.client_of(3), "bkt", k).await?, v);
    }
    assert!(matches!(local_row(&s, 3, "bkt", "doomed"), Some(Row::Tombstone(_))), "the delete reached node 3");
    assert_eq!(get(&s.client_of(3), "bkt", "before").await?, b"new");
    Ok(())
}

/// A lifecycle configuration of one rule: objects under `tmp/` expire after
/// `days`.
fn tmp_expiry(days: i32) -> anyhow::Result<aws_sdk_s3::types::BucketLifecycleConfiguration> {
    use aws_sdk_s3::types::{
        BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule, LifecycleRuleFilter,
    };
    let rule = LifecycleRule::builder()
        .id("tmp")
        .status(ExpirationStatus::Enabled)
        .filter(LifecycleRuleFilter::builder().prefix("tmp/").build())
        .expiration(LifecycleExpiration::builder().days(days).build())
        .build()?;
    Ok(BucketLifecycleConfiguration::builder().rules(rule).build()?)
}

/// A bucket's lifecycle configuration goes where bucket rows go: put while a
/// node is cut off, it needs only the majority, and the node gets it from
/// the resync queue after healing; a delete that another node misses
/// reaches it the same way (the newer, empty configuration wins).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lifecycle_configuration_reaches_a_node_that_missed_it_and_so_does_its_delete() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let rules = |id: NodeId| {
        let row = s.cluster.node(id).store.meta.get_bucket("bkt").expect("bucket row");
        row.map(|b| b.rules().to_vec()).unwrap_or_default()
    };
    s.cluster.faults.isolate(3);
    let config = tmp_expiry(7)?;
    c.put_bucket_lifecycle_configuration().bucket("bkt").lifecycle_configuration(config).send().await?;
    assert_eq!(rules(2).len(), 1);
    assert!(rules(3).is_empty(), "the isolated node got the configuration");
    let got = s.client_of(2).get_bucket_lifecycle_configuration().bucket("bkt").send().await?;
    assert_eq!(got.rules().len(), 1);
    s.cluster.faults.heal();
    eventually(60, "node 3 gets the configuration from the resync queue", || rules(3).len() == 1).await;
    assert_eq!(rules(3), rules(1));

    s.cluster.faults.isolate(2);
    s.client_of(1).delete_bucket_lifecycle().bucket("bkt").send().await?;
    assert_eq!(rules(2).len(), 1, "the isolated node heard of the delete");
    s.cluster.faults.heal();
    eventually(60, "node 2 learns of the delete from the resync queue", || rules(2).is_empty()).await;
    let e = s.client_of(2).get_bucket_lifecycle_configuration().bucket("bkt").send().await.expect_err("deleted");
    assert_eq!(code(&e), "NoSuchLifecycleConfiguration");
    Ok(())
}

/// With the resync queue lost (its node's disk died, or it was cleared), a
/// lifecycle configuration and later its delete still reach the node that
/// missed them: the anti-entropy round of the rows every node holds sends
/// every configuration to every peer, and a peer takes only a newer one
/// for the same incarnation of the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anti_entropy_brings_a_lifecycle_configuration_and_its_delete_to_a_node_that_missed_both() -> R {
    let _gate = crate::gate::shared();
    use lightningstor::cluster::rpc::{Msg, Req, Resp};
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let row = |id: NodeId| s.cluster.node(id).store.meta.get_bucket("bkt").expect("read").expect("bucket row");
    let rules = |id: NodeId| row(id).rules().to_vec();
    let clear_queues = || -> R {
        for id in s.cluster.ids() {
            s.cluster.node(id).resync.clear()?;
        }
        Ok(())
    };
    let config = tmp_expiry(3)?;

    s.cluster.faults.isolate(3);
    c.put_bucket_lifecycle_configuration().bucket("bkt").lifecycle_configuration(config).send().await?;
    clear_queues()?;
    s.cluster.faults.heal();
    assert!(rules(3).is_empty(), "node 3 got the configuration without anti-entropy");
    let n1 = s.cluster.coordinator(1);
    assert!(n1.shared_rows_round().await? >= 1, "node 1's round sent node 3 the configuration");
    assert_eq!(rules(3), rules(1));
    assert_eq!(rules(3).len(), 1);
    assert_eq!(n1.shared_rows_round().await?, 0, "a second round sends nothing");

    // A configuration for another incarnation of the bucket (created at
    // another time) is not taken, however new.
    let mut other = row(1).lifecycle.expect("node 1's configuration");
    other.version += 1_000_000;
    other.rules.clear();
    let stale = Req::MergeLifecycles { rows: vec![("bkt".into(), row(3).created_ms - 1, other)] };
    let answer = n1.node.call(3, Msg::new(stale)).await?;
    assert_eq!(answer.head, Resp::Count(0));
    assert_eq!(rules(3).len(), 1, "a configuration of another incarnation replaced node 3's");

    s.cluster.faults.isolate(3);
    c.delete_bucket_lifecycle().bucket("bkt").send().await?;
    clear_queues()?;
    s.cluster.faults.heal();
    assert_eq!(rules(3).len(), 1, "node 3 heard of the delete without anti-entropy");
    assert!(s.cluster.coordinator(2).shared_rows_round().await? >= 1, "node 2's round sent node 3 the delete");
    assert!(rules(3).is_empty());
    let e = s.client_of(3).get_bucket_lifecycle_configuration().bucket("bkt").send().await.expect_err("deleted");
    assert_eq!(code(&e), "NoSuchLifecycleConfiguration");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_later_write_wins_even_through_a_coordinator_whose_clock_trails() -> R {
    let _gate = crate::gate::shared();
    use lightningstor::cluster::hlc;
    let s = InCluster::new(5);
    s.client_of(1).create_bucket().bucket("bkt").send().await?;
    // Node 5's clock runs 3 s ahead of node 1's, which is not a replica of
    // the keys below, so it never sees node 5's versions on its own.
    let keys: Vec<String> = (0..200)
        .map(|i| format!("k{i}"))
        .filter(|k| !s.cluster.node(1).replicas("bkt", k.as_bytes()).contains(&1))
        .take(2)
        .collect();
    let wall = hlc::version_ms(s.cluster.node(5).hlc.now());
    s.cluster.node(5).hlc.observe(hlc::first_version_at(wall + 3000));
    let (ahead, behind) = (s.client_of(5), s.client_of(1));
    put(&ahead, "bkt", &keys[0], b"first").await?;
    behind.delete_object().bucket("bkt").key(&keys[0]).send().await?;
    // Node 1 has now seen node 5's clock; move node 5 ahead again.
    s.cluster.node(5).hlc.observe(hlc::first_version_at(wall + 6000));
    put(&ahead, "bkt", &keys[1], b"first").await?;
    put(&behind, "bkt", &keys[1], b"second").await?;
    for id in 1..=5u8 {
        let e = get(&s.client_of(id), "bkt", &keys[0]).await.expect_err("the acknowledged delete stands");
        assert!(format!("{e:?}").contains("NoSuchKey"), "{e:?}");
        assert_eq!(get(&s.client_of(id), "bkt", &keys[1]).await?, b"second");
    }
    assert_eq!(s.cluster.node(1).metrics.recommits.load(std::sync::atomic::Ordering::Relaxed), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_get_under_way_returns_the_old_bytes_while_the_key_is_overwritten() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let old = pseudo_random(8 << 20, 61);
    put(&c, "bkt", "k", &old).await?;
    for id in 1..=3 {
        landed_row(&s, id, "bkt", "k").await;
    }
    // The GET has its row and its first blocks; the rest it fetches later.
    let mut body = c.get_object().bucket("bkt").key("k").send().await?.body;
    let mut got = body.try_next().await?.expect("a first chunk").to_vec();
    let new = pseudo_random(8 << 20, 62);
    put(&s.client_of(2), "bkt", "k", &new).await?;
    eventually(10, "every replica holds the new row", || {
        (1..=3).all(|id| matches!(local_row(&s, id, "bkt", "k"), Some(Row::Object(m)) if m.data.blocks()[0].hash == lightningstor::block::BlockHash::of(&new[..1 << 20])))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    while let Some(chunk) = body.try_next().await? {
        got.extend_from_slice(&chunk);
    }
    assert!(got == old, "the GET under way returned {} bytes, not the old object", got.len());
    assert_eq!(get(&c, "bkt", "k").await?, new);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_repair_a_stale_replica() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    put(&c, "bkt", "k", b"v1").await?;
    let v1 = landed_row(&s, 3, "bkt", "k").await.version();
    // Node 3 misses v2, and node 1 forgets to resync it (queue drained by hand).
    s.cluster.faults.cut(1, 3);
    put(&c, "bkt", "k", b"v2").await?;
    s.cluster.node(1).resync.clear()?;
    s.cluster.faults.heal();
    assert_eq!(local_row(&s, 3, "bkt", "k").map(|r| r.version()), Some(v1), "node 3 missed v2");
    // A read asks R = 2 replicas, node 2 itself and the others in turns:
    // of two reads through node 2, one asks node 3, sees it stale and
    // pushes the new row to it.
    for _ in 0..2 {
        assert_eq!(get(&s.client_of(2), "bkt", "k").await?, b"v2");
    }
    eventually(20, "node 3 repaired", || local_row(&s, 3, "bkt", "k").is_some_and(|r| r.version() > v1)).await;
    assert!(s.cluster.node(2).metrics.read_repairs.load(std::sync::atomic::Ordering::Relaxed) > 0);
    Ok(())
}

/// A read coordinated by a stale replica: it reads its own (old) row, the
/// others report a newer version only, so it fetches that row from one of
/// them before answering, and repairs itself. Small (inline) and
/// multi-block objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_through_a_stale_replica_returns_the_newest_row_and_repairs_it() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    for (key, size) in [("small", 100usize), ("large", 3 << 20)] {
        let v1 = pseudo_random(size, 71);
        put(&c, "bkt", key, &v1).await?;
        let old = landed_row(&s, 3, "bkt", key).await.version();
        // Node 3 misses v2, and node 1 forgets to resync it.
        s.cluster.faults.cut(1, 3);
        let v2 = pseudo_random(size, 72);
        put(&c, "bkt", key, &v2).await?;
        s.cluster.node(1).resync.clear()?;
        s.cluster.faults.heal();
        assert_eq!(local_row(&s, 3, "bkt", key).map(|r| r.version()), Some(old), "node 3 missed v2 of {key}");
        let fetched = || s.cluster.node(3).metrics.read_rows_fetched.load(Ordering::Relaxed);
        let before = fetched();
        let got = get(&s.client_of(3), "bkt", key).await?;
        assert!(got == v2, "a read through stale node 3 returned {} bytes, not v2 of {key}", got.len());
        // Its own (old) row, then the newest from a replica that reported it.
        assert_eq!(fetched() - before, 2, "rows node 3 fetched for the read of {key}");
        eventually(20, "node 3 repaired", || local_row(&s, 3, "bkt", key).is_some_and(|r| r.version() > old)).await;
    }
    // A deleted key reads as deleted through the replica that missed the delete.
    put(&c, "bkt", "gone", b"here").await?;
    landed_row(&s, 3, "bkt", "gone").await;
    s.cluster.faults.cut(1, 3);
    c.delete_object().bucket("bkt").key("gone").send().await?;
    s.cluster.node(1).resync.clear()?;
    s.cluster.faults.heal();
    assert!(matches!(local_row(&s, 3, "bkt", "gone"), Some(Row::Object(_))), "node 3 missed the delete");
    let e = s.client_of(3).get_object().bucket("bkt").key("gone").send().await.expect_err("deleted");
    assert_eq!(code(&e), "NoSuchKey");
    Ok(())
}

/// With every replica current, a read fetches the row from one replica
/// (the coordinator's own copy) and only the version from the others:
/// through a replica and through a node that holds no copy, one GET at a
/// time and 16 at once (whose version asks share messages). And the
/// versions a replica reports are those of the rows it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_fetches_the_row_from_one_replica_and_only_versions_from_the_others() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(4);
    s.client_of(1).create_bucket().bucket("bkt").send().await?;
    let mut want = BTreeMap::new();
    for i in 0..12u64 {
        let data = pseudo_random(if i == 0 { 3 << 20 } else { 3000 }, 80 + i);
        put(&s.client_of(1), "bkt", &format!("k{i}"), &data).await?;
        want.insert(format!("k{i}"), data);
    }
    put(&s.client_of(1), "bkt", "gone", b"x").await?;
    s.client_of(1).delete_object().bucket("bkt").key("gone").send().await?;
    for k in want.keys().map(String::as_str).chain(["gone"]) {
        for id in s.cluster.node(1).replicas("bkt", k.as_bytes()) {
            eventually(10, &format!("node {id} holds the last write of {k}"), || {
                local_row(&s, id, "bkt", k).is_some_and(|r| k != "gone" || matches!(r, Row::Tombstone(_)))
            })
            .await;
        }
    }
    let names: Vec<&str> = want.keys().map(String::as_str).chain(["gone", "never"]).collect();
    for id in s.cluster.ids() {
        let rows: Vec<u64> = names.iter().map(|k| local_row(&s, id, "bkt", k).map_or(0, |r| r.version())).collect();
        let versions = s.cluster.node(id).store.meta.get_versions(names.iter().map(|k| ("bkt", k.as_bytes())))?;
        assert_eq!(versions, rows, "versions of the rows on node {id}");
    }
    let load = |id: NodeId| {
        let m = &s.cluster.node(id).metrics;
        (
            m.read_rows_fetched.load(Ordering::Relaxed),
            m.read_versions_asked.load(Ordering::Relaxed),
            m.version_batches.load(Ordering::Relaxed),
            m.hedged_reads.load(Ordering::Relaxed),
        )
    };
    // A read whose first replica is slow (a loaded machine) asks a spare for
    // its row too: each such hedge may fetch one more row, and is counted.
    let rows_for = |reads: u64, rows: u64, hedged: u64, via: NodeId, what: &str| {
        assert!(
            rows >= reads && rows <= reads + hedged,
            "{what} through node {via}: {rows} rows fetched in full by {reads} reads ({hedged} hedged)"
        );
    };
    for via in s.cluster.ids() {
        let c = s.client_of(via);
        let (rows, asks, _, hedged) = load(via);
        for (k, v) in &want {
            assert!(get(&c, "bkt", k).await? == *v, "{k} through node {via}");
        }
        let (rows_after, asks_after, _, hedged_after) = load(via);
        let reads = want.len() as u64;
        rows_for(reads, rows_after - rows, hedged_after - hedged, via, "one at a time");
        assert!(asks_after - asks >= reads, "versions asked by {reads} reads through node {via}");
        let (rows, asks, _, hedged) = load(via);
        let mut tasks = Vec::new();
        for (k, v) in want.clone() {
            let c = c.clone();
            tasks.push(tokio::spawn(async move { anyhow::Ok(get(&c, "bkt", &k).await? == v) }));
        }
        for t in tasks {
            assert!(t.await??, "a concurrent read through node {via} returned other bytes");
        }
        let (rows_after, asks_after, _, hedged_after) = load(via);
        rows_for(reads, rows_after - rows, hedged_after - hedged, via, "concurrently");
        assert!(asks_after - asks >= reads, "versions asked by {reads} concurrent reads through node {via}");
    }
    Ok(())
}

fn block_file(s: &InCluster, id: NodeId, hash: &lightningstor::block::BlockHash) -> std::path::PathBuf {
    let hex = hash.to_hex();
    s.cluster.config.nodes[usize::from(id) - 1].data_dir.join("blocks").join(&hex[..2]).join(&hex)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flipped_byte_is_read_around_and_repaired_by_reads_and_by_scrub() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(3 * 1024 * 1024 + 5, 9);
    put(&c, "bkt", "big", &data).await?;
    let Row::Object(meta) = landed_row(&s, 1, "bkt", "big").await else { panic!("not an object row") };
    let blocks = meta.data.blocks().to_vec();
    assert_eq!(blocks.len(), 4);
    // Flip a byte of block 0 on node 1 (read first: the coordinator reads locally).
    let f0 = block_file(&s, 1, &blocks[0].hash);
    let mut bytes = std::fs::read(&f0)?;
    bytes[1000] ^= 0x40;
    std::fs::write(&f0, &bytes)?;
    // The read still returns the right bytes, and repairs node 1's copy.
    assert_eq!(get(&c, "bkt", "big").await?, data);
    eventually(20, "read repair of the corrupt block", || {
        std::fs::read(&f0).is_ok_and(|b| lightningstor::block::BlockHash::of(&b) == blocks[0].hash)
    })
    .await;
    // Flip a byte of block 2 on node 2; scrub finds and fixes it.
    let f2 = block_file(&s, 2, &blocks[2].hash);
    let mut bytes = std::fs::read(&f2)?;
    bytes[7] ^= 0x01;
    std::fs::write(&f2, &bytes)?;
    let node2 = s.cluster.coordinator(2);
    node2.repair().scrub_some(None, 10_000).await?;
    let fixed = std::fs::read(&f2)?;
    assert_eq!(lightningstor::block::BlockHash::of(&fixed), blocks[2].hash, "scrub rewrote the block");
    assert!(node2.node.metrics.bad_copies_found.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    assert_eq!(get(&s.client_of(2), "bkt", "big").await?, data);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn background_scrub_repairs_a_flipped_byte_and_slows_down_under_traffic() -> R {
    let _gate = crate::gate::shared();
    use std::sync::atomic::Ordering::Relaxed;
    let rate = 20;
    let s = InCluster::with(3, |c| c.scrub_blocks_per_sec = rate);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    for i in 0..6 {
        put(&c, "bkt", &format!("o{i}"), &pseudo_random(3 * 1024 * 1024 + 5, 40 + i)).await?;
    }
    // No scrub_some call: the node's own background task finds the bad copy.
    let Row::Object(meta) = landed_row(&s, 2, "bkt", "o3").await else { panic!("not an object row") };
    let hash = meta.data.blocks()[1].hash;
    let f = block_file(&s, 2, &hash);
    let mut bytes = std::fs::read(&f)?;
    bytes[4321] ^= 0x08;
    std::fs::write(&f, &bytes)?;
    eventually(60, "background scrub rewrites the block", || {
        std::fs::read(&f).is_ok_and(|b| lightningstor::block::BlockHash::of(&b) == hash)
    })
    .await;
    assert!(s.cluster.node(2).metrics.bad_copies_found.load(Relaxed) >= 1);
    // Node 1 holds 24 blocks. While it serves requests, scrub there takes
    // a tenth of its rate; once idle, the full rate.
    let n1 = s.cluster.node(1);
    let scrubbed = || n1.metrics.scrubbed_blocks.load(Relaxed);
    let traffic = |secs: u64| {
        let c = c.clone();
        async move {
            let until = Instant::now() + Duration::from_secs(secs);
            for _ in 0..100_000 {
                if Instant::now() >= until {
                    break;
                }
                c.head_object().bucket("bkt").key("o1").send().await?;
            }
            anyhow::Ok(())
        }
    };
    traffic(2).await?; // the tick already under way ends
    let before = scrubbed();
    traffic(4).await?;
    let busy = scrubbed() - before;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = scrubbed();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let idle = scrubbed() - before;
    let tenth = u64::from(rate / 10);
    assert!(busy <= tenth * 6, "{busy} blocks scrubbed in 4 busy seconds at {tenth} per second");
    assert!(idle >= u64::from(rate), "{idle} blocks scrubbed in 4 idle seconds at {rate} per second");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_replica_holds_up_neither_writes_nor_reads_and_catches_up() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    // Node 3 takes every message and answers none (a SIGSTOPped process, a
    // paused container) until resumed. Without a bound on how long the
    // coordinator waits past the quorum, these requests never finish.
    s.cluster.faults.pause(3);
    let big = pseudo_random(20 << 20, 31);
    let small = pseudo_random(3000, 32);
    let bound = Duration::from_secs(30);
    let timed = |what: &'static str| {
        move |_: tokio::time::error::Elapsed| anyhow::anyhow!("{what} waited for the paused replica")
    };
    tokio::time::timeout(bound, put(&c, "bkt", "big", &big)).await.map_err(timed("a 20 MiB PUT"))??;
    tokio::time::timeout(bound, put(&c, "bkt", "small", &small)).await.map_err(timed("a 3 KB PUT"))??;
    // Through node 1, and through node 2 (whose reads are not mixed with
    // resync's: node 1 coordinated the writes, so it has node 3's queue).
    for via in [1, 2] {
        for (key, value) in [("big", &big), ("small", &small)] {
            let got =
                tokio::time::timeout(bound, get(&s.client_of(via), "bkt", key)).await.map_err(timed("a GET"))??;
            assert!(got == *value, "{key} differs through node {via} while node 3 is paused");
        }
    }
    assert!(local_row(&s, 3, "bkt", "big").is_none() && local_row(&s, 3, "bkt", "small").is_none());
    // A read asks its coordinator and one other replica in turns: of node
    // 2's two GETs, the second asked node 3, got no answer, and asked node
    // 1 after the hedge.
    assert_eq!(s.cluster.node(2).metrics.hedged_reads.load(std::sync::atomic::Ordering::Relaxed), 1);
    // Resumed, node 3 gets both rows from the resync queue and serves them.
    s.cluster.faults.resume(3);
    eventually(60, "node 3 holds both rows", || {
        local_row(&s, 3, "bkt", "big").is_some() && local_row(&s, 3, "bkt", "small").is_some()
    })
    .await;
    s.cluster.faults.isolate(1);
    let c3 = s.client_of(3);
    for (key, value) in [("big", &big), ("small", &small)] {
        assert!(get(&c3, "bkt", key).await? == *value, "{key} differs on node 3 after it caught up");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anti_entropy_finds_and_fixes_divergence_without_the_queue() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    for i in 0..20u64 {
        put(&c, "bkt", &format!("k{i}"), &pseudo_random(500, i)).await?;
    }
    for i in 0..20u64 {
        landed_row(&s, 3, "bkt", &format!("k{i}")).await;
    }
    // Node 3 misses ten writes; the resync queue is lost (as if node 1's disk died).
    s.cluster.faults.isolate(3);
    for i in 20..30u64 {
        put(&c, "bkt", &format!("k{i}"), &pseudo_random(2_000_000, i)).await?;
    }
    let n1 = s.cluster.node(1);
    let n2 = s.cluster.node(2);
    for n in [&n1, &n2] {
        n.resync.clear()?;
    }
    s.cluster.faults.heal();
    assert!(local_row(&s, 3, "bkt", "k25").is_none());
    let n3 = s.cluster.coordinator(3);
    let fixed = n3.repair().anti_entropy_round().await?;
    assert_eq!(fixed, 10, "exactly the missed rows were pulled");
    for i in 0..30u64 {
        let k = format!("k{i}");
        assert_eq!(local_row(&s, 3, "bkt", &k), local_row(&s, 1, "bkt", &k));
    }
    assert_eq!(n3.repair().anti_entropy_round().await?, 0, "a second round finds nothing");
    Ok(())
}

/// Rows anti-entropy has read from the stores of every node so far.
fn anti_entropy_rows_read(s: &InCluster) -> u64 {
    s.cluster
        .ids()
        .into_iter()
        .map(|id| s.cluster.node(id).metrics.anti_entropy_rows_read.load(Ordering::Relaxed))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_anti_entropy_round_reads_rows_in_proportion_to_what_differs_not_to_what_is_stored() -> R {
    let _gate = crate::gate::shared();
    use futures::{StreamExt as _, TryStreamExt as _};
    const OBJECTS: u64 = 2000;
    let s = InCluster::with(3, |c| c.fsync = false);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    futures::stream::iter(0..OBJECTS)
        .map(|i| {
            let c = c.clone();
            async move { put(&c, "bkt", &format!("k{i}"), &pseudo_random(64, i)).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    for id in s.cluster.ids() {
        for i in 0..OBJECTS {
            landed_row(&s, id, "bkt", &format!("k{i}")).await;
        }
    }
    let n3 = s.cluster.coordinator(3);
    let before = anti_entropy_rows_read(&s);
    assert_eq!(n3.repair().anti_entropy_round().await?, 0);
    let in_sync = anti_entropy_rows_read(&s) - before;
    eprintln!("{OBJECTS} objects in sync: a round read {in_sync} rows");
    assert_eq!(in_sync, 0, "a round over replicas in sync reads no row");

    // Node 3 misses k = 5 changes (3 overwrites, 2 deletes); the resync queue is lost.
    s.cluster.faults.isolate(3);
    let changed: Vec<String> = (0..5).map(|i| format!("k{}", i * 397)).collect();
    for k in &changed[..3] {
        put(&c, "bkt", k, b"newer").await?;
    }
    for k in &changed[3..] {
        c.delete_object().bucket("bkt").key(k).send().await?;
    }
    for id in [1, 2] {
        s.cluster.node(id).resync.clear()?;
    }
    s.cluster.faults.heal();
    // What reading the differing leaves on both sides costs at most: their
    // rows on node 3 and on one peer (after the first peer, node 3 is in sync).
    let partitions = s.cluster.config.partitions;
    let mut leaves: Vec<(u32, u8)> =
        changed.iter().map(|k| lightningstor::meta::merkle::position(partitions, "bkt", k.as_bytes())).collect();
    leaves.sort();
    leaves.dedup();
    let leaf_rows = s.cluster.node(1).store.meta.leaf_rows(&leaves)?.len() as u64;
    let before = anti_entropy_rows_read(&s);
    assert_eq!(n3.repair().anti_entropy_round().await?, 5, "exactly the missed rows were pulled");
    let diverged = anti_entropy_rows_read(&s) - before;
    eprintln!(
        "{OBJECTS} objects, 5 diverged in {} leaves holding {leaf_rows} rows: a round read {diverged} rows",
        leaves.len()
    );
    assert!(diverged >= 10, "both sides' rows of the changed keys were read ({diverged})");
    assert!(diverged <= 2 * leaf_rows, "only the differing leaves were read ({diverged} > 2 x {leaf_rows})");
    assert!(diverged < OBJECTS / 20);
    for k in &changed {
        assert_eq!(local_row(&s, 3, "bkt", k), local_row(&s, 1, "bkt", k));
    }
    assert!(matches!(local_row(&s, 3, "bkt", &changed[4]), Some(Row::Tombstone(_))));
    let before = anti_entropy_rows_read(&s);
    assert_eq!(n3.repair().anti_entropy_round().await?, 0, "a second round finds nothing");
    assert_eq!(anti_entropy_rows_read(&s), before, "and reads no row");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn adding_and_removing_a_node_moves_data_while_reads_and_writes_go_on() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(4);
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    let mut want = BTreeMap::new();
    for i in 0..60u64 {
        let data = pseudo_random(if i % 6 == 0 { 1_100_000 } else { 1000 }, i);
        put(&c, "bkt", &format!("k{i}"), &data).await?;
        want.insert(format!("k{i}"), data);
    }
    // Add node 5: a new cluster file, applied to every node.
    let mut bigger = s.cluster.config.clone();
    let extra = lightningstor::cluster::ClusterConfig::init(5, s.dir.path(), 1, false)?.nodes[4].clone();
    bigger.nodes.push(extra);
    bigger.layout_version += 1;
    s.cluster.start_node("n5", &bigger)?;
    s.cluster.change_layout(&bigger);
    // Reads and writes during the move.
    for (k, v) in &want {
        assert_eq!(&get(&c, "bkt", k).await?, v, "{k} during the move");
    }
    for i in 60..70u64 {
        let data = pseudo_random(3000, i);
        put(&c, "bkt", &format!("k{i}"), &data).await?;
        want.insert(format!("k{i}"), data);
    }
    for id in s.cluster.ids() {
        s.cluster.coordinator(id).repair().rebalance_round().await?;
    }
    for id in s.cluster.ids() {
        s.cluster.node(id).finish_layout_change();
    }
    let n5_rows = want.keys().filter(|k| local_row(&s, 5, "bkt", k).is_some()).count();
    assert!(n5_rows > 20, "node 5 took its share ({n5_rows} rows)");
    for (k, v) in &want {
        for id in s.cluster.node(1).replicas("bkt", k.as_bytes()) {
            assert!(local_row(&s, id, "bkt", k).is_some(), "{k} missing on its new replica {id}");
        }
        assert_eq!(&get(&c, "bkt", k).await?, v);
    }
    // Remove node 2.
    let mut smaller = bigger.clone();
    smaller.nodes.retain(|n| n.id != 2);
    smaller.layout_version += 1;
    s.cluster.change_layout(&smaller);
    for (k, v) in &want {
        assert_eq!(&get(&c, "bkt", k).await?, v, "{k} while node 2 leaves");
    }
    for id in [1, 3, 4, 5, 2] {
        s.cluster.coordinator(id).repair().rebalance_round().await?;
    }
    for id in s.cluster.ids() {
        s.cluster.node(id).finish_layout_change();
    }
    s.cluster.stop_node(2);
    for (k, v) in &want {
        assert_eq!(&get(&s.client_of(1), "bkt", k).await?, v, "{k} after node 2 left");
        for id in s.cluster.node(1).replicas("bkt", k.as_bytes()) {
            assert_ne!(id, 2);
            assert!(local_row(&s, id, "bkt", k).is_some(), "{k} missing on replica {id}");
        }
    }
    Ok(())
}

/// Per key: the last acknowledged value (None = deleted or never written)
/// and every value whose write failed (it may or may not have taken effect).
#[derive(Default, Debug)]
struct KeyModel {
    acked: Option<Vec<u8>>,
    uncertain: Vec<Option<Vec<u8>>>,
    /// What happened to the key, for the failure message.
    log: Vec<String>,
}

impl KeyModel {
    fn allows(&self, got: &Option<Vec<u8>>) -> bool {
        *got == self.acked || self.uncertain.contains(got)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_random_fault_schedule_never_loses_an_acknowledged_write_or_invents_a_value() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::with(5, |c| c.replication_factor = 3);
    let clients: Vec<_> = (1..=5u8).map(|i| s.client_of(i)).collect();
    clients[0].create_bucket().bucket("bkt").send().await?;
    let mut model: BTreeMap<String, KeyModel> = BTreeMap::new();
    let mut rng = 0x5eed_u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut acked_writes, mut reads_checked, mut faults) = (0, 0, 0);
    let mut events = Vec::new();
    for step in 0..160u64 {
        let key = format!("k{}", next(12));
        let via = next(5) as usize;
        match next(20) {
            0..=1 => {
                faults += 1;
                let n = next(5) as u8 + 1;
                s.cluster.faults.isolate(n);
                events.push(format!("step {step}: isolate {n}"));
            }
            2 => {
                faults += 1;
                let (a, b) = (next(5) as u8 + 1, next(5) as u8 + 1);
                s.cluster.faults.cut(a, b);
                events.push(format!("step {step}: cut {a}-{b}"));
            }
            3..=4 => {
                s.cluster.faults.heal();
                events.push(format!("step {step}: heal"));
            }
            5..=10 => {
                let len = if next(8) == 0 { 1_100_000 } else { 100 + next(3000) as usize };
                let value = pseudo_random(len, step);
                let m = model.entry(key.clone()).or_default();
                let r = put(&clients[via], "bkt", &key, &value).await;
                m.log.push(format!("step {step}: put {len} bytes via node {}: {}", via + 1, r.is_ok()));
                events.push(format!("step {step}: put {key} {len} bytes via node {}: {}", via + 1, r.is_ok()));
                match r {
                    Ok(()) => {
                        acked_writes += 1;
                        m.acked = Some(value);
                    }
                    Err(_) => m.uncertain.push(Some(value)),
                }
            }
            11..=12 => {
                let m = model.entry(key.clone()).or_default();
                let r = clients[via].delete_object().bucket("bkt").key(&key).send().await;
                m.log.push(format!("step {step}: delete via node {}: {}", via + 1, r.is_ok()));
                events.push(format!("step {step}: delete {key} via node {}: {}", via + 1, r.is_ok()));
                match r {
                    Ok(_) => m.acked = None,
                    Err(_) => m.uncertain.push(None),
                }
            }
            _ => {
                let got = match clients[via].get_object().bucket("bkt").key(&key).send().await {
                    Ok(o) => Some(Some(o.body.collect().await?.into_bytes().to_vec())),
                    Err(e) if code(&e) == "NoSuchKey" => Some(None),
                    Err(_) => None, // unavailable under faults: allowed
                };
                if let Some(got) = got {
                    reads_checked += 1;
                    let m = model.entry(key.clone()).or_default();
                    let rows: Vec<String> = s
                        .cluster
                        .ids()
                        .into_iter()
                        .filter_map(|id| {
                            local_row(&s, id, "bkt", &key).map(|r| match r {
                                Row::Object(o) => format!("node {id}: {} bytes at {}", o.size, o.version),
                                Row::Tombstone(v) => format!("node {id}: tombstone at {v}"),
                            })
                        })
                        .collect();
                    assert!(
                        m.allows(&got),
                        "step {step}: read of {key} via node {} returned {:?} bytes, a value never written or a lost \
                         write; the key's history: {:#?}; replicas {:?} hold {rows:?}; events: {events:?}",
                        via + 1,
                        got.as_ref().map(Vec::len),
                        m.log,
                        s.cluster.node(1).replicas("bkt", key.as_bytes()),
                    );
                    events.push(format!("step {step}: read {key} via node {}: {:?}", via + 1, got.map(|g| g.len())));
                }
            }
        }
    }
    s.cluster.faults.heal();
    // After healing and repair every replica agrees and every key reads back
    // its acknowledged value (or one whose write was in doubt).
    for id in s.cluster.ids() {
        s.cluster.coordinator(id).repair().anti_entropy_round().await?;
    }
    for (key, m) in &model {
        for c in &clients {
            let got = match c.get_object().bucket("bkt").key(key).send().await {
                Ok(o) => Some(o.body.collect().await?.into_bytes().to_vec()),
                Err(e) if code(&e) == "NoSuchKey" => None,
                Err(e) => panic!("read of {key} failed after healing: {e:?}"),
            };
            assert!(
                m.allows(&got),
                "{key} after healing: {:?} bytes not allowed; history {:#?}",
                got.map(|g| g.len()),
                m.log
            );
        }
    }
    assert!(acked_writes > 25 && reads_checked > 25 && faults > 5, "{acked_writes} {reads_checked} {faults}");
    Ok(())
}

#[test]
fn killing_a_node_during_600_parallel_uploads_loses_no_acknowledged_object() {
    let _gate = crate::gate::shared();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    let cluster = SpawnedCluster::start(3, |c| {
        c.scrub_blocks_per_sec = 0;
        c.anti_entropy_secs = 5;
    });
    let clients: Vec<_> = (0..3).map(|i| cluster.client(i)).collect();
    let cluster = std::sync::Arc::new(std::sync::Mutex::new(cluster));
    rt.block_on(async {
        clients[0].create_bucket().bucket("bkt").send().await.expect("bucket");
        let size = |i: u64| if i % 10 == 0 { 1_500_000 } else { 20_000 + (i as usize % 7) * 1000 };
        let acked_count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let killer = {
            let cluster = cluster.clone();
            let acked = acked_count.clone();
            tokio::spawn(async move {
                while acked.load(std::sync::atomic::Ordering::Relaxed) < 150 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::task::spawn_blocking(move || cluster.lock().expect("lock").kill(2)).await.expect("kill");
            })
        };
        let uploads = futures::stream::iter(0..600u64).map(|i| {
            let c = clients[(i % 3) as usize].clone();
            let acked = acked_count.clone();
            async move {
                let r = put(&c, "bkt", &format!("obj{i}"), &pseudo_random(size(i), i)).await;
                if r.is_ok() {
                    acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                (i, r.is_ok())
            }
        });
        use futures::StreamExt as _;
        let results: Vec<(u64, bool)> = uploads.buffer_unordered(64).collect().await;
        killer.await.expect("killer");
        let acked: Vec<u64> = results.iter().filter(|r| r.1).map(|r| r.0).collect();
        let unacked: Vec<u64> = results.iter().filter(|r| !r.1).map(|r| r.0).collect();
        assert!(acked.len() >= 400, "only {} of 600 uploads acknowledged", acked.len());
        eprintln!("{} acknowledged, {} failed (their coordinator was killed)", acked.len(), unacked.len());
        // During the outage: every acknowledged object reads back from both survivors.
        for &i in &acked {
            for c in &clients[..2] {
                let got = get(c, "bkt", &format!("obj{i}")).await.expect("acknowledged object readable during outage");
                assert!(got == pseudo_random(size(i), i), "obj{i} differs during the outage");
            }
        }
        // Unacknowledged objects are absent or whole, never partial.
        for &i in &unacked {
            match get(&clients[0], "bkt", &format!("obj{i}")).await {
                Ok(got) => assert!(got == pseudo_random(size(i), i), "obj{i} is half-visible"),
                Err(e) => assert!(format!("{e:?}").contains("NoSuchKey"), "obj{i}: {e:?}"),
            }
        }
        // Bring node 3 back and wait for repair to converge.
        let c2 = {
            let cluster = cluster.clone();
            tokio::task::spawn_blocking(move || {
                let mut c = cluster.lock().expect("lock");
                c.restart(2);
                c.client(2)
            })
            .await
            .expect("restart")
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (q, objects) = {
                let c = cluster.lock().expect("lock");
                let q: f64 = (0..3).filter_map(|i| c.metric(i, "lightningstor_resync_queue")).sum();
                let o: Vec<f64> = (0..3).filter_map(|i| c.metric(i, "lightningstor_objects")).collect();
                (q, o)
            };
            if q == 0.0
                && objects.len() == 3
                && objects.iter().all(|o| *o == objects[0])
                && objects[0] >= acked.len() as f64
            {
                break;
            }
            assert!(Instant::now() < deadline, "no convergence: queue {q}, objects {objects:?}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for &i in &acked {
            let got = get(&c2, "bkt", &format!("obj{i}")).await.expect("readable after repair");
            assert!(got == pseudo_random(size(i), i), "obj{i} differs after repair");
        }
    });
}

/// Stored object rows per running node (the `lightningstor_objects` gauge).
fn object_counts(cluster: &SpawnedCluster) -> Vec<f64> {
    (0..cluster.nodes.len()).filter_map(|i| cluster.metric(i, "lightningstor_objects")).collect()
}

/// PUTs `prefix0..prefixN` through the given nodes' clients, 16 at a time;
/// every one must be acknowledged.
async fn put_all(clients: &[aws_sdk_s3::Client], prefix: &str, n: u64, size: impl Fn(u64) -> usize) {
    use futures::StreamExt as _;
    let puts = futures::stream::iter(0..n).map(|i| {
        let c = clients[i as usize % clients.len()].clone();
        let (key, value) = (format!("{prefix}{i}"), pseudo_random(size(i), i ^ prefix.len() as u64));
        async move { put(&c, "bkt", &key, &value).await.map_err(|e| format!("{key}: {e:?}")) }
    });
    for r in puts.buffer_unordered(16).collect::<Vec<_>>().await {
        r.expect("every PUT is acknowledged");
    }
}

/// A two-thread runtime and `n` spawned nodes with scrub off and
/// anti-entropy every 2 s (repair comes from the queues, fast).
fn quiet_spawned(n: usize) -> (tokio::runtime::Runtime, SpawnedCluster) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cluster = SpawnedCluster::start(n, |c| {
        c.scrub_blocks_per_sec = 0;
        c.anti_entropy_secs = 2;
    });
    (rt, cluster)
}

#[test]
fn a_five_node_spawned_cluster_keeps_three_copies_and_rides_out_a_dead_node() {
    let _gate = crate::gate::shared();
    let (rt, mut cluster) = quiet_spawned(5);
    assert_eq!(cluster.config.replication_factor, 3, "cluster init's default");
    let size = |i: u64| if i % 8 == 0 { 1_200_000 } else { 3_000 + (i as usize % 11) * 500 };
    let value = |prefix: &str, i: u64| pseudo_random(size(i), i ^ prefix.len() as u64);
    let clients: Vec<_> = (0..5).map(|i| cluster.client(i)).collect();
    rt.block_on(async {
        clients[0].create_bucket().bucket("bkt").send().await.expect("bucket");
        put_all(&clients, "a", 100, size).await;
    });
    // Three copies of each object (the third may land just after the
    // acknowledgement), spread over all five nodes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while object_counts(&cluster).iter().sum::<f64>() != 300.0 {
        assert!(Instant::now() < deadline, "not 3 x 100 rows: {:?}", object_counts(&cluster));
        std::thread::sleep(Duration::from_millis(200));
    }
    let counts = object_counts(&cluster);
    assert!(counts.len() == 5 && counts.iter().all(|c| *c > 20.0 && *c < 100.0), "placement is lopsided: {counts:?}");

    // One node of five down: every partition keeps two replicas, so every
    // write is still acknowledged and every object reads from every survivor.
    cluster.kill(3);
    let live: Vec<_> = [0, 1, 2, 4].iter().map(|i| clients[*i].clone()).collect();
    rt.block_on(async {
        put_all(&live, "bb", 100, size).await;
        for c in &live {
            for (prefix, i) in (0..100).flat_map(|i| [("a", i), ("bb", i)]) {
                let got = get(c, "bkt", &format!("{prefix}{i}")).await.expect("readable during the outage");
                assert!(got == value(prefix, i), "{prefix}{i} differs during the outage");
            }
        }
    });

    // Back again: the missed writes reach it, and it serves all of them.
    cluster.restart(3);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let q: f64 = (0..5).filter_map(|i| cluster.metric(i, "lightningstor_resync_queue")).sum();
        let counts = object_counts(&cluster);
        if q == 0.0 && counts.len() == 5 && counts.iter().sum::<f64>() == 600.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no convergence: queue {q}, objects {counts:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
    let back = cluster.client(3);
    rt.block_on(async {
        for (prefix, i) in (0..100).flat_map(|i| [("a", i), ("bb", i)]) {
            let got = get(&back, "bkt", &format!("{prefix}{i}")).await.expect("readable from the returned node");
            assert!(got == value(prefix, i), "{prefix}{i} differs after repair");
        }
    });
}

async fn create_upload(c: &aws_sdk_s3::Client, b: &str, k: &str) -> anyhow::Result<String> {
    let up = c.create_multipart_upload().bucket(b).key(k).send().await?;
    Ok(up.upload_id().ok_or_else(|| anyhow::anyhow!("no upload id"))?.to_owned())
}

async fn upload_part(
    c: &aws_sdk_s3::Client,
    b: &str,
    k: &str,
    id: &str,
    n: i32,
    data: &[u8],
) -> anyhow::Result<String> {
    let out = c
        .upload_part()
        .bucket(b)
        .key(k)
        .upload_id(id)
        .part_number(n)
        .body(ByteStream::from(data.to_vec()))
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("part {n} of {k}: {}: {e:?}", code(&e)))?;
    Ok(out.e_tag.ok_or_else(|| anyhow::anyhow!("no etag"))?)
}

async fn complete(c: &aws_sdk_s3::Client, b: &str, k: &str, id: &str, etags: &[String]) -> anyhow::Result<String> {
    use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
    let mut parts = CompletedMultipartUpload::builder();
    for (i, e) in etags.iter().enumerate() {
        parts = parts.parts(CompletedPart::builder().part_number(i as i32 + 1).e_tag(e).build());
    }
    let out = c
        .complete_multipart_upload()
        .bucket(b)
        .key(k)
        .upload_id(id)
        .multipart_upload(parts.build())
        .send()
        .await
        .map_err(|e| anyhow::anyhow!("complete {k}: {}: {e:?}", code(&e)))?;
    Ok(out.e_tag.ok_or_else(|| anyhow::anyhow!("no etag"))?)
}

/// A completion drops the upload in the same transaction, on each replica,
/// as it commits the object: wherever the object is, the upload is gone. A
/// retry through a node that missed the completion (its upload still live)
/// gets the first answer while the key holds that object, and commits
/// nothing again: not with `If-None-Match: *` (no 412), and not over a
/// newer object written meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeated_complete_through_a_replica_that_missed_it_never_commits_again() -> R {
    let _gate = crate::gate::shared();
    use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let id = create_upload(&c, "bkt", "k").await?;
    let etag = upload_part(&c, "bkt", "k", &id, 1, &pseudo_random(70_000, 9)).await?;
    let complete = |c: aws_sdk_s3::Client, cond: bool| {
        let parts =
            CompletedMultipartUpload::builder().parts(CompletedPart::builder().part_number(1).e_tag(&etag).build());
        let req = c.complete_multipart_upload().bucket("bkt").key("k").upload_id(&id).multipart_upload(parts.build());
        let req = if cond { req.if_none_match("*") } else { req };
        async move { req.send().await.map(|o| o.e_tag.unwrap_or_default()).map_err(|e| code(&e)) }
    };
    s.cluster.faults.isolate(3);
    let first = complete(c.clone(), true).await.expect("the first complete");
    for n in [1, 2] {
        let store = &s.cluster.node(n).store;
        assert!(store.meta.upload_gone(&id)? && store.meta.get_upload(&id)?.is_none(), "node {n} kept the upload");
        let Some(Row::Object(m)) = local_row(&s, n, "bkt", "k") else { panic!("node {n} lacks the object") };
        assert_eq!(format!("\"{}\"", m.etag), first);
    }
    let version = |n| local_row(&s, n, "bkt", "k").map(|r| r.version());
    let committed = version(1);
    s.cluster.faults.heal();
    assert!(s.cluster.node(3).store.meta.get_upload(&id)?.is_some(), "node 3 missed the completion");
    // The retry after a lost reply, conditional as the first: the same answer, no new version.
    assert_eq!(complete(s.client_of(3), true).await, Ok(first.clone()));
    assert_eq!(complete(s.client_of(3), false).await, Ok(first.clone()));
    assert_eq!((version(1), version(2)), (committed, committed), "a retry committed again");
    // A newer object written meanwhile is never overwritten by a retry.
    put(&s.client_of(2), "bkt", "k", b"newer").await?;
    for n in 1..=3u8 {
        assert_eq!(complete(s.client_of(n), false).await, Err("NoSuchUpload".to_owned()), "through node {n}");
    }
    assert_eq!(get(&c, "bkt", "k").await?, b"newer");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn multipart_uploads_survive_nodes_down_and_read_back_from_every_node() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let c = s.client_of(1);
    c.create_bucket().bucket("bkt").send().await?;
    let parts =
        [pseudo_random(5 * 1024 * 1024 + 1000, 1), pseudo_random(5 * 1024 * 1024, 2), pseudo_random(300_000, 3)];
    let whole: Vec<u8> = parts.concat();
    // Node 2 misses the creation and part 1; node 3 misses parts 2 and 3 and the completion.
    s.cluster.faults.isolate(2);
    let id = create_upload(&c, "bkt", "big").await?;
    let mut etags = vec![upload_part(&c, "bkt", "big", &id, 1, &parts[0]).await?];
    s.cluster.faults.heal();
    s.cluster.faults.isolate(3);
    for (i, p) in parts.iter().enumerate().skip(1) {
        etags.push(upload_part(&c, "bkt", "big", &id, i as i32 + 1, p).await?);
    }
    let listed = c.list_parts().bucket("bkt").key("big").upload_id(&id).send().await?;
    assert_eq!(listed.parts().len(), 3, "every acknowledged part is listed");
    let e = get(&c, "bkt", "big").await.expect_err("not visible before completion");
    assert!(format!("{e:?}").contains("NoSuchKey"), "{e:?}");
    complete(&c, "bkt", "big", &id, &etags).await?;
    // Node 2 got the blocks of part 1 at completion: both live nodes serve it.
    for n in [1, 2] {
        assert!(get(&s.client_of(n), "bkt", "big").await? == whole, "node {n} read differs during the outage");
    }
    s.cluster.faults.heal();
    eventually(60, "node 3 gets the completed object through the resync queue", || {
        local_row(&s, 3, "bkt", "big") == local_row(&s, 1, "bkt", "big") && s.cluster.node(1).resync.is_empty()
    })
    .await;
    let Some(Row::Object(meta)) = local_row(&s, 3, "bkt", "big") else { panic!("node 3 has no object row") };
    for b in meta.data.blocks() {
        assert!(s.cluster.node(3).store.blocks.contains(&b.hash)?, "node 3 lacks block {}", b.hash.to_hex());
    }
    for n in 1..=3 {
        assert!(get(&s.client_of(n), "bkt", "big").await? == whole, "node {n} read differs after repair");
    }
    // Node 3 missed the drop of the completed upload; it can never revive it.
    assert!(s.cluster.node(3).store.meta.get_upload(&id)?.is_some());
    assert!(c.list_multipart_uploads().bucket("bkt").send().await?.uploads().is_empty());
    assert_eq!(s.cluster.coordinator(3).sweep_uploads().await?, 1, "the sweep drops it on node 3");
    let e = upload_part(&s.client_of(3), "bkt", "big", &id, 4, b"late").await.expect_err("completed upload");
    assert!(e.to_string().contains("NoSuchUpload"), "{e}");
    for n in 1..=3 {
        let store = &s.cluster.node(n).store;
        assert!(store.meta.get_upload(&id)?.is_none() && store.meta.upload_gone(&id)?, "node {n} still has the upload");
        assert_eq!(store.meta.counts()?, s.cluster.node(1).store.meta.counts()?, "node {n} holds other blocks");
    }

    // Abort with a node down: the parts' blocks go, the upload stays gone.
    s.cluster.faults.isolate(2);
    let id2 = create_upload(&c, "bkt", "aborted").await?;
    upload_part(&c, "bkt", "aborted", &id2, 1, &pseudo_random(2_000_000, 9)).await?;
    c.abort_multipart_upload().bucket("bkt").key("aborted").upload_id(&id2).send().await?;
    s.cluster.faults.heal();
    let e = upload_part(&s.client_of(2), "bkt", "aborted", &id2, 2, b"x").await.expect_err("aborted");
    assert!(e.to_string().contains("NoSuchUpload"), "{e}");
    assert!(c.list_multipart_uploads().bucket("bkt").send().await?.uploads().is_empty());
    assert!(get(&c, "bkt", "aborted").await.is_err());
    eventually(10, "aborted parts' blocks are freed", || {
        (1..=3).all(|n| s.cluster.node(n).store.meta.counts().ok() == s.cluster.node(1).store.meta.counts().ok())
    })
    .await;
    Ok(())
}

#[test]
fn a_multipart_upload_to_spawned_nodes_survives_a_kill_and_reads_back_from_every_node() {
    let _gate = crate::gate::shared();
    let (rt, mut cluster) = quiet_spawned(3);
    let c = cluster.client(0);
    let parts = [pseudo_random(6 * 1024 * 1024, 21), pseudo_random(5 * 1024 * 1024 + 7, 22), pseudo_random(1000, 23)];
    let whole: Vec<u8> = parts.concat();
    let id = rt.block_on(async {
        c.create_bucket().bucket("bkt").send().await.expect("bucket");
        let id = create_upload(&c, "bkt", "image.qcow2").await.expect("create");
        upload_part(&c, "bkt", "image.qcow2", &id, 1, &parts[0]).await.expect("part 1");
        id
    });
    cluster.kill(2);
    let etag = rt.block_on(async {
        let mut etags = Vec::new();
        let listed = c.list_parts().bucket("bkt").key("image.qcow2").upload_id(&id).send().await.expect("parts");
        etags.extend(listed.parts().iter().filter_map(|p| p.e_tag().map(str::to_owned)));
        for (i, p) in parts.iter().enumerate().skip(1) {
            etags.push(upload_part(&c, "bkt", "image.qcow2", &id, i as i32 + 1, p).await.expect("part"));
        }
        let etag = complete(&c, "bkt", "image.qcow2", &id, &etags).await.expect("complete with a node down");
        for i in 0..2 {
            let got = get(&cluster.client(i), "bkt", "image.qcow2").await.expect("read during the outage");
            assert!(got == whole, "node {i} read differs during the outage");
        }
        etag
    });
    assert!(etag.ends_with("-3\""), "{etag}");
    cluster.restart(2);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let q: f64 = (0..3).filter_map(|i| cluster.metric(i, "lightningstor_resync_queue")).sum();
        let objects: Vec<f64> = (0..3).filter_map(|i| cluster.metric(i, "lightningstor_objects")).collect();
        if q == 0.0 && objects == [1.0, 1.0, 1.0] {
            break;
        }
        assert!(Instant::now() < deadline, "no convergence: queue {q}, objects {objects:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
    rt.block_on(async {
        for i in 0..3 {
            let got = get(&cluster.client(i), "bkt", "image.qcow2").await.expect("read after repair");
            assert!(got == whole, "node {i} read differs after repair");
        }
        let left = c.list_multipart_uploads().bucket("bkt").send().await.expect("list uploads");
        assert!(left.uploads().is_empty(), "{:?}", left.uploads());
    });
    // Node 3's reads above fetch local blocks first; its disk holds the whole object too.
    let dir = cluster.config.nodes[2].data_dir.clone();
    let sum: usize = block_files(&dir).iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len() as usize)).sum();
    assert!(sum >= whole.len(), "node 3 holds {sum} block bytes, the object is {}", whole.len());
}

/// Node lines of `cluster status` output: (name, health, layout version).
fn status_lines(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 6 && f[0].starts_with('n') && f[1].parse::<u8>().is_ok())
                .then(|| (f[0].to_owned(), f[4].to_owned(), f[5].to_owned()))
        })
        .collect()
}

#[test]
fn cluster_status_and_layout_apply_add_and_remove_nodes_of_running_processes() {
    let _gate = crate::gate::shared();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mut cluster = SpawnedCluster::start_with_spares(3, 1, |c| {
        // The nodes' admin key, in the file for the CLI's `key create`.
        c.access_key = Some(AK.into());
        c.secret_key = Some(SK.into());
        c.scrub_blocks_per_sec = 0;
        c.anti_entropy_secs = 5;
    });
    let path = cluster.config_path.to_string_lossy().into_owned();
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &path]);
    assert!(ok, "status failed: {err}");
    assert_eq!(
        status_lines(&out),
        ["n1", "n2", "n3"].map(|n| (n.to_owned(), "up".to_owned(), "1".to_owned())),
        "{out}"
    );
    assert!(out.contains("repair backlog: 0 resync entries"), "{out}");
    // Below the table, each node's data dir: file system, device, how blocks are written.
    let facts: Vec<&str> = out.lines().filter(|l| l.contains("; block writes ")).collect();
    assert_eq!(facts.len(), 3, "{out}");
    assert!(facts.iter().all(|l| !l.contains(": unknown on ")), "{out}");

    let size = |i: u64| if i % 8 == 0 { 1_300_000 } else { 2000 + i as usize };
    let mut want: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let c0 = cluster.client(0);
    rt.block_on(async {
        c0.create_bucket().bucket("bkt").send().await.expect("bucket");
        for i in 0..40u64 {
            let data = pseudo_random(size(i), i);
            put(&c0, "bkt", &format!("k{i}"), &data).await.expect("put");
            want.insert(format!("k{i}"), data);
        }
    });

    // A key made before n4 joins: only n1..n3 have its rows.
    let key_cli = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--config", path.as_str(), "--node", "n1"]);
        run_cli(&a, &[])
    };
    let (good, out, err) = key_cli(&["key", "create", "dave"]);
    assert!(good, "key create: {err}");
    let (dave, dave_secret) = new_key(&out);
    let (good, _, err) = key_cli(&["bucket", "allow", "--read", "bkt", "--key", "dave"]);
    assert!(good, "bucket allow: {err}");

    // Add n4 while a writer keeps writing through n2.
    let mut bigger = cluster.config.clone();
    bigger.nodes.push(cluster.spares[0].clone());
    bigger.layout_version = 2;
    cluster.set_config(bigger.clone());
    cluster.add(3);
    let writer = {
        let c = cluster.client(1);
        rt.spawn(async move {
            let mut acked = Vec::new();
            for i in 100..130u64 {
                if put(&c, "bkt", &format!("k{i}"), &pseudo_random(3000, i)).await.is_ok() {
                    acked.push(i);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            acked
        })
    };
    let (ok, out, err) = cluster.cli(&["cluster", "layout", "apply", "--config", &path]);
    assert!(ok, "apply (add n4) failed: {out}\n{err}");
    assert!(out.contains("layout 2 in place"), "{out}");
    let acked = rt.block_on(writer).expect("writer");
    assert_eq!(acked.len(), 30, "writes during the move must succeed");
    for i in acked {
        want.insert(format!("k{i}"), pseudo_random(3000, i));
    }
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &path]);
    assert!(ok, "{err}");
    let lines = status_lines(&out);
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines.iter().all(|(_, h, v)| h == "up" && v == "2"), "{out}");
    let n4_objects = cluster.metric(3, "lightningstor_objects").unwrap_or(0.0);
    assert!(n4_objects > 20.0, "n4 took its share: {n4_objects} objects");
    // The added node got the keyring with the data: dave reads through n4
    // as soon as the apply is done, and may still only read.
    let n4 = client_of(&cluster.nodes[3].as_ref().expect("n4 up").endpoint(), &dave, &dave_secret);
    rt.block_on(async {
        let got = n4.get_object().bucket("bkt").key("k0").send().await.expect("dave reads through the added n4");
        assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), want["k0"].as_slice());
        let e = n4.put_object().bucket("bkt").key("dave").body(b"x".to_vec().into()).send().await.expect_err("ro");
        assert_eq!(code(&e), "AccessDenied");
    });
    rt.block_on(async {
        for i in 0..4 {
            let c = cluster.client(i);
            for (k, v) in &want {
                assert!(&get(&c, "bkt", k).await.expect("read after adding n4") == v, "{k} via node {i}");
            }
        }
    });

    // Remove n1, then stop it: everything must still read from the rest.
    let mut smaller = bigger.clone();
    smaller.nodes.retain(|n| n.name != "n1");
    smaller.layout_version = 3;
    cluster.set_config(smaller);
    let (ok, out, err) = cluster.cli(&["cluster", "layout", "apply", "--config", &path]);
    assert!(ok, "apply (remove n1) failed: {out}\n{err}");
    cluster.kill(0);
    rt.block_on(async {
        for i in 1..4 {
            let c = cluster.client(i);
            for (k, v) in &want {
                assert!(&get(&c, "bkt", k).await.expect("read after removing n1") == v, "{k} via node {i}");
            }
        }
    });
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &path]);
    assert!(ok, "{err}");
    assert_eq!(
        status_lines(&out),
        ["n2", "n3", "n4"].map(|n| (n.to_owned(), "up".to_owned(), "3".to_owned())),
        "{out}"
    );
    // An older file is refused.
    let mut stale = bigger;
    stale.nodes.retain(|n| n.name != "n1");
    let stale_path = cluster.dir.path().join("stale.toml");
    std::fs::write(&stale_path, stale.to_toml()).expect("write");
    let (ok, _, err) = cluster.cli(&["cluster", "layout", "apply", "--config", &stale_path.to_string_lossy()]);
    assert!(!ok && err.contains("layout_version"), "{err}");

    // Nothing running: a clear error, not a table of DOWN lines.
    for i in 1..4 {
        cluster.kill(i);
    }
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &path]);
    assert!(!ok, "status with every node down must fail: {out}");
    assert!(err.contains("no node of the cluster answered"), "{err}");
}

#[test]
fn a_random_schedule_of_kills_and_restarts_of_spawned_nodes_never_loses_an_acknowledged_write() {
    let _gate = crate::gate::shared();
    let seed: u64 = std::env::var("LS_FAULT_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64) | 1
    });
    eprintln!("fault schedule seed {seed} (rerun with LS_FAULT_SEED={seed})");
    let (rt, mut cluster) = quiet_spawned(3);
    let mut clients: Vec<aws_sdk_s3::Client> = (0..3).map(|i| cluster.client(i)).collect();
    rt.block_on(clients[0].create_bucket().bucket("bkt").send()).expect("bucket");
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut model: BTreeMap<String, KeyModel> = BTreeMap::new();
    let (mut acked_writes, mut reads_checked, mut kills) = (0u32, 0u32, 0u32);
    let started = Instant::now();
    // At least 150 steps; past that, go on until the schedule has done enough
    // to mean something (a seed with long outages acknowledges few writes),
    // bounded in steps and time.
    let enough = |w: u32, r: u32, k: u32| w >= 25 && r >= 25 && k >= 3;
    for step in 0..600u64 {
        if step >= 150 && enough(acked_writes, reads_checked, kills) {
            break;
        }
        if started.elapsed() > Duration::from_secs(150) {
            eprintln!("time bound reached at step {step}");
            break;
        }
        let key = format!("k{}", next(10));
        let down: Vec<usize> = (0..3).filter(|i| cluster.nodes[*i].is_none()).collect();
        // Requests go through a running node; one sent to a dead process
        // fails before it reaches the cluster and tests nothing.
        let up: Vec<usize> = (0..3).filter(|i| cluster.nodes[*i].is_some()).collect();
        let via = up[next(up.len() as u64) as usize];
        match next(20) {
            0..=1 if down.len() < 2 => {
                let victim = next(3) as usize;
                if cluster.nodes[victim].is_some() {
                    kills += 1;
                    cluster.kill(victim);
                }
            }
            2..=3 if !down.is_empty() => {
                let back = down[next(down.len() as u64) as usize];
                cluster.restart(back);
                clients[back] = cluster.client(back);
            }
            4..=10 => {
                let len = if next(6) == 0 { 1_100_000 } else { 100 + next(20_000) as usize };
                let value = pseudo_random(len, seed ^ step);
                let m = model.entry(key.clone()).or_default();
                match rt.block_on(put(&clients[via], "bkt", &key, &value)) {
                    Ok(()) => {
                        acked_writes += 1;
                        m.acked = Some(value);
                    }
                    Err(_) => m.uncertain.push(Some(value)),
                }
            }
            11..=12 => {
                let m = model.entry(key.clone()).or_default();
                match rt.block_on(clients[via].delete_object().bucket("bkt").key(&key).send()) {
                    Ok(_) => m.acked = None,
                    Err(_) => m.uncertain.push(None),
                }
            }
            _ => {
                let got = rt.block_on(async {
                    match clients[via].get_object().bucket("bkt").key(&key).send().await {
                        Ok(o) => o.body.collect().await.ok().map(|b| Some(b.into_bytes().to_vec())),
                        Err(e) if code(&e) == "NoSuchKey" => Some(None),
                        Err(_) => None, // node down or no quorum: allowed
                    }
                });
                if let Some(got) = got {
                    reads_checked += 1;
                    let m = model.entry(key.clone()).or_default();
                    assert!(m.allows(&got), "seed {seed} step {step}: {key} read a value never written or lost one");
                }
            }
        }
    }
    for i in 0..3 {
        if cluster.nodes[i].is_none() {
            cluster.restart(i);
            clients[i] = cluster.client(i);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    while (0..3).filter_map(|i| cluster.metric(i, "lightningstor_resync_queue")).sum::<f64>() > 0.0 {
        assert!(Instant::now() < deadline, "seed {seed}: resync queues never drained");
        std::thread::sleep(Duration::from_millis(300));
    }
    std::thread::sleep(Duration::from_secs(5)); // two anti-entropy passes
    rt.block_on(async {
        for (key, m) in &model {
            let mut seen = Vec::new();
            for c in &clients {
                let got = match c.get_object().bucket("bkt").key(key).send().await {
                    Ok(o) => Some(o.body.collect().await.expect("body").into_bytes().to_vec()),
                    Err(e) if code(&e) == "NoSuchKey" => None,
                    Err(e) => panic!("seed {seed}: read of {key} failed after recovery: {e:?}"),
                };
                assert!(m.allows(&got), "seed {seed}: {key} after recovery: {:?} not allowed", got.map(|g| g.len()));
                seen.push(got);
            }
            assert!(seen.windows(2).all(|w| w[0] == w[1]), "seed {seed}: nodes disagree on {key} after recovery");
        }
    });
    eprintln!("{acked_writes} acknowledged writes, {reads_checked} reads checked, {kills} kills");
    assert!(
        enough(acked_writes, reads_checked, kills),
        "seed {seed}: the schedule did too little to test anything: {acked_writes} acknowledged writes, {reads_checked} reads, {kills} kills"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_conditional_puts_through_different_nodes_let_exactly_one_win() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let clients: Vec<_> = (1..=3u8).map(|i| s.client_of(i)).collect();
    clients[0].create_bucket().bucket("bkt").send().await?;
    // If-None-Match: * from 12 writers at once: one creates, eleven get 412.
    let tries = (0..12u64).map(|i| {
        let c = clients[(i % 3) as usize].clone();
        async move {
            let r = c
                .put_object()
                .bucket("bkt")
                .key("once")
                .if_none_match("*")
                .body(ByteStream::from(pseudo_random(5000, i)))
                .send()
                .await;
            (i, r.map_err(|e| code(&e)))
        }
    });
    let results = futures::future::join_all(tries).await;
    let winners: Vec<u64> = results.iter().filter(|(_, r)| r.is_ok()).map(|(i, _)| *i).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert!(results.iter().all(|(_, r)| r.as_ref().err().is_none_or(|c| c == "PreconditionFailed")), "{results:?}");
    assert_eq!(get(&clients[1], "bkt", "once").await?, pseudo_random(5000, winners[0]));
    // If-Match on the current ETag from 9 writers at once: one replaces it.
    let etag = clients[0].head_object().bucket("bkt").key("once").send().await?.e_tag.expect("etag");
    let tries = (100..109u64).map(|i| {
        let (c, etag) = (clients[(i % 3) as usize].clone(), etag.clone());
        async move {
            let r = c
                .put_object()
                .bucket("bkt")
                .key("once")
                .if_match(etag)
                .body(ByteStream::from(pseudo_random(700, i)))
                .send()
                .await;
            (i, r.map_err(|e| code(&e)))
        }
    });
    let results = futures::future::join_all(tries).await;
    let winners: Vec<u64> = results.iter().filter(|(_, r)| r.is_ok()).map(|(i, _)| *i).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert_eq!(get(&clients[2], "bkt", "once").await?, pseudo_random(700, winners[0]));
    Ok(())
}

/// A conditional write that works longer than a lease (a complete copying
/// blocks to a lagging replica) keeps its key leased: with 300 ms leases, a
/// holder working 1.5 s is never overlapped by another node's holder, and a
/// holder cut off from the other replicas is abandoned with 503 before the
/// grants it lost expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_lease_is_renewed_while_its_holder_works_and_abandoned_when_it_cannot_be() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::with(3, |c| c.key_lease_ms = 300);
    let (n1, n2) = (s.cluster.coordinator(1), s.cluster.coordinator(2));
    let held = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let first = {
        let (n1, held) = (n1.clone(), held.clone());
        tokio::spawn(async move {
            n1.with_key_lease("bkt", b"k", async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                *held.lock().expect("lock") = Some(Instant::now());
                Ok(())
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = n2.with_key_lease("bkt", b"k", async { Ok(Instant::now()) }).await?;
    first.await??;
    let released = held.lock().expect("lock").expect("the first holder finished");
    assert!(second >= released, "the second holder got the key {:?} before the first let it go", released - second);

    // Cut off from both other replicas, a holder cannot renew: it is
    // abandoned, and the others then take the key.
    let started = Instant::now();
    let cut_off = {
        let (n1, faults) = (n1.clone(), s.cluster.faults.clone());
        tokio::spawn(async move {
            n1.with_key_lease("bkt", b"k2", async {
                faults.isolate(1);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            })
            .await
        })
    };
    let e = cut_off.await?.expect_err("a holder that lost its lease is abandoned");
    assert!(matches!(e, lightningstor::LightningError::Unavailable(_)), "{e:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "abandoned only after {:?}", started.elapsed());
    s.cluster.faults.heal();
    n2.with_key_lease("bkt", b"k2", async { Ok(()) }).await?;
    Ok(())
}

/// A row for `data` staged by `Engine::stage`, as PutObject commits it.
fn object_row(staged: &lightningstor::engine::Staged<lightningstor::cluster::engine::Session>) -> ObjectMeta {
    ObjectMeta {
        version: 0,
        size: staged.size,
        etag: hex::encode(staged.md5),
        last_modified_ms: 1,
        headers: Default::default(),
        checksum: None,
        parts: Vec::new(),
        data: staged.data.clone(),
        sse_c: None,
        versioned: None,
    }
}

/// A write racing DeleteBucket: a body staged before the delete and
/// committed after it is refused NoSuchBucket on every replica, so the
/// write fails and neither brings the bucket back nor leaves a row. One
/// committed on a replica before the delete reached it makes the delete
/// fail there: the delete answers BucketNotEmpty and the bucket is back
/// on every node, holding the object.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_racing_delete_bucket_fails_with_no_such_bucket_and_leaves_nothing() -> R {
    let _gate = crate::gate::shared();
    use lightningstor::engine::Engine;
    use lightningstor::meta::ops::WriteConditions;
    let s = InCluster::new(3);
    let (n1, n2) = (s.cluster.coordinator(1), s.cluster.coordinator(2));
    Engine::create_bucket(&n1, "race").await?;
    let body = || futures::stream::iter([Ok::<_, std::io::Error>(bytes::Bytes::from(pseudo_random(300_000, 5)))]);
    let staged = Engine::stage(&n1, "race", "k", body(), None, false).await?;
    let row = object_row(&staged);
    Engine::delete_bucket(&n2, "race").await?;
    let e = Engine::commit(&n1, "race", "k", row, staged.hold, &WriteConditions::default()).await.expect_err("deleted");
    assert!(matches!(e, lightningstor::LightningError::NoSuchBucket(_)), "{e:?}");
    // So is a copy into it (the same commit) and a conditional write.
    let staged = Engine::stage(&n1, "race", "k", body(), None, true).await?;
    let cond = WriteConditions { if_none_match: Some(s3s::dto::ETagCondition::Any), if_match: None };
    let e = Engine::commit(&n1, "race", "k", object_row(&staged), staged.hold, &cond).await.expect_err("deleted");
    assert!(matches!(e, lightningstor::LightningError::NoSuchBucket(_)), "{e:?}");
    for n in 1..=3u8 {
        let store = &s.cluster.node(n).store;
        assert!(store.meta.get_bucket("race")?.is_none(), "node {n} has the bucket again");
        assert!(local_row(&s, n, "race", "k").is_none(), "node {n} kept a row");
    }
    let c = s.client();
    assert_eq!(status(&c.head_bucket().bucket("race").send().await.expect_err("deleted")), 404);

    // Node 3 commits a write (its replica's part of it) before the delete
    // reaches it; the delete fails, and leaves the bucket on every node.
    Engine::create_bucket(&n1, "race2").await?;
    let staged = Engine::stage(&n1, "race2", "k", body(), None, true).await?;
    let row = Row::Object(ObjectMeta { version: n1.node.hlc.now(), ..object_row(&staged) });
    let node3 = s.cluster.node(3);
    let req = lightningstor::cluster::rpc::Req::Commit { session: 0, bucket: "race2".into(), key: b"k".to_vec(), row };
    node3.call(3, lightningstor::cluster::rpc::Msg::new(req)).await?;
    // (The listing the delete starts with reads a quorum that may not include node 3.)
    match Engine::delete_bucket(&n2, "race2").await {
        Err(lightningstor::LightningError::BucketNotEmpty(_)) => {}
        other => panic!("delete of a bucket a replica holds an object of: {other:?}"),
    }
    for n in 1..=3u8 {
        assert!(s.cluster.node(n).store.meta.get_bucket("race2")?.is_some(), "node {n} lost the bucket");
    }
    c.head_bucket().bucket("race2").send().await?;
    Ok(())
}

/// A process that can reach a node's RPC port but lacks the cluster's
/// `rpc_secret` gets nothing done: an old-style client that sends a
/// `ChangeLayout` frame straight away, a handshake with a made-up answer, and
/// the operator CLI run with a cluster file holding another secret (a
/// separate process, as an intruder's would be) are all refused, and the
/// nodes keep their layout and keep serving.
#[test]
fn node_rpc_refuses_every_peer_without_the_cluster_secret() {
    let _gate = crate::gate::shared();
    use std::io::{Read, Write};
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cluster = SpawnedCluster::start(3, |c| {
        c.scrub_blocks_per_sec = 0;
        c.anti_entropy_secs = 0;
    });
    let rpc = cluster.config.nodes[0].rpc;
    let read_to_end = |s: &mut std::net::TcpStream| -> Vec<u8> {
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        got
    };

    // 1. A client of the unauthenticated protocol: a ChangeLayout frame at once.
    let mut shrunk = cluster.config.clone();
    shrunk.nodes.truncate(1);
    shrunk.replication_factor = 1;
    shrunk.layout_version = 9;
    let frame = lightningstor::cluster::rpc::encode(&lightningstor::cluster::rpc::Msg::new(
        lightningstor::cluster::rpc::Req::ChangeLayout { old: cluster.config.to_toml(), new: shrunk.to_toml() },
    ))
    .expect("frame");
    let mut s = std::net::TcpStream::connect(rpc).expect("connect");
    s.write_all(&frame).expect("send");
    let got = read_to_end(&mut s);
    assert!(got.starts_with(b"LSRPC"), "the node greets first: {got:?}");
    assert_eq!(got.len(), lightningstor::cluster::auth::HELLO_LEN, "and says nothing more before it closes");

    // 2. A handshake with a made-up answer.
    let mut s = std::net::TcpStream::connect(rpc).expect("connect");
    let mut hello = [0u8; lightningstor::cluster::auth::HELLO_LEN];
    s.read_exact(&mut hello).expect("hello");
    s.write_all(&[0x5a; lightningstor::cluster::auth::ANSWER_LEN]).expect("answer");
    assert!(read_to_end(&mut s).is_empty(), "no proof for a caller without the secret");

    // 3. The operator CLI with a file that holds another secret.
    let mut rogue = cluster.config.clone();
    rogue.rpc_secret = Some(lightningstor::cluster::auth::RpcSecret::random().expect("random").to_hex());
    let rogue_path = cluster.dir.path().join("rogue.toml");
    std::fs::write(&rogue_path, rogue.to_toml()).expect("write rogue file");
    let rogue_path = rogue_path.to_string_lossy().into_owned();
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &rogue_path]);
    assert!(!ok, "status with another secret must fail: {out}");
    assert!(err.contains("rpc handshake refused"), "{err}");
    let mut rogue_shrunk = shrunk.clone();
    rogue_shrunk.rpc_secret = rogue.rpc_secret.clone();
    std::fs::write(cluster.dir.path().join("rogue-shrunk.toml"), rogue_shrunk.to_toml()).expect("write");
    let shrunk_path = cluster.dir.path().join("rogue-shrunk.toml").to_string_lossy().into_owned();
    let (ok, _, err) = cluster.cli(&["cluster", "layout", "apply", "--config", &shrunk_path]);
    assert!(!ok, "layout apply with another secret must fail");
    assert!(err.contains("rpc handshake refused"), "{err}");

    // The cluster is unharmed: every node up at layout 1, and it serves.
    let path = cluster.config_path.to_string_lossy().into_owned();
    let (ok, out, err) = cluster.cli(&["cluster", "status", "--config", &path]);
    assert!(ok, "status failed: {err}");
    assert_eq!(
        status_lines(&out),
        ["n1", "n2", "n3"].map(|n| (n.to_owned(), "up".to_owned(), "1".to_owned())),
        "{out}"
    );
    let c = cluster.client(0);
    rt.block_on(async {
        c.create_bucket().bucket("bkt").send().await.expect("bucket");
        put(&c, "bkt", "k", b"still here").await.expect("put");
        assert_eq!(get(&cluster.client(2), "bkt", "k").await.expect("get"), b"still here");
    });
}

#[test]
fn cluster_init_writes_random_keys_and_allows_anonymous_access_only_when_asked() {
    let _gate = crate::gate::shared();
    let init = |extra: &[&str]| {
        let mut a = vec!["cluster", "init", "--nodes", "3", "--base-dir", "/tmp/ls-init"];
        a.extend(extra);
        let (good, out, err) = run_cli(&a, &[]);
        assert!(good, "{err}");
        lightningstor::cluster::ClusterConfig::from_toml(&out).expect("init prints a valid file")
    };
    let (a, b) = (init(&[]), init(&[]));
    assert!(!a.anonymous && !b.anonymous, "no anonymous access by default");
    let (ak, sk) = (a.access_key.clone().expect("an admin key"), a.secret_key.clone().expect("a secret"));
    assert!(ak.starts_with("LS") && sk.len() == 40, "{ak} {sk}");
    assert_ne!((a.access_key, a.secret_key, a.rpc_secret), (b.access_key, b.secret_key, b.rpc_secret), "random");
    assert!(init(&["--anonymous"]).anonymous);
}

#[test]
fn keys_made_through_one_node_work_on_every_node_also_after_restarts() {
    let _gate = crate::gate::shared();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let mut cluster = SpawnedCluster::start(3, |c| {
        // The file's admin key is the one the nodes run with (the
        // environment gives them AK/SK too), so the CLI reads it from the file.
        c.access_key = Some(AK.into());
        c.secret_key = Some(SK.into());
        c.scrub_blocks_per_sec = 0;
    });
    let path = cluster.config_path.to_string_lossy().into_owned();
    let cli = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--config", path.as_str(), "--node", "n1"]);
        run_cli(&a, &[])
    };
    let endpoints: Vec<String> = (0..3).map(|i| cluster.nodes[i].as_ref().expect("up").endpoint()).collect();
    let (bob, secret) = rt.block_on(keys_and_permissions(&cli, &endpoints));

    // n2 restarts: it authorizes bob from its own rows.
    cluster.kill(1);
    cluster.restart(1);
    let n2 = client_of(&cluster.nodes[1].as_ref().expect("up").endpoint(), &bob, &secret);
    rt.block_on(async {
        n2.get_object().bucket("adminb").key("k").send().await.expect("bob reads on the restarted node");
        let e = n2.put_object().bucket("adminb").key("x").body(b"x".to_vec().into()).send().await.expect_err("ro");
        assert_eq!(code(&e), "AccessDenied");
    });

    // A key made while n3 is down reaches it from the resync queue once it is back.
    cluster.kill(2);
    let (good, out, err) = cli(&["key", "create", "carol"]);
    assert!(good, "two of three nodes take a key: {err}");
    let (carol, carol_secret) = new_key(&out);
    cluster.restart(2);
    let n3 = client_of(&cluster.nodes[2].as_ref().expect("up").endpoint(), &carol, &carol_secret);
    let back = Instant::now();
    let deadline = back + Duration::from_secs(60);
    rt.block_on(async {
        loop {
            match n3.list_buckets().send().await {
                Ok(_) => break,
                Err(e) => {
                    assert_eq!(code(&e), "InvalidAccessKeyId", "{e:?}");
                    assert!(Instant::now() < deadline, "carol's key did not reach n3 within 60 s");
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    eprintln!("carol's key reached the returned node {:?} after it listened", back.elapsed());
}

#[test]
fn an_anonymous_cluster_serves_requests_signed_with_unknown_keys() {
    let _gate = crate::gate::shared();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let cluster = SpawnedCluster::start(3, |c| c.anonymous = true);
    let ep = |i: usize| cluster.nodes[i].as_ref().expect("up").endpoint();
    rt.block_on(async {
        let c = client_of(&ep(0), "nobody", "anything");
        c.create_bucket().bucket("open").send().await.expect("create with an unknown key");
        c.put_object().bucket("open").key("k").body(b"open data".to_vec().into()).send().await.expect("put");
        let other = client_of(&ep(2), "somebody", "else");
        let out = other.get_object().bucket("open").key("k").send().await.expect("get through another node");
        assert_eq!(out.body.collect().await.expect("body").into_bytes().as_ref(), b"open data");
        // The admin key (from the environment) is still checked.
        let e = client_of(&ep(1), AK, "wrong").list_buckets().send().await.expect_err("bad signature");
        assert_eq!(code(&e), "SignatureDoesNotMatch");
    });
}

/// A node of an older build knows no `RowVersions` (the batched version
/// asks of reads) and answers it as unsupported (testkit's
/// `Faults::old_build` answers for it as the TCP listener answers a request
/// it cannot decode). During a rolling upgrade, reads through the other
/// nodes ask it for its row instead: they keep their quorum with the third
/// replica down, and return the last acknowledged write, also through a
/// coordinator whose own copy missed that write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_keep_their_quorum_when_a_replica_of_an_older_build_refuses_version_asks() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    s.cluster.faults.old_build(2);
    let c1 = s.client_of(1);
    c1.create_bucket().bucket("bkt").send().await?;
    for (key, size) in [("small", 3000usize), ("large", 3 << 20)] {
        put(&c1, "bkt", key, &pseudo_random(size, 90)).await?;
        let old = landed_row(&s, 3, "bkt", key).await.version();
        // Node 3 misses v2, and node 1 forgets to resync it: nodes 1 and 2 hold it.
        s.cluster.faults.cut(1, 3);
        let v2 = pseudo_random(size, 91);
        put(&c1, "bkt", key, &v2).await?;
        eventually(10, "node 2 commits v2", || local_row(&s, 2, "bkt", key).is_some_and(|r| r.version() > old)).await;
        s.cluster.node(1).resync.clear()?;
        s.cluster.faults.heal();
        // Node 3 down: a read through node 1 has itself and node 2.
        s.cluster.faults.isolate(3);
        for _ in 0..3 {
            let got = get(&c1, "bkt", key).await?;
            assert!(got == v2, "{key} through node 1 with node 3 down: {} bytes, not v2", got.len());
        }
        s.cluster.faults.heal();
        // Node 1 down: a read through stale node 3 has itself and node 2,
        // which alone holds v2 among them.
        s.cluster.faults.isolate(1);
        assert_eq!(local_row(&s, 3, "bkt", key).map(|r| r.version()), Some(old), "node 3 missed v2 of {key}");
        let got = get(&s.client_of(3), "bkt", key).await?;
        assert!(got == v2, "{key} through stale node 3 with node 1 down: {} bytes, not v2", got.len());
        s.cluster.faults.heal();
    }
    Ok(())
}

/// Deleting a bucket and creating it again under the same name: the
/// replicas' memory of the delete (`buckets_gone`) must neither answer a
/// false NoSuchBucket for the new bucket nor let the old one come back,
/// with every node up, with a node down during the delete, and with a node
/// down during the new create that has to take writes afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bucket_deleted_and_created_again_serves_through_every_node() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let clients: Vec<aws_sdk_s3::Client> = (1..=3).map(|i| s.client_of(i)).collect();
    let data = |round: u64, i: u64| pseudo_random(2000 + (i as usize) * 7000, 100 + round * 10 + i);
    // Round 0: every node up. Round 1: node 3 down during the delete.
    // Round 2: node 3 down during the new create, node 1 down afterwards
    // (node 1 coordinated the create, so only node 3's own memory decides).
    for round in 0..3u64 {
        let what = |m: &str| format!("round {round}: {m}");
        clients[0].create_bucket().bucket("again").send().await?;
        for (i, c) in clients.iter().enumerate() {
            put(c, "again", &format!("k{i}"), &data(round, i as u64)).await?;
        }
        for (i, c) in clients.iter().enumerate() {
            c.delete_object().bucket("again").key(format!("k{i}")).send().await?;
        }
        if round == 1 {
            s.cluster.faults.isolate(3);
        }
        clients[1].delete_bucket().bucket("again").send().await?;
        s.cluster.faults.heal();
        // Deleted, as acknowledged, through every node.
        for (i, c) in clients.iter().enumerate() {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let listed = c.list_buckets().send().await?;
                let head = c.head_bucket().bucket("again").send().await;
                let listed = listed.buckets().iter().any(|b| b.name() == Some("again"));
                let last = match head {
                    Err(e) if status(&e) == 404 && !listed => break,
                    other => format!("head {:?}, listed {listed}", other.map(|_| ()).map_err(|e| status(&e))),
                };
                assert!(Instant::now() < deadline, "{}", what(&format!("node {} still has the bucket: {last}", i + 1)));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        if round == 2 {
            s.cluster.faults.isolate(3);
        }
        clients[0]
            .create_bucket()
            .bucket("again")
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("{}", what(&format!("create again: {}", code(&e)))))?;
        if round == 2 {
            // Node 1 stops before its resync queue gives node 3 the bucket.
            s.cluster.node(1).resync.clear()?;
        }
        s.cluster.faults.heal();
        let writers: Vec<usize> = if round == 2 {
            s.cluster.faults.isolate(1);
            vec![1, 2]
        } else {
            vec![0, 1, 2]
        };
        for &w in &writers {
            let k = format!("n{w}");
            put(&clients[w], "again", &k, &data(round, 10 + w as u64))
                .await
                .map_err(|e| anyhow::anyhow!("{}", what(&format!("put {k} through node {}: {e}", w + 1))))?;
        }
        for &r in &writers {
            clients[r].head_bucket().bucket("again").send().await?;
            for &w in &writers {
                let k = format!("n{w}");
                let got = get(&clients[r], "again", &k).await?;
                assert!(got == data(round, 10 + w as u64), "{}", what(&format!("{k} through node {}", r + 1)));
            }
            for i in 0..3 {
                let e = clients[r].get_object().bucket("again").key(format!("k{i}")).send().await.expect_err("deleted");
                assert_eq!(code(&e), "NoSuchKey", "{}", what("an object of the old bucket"));
            }
        }
        s.cluster.faults.heal();
        // Every node ends up with the bucket row and no memory of the delete.
        for n in 1..=3u8 {
            eventually(20, &what(&format!("node {n} holds the new bucket")), || {
                s.cluster.node(n).store.meta.get_bucket("again").ok().flatten().is_some()
            })
            .await;
        }
        for &w in &writers {
            for (r, c) in clients.iter().enumerate() {
                let got = get(c, "again", &format!("n{w}")).await?;
                assert!(got == data(round, 10 + w as u64), "{}", what(&format!("n{w} through node {}", r + 1)));
            }
            clients[0].delete_object().bucket("again").key(format!("n{w}")).send().await?;
        }
        clients[0].delete_bucket().bucket("again").send().await?;
    }
    Ok(())
}

/// Node `n`'s own bucket row of `b`.
fn bucket_row(s: &InCluster, n: NodeId, b: &str) -> Option<lightningstor::meta::types::BucketMeta> {
    s.cluster.node(n).store.meta.get_bucket(b).ok().flatten()
}

/// HeadBucket's HTTP status through `c`.
async fn head_status(c: &aws_sdk_s3::Client, b: &str) -> u16 {
    match c.head_bucket().bucket(b).send().await {
        Ok(_) => 200,
        Err(e) => status(&e),
    }
}

/// A bucket's create or delete that reaches a node late, from the resync
/// queue of a node that missed what came after it, must not undo it
/// (5 nodes, so that a majority takes each step without the nodes cut off).
/// Late delete: node 2 deletes the bucket with node 5 cut off and queues
/// the delete for it; node 1 creates the bucket again with nodes 2 and 5
/// cut off and queues the create for both; node 5 gets the create, then
/// node 2's old delete. Late create: node 1 creates a bucket with node 5
/// cut off and queues the create for it; node 2 deletes the bucket with
/// node 1 cut off; node 1's old create then reaches node 5.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_bucket_create_or_delete_from_the_resync_queue_undoes_nothing() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(5);
    let f = &s.cluster.faults;
    let clients: Vec<aws_sdk_s3::Client> = (1..=5).map(|i| s.client_of(i)).collect();
    let row = |n: u8, b: &str| bucket_row(&s, n, b);
    let created = |n: u8, b: &str| row(n, b).map(|r| r.created_ms);

    // Late delete.
    clients[0].create_bucket().bucket("late").send().await?;
    f.isolate(5);
    clients[1].delete_bucket().bucket("late").send().await?;
    assert!(!s.cluster.node(2).resync.is_empty(), "node 2 queued the delete for node 5");
    f.cut(1, 2);
    clients[0].create_bucket().bucket("late").send().await?;
    let new = created(1, "late").expect("node 1 holds the new bucket");
    assert!(row(2, "late").is_none() && row(5, "late").is_some_and(|r| r.created_ms < new), "nodes 2 and 5 missed it");
    // Node 5 gets node 1's create first, then node 2's delete.
    f.cut(2, 5);
    f.rejoin(5);
    eventually(20, "node 5 takes the new bucket from node 1's queue", || created(5, "late") == Some(new)).await;
    f.uncut(2, 5);
    eventually(20, "node 2's queued delete reaches node 5", || s.cluster.node(2).resync.is_empty()).await;
    assert_eq!(created(5, "late"), Some(new), "node 2's late delete deleted the bucket created since on node 5");
    f.heal();
    eventually(20, "node 2 gets the new bucket", || created(2, "late") == Some(new)).await;
    for (w, c) in clients.iter().enumerate() {
        put(c, "late", &format!("k{w}"), &pseudo_random(3000, 200 + w as u64))
            .await
            .map_err(|e| anyhow::anyhow!("put through node {}: {e}", w + 1))?;
    }
    for (r, c) in clients.iter().enumerate() {
        for w in 0..clients.len() {
            let got = get(c, "late", &format!("k{w}")).await?;
            assert!(got == pseudo_random(3000, 200 + w as u64), "k{w} through node {}", r + 1);
        }
    }

    // Late create.
    f.isolate(5);
    clients[0].create_bucket().bucket("later").send().await?;
    let made = created(1, "later").expect("node 1 holds the bucket");
    assert!(!s.cluster.node(1).resync.is_empty(), "node 1 queued the create for node 5");
    f.cut(1, 5);
    f.rejoin(5);
    f.cut(1, 2);
    f.cut(2, 1);
    clients[1].delete_bucket().bucket("later").send().await?;
    assert!(row(5, "later").is_none() && created(1, "later") == Some(made), "node 1 missed the delete");
    // Node 1, still holding the bucket, sends node 5 its old create.
    f.uncut(1, 5);
    eventually(20, "node 1's queued create reaches node 5", || s.cluster.node(1).resync.is_empty()).await;
    assert!(row(5, "later").is_none(), "node 1's late create brought the deleted bucket back on node 5");
    f.heal();
    eventually(20, "node 1 gets the delete", || row(1, "later").is_none()).await;
    for (i, c) in clients.iter().enumerate() {
        assert_eq!(head_status(c, "later").await, 404, "HeadBucket through node {}", i + 1);
        let listed = c.list_buckets().send().await?;
        assert!(!listed.buckets().iter().any(|b| b.name() == Some("later")), "listed through node {}", i + 1);
    }
    Ok(())
}

/// Bucket rows and the keyring are part of anti-entropy: a node that
/// missed a bucket's delete, its create, or a new key gets it although the
/// coordinator's resync queue lost the entry (the coordinator died before
/// it ran; here: cleared).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn anti_entropy_repairs_bucket_rows_and_keys_a_lost_resync_entry_left_behind() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::with(3, |c| c.anti_entropy_secs = 1);
    let f = &s.cluster.faults;
    let c1 = s.client_of(1);
    let c3 = s.client_of(3);
    let row = |n: u8, b: &str| bucket_row(&s, n, b);
    let repairs = |n: u8| s.cluster.node(n).metrics.repairs.load(std::sync::atomic::Ordering::Relaxed);

    // A missed delete.
    c1.create_bucket().bucket("gone").send().await?;
    f.isolate(3);
    s.client_of(2).delete_bucket().bucket("gone").send().await?;
    s.cluster.node(2).resync.clear()?;
    assert!(row(3, "gone").is_some(), "node 3 missed the delete");
    f.heal();
    let before = repairs(1) + repairs(2);
    eventually(20, "node 3 loses the deleted bucket", || row(3, "gone").is_none()).await;
    assert!(repairs(1) + repairs(2) > before, "anti-entropy counted its repair");
    assert_eq!(head_status(&c3, "gone").await, 404, "HeadBucket through node 3");

    // A missed create.
    f.isolate(3);
    c1.create_bucket().bucket("made").send().await?;
    s.cluster.node(1).resync.clear()?;
    assert!(row(3, "made").is_none(), "node 3 missed the create");
    f.heal();
    eventually(20, "node 3 gets the bucket", || {
        row(3, "made").map(|r| r.created_ms) == row(1, "made").map(|r| r.created_ms)
    })
    .await;
    // Node 3 takes the bucket's writes as a replica again.
    f.isolate(1);
    put(&c3, "made", "k", &pseudo_random(5000, 300)).await?;
    f.heal();
    assert!(get(&c1, "made", "k").await? == pseudo_random(5000, 300), "k through node 1");

    // A key made while node 3 was away.
    use lightningstor::keys::Keyring as _;
    f.isolate(3);
    let (id, key) = lightningstor::keys::create_key(&*s.cluster.coordinator(1), "late-key").await?;
    s.cluster.node(1).resync.clear()?;
    assert!(s.cluster.node(3).store.key(&id)?.is_none(), "node 3 missed the key");
    f.heal();
    eventually(20, "node 3 learns the key", || s.cluster.node(3).store.key(&id).ok().flatten().is_some()).await;
    let conf = sdk_config("http://localhost:9000", &id, &key.secret)
        .http_client(testkit::sdk::InProcess::from(s.cluster.service(3)))
        .build();
    aws_sdk_s3::Client::from_conf(conf).create_bucket().bucket("keyed").send().await?;
    Ok(())
}

/// A replica that missed a bucket's create makes the row itself when a
/// row of the bucket reaches it (here: a tombstone, through anti-entropy,
/// before the bucket's delete does). That row has no known creation time:
/// the delete still deletes it, and it is never sent on as a create that
/// would bring the deleted bucket back on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bucket_row_a_replica_made_for_a_tombstone_does_not_bring_the_deleted_bucket_back() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::with(3, |c| c.anti_entropy_secs = 1);
    let f = &s.cluster.faults;
    let c1 = s.client_of(1);
    let row = |n: u8| bucket_row(&s, n, "tomb");
    f.isolate(3);
    c1.create_bucket().bucket("tomb").send().await?;
    put(&c1, "tomb", "k", &pseudo_random(2000, 400)).await?;
    c1.delete_object().bucket("tomb").key("k").send().await?;
    c1.delete_bucket().bucket("tomb").send().await?;
    s.cluster.node(1).resync.clear()?;
    s.cluster.node(2).resync.clear()?;
    assert!(row(3).is_none(), "node 3 missed the create");
    f.heal();
    // Anti-entropy pushes the tombstone (the object rows' round runs first).
    eventually(20, "node 3 gets the tombstone", || local_row(&s, 3, "tomb", "k").is_some()).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    for n in 1..=3u8 {
        assert!(row(n).is_none(), "node {n} holds the deleted bucket: {:?}", row(n));
    }
    for (i, c) in (1..=3u8).map(|n| s.client_of(n)).enumerate() {
        assert_eq!(head_status(&c, "tomb").await, 404, "HeadBucket through node {}", i + 1);
    }
    Ok(())
}

/// An admin request names the node it is signed for (`node=`, the address
/// the client connected to): recorded on its way to one node of a cluster,
/// it is refused by the others, inside the five minutes and with a nonce
/// they never saw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_request_replayed_to_another_node_is_refused() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let cluster = lightningstor::cluster::start_local(3, dir.path(), |c| {
        c.access_key = Some(AK.into());
        c.secret_key = Some(SK.into());
        c.anonymous = false;
        c.scrub_blocks_per_sec = 0;
        c.anti_entropy_secs = 0;
    })
    .await?;
    let addrs = cluster.s3_addrs();
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
    let target = format!(
        "/_admin/keys?name=eve&nonce={}&node={}",
        lightningstor::admin::new_nonce()?,
        lightningstor::admin::encode(&addrs[0].to_string())
    );
    let auth = lightningstor::admin::authorization(AK, SK, secs, "POST", &target);
    let send = |addr: std::net::SocketAddr| {
        let (url, auth) = (format!("http://{addr}{target}"), auth.clone());
        async move {
            let r = reqwest::Client::new().post(url).header("authorization", auth).send().await?;
            anyhow::Ok((r.status().as_u16(), r.text().await?))
        }
    };
    let (st, body) = send(addrs[0]).await?;
    assert_eq!(st, 200, "{body}");
    for &other in &addrs[1..] {
        let (st, body) = send(other).await?;
        assert!(st == 403 && body.contains("another node"), "replayed to {other}: {st} {body}");
    }
    // The client names each node it talks to.
    let admin = lightningstor::admin::Client::new(&addrs[1].to_string(), AK, SK);
    admin.create_key("mallory").await?;
    let keys = admin.list_keys().await?;
    assert_eq!(keys.iter().filter(|k| k.name == "eve").count(), 1, "{keys:?}");
    cluster.shutdown().await;
    Ok(())
}

/// The version ids node `n` holds for a key (newest first), and those it
/// deleted for good.
fn held_versions(s: &InCluster, n: NodeId, b: &str, k: &str) -> (Vec<u64>, Vec<u64>) {
    let (versions, gone) = s.cluster.node(n).store.meta.key_versions(b, k.as_bytes()).expect("versions");
    (versions.iter().map(|v| v.version()).collect(), gone)
}

/// Bucket versioning across replicas that miss things: a node cut off
/// while versioning is turned on gets the state from the resync queue;
/// versions written while a replica is cut off are read and listed through
/// any read quorum (R + W > N); a version deleted for good while a replica
/// that holds it is cut off stays deleted when that replica is part of the
/// quorum again; deleting the latest version for good makes the one below
/// it current on every replica, with its own id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn versions_survive_replicas_that_miss_writes_and_deletes_of_versions() -> R {
    let _gate = crate::gate::shared();
    use aws_sdk_s3::types::{BucketVersioningStatus, VersioningConfiguration};
    let s = InCluster::new(3);
    let f = &s.cluster.faults;
    let c1 = s.client_of(1);
    c1.create_bucket().bucket("bkt").send().await?;
    put(&c1, "bkt", "pre", b"before versioning").await?;
    f.isolate(3);
    let enabled = VersioningConfiguration::builder().status(BucketVersioningStatus::Enabled).build();
    c1.put_bucket_versioning().bucket("bkt").versioning_configuration(enabled).send().await?;
    assert_eq!(bucket_row(&s, 3, "bkt").and_then(|r| r.versioning), None, "node 3 was cut off");
    f.heal();
    eventually(30, "node 3 gets the versioning state from the resync queue", || {
        bucket_row(&s, 3, "bkt").and_then(|r| r.versioning) == Some(lightningstor::meta::types::Versioning::Enabled)
    })
    .await;
    // Every replica made the object from before its key's null version.
    for n in 1..=3 {
        let (held, _) = held_versions(&s, n, "bkt", "pre");
        assert_eq!(held.len(), 1, "node {n}: {held:?}");
    }

    let put_v = |c: aws_sdk_s3::Client, body: &'static [u8]| async move {
        let out = c.put_object().bucket("bkt").key("k").body(ByteStream::from_static(body)).send().await?;
        anyhow::Ok(out.version_id().expect("version id").to_owned())
    };
    let v1 = put_v(c1.clone(), b"one").await?;
    let v2 = put_v(c1.clone(), b"two").await?;
    eventually(10, "every replica holds both versions", || {
        (1..=3).all(|n| held_versions(&s, n, "bkt", "k").0.len() == 2)
    })
    .await;
    // Node 3 is cut off while v1 is deleted for good and v3 is written.
    f.isolate(3);
    c1.delete_object().bucket("bkt").key("k").version_id(&v1).send().await?;
    let v3 = put_v(c1.clone(), b"three").await?;
    // A quorum of nodes 2 and 3, node 1 (whose resync queue holds what
    // node 3 missed) cut off: node 3 still holds v1, node 2 remembers its
    // delete; node 2 holds v3, which node 3 missed.
    f.isolate(1);
    f.rejoin(3);
    let id = |v: &str| u64::from_str_radix(v, 16).expect("a version id");
    assert_eq!(held_versions(&s, 3, "bkt", "k"), (vec![id(&v2), id(&v1)], vec![]), "node 3 missed both");
    let c2 = s.client_of(2);
    let ids = |out: &aws_sdk_s3::operation::list_object_versions::ListObjectVersionsOutput| -> Vec<String> {
        out.versions()
            .iter()
            .filter(|v| v.key() == Some("k"))
            .filter_map(|v| v.version_id().map(str::to_owned))
            .collect()
    };
    let listed = c2.list_object_versions().bucket("bkt").send().await?;
    assert_eq!(ids(&listed), [v3.clone(), v2.clone()], "v1 stays deleted, v3 is found");
    let e = c2.get_object().bucket("bkt").key("k").version_id(&v1).send().await.expect_err("v1 was deleted");
    assert_eq!(code(&e), "NoSuchVersion");
    let got = c2.get_object().bucket("bkt").key("k").version_id(&v3).send().await?;
    assert_eq!(got.body.collect().await?.into_bytes().as_ref(), b"three");
    // Deleting the latest (v3) for good makes v2 current, with v2's id.
    c2.delete_object().bucket("bkt").key("k").version_id(&v3).send().await?;
    let got = c2.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(got.version_id(), Some(v2.as_str()));
    assert_eq!(got.body.collect().await?.into_bytes().as_ref(), b"two");
    f.heal();
    eventually(30, "node 1 gets the current row back to v2", || {
        matches!(local_row(&s, 1, "bkt", "k"), Some(Row::Object(m)) if m.version_id().as_deref() == Some(v2.as_str()))
    })
    .await;
    for n in 1..=3 {
        let got = s.client_of(n).get_object().bucket("bkt").key("k").send().await?;
        assert_eq!(got.version_id(), Some(v2.as_str()), "through node {n}");
        let listed = s.client_of(n).list_object_versions().bucket("bkt").prefix("k").send().await?;
        assert_eq!(ids(&listed), [v2.clone()], "through node {n}");
    }
    // Versions and a marker a replica missed reach it (the resync queue of
    // the writes' coordinator, or the read repair of a version read).
    f.isolate(3);
    let r1 = c1.put_object().bucket("bkt").key("r").body(ByteStream::from(pseudo_random(300_000, 1))).send().await?;
    let r2 = c1.put_object().bucket("bkt").key("r").body(ByteStream::from_static(b"small")).send().await?;
    let marker = c1.delete_object().bucket("bkt").key("r").send().await?;
    assert_eq!(held_versions(&s, 3, "bkt", "r"), (vec![], vec![]));
    f.heal();
    let want: Vec<u64> =
        [marker.version_id(), r2.version_id(), r1.version_id()].iter().map(|v| id(v.expect("a version id"))).collect();
    eventually(30, "node 3 gets the versions it missed", || held_versions(&s, 3, "bkt", "r").0 == want).await;
    let got =
        s.client_of(3).get_object().bucket("bkt").key("r").version_id(r1.version_id().expect("id")).send().await?;
    assert_eq!(got.body.collect().await?.into_bytes().to_vec(), pseudo_random(300_000, 1));
    Ok(())
}

/// A layout change moves noncurrent versions too: after a node is added
/// and another removed, every version of a versioned bucket is held by
/// each of its key's new replicas and reads back by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_layout_change_moves_every_version_and_delete_marker() -> R {
    let _gate = crate::gate::shared();
    use aws_sdk_s3::types::{BucketVersioningStatus, VersioningConfiguration};
    let s = InCluster::new(4);
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    let enabled = VersioningConfiguration::builder().status(BucketVersioningStatus::Enabled).build();
    c.put_bucket_versioning().bucket("bkt").versioning_configuration(enabled).send().await?;
    // Per key: its version ids, newest first, and the body of each object version.
    let mut want: BTreeMap<String, Vec<(String, Option<Vec<u8>>)>> = BTreeMap::new();
    for i in 0..16u64 {
        let key = format!("k{i}");
        for j in 0..2u64 {
            let body = pseudo_random(if i % 5 == 0 { 200_000 } else { 700 }, i * 10 + j);
            let out = c.put_object().bucket("bkt").key(&key).body(ByteStream::from(body.clone())).send().await?;
            want.entry(key.clone()).or_default().insert(0, (out.version_id().expect("id").to_owned(), Some(body)));
        }
        if i % 4 == 0 {
            let out = c.delete_object().bucket("bkt").key(&key).send().await?;
            want.entry(key.clone()).or_default().insert(0, (out.version_id().expect("id").to_owned(), None));
        }
    }
    let id = |v: &str| u64::from_str_radix(v, 16).expect("a version id");
    let check = |s: &InCluster, c: aws_sdk_s3::Client, want: BTreeMap<String, Vec<(String, Option<Vec<u8>>)>>| {
        let placed: Vec<(String, Vec<NodeId>)> =
            want.keys().map(|k| (k.clone(), s.cluster.node(1).replicas("bkt", k.as_bytes()))).collect();
        let held: BTreeMap<(String, NodeId), Vec<u64>> = placed
            .iter()
            .flat_map(|(k, ids)| ids.iter().map(move |n| (k.clone(), *n)))
            .map(|(k, n)| {
                let h = held_versions(s, n, "bkt", &k).0;
                ((k, n), h)
            })
            .collect();
        async move {
            for (k, versions) in &want {
                let ids_want: Vec<u64> = versions.iter().map(|(v, _)| id(v)).collect();
                for ((key, n), h) in &held {
                    if key == k {
                        assert_eq!(h, &ids_want, "{k} on its replica {n}");
                    }
                }
                for (v, body) in versions {
                    let got = c.get_object().bucket("bkt").key(k).version_id(v).send().await;
                    match body {
                        Some(b) => assert_eq!(&got?.body.collect().await?.into_bytes().to_vec(), b, "{k} {v}"),
                        None => assert_eq!(status(&got.expect_err("a marker")), 405, "{k} {v}"),
                    }
                }
            }
            anyhow::Ok(())
        }
    };
    // Add node 5.
    let mut bigger = s.cluster.config.clone();
    let extra = lightningstor::cluster::ClusterConfig::init(5, s.dir.path(), 1, false)?.nodes[4].clone();
    bigger.nodes.push(extra);
    bigger.layout_version += 1;
    s.cluster.start_node("n5", &bigger)?;
    s.cluster.change_layout(&bigger);
    for id in s.cluster.ids() {
        s.cluster.coordinator(id).repair().rebalance_round().await?;
    }
    for id in s.cluster.ids() {
        s.cluster.node(id).finish_layout_change();
    }
    let on_5 = want.keys().filter(|k| !held_versions(&s, 5, "bkt", k).0.is_empty()).count();
    assert!(on_5 > 4, "node 5 took its share of versions ({on_5} keys)");
    check(&s, s.client(), want.clone()).await?;
    // Remove node 2.
    let mut smaller = bigger.clone();
    smaller.nodes.retain(|n| n.id != 2);
    smaller.layout_version += 1;
    s.cluster.change_layout(&smaller);
    for id in [1, 3, 4, 5, 2] {
        s.cluster.coordinator(id).repair().rebalance_round().await?;
    }
    for id in s.cluster.ids() {
        s.cluster.node(id).finish_layout_change();
    }
    s.cluster.stop_node(2);
    check(&s, s.client_of(1), want).await?;
    Ok(())
}
