//! The fixture of the replica and failover tests: three (or more)
//! `coronafs serve` nodes of one cluster in this process, over loopback,
//! in zones z1, z2, z3 (and on).

use crate::cluster::ClusterFile;
use crate::config::ServerConfig;
use crate::service::RunningServer;

/// Three started nodes `n1`..`n3` (write quorum 2), their cluster file,
/// their configs (to restart one) and their data dirs (kept while held).
pub(super) struct Three {
    pub file: ClusterFile,
    pub cfgs: Vec<ServerConfig>,
    pub servers: Vec<RunningServer>,
    pub dirs: Vec<tempfile::TempDir>,
}

/// Three nodes with automatic failover off (the tests that promote by hand).
pub(super) async fn start_three(ack_timeout_ms: u64) -> Three {
    start_three_timed(ack_timeout_ms, 1_000, 0).await
}

/// Three nodes whose primaries send a heartbeat every `heartbeat_ms` and
/// whose copies start a failover after `failover_after_ms` of silence (0: never).
pub(super) async fn start_three_timed(ack_timeout_ms: u64, heartbeat_ms: u64, failover_after_ms: u64) -> Three {
    start_three_with(ack_timeout_ms, heartbeat_ms, failover_after_ms, 200).await
}

/// The same with primaries retrying the resync of a copy out of the live
/// set every `resync_retry_ms`.
pub(super) async fn start_three_with(
    ack_timeout_ms: u64,
    heartbeat_ms: u64,
    failover_after_ms: u64,
    resync_retry_ms: u64,
) -> Three {
    start_nodes(3, ack_timeout_ms, heartbeat_ms, failover_after_ms, resync_retry_ms, |_| {}).await
}

/// `count` started nodes `n1`..`nN` (write quorum 2) of a cluster file
/// timed as [`start_three_with`], changed by `tune` before they start.
pub(super) async fn start_nodes(
    count: usize,
    ack_timeout_ms: u64,
    heartbeat_ms: u64,
    failover_after_ms: u64,
    resync_retry_ms: u64,
    tune: impl FnOnce(&mut ClusterFile),
) -> Three {
    let mut file = ClusterFile::on_loopback(count).expect("a loopback cluster");
    (file.ack_timeout_ms, file.heartbeat_ms, file.failover_after_ms) =
        (ack_timeout_ms, heartbeat_ms, failover_after_ms);
    file.resync_retry_ms = resync_retry_ms;
    // A short lease, so a promote by hand after the primary's loss waits
    // two seconds for it at most (automatic failover's own timeout
    // otherwise); shorter ones lapse on a loaded 2-core host when a Raft
    // election there takes a second or two.
    file.lease_ms = Some(if failover_after_ms == 0 { 2_000 } else { failover_after_ms });
    tune(&mut file);
    file.validate().expect("valid cluster file");
    let dirs: Vec<_> = (0..count).map(|_| tempfile::tempdir().expect("tempdir")).collect();
    let mut cfgs = Vec::new();
    let mut servers = Vec::new();
    for (i, n) in file.nodes.iter().enumerate() {
        let mut cfg = ServerConfig::ephemeral(dirs[i].path(), crate::backend::IoEngine::Threads);
        (cfg.nbd, cfg.api, cfg.cluster) = (n.nbd, n.api, Some((file.clone(), n.name.clone())));
        cfgs.push(cfg.clone());
        servers.push(crate::service::start(cfg).await.expect("start"));
    }
    Three { file, cfgs, servers, dirs }
}
