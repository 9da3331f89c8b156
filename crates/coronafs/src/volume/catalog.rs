//! The metadata model (pure, no I/O): volumes, snapshots and layers, and the
//! rules over them (chains, depth, who is a clone of what, which layers are
//! garbage). [`super::meta`] stores it in redb; the manager changes a copy
//! and commits the difference in one transaction.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// A volume: a size and the layer its writes go to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeRec {
    /// Size in bytes.
    pub size: u64,
    /// The head layer.
    pub head: u64,
    /// The snapshot this volume was cloned from (`VOL@SNAP`), until flattened.
    pub origin: Option<String>,
    /// Write epoch: connections that declared a lower one may not write
    /// (0 until the first fence; absent in records written before fencing).
    #[serde(default)]
    pub epoch: u64,
    /// The nodes holding the other copies of a replicated volume, which
    /// this node is the primary of (empty for a volume on this node only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Those of `replicas` the primary dropped from the live set: they miss
    /// writes, so they rejoin only after a resync copied what they lack
    /// (`backend/replicated/resync.rs`). They still count as copies for
    /// the quorum.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale: Vec<String>,
    /// Whom this copy voted for as primary at `epoch` (failover; a copy
    /// votes once per epoch, and this record makes that survive restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub voted_for: Option<String>,
    /// On a replica: the node that last opened a write stream to this copy,
    /// which NBD clients are sent to. On a primary after a failover: itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// Every copy of the volume (primary included) as that primary named
    /// them; who votes in a failover.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub copies: Vec<String>,
    /// On a primary made by a failover, while `epoch` is still the one it
    /// was elected at: the write epoch of the stream it took over (the old
    /// primary's, which that primary's NBD clients declared). Cleared when
    /// the epoch is raised by a fence. NBD clients that declared exactly
    /// this epoch are told the new one (docs/design/replication-volumes.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promoted_from: Option<u64>,
    /// On a copy: a number drawn when the copy first took a primary's
    /// stream, new with every record of this name, so a primary that knew
    /// another one can tell the copy was deleted and made again (it then
    /// gets a full copy, not only the regions the primary's log names).
    /// 0: none drawn yet.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A snapshot: a frozen layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapRec {
    pub layer: u64,
    /// Size of the volume when the snapshot was taken.
    pub size: u64,
    /// On a replicated volume's primary: the copies that did not take this
    /// snapshot (out of the live set, or failed it). They never get it: a
    /// resync brings back a copy's head, not its snapshots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
}

/// A layer: a data file and, with a parent, an ownership map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRec {
    /// Data file, relative to the data dir.
    pub file: String,
    /// Logical size in bytes.
    pub size: u64,
    pub parent: Option<u64>,
    /// Bytes of the parent visible through this layer.
    pub parent_limit: u64,
}

/// On the primary that deleted a replicated volume: the copies still to be
/// told (they were unreachable when it was deleted). Kept until each copy
/// deleted itself or refused for good (it belongs to a newer primary).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deletion {
    /// The nodes whose copies are still to be deleted.
    pub nodes: Vec<String>,
    /// The volume's epoch when it was deleted: a copy fenced above it has
    /// another primary now and refuses.
    pub epoch: u64,
}

/// Everything the store holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    pub volumes: BTreeMap<String, VolumeRec>,
    /// Keyed by `VOL@SNAP`.
    pub snapshots: BTreeMap<String, SnapRec>,
    pub layers: BTreeMap<u64, LayerRec>,
    pub next_layer: u64,
    /// Deleted replicated volumes whose copies on other nodes are still to
    /// be deleted, by volume name (committed with the deletion itself).
    pub deletions: BTreeMap<String, Deletion>,
}

/// `VOL@SNAP`.
pub fn snap_key(vol: &str, snap: &str) -> String {
    format!("{vol}@{snap}")
}

impl Catalog {
    /// A fresh layer id.
    pub fn alloc_layer(&mut self) -> u64 {
        self.next_layer = self.next_layer.max(self.layers.keys().next_back().map_or(0, |k| k + 1)).max(1);
        let id = self.next_layer;
        self.next_layer += 1;
        id
    }

    /// Layers from `layer` down to its base.
    pub fn chain(&self, layer: u64) -> Vec<u64> {
        let mut out = vec![layer];
        let mut cur = layer;
        while let Some(p) = self.layers.get(&cur).and_then(|l| l.parent) {
            if out.contains(&p) {
                break;
            }
            out.push(p);
            cur = p;
        }
        out
    }

    /// Snapshot names of a volume, sorted.
    pub fn snapshots_of(&self, vol: &str) -> Vec<String> {
        let prefix = format!("{vol}@");
        self.snapshots.keys().filter_map(|k| k.strip_prefix(&prefix).map(str::to_owned)).collect()
    }

    /// Volumes cloned from `VOL@SNAP`.
    pub fn clones_of(&self, key: &str) -> Vec<String> {
        self.volumes.iter().filter(|(_, v)| v.origin.as_deref() == Some(key)).map(|(n, _)| n.clone()).collect()
    }

    /// Layers no volume or snapshot can reach.
    pub fn garbage(&self) -> Vec<u64> {
        let mut live = BTreeSet::new();
        let roots = self.volumes.values().map(|v| v.head).chain(self.snapshots.values().map(|s| s.layer));
        for r in roots {
            live.extend(self.chain(r));
        }
        self.layers.keys().filter(|k| !live.contains(k)).copied().collect()
    }

    /// Drops unreachable layers; returns them.
    pub fn collect_garbage(&mut self) -> Vec<(u64, LayerRec)> {
        self.garbage().into_iter().filter_map(|id| self.layers.remove(&id).map(|l| (id, l))).collect()
    }

    /// Every layer record that a volume or snapshot needs exists.
    pub fn check(&self) -> Result<(), String> {
        let roots = self.volumes.iter().map(|(n, v)| (n.clone(), v.head));
        for (name, r) in roots.chain(self.snapshots.iter().map(|(k, s)| (k.clone(), s.layer))) {
            for l in self.chain(r) {
                if !self.layers.contains_key(&l) {
                    return Err(format!("{name} needs layer {l}, which is missing"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(parent: Option<u64>) -> LayerRec {
        LayerRec { file: String::new(), size: 1, parent, parent_limit: 1 }
    }

    #[test]
    fn garbage_is_what_no_volume_or_snapshot_reaches() {
        let mut c = Catalog::default();
        for (id, p) in [(1, None), (2, Some(1)), (3, Some(1)), (4, Some(2)), (9, None)] {
            c.layers.insert(id, layer(p));
        }
        c.volumes.insert("a".into(), VolumeRec { size: 1, head: 4, ..Default::default() });
        c.snapshots.insert(snap_key("a", "s"), SnapRec { layer: 2, size: 1, missing: Vec::new() });
        assert_eq!(c.chain(4), vec![4, 2, 1]);
        assert_eq!(c.garbage(), vec![3, 9]);
        assert_eq!(c.snapshots_of("a"), vec!["s".to_owned()]);
        assert!(c.snapshots_of("").is_empty());
        let gone: Vec<u64> = c.collect_garbage().into_iter().map(|(id, _)| id).collect();
        assert_eq!(gone, vec![3, 9]);
        c.check().expect("consistent");
        c.layers.remove(&1);
        assert!(c.check().is_err());
        assert_eq!(c.alloc_layer(), 5);
    }
}
