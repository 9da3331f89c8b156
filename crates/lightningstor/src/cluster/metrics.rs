//! Replication counters of one node, exported at /metrics
//! ([`super::render_metrics`]). Below every role of the node: the replica,
//! the coordinator and the repair worker count into the same set.

use std::sync::atomic::{AtomicU64, Ordering};

/// Replication counters of one node (exported at /metrics).
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// Writes acknowledged with fewer than all replicas.
    pub degraded_writes: AtomicU64,
    /// Writes committed a second time, above a newer row a replica held.
    pub recommits: AtomicU64,
    /// Rows or blocks pushed to a replica that missed them (resync, read repair, anti-entropy).
    pub repairs: AtomicU64,
    /// Read repairs started.
    pub read_repairs: AtomicU64,
    /// Resync queue entries completed.
    pub resync_done: AtomicU64,
    /// Resync attempts that failed (and were rescheduled).
    pub resync_failed: AtomicU64,
    /// Corrupt or missing block copies found (reads and scrub).
    pub bad_copies_found: AtomicU64,
    /// Blocks scrub re-hashed.
    pub scrubbed_blocks: AtomicU64,
    /// Anti-entropy partitions found divergent.
    pub divergent_partitions: AtomicU64,
    /// Rows anti-entropy read from this node's store (for its own rounds
    /// and to answer peers'): grows with what differs, not with what is stored.
    pub anti_entropy_rows_read: AtomicU64,
    /// Tree nodes anti-entropy compared (its own rounds).
    pub anti_entropy_nodes_compared: AtomicU64,
    /// Requests that failed for lack of a quorum.
    pub quorum_failures: AtomicU64,
    /// Reads that asked replicas beyond the read quorum (one asked failed
    /// or was slow to answer).
    pub hedged_reads: AtomicU64,
    /// Rows reads fetched in full from a replica, the local one included:
    /// one per read when the row read is the newest, two when a replica
    /// reported a newer version (see [`super::coord::Coordinator::read_row`]).
    pub read_rows_fetched: AtomicU64,
    /// Row versions reads asked of replicas instead of the row.
    pub read_versions_asked: AtomicU64,
    /// Messages that carried version asks ([`super::batch`]): fewer than
    /// the asks when concurrent reads shared them.
    pub version_batches: AtomicU64,
}

impl ClusterMetrics {
    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}
