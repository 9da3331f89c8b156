//! Bucket rows in a cluster: every node holds every bucket row. Creates and
//! deletes go to all nodes and need a majority (one node in degraded mode);
//! nodes that missed a create get it from the resync queue.
//!
//! The keyring (access keys and grants, [`crate::keys`]) goes the same way:
//! every node holds every row, a change goes to all nodes and needs a
//! majority, and a node that missed it gets the whole keyring from the
//! resync queue (rows are versioned by the HLC, the newer wins, deletes are
//! tombstones). Requests are authorized from the local rows, so a node that
//! was down during a change applies it once its resync entry runs.

use super::NodeId;
use super::config::Consistency;
use super::coord::Coordinator;
use super::metrics::ClusterMetrics;
use super::rpc::{Msg, Req, Resp};
use crate::error::{LightningError, Result};
use crate::keys::{AuthRow, KeyMeta, Keyring, Perms};
use crate::lifecycle::Lifecycle;
use crate::meta::now_ms;
use std::collections::BTreeMap;
use std::sync::Arc;

impl Coordinator {
    fn need_nodes(&self, total: usize) -> usize {
        match self.node.consistency() {
            Consistency::Consistent => total / 2 + 1,
            Consistency::Degraded => 1,
        }
    }

    async fn to_all(self: &Arc<Self>, req: Req) -> Vec<(NodeId, Result<Msg<Resp>>)> {
        let calls = self.node.all_nodes().into_iter().map(|n| {
            let node = self.clone();
            let req = req.clone();
            async move { (n, node.node.call(n, Msg::new(req)).await) }
        });
        futures::future::join_all(calls).await
    }

    fn majority(&self, ok: usize, total: usize, what: &str) -> Result<()> {
        if ok < self.need_nodes(total) {
            ClusterMetrics::inc(&self.node.metrics.quorum_failures);
            return Err(LightningError::Unavailable(format!("{what}: only {ok} of {total} nodes answered")));
        }
        Ok(())
    }

    /// Sends `make()`, a write into `bucket`, to node `n`. A node that
    /// refuses it with NoSuchBucket because it remembers deleting the
    /// bucket may have missed the bucket's create since (it was down, and
    /// the create's resync entry has not reached it: the node holding it
    /// may be down now). It gets the bucket, with the creation time of the
    /// row this node holds ([`Req::CreateBucketSince`], which it refuses
    /// when its delete is the later: a write racing the delete brings
    /// nothing back), and the write once more.
    pub(super) async fn call_write(
        self: &Arc<Self>,
        n: NodeId,
        bucket: &str,
        make: impl Fn() -> Req,
    ) -> Result<Msg<Resp>> {
        let first = self.node.call(n, Msg::new(make())).await;
        if !matches!(first, Err(LightningError::NoSuchBucket(_))) || n == self.node.id {
            return first;
        }
        let Ok(Some(row)) = self.node.replica.bucket(bucket) else { return first };
        if row.created_ms == crate::meta::ops::UNKNOWN_CREATED_MS {
            return first; // a row made here for a write: its time says nothing
        }
        let since = Req::CreateBucketSince { name: bucket.to_owned(), created_ms: row.created_ms };
        if !matches!(self.node.call(n, Msg::new(since)).await, Ok(Msg { head: Resp::Flag(true), .. })) {
            return first;
        }
        tracing::info!(bucket, node = n, "a node that missed the bucket's create after deleting it took it");
        if let Some(lifecycle) = row.lifecycle {
            let set = Req::SetLifecycle { bucket: bucket.to_owned(), lifecycle };
            if let Err(e) = self.node.call(n, Msg::new(set)).await {
                tracing::warn!(bucket, node = n, error = %e, "the bucket's lifecycle configuration did not reach it");
            }
        }
        if let (Some(state), Some(at)) = (row.versioning, row.versioning_at) {
            let set = Req::SetVersioning { bucket: bucket.to_owned(), state, at };
            if let Err(e) = self.node.call(n, Msg::new(set)).await {
                tracing::warn!(bucket, node = n, error = %e, "the bucket's versioning state did not reach it");
            }
        }
        self.node.call(n, Msg::new(make())).await
    }

    /// Sends key and grant rows to every node.
    pub async fn replicate_auth(self: &Arc<Self>, rows: Vec<AuthRow>) -> Result<()> {
        // An empty bucket name in the resync queue stands for the keyring.
        self.to_all_queue_missed(Req::MergeAuth { rows }, "", "change keys").await
    }

    /// Sends `req` to every node and needs a majority; the nodes that
    /// missed it are queued for resync of `bucket` (of the keyring when
    /// empty) before the answer.
    pub(super) async fn to_all_queue_missed(self: &Arc<Self>, req: Req, bucket: &str, what: &str) -> Result<()> {
        let replies = self.to_all(req).await;
        let total = replies.len();
        let ok = replies.iter().filter(|(_, r)| r.is_ok()).count();
        let missed: Vec<_> = replies
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(n, _)| (*n, bucket.to_owned(), Vec::new(), true))
            .collect();
        self.majority(ok, total, what)?;
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.node.resync.add(&missed))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        Ok(())
    }

    /// The creation time of a create coordinated here now: later than a
    /// delete of the bucket this node remembers, should its clock have
    /// stepped back (replicas order a bucket's create and delete by time).
    fn creation_time(&self, name: &str) -> Result<i64> {
        let deleted_here = self.node.replica.bucket_deleted_ms(name)?;
        Ok(deleted_here.map_or_else(now_ms, |d| now_ms().max(d + 1)))
    }

    /// Creates a bucket on every node.
    pub async fn create_bucket(self: &Arc<Self>, name: &str) -> Result<()> {
        if self.bucket_exists(name).await? {
            return Err(LightningError::BucketAlreadyExists(name.to_owned()));
        }
        let created_ms = self.creation_time(name)?;
        let req = Req::CreateBucket { name: name.to_owned(), created_ms };
        self.to_all_queue_missed(req, name, "create bucket").await
    }

    /// Whether a bucket exists here or on any reachable node.
    pub async fn bucket_exists(self: &Arc<Self>, name: &str) -> Result<bool> {
        if self.node.replica.bucket(name)?.is_some() {
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
    ///
    /// Each node refuses the delete while it holds an object row of the
    /// bucket and, once it has deleted it, refuses the rows of writes that
    /// were under way ([`crate::meta::ops::drop_bucket`]). A write that
    /// raced the delete and committed somewhere first makes it fail: the
    /// nodes that had deleted the bucket get it back (with its lifecycle
    /// configuration), and the answer is BucketNotEmpty.
    pub async fn delete_bucket(self: &Arc<Self>, name: &str) -> Result<()> {
        self.require_bucket(name).await?;
        let q = crate::listing::ListQuery { max_keys: 1, ..Default::default() };
        let page = self.list(name, q.clone()).await?;
        if !page.entries.is_empty() {
            return Err(LightningError::BucketNotEmpty(name.to_owned()));
        }
        // Nor may it hold versions or delete markers (asked whatever this
        // node holds of the versioning state: it may have missed a change).
        let q = crate::versioning::VersionQuery { list: q, ..Default::default() };
        if !self.list_bucket_versions(name, q).await?.items.is_empty() {
            return Err(LightningError::BucketNotEmpty(name.to_owned()));
        }
        // What the nodes that delete it get back should another refuse.
        let row = self.node.replica.bucket(name)?;
        let replies = self.to_all(Req::DeleteBucket { name: name.to_owned() }).await;
        let total = replies.len();
        let ok = replies.iter().filter(|(_, r)| r.is_ok()).count();
        if replies.iter().any(|(_, r)| matches!(r, Err(LightningError::BucketNotEmpty(_)))) {
            let deleted: Vec<NodeId> = replies.iter().filter(|(_, r)| r.is_ok()).map(|(n, _)| *n).collect();
            self.undo_delete_bucket(name, row, &deleted).await?;
            return Err(LightningError::BucketNotEmpty(name.to_owned()));
        }
        self.majority(ok, total, "delete bucket")?;
        // A node that missed the delete (down, cut off) would keep the
        // bucket, answer HeadBucket and ListBuckets with it, and so bring
        // it back for every node: the resync queue takes the delete to it
        // ([`Coordinator::resync_bucket`]).
        let missed: Vec<_> =
            replies.iter().filter(|(_, r)| r.is_err()).map(|(n, _)| (*n, name.to_owned(), Vec::new(), true)).collect();
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.node.resync.add(&missed))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// The resync of bucket `name`'s row to node `to`: the row this node
    /// holds (with its lifecycle configuration), or the bucket's delete
    /// when this node deleted it. Both carry their time, as the entry may
    /// run long after them: the create is the row's own creation time,
    /// which a node that deleted the bucket since refuses
    /// ([`Req::CreateBucketSince`]: the delete stands, and the row here is
    /// the stale one), and the delete is this node's time of deleting it,
    /// which a node whose row was created since refuses
    /// ([`Req::DeleteBucketBefore`]). A node of an older build, which knows
    /// neither, gets the plain create and delete. A node that holds an
    /// object row of the bucket refuses the delete (BucketNotEmpty: a
    /// write it took raced the delete) and keeps the bucket; that ends the
    /// entry.
    pub(super) async fn resync_bucket(self: &Arc<Self>, to: NodeId, name: &str) -> Result<()> {
        if let Some(row) = self.node.replica.bucket(name)? {
            let since = Req::CreateBucketSince { name: name.to_owned(), created_ms: row.created_ms };
            let here = match self.node.call(to, Msg::new(since)).await {
                Ok(Msg { head: Resp::Flag(here), .. }) => here,
                Ok(other) => {
                    return Err(LightningError::Unavailable(format!(
                        "unexpected answer to CreateBucketSince: {:?}",
                        other.head
                    )));
                }
                Err(LightningError::UnsupportedRequest(_)) => {
                    let create = Req::CreateBucket { name: name.to_owned(), created_ms: row.created_ms };
                    self.node.call(to, Msg::new(create)).await?;
                    true
                }
                Err(e) => return Err(e),
            };
            if !here {
                tracing::warn!(
                    bucket = name,
                    node = to,
                    created_ms = row.created_ms,
                    "a node deleted the bucket after this node's row was created; the create is not resent"
                );
                return Ok(());
            }
            if let Some(lifecycle) = row.lifecycle {
                self.node.call(to, Msg::new(Req::SetLifecycle { bucket: name.to_owned(), lifecycle })).await?;
            }
            if let (Some(state), Some(at)) = (row.versioning, row.versioning_at) {
                let set = Req::SetVersioning { bucket: name.to_owned(), state, at };
                self.node.call(to, Msg::new(set)).await?;
            }
            return Ok(());
        }
        let Some(deleted_ms) = self.node.replica.bucket_deleted_ms(name)? else {
            return Ok(());
        };
        let late = Req::DeleteBucketBefore { name: name.to_owned(), deleted_ms };
        let r = match self.node.call(to, Msg::new(late)).await {
            Err(LightningError::UnsupportedRequest(_)) => {
                self.node.call(to, Msg::new(Req::DeleteBucket { name: name.to_owned() })).await.map(|_| true)
            }
            Ok(Msg { head: Resp::Flag(deleted), .. }) => Ok(deleted),
            Ok(other) => {
                Err(LightningError::Unavailable(format!("unexpected answer to DeleteBucketBefore: {:?}", other.head)))
            }
            Err(e) => Err(e),
        };
        match r {
            Ok(true) => Ok(()),
            Ok(false) => {
                tracing::info!(
                    bucket = name,
                    node = to,
                    "a node created the bucket again after this node deleted it; it keeps it"
                );
                Ok(())
            }
            Err(LightningError::BucketNotEmpty(_)) => {
                tracing::warn!(
                    bucket = name,
                    node = to,
                    "a node that missed the bucket's delete holds an object of it and keeps it"
                );
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Anti-entropy of the rows every node holds, bucket rows and the
    /// keyring. Bucket rows: compares this node's bucket rows and
    /// deleted buckets with each peer's bucket list and sends the peer
    /// what it lacks, timed as the resync queue's entries are: a row it
    /// lacks or holds older ([`Req::CreateBucketSince`], refused if it
    /// deleted the bucket since) and a delete of a bucket whose row it
    /// holds from before the delete ([`Req::DeleteBucketBefore`]). What the
    /// peer knows newer, it sends here in its own round. The keyring: every
    /// key and grant row goes to every peer ([`Req::MergeAuth`]; a peer
    /// keeps the newer version of each). Lifecycle configurations: every
    /// configuration of a bucket row of known creation time goes to every
    /// peer ([`Req::MergeLifecycles`]; a peer takes a newer one for the same
    /// incarnation of the bucket, an empty one being a delete). This
    /// repairs what a resync queue would have, had its node not died (or
    /// cleared it) before its entries ran. Per peer and round: one bucket
    /// listing, one message of the keyring and one of the lifecycle
    /// configurations (all small). Returns the bucket rows, deletes and
    /// configurations peers took.
    pub async fn shared_rows_round(self: &Arc<Self>) -> Result<usize> {
        let (rows, gone) = self.node.replica.buckets_and_deletes().await?;
        let auth = self.node.replica.auth_rows().await?;
        let lifecycles: Vec<(String, i64, Lifecycle)> = rows
            .iter()
            .filter(|(_, b)| b.created_ms != crate::meta::ops::UNKNOWN_CREATED_MS)
            .filter_map(|(name, b)| Some((name.clone(), b.created_ms, b.lifecycle.clone()?)))
            .collect();
        let mut sent = 0;
        for peer in self.node.all_nodes().into_iter().filter(|n| *n != self.node.id) {
            if !auth.is_empty()
                && let Err(e) = self.node.call(peer, Msg::new(Req::MergeAuth { rows: auth.clone() })).await
            {
                tracing::debug!(node = peer, error = %e, "anti-entropy: the keyring did not reach a node");
            }
            if !lifecycles.is_empty() {
                match self.node.call(peer, Msg::new(Req::MergeLifecycles { rows: lifecycles.clone() })).await {
                    Ok(Msg { head: Resp::Count(took), .. }) if took > 0 => {
                        sent += took as usize;
                        tracing::info!(node = peer, took, "anti-entropy: a node lacked lifecycle configurations");
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(node = peer, error = %e, "anti-entropy: lifecycle configurations did not reach a node");
                    }
                }
            }
            // Versioning states: a node takes only a newer change (few
            // buckets have one; one request each).
            for (name, row) in &rows {
                let (Some(state), Some(at)) = (row.versioning, row.versioning_at) else { continue };
                let set = Req::SetVersioning { bucket: name.clone(), state, at };
                match self.node.call(peer, Msg::new(set)).await {
                    Ok(Msg { head: Resp::Flag(true), .. }) => {
                        sent += 1;
                        tracing::info!(bucket = %name, node = peer, "anti-entropy: a node missed a versioning change");
                    }
                    Ok(_) | Err(LightningError::NoSuchBucket(_)) => {}
                    Err(LightningError::UnsupportedRequest(_)) => break,
                    Err(e) => {
                        tracing::debug!(bucket = %name, node = peer, error = %e, "anti-entropy: a versioning state did not reach a node");
                    }
                }
            }
            let theirs: BTreeMap<String, i64> = match self.node.call(peer, Msg::new(Req::ListBuckets)).await {
                Ok(Msg { head: Resp::Buckets(b), .. }) => b.into_iter().collect(),
                Ok(_) | Err(_) => continue,
            };
            for (name, row) in &rows {
                let unknown = row.created_ms == crate::meta::ops::UNKNOWN_CREATED_MS;
                if unknown || theirs.get(name).is_some_and(|c| *c >= row.created_ms) {
                    continue;
                }
                let since = Req::CreateBucketSince { name: name.clone(), created_ms: row.created_ms };
                match self.node.call(peer, Msg::new(since)).await {
                    Ok(Msg { head: Resp::Flag(true), .. }) => {
                        sent += 1;
                        tracing::info!(bucket = %name, node = peer, "anti-entropy: a node lacked the bucket's row");
                        if let Some(lifecycle) = row.lifecycle.clone() {
                            let set = Req::SetLifecycle { bucket: name.clone(), lifecycle };
                            if let Err(e) = self.node.call(peer, Msg::new(set)).await {
                                tracing::debug!(bucket = %name, node = peer, error = %e, "anti-entropy: a lifecycle configuration did not reach a node");
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(LightningError::UnsupportedRequest(_)) => break,
                    Err(e) => {
                        tracing::debug!(bucket = %name, node = peer, error = %e, "anti-entropy: a bucket row did not reach a node");
                    }
                }
            }
            for (name, deleted_ms) in &gone {
                if theirs.get(name).is_none_or(|c| c > deleted_ms) {
                    continue;
                }
                let late = Req::DeleteBucketBefore { name: name.clone(), deleted_ms: *deleted_ms };
                match self.node.call(peer, Msg::new(late)).await {
                    Ok(Msg { head: Resp::Flag(true), .. }) => {
                        sent += 1;
                        tracing::info!(bucket = %name, node = peer, "anti-entropy: a node missed the bucket's delete");
                    }
                    Ok(_) | Err(LightningError::BucketNotEmpty(_)) => {}
                    Err(LightningError::UnsupportedRequest(_)) => break,
                    Err(e) => {
                        tracing::debug!(bucket = %name, node = peer, error = %e, "anti-entropy: a bucket's delete did not reach a node");
                    }
                }
            }
        }
        self.node.metrics.repairs.fetch_add(sent as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(sent)
    }

    /// Creates bucket `name` again on every node when a node refused its
    /// delete (the nodes in `deleted` had deleted it), timed now, after the
    /// delete, so that every node's row is newer than any node's memory of
    /// the delete: a node this misses takes it from the resync queue, and a
    /// late delete ([`Req::DeleteBucketBefore`]) or a stale anti-entropy
    /// round leaves it. [`Req::RecreateBucket`] keeps a node's own
    /// configuration and sends the newest lifecycle configuration any node
    /// answered (the nodes that deleted the bucket lost theirs). A node of
    /// an older build gets the plain create and the configuration.
    async fn undo_delete_bucket(
        self: &Arc<Self>,
        name: &str,
        row: Option<crate::meta::types::BucketMeta>,
        deleted: &[NodeId],
    ) -> Result<()> {
        tracing::info!(bucket = name, nodes = ?deleted, "a node refused the bucket's delete; it is created again");
        let created_ms = self.creation_time(name)?;
        let mut lifecycle = row.and_then(|b| b.lifecycle);
        for (_, r) in self.to_all(Req::GetLifecycle { bucket: name.to_owned() }).await {
            if let Ok(Msg { head: Resp::Lifecycle(Some(l)), .. }) = r
                && lifecycle.as_ref().is_none_or(|have| have.version < l.version)
            {
                lifecycle = Some(l);
            }
        }
        let all = self.node.all_nodes();
        let calls = all.iter().map(|&n| {
            let node = self.clone();
            let lifecycle = lifecycle.clone();
            let again = Req::RecreateBucket { name: name.to_owned(), created_ms, lifecycle: lifecycle.clone() };
            async move {
                match node.node.call(n, Msg::new(again)).await {
                    Err(LightningError::UnsupportedRequest(_)) => {
                        node.node.call(n, Msg::new(Req::CreateBucket { name: name.to_owned(), created_ms })).await?;
                        if let Some(lifecycle) = lifecycle {
                            node.node
                                .call(n, Msg::new(Req::SetLifecycle { bucket: name.to_owned(), lifecycle }))
                                .await?;
                        }
                        Ok(())
                    }
                    r => r.map(drop),
                }
            }
        });
        let mut missed = Vec::new();
        for (n, r) in all.iter().zip(futures::future::join_all(calls).await) {
            if let Err(e) = r {
                tracing::warn!(bucket = name, node = n, error = %e, "a bucket whose delete was refused is queued to come back");
                missed.push((*n, name.to_owned(), Vec::new(), true));
            }
        }
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.node.resync.add(&missed))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// Sends a bucket's lifecycle configuration (an empty one deletes it) to
    /// every node; needs a majority, nodes that missed it get it from the
    /// resync queue with the bucket row.
    pub async fn put_lifecycle(self: &Arc<Self>, bucket: &str, lifecycle: Lifecycle) -> Result<()> {
        self.require_bucket(bucket).await?;
        let req = Req::SetLifecycle { bucket: bucket.to_owned(), lifecycle };
        self.to_all_queue_missed(req, bucket, "put lifecycle configuration").await
    }

    /// The newest lifecycle configuration of `bucket` among a majority of nodes.
    pub async fn get_lifecycle(self: &Arc<Self>, bucket: &str) -> Result<Option<Lifecycle>> {
        self.require_bucket(bucket).await?;
        let replies = self.to_all(Req::GetLifecycle { bucket: bucket.to_owned() }).await;
        let total = replies.len();
        let mut ok = 0;
        let mut newest: Option<Lifecycle> = None;
        for (_, r) in replies {
            if let Ok(Msg { head: Resp::Lifecycle(l), .. }) = r {
                ok += 1;
                if let Some(l) = l
                    && newest.as_ref().is_none_or(|n| l.version > n.version)
                {
                    newest = Some(l);
                }
            }
        }
        self.majority(ok, total, "get lifecycle configuration")?;
        Ok(newest)
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
                    // The newest creation: a node's older row is stale, and
                    // one it made itself has no known time.
                    let e = all.entry(n).or_insert(t);
                    *e = (*e).max(t);
                }
            }
        }
        self.majority(ok, total, "list buckets")?;
        Ok(all.into_iter().collect())
    }
}

/// A cluster node's keyring: reads from its own rows, changes replicated.
#[async_trait::async_trait]
impl Keyring for Coordinator {
    fn key(&self, id: &str) -> Result<Option<KeyMeta>> {
        self.node.store.key(id)
    }

    fn keys(&self) -> Result<Vec<(String, KeyMeta)>> {
        self.node.store.keys()
    }

    fn perms(&self, bucket: &str, id: &str) -> Result<Perms> {
        self.node.store.perms(bucket, id)
    }

    fn grants(&self) -> Result<Vec<(String, String, Perms)>> {
        self.node.store.grants()
    }

    fn next_version(&self) -> u64 {
        self.node.hlc.now()
    }

    async fn bucket_exists(&self, bucket: &str) -> Result<bool> {
        match self.me.upgrade() {
            Some(me) => Coordinator::bucket_exists(&me, bucket).await,
            None => Err(LightningError::Unavailable("the node is shutting down".into())),
        }
    }

    async fn apply(&self, rows: Vec<AuthRow>) -> Result<()> {
        match self.me.upgrade() {
            Some(me) => me.replicate_auth(rows).await,
            None => Err(LightningError::Unavailable("the node is shutting down".into())),
        }
    }
}
