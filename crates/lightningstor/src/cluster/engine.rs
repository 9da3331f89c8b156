//! The cluster coordinator as an [`Engine`]: the S3 front end
//! ([`crate::s3`]) serves a cluster node through it, and each call becomes
//! quorum requests to the replicas of the key ([`super::coord`]), the
//! buckets' rows on every node ([`super::buckets`]), the merged listing
//! ([`super::list`]) or the replicated uploads ([`super::multipart`]).
//!
//! Write conditions (If-Match / If-None-Match, conditional deletes) are
//! checked against a quorum read under the key's lease ([`super::locks`]),
//! and the row gets a version above the one the check saw.

use super::NodeId;
use super::coord::Coordinator;
use super::coord::union;
use super::rpc::{Msg, Req, Resp};
use crate::checksum::ChecksumAlgo;
use crate::conditions::DeleteConditions;
use crate::config::Config;
use crate::engine::{Engine, Staged};
use crate::error::{LightningError, Result};
use crate::keys::Keyring;
use crate::lifecycle::{Lifecycle, Rule};
use crate::listing::{ListPage, ListQuery};
use crate::meta::now_ms;
use crate::meta::ops::{self, Claimed, CompletedPart, Removed, WriteConditions};
use crate::meta::types::{
    ObjectData, ObjectMeta, ObjectSummary, PartMeta, Row, UploadMeta, Version, Versioned, Versioning,
};
use crate::metrics::Metrics;
use crate::versioning::{VersionPage, VersionQuery, VersionRef, version_id};
use bytes::Bytes;
use futures::Stream;
use futures::stream::BoxStream;
use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

/// The blocks of a body staged on the replicas: the upload session they
/// are pinned under there, and the replicas that stored every block.
#[derive(Debug)]
pub struct Session {
    /// Upload session id.
    pub id: u64,
    /// Replicas holding every block.
    pub complete: Vec<NodeId>,
}

/// `row` as a version of a key of a bucket in versioning `state` (untouched
/// in a bucket that never had versioning).
fn tagged(row: ObjectMeta, state: Option<Versioning>) -> ObjectMeta {
    let versioned = match state {
        None => None,
        Some(Versioning::Enabled) => Some(Versioned::Id),
        Some(Versioning::Suspended) => Some(Versioned::Null),
    };
    ObjectMeta { versioned, ..row }
}

impl Coordinator {
    /// If-Match / If-None-Match of a write, checked against a quorum read;
    /// callers hold the key's lease ([`super::locks`]) from this check to the commit.
    async fn check_write_conditions(self: &Arc<Self>, bucket: &str, key: &str, cond: &WriteConditions) -> Result<()> {
        let cur = self.read_row(bucket, key.as_bytes()).await?;
        let etag = match &cur.row {
            Some(Row::Object(m)) => Some(m.etag.as_str()),
            _ => None,
        };
        crate::conditions::check_write(etag, cond.if_match.as_ref(), cond.if_none_match.as_ref(), key)
    }

    /// Writes the tombstone of `key`; a conditional delete checks `cond` against
    /// a quorum read under the key's lease, as a conditional PUT does
    /// (refused in degraded mode unless `even_degraded`, see [`Coordinator::with_key_lease`]).
    pub(super) async fn delete_row(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        cond: &DeleteConditions,
        even_degraded: bool,
    ) -> Result<()> {
        if cond.is_empty() {
            return self.write_row(bucket, key.as_bytes(), Row::Tombstone(self.node.hlc.now())).await;
        }
        let checked_delete = async {
            let cur = self.read_row(bucket, key.as_bytes()).await?;
            let current = match &cur.row {
                Some(Row::Object(m)) => Some((m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))),
                _ => None,
            };
            cond.check(current, key)?;
            // A version above the row the check saw (the read advanced the clock).
            self.write_row(bucket, key.as_bytes(), Row::Tombstone(self.node.hlc.now())).await
        };
        if even_degraded {
            self.with_key_lease_even_degraded(bucket, key.as_bytes(), checked_delete).await
        } else {
            self.with_key_lease(bucket, key.as_bytes(), checked_delete).await
        }
    }
}

impl Coordinator {
    /// A DELETE of (bucket, key), of version `version` when one is named,
    /// if `cond` holds: outside versioned buckets the key's tombstone (only
    /// the `null` version exists there); in a versioned one a delete marker
    /// or the removal of that version ([`super::versions`]).
    pub(super) async fn delete_any(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        version: Option<VersionRef>,
        cond: &DeleteConditions,
        even_degraded: bool,
    ) -> Result<Removed> {
        match (self.bucket_versioning(bucket)?, version) {
            (None, None) => self.delete_row(bucket, key, cond, even_degraded).await.map(|()| Removed::default()),
            (None, Some(VersionRef::Null)) => {
                self.delete_row(bucket, key, cond, even_degraded).await?;
                Ok(Removed { version_id: Some("null".into()), delete_marker: false })
            }
            (None, Some(VersionRef::Id(id))) => {
                cond.check(None, key)?;
                Ok(Removed { version_id: Some(version_id(id, false)), delete_marker: false })
            }
            (Some(state), None) => self.put_delete_marker(bucket, key, state, cond, even_degraded).await,
            (Some(_), Some(v)) => self.delete_version(bucket, key, v, cond).await,
        }
    }
}

impl Engine for Arc<Coordinator> {
    type Hold = Session;
    type Source = Vec<NodeId>;

    fn config(&self) -> &Config {
        &self.node.store.config
    }

    fn metrics(&self) -> &Metrics {
        &self.node.store.metrics
    }

    fn keyring(&self) -> &dyn Keyring {
        &**self
    }

    async fn create_bucket(&self, name: &str) -> Result<()> {
        Coordinator::create_bucket(self, name).await
    }

    async fn require_bucket(&self, name: &str) -> Result<()> {
        Coordinator::require_bucket(self, name).await
    }

    async fn delete_bucket(&self, name: &str) -> Result<()> {
        Coordinator::delete_bucket(self, name).await
    }

    async fn list_buckets(&self) -> Result<Vec<(String, i64)>> {
        Coordinator::list_buckets(self).await
    }

    async fn lifecycle(&self, bucket: &str) -> Result<Vec<Rule>> {
        Ok(self.get_lifecycle(bucket).await?.map(|l| l.rules).unwrap_or_default())
    }

    async fn set_lifecycle(&self, bucket: &str, rules: Vec<Rule>) -> Result<()> {
        // No rules: an empty configuration with a new version replaces the rules everywhere.
        self.put_lifecycle(bucket, Lifecycle { version: self.node.hlc.now(), rules }).await
    }

    async fn get(&self, bucket: &str, key: &str) -> Result<Option<(ObjectMeta, Vec<NodeId>)>> {
        let r = self.read_row(bucket, key.as_bytes()).await?;
        Ok(match r.row {
            Some(Row::Object(m)) => Some((m, r.holders)),
            _ => None,
        })
    }

    fn read(&self, meta: &ObjectMeta, from: Vec<NodeId>, range: Range<u64>) -> BoxStream<'static, Result<Bytes>> {
        self.read_body(meta, range, from)
    }

    async fn stage<S, E>(
        &self,
        bucket: &str,
        key: &str,
        body: S,
        algo: Option<ChecksumAlgo>,
        inline: bool,
    ) -> Result<Staged<Session>>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display + Send,
    {
        let s = Coordinator::stage(self, bucket, key.as_bytes(), body, algo, inline).await?;
        let hold = Session { id: s.session, complete: s.complete };
        Ok(Staged { size: s.size, md5: s.md5, checksum: s.checksum, data: s.data, hold })
    }

    async fn copy_data(
        &self,
        bucket: &str,
        key: &str,
        src: &ObjectMeta,
        from: Vec<NodeId>,
    ) -> Result<(ObjectData, Session)> {
        // The destination may live on other replicas: stream the bytes
        // through the normal write path (blocks deduplicate where they
        // already exist); inline stays inline.
        let inline = matches!(src.data, ObjectData::Inline(_));
        let body = self.read_body(src, 0..src.size, from);
        let s = Coordinator::stage(self, bucket, key.as_bytes(), body, None, inline).await?;
        Ok((s.data, Session { id: s.session, complete: s.complete }))
    }

    async fn commit(
        &self,
        bucket: &str,
        key: &str,
        row: ObjectMeta,
        hold: Session,
        cond: &WriteConditions,
    ) -> Result<ObjectMeta> {
        let state = self.bucket_versioning(bucket)?;
        if cond.if_match.is_none() && cond.if_none_match.is_none() {
            if state.is_some() {
                // A version's id is for good: read first, so it is above every
                // acknowledged write (the read moves the clock past them)
                // and no commit round has to give it a newer one.
                self.read_row(bucket, key.as_bytes()).await?;
            }
            let row = tagged(ObjectMeta { version: self.node.hlc.now(), ..row }, state);
            self.commit_row(bucket, key.as_bytes(), Row::Object(row.clone()), hold.id, &hold.complete).await?;
            return Ok(row);
        }
        self.with_key_lease(bucket, key.as_bytes(), async {
            self.check_write_conditions(bucket, key, cond).await?;
            // A version above the row the check saw (the read advanced the clock).
            let row = tagged(ObjectMeta { version: self.node.hlc.now(), ..row }, state);
            self.commit_row(bucket, key.as_bytes(), Row::Object(row.clone()), hold.id, &hold.complete).await?;
            Ok(row)
        })
        .await
    }

    async fn delete(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionRef>,
        cond: &DeleteConditions,
    ) -> Result<Removed> {
        Coordinator::require_bucket(self, bucket).await?;
        self.delete_any(bucket, key, version, cond, false).await
    }

    async fn delete_many(
        &self,
        bucket: &str,
        keys: Vec<(String, Option<VersionRef>, DeleteConditions)>,
    ) -> Result<Vec<Result<Removed>>> {
        let calls = keys.into_iter().map(|(key, version, cond)| {
            let node = self.clone();
            let bucket = bucket.to_owned();
            async move { node.delete_any(&bucket, &key, version, &cond, false).await }
        });
        Ok(futures::future::join_all(calls).await)
    }

    async fn list(&self, bucket: &str, q: ListQuery) -> Result<ListPage<ObjectSummary>> {
        Coordinator::require_bucket(self, bucket).await?;
        Coordinator::list(self, bucket, q).await
    }

    async fn versioning(&self, bucket: &str) -> Result<Option<Versioning>> {
        Coordinator::require_bucket(self, bucket).await?;
        self.bucket_versioning(bucket)
    }

    async fn set_versioning(&self, bucket: &str, state: Versioning) -> Result<()> {
        self.set_bucket_versioning(bucket, state).await
    }

    async fn get_version(&self, bucket: &str, key: &str, version: VersionRef) -> Result<(ObjectMeta, Vec<NodeId>)> {
        let missing = || LightningError::NoSuchVersion {
            key: key.to_owned(),
            version_id: match version {
                VersionRef::Null => "null".into(),
                VersionRef::Id(id) => version_id(id, false),
            },
        };
        if self.bucket_versioning(bucket)?.is_none() {
            // This node may have missed the bucket's versioning change (the
            // resync queue or anti-entropy brings it): a version the
            // replicas hold is answered all the same.
            let held = self.key_versions(bucket, key.as_bytes()).await?;
            if let Some((Version::Object(m), holders)) =
                held.into_iter().find(|(v, _)| version.names(v.version(), v.is_null()))
            {
                return Ok((m, holders));
            }
            // Outside versioned buckets the current object is the null version.
            return match (version, Engine::get(self, bucket, key).await?) {
                (VersionRef::Null, Some(found)) => Ok(found),
                _ => {
                    Coordinator::require_bucket(self, bucket).await?;
                    Err(missing())
                }
            };
        }
        let versions = self.key_versions(bucket, key.as_bytes()).await?;
        match versions.into_iter().find(|(v, _)| version.names(v.version(), v.is_null())) {
            Some((Version::Object(m), holders)) => Ok((m, holders)),
            Some((v @ Version::Marker(_), _)) => {
                Err(LightningError::DeleteMarker { key: key.to_owned(), version_id: v.id(), named: true })
            }
            None => {
                Coordinator::require_bucket(self, bucket).await?;
                Err(missing())
            }
        }
    }

    async fn latest_marker(&self, bucket: &str, key: &str) -> Result<Option<String>> {
        if self.bucket_versioning(bucket)?.is_none() {
            return Ok(None);
        }
        Ok(match self.key_versions(bucket, key.as_bytes()).await?.first() {
            Some((v @ Version::Marker(_), _)) => Some(v.id()),
            _ => None,
        })
    }

    async fn list_versions(&self, bucket: &str, q: VersionQuery) -> Result<VersionPage> {
        Coordinator::require_bucket(self, bucket).await?;
        self.list_bucket_versions(bucket, q).await
    }

    async fn create_upload(&self, id: &str, upload: UploadMeta) -> Result<()> {
        Coordinator::require_bucket(self, &upload.bucket).await?;
        let targets = union(&self.node.write_sets(&upload.bucket, upload.key.as_bytes()));
        self.quorum_call(&upload.bucket, upload.key.as_bytes(), &targets, || Req::CreateUpload {
            id: id.to_owned(),
            upload: upload.clone(),
        })
        .await?;
        Ok(())
    }

    async fn upload(&self, bucket: &str, key: &str, id: &str) -> Result<UploadMeta> {
        Ok(self.upload_state(bucket, key, id, false).await?.0)
    }

    async fn put_part(&self, id: &str, upload: &UploadMeta, number: u32, part: PartMeta, hold: Session) -> Result<()> {
        let (bucket, key) = (upload.bucket.as_str(), upload.key.as_bytes());
        let targets: Vec<NodeId> =
            union(&self.node.write_sets(bucket, key)).into_iter().filter(|n| hold.complete.contains(n)).collect();
        self.quorum_call(bucket, key, &targets, || Req::PutPart {
            session: hold.id,
            id: id.to_owned(),
            upload: upload.clone(),
            number,
            part: part.clone(),
        })
        .await?;
        Ok(())
    }

    async fn parts(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        after: u32,
        limit: usize,
    ) -> Result<(UploadMeta, Vec<(u32, PartMeta)>)> {
        let (upload, stored) = self.upload_state(bucket, key, id, true).await?;
        // Replicas may differ on a re-uploaded part: the newest copy wins.
        let mut merged: BTreeMap<u32, PartMeta> = BTreeMap::new();
        for (n, p) in stored {
            match merged.get(&n) {
                Some(cur) if (cur.last_modified_ms, cur.etag()) >= (p.last_modified_ms, p.etag()) => {}
                _ => {
                    merged.insert(n, p);
                }
            }
        }
        Ok((upload, merged.into_iter().filter(|(n, _)| *n > after).take(limit).collect()))
    }

    async fn complete_upload(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        wanted: Vec<CompletedPart>,
        claimed: Claimed,
        cond: WriteConditions,
        accept: impl FnOnce(&UploadMeta) -> Result<()> + Send,
    ) -> Result<ObjectMeta> {
        // Every acknowledged part is on a read quorum.
        let (upload, stored) = self.upload_state(bucket, key, id, true).await?;
        accept(&upload)?;
        let state = self.bucket_versioning(bucket)?;
        if state.is_some() {
            // As for a PUT: the version is above every acknowledged write.
            self.read_row(bucket, key.as_bytes()).await?;
        }
        let assemble_and_commit = async {
            let meta = ops::assemble_upload(&upload, &wanted, &stored, self.node.hlc.now(), now_ms())?;
            let meta = tagged(meta, state);
            ops::check_claimed_checksums(&upload, &meta, &claimed)?;
            // The replicas drop the upload in the transaction that commits the object.
            self.commit_completed(bucket, key.as_bytes(), &Row::Object(meta.clone()), id).await?;
            Ok::<_, LightningError>(meta)
        };
        if cond.if_match.is_some() || cond.if_none_match.is_some() {
            self.with_key_lease(bucket, key.as_bytes(), async {
                self.check_write_conditions(bucket, key, &cond).await?;
                assemble_and_commit.await
            })
            .await
        } else {
            assemble_and_commit.await
        }
    }

    async fn abort_upload(&self, bucket: &str, key: &str, id: &str) -> Result<()> {
        // NoSuchUpload unless a quorum read finds it in progress.
        self.upload_state(bucket, key, id, false).await?;
        let targets = union(&self.node.write_sets(bucket, key.as_bytes()));
        self.quorum_call(bucket, key.as_bytes(), &targets, || Req::DropUpload {
            id: id.to_owned(),
            bucket: bucket.to_owned(),
        })
        .await?;
        Ok(())
    }

    async fn uploads(
        &self,
        bucket: &str,
        prefix: &str,
        key_marker: Option<&str>,
        id_marker: Option<&str>,
    ) -> Result<Vec<(String, String, UploadMeta)>> {
        Coordinator::require_bucket(self, bucket).await?;
        let calls = self.node.all_nodes().into_iter().map(|n| {
            let node = self.clone();
            let req = Req::ListUploads { bucket: bucket.to_owned(), prefix: prefix.to_owned() };
            async move { (n, node.node.call(n, Msg::new(req)).await) }
        });
        let mut answered = HashSet::new();
        let mut live: BTreeMap<(String, String), UploadMeta> = BTreeMap::new();
        let mut gone: HashSet<String> = HashSet::new();
        for (n, r) in futures::future::join_all(calls).await {
            if let Ok(Msg { head: Resp::Uploads { live: l, gone: g }, .. }) = r {
                answered.insert(n);
                gone.extend(g);
                for (key, id, u) in l {
                    live.insert((key, id), u);
                }
            }
        }
        self.check_coverage(&answered, "list-multipart-uploads")?;
        Ok(live
            .into_iter()
            .filter(|((key, id), _)| {
                !gone.contains(id)
                    && match (key_marker, id_marker) {
                        (Some(m), Some(um)) => (key.as_str(), id.as_str()) > (m, um),
                        (Some(m), None) => key.as_str() > m,
                        (None, _) => true,
                    }
            })
            .map(|((key, id), u)| (key, id, u))
            .collect())
    }
}
