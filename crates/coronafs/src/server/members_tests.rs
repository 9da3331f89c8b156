//! The volume map's own Raft group changing: four `coronafs serve` nodes in
//! this process over loopback (heartbeat 100 ms, lease 2 s). Three start
//! with a cluster file of three and found the group; the fourth starts
//! later with a file that lists it, finds the group held, founds nothing,
//! joins when added and leaves when removed; the removals that would cost
//! a volume its primary or its write quorum are refused.

use crate::cluster::ClusterFile;
use crate::config::ServerConfig;
use crate::dto::CreateVolume;
use crate::service::RunningServer;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

async fn start(file: &ClusterFile, i: usize, dir: &tempfile::TempDir) -> RunningServer {
    let n = &file.nodes[i];
    let mut cfg = ServerConfig::ephemeral(dir.path(), crate::backend::IoEngine::Threads);
    (cfg.nbd, cfg.api, cfg.cluster) = (n.nbd, n.api, Some((file.clone(), n.name.clone())));
    crate::service::start(cfg).await.expect("start")
}

/// Waits until `node`'s map has `voters` and lists every volume of `volumes`.
async fn sees(node: &RunningServer, voters: &BTreeSet<String>, volumes: &[&str]) {
    let map = node.volumes.volume_map().expect("a map member").clone();
    let start = Instant::now();
    loop {
        let (st, m) = (map.status(), map.map());
        if st.voters.iter().cloned().collect::<BTreeSet<_>>() == *voters && volumes.iter().all(|v| m.get(v).is_some()) {
            return;
        }
        assert!(start.elapsed() < LIMIT, "{}: voters {:?}, volumes {:?}", st.node, st.voters, m.volumes.keys());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_node_founds_no_group_of_its_own_joins_when_added_and_leaves_when_removed() {
    let mut four = ClusterFile::on_loopback(4).expect("a loopback cluster");
    (four.ack_timeout_ms, four.heartbeat_ms, four.failover_after_ms, four.lease_ms) = (3_000, 100, 0, Some(2_000));
    four.validate().expect("valid");
    let mut three = four.clone();
    three.nodes.truncate(3);
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().expect("tempdir")).collect();
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(start(&three, i, &dirs[i]).await);
    }
    let api = nodes[0].api_client();
    let vm = CreateVolume { name: "vm".into(), size: Some(4 << 20), from_snapshot: None, replicas: Some(3) };
    api.create_volume(&vm).await.expect("create vm");
    let pair = CreateVolume { name: "pair".into(), size: Some(4 << 20), from_snapshot: None, replicas: Some(2) };
    let other = api.create_volume(&pair).await.expect("create pair").replicas[0].clone();
    let founders = set(&["n1", "n2", "n3"]);
    sees(&nodes[2], &founders, &["vm", "pair"]).await;

    // n4's peers hold the map: it founds nothing and knows nothing.
    let n4 = start(&four, 3, &dirs[3]).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let alone = n4.volumes.volume_map().expect("a map member").clone();
    assert!(alone.status().voters.is_empty(), "n4 founded a group: {:?}", alone.status());
    assert!(alone.map().volumes.is_empty(), "n4 has a map of its own");
    assert_eq!(nodes[0].volumes.volume_map().expect("map").status().voters.len(), 3, "n4 joined by itself");

    // Added through a node that is not necessarily the leader: a voter,
    // with the whole map.
    let replica = four.nodes[3].replica.to_string();
    let m = nodes[1].api_client().add_node("n4", &replica).await.expect("add n4");
    assert_eq!(m.status.voters.iter().cloned().collect::<BTreeSet<_>>(), set(&["n1", "n2", "n3", "n4"]));
    let all = set(&["n1", "n2", "n3", "n4"]);
    sees(&n4, &all, &["vm", "pair"]).await;
    let again = nodes[2].api_client().add_node("n4", &replica).await.expect("adding a voter again changes nothing");
    assert_eq!(again.status.voters.len(), 4);

    // Refusals, each leaving the group as it was.
    let e = nodes[2].api_client().remove_node("n1").await.expect_err("the primary stays");
    assert!(e.to_string().contains("primary of volume"), "{e}");
    let e = nodes[2].api_client().remove_node(&other).await.expect_err("pair needs both of its copies");
    assert!(e.to_string().contains("fewer than its write quorum of 2"), "{e}");
    let e = nodes[2].api_client().remove_node("n9").await.expect_err("no such voter");
    assert!(e.to_string().contains("not a voter"), "{e}");
    let e = nodes[2].api_client().add_node("n9", "bad address").await.expect_err("no address");
    assert!(e.to_string().contains("host:port"), "{e}");
    sees(&nodes[0], &all, &[]).await;

    // Out again, and the three go on committing without it.
    let m = n4.api_client().remove_node("n4").await.expect("remove n4");
    assert_eq!(m.status.voters.iter().cloned().collect::<BTreeSet<_>>(), founders);
    n4.shutdown().await;
    let more = CreateVolume { name: "more".into(), size: Some(4 << 20), from_snapshot: None, replicas: Some(3) };
    api.create_volume(&more).await.expect("the map still commits");
    for n in &nodes {
        sees(n, &founders, &["vm", "pair", "more"]).await;
    }

    // A node that does not answer is not made a voter, and is not left a learner.
    let e = api.add_node("n5", "127.0.0.1:1").await.expect_err("nothing listens there");
    assert!(e.to_string().contains("did not take the map's log"), "{e}");
    let st = nodes[0].volumes.volume_map().expect("map").status();
    assert_eq!(st.voters.iter().cloned().collect::<BTreeSet<_>>(), founders, "{st:?}");
    for n in nodes {
        n.shutdown().await;
    }
}
