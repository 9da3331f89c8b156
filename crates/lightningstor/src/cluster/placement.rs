//! Placement: keys hash into a fixed number of partitions; each partition
//! maps to N nodes, computed deterministically from the layout.
//!
//! Nodes are ranked per partition by weighted rendezvous hashing (the score
//! of node n for partition p is derived from BLAKE3(p, n.name) and scaled by
//! n.capacity), then picked in rank order while skipping zones already
//! used, and only then from zones already used. Rendezvous ranking moves only
//! the partitions a joining or leaving node gains or loses. The rest of the
//! code sees placement through the small [`Replication`] trait.

use super::NodeId;
use super::config::{ClusterConfig, NodeConfig};
use std::collections::HashSet;

/// What the rest of the cluster code asks of placement.
pub trait Replication: Send + Sync {
    /// The nodes holding `partition`, in preference order.
    fn nodes_for(&self, partition: u32) -> &[NodeId];
    /// Replies a read needs.
    fn read_quorum(&self) -> usize;
    /// Acknowledgements a write needs.
    fn write_quorum(&self) -> usize;
    /// Number of partitions.
    fn partitions(&self) -> u32;
}

/// The partition of an object key (or of a bucket name with an empty key).
/// (The hash lives with the metadata's hash trees, which index rows by it.)
pub fn partition_of(partitions: u32, bucket: &str, key: &[u8]) -> u32 {
    crate::meta::merkle::position(partitions, bucket, key).0
}

/// A computed layout: partition -> nodes.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Layout version from the cluster file.
    pub version: u64,
    table: Vec<Vec<NodeId>>,
    r: usize,
    w: usize,
}

fn score(partition: u32, node: &NodeConfig) -> f64 {
    let mut h = blake3::Hasher::new();
    h.update(&partition.to_le_bytes());
    h.update(node.name.as_bytes());
    let d = h.finalize();
    let b = d.as_bytes();
    let x = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    // Uniform in (0, 1]; -ln(u)/capacity is exponential with rate capacity,
    // and the smallest wins: P(node wins) is proportional to its capacity.
    let u = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    -u.ln() / f64::from(node.capacity.max(1))
}

impl Layout {
    /// Computes the layout the cluster file describes.
    pub fn compute(c: &ClusterConfig) -> Self {
        let n = c.replication_factor.min(c.nodes.len());
        let table = (0..c.partitions)
            .map(|p| {
                let mut ranked: Vec<(f64, &NodeConfig)> = c.nodes.iter().map(|node| (score(p, node), node)).collect();
                ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.id.cmp(&b.1.id)));
                let mut zones = HashSet::new();
                let mut chosen: Vec<NodeId> = Vec::with_capacity(n);
                for (_, node) in &ranked {
                    if chosen.len() < n && zones.insert(node.zone.as_str()) {
                        chosen.push(node.id);
                    }
                }
                for (_, node) in &ranked {
                    if chosen.len() < n && !chosen.contains(&node.id) {
                        chosen.push(node.id);
                    }
                }
                chosen
            })
            .collect();
        Layout { version: c.layout_version, table, r: c.r(), w: c.w() }
    }

    /// Every partition a node holds.
    pub fn partitions_of(&self, node: NodeId) -> Vec<u32> {
        (0..self.partitions()).filter(|p| self.nodes_for(*p).contains(&node)).collect()
    }
}

impl Replication for Layout {
    fn nodes_for(&self, partition: u32) -> &[NodeId] {
        self.table.get(partition as usize).map(Vec::as_slice).unwrap_or(&[])
    }
    fn read_quorum(&self) -> usize {
        self.r
    }
    fn write_quorum(&self) -> usize {
        self.w
    }
    fn partitions(&self) -> u32 {
        u32::try_from(self.table.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cluster(n: usize) -> ClusterConfig {
        ClusterConfig::init(n, Path::new("/tmp/x"), 9000, false).expect("init")
    }

    #[test]
    fn every_partition_gets_n_distinct_nodes_and_the_load_is_even() {
        let c = cluster(5);
        let l = Layout::compute(&c);
        let mut load = std::collections::HashMap::new();
        for p in 0..l.partitions() {
            let nodes = l.nodes_for(p);
            assert_eq!(nodes.len(), 3);
            assert_eq!(nodes.iter().collect::<HashSet<_>>().len(), 3);
            for n in nodes {
                *load.entry(*n).or_insert(0) += 1;
            }
        }
        // 256 * 3 / 5 = 153.6 per node; allow a generous spread.
        for (n, v) in load {
            assert!((110..200).contains(&v), "node {n} holds {v} partitions");
        }
    }

    #[test]
    fn replicas_spread_over_zones_before_sharing_one() {
        let mut c = cluster(6);
        for (i, n) in c.nodes.iter_mut().enumerate() {
            n.zone = format!("zone{}", i % 3);
        }
        let l = Layout::compute(&c);
        for p in 0..l.partitions() {
            let zones: HashSet<String> = l
                .nodes_for(p)
                .iter()
                .map(|id| c.nodes.iter().find(|n| n.id == *id).expect("node").zone.clone())
                .collect();
            assert_eq!(zones.len(), 3, "partition {p} does not span three zones");
        }
    }

    #[test]
    fn placement_is_deterministic_and_adding_a_node_moves_few_partitions() {
        let c4 = cluster(4);
        let a = Layout::compute(&c4);
        let b = Layout::compute(&c4);
        let c5 = cluster(5);
        let d = Layout::compute(&c5);
        let mut moved = 0;
        for p in 0..a.partitions() {
            assert_eq!(a.nodes_for(p), b.nodes_for(p));
            let old: HashSet<_> = a.nodes_for(p).iter().collect();
            moved += d.nodes_for(p).iter().filter(|n| !old.contains(n)).count();
        }
        // The new node should take about 3/5 of 256 replica slots = 154; nothing else moves.
        assert!(moved < 256 * 3 / 5 + 40, "{moved} replica slots moved");
        assert!(moved > 0);
    }

    #[test]
    fn keys_map_to_stable_partitions() {
        assert_eq!(partition_of(256, "b", b"k"), partition_of(256, "b", b"k"));
        assert!(partition_of(256, "b", b"k") < 256);
    }
}
