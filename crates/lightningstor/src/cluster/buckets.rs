//! Bucket rows in a cluster: every node holds every bucket row. Creates and
//! deletes go to all nodes and need a majority (one node in degraded mode);
//! nodes that missed a create get it from the resync queue.

use super::NodeId;
use super::config::Consistency;
use super::node::{ClusterMetrics, Node};
use super::rpc::{Msg, Req, Resp};
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;

impl Node {
    fn need_nodes(&self, total: usize) -> usize {
        match self.consistency() {
            Consistency::Consistent => total / 2 + 1,
            Consistency::Degraded => 1,
        }
    }

    async fn to_all(self: &Arc<Self>, req: Req) -> Vec<(NodeId, Result<Msg<Resp>>)> {
        let calls = self.all_nodes().into_iter().map(|n| {
            let node = self.clone();
            let req = req.clone();
            async move { (n, node.call(n, Msg::new(req)).await) }
        });
        futures::future::join_all(calls).await
    }

    fn majority(&self, ok: usize, total: usize, what: &str) -> Result<()> {
        if ok < self.need_nodes(total) {
            ClusterMetrics::inc(&self.metrics.quorum_failures);
            return Err(LightningError::Unavailable(format!("{what}: only {ok} of {total} nodes answered")));
        }
        Ok(())
    }

    /// Creates a bucket on every node.
    pub async fn create_bucket(self: &Arc<Self>, name: &str) -> Result<()> {
        if self.bucket_exists(name).await? {
            return Err(LightningError::BucketAlreadyExists(name.to_owned()));
        }
        let replies = self.to_all(Req::CreateBucket { name: name.to_owned(), created_ms: now_ms() }).await;
        let total = replies.len();
        let mut ok = 0;
        let mut missed = Vec::new();
        for (n, r) in replies {
            match r {
                Ok(_) => ok += 1,
                Err(_) => missed.push((n, name.to_owned(), Vec::new(), true)),
            }
        }
        self.majority(ok, total, "create bucket")?;
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.resync.add(&missed))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        Ok(())
    }

    /// Whether a bucket exists here or on any reachable node.
    pub async fn bucket_exists(self: &Arc<Self>, name: &str) -> Result<bool> {
        if self.store.meta.get_bucket(name)?.is_some() {
            return Ok(true);
        }
        let replies = self.to_all(Req::HeadBucket { name: name.to_owned() }).await;
        Ok(replies.into_iter().any(|(_, r)| matches!(r, Ok(Msg { head: Resp::Flag(true), .. }))))
    }

    /// NoSuchBucket unless the bucket exists.
    pub async fn require_bucket(self: &Arc<Self>, name: &str) -> Result<()> {
        if self.bucket_exists(name).await? { Ok(()) } else { Err(LightningError::NoSuchBucket(name.to_owned())) }
    }

    /// Deletes an empty bucket everywhere.
    pub async fn delete_bucket(self: &Arc<Self>, name: &str) -> Result<()> {
        self.require_bucket(name).await?;
        let q = crate::listing::ListQuery { max_keys: 1, ..Default::default() };
        let page = self.list(name, q).await?;
        if !page.entries.is_empty() {
            return Err(LightningError::BucketNotEmpty(name.to_owned()));
        }
        let replies = self.to_all(Req::DeleteBucket { name: name.to_owned() }).await;
        let total = replies.len();
        let ok = replies.iter().filter(|(_, r)| r.is_ok()).count();
        self.majority(ok, total, "delete bucket")
    }

    /// Every bucket any reachable node knows, with its creation time.
    pub async fn list_buckets(self: &Arc<Self>) -> Result<Vec<(String, i64)>> {
        let replies = self.to_all(Req::ListBuckets).await;
        let total = replies.len();
        let mut ok = 0;
        let mut all = BTreeMap::new();
        for (_, r) in replies {
            if let Ok(Msg { head: Resp::Buckets(b), .. }) = r {
                ok += 1;
                for (n, t) in b {
                    all.entry(n).or_insert(t);
                }
            }
        }
        self.majority(ok, total, "list buckets")?;
        Ok(all.into_iter().collect())
    }
}
