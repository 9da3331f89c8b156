//! Replicated multipart uploads: the coordinator's side of the upload
//! calls of [`super::engine`] (the S3 requests are parsed and answered in
//! [`crate::s3`], as on a single node).
//!
//! An upload lives on the replica set of its key, like the object it will
//! become: the upload row and each part row are written to every replica
//! and acknowledged after the write quorum, and a part's blocks are sent
//! the same way as a PUT's (pinned under an upload session until the part
//! row references them). Every replica keeps its block reference counts
//! exact with the engine's own `uploads` / `parts` tables.
//!
//! Completing reads the upload from a read quorum (so it sees every
//! acknowledged part), takes for each requested part the copy whose ETag
//! the client names, and commits the object row on every replica, first
//! sending a replica the blocks it lacks (it may have missed a part);
//! the object becomes visible atomically, as any row does. Each replica
//! drops the upload and remembers it as *gone* (`uploads_gone`) in the
//! transaction that commits the object, so a repeated complete (an SDK
//! retrying a lost reply) finds it gone and the object there, and never
//! commits again; a replica that already has it gone refuses the commit,
//! so of two completes (or a complete and an abort) racing, at most one
//! gets a write quorum. A replica that missed the complete, or a late
//! part, can never revive the upload: in a quorum read a `Gone` answer
//! wins over `Live`, and the stale replica is told to drop it (and the
//! periodic sweep finds those no read visits).

use super::NodeId;
use super::coord::Coordinator;
use super::coord::union;
use super::metrics::ClusterMetrics;
use super::rpc::{Msg, Req, Resp, UploadState};
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use crate::meta::types::{PartMeta, Row, UploadMeta};
use std::collections::HashSet;
use std::sync::Arc;

impl Coordinator {
    /// Sends `make(n)` to every node of `targets` and returns those that
    /// accepted it; fails when a write set of (bucket, key) lacks its write
    /// quorum. A replica's NoSuchUpload (or NoSuchBucket: the bucket was
    /// deleted there) is passed on as such.
    pub(super) async fn quorum_call(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        targets: &[NodeId],
        make: impl Fn() -> Req,
    ) -> Result<HashSet<NodeId>> {
        let sets = self.node.write_sets(bucket, key);
        let make = &make;
        let calls = targets.iter().map(|&n| {
            let node = self.clone();
            async move { (n, node.call_write(n, bucket, make).await) }
        });
        let mut ok = HashSet::new();
        let mut gone = None;
        for (n, r) in futures::future::join_all(calls).await {
            match r {
                Ok(_) => {
                    ok.insert(n);
                }
                Err(e @ (LightningError::NoSuchUpload(_) | LightningError::NoSuchBucket(_))) => gone = Some(e),
                Err(e) => tracing::debug!(node = n, error = %e, "replica missed an upload write"),
            }
        }
        for s in &sets {
            let acks = s.iter().filter(|n| ok.contains(n)).count();
            if acks < self.need_w(s.len()) {
                if let Some(e) = gone {
                    return Err(e);
                }
                return Err(self.quorum_failed(&format!(
                    "only {acks} of {} replicas stored the upload change (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        Ok(ok)
    }

    /// Reads upload `id` of (bucket, key) from a read quorum of its
    /// replicas: the upload and (when `parts`) every replica's parts, which
    /// may hold several candidates per part number. NoSuchUpload when any
    /// replica knows it gone or none has it.
    pub async fn upload_state(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        id: &str,
        parts: bool,
    ) -> Result<(UploadMeta, Vec<(u32, PartMeta)>)> {
        let sets = self.node.write_sets(bucket, key.as_bytes());
        let quorum_set = sets.last().cloned().unwrap_or_default();
        let ask = union(&sets);
        let calls = ask.iter().map(|&n| {
            let node = self.clone();
            let req = Req::GetUpload { id: id.to_owned(), parts };
            async move { (n, node.node.call(n, Msg::new(req)).await) }
        });
        let mut replies: Vec<(NodeId, UploadState)> = Vec::new();
        for (n, r) in futures::future::join_all(calls).await {
            if let Ok(Msg { head: Resp::Upload(s), .. }) = r {
                replies.push((n, s));
            }
        }
        let answered = quorum_set.iter().filter(|n| replies.iter().any(|(m, _)| m == *n)).count();
        if answered < self.need_r(quorum_set.len()) {
            return Err(self.quorum_failed(&format!(
                "only {answered} of {} replicas answered for the upload (read quorum {})",
                quorum_set.len(),
                self.need_r(quorum_set.len())
            )));
        }
        let no_such = || LightningError::NoSuchUpload(id.to_owned());
        if replies.iter().any(|(_, s)| *s == UploadState::Gone) {
            // Replicas still holding it missed the drop: repair them.
            for (n, s) in &replies {
                if matches!(s, UploadState::Live(..)) {
                    let (node, n) = (self.clone(), *n);
                    let req = Req::DropUpload { id: id.to_owned(), bucket: bucket.to_owned() };
                    tokio::spawn(async move {
                        if node.node.call(n, Msg::new(req)).await.is_ok() {
                            ClusterMetrics::inc(&node.node.metrics.repairs);
                        }
                    });
                }
            }
            return Err(no_such());
        }
        let mut upload = None;
        let mut all_parts = Vec::new();
        for (_, s) in replies {
            if let UploadState::Live(u, p) = s {
                if u.bucket != bucket || u.key != key {
                    return Err(no_such());
                }
                upload.get_or_insert(u);
                all_parts.extend(p);
            }
        }
        Ok((upload.ok_or_else(no_such)?, all_parts))
    }

    /// Commits `row`, the object of completed upload `id`, on every
    /// replica of (bucket, key), first sending each the blocks it lacks;
    /// each replica drops the upload in the same transaction
    /// ([`Req::CompleteUpload`]), so the upload is gone wherever the object
    /// is, and a repeated complete can never commit it again. Acknowledged
    /// once every write set has W, with the replicas that missed it queued
    /// for resync first. NoSuchUpload when too few replicas took it because
    /// another complete or an abort of the upload got there first. Like
    /// [`Coordinator::commit_row`], once more at a newer version (a plain commit:
    /// the upload is gone) if a replica of the quorum holds a newer row.
    pub async fn commit_completed(self: &Arc<Self>, bucket: &str, key: &[u8], row: &Row, id: &str) -> Result<()> {
        let newest = self.fill_attempt(bucket, key, row, Some(id)).await?;
        if let Some(row) = self.above(newest, row) {
            self.fill_attempt(bucket, key, &row, None).await?;
        }
        Ok(())
    }

    /// One round of [`Coordinator::commit_completed`]; returns the newest version
    /// the acknowledging replicas hold.
    pub(super) async fn fill_attempt(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        row: &Row,
        upload: Option<&str>,
    ) -> Result<u64> {
        let sets = self.node.write_sets(bucket, key);
        let targets = union(&sets);
        let calls = targets.iter().map(|&n| {
            let node = self.clone();
            async move { (n, node.push_row_of(n, bucket, key, row, upload).await) }
        });
        let mut ok = HashSet::new();
        let mut newest = 0;
        let mut refused = None;
        for (n, r) in futures::future::join_all(calls).await {
            match r {
                Ok(current) => {
                    newest = newest.max(current);
                    ok.insert(n);
                }
                Err(e @ (LightningError::NoSuchUpload(_) | LightningError::NoSuchBucket(_))) => refused = Some(e),
                Err(e) => tracing::debug!(node = n, error = %e, "replica missed a completed upload"),
            }
        }
        for s in &sets {
            let acks = s.iter().filter(|n| ok.contains(n)).count();
            if acks < self.need_w(s.len()) {
                if let Some(e) = refused {
                    if matches!(e, LightningError::NoSuchBucket(_)) {
                        self.undo_commit(bucket, key, row, &ok).await;
                    }
                    return Err(e);
                }
                return Err(self.quorum_failed(&format!(
                    "only {acks} of {} replicas committed the object (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        let missed: Vec<(NodeId, String, Vec<u8>, bool)> =
            targets.iter().filter(|n| !ok.contains(n)).map(|&n| (n, bucket.to_owned(), key.to_vec(), false)).collect();
        if !missed.is_empty() {
            ClusterMetrics::inc(&self.node.metrics.degraded_writes);
            let node = self.clone();
            tokio::task::spawn_blocking(move || node.node.resync.add(&missed))
                .await
                .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        }
        Ok(newest)
    }

    /// Drops this node's uploads that another replica knows are gone (a
    /// drop this node missed), and forgets gone markers older than the
    /// tombstone delay. Returns the uploads dropped.
    pub async fn sweep_uploads(self: &Arc<Self>) -> Result<usize> {
        let keep_ms = i64::try_from(self.node.config().tombstone_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        let before = now_ms().saturating_sub(keep_ms);
        let (live, old) = self.node.replica.uploads_and_old_gone(before).await?;
        for id in old {
            self.node.replica.forget_gone_upload(id).await?;
        }
        let mut dropped = 0;
        for (id, u) in live {
            let peers: Vec<NodeId> = union(&self.node.write_sets(&u.bucket, u.key.as_bytes()))
                .into_iter()
                .filter(|n| *n != self.node.id)
                .collect();
            for n in peers {
                let req = Req::GetUpload { id: id.clone(), parts: false };
                if let Ok(Msg { head: Resp::Upload(UploadState::Gone), .. }) = self.node.call(n, Msg::new(req)).await {
                    self.node.replica.drop_upload(id.clone(), u.bucket.clone()).await?;
                    ClusterMetrics::inc(&self.node.metrics.repairs);
                    dropped += 1;
                    break;
                }
            }
        }
        Ok(dropped)
    }
}
