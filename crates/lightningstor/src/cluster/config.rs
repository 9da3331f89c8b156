//! The cluster description: one TOML file shared by every node.
//!
//! It names the replication factor, the consistency mode, the layout version
//! and every node (id, name, S3 and node-to-node addresses, data directory,
//! zone, capacity). `lightningstor serve --config FILE --node NAME` runs the
//! node called NAME; [`ClusterConfig::init`] writes a working file for a
//! loopback cluster.

use crate::config::Config;
use crate::error::{LightningError, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// What reads and writes wait for (see docs/lightningstor.md, "Consistency").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Consistency {
    /// Writes wait for the write quorum, reads for the read quorum (R + W > N):
    /// every read sees every acknowledged write.
    #[default]
    Consistent,
    /// Writes and reads succeed with one replica: the cluster stays available
    /// with a single live replica, reads may be stale until repair converges.
    Degraded,
}

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Stable numeric id (1..=255), unique; breaks ties between row versions.
    pub id: u8,
    /// Unique name, as given to `--node`.
    pub name: String,
    /// S3 listen address.
    pub s3: SocketAddr,
    /// Node-to-node listen address.
    pub rpc: SocketAddr,
    /// Data directory (metadata, blocks, resync queue).
    pub data_dir: PathBuf,
    /// Failure domain; replicas of a partition go to distinct zones first.
    #[serde(default = "default_zone")]
    pub zone: String,
    /// Relative capacity; a node with twice the capacity gets about twice the partitions.
    #[serde(default = "default_capacity")]
    pub capacity: u32,
}

fn default_zone() -> String {
    "default".to_owned()
}

fn default_capacity() -> u32 {
    1
}

fn default_rf() -> usize {
    3
}

fn default_partitions() -> u32 {
    256
}

fn default_region() -> String {
    "us-east-1".to_owned()
}

fn default_true() -> bool {
    true
}

fn default_tombstone_secs() -> u64 {
    24 * 3600
}

fn default_anti_entropy() -> u64 {
    60
}

fn default_scrub_rate() -> u32 {
    50
}

/// The whole cluster file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Copies of every object (N).
    #[serde(default = "default_rf")]
    pub replication_factor: usize,
    /// Write quorum W (default: a majority of N).
    #[serde(default)]
    pub write_quorum: Option<usize>,
    /// Read quorum R (default: N - W + 1, so R + W > N).
    #[serde(default)]
    pub read_quorum: Option<usize>,
    /// Consistency mode.
    #[serde(default)]
    pub consistency: Consistency,
    /// Layout version; bump it whenever the node list changes.
    pub layout_version: u64,
    /// Number of partitions keys hash into (fixed for the life of the cluster).
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// The admin key's access key id (the same on every node): full access,
    /// and the key admin requests (`lightningstor key ...`) are signed with.
    #[serde(default)]
    pub access_key: Option<String>,
    /// The admin key's secret.
    #[serde(default)]
    pub secret_key: Option<String>,
    /// Accept unsigned requests (and requests signed with unknown keys):
    /// everyone may do everything.
    #[serde(default)]
    pub anonymous: bool,
    /// The secret every node proves it holds before node-to-node RPC (64 hex
    /// digits, the same on every node; `cluster init` writes a random one).
    /// Required: without it a node refuses to start.
    #[serde(default)]
    pub rpc_secret: Option<String>,
    /// Region reported to clients.
    #[serde(default = "default_region")]
    pub region: String,
    /// fsync before acknowledging (never false in production).
    #[serde(default = "default_true")]
    pub fsync: bool,
    /// Seconds a delete's tombstone is kept before it is collected.
    #[serde(default = "default_tombstone_secs")]
    pub tombstone_secs: u64,
    /// Blocks scrub re-hashes per second on each node when it is idle, a
    /// tenth of that while it serves traffic (0 turns scrub off).
    #[serde(default = "default_scrub_rate")]
    pub scrub_blocks_per_sec: u32,
    /// Seconds between anti-entropy passes on each node (0 turns it off).
    #[serde(default = "default_anti_entropy")]
    pub anti_entropy_secs: u64,
    /// Length in seconds of a lifecycle "day" (86400; smaller only in tests).
    #[serde(default = "default_lifecycle_day")]
    pub lifecycle_day_secs: u64,
    /// Seconds between rounds of the lifecycle task on each node.
    #[serde(default = "default_lifecycle_interval")]
    pub lifecycle_interval_secs: u64,
    /// Milliseconds a conditional write's key lease lasts unless renewed
    /// (its holder renews it every third of that while it works); at least 100.
    #[serde(default = "default_key_lease_ms")]
    pub key_lease_ms: u64,
    /// The nodes.
    pub nodes: Vec<NodeConfig>,
}

fn default_lifecycle_day() -> u64 {
    crate::config::DEFAULT_LIFECYCLE_DAY_SECS
}

/// How long a conditional write's key lease lasts unless released or renewed.
pub const DEFAULT_KEY_LEASE_MS: u64 = 10_000;

fn default_key_lease_ms() -> u64 {
    DEFAULT_KEY_LEASE_MS
}

fn default_lifecycle_interval() -> u64 {
    crate::config::DEFAULT_LIFECYCLE_INTERVAL_SECS
}

impl ClusterConfig {
    /// Parses a cluster file (unknown fields are an error) and validates it.
    pub fn from_toml(text: &str) -> Result<Self> {
        let c: ClusterConfig = svc_kit::config::parse(text)?;
        c.validate()?;
        Ok(c)
    }

    /// Reads and validates a cluster file; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(svc_kit::config::load_validated(path, ClusterConfig::validate)?)
    }

    /// The file's text.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// W.
    pub fn w(&self) -> usize {
        self.write_quorum.unwrap_or(self.replication_factor / 2 + 1)
    }

    /// R.
    pub fn r(&self) -> usize {
        self.read_quorum.unwrap_or(self.replication_factor + 1 - self.w())
    }

    /// Checks the rules every cluster file must follow.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(LightningError::Config(m));
        if self.nodes.is_empty() {
            return bad("a cluster needs at least one node".into());
        }
        if self.replication_factor == 0 || self.replication_factor > self.nodes.len() {
            return bad(format!(
                "replication_factor {} must be between 1 and the number of nodes ({})",
                self.replication_factor,
                self.nodes.len()
            ));
        }
        let (w, r) = (self.w(), self.r());
        if w == 0 || w > self.replication_factor || r == 0 || r > self.replication_factor {
            return bad(format!("quorums R={r} W={w} must be between 1 and N={}", self.replication_factor));
        }
        if r + w <= self.replication_factor {
            return bad(format!("R + W must exceed N (R={r} W={w} N={})", self.replication_factor));
        }
        if !(100..=u64::from(u32::MAX)).contains(&self.key_lease_ms) {
            return bad(format!("key_lease_ms {} must be between 100 and {}", self.key_lease_ms, u32::MAX));
        }
        if self.partitions == 0 || self.partitions > 65_536 {
            return bad("partitions must be between 1 and 65536".into());
        }
        let (mut ids, mut names, mut addrs) = (HashSet::new(), HashSet::new(), HashSet::new());
        for n in &self.nodes {
            if n.id == 0 || !ids.insert(n.id) {
                return bad(format!("node ids must be unique and non-zero ({} repeats or is 0)", n.id));
            }
            if n.name.is_empty() || !names.insert(n.name.clone()) {
                return bad(format!("node names must be unique and non-empty ({:?})", n.name));
            }
            if !addrs.insert(n.s3) || !addrs.insert(n.rpc) {
                return bad(format!("node {} reuses an address", n.name));
            }
            if n.capacity == 0 {
                return bad(format!("node {} has capacity 0", n.name));
            }
        }
        self.rpc_secret()?;
        self.node_config(&self.nodes[0].name)?.validate()
    }

    /// The cluster's RPC secret.
    pub fn rpc_secret(&self) -> Result<crate::cluster::auth::RpcSecret> {
        match &self.rpc_secret {
            Some(hex) => Ok(crate::cluster::auth::RpcSecret::parse(hex)?),
            None => Err(LightningError::Config(
                "the cluster file has no rpc_secret: nodes accept RPC only from holders of it; add \
                 rpc_secret = \"<64 hex digits>\" (e.g. from `openssl rand -hex 32`) to every node's file, \
                 or let `lightningstor cluster init` write one"
                    .into(),
            )),
        }
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Result<&NodeConfig> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| LightningError::Config(format!("no node named {name:?} in the cluster file")))
    }

    /// The single-node engine configuration node `name` runs with.
    pub fn node_config(&self, name: &str) -> Result<Config> {
        let n = self.node(name)?;
        Ok(Config {
            data_dir: n.data_dir.clone(),
            listen: n.s3,
            access_key: self.access_key.clone(),
            secret_key: self.secret_key.clone(),
            anonymous: self.anonymous,
            region: self.region.clone(),
            fsync: self.fsync,
            tree_partitions: Some(self.partitions),
            lifecycle_day_secs: self.lifecycle_day_secs,
            lifecycle_interval_secs: self.lifecycle_interval_secs,
            ..Config::default()
        })
    }

    /// A cluster of `n` nodes on 127.0.0.1: node `i` (1-based) serves S3 on
    /// `base_port + i - 1` and RPC on `base_port + 100 + i - 1`, keeps its
    /// data in `base_dir/nI`, and sits in zone `zI` (one zone per node).
    /// The admin key and the RPC secret are random; unsigned requests are
    /// accepted only with `anonymous`.
    pub fn init(n: usize, base_dir: &Path, base_port: u16, anonymous: bool) -> Result<Self> {
        if n == 0 || n > 100 {
            return Err(LightningError::Config("--nodes must be between 1 and 100".into()));
        }
        let nodes = (1..=n)
            .map(|i| {
                let off = u16::try_from(i - 1).unwrap_or(0);
                NodeConfig {
                    id: u8::try_from(i).unwrap_or(u8::MAX),
                    name: format!("n{i}"),
                    s3: SocketAddr::from(([127, 0, 0, 1], base_port.saturating_add(off))),
                    rpc: SocketAddr::from(([127, 0, 0, 1], base_port.saturating_add(100).saturating_add(off))),
                    data_dir: base_dir.join(format!("n{i}")),
                    zone: format!("z{i}"),
                    capacity: 1,
                }
            })
            .collect();
        let c = ClusterConfig {
            replication_factor: n.min(3),
            write_quorum: None,
            read_quorum: None,
            consistency: Consistency::Consistent,
            layout_version: 1,
            partitions: default_partitions(),
            access_key: Some(crate::keys::new_key_id()?),
            secret_key: Some(crate::keys::new_secret()?),
            anonymous,
            rpc_secret: Some(crate::cluster::auth::RpcSecret::random()?.to_hex()),
            region: default_region(),
            fsync: true,
            tombstone_secs: default_tombstone_secs(),
            scrub_blocks_per_sec: default_scrub_rate(),
            anti_entropy_secs: default_anti_entropy(),
            lifecycle_day_secs: default_lifecycle_day(),
            lifecycle_interval_secs: default_lifecycle_interval(),
            key_lease_ms: default_key_lease_ms(),
            nodes,
        };
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_writes_a_file_that_parses_back_to_the_same_cluster() {
        let c = ClusterConfig::init(3, Path::new("/tmp/ls"), 9000, false).expect("init");
        let back = ClusterConfig::from_toml(&c.to_toml()).expect("parse");
        assert_eq!(back, c);
        assert_eq!((c.w(), c.r()), (2, 2));
        assert_eq!(c.node("n2").expect("n2").s3.port(), 9001);
        assert_eq!(c.node("n3").expect("n3").rpc.port(), 9102);
        let again = ClusterConfig::init(3, Path::new("/tmp/ls"), 9000, false).expect("init");
        assert!(c.access_key.is_some() && c.secret_key.is_some() && !c.anonymous);
        assert_ne!((&c.access_key, &c.secret_key), (&again.access_key, &again.secret_key), "keys are random");
        assert!(ClusterConfig::init(1, Path::new("/tmp/ls"), 9000, true).expect("init").anonymous);
    }

    #[test]
    fn unknown_fields_bad_quorums_and_duplicates_are_refused() {
        let c = ClusterConfig::init(3, Path::new("/tmp/ls"), 9000, false).expect("init");
        let text = c.to_toml();
        assert!(ClusterConfig::from_toml(&format!("bogus = 1\n{text}")).is_err());
        let mut bad = c.clone();
        bad.write_quorum = Some(1);
        bad.read_quorum = Some(1);
        assert!(bad.validate().is_err(), "R + W <= N must be refused");
        let mut bad = c.clone();
        bad.nodes[1].id = bad.nodes[0].id;
        assert!(bad.validate().is_err());
        let mut bad = c;
        bad.replication_factor = 4;
        assert!(bad.validate().is_err());
    }

    #[test]
    fn a_cluster_file_is_validated_on_load_and_errors_name_it() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("cluster.toml");
        let c = ClusterConfig::init(3, Path::new("/tmp/ls"), 9000, false).expect("init");
        std::fs::write(&path, c.to_toml()).expect("write");
        assert_eq!(ClusterConfig::from_file(&path).expect("good"), c);
        std::fs::write(&path, format!("{}\nreplication_factr = 2\n", c.to_toml())).expect("write");
        let e = ClusterConfig::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}:", path.display())) && e.contains("`replication_factr`"), "{e}");
        let mut bad = c;
        bad.replication_factor = 4;
        std::fs::write(&path, bad.to_toml()).expect("write");
        let e = ClusterConfig::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}: invalid configuration: replication_factor 4", path.display())), "{e}");
    }
}
