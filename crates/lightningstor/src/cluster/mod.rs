//! Replication: a cluster of LightningStor nodes that keeps N copies of
//! every object and loses no acknowledged write when a node dies.
//!
//! The module list is the dependency stack, bottom up:
//!
//! - [`config`]: the cluster TOML file and `cluster init`;
//! - [`placement`]: partitions -> nodes, behind the [`placement::Replication`] trait;
//! - [`hlc`]: hybrid logical clock row versions;
//! - [`rpc`]: node-to-node messages and framing (sans-IO);
//! - [`transport`]: the [`transport::Transport`] trait, in-process and TCP;
//! - [`batch`]: the queues that batch a coordinator's version asks per replica;
//! - [`resync`]: the persistent queue of replicas to catch up;
//! - [`metrics`]: the replication counters every role counts into;
//! - [`replica`]: the replica role, applying what others send to the local store;
//! - [`node`]: a node: its layout, its calls, and the routing of requests to its roles;
//! - [`coord`]: the [`coord::Coordinator`] over a node (quorum writes and reads, read repair);
//! - [`buckets`], [`list`]: bucket rows and listings across the cluster;
//! - [`multipart`]: replicated multipart uploads;
//! - [`lifecycle`]: each node's share of the lifecycle task;
//! - [`locks`]: key leases that make conditional writes atomic;
//! - [`repair`]: the repair worker (resync, scrub, anti-entropy, tombstones, rebalance);
//! - [`s3`]: `impl S3` for a cluster node;
//! - [`admin`]: status and layout change for the CLI.
//!
//! The in-process test cluster and the faulty transport are test doubles
//! outside this crate: `testkit::lightningstor` (crates/testkit).

pub mod admin;
pub mod auth;
pub mod batch;
pub mod buckets;
pub mod config;
pub mod coord;
pub mod engine;
pub mod hlc;
pub mod lifecycle;
pub mod list;
pub mod locks;
pub mod metrics;
pub mod multipart;
pub mod node;
pub mod placement;
pub mod repair;
pub mod replica;
pub mod resync;
pub mod rpc;
pub mod s3;
pub mod transport;
pub mod versions;

pub use config::{ClusterConfig, Consistency};
pub use node::Node;

use crate::error::{LightningError, Result};
use crate::server::{MetricsFn, Running};
use crate::store::Store;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A node's id (from the cluster file).
pub type NodeId = u8;

/// Timeout of one node-to-node request over TCP.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// Prometheus text for a cluster node: the engine's counters plus replication's.
pub fn render_metrics(node: &Node) -> String {
    let mut out = crate::server::store_metrics(&node.store);
    let m = &node.metrics;
    let counters = [
        ("degraded_writes_total", "writes acknowledged without every replica", &m.degraded_writes),
        ("recommits_total", "writes committed again above a newer row a replica held", &m.recommits),
        ("repairs_total", "rows and blocks pushed to replicas that missed them", &m.repairs),
        ("read_repairs_total", "read repairs started", &m.read_repairs),
        ("resync_done_total", "resync queue entries completed", &m.resync_done),
        ("resync_failed_total", "resync attempts that failed and were rescheduled", &m.resync_failed),
        ("bad_copies_total", "corrupt or missing block copies found", &m.bad_copies_found),
        ("scrubbed_blocks_total", "blocks re-hashed by scrub", &m.scrubbed_blocks),
        ("divergent_partitions_total", "partitions anti-entropy found divergent", &m.divergent_partitions),
        ("hedged_reads_total", "reads that asked replicas beyond the read quorum", &m.hedged_reads),
        ("anti_entropy_rows_read_total", "rows anti-entropy read from the store", &m.anti_entropy_rows_read),
        ("anti_entropy_nodes_compared_total", "hash tree nodes anti-entropy compared", &m.anti_entropy_nodes_compared),
        ("quorum_failures_total", "requests refused for lack of a quorum", &m.quorum_failures),
        (
            "read_rows_fetched_total",
            "rows reads fetched in full from a replica (the local one included)",
            &m.read_rows_fetched,
        ),
        (
            "read_versions_asked_total",
            "row versions reads asked of replicas instead of the row",
            &m.read_versions_asked,
        ),
        ("version_batches_total", "messages that carried reads' version asks to a replica", &m.version_batches),
    ];
    let mut t = svc_kit::prom::Text::new();
    for (name, help, c) in counters {
        t.counter(&format!("lightningstor_{name}"), help, c.load(Ordering::Relaxed));
    }
    t.gauge("lightningstor_resync_queue", "entries waiting in the resync queue", node.resync.len());
    t.gauge("lightningstor_layout_version", "layout version this node runs", node.layout().version);
    out.push_str(&t.finish());
    out
}

/// A running cluster node serving S3 and node-to-node traffic over TCP.
pub struct RunningNode {
    /// The node.
    pub node: Arc<Node>,
    /// Its coordinator (the S3 server's engine).
    pub coord: Arc<coord::Coordinator>,
    /// The S3 server.
    pub s3: Running,
    /// The RPC server and background tasks.
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for RunningNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningNode").field("id", &self.node.id).finish_non_exhaustive()
    }
}

impl RunningNode {
    /// Stops serving.
    pub async fn shutdown(self) {
        for t in &self.tasks {
            t.abort();
        }
        self.s3.shutdown().await;
    }
}

/// Starts node `name` of `config`: opens its store, listens for S3 and RPC
/// on the addresses the file gives, and starts the background tasks.
pub async fn start(config: ClusterConfig, name: &str) -> Result<RunningNode> {
    config.validate()?;
    let me = config.node(name)?.clone();
    let engine = config.node_config(name)?;
    let s3_listener = tokio::net::TcpListener::bind(me.s3).await?;
    let rpc_listener = tokio::net::TcpListener::bind(me.rpc).await?;
    let store = tokio::task::spawn_blocking(move || Store::open(engine))
        .await
        .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
    let peers = config.nodes.iter().map(|n| (n.id, n.rpc)).collect();
    let secret = config.rpc_secret()?;
    let transport = Arc::new(transport::Tcp::new(peers, RPC_TIMEOUT, secret.clone()));
    let node = Node::new(config, name, store.clone(), transport)?;
    let mut tasks = vec![transport::serve_tcp(rpc_listener, node.clone(), secret)];
    let coord = coord::Coordinator::new(node.clone());
    tasks.extend(coord.repair().spawn());
    let svc = crate::server::service_for(s3::ClusterS3::new(coord.clone()), &store.config, coord.clone());
    let gate = Arc::new(crate::server::Gate::new(coord.clone(), &store.config));
    let n = node.clone();
    let metrics: MetricsFn = Arc::new(move || render_metrics(&n));
    let s3 = crate::server::serve_with(s3_listener, svc, metrics, Some(gate))?;
    Ok(RunningNode { node, coord, s3, tasks })
}

/// A cluster whose nodes all run in this process, each serving S3 and RPC
/// over real TCP on 127.0.0.1 (benches, examples, embedded labs).
#[derive(Debug)]
pub struct LocalCluster {
    /// The cluster file the nodes run with.
    pub config: ClusterConfig,
    /// The running nodes, in the order of the file.
    pub nodes: Vec<RunningNode>,
}

impl LocalCluster {
    /// The S3 address of every node.
    pub fn s3_addrs(&self) -> Vec<std::net::SocketAddr> {
        self.nodes.iter().map(|n| n.s3.addr).collect()
    }

    /// Stops every node.
    pub async fn shutdown(self) {
        for n in self.nodes {
            n.shutdown().await;
        }
    }
}

/// Starts `n` nodes in this process with data under `dir` (one directory per
/// node), on free loopback ports. The file is [`ClusterConfig::init`]'s
/// with `anonymous` (RF = min(3, n)); `adjust` may change it (keys,
/// quorums, intervals) before the nodes start.
pub async fn start_local(
    n: usize,
    dir: &std::path::Path,
    adjust: impl FnOnce(&mut ClusterConfig),
) -> Result<LocalCluster> {
    let mut config = ClusterConfig::init(n, dir, 1, true)?;
    // Hold every probe listener until all ports are chosen, so none repeats.
    let mut probes = Vec::new();
    let mut free_port = || -> Result<u16> {
        let l = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        let port = l.local_addr()?.port();
        probes.push(l);
        Ok(port)
    };
    for node in &mut config.nodes {
        node.s3.set_port(free_port()?);
        node.rpc.set_port(free_port()?);
    }
    drop(probes);
    adjust(&mut config);
    config.validate()?;
    let mut nodes = Vec::with_capacity(n);
    for node in &config.nodes {
        nodes.push(start(config.clone(), &node.name).await?);
    }
    Ok(LocalCluster { config, nodes })
}
