//! A cluster node's share of the lifecycle task ([`crate::lifecycle`]).
//!
//! Every node runs the task over the rows it holds, from its own copy of
//! the (replicated) bucket rows, but acts only on keys whose replica set's
//! first *live* node it is: at the start of each round it pings every node,
//! and a key belongs to the first node of its replica set that answered.
//! So each key is handled by one node while its replicas agree on who is up;
//! when they do not (a partition), two nodes may act on the same key, which
//! is harmless: deletes and aborts go through the normal coordinated paths
//! (a delete conditional on the ETag and last-modified time seen, under the
//! key's lease; an abort after a quorum read), so the second finds the work
//! done. Those paths replicate with the usual quorums and resync.

use super::NodeId;
use super::coord::Coordinator;
use super::rpc::{Msg, Req};
use crate::error::Result;
use crate::lifecycle::{self, Candidate, Page, PendingUpload, Rule, Target};
use crate::metrics::Metrics;
use crate::s3::lifecycle::{after_key, page_of};
use std::collections::HashSet;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How long a node waits for a ping's answer before counting the peer down.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

struct Share {
    coord: Arc<Coordinator>,
    live: Mutex<HashSet<NodeId>>,
}

/// The node that handles a key: the first live node of its (current)
/// replica set, `None` when none is live (pure).
pub fn handler(sets: &[Vec<NodeId>], live: &HashSet<NodeId>) -> Option<NodeId> {
    sets.first().and_then(|s| s.iter().copied().find(|n| live.contains(n)))
}

impl Share {
    /// Whether this node handles `key` of `bucket`.
    fn mine(&self, live: &HashSet<NodeId>, bucket: &str, key: &[u8]) -> bool {
        handler(&self.coord.node.write_sets(bucket, key), live) == Some(self.coord.node.id)
    }

    fn live(&self) -> HashSet<NodeId> {
        self.live.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl Target for Share {
    async fn prepare(&self) -> Result<()> {
        let calls = self.coord.node.all_nodes().into_iter().map(|n| {
            let node = self.coord.node.clone();
            async move {
                let r = tokio::time::timeout(PING_TIMEOUT, node.call(n, Msg::new(Req::Ping))).await;
                (n, matches!(r, Ok(Ok(_))))
            }
        });
        let mut live: HashSet<NodeId> =
            futures::future::join_all(calls).await.into_iter().filter(|(_, up)| *up).map(|(n, _)| n).collect();
        live.insert(self.coord.node.id);
        if let Ok(mut l) = self.live.lock() {
            *l = live;
        }
        Ok(())
    }

    async fn configured_buckets(&self) -> Result<Vec<(String, Vec<Rule>)>> {
        let all = self.coord.node.replica.buckets().await?;
        Ok(all.into_iter().filter(|(_, m)| !m.rules().is_empty()).map(|(n, m)| (n, m.rules().to_vec())).collect())
    }

    async fn objects(&self, bucket: &str, after: &str, limit: usize) -> Result<Page> {
        let rows = self.coord.node.replica.raw_rows(bucket, after_key(after), limit).await?;
        let live = self.live();
        Ok(page_of(rows, limit, |k| self.mine(&live, bucket, k)))
    }

    async fn expire(&self, bucket: &str, c: &Candidate) -> Result<bool> {
        // Not through the engine's delete, which refuses conditional
        // deletes in degraded mode: this one must go on there (under a
        // lease exclusive among the nodes that reach each other).
        let cond = crate::s3::lifecycle::unchanged(c);
        // In a versioned bucket the expired object gets a delete marker, as in S3.
        let deleted = self.coord.delete_any(bucket, &c.key, None, &cond, true).await;
        crate::s3::lifecycle::expired(deleted.map(|_| ()))
    }

    async fn uploads(&self, bucket: &str, limit: usize) -> Result<Vec<PendingUpload>> {
        let ups = self.coord.node.replica.bucket_uploads(bucket, limit)?;
        let live = self.live();
        Ok(ups
            .into_iter()
            .filter(|(key, _, _)| self.mine(&live, bucket, key.as_bytes()))
            .map(|(key, id, u)| PendingUpload { key, id, initiated_ms: u.initiated_ms })
            .collect())
    }

    async fn abort(&self, bucket: &str, u: &PendingUpload) -> Result<bool> {
        crate::s3::lifecycle::abort(&self.coord, bucket, u).await
    }

    fn metrics(&self) -> &Metrics {
        &self.coord.node.store.metrics
    }
}

/// Starts the lifecycle task of `coord`'s node; it ends when the
/// coordinator is dropped (or the handle is aborted with the node's other
/// background tasks).
pub fn spawn(coord: &Arc<Coordinator>) -> tokio::task::JoinHandle<()> {
    let weak: Weak<Coordinator> = Arc::downgrade(coord);
    let cfg = &coord.node.store.config;
    let interval = Duration::from_secs(cfg.lifecycle_interval_secs);
    let day_ms = i64::try_from(cfg.lifecycle_day_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    tokio::spawn(lifecycle::run(
        move || weak.upgrade().map(|coord| Arc::new(Share { coord, live: Mutex::new(HashSet::new()) })),
        interval,
        day_ms,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_handled_by_the_first_live_node_of_its_current_replica_set() {
        let live = |ids: &[NodeId]| ids.iter().copied().collect::<HashSet<_>>();
        let sets = vec![vec![3, 1, 2], vec![4, 5, 6]];
        assert_eq!(handler(&sets, &live(&[1, 2, 3])), Some(3));
        assert_eq!(handler(&sets, &live(&[1, 2])), Some(1));
        assert_eq!(handler(&sets, &live(&[2, 4])), Some(2));
        // The previous layout's set (during a change) never decides.
        assert_eq!(handler(&sets, &live(&[4, 5])), None);
        assert_eq!(handler(&[], &live(&[1])), None);
    }
}
