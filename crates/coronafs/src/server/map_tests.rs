//! The volume map through `coronafs serve`: three nodes in one process
//! over loopback run one Raft group on their replica listeners; a
//! replicated volume is in every node's map from its creation until its
//! deletion, and the map survives a restart of every node.

use super::test_cluster::start_three;
use crate::dto::{ClusterMap, CreateVolume};
use crate::error::CoronaError;
use std::time::{Duration, Instant};

/// Polls node `i`'s `/v1/cluster/map` until `ok` holds (at most 20 s).
async fn map_until(
    t: &super::test_cluster::Three,
    i: usize,
    what: &str,
    ok: impl Fn(&ClusterMap) -> bool,
) -> ClusterMap {
    let start = Instant::now();
    loop {
        let m = t.servers[i].api_client().cluster_map().await.expect("GET /v1/cluster/map");
        if ok(&m) {
            return m;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "node {i}: {what}: not within 20 s: {m:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_volume_is_in_every_nodes_map_from_creation_to_deletion_and_across_restarts() {
    let mut t = start_three(5_000).await;
    let body = CreateVolume { name: "vm".into(), size: Some(4 << 20), from_snapshot: None, replicas: Some(3) };
    t.servers[0].api_client().create_volume(&body).await.expect("create with 3 copies");
    for i in 0..3 {
        let m = map_until(&t, i, "vm in the map", |m| m.volumes.contains_key("vm")).await;
        let vm = &m.volumes["vm"];
        assert_eq!(vm.primary, "n1");
        assert_eq!((vm.epoch, vm.quorum, vm.in_sync.len()), (0, 2, 3));
        let mut copies = vm.copies.clone();
        copies.sort();
        assert_eq!(copies, ["n1", "n2", "n3"]);
        assert_eq!(m.status.voters.len(), 3);
    }
    // A plain volume is not replicated: not in the map.
    t.servers[1].api_client().create("plain", 1 << 20).await.expect("create plain");
    // Every node stopped and started again on its data dir.
    let servers: Vec<_> = t.servers.drain(..).collect();
    for s in servers {
        s.shutdown().await;
    }
    for cfg in &t.cfgs {
        t.servers.push(crate::service::start(cfg.clone()).await.expect("restart"));
    }
    for i in 0..3 {
        let m = map_until(&t, i, "a leader and vm after the restart", |m| {
            m.status.leader.is_some() && m.volumes.contains_key("vm")
        })
        .await;
        assert!(!m.volumes.contains_key("plain"));
    }
    t.servers[0].api_client().delete("vm", true).await.expect("delete");
    for i in 0..3 {
        map_until(&t, i, "vm gone from the map", |m| !m.volumes.contains_key("vm")).await;
    }
    for s in t.servers.drain(..) {
        s.shutdown().await;
    }
}

#[tokio::test]
async fn a_server_in_no_cluster_answers_404_for_the_map() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = crate::config::ServerConfig::ephemeral(dir.path(), crate::backend::IoEngine::Threads);
    let s = crate::service::start(cfg).await.expect("start");
    match s.api_client().cluster_map().await {
        Err(CoronaError::Api { status: Some(404), message, .. }) => {
            assert!(message.contains("no cluster"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    s.shutdown().await;
}
