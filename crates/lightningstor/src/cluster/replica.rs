//! The replica role of a node: applies what coordinators and repair send
//! (blocks, rows, parts, bucket rows, lifecycle and keyring merges) to the
//! local store and answers reads of it (rows, blocks, uploads, and the hash
//! trees anti-entropy compares). It knows no layout, quorum or peer:
//! [`super::node::Node`] routes the requests of those roles (layout, key
//! leases, status) and hands it the rest.

use super::hlc::Hlc;
use super::metrics::ClusterMetrics;
use super::rpc::{Msg, Req, Resp, UploadState};
use crate::block::{BlockHash, Scrubbed, scrub_one};
use crate::error::{LightningError, Result};
use crate::keys::AuthRow;
use crate::meta::ops;
use crate::meta::types::{BucketMeta, PartMeta, RawEntry, Row, UploadMeta, VersionRow};
use crate::store::{Pins, Store};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Uncommitted upload sessions older than this are dropped (their blocks freed).
const SESSION_TTL: Duration = Duration::from_secs(600);

/// How long blocks freed by an overwrite or a delete stay on disk: a GET
/// that read the old row on some coordinator may still be fetching them
/// (nodes do not pin blocks for each other's reads). A node that stops
/// before then leaves them to the garbage collection at its next start.
const FREED_BLOCK_GRACE: Duration = Duration::from_secs(60);

/// Most keys of a [`Req::RowVersions`] read on the request's task (point
/// reads of cached pages, microseconds each); a larger batch goes to the
/// blocking pool, so it does not hold a runtime thread.
const ROW_READS_INLINE: usize = 32;

/// The replica side of one node.
pub struct Replica {
    store: Arc<Store>,
    hlc: Arc<Hlc>,
    metrics: Arc<ClusterMetrics>,
    /// Blocks received per upload session, pinned until its commit.
    sessions: Mutex<HashMap<u64, (Pins, Instant)>>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").finish_non_exhaustive()
    }
}

impl Replica {
    /// The replica over `store`, observing versions into the node's `hlc`
    /// and counting into its `metrics`.
    pub fn new(store: Arc<Store>, hlc: Arc<Hlc>, metrics: Arc<ClusterMetrics>) -> Self {
        Replica { store, hlc, metrics, sessions: Mutex::new(HashMap::new()) }
    }

    /// Drops upload sessions that never committed.
    pub fn expire_sessions(&self) {
        if let Ok(mut s) = self.sessions.lock() {
            s.retain(|_, (_, t)| t.elapsed() < SESSION_TTL);
        }
    }

    /// Runs `f` on the store on the blocking pool.
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// Digests of the (bucket, key, version) rows this node holds in each
    /// of `partitions` (the request of builds before the hash trees; read
    /// from the trees' index, one partition at a time).
    pub async fn digests(&self, partitions: &[u32]) -> Result<Vec<[u8; 32]>> {
        let mut out = Vec::with_capacity(partitions.len());
        for p in partitions {
            let mut h = blake3::Hasher::new();
            for (b, k, v, t) in self.partition_rows(*p).await? {
                h.update(&(b.len() as u64).to_le_bytes());
                h.update(b.as_bytes());
                h.update(&(k.len() as u64).to_le_bytes());
                h.update(&k);
                h.update(&v.to_le_bytes());
                h.update(&[u8::from(t)]);
            }
            out.push(*h.finalize().as_bytes());
        }
        Ok(out)
    }

    /// The rows of one partition held here (counted as rows read).
    pub async fn partition_rows(&self, partition: u32) -> Result<Vec<VersionRow>> {
        let rows = self.blocking(move |s| s.meta.partition_rows(partition)).await?;
        self.metrics.anti_entropy_rows_read.fetch_add(rows.len() as u64, Ordering::Relaxed);
        Ok(rows)
    }

    /// The hashes of these tree nodes here.
    pub async fn tree_nodes(&self, nodes: Vec<(u32, u16)>) -> Result<Vec<[u8; 32]>> {
        self.blocking(move |s| s.meta.tree_nodes(&nodes)).await
    }

    /// The rows of these tree leaves here (counted as rows read).
    pub async fn leaf_rows(&self, leaves: Vec<(u32, u8)>) -> Result<Vec<VersionRow>> {
        let rows = self.blocking(move |s| s.meta.leaf_rows(&leaves)).await?;
        self.metrics.anti_entropy_rows_read.fetch_add(rows.len() as u64, Ordering::Relaxed);
        Ok(rows)
    }

    // What the node's other roles (coordinator, repair worker, lifecycle
    // share) read and tidy in the local store: they go through these
    // methods, not the store's tables.

    /// This node's row of bucket `name`, if it holds one (a point read).
    pub fn bucket(&self, name: &str) -> Result<Option<BucketMeta>> {
        self.store.meta.get_bucket(name)
    }

    /// When this node deleted bucket `name`, if it remembers the delete.
    pub fn bucket_deleted_ms(&self, name: &str) -> Result<Option<i64>> {
        self.store.meta.bucket_deleted_ms(name)
    }

    /// The bucket rows held here.
    pub async fn buckets(&self) -> Result<Vec<(String, BucketMeta)>> {
        self.blocking(|s| s.meta.list_buckets()).await
    }

    /// The bucket rows held here and the buckets deleted here (with the
    /// time of the delete), read together.
    pub async fn buckets_and_deletes(&self) -> Result<(Vec<(String, BucketMeta)>, Vec<(String, i64)>)> {
        self.blocking(|s| Ok((s.meta.list_buckets()?, s.meta.buckets_gone()?))).await
    }

    /// Every key and grant row held here.
    pub async fn auth_rows(&self) -> Result<Vec<AuthRow>> {
        self.blocking(|s| s.meta.auth_rows()).await
    }

    /// This node's row of a key, if any (a point read).
    pub fn row(&self, bucket: &str, key: &[u8]) -> Result<Option<Row>> {
        self.store.meta.get_row(bucket, key)
    }

    /// The versions of a key held here (newest first) and those deleted
    /// for good here.
    pub fn key_versions(&self, bucket: &str, key: &[u8]) -> Result<(Vec<crate::meta::types::Version>, Vec<u64>)> {
        self.store.meta.key_versions(bucket, key)
    }

    /// Every (bucket, key) with versions (or deletes of versions) here.
    pub async fn version_keys(&self) -> Result<Vec<(String, Vec<u8>)>> {
        self.blocking(|s| s.meta.version_keys()).await
    }

    /// Up to `limit` rows of `bucket` after `from`, tombstones included.
    pub async fn raw_rows(&self, bucket: &str, from: Vec<u8>, limit: usize) -> Result<Vec<(Vec<u8>, RawEntry)>> {
        let bucket = bucket.to_owned();
        self.blocking(move |s| s.meta.list_raw(&bucket, &from, b"", limit)).await
    }

    /// (bucket, key, version, tombstone) of every row held here.
    pub async fn all_rows(&self) -> Result<Vec<VersionRow>> {
        self.blocking(|s| s.meta.all_versions()).await
    }

    /// The tombstones older than row version `before`.
    pub async fn old_tombstones(&self, before: u64) -> Result<Vec<(String, Vec<u8>, u64)>> {
        self.blocking(move |s| s.meta.old_tombstones(before)).await
    }

    /// Drops one tombstone, if it is still version `version` of its key.
    pub async fn drop_tombstone(&self, bucket: String, key: Vec<u8>, version: u64) -> Result<()> {
        self.store.meta.write(move |t| ops::drop_tombstone(t, &bucket, &key, version)).await
    }

    /// Up to `limit` uploads of `bucket` in progress here: (key, id, upload).
    pub fn bucket_uploads(&self, bucket: &str, limit: usize) -> Result<Vec<(String, String, UploadMeta)>> {
        self.store.meta.list_uploads(bucket, "", None, None, limit)
    }

    /// The uploads in progress here (id, upload), and the ids of uploads
    /// that ended here before `before_ms` (gone markers due for collection).
    pub async fn uploads_and_old_gone(&self, before_ms: i64) -> Result<(Vec<(String, UploadMeta)>, Vec<String>)> {
        self.blocking(move |s| Ok((s.meta.all_uploads()?, s.meta.gone_uploads("", before_ms)?.1))).await
    }

    /// Forgets the gone marker of upload `id`.
    pub async fn forget_gone_upload(&self, id: String) -> Result<()> {
        self.store.meta.write(move |t| ops::forget_gone_upload(t, &id)).await
    }

    /// Drops upload `id` of `bucket` here (marking it gone) and frees its
    /// parts' blocks.
    pub async fn drop_upload(&self, id: String, bucket: String) -> Result<()> {
        let now = crate::meta::now_ms();
        let freed = self.store.meta.write(move |t| ops::drop_upload(t, &id, &bucket, now)).await?;
        self.store.spawn_delete(freed);
        Ok(())
    }

    /// Every block held here, sorted.
    pub async fn block_list(&self) -> Result<Vec<BlockHash>> {
        let mut list = self.blocking(|s| s.blocks.list()).await?;
        list.sort();
        Ok(list)
    }

    /// Re-hashes block `hash` here ([`scrub_one`]); a corrupt one is
    /// counted in the store's metrics.
    pub async fn scrub(&self, hash: BlockHash) -> Result<Scrubbed> {
        let r = self.blocking(move |s| scrub_one(s.blocks.as_ref(), &hash)).await?;
        if r == Scrubbed::Corrupt {
            self.store.metrics.inc(&self.store.metrics.corrupt_blocks);
        }
        Ok(r)
    }

    /// Serves one replica request; the requests of the node's other roles
    /// are refused with InvalidRequest. `trusted`: the request comes from
    /// this node itself, whose block bytes were hashed by the coordinator a
    /// moment ago (no re-hash).
    pub async fn serve(&self, req: Msg<Req>, trusted: bool) -> Result<Msg<Resp>> {
        let Msg { head, data } = req;
        Ok(match head {
            Req::Ping => Msg::new(Resp::Ok),
            Req::PutBlock { session, hash } => {
                let pins = self.session(session);
                self.put_block(hash, data, Some(pins), false, trusted).await?;
                Msg::new(Resp::Ok)
            }
            Req::RepairBlock { hash } => {
                self.put_block(hash, data, None, true, false).await?;
                ClusterMetrics::inc(&self.metrics.repairs);
                Msg::new(Resp::Ok)
            }
            Req::GetBlock { hash } => {
                let store = self.store.clone();
                let data = self.blocking(move |s| s.blocks.get(&hash)).await;
                if matches!(data, Err(LightningError::CorruptBlock { .. })) {
                    ClusterMetrics::inc(&self.metrics.bad_copies_found);
                    store.metrics.inc(&store.metrics.corrupt_blocks);
                }
                Msg::with_data(Resp::Block, data?)
            }
            Req::MissingBlocks { hashes } => {
                let missing = self
                    .blocking(move |s| {
                        let mut out = Vec::new();
                        for h in hashes {
                            if !s.blocks.contains(&h)? {
                                out.push(h);
                            }
                        }
                        Ok(out)
                    })
                    .await?;
                Msg::new(Resp::Missing(missing))
            }
            Req::Commit { session, bucket, key, row } => {
                self.hlc.observe(row.version());
                let (applied, current) = self.commit(session, bucket, key, row, None).await?;
                Msg::new(Resp::Committed { applied, current })
            }
            Req::CompleteUpload { session, id, bucket, key, row } => {
                self.hlc.observe(row.version());
                let (applied, current) = self.commit(session, bucket, key, row, Some(id)).await?;
                Msg::new(Resp::Committed { applied, current })
            }
            // A point read of a row is a few microseconds of redb on cached
            // pages: read here, as the single-node GET does, rather than
            // paying a hand-off to the blocking pool on every replica.
            Req::GetRow { bucket, key } => {
                let row = self.store.meta.get_row(&bucket, &key)?;
                if let Some(r) = &row {
                    self.hlc.observe(r.version());
                }
                Msg::new(Resp::Row(row))
            }
            Req::RowVersion { bucket, key } => {
                let v = self.store.meta.get_row(&bucket, &key)?.map_or(0, |r| r.version());
                self.hlc.observe(v);
                Msg::new(Resp::Version(v))
            }
            Req::RowVersions { keys } => {
                let versions = if keys.len() <= ROW_READS_INLINE {
                    self.store.meta.get_versions(keys.iter().map(|(b, k)| (b.as_str(), k.as_slice())))?
                } else {
                    self.blocking(move |s| s.meta.get_versions(keys.iter().map(|(b, k)| (b.as_str(), k.as_slice()))))
                        .await?
                };
                self.hlc.observe(versions.iter().copied().max().unwrap_or(0));
                Msg::new(Resp::RowVersions(versions))
            }
            Req::CreateBucket { name, created_ms } => {
                let created = self.store.meta.write(move |t| ops::ensure_bucket(t, &name, created_ms)).await?;
                Msg::new(Resp::Flag(created))
            }
            Req::MergeAuth { rows } => {
                for r in &rows {
                    self.hlc.observe(match r {
                        crate::keys::AuthRow::Key { row, .. } => row.version,
                        crate::keys::AuthRow::Grant { row, .. } => row.version,
                    });
                }
                // Anti-entropy sends the whole keyring every round: only rows
                // newer than those here take a write transaction.
                let here = self.blocking(|s| s.meta.auth_rows()).await?;
                let rows = crate::keys::newer_rows(rows, &here);
                if !rows.is_empty() {
                    self.store.meta.write(move |t| ops::merge_auth(t, &rows)).await?;
                }
                Msg::new(Resp::Ok)
            }
            Req::CreateBucketSince { name, created_ms } => {
                let here = self.store.meta.write(move |t| ops::ensure_bucket_since(t, &name, created_ms)).await?;
                Msg::new(Resp::Flag(here))
            }
            Req::HeadBucket { name } => {
                let b = self.blocking(move |s| s.meta.get_bucket(&name)).await?;
                Msg::new(Resp::Flag(b.is_some()))
            }
            Req::DeleteBucket { name } => {
                let freed = self.store.meta.write(move |t| ops::drop_bucket(t, &name)).await?;
                self.store.spawn_delete(freed);
                Msg::new(Resp::Ok)
            }
            Req::DeleteBucketBefore { name, deleted_ms } => {
                let freed = self.store.meta.write(move |t| ops::drop_bucket_before(t, &name, deleted_ms)).await?;
                let deleted = freed.is_some();
                self.store.spawn_delete(freed.unwrap_or_default());
                Msg::new(Resp::Flag(deleted))
            }
            Req::RecreateBucket { name, created_ms, lifecycle } => {
                if let Some(l) = &lifecycle {
                    self.hlc.observe(l.version);
                }
                self.store.meta.write(move |t| ops::recreate_bucket(t, &name, created_ms, lifecycle.as_ref())).await?;
                Msg::new(Resp::Ok)
            }
            Req::SetLifecycle { bucket, lifecycle } => {
                self.hlc.observe(lifecycle.version);
                self.store.meta.write(move |t| ops::set_lifecycle(t, &bucket, &lifecycle, true)).await?;
                Msg::new(Resp::Ok)
            }
            Req::MergeLifecycles { rows } => {
                for (_, _, l) in &rows {
                    self.hlc.observe(l.version);
                }
                // Sent every round: only configurations newer than the ones
                // here take a write transaction.
                let here = self.blocking(|s| s.meta.list_buckets()).await?;
                let here: std::collections::HashMap<_, _> = here.into_iter().collect();
                let rows: Vec<_> = rows
                    .into_iter()
                    .filter(|(name, created_ms, l)| {
                        here.get(name).is_some_and(|b| {
                            b.created_ms == *created_ms && b.lifecycle.as_ref().is_none_or(|h| h.version < l.version)
                        })
                    })
                    .collect();
                let mut took = 0u64;
                if !rows.is_empty() {
                    took = self
                        .store
                        .meta
                        .write(move |t| {
                            let mut n = 0;
                            for (name, created_ms, l) in &rows {
                                n += u64::from(ops::merge_lifecycle(t, name, *created_ms, l)?);
                            }
                            Ok(n)
                        })
                        .await?;
                }
                Msg::new(Resp::Count(took))
            }
            Req::GetLifecycle { bucket } => {
                let b = self.blocking(move |s| s.meta.get_bucket(&bucket)).await?;
                Msg::new(Resp::Lifecycle(b.and_then(|b| b.lifecycle)))
            }
            Req::ListBuckets => {
                let b = self.blocking(|s| s.meta.list_buckets()).await?;
                Msg::new(Resp::Buckets(b.into_iter().map(|(n, m)| (n, m.created_ms)).collect()))
            }
            Req::ListRaw { bucket, from, prefix, limit } => {
                let rows = self
                    .blocking(move |s| s.meta.list_raw(&bucket, &from, &prefix, limit.clamp(1, 10_000) as usize))
                    .await?;
                Msg::new(Resp::Raw(rows))
            }
            Req::Digests { partitions } => Msg::new(Resp::Digests(self.digests(&partitions).await?)),
            Req::PartitionRows { partition } => Msg::new(Resp::Versions(self.partition_rows(partition).await?)),
            Req::TreeNodes { nodes } => Msg::new(Resp::Digests(self.tree_nodes(nodes).await?)),
            Req::LeafRows { leaves } => Msg::new(Resp::Versions(self.leaf_rows(leaves).await?)),
            Req::CreateUpload { id, upload } => {
                self.store.meta.write(move |t| ops::replica_create_upload(t, &id, &upload)).await?;
                Msg::new(Resp::Ok)
            }
            Req::PutPart { session, id, upload, number, part } => {
                self.put_part(session, id, upload, number, part).await?;
                Msg::new(Resp::Ok)
            }
            Req::GetUpload { id, parts } => {
                let state = self
                    .blocking(move |s| {
                        if s.meta.upload_gone(&id)? {
                            return Ok(UploadState::Gone);
                        }
                        Ok(match s.meta.get_upload(&id)? {
                            None => UploadState::Absent,
                            Some(u) if parts => UploadState::Live(u, s.meta.list_parts(&id, 0, 10_000)?),
                            Some(u) => UploadState::Live(u, Vec::new()),
                        })
                    })
                    .await?;
                Msg::new(Resp::Upload(state))
            }
            Req::DropUpload { id, bucket } => {
                let now = crate::meta::now_ms();
                let freed = self.store.meta.write(move |t| ops::drop_upload(t, &id, &bucket, now)).await?;
                self.store.spawn_delete(freed);
                Msg::new(Resp::Ok)
            }
            Req::ListUploads { bucket, prefix } => {
                let (live, gone) = self
                    .blocking(move |s| {
                        let live = s.meta.list_uploads(&bucket, &prefix, None, None, 10_000)?;
                        let (gone, _) = s.meta.gone_uploads(&bucket, i64::MIN)?;
                        Ok((live, gone))
                    })
                    .await?;
                Msg::new(Resp::Uploads { live, gone })
            }
            Req::SetVersioning { bucket, state, at } => {
                self.hlc.observe(at);
                let (took, freed) = self
                    .store
                    .meta
                    .write(move |t| crate::meta::versions::replica_set_versioning(t, &bucket, state, at))
                    .await?;
                self.free_later(freed);
                Msg::new(Resp::Flag(took))
            }
            Req::KeyVersions { bucket, key } => {
                let (versions, gone) = self.store.meta.key_versions(&bucket, &key)?;
                self.hlc.observe(versions.iter().map(|v| v.version()).chain(gone.iter().copied()).max().unwrap_or(0));
                Msg::new(Resp::KeyVersions { versions, gone })
            }
            Req::VersionEntries { bucket, from, prefix, limit } => {
                let limit = limit.clamp(1, 10_000) as usize;
                let (entries, gone) =
                    self.blocking(move |s| s.meta.version_entries(&bucket, &from, &prefix, limit)).await?;
                Msg::new(Resp::VersionEntries { entries, gone })
            }
            Req::PutMarker { bucket, key, marker } => {
                self.hlc.observe(marker.version);
                let (applied, current, freed) = self
                    .store
                    .meta
                    .write(move |t| crate::meta::versions::replica_marker(t, &bucket, &key, marker))
                    .await?;
                self.free_later(freed);
                Msg::new(Resp::Committed { applied, current })
            }
            Req::DropVersion { bucket, key, id } => {
                let (held, freed) = self
                    .store
                    .meta
                    .write(move |t| {
                        let mut freed = Vec::new();
                        let held = crate::meta::versions::replica_drop(t, &bucket, &key, id, &mut freed)?;
                        Ok((held, freed))
                    })
                    .await?;
                self.free_later(freed);
                Msg::new(Resp::Flag(held))
            }
            Req::Status
            | Req::LockKey { .. }
            | Req::UnlockKey { .. }
            | Req::GetConfig
            | Req::ChangeLayout { .. }
            | Req::Rebalance
            | Req::FinishLayout => {
                return Err(LightningError::InvalidRequest("not a replica request".into()));
            }
        })
    }

    fn session(&self, id: u64) -> Pins {
        let mut s = match self.sessions.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        s.entry(id).or_insert_with(|| (self.store.new_pins(), Instant::now())).0.clone()
    }

    /// Stores a block received from another node, after checking it hashes
    /// to its name. `replace` overwrites a corrupt copy.
    async fn put_block(
        &self,
        hash: BlockHash,
        data: Bytes,
        pins: Option<Pins>,
        replace: bool,
        trusted: bool,
    ) -> Result<()> {
        self.blocking(move |s| {
            if !trusted {
                crate::block::verify(&hash, &data)?;
            }
            if let Some(p) = &pins {
                p.add(hash);
            }
            if replace && s.blocks.contains(&hash)? && s.blocks.get(&hash).is_err() {
                s.blocks.delete(&hash)?;
            }
            s.blocks.put_parts(&hash, &[data])?;
            s.metrics.inc(&s.metrics.blocks_written);
            if replace {
                s.blocks.flush()?;
            }
            Ok(())
        })
        .await
    }

    /// Applies `row` unless the key holds a version at least as new;
    /// returns whether it did and the version the key holds afterwards.
    /// Merges a row whose blocks were sent under `session`; with `upload`,
    /// the row of that completed upload, which goes with it
    /// ([`ops::replica_complete_upload`]).
    async fn commit(
        &self,
        session: u64,
        bucket: String,
        key: Vec<u8>,
        row: Row,
        upload: Option<String>,
    ) -> Result<(bool, u64)> {
        let pins = self.sessions.lock().ok().and_then(|mut s| s.remove(&session)).map(|(p, _)| p);
        let blocks = match &row {
            Row::Object(m) => m.data.blocks().to_vec(),
            Row::Tombstone(_) => Vec::new(),
        };
        // Every block must be here (and stay) before a row may reference it.
        // (Inline rows and tombstones have none: no trip to the blocking pool.)
        let store = self.store.clone();
        let held = if blocks.is_empty() {
            store.pin_existing(&[])?
        } else {
            self.blocking(move |_| store.pin_existing(&blocks)).await?
        };
        let now = crate::meta::now_ms();
        let r = self
            .store
            .meta
            .write(move |t| match &upload {
                None => ops::apply_row(t, &bucket, &key, &row),
                Some(id) => ops::replica_complete_upload(t, id, &bucket, &key, &row, now),
            })
            .await;
        held.release();
        let (applied, current, freed) = r?;
        if let Some(p) = pins {
            p.release();
        }
        self.free_later(freed);
        Ok((applied, current))
    }

    /// Deletes blocks freed by an overwrite or a delete after
    /// [`FREED_BLOCK_GRACE`] (unless a row took them again meanwhile).
    fn free_later(&self, freed: Vec<BlockHash>) {
        if freed.is_empty() {
            return;
        }
        // Weak: a node stopped meanwhile closes its store now and leaves
        // these to the garbage collection at its next start.
        let store = Arc::downgrade(&self.store);
        tokio::spawn(async move {
            tokio::time::sleep(FREED_BLOCK_GRACE).await;
            if let Some(store) = store.upgrade() {
                store.spawn_delete(freed);
            }
        });
    }

    async fn put_part(&self, session: u64, id: String, upload: UploadMeta, number: u32, part: PartMeta) -> Result<()> {
        let pins = self.sessions.lock().ok().and_then(|mut s| s.remove(&session)).map(|(p, _)| p);
        let store = self.store.clone();
        let blocks = part.blocks.clone();
        let held = self.blocking(move |_| store.pin_existing(&blocks)).await?;
        let r = self.store.meta.write(move |t| ops::replica_put_part(t, &id, &upload, number, &part)).await;
        held.release();
        if let Some(p) = pins {
            p.release();
        }
        self.store.spawn_delete(r?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn replica(dir: &std::path::Path) -> (Replica, Arc<Hlc>) {
        let store =
            Store::open(Config { tree_partitions: Some(8), anonymous: true, ..Config::new(dir) }).expect("store");
        let hlc = Arc::new(Hlc::new(1));
        (Replica::new(store, hlc.clone(), Arc::default()), hlc)
    }

    async fn ask(r: &Replica, req: Req) -> Result<Resp> {
        Ok(r.serve(Msg::new(req), false).await?.head)
    }

    /// A replica alone, without a layout, a transport or peers: it keeps
    /// the newer of two rows, moves its clock past what it saw, answers
    /// its tree reads, and refuses the requests of the node's other roles.
    #[tokio::test]
    async fn a_replica_alone_keeps_the_newer_row_and_refuses_the_node_roles_requests() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (r, hlc) = replica(dir.path());
        let v = hlc.now() + 1_000_000;
        let created = ask(&r, Req::CreateBucket { name: "b".into(), created_ms: 5 }).await.expect("create");
        assert_eq!(created, Resp::Flag(true));
        let commit =
            |version| Req::Commit { session: 1, bucket: "b".into(), key: b"k".to_vec(), row: Row::Tombstone(version) };
        let newer = ask(&r, commit(v)).await.expect("commit");
        assert_eq!(newer, Resp::Committed { applied: true, current: v });
        let older = ask(&r, commit(v - 1)).await.expect("commit");
        assert_eq!(older, Resp::Committed { applied: false, current: v });
        assert!(hlc.now() > v, "the clock did not move past a version it saw");
        let row = ask(&r, Req::GetRow { bucket: "b".into(), key: b"k".to_vec() }).await.expect("row");
        assert_eq!(row, Resp::Row(Some(Row::Tombstone(v))));
        let rows = r.partition_rows(crate::cluster::placement::partition_of(8, "b", b"k")).await.expect("rows");
        assert_eq!(rows, vec![("b".to_owned(), b"k".to_vec(), v, true)]);
        for req in [Req::Status, Req::GetConfig, Req::FinishLayout, Req::Rebalance] {
            let e = ask(&r, req).await.expect_err("a node request");
            assert!(matches!(e, LightningError::InvalidRequest(_)), "{e}");
        }
    }

    /// A replica alone keeps every version of a versioned bucket's key it
    /// receives (also one older than its row), keeps one `null` version
    /// (the newest), and neither keeps nor takes again a version deleted for
    /// good; a marker makes the row a tombstone; dropping the bucket drops
    /// its versions.
    #[tokio::test]
    async fn a_replica_keeps_versions_as_a_set_less_those_deleted_for_good() {
        use crate::meta::types::{DeleteMarker, ObjectData, ObjectMeta, Version, Versioned, Versioning};
        let dir = tempfile::tempdir().expect("tempdir");
        let (r, hlc) = replica(dir.path());
        let v = hlc.now() + 1_000_000;
        ask(&r, Req::CreateBucket { name: "b".into(), created_ms: 5 }).await.expect("create");
        let on = ask(&r, Req::SetVersioning { bucket: "b".into(), state: Versioning::Enabled, at: v }).await;
        assert_eq!(on.expect("versioning"), Resp::Flag(true));
        let older = Req::SetVersioning { bucket: "b".into(), state: Versioning::Suspended, at: v - 1 };
        assert_eq!(ask(&r, older).await.expect("older change"), Resp::Flag(false));
        let row = |version, versioned| {
            Row::Object(ObjectMeta {
                version,
                size: 1,
                etag: format!("e{version}"),
                last_modified_ms: 0,
                headers: Default::default(),
                checksum: None,
                parts: Vec::new(),
                data: ObjectData::Inline(vec![1]),
                sse_c: None,
                versioned: Some(versioned),
            })
        };
        let commit = |row| Req::Commit { session: 1, bucket: "b".into(), key: b"k".to_vec(), row };
        let held = |r: Resp| match r {
            Resp::KeyVersions { versions, gone } => (versions.iter().map(Version::version).collect::<Vec<_>>(), gone),
            other => panic!("{other:?}"),
        };
        let read = || Req::KeyVersions { bucket: "b".into(), key: b"k".to_vec() };
        ask(&r, commit(row(v + 2, Versioned::Id))).await.expect("commit");
        // Older than the row: not applied as the row, kept as a version.
        let late = ask(&r, commit(row(v + 1, Versioned::Id))).await.expect("commit");
        assert_eq!(late, Resp::Committed { applied: false, current: v + 2 });
        ask(&r, commit(row(v + 3, Versioned::Null))).await.expect("commit");
        ask(&r, commit(row(v + 5, Versioned::Null))).await.expect("commit");
        ask(&r, commit(row(v + 4, Versioned::Null))).await.expect("an older null");
        // The null version replaced is remembered as deleted.
        assert_eq!(held(ask(&r, read()).await.expect("read")), (vec![v + 5, v + 2, v + 1], vec![v + 3]));
        let drop = Req::DropVersion { bucket: "b".into(), key: b"k".to_vec(), id: v + 1 };
        assert_eq!(ask(&r, drop.clone()).await.expect("drop"), Resp::Flag(true));
        assert_eq!(ask(&r, drop).await.expect("drop again"), Resp::Flag(false));
        ask(&r, commit(row(v + 1, Versioned::Id))).await.expect("the dropped version again");
        assert_eq!(held(ask(&r, read()).await.expect("read")), (vec![v + 5, v + 2], vec![v + 1, v + 3]));
        let marker = DeleteMarker { version: v + 6, last_modified_ms: 0, null: false };
        let put = ask(&r, Req::PutMarker { bucket: "b".into(), key: b"k".to_vec(), marker }).await;
        assert_eq!(put.expect("marker"), Resp::Committed { applied: true, current: v + 6 });
        let got = ask(&r, Req::GetRow { bucket: "b".into(), key: b"k".to_vec() }).await.expect("row");
        assert_eq!(got, Resp::Row(Some(Row::Tombstone(v + 6))));
        assert_eq!(held(ask(&r, read()).await.expect("read")).0, vec![v + 6, v + 5, v + 2]);
        // The coordinator checks a bucket is empty across the replicas; one
        // that drops it drops the versions it holds (it missed their deletes).
        ask(&r, Req::DeleteBucket { name: "b".into() }).await.expect("delete bucket");
        assert_eq!(held(ask(&r, read()).await.expect("read")), (vec![], vec![]));
    }
}
