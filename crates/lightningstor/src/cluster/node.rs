//! A cluster node: its local engine, its view of the layout, and the
//! replica side of every node-to-node request.

use super::NodeId;
use super::config::{ClusterConfig, Consistency};
use super::hlc::Hlc;
use super::placement::{Layout, Replication, partition_of};
use super::resync::Resync;
use super::rpc::{Msg, NodeStatus, Req, Resp, UploadState};
use super::transport::{Handler, Transport};
use crate::block::BlockHash;
use crate::error::{LightningError, Result};
use crate::meta::ops;
use crate::meta::types::{PartMeta, Row, UploadMeta};
use crate::store::{Pins, Store};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
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
    /// reported a newer version (see [`Node::read_row`]).
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

/// One node of a cluster.
pub struct Node {
    /// This node's id.
    pub id: NodeId,
    /// The local engine (this node's replicas).
    pub store: Arc<Store>,
    /// The node-to-node transport.
    pub transport: Arc<dyn Transport>,
    /// The row-version clock.
    pub hlc: Hlc,
    /// Replicas missed during outages, to push later.
    pub resync: Resync,
    /// Replication counters.
    pub metrics: ClusterMetrics,
    config: RwLock<Arc<ClusterConfig>>,
    layout: RwLock<Arc<Layout>>,
    /// Layout before the last change, while data moves (reads ask both).
    previous: RwLock<Option<Arc<Layout>>>,
    sessions: Mutex<HashMap<u64, (Pins, Instant)>>,
    /// Short leases on keys held by conditional writes (see [`super::locks`]).
    pub(crate) locks: super::locks::KeyLocks,
    /// This node, for requests that need an owning handle (rebalance).
    pub(super) me: std::sync::Weak<Node>,
    /// Blocks in memory over all uploads this node coordinates.
    pub(crate) budget: Arc<tokio::sync::Semaphore>,
    /// Turns of the remote replicas a read asks (see [`Node::read_row`]).
    pub(crate) read_turn: std::sync::atomic::AtomicUsize,
    /// Reads' version asks waiting for their replica's next batch.
    pub(crate) version_asks: super::batch::Batches<super::batch::VersionAsk>,
    /// Replicas that answered version asks as unsupported (an older
    /// build): reads ask them for rows for a while.
    pub(crate) old_builds: super::batch::OldBuilds,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Node {
    /// Opens node `name` of `config` over an open store and a transport.
    pub fn new(
        config: ClusterConfig,
        name: &str,
        store: Arc<Store>,
        transport: Arc<dyn Transport>,
    ) -> Result<Arc<Self>> {
        let me = config.node(name)?;
        let id = me.id;
        let resync = Resync::open(&me.data_dir.join("resync.redb"))?;
        let layout = Arc::new(Layout::compute(&config));
        Ok(Arc::new_cyclic(|me| Node {
            me: me.clone(),
            id,
            store,
            transport,
            hlc: Hlc::new(id),
            resync,
            metrics: ClusterMetrics::default(),
            config: RwLock::new(Arc::new(config)),
            layout: RwLock::new(layout),
            previous: RwLock::new(None),
            sessions: Mutex::new(HashMap::new()),
            locks: super::locks::KeyLocks::default(),
            budget: Arc::new(tokio::sync::Semaphore::new(crate::store::BLOCK_BUDGET)),
            read_turn: std::sync::atomic::AtomicUsize::new(0),
            version_asks: super::batch::Batches::new(1),
            old_builds: super::batch::OldBuilds::default(),
        }))
    }

    /// The cluster file this node runs with.
    pub fn config(&self) -> Arc<ClusterConfig> {
        self.config.read().map(|c| c.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The current layout.
    pub fn layout(&self) -> Arc<Layout> {
        self.layout.read().map(|c| c.clone()).unwrap_or_else(|p| p.into_inner().clone())
    }

    /// The layout being moved away from, if a change is in progress.
    pub fn previous_layout(&self) -> Option<Arc<Layout>> {
        self.previous.read().ok().and_then(|p| p.clone())
    }

    /// Switches to a new cluster file (layout change). The old layout stays
    /// readable until [`Node::finish_layout_change`].
    pub fn change_layout(&self, config: ClusterConfig) {
        let old = self.config();
        self.install(&old, self.layout(), config);
    }

    /// Switches from cluster file `old` to `new`, as told by `cluster layout
    /// apply`. Idempotent: a node already running `new` (a node added by
    /// this change, or a repeated apply) keeps or takes `old` as previous.
    pub fn change_layout_from(&self, old: &ClusterConfig, new: ClusterConfig) -> Result<()> {
        let cur = self.layout().version;
        if new.layout_version < cur {
            return Err(LightningError::Config(format!(
                "layout version {} is older than the {cur} this node runs",
                new.layout_version
            )));
        }
        if old.partitions != new.partitions || old.replication_factor != new.replication_factor {
            return Err(LightningError::Config(
                "partitions and replication_factor cannot change in a layout change".into(),
            ));
        }
        if new.layout_version == cur && self.previous_layout().is_some() {
            return Ok(()); // already moving to it
        }
        self.install(old, Arc::new(Layout::compute(old)), new);
        Ok(())
    }

    fn install(&self, old: &ClusterConfig, old_layout: Arc<Layout>, config: ClusterConfig) {
        let new = Arc::new(Layout::compute(&config));
        // Nodes leaving stay reachable while their data moves.
        let mut peers: HashMap<NodeId, std::net::SocketAddr> = old.nodes.iter().map(|n| (n.id, n.rpc)).collect();
        peers.extend(config.nodes.iter().map(|n| (n.id, n.rpc)));
        self.transport.set_peers(peers);
        if let Ok(mut p) = self.previous.write() {
            *p = (old_layout.version != new.version).then_some(old_layout);
        }
        if let Ok(mut l) = self.layout.write() {
            *l = new;
        }
        if let Ok(mut c) = self.config.write() {
            *c = Arc::new(config);
        }
    }

    /// Forgets the previous layout once data has moved.
    pub fn finish_layout_change(&self) {
        if let Ok(mut p) = self.previous.write() {
            *p = None;
        }
    }

    /// The consistency mode.
    pub fn consistency(&self) -> Consistency {
        self.config().consistency
    }

    /// The partition of a key.
    pub fn partition(&self, bucket: &str, key: &[u8]) -> u32 {
        partition_of(self.layout().partitions(), bucket, key)
    }

    /// The replicas of a key under the current layout.
    pub fn replicas(&self, bucket: &str, key: &[u8]) -> Vec<NodeId> {
        let l = self.layout();
        l.nodes_for(partition_of(l.partitions(), bucket, key)).to_vec()
    }

    /// Every node id in the current layout.
    pub fn all_nodes(&self) -> Vec<NodeId> {
        self.config().nodes.iter().map(|n| n.id).collect()
    }

    /// Sends a request to `to` (handled here when `to` is this node).
    pub async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        let r = if to == self.id {
            Ok(self.serve(req, true).await.unwrap_or_else(|e| Msg::new(Resp::Err((&e).into()))))
        } else {
            self.transport.call(to, req).await
        };
        r?.ok()
    }

    /// Drops upload sessions that never committed.
    pub fn expire_sessions(&self) {
        if let Ok(mut s) = self.sessions.lock() {
            s.retain(|_, (_, t)| t.elapsed() < SESSION_TTL);
        }
    }

    async fn blocking<T: Send + 'static>(&self, f: impl FnOnce(&Store) -> Result<T> + Send + 'static) -> Result<T> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// The replica side of every request.
    pub async fn handle_local(&self, req: Msg<Req>) -> Msg<Resp> {
        if let Req::Rebalance = req.head {
            return match self.rebalance().await {
                Ok(n) => Msg::new(Resp::Count(n as u64)),
                Err(e) => Msg::new(Resp::Err((&e).into())),
            };
        }
        match self.serve(req, false).await {
            Ok(m) => m,
            Err(e) => Msg::new(Resp::Err((&e).into())),
        }
    }

    /// `trusted`: the request comes from this node itself, whose block
    /// bytes were hashed by the coordinator a moment ago (no re-hash).
    async fn serve(&self, req: Msg<Req>, trusted: bool) -> Result<Msg<Resp>> {
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
            Req::Status => Msg::new(Resp::Status(self.status().await?)),
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
            Req::LockKey { bucket, key, token, ttl_ms } => {
                Msg::new(Resp::Flag(self.locks.try_lock(bucket, key, token, ttl_ms)))
            }
            Req::UnlockKey { bucket, key, token } => {
                self.locks.unlock(bucket, key, token);
                Msg::new(Resp::Ok)
            }
            Req::GetConfig => Msg::new(Resp::Config(self.config().to_toml())),
            Req::ChangeLayout { old, new } => {
                let (old, new) = (ClusterConfig::from_toml(&old)?, ClusterConfig::from_toml(&new)?);
                self.change_layout_from(&old, new)?;
                Msg::new(Resp::Ok)
            }
            // Answered in `handle_local` (rebalancing calls back into `serve`).
            Req::Rebalance => return Err(LightningError::InvalidRequest("rebalance is a remote request".into())),
            Req::FinishLayout => {
                self.finish_layout_change();
                Msg::new(Resp::Ok)
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
        if !freed.is_empty() {
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
        Ok((applied, current))
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

    async fn rebalance(&self) -> Result<usize> {
        let me = self.me.upgrade().ok_or_else(|| LightningError::Unavailable("node is shutting down".into()))?;
        me.rebalance_round().await
    }

    /// Node health and conditions for `cluster status`.
    pub async fn status(&self) -> Result<NodeStatus> {
        let (blocks, objects, data_dir_fs, host) = self
            .blocking(|s| {
                let (blocks, objects) = s.meta.counts()?;
                Ok((blocks, objects, hostinfo::fs_of(&s.config.data_dir), hostinfo::host()))
            })
            .await?;
        let direct = self.store.blocks.direct_io();
        Ok(NodeStatus {
            layout_version: self.layout().version,
            resync_queue: self.resync.len(),
            objects,
            blocks,
            repairs: self.metrics.repairs.load(Ordering::Relaxed),
            corrupt_blocks: self.metrics.bad_copies_found.load(Ordering::Relaxed),
            previous_layout: self.previous_layout().map(|l| l.version),
            data_dir_fs,
            o_direct: direct.o_direct,
            o_direct_fell_back: direct.o_direct_fell_back,
            host,
        })
    }
}

#[async_trait::async_trait]
impl Handler for Node {
    async fn handle(&self, req: Msg<Req>) -> Msg<Resp> {
        self.handle_local(req).await
    }
}
