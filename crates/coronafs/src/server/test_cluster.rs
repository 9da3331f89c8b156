//! The fixture of the replica and failover tests: three `coronafs serve`
//! nodes of one cluster in this process, over loopback, in zones a, b, c.

use crate::cluster::{ClusterFile, ClusterNode};
use crate::config::ServerConfig;
use crate::replica::auth::RpcSecret;
use crate::service::RunningServer;
use std::net::SocketAddr;

/// A loopback address free right now.
pub(super) fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

/// Three started nodes `n1`..`n3` (write quorum 2), their cluster file,
/// their configs (to restart one) and their data dirs (kept while held).
pub(super) struct Three {
    pub file: ClusterFile,
    pub cfgs: Vec<ServerConfig>,
    pub servers: Vec<RunningServer>,
    pub dirs: Vec<tempfile::TempDir>,
}

pub(super) async fn start_three(ack_timeout_ms: u64) -> Three {
    let nodes: Vec<ClusterNode> = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, zone)| ClusterNode {
            name: format!("n{}", i + 1),
            nbd: free_addr(),
            api: free_addr(),
            replica: free_addr(),
            zone: zone.to_string(),
        })
        .collect();
    let secret = RpcSecret::random().expect("secret");
    let file = ClusterFile {
        rpc_secret: secret.to_hex(),
        write_quorum: 2,
        ack_timeout_ms,
        resync_bytes_per_sec: crate::backend::replicated::resync::DEFAULT_RATE,
        resync_retry_ms: 200,
        nodes,
    };
    file.validate().expect("valid cluster file");
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().expect("tempdir")).collect();
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
