//! An in-process LightningStor cluster for tests, and the transports it
//! runs over: every node in this process ([`Hub`]), talking through the
//! in-process transport ([`InProcess`]) wrapped in shared [`Faults`]
//! ([`Faulty`]), so a test can partition, cut, delay, pause or drop traffic
//! between nodes.
//!
//! Test doubles live here, outside `lightningstor`, so they are never
//! compiled into its release binary; they use only its public traits
//! ([`Transport`], [`Handler`]) and constructors.

use lightningstor::cluster::NodeId;
use lightningstor::cluster::config::ClusterConfig;
use lightningstor::cluster::coord::Coordinator;
use lightningstor::cluster::node::Node;
use lightningstor::cluster::rpc::{Msg, Req, Resp};
use lightningstor::cluster::s3::ClusterS3;
use lightningstor::cluster::transport::{Handler, Transport};
use lightningstor::error::{LightningError, Result};
use lightningstor::store::Store;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

fn unreachable(to: NodeId, why: &str) -> LightningError {
    LightningError::Unavailable(format!("node {to} unreachable: {why}"))
}

/// Nodes of one process, by id.
#[derive(Default)]
pub struct Hub {
    nodes: RwLock<HashMap<NodeId, Weak<dyn Handler>>>,
}

impl Hub {
    /// An empty hub.
    pub fn new() -> Arc<Self> {
        Arc::new(Hub::default())
    }

    /// Registers node `id` (replacing an earlier registration).
    pub fn register(&self, id: NodeId, h: Weak<dyn Handler>) {
        if let Ok(mut n) = self.nodes.write() {
            n.insert(id, h);
        }
    }

    /// Removes node `id` (it looks down from then on).
    pub fn unregister(&self, id: NodeId) {
        if let Ok(mut n) = self.nodes.write() {
            n.remove(&id);
        }
    }
}

/// In-process transport: calls the other node's handler directly.
pub struct InProcess {
    hub: Arc<Hub>,
}

impl InProcess {
    /// A transport over `hub`.
    pub fn new(hub: Arc<Hub>) -> Self {
        InProcess { hub }
    }
}

#[async_trait::async_trait]
impl Transport for InProcess {
    async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        let h = self.hub.nodes.read().ok().and_then(|n| n.get(&to).and_then(Weak::upgrade));
        match h {
            Some(h) => Ok(h.handle(req).await),
            None => Err(unreachable(to, "not running")),
        }
    }
}

/// Faults applied to traffic, shared by every node of a test cluster.
#[derive(Debug, Default)]
pub struct Faults {
    /// Nodes cut off from every other node (both directions).
    isolated: Mutex<HashSet<NodeId>>,
    /// Directed links that drop everything.
    cut: Mutex<HashSet<(NodeId, NodeId)>>,
    /// Delay added to every message.
    delay_ms: std::sync::atomic::AtomicU64,
    /// Percentage of messages dropped at random.
    drop_percent: std::sync::atomic::AtomicU64,
    /// Paused nodes: messages to them wait until they resume.
    paused: Mutex<HashSet<NodeId>>,
    /// Nodes that answer the requests newer than [`Req::CompleteUpload`]
    /// as a node of a build without them does: [`Resp::Unsupported`].
    old_build: Mutex<HashSet<NodeId>>,
}

impl Faults {
    /// No faults.
    pub fn new() -> Arc<Self> {
        Arc::new(Faults::default())
    }

    /// Cuts `n` off from every other node.
    pub fn isolate(&self, n: NodeId) {
        if let Ok(mut s) = self.isolated.lock() {
            s.insert(n);
        }
    }

    /// Ends [`Faults::isolate`] of node `n` (cuts stay).
    pub fn rejoin(&self, n: NodeId) {
        if let Ok(mut s) = self.isolated.lock() {
            s.remove(&n);
        }
    }

    /// Drops the one-way link `from -> to`.
    pub fn cut(&self, from: NodeId, to: NodeId) {
        if let Ok(mut s) = self.cut.lock() {
            s.insert((from, to));
        }
    }

    /// Restores the one-way link `from -> to` (other cuts stay).
    pub fn uncut(&self, from: NodeId, to: NodeId) {
        if let Ok(mut s) = self.cut.lock() {
            s.remove(&(from, to));
        }
    }

    /// Removes every partition and cut.
    pub fn heal(&self) {
        if let Ok(mut s) = self.isolated.lock() {
            s.clear();
        }
        if let Ok(mut s) = self.cut.lock() {
            s.clear();
        }
    }

    /// Delays every message by `ms`.
    pub fn set_delay_ms(&self, ms: u64) {
        self.delay_ms.store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Pauses node `n` (as `docker pause` or SIGSTOP would): it takes
    /// messages but answers none until [`Faults::resume`].
    pub fn pause(&self, n: NodeId) {
        if let Ok(mut p) = self.paused.lock() {
            p.insert(n);
        }
    }

    /// Lets a paused node answer again (what waited goes on).
    pub fn resume(&self, n: NodeId) {
        if let Ok(mut p) = self.paused.lock() {
            p.remove(&n);
        }
    }

    fn is_paused(&self, n: NodeId) -> bool {
        self.paused.lock().map(|p| p.contains(&n)).unwrap_or(false)
    }

    /// Makes node `n` answer as a node of an older build, one that knows no
    /// [`Req::RowVersions`] or the bucket requests newer than it
    /// ([`Req::CreateBucketSince`], [`Req::DeleteBucketBefore`],
    /// [`Req::RecreateBucket`], [`Req::MergeLifecycles`]): its TCP listener answers a request it cannot
    /// decode with [`Resp::Unsupported`], and so does this transport.
    pub fn old_build(&self, n: NodeId) {
        if let Ok(mut s) = self.old_build.lock() {
            s.insert(n);
        }
    }

    fn unsupported(&self, to: NodeId, req: &Req) -> bool {
        matches!(
            req,
            Req::RowVersions { .. }
                | Req::CreateBucketSince { .. }
                | Req::DeleteBucketBefore { .. }
                | Req::RecreateBucket { .. }
                | Req::MergeLifecycles { .. }
        ) && self.old_build.lock().map(|s| s.contains(&to)).unwrap_or(false)
    }

    /// Drops `p` percent of messages.
    pub fn set_drop_percent(&self, p: u64) {
        self.drop_percent.store(p.min(100), std::sync::atomic::Ordering::Relaxed);
    }

    fn blocks(&self, from: NodeId, to: NodeId) -> bool {
        let iso = self.isolated.lock().map(|s| s.contains(&from) || s.contains(&to)).unwrap_or(false);
        let cut = self.cut.lock().map(|s| s.contains(&(from, to))).unwrap_or(false);
        iso || cut
    }
}

/// Wraps a transport with [`Faults`].
pub struct Faulty<T> {
    inner: T,
    me: NodeId,
    faults: Arc<Faults>,
}

impl<T> Faulty<T> {
    /// `inner` as seen from node `me` under `faults`.
    pub fn new(inner: T, me: NodeId, faults: Arc<Faults>) -> Self {
        Faulty { inner, me, faults }
    }
}

#[async_trait::async_trait]
impl<T: Transport> Transport for Faulty<T> {
    async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        use std::sync::atomic::Ordering::Relaxed;
        let delay = self.faults.delay_ms.load(Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if self.faults.blocks(self.me, to) {
            return Err(unreachable(to, "partitioned (test fault)"));
        }
        let p = self.faults.drop_percent.load(Relaxed);
        if p > 0 && u64::from(rand_byte()) * 100 / 256 < p {
            return Err(unreachable(to, "message dropped (test fault)"));
        }
        while self.faults.is_paused(to) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = if self.faults.unsupported(to, &req.head) {
            Ok(Msg::new(Resp::Unsupported(format!("node {to} (an older build, test fault) cannot decode the request"))))
        } else {
            self.inner.call(to, req).await
        };
        // A reply can be lost too: the request ran, the caller sees an error.
        if self.faults.blocks(to, self.me) {
            return Err(unreachable(to, "reply lost to a partition (test fault)"));
        }
        r
    }

    fn set_peers(&self, peers: HashMap<NodeId, SocketAddr>) {
        self.inner.set_peers(peers);
    }
}

fn rand_byte() -> u8 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() & 0xff) as u8
}

/// A started node, its coordinator and its background tasks.
type RunningNode = (Arc<Node>, Arc<Coordinator>, Vec<tokio::task::JoinHandle<()>>);

/// Nodes of one cluster in this process.
pub struct TestCluster {
    /// The cluster file the nodes run with.
    pub config: ClusterConfig,
    /// Traffic faults (shared by every node).
    pub faults: Arc<Faults>,
    hub: Arc<Hub>,
    nodes: Mutex<HashMap<NodeId, RunningNode>>,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster").finish_non_exhaustive()
    }
}

impl TestCluster {
    /// Starts a cluster of `n` nodes with data under `base`; `adjust` may
    /// change the generated cluster file first (keys, quorums, intervals).
    /// Must be called inside a tokio runtime.
    pub fn start(base: &Path, n: usize, adjust: impl FnOnce(&mut ClusterConfig)) -> Result<Self> {
        let mut config = ClusterConfig::init(n, base, 1, true)?;
        adjust(&mut config);
        config.validate()?;
        let c = TestCluster {
            config: config.clone(),
            faults: Faults::new(),
            hub: Hub::new(),
            nodes: Mutex::new(HashMap::new()),
        };
        for node in &config.nodes {
            c.start_node(&node.name, &config)?;
        }
        Ok(c)
    }

    /// Starts (or adds) node `name` of `config`.
    pub fn start_node(&self, name: &str, config: &ClusterConfig) -> Result<Arc<Node>> {
        let engine = config.node_config(name)?;
        let store = Store::open(engine)?;
        let id = config.node(name)?.id;
        let transport = Arc::new(Faulty::new(InProcess::new(self.hub.clone()), id, self.faults.clone()));
        let node = Node::new(config.clone(), name, store, transport)?;
        let weak: std::sync::Weak<dyn Handler> = {
            let h: Arc<dyn Handler> = node.clone();
            Arc::downgrade(&h)
        };
        self.hub.register(id, weak);
        let coord = Coordinator::new(node.clone());
        let tasks = coord.repair().spawn();
        if let Ok(mut n) = self.nodes.lock() {
            n.insert(id, (node.clone(), coord, tasks));
        }
        Ok(node)
    }

    /// Node `id`.
    pub fn node(&self, id: NodeId) -> Arc<Node> {
        match self.nodes.lock().ok().and_then(|n| n.get(&id).map(|(n, _, _)| n.clone())) {
            Some(n) => n,
            None => panic!("no node {id} in the test cluster"),
        }
    }

    /// The coordinator of node `id` (what its S3 service runs on).
    pub fn coordinator(&self, id: NodeId) -> Arc<Coordinator> {
        match self.nodes.lock().ok().and_then(|n| n.get(&id).map(|(_, c, _)| c.clone())) {
            Some(c) => c,
            None => panic!("no node {id} in the test cluster"),
        }
    }

    /// Every node id.
    pub fn ids(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self.nodes.lock().map(|n| n.keys().copied().collect()).unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// The S3 service of node `id` (plug it into aws-sdk-s3 with [`crate::sdk::InProcess`]).
    pub fn service(&self, id: NodeId) -> s3s::service::S3Service {
        let coord = self.coordinator(id);
        let cfg = coord.node.store.config.clone();
        lightningstor::server::service_for(ClusterS3::new(coord.clone()), &cfg, coord)
    }

    /// Stops node `id`'s background tasks and takes it off the network
    /// (its data stays; other nodes see it as down).
    pub fn stop_node(&self, id: NodeId) -> Option<Arc<Node>> {
        self.hub.unregister(id);
        let (node, _, tasks) = self.nodes.lock().ok()?.remove(&id)?;
        for t in tasks {
            t.abort();
        }
        Some(node)
    }

    /// Applies a new cluster file to every running node (layout change).
    pub fn change_layout(&self, config: &ClusterConfig) {
        for id in self.ids() {
            self.node(id).change_layout(config.clone());
        }
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        if let Ok(mut n) = self.nodes.lock() {
            for (_, (_, _, tasks)) in n.drain() {
                for t in tasks {
                    t.abort();
                }
            }
        }
    }
}
