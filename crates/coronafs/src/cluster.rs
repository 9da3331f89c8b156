//! The cluster file: every CoronaFS node of a cluster, with its addresses
//! and zone, and the shared secret of the replica RPC. Each node runs
//! `coronafs serve --config node.toml` whose `cluster` and `node` fields name
//! this file and the node's entry in it. Example:
//!
//! ```toml
//! rpc_secret = "64 hex digits, e.g. from `openssl rand -hex 32`"
//! write_quorum = 2
//! heartbeat_ms = 1000        # a primary's heartbeat on an idle replica link
//! failover_after_ms = 5000   # silence after which a copy starts a failover (0: off)
//! # lease_ms = 5000          # a primary's lease in the volume map (default: failover_after_ms)
//! # replace_after_ms = 600000 # a copy out of sync this long is replaced on another node (default: off)
//!
//! [[nodes]]
//! name = "node01"
//! nbd = "10.89.0.11:10809"
//! api = "10.89.0.11:7070"
//! replica = "10.89.0.11:7071"
//! zone = "rack-a"
//! ```
//!
//! [`ClusterFile::place`] chooses the nodes of a replicated volume's copies
//! (docs/design/replication-volumes.md, "Placement").

use crate::error::{CoronaError, Result};
use crate::replica::auth::RpcSecret;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;

/// What a server in a cluster knows of it: the file and which node it is.
#[derive(Debug, Clone)]
pub struct Membership {
    pub cluster: ClusterFile,
    /// This node's name in the file.
    pub node: String,
    pub secret: RpcSecret,
    /// Where replicated volumes count dropped replicas.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The control API token, which the nodes of a cluster share: sent to
    /// the other nodes' APIs (creating and removing copies).
    pub api_token: Option<svc_kit::api_token::ApiToken>,
}

impl Membership {
    /// Node `node` of `cluster`, which must name it.
    pub fn new(cluster: ClusterFile, node: &str, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Result<Self> {
        cluster.node(node)?;
        let secret = cluster.secret()?;
        Ok(Membership { cluster, node: node.to_owned(), secret, metrics, api_token: None })
    }

    /// A client of `node`'s control API, with the cluster's token.
    pub fn peer_api(&self, node: &ClusterNode) -> crate::api_client::ApiClient {
        crate::api_client::ApiClient::new(&format!("http://{}", node.api)).with_token(self.api_token.clone())
    }

    /// This node's entry.
    pub fn me(&self) -> Result<&ClusterNode> {
        self.cluster.node(&self.node)
    }
}

/// One node of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterNode {
    /// Unique name, as the node's `node` setting gives it.
    pub name: String,
    /// Its NBD address (where clients of the volumes it is primary for connect).
    pub nbd: SocketAddr,
    /// Its control API address (where other nodes create copies on it).
    pub api: SocketAddr,
    /// Its replica RPC address (where primaries forward writes to it).
    pub replica: SocketAddr,
    /// Failure domain: the copies of a volume go to different zones first.
    #[serde(default = "default_zone")]
    pub zone: String,
}

fn default_zone() -> String {
    "default".to_owned()
}

fn default_quorum() -> usize {
    2
}

fn default_ack_timeout_ms() -> u64 {
    10_000
}

fn default_resync_rate() -> u64 {
    crate::backend::replicated::resync::DEFAULT_RATE
}

fn default_resync_retry_ms() -> u64 {
    crate::backend::replicated::resync::DEFAULT_RETRY.as_millis() as u64
}

fn default_heartbeat_ms() -> u64 {
    1_000
}

fn default_failover_after_ms() -> u64 {
    5_000
}

/// The whole cluster file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Shared secret of the replica RPC: 64 hex digits (32 random bytes).
    pub rpc_secret: String,
    /// Copies (the primary included) that must be live for a replicated
    /// volume to accept writes and flushes [default: 2].
    #[serde(default = "default_quorum")]
    pub write_quorum: usize,
    /// How long a FLUSH waits for a replica before dropping it, in
    /// milliseconds [default: 10000].
    #[serde(default = "default_ack_timeout_ms")]
    pub ack_timeout_ms: u64,
    /// Throttle of a resync (a primary copying what a returning replica
    /// lacks), in bytes per second per volume [default: 64 MiB/s].
    #[serde(default = "default_resync_rate")]
    pub resync_bytes_per_sec: u64,
    /// How long a primary waits between attempts to reach a replica out of
    /// the live set, in milliseconds [default: 2000]; doubled after each
    /// failed attempt of that replica, up to 32 times this, jittered.
    #[serde(default = "default_resync_retry_ms")]
    pub resync_retry_ms: u64,
    /// How often a primary sends a heartbeat on an idle replica link, in
    /// milliseconds [default: 1000].
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// How long a replica copy may hear nothing from its primary before it
    /// starts an automatic failover, in milliseconds; 0 turns automatic
    /// failover off [default: 5000]. At least twice `heartbeat_ms`.
    #[serde(default = "default_failover_after_ms")]
    pub failover_after_ms: u64,
    /// How long a primary's lease in the volume map lasts, in milliseconds:
    /// a primary whose renewals stop takes no write after 80 % of it, and
    /// another copy may take over after all of it [default:
    /// `failover_after_ms`, or 5000 when automatic failover is off].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// How long a copy may stay out of the in-sync set (unreachable,
    /// failing, or not caught up) before its primary replaces it by a new
    /// copy on a node holding none, filled in the background at
    /// `resync_bytes_per_sec`, in milliseconds [default: off]. At least
    /// twice the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace_after_ms: Option<u64>,
    /// Every node, in any order.
    pub nodes: Vec<ClusterNode>,
}

impl ClusterFile {
    /// Reads and validates a cluster file; errors name the file.
    pub fn load(path: &Path) -> Result<Self> {
        let f: ClusterFile = svc_kit::config::load(path)?;
        f.validate().map_err(|e| CoronaError::Config(format!("{}: {e}", path.display())))?;
        Ok(f)
    }

    /// Parses and validates a cluster file's text.
    pub fn from_toml(text: &str) -> Result<Self> {
        let f: ClusterFile = svc_kit::config::parse(text)?;
        f.validate()?;
        Ok(f)
    }

    /// A primary's lease in the volume map: `lease_ms`, by default
    /// `failover_after_ms` (5 s when automatic failover is off).
    pub fn lease(&self) -> std::time::Duration {
        let fallback = if self.failover_after_ms == 0 { 5_000 } else { self.failover_after_ms };
        std::time::Duration::from_millis(self.lease_ms.unwrap_or(fallback))
    }

    /// Checks what serde cannot: a valid secret, at least one node, unique
    /// names and addresses, a quorum between 1 and the number of nodes.
    pub fn validate(&self) -> Result<()> {
        self.secret()?;
        if self.nodes.is_empty() {
            return Err(CoronaError::Config("the cluster file names no nodes".into()));
        }
        let mut names = HashSet::new();
        let mut addrs = HashSet::new();
        for n in &self.nodes {
            crate::util::validate_name(&n.name)
                .map_err(|e| CoronaError::Config(format!("node name {:?}: {e}", n.name)))?;
            if !names.insert(n.name.as_str()) {
                return Err(CoronaError::Config(format!("node {:?} is named twice", n.name)));
            }
            for a in [n.nbd, n.api, n.replica] {
                if !addrs.insert(a) {
                    return Err(CoronaError::Config(format!("address {a} is used twice (node {:?})", n.name)));
                }
            }
        }
        if self.heartbeat_ms == 0 {
            return Err(CoronaError::Config("heartbeat_ms must be above 0".into()));
        }
        if self.failover_after_ms != 0 && self.failover_after_ms < 2 * self.heartbeat_ms {
            return Err(CoronaError::Config(format!(
                "failover_after_ms {} must be 0 (off) or at least twice heartbeat_ms {}",
                self.failover_after_ms, self.heartbeat_ms
            )));
        }
        if let Some(l) = self.lease_ms
            && l < 2 * self.heartbeat_ms.min(250)
        {
            return Err(CoronaError::Config(format!(
                "lease_ms {l} is too short: at least twice heartbeat_ms or 500 ms, whichever is less"
            )));
        }
        if let Some(r) = self.replace_after_ms
            && r < 2 * self.lease().as_millis() as u64
        {
            return Err(CoronaError::Config(format!(
                "replace_after_ms {r} is too short: at least twice the lease ({} ms), or leave it out (off)",
                self.lease().as_millis()
            )));
        }
        if self.write_quorum == 0 || self.write_quorum > self.nodes.len() {
            return Err(CoronaError::Config(format!(
                "write_quorum {} must be between 1 and the {} nodes",
                self.write_quorum,
                self.nodes.len()
            )));
        }
        Ok(())
    }

    /// A cluster of `n` nodes `n1`..`nN` on loopback, in zones `z1`..`zN`,
    /// each with three ports free right now, a fresh secret, write quorum
    /// 2 (1 for a single node) and the default timeouts: for tests and
    /// benches that run every node in one process.
    pub fn on_loopback(n: usize) -> Result<Self> {
        // Every listener is held until all are bound, so no port is handed
        // out twice (a dropped one may come back from the next bind).
        let held = std::cell::RefCell::new(Vec::new());
        let free = || -> Result<SocketAddr> {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            let addr = l.local_addr()?;
            held.borrow_mut().push(l);
            Ok(addr)
        };
        let nodes = (1..=n)
            .map(|i| {
                Ok(ClusterNode {
                    name: format!("n{i}"),
                    nbd: free()?,
                    api: free()?,
                    replica: free()?,
                    zone: format!("z{i}"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        drop(held);
        let f = ClusterFile {
            rpc_secret: RpcSecret::random()?.to_hex(),
            write_quorum: n.min(2),
            ack_timeout_ms: default_ack_timeout_ms(),
            resync_bytes_per_sec: default_resync_rate(),
            resync_retry_ms: default_resync_retry_ms(),
            heartbeat_ms: default_heartbeat_ms(),
            failover_after_ms: default_failover_after_ms(),
            lease_ms: None,
            replace_after_ms: None,
            nodes,
        };
        f.validate()?;
        Ok(f)
    }

    /// The RPC secret.
    pub fn secret(&self) -> Result<RpcSecret> {
        Ok(RpcSecret::parse(&self.rpc_secret)?)
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Result<&ClusterNode> {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .ok_or_else(|| CoronaError::Config(format!("node {name:?} is not in the cluster file")))
    }

    /// The nodes of a volume with `copies` copies whose primary is
    /// `primary`: the primary first, then one node per zone not yet used
    /// (zones and nodes in name order), then the remaining nodes in name
    /// order. Deterministic, so every node computes the same answer.
    pub fn place(&self, primary: &str, copies: usize) -> Result<Vec<&ClusterNode>> {
        self.place_on(primary, copies, |_| true)
    }

    /// [`ClusterFile::place`] among the nodes `allowed` names only (the
    /// primary is always first): where a replicated clone may have copies.
    pub fn place_on(&self, primary: &str, copies: usize, allowed: impl Fn(&str) -> bool) -> Result<Vec<&ClusterNode>> {
        let first = self.node(primary)?;
        if copies == 0 || copies > self.nodes.len() {
            return Err(CoronaError::BadRequest(format!(
                "{copies} copies asked, but the cluster has {} nodes",
                self.nodes.len()
            )));
        }
        if copies < self.write_quorum {
            return Err(CoronaError::BadRequest(format!(
                "{copies} copies is below the write quorum of {}: the volume could never be written",
                self.write_quorum
            )));
        }
        if copies > 1 && self.failover_after_ms != 0 && self.write_quorum * 2 <= copies {
            // A primary cut off with `write_quorum` copies could go on
            // acknowledging flushes while a majority of the others elects a
            // new primary: two sides writing. A quorum above half the
            // copies makes any two such sets share a copy.
            return Err(CoronaError::BadRequest(format!(
                "{copies} copies with a write quorum of {}: automatic failover needs a write quorum above half \
                 the copies (at least {}), or failover_after_ms = 0",
                self.write_quorum,
                copies / 2 + 1
            )));
        }
        let mut rest: Vec<&ClusterNode> = self.nodes.iter().filter(|n| n.name != primary && allowed(&n.name)).collect();
        if rest.len() + 1 < copies {
            return Err(CoronaError::BadRequest(format!(
                "{copies} copies asked, but only {} node(s) may hold one",
                rest.len() + 1
            )));
        }
        rest.sort_by(|a, b| (&a.zone, &a.name).cmp(&(&b.zone, &b.name)));
        let mut chosen = vec![first];
        let mut zones: HashSet<&str> = HashSet::from([first.zone.as_str()]);
        for n in &rest {
            if chosen.len() < copies && zones.insert(n.zone.as_str()) {
                chosen.push(n);
            }
        }
        let mut others: Vec<&ClusterNode> =
            rest.into_iter().filter(|n| !chosen.iter().any(|c| c.name == n.name)).collect();
        others.sort_by(|a, b| a.name.cmp(&b.name));
        chosen.extend(others.into_iter().take(copies - chosen.len()));
        Ok(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(zones: &[&str]) -> ClusterFile {
        let nodes = zones
            .iter()
            .enumerate()
            .map(|(i, z)| ClusterNode {
                name: format!("n{}", i + 1),
                nbd: format!("10.0.0.{}:10809", i + 1).parse().expect("addr"),
                api: format!("10.0.0.{}:7070", i + 1).parse().expect("addr"),
                replica: format!("10.0.0.{}:7071", i + 1).parse().expect("addr"),
                zone: z.to_string(),
            })
            .collect();
        ClusterFile {
            rpc_secret: "ab".repeat(32),
            write_quorum: 2,
            ack_timeout_ms: 10_000,
            resync_bytes_per_sec: default_resync_rate(),
            resync_retry_ms: default_resync_retry_ms(),
            heartbeat_ms: 1_000,
            failover_after_ms: 5_000,
            lease_ms: None,
            replace_after_ms: None,
            nodes,
        }
    }

    fn names(v: Vec<&ClusterNode>) -> Vec<&str> {
        v.into_iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn copies_go_to_different_zones_first() {
        let f = file(&["a", "a", "b", "c"]);
        assert_eq!(names(f.place("n1", 3).expect("place")), ["n1", "n3", "n4"]);
        assert_eq!(names(f.place("n2", 3).expect("place")), ["n2", "n3", "n4"]);
        let f = file(&["a", "a", "b"]);
        assert_eq!(names(f.place("n3", 3).expect("place")), ["n3", "n1", "n2"]);
        assert_eq!(names(f.place("n1", 3).expect("place")), ["n1", "n3", "n2"], "zone b before the second a");
    }

    #[test]
    fn a_placement_among_allowed_nodes_keeps_the_zone_rule_and_says_when_too_few_are_allowed() {
        let f = file(&["a", "a", "b", "c"]);
        let not_n3 = |n: &str| n != "n3";
        assert_eq!(names(f.place_on("n1", 3, not_n3).expect("place")), ["n1", "n4", "n2"]);
        let e = f.place_on("n1", 3, |n| n == "n2").expect_err("two allowed").to_string();
        assert!(e.contains("only 2 node(s)"), "{e}");
    }

    #[test]
    fn impossible_placements_are_refused() {
        let f = file(&["a", "b"]);
        assert!(f.place("n1", 3).expect_err("too few nodes").to_string().contains("2 nodes"));
        assert!(f.place("n1", 1).expect_err("below quorum").to_string().contains("write quorum"));
        assert!(f.place("n9", 2).is_err());
        // Two copies with a quorum of 1 could each go on alone in a
        // partition: refused while automatic failover is on.
        let mut f = file(&["a", "b", "c", "d"]);
        f.write_quorum = 1;
        let e = f.place("n1", 2).expect_err("quorum of half the copies").to_string();
        assert!(e.contains("above half") && e.contains("at least 2"), "{e}");
        f.write_quorum = 2;
        assert!(f.place("n1", 4).expect_err("2 of 4").to_string().contains("at least 3"));
        assert_eq!(f.place("n1", 3).expect("2 of 3").len(), 3);
        f.failover_after_ms = 0;
        assert_eq!(f.place("n1", 4).expect("by hand only").len(), 4);
    }

    #[test]
    fn a_cluster_file_parses_and_bad_ones_are_refused() {
        let text = format!(
            "rpc_secret = \"{}\"\n[[nodes]]\nname = \"n1\"\nnbd = \"127.0.0.1:1\"\napi = \"127.0.0.1:2\"\nreplica = \"127.0.0.1:3\"\n",
            "cd".repeat(32)
        );
        let f = ClusterFile::from_toml(&text).expect_err("quorum 2 of 1 node");
        assert!(f.to_string().contains("write_quorum"), "{f}");
        let f = ClusterFile::from_toml(&format!("write_quorum = 1\n{text}")).expect("valid");
        assert_eq!(f.nodes[0].zone, "default");
        assert_eq!((f.ack_timeout_ms, f.heartbeat_ms, f.failover_after_ms), (10_000, 1_000, 5_000));
        let e = ClusterFile::from_toml(&format!("write_quorum = 1\nfailover_after_ms = 1500\n{text}"));
        assert!(e.expect_err("below twice the heartbeat").to_string().contains("twice"));
        let off = ClusterFile::from_toml(&format!("write_quorum = 1\nfailover_after_ms = 0\n{text}"));
        assert_eq!(off.expect("0 turns it off").failover_after_ms, 0);
        let e = ClusterFile::from_toml(&format!("write_quorum = 1\nrpc_secrets = 1\n{text}")).expect_err("typo");
        assert!(e.to_string().contains("rpc_secrets"), "{e}");
        let bad = ClusterFile::from_toml(&format!("write_quorum = 1\n{}", text.replace(&"cd".repeat(32), "short")));
        assert!(bad.expect_err("secret").to_string().contains("64 hex digits"));
        let mut twice = file(&["a", "b"]);
        twice.nodes[1].name = "n1".into();
        assert!(twice.validate().expect_err("names").to_string().contains("named twice"));
        let mut same = file(&["a", "b"]);
        same.nodes[1].replica = same.nodes[0].api;
        assert!(same.validate().expect_err("addrs").to_string().contains("used twice"));
    }
}
