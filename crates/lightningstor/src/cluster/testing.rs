//! An in-process cluster for tests: every node in this process, talking
//! through the in-process transport wrapped in shared [`Faults`], so a test
//! can partition, cut, delay or drop traffic between nodes.

use super::NodeId;
use super::config::ClusterConfig;
use super::node::Node;
use super::s3::ClusterS3;
use super::transport::{Faults, Faulty, Handler, Hub, InProcess};
use crate::error::Result;
use crate::store::Store;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Nodes of one cluster in this process.
pub struct TestCluster {
    /// The cluster file the nodes run with.
    pub config: ClusterConfig,
    /// Traffic faults (shared by every node).
    pub faults: Arc<Faults>,
    hub: Arc<Hub>,
    nodes: Mutex<HashMap<NodeId, (Arc<Node>, Vec<tokio::task::JoinHandle<()>>)>>,
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
        let mut config = ClusterConfig::init(n, base, 1)?;
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
        let tasks = node.spawn_background();
        if let Ok(mut n) = self.nodes.lock() {
            n.insert(id, (node.clone(), tasks));
        }
        Ok(node)
    }

    /// Node `id`.
    pub fn node(&self, id: NodeId) -> Arc<Node> {
        match self.nodes.lock().ok().and_then(|n| n.get(&id).map(|(n, _)| n.clone())) {
            Some(n) => n,
            None => panic!("no node {id} in the test cluster"),
        }
    }

    /// Every node id.
    pub fn ids(&self) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self.nodes.lock().map(|n| n.keys().copied().collect()).unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// The S3 service of node `id` (plug it into aws-sdk-s3 with s3s-aws).
    pub fn service(&self, id: NodeId) -> s3s::service::S3Service {
        let node = self.node(id);
        let cfg = node.store.config.clone();
        crate::server::service_for(ClusterS3::new(node), &cfg)
    }

    /// Stops node `id`'s background tasks and takes it off the network
    /// (its data stays; other nodes see it as down).
    pub fn stop_node(&self, id: NodeId) -> Option<Arc<Node>> {
        self.hub.unregister(id);
        let (node, tasks) = self.nodes.lock().ok()?.remove(&id)?;
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
            for (_, (_, tasks)) in n.drain() {
                for t in tasks {
                    t.abort();
                }
            }
        }
    }
}
