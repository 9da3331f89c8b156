//! A cluster node: its local engine, its view of the layout, its calls to
//! other nodes, and the routing of their requests. The replica
//! ([`super::replica`]) serves what other nodes store here and is a field
//! of the node; the coordinator ([`super::coord::Coordinator`]) and the
//! repair worker ([`super::repair::Repair`]) are types of their own over
//! the node's public methods, made by whoever serves S3 and runs the
//! background tasks ([`super::start`]). This file answers the layout,
//! key-lease and status requests and hands the rest to the replica.

use super::NodeId;
use super::config::{ClusterConfig, Consistency};
use super::hlc::Hlc;
use super::metrics::ClusterMetrics;
use super::placement::{Layout, Replication, partition_of};
use super::replica::Replica;
use super::resync::Resync;
use super::rpc::{Msg, NodeStatus, Req, Resp};
use super::transport::{Handler, Transport};
use crate::error::{LightningError, Result};
use crate::store::Store;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

/// One node of a cluster.
pub struct Node {
    /// This node's id.
    pub id: NodeId,
    /// The local engine (this node's replicas).
    pub store: Arc<Store>,
    /// The node-to-node transport.
    pub transport: Arc<dyn Transport>,
    /// The row-version clock (shared with the replica).
    pub hlc: Arc<Hlc>,
    /// Replicas missed during outages, to push later.
    pub resync: Resync,
    /// Replication counters (shared with the replica).
    pub metrics: Arc<ClusterMetrics>,
    /// The replica side: what this node stores for the cluster.
    pub replica: Replica,
    config: RwLock<Arc<ClusterConfig>>,
    layout: RwLock<Arc<Layout>>,
    /// Layout before the last change, while data moves (reads ask both).
    previous: RwLock<Option<Arc<Layout>>>,
    /// Short leases on keys held by conditional writes (see [`super::locks`]).
    pub(crate) locks: super::locks::KeyLocks,
    /// This node, for requests that need an owning handle (rebalance).
    pub(super) me: std::sync::Weak<Node>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Node {
    /// Opens node `name` of `config` over an open store and a transport.
    pub fn new(
        config: ClusterConfig,
        name: &str,
        store: Arc<Store>,
        transport: Arc<dyn Transport>,
    ) -> Result<Arc<Self>> {
        let me = config.node(name)?;
        let id = me.id;
        let resync = Resync::open(&me.data_dir.join("resync.redb"))?;
        let layout = Arc::new(Layout::compute(&config));
        let hlc = Arc::new(Hlc::new(id));
        let metrics = Arc::new(ClusterMetrics::default());
        let replica = Replica::new(store.clone(), hlc.clone(), metrics.clone());
        Ok(Arc::new_cyclic(|me| Node {
            me: me.clone(),
            id,
            store,
            transport,
            hlc,
            resync,
            metrics,
            replica,
            config: RwLock::new(Arc::new(config)),
            layout: RwLock::new(layout),
            previous: RwLock::new(None),
            locks: super::locks::KeyLocks::default(),
        }))
    }

    /// The cluster file this node runs with.
    pub fn config(&self) -> Arc<ClusterConfig> {
        self.config.read().map(|c| c.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The current layout.
    pub fn layout(&self) -> Arc<Layout> {
        self.layout.read().map(|c| c.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The layout being moved away from, if a change is in progress.
    pub fn previous_layout(&self) -> Option<Arc<Layout>> {
        self.previous.read().ok().and_then(|p| p.clone())
    }

    /// Switches to a new cluster file (layout change). The old layout stays
    /// readable until [`Node::finish_layout_change`].
    pub fn change_layout(&self, config: ClusterConfig) {
        let old = self.config();
        self.install(&old, self.layout(), config);
    }

    /// Switches from cluster file `old` to `new`, as told by `cluster layout
    /// apply`. Idempotent: a node already running `new` (a node added by
    /// this change, or a repeated apply) keeps or takes `old` as previous.
    pub fn change_layout_from(&self, old: &ClusterConfig, new: ClusterConfig) -> Result<()> {
        let cur = self.layout().version;
        if new.layout_version < cur {
            return Err(LightningError::Config(format!(
                "layout version {} is older than the {cur} this node runs",
                new.layout_version
            )));
        }
        if old.partitions != new.partitions || old.replication_factor != new.replication_factor {
            return Err(LightningError::Config(
                "partitions and replication_factor cannot change in a layout change".into(),
            ));
        }
        if new.layout_version == cur && self.previous_layout().is_some() {
            return Ok(()); // already moving to it
        }
        self.install(old, Arc::new(Layout::compute(old)), new);
        Ok(())
    }

    fn install(&self, old: &ClusterConfig, old_layout: Arc<Layout>, config: ClusterConfig) {
        let new = Arc::new(Layout::compute(&config));
        // Nodes leaving stay reachable while their data moves.
        let mut peers: HashMap<NodeId, std::net::SocketAddr> = old.nodes.iter().map(|n| (n.id, n.rpc)).collect();
        peers.extend(config.nodes.iter().map(|n| (n.id, n.rpc)));
        self.transport.set_peers(peers);
        if let Ok(mut p) = self.previous.write() {
            *p = (old_layout.version != new.version).then_some(old_layout);
        }
        if let Ok(mut l) = self.layout.write() {
            *l = new;
        }
        if let Ok(mut c) = self.config.write() {
            *c = Arc::new(config);
        }
    }

    /// Forgets the previous layout once data has moved.
    pub fn finish_layout_change(&self) {
        if let Ok(mut p) = self.previous.write() {
            *p = None;
        }
    }

    /// The consistency mode.
    pub fn consistency(&self) -> Consistency {
        self.config().consistency
    }

    /// The partition of a key.
    pub fn partition(&self, bucket: &str, key: &[u8]) -> u32 {
        partition_of(self.layout().partitions(), bucket, key)
    }

    /// The replicas of a key under the current layout.
    pub fn replicas(&self, bucket: &str, key: &[u8]) -> Vec<NodeId> {
        let l = self.layout();
        l.nodes_for(partition_of(l.partitions(), bucket, key)).to_vec()
    }

    /// The replica sets a write to this key must reach a quorum in: the
    /// current one, and during a layout change the previous one too.
    pub fn write_sets(&self, bucket: &str, key: &[u8]) -> Vec<Vec<NodeId>> {
        let l = self.layout();
        let p = partition_of(l.partitions(), bucket, key);
        let mut sets = vec![l.nodes_for(p).to_vec()];
        if let Some(old) = self.previous_layout() {
            let o = old.nodes_for(p).to_vec();
            if o != sets[0] {
                sets.push(o);
            }
        }
        sets
    }

    /// Every node id in the current layout.
    pub fn all_nodes(&self) -> Vec<NodeId> {
        self.config().nodes.iter().map(|n| n.id).collect()
    }

    /// Sends a request to `to` (handled here when `to` is this node).
    pub async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        let r = if to == self.id {
            Ok(self.serve(req, true).await.unwrap_or_else(|e| Msg::new(Resp::Err((&e).into()))))
        } else {
            self.transport.call(to, req).await
        };
        r?.ok()
    }

    /// Answers a request from another node (the transport's handler).
    pub async fn handle_local(&self, req: Msg<Req>) -> Msg<Resp> {
        if let Req::Rebalance = req.head {
            return match self.rebalance().await {
                Ok(n) => Msg::new(Resp::Count(n as u64)),
                Err(e) => Msg::new(Resp::Err((&e).into())),
            };
        }
        match self.serve(req, false).await {
            Ok(m) => m,
            Err(e) => Msg::new(Resp::Err((&e).into())),
        }
    }

    /// Serves the requests of the node's own roles (status, key leases,
    /// layout) and hands the rest to the replica. `trusted`: the request
    /// comes from this node itself, whose block bytes were hashed by the
    /// coordinator a moment ago (no re-hash).
    async fn serve(&self, req: Msg<Req>, trusted: bool) -> Result<Msg<Resp>> {
        let Msg { head, data } = req;
        Ok(match head {
            Req::Status => Msg::new(Resp::Status(self.status().await?)),
            Req::LockKey { bucket, key, token, ttl_ms } => {
                Msg::new(Resp::Flag(self.locks.try_lock(bucket, key, token, ttl_ms)))
            }
            Req::UnlockKey { bucket, key, token } => {
                self.locks.unlock(bucket, key, token);
                Msg::new(Resp::Ok)
            }
            Req::GetConfig => Msg::new(Resp::Config(self.config().to_toml())),
            Req::ChangeLayout { old, new } => {
                let (old, new) = (ClusterConfig::from_toml(&old)?, ClusterConfig::from_toml(&new)?);
                self.change_layout_from(&old, new)?;
                Msg::new(Resp::Ok)
            }
            // Answered in `handle_local` (rebalancing calls back into `serve`).
            Req::Rebalance => return Err(LightningError::InvalidRequest("rebalance is a remote request".into())),
            Req::FinishLayout => {
                self.finish_layout_change();
                Msg::new(Resp::Ok)
            }
            head => return self.replica.serve(Msg { head, data }, trusted).await,
        })
    }

    async fn rebalance(&self) -> Result<usize> {
        let me = self.me.upgrade().ok_or_else(|| LightningError::Unavailable("node is shutting down".into()))?;
        // A coordinator of its own: rebalancing pushes rows, it needs
        // none of the serving coordinator's budget or read batches.
        super::coord::Coordinator::new(me).repair().rebalance_round().await
    }

    /// Node health and conditions for `cluster status`.
    pub async fn status(&self) -> Result<NodeStatus> {
        let (blocks, objects, data_dir_fs, host) = self
            .replica
            .blocking(|s| {
                let (blocks, objects) = s.meta.counts()?;
                Ok((blocks, objects, hostinfo::fs_of(&s.config.data_dir), hostinfo::host()))
            })
            .await?;
        let direct = self.store.blocks.direct_io();
        Ok(NodeStatus {
            layout_version: self.layout().version,
            resync_queue: self.resync.len(),
            objects,
            blocks,
            repairs: self.metrics.repairs.load(Ordering::Relaxed),
            corrupt_blocks: self.metrics.bad_copies_found.load(Ordering::Relaxed),
            previous_layout: self.previous_layout().map(|l| l.version),
            data_dir_fs,
            o_direct: direct.o_direct,
            o_direct_fell_back: direct.o_direct_fell_back,
            host,
        })
    }
}

#[async_trait::async_trait]
impl Handler for Node {
    async fn handle(&self, req: Msg<Req>) -> Msg<Resp> {
        self.handle_local(req).await
    }
}
