//! The repair worker: the resync queue, scrub, anti-entropy, tombstone
//! collection and rebalancing. [`Repair`] works through the public
//! methods of a node's roles only (the coordinator's reads and pushes, the
//! replica's tree reads, the node's layout and calls); each of its loops runs as its own
//! task per node ([`Repair::spawn`]), bounded in rate, and counts what it
//! does in [`super::metrics::ClusterMetrics`].

use super::NodeId;
use super::coord::Coordinator;
use super::metrics::ClusterMetrics;
use super::placement::Replication;
use super::resync::Entry;
use super::rpc::{Msg, Req, Resp};
use crate::block::{BlockHash, Scrubbed};
use crate::error::{LightningError, Result};
use crate::meta::merkle;
use crate::meta::types::VersionRow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Tree nodes asked of a peer in one request (32 bytes each in the answer).
const NODES_PER_CALL: usize = 4096;
/// Tree leaves whose rows are asked of a peer in one request.
const LEAVES_PER_CALL: usize = 64;

fn join_err(e: tokio::task::JoinError) -> LightningError {
    LightningError::Io(std::io::Error::other(e))
}

/// A node's repair worker. Cheap to make: it holds only the node's
/// coordinator (the resync queue, trees and counters it works on are the
/// node's; a scrub pass's position lives in the scrub loop).
/// [`Coordinator::repair`] makes one for single rounds (tests, the
/// rebalance of `cluster layout apply`); [`Repair::spawn`] runs the loops
/// of a serving node.
#[derive(Debug, Clone)]
pub struct Repair {
    coord: Arc<Coordinator>,
}

impl Repair {
    /// The repair worker of the node `coord` coordinates for.
    pub fn new(coord: Arc<Coordinator>) -> Self {
        Repair { coord }
    }

    /// Works through due resync entries once; returns how many were tried.
    pub async fn resync_round(&self) -> Result<usize> {
        let node = self.coord.node.clone();
        let due = tokio::task::spawn_blocking(move || node.resync.due(64)).await.map_err(join_err)??;
        let n = due.len();
        let jobs = due.into_iter().map(|e| {
            let coord = self.coord.clone();
            async move {
                let r = Repair::resync_one(&coord, &e).await;
                let node = coord.node.clone();
                let ok = r.is_ok();
                if let Err(err) = r {
                    tracing::debug!(node = e.node, error = %err, "resync attempt failed");
                }
                let _ =
                    tokio::task::spawn_blocking(move || if ok { node.resync.done(&e) } else { node.resync.retry(&e) })
                        .await;
                let m = &coord.node.metrics;
                ClusterMetrics::inc(if ok { &m.resync_done } else { &m.resync_failed });
            }
        });
        futures::stream::iter(jobs).buffer_unordered(8).collect::<Vec<()>>().await;
        Ok(n)
    }

    async fn resync_one(coord: &Arc<Coordinator>, e: &Entry) -> Result<()> {
        if e.due.bucket_row && e.bucket.is_empty() {
            // The keyring (see buckets.rs): push every row, the replica keeps the newer ones.
            let rows = coord.node.replica.auth_rows().await?;
            coord.node.call(e.node, Msg::new(Req::MergeAuth { rows })).await?;
            return Ok(());
        }
        if e.due.bucket_row {
            return coord.resync_bucket(e.node, &e.bucket).await;
        }
        let replicas: Vec<NodeId> = coord.node.write_sets(&e.bucket, &e.key).concat();
        if !replicas.contains(&e.node) {
            return Ok(()); // no longer a replica after a layout change
        }
        let found = coord.read_row(&e.bucket, &e.key).await?;
        if let Some(row) = found.row {
            coord.push_row(e.node, &e.bucket, &e.key, &row).await?;
        }
        if coord.bucket_versioning(&e.bucket)?.is_some() {
            coord.resync_versions(e.node, &e.bucket, &e.key).await?;
        }
        Ok(())
    }

    /// Re-hashes up to `max` local blocks starting after `after`; corrupt
    /// ones are replaced from another node. Returns the last block checked.
    pub async fn scrub_some(&self, after: Option<BlockHash>, max: usize) -> Result<Option<BlockHash>> {
        let list = self.coord.node.replica.block_list().await?;
        let start = after.map_or(0, |a| list.partition_point(|h| *h <= a));
        let batch: Vec<BlockHash> = list.into_iter().skip(start).take(max).collect();
        let last = batch.last().copied();
        self.scrub_blocks(batch).await?;
        Ok(last)
    }

    /// Re-hashes `batch`; a corrupt block is replaced from another node. A
    /// block deleted since it was listed, even while scrub read it, is
    /// skipped without an alarm ([`crate::block::scrub_one`]).
    async fn scrub_blocks(&self, batch: Vec<BlockHash>) -> Result<()> {
        for hash in batch {
            let r = self.coord.node.replica.scrub(hash).await;
            self.coord.node.metrics.scrubbed_blocks.fetch_add(1, Ordering::Relaxed);
            if let Ok(Scrubbed::Corrupt) = r {
                ClusterMetrics::inc(&self.coord.node.metrics.bad_copies_found);
                tracing::warn!(block = %hash, "scrub found a corrupt block; fetching a good copy");
                let others: Vec<NodeId> =
                    self.coord.node.all_nodes().into_iter().filter(|n| *n != self.coord.node.id).collect();
                match self.coord.fetch_block(hash, &others).await {
                    Ok(data) => {
                        self.coord
                            .node
                            .call(self.coord.node.id, Msg::with_data(Req::RepairBlock { hash }, data))
                            .await?;
                    }
                    Err(e) => tracing::error!(block = %hash, error = %e, "no good copy of a corrupt block"),
                }
            }
        }
        Ok(())
    }

    /// A counter that moves whenever this node serves foreground traffic
    /// (S3 requests, blocks written or read for a client or a peer).
    fn foreground_ops(&self) -> u64 {
        let m = &self.coord.node.store.metrics;
        [&m.requests, &m.blocks_written, &m.blocks_read].iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// One anti-entropy pass: for every peer, compare the hash trees of the
    /// partitions both hold, root first, descending only into nodes whose
    /// hashes differ; for the leaves that differ, compare row versions and
    /// push or pull the newer rows. In sync, a pass reads one root per
    /// shared partition and no row. Returns rows repaired.
    pub async fn anti_entropy_round(&self) -> Result<usize> {
        let layout = self.coord.node.layout();
        let mine = layout.partitions_of(self.coord.node.id);
        let mut by_peer: HashMap<NodeId, Vec<u32>> = HashMap::new();
        for p in &mine {
            for n in layout.nodes_for(*p) {
                if *n != self.coord.node.id {
                    by_peer.entry(*n).or_default().push(*p);
                }
            }
        }
        let mut repaired = 0;
        for (peer, parts) in by_peer {
            let Some(leaves) = self.differing_leaves(peer, &parts).await? else { continue };
            for chunk in leaves.chunks(LEAVES_PER_CALL) {
                repaired += self.reconcile(peer, chunk).await?;
            }
        }
        Ok(repaired)
    }

    /// The leaves of `partitions` whose hashes differ here and on `peer`;
    /// `None` when the peer does not answer (or runs a build without trees).
    async fn differing_leaves(&self, peer: NodeId, partitions: &[u32]) -> Result<Option<Vec<(u32, u8)>>> {
        let mut ask: Vec<(u32, u16)> = partitions.iter().map(|p| (*p, merkle::ROOT)).collect();
        let mut leaves = Vec::new();
        while !ask.is_empty() {
            let mut next = Vec::new();
            for chunk in ask.chunks(NODES_PER_CALL) {
                let theirs = match self.coord.node.call(peer, Msg::new(Req::TreeNodes { nodes: chunk.to_vec() })).await
                {
                    Ok(Msg { head: Resp::Digests(d), .. }) if d.len() == chunk.len() => d,
                    _ => return Ok(None),
                };
                let ours = self.coord.node.replica.tree_nodes(chunk.to_vec()).await?;
                self.coord.node.metrics.anti_entropy_nodes_compared.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                let step = merkle::descend(chunk, &ours, &theirs);
                self.coord.node.metrics.divergent_partitions.fetch_add(step.partitions as u64, Ordering::Relaxed);
                next.extend(step.ask);
                leaves.extend(step.leaves);
            }
            ask = next;
        }
        Ok(Some(leaves))
    }

    /// Makes the rows of `leaves` equal here and on `peer`: newer rows of
    /// ours are pushed, newer rows of theirs pulled.
    async fn reconcile(&self, peer: NodeId, leaves: &[(u32, u8)]) -> Result<usize> {
        let theirs = match self.coord.node.call(peer, Msg::new(Req::LeafRows { leaves: leaves.to_vec() })).await?.head {
            Resp::Versions(v) => v,
            _ => return Ok(0),
        };
        let ours = self.coord.node.replica.leaf_rows(leaves.to_vec()).await?;
        let key = |r: &VersionRow| (r.0.clone(), r.1.clone());
        let mine: HashMap<_, u64> = ours.iter().map(|r| (key(r), r.2)).collect();
        let other: HashMap<_, u64> = theirs.iter().map(|r| (key(r), r.2)).collect();
        let mut n = 0;
        for ((b, k), v) in &mine {
            if other.get(&(b.clone(), k.clone())).is_none_or(|o| o < v)
                && let Some(row) = self.coord.node.replica.row(b, k)?
            {
                self.coord.push_row(peer, b, k, &row).await?;
                n += 1;
            }
        }
        for ((b, k), v) in &other {
            if mine.get(&(b.clone(), k.clone())).is_none_or(|m| m < v) {
                let req = Req::GetRow { bucket: b.clone(), key: k.clone() };
                if let Resp::Row(Some(row)) = self.coord.node.call(peer, Msg::new(req)).await?.head {
                    self.coord.push_row(self.coord.node.id, b, k, &row).await?;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Drops tombstones older than the configured delay (`tombstone_secs`).
    /// Deleted buckets stay remembered (`buckets_gone`, a small row each):
    /// a node that missed a delete and came back later than that would
    /// otherwise bring the bucket back through anti-entropy.
    pub async fn collect_tombstones(&self) -> Result<usize> {
        let keep_ms = self.coord.node.config().tombstone_secs.saturating_mul(1000);
        let now = u64::try_from(crate::meta::now_ms()).unwrap_or(0);
        let before = now.saturating_sub(keep_ms) << 20;
        let old = self.coord.node.replica.old_tombstones(before).await?;
        let n = old.len();
        for (b, k, v) in old {
            self.coord.node.replica.drop_tombstone(b, k, v).await?;
        }
        Ok(n)
    }

    /// Pushes every row this node holds to the replicas the current layout
    /// assigns it to (after a layout change). Returns rows pushed.
    pub async fn rebalance_round(&self) -> Result<usize> {
        // A node added by this change has none of the keyring (keys are
        // rows of every node, not of a partition): give every other node all
        // of ours; each keeps the newer version of a row, so this is safe to
        // repeat and is not counted as rows moved.
        let auth = self.coord.node.replica.auth_rows().await?;
        if !auth.is_empty() {
            let others: Vec<NodeId> =
                self.coord.node.config().nodes.iter().map(|n| n.id).filter(|id| *id != self.coord.node.id).collect();
            for peer in others {
                self.coord.node.call(peer, Msg::new(Req::MergeAuth { rows: auth.clone() })).await?;
            }
        }
        // So does it of the buckets' versioning states (a node takes only a
        // newer change), before the versions below go to it.
        for (name, row) in self.coord.node.replica.buckets().await? {
            let (Some(state), Some(at)) = (row.versioning, row.versioning_at) else { continue };
            for peer in self.coord.node.config().nodes.iter().map(|n| n.id).filter(|id| *id != self.coord.node.id) {
                let set = Req::SetVersioning { bucket: name.clone(), state, at };
                self.coord.node.call(peer, Msg::new(set)).await?;
            }
        }
        let rows = self.coord.node.replica.all_rows().await?;
        let mut n = 0;
        // The versions of versioned buckets' keys held here (also of keys
        // whose row is gone, a delete marker's tombstone collected).
        for (b, k) in self.coord.node.replica.version_keys().await? {
            if self.coord.bucket_versioning(&b)?.is_some() {
                n += self.coord.rebalance_versions(&b, &k).await?;
            }
        }
        for (b, k, _, _) in rows {
            let Some(row) = self.coord.node.replica.row(&b, &k)? else { continue };
            for target in self.coord.node.replicas(&b, &k) {
                if target == self.coord.node.id {
                    continue;
                }
                let req = Req::RowVersion { bucket: b.clone(), key: k.clone() };
                let theirs = match self.coord.node.call(target, Msg::new(req)).await?.head {
                    Resp::Version(v) => v,
                    _ => 0,
                };
                if theirs < row.version() {
                    self.coord.push_row(target, &b, &k, &row).await?;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Starts the worker's loops (and the node's share of the lifecycle
    /// task); they stop when the returned handles are aborted.
    pub fn spawn(self) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        let config = self.coord.node.config();
        let w = self.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match w.resync_round().await {
                    Ok(0) | Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    Ok(_) => {}
                }
                w.coord.node.replica.expire_sessions();
            }
        }));
        let rate = config.scrub_blocks_per_sec;
        if rate > 0 {
            let w = self.clone();
            tasks.push(tokio::spawn(async move {
                // One listing per pass over the store, `rate` blocks a
                // second; while clients or peers keep the node busy, a
                // tenth of that (at least one block), so scrub neither
                // stops under steady load nor competes with it.
                let rate = rate as usize;
                let mut pass: std::collections::VecDeque<BlockHash> = Default::default();
                let mut seen = w.foreground_ops();
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let busy = w.foreground_ops() != seen;
                    let share = if busy { (rate / 10).max(1) } else { rate };
                    if pass.is_empty() {
                        match w.coord.node.replica.block_list().await {
                            Ok(list) => pass = list.into(),
                            Err(e) => tracing::debug!(error = %e, "scrub could not list blocks"),
                        }
                    }
                    let batch: Vec<BlockHash> = pass.drain(..share.min(pass.len())).collect();
                    if let Err(e) = w.scrub_blocks(batch).await {
                        tracing::debug!(error = %e, "scrub round failed");
                    }
                    // Counted after the batch, so a repair write of scrub's
                    // own does not look like a client.
                    seen = w.foreground_ops();
                }
            }));
        }
        tasks.push(super::lifecycle::spawn(&self.coord));
        let ae = config.anti_entropy_secs;
        if ae > 0 {
            let w = self;
            tasks.push(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(ae)).await;
                    if let Err(e) = w.anti_entropy_round().await {
                        tracing::debug!(error = %e, "anti-entropy round failed");
                    }
                    if let Err(e) = w.coord.shared_rows_round().await {
                        tracing::debug!(error = %e, "anti-entropy of bucket rows and keys failed");
                    }
                    let _ = w.collect_tombstones().await;
                    if let Err(e) = w.coord.sweep_uploads().await {
                        tracing::debug!(error = %e, "upload sweep failed");
                    }
                }
            }));
        }
        tasks
    }
}

use futures::StreamExt as _;
