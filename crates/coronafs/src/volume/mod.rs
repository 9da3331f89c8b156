//! Volumes, snapshots and clones: the control plane over layered backends.
//!
//! [`Volumes`] owns the metadata store ([`meta`]), the layer files
//! ([`files`]) and the open exports ([`export`]), which the NBD server
//! above uses. Every change follows one order so that
//! a crash at any point leaves a state the next start repairs:
//!
//! 1. create new files and fsync them (and the directory);
//! 2. quiesce and flush the volume if the change freezes or replaces its head;
//! 3. commit the new catalog to redb (the commit point);
//! 4. swap the in-memory head, then unlink files no record names.
//!
//! A crash before 3 leaves unnamed files (removed at start); after 3, files
//! of dropped layers (removed at start) or a size not yet applied to a file
//! (fixed when the layer opens). See docs/design/volumes.md.

pub mod autofail;
pub mod catalog;
pub mod copies;
pub mod export;
pub mod failover;
pub mod faults;
pub mod fence;
pub mod files;
pub mod lease;
pub mod meta;
pub mod registry;
pub mod replace;
pub mod replication;

use crate::backend::layered::{Layer, Layered, MAX_DEPTH, map};
use crate::backend::replicated::drl::DrlRecord;
use crate::backend::{AnyBackend, BlockBackend, Opener, pagecache};
use crate::cluster::{ClusterNode, Membership};
use crate::dto::{EvictReport, SnapshotInfo, VolumeInfo};
use crate::error::{CoronaError, Result};
use crate::proto::handshake::{ExportCatalog, ExportDesc};
use crate::util::validate_name;
use catalog::{Catalog, Deletion, LayerRec, SnapRec, VolumeRec, snap_key};
use export::{Export, MAX_BLOCK, PREF_BLOCK};
use meta::Meta;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Largest volume: 1 PiB.
pub const MAX_SIZE: u64 = 1 << 50;

/// How long a fence waits for writes of older epochs still in flight.
pub const FENCE_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The volume manager of one data dir.
#[derive(Debug)]
pub struct Volumes {
    dir: PathBuf,
    opener: Opener,
    read_only: bool,
    meta: Arc<Meta>,
    cat: Mutex<Catalog>,
    /// Serializes changes to the catalog.
    control: tokio::sync::Mutex<()>,
    /// Open exports (`VOL` and `VOL@SNAP`). Kept open until deleted or the
    /// server stops, so map bits are never dropped unflushed.
    open: Mutex<HashMap<String, Arc<Export>>>,
    /// Fault injection at each step of a change (tests; a no-op otherwise).
    pub faults: faults::Faults,
    /// The cluster this server is a node of, once it joined one: replicated
    /// volumes need it to reach their replicas.
    membership: std::sync::OnceLock<Arc<Membership>>,
    /// This manager, for tasks it starts (set by [`Volumes::join`]).
    this: std::sync::OnceLock<std::sync::Weak<Volumes>>,
    /// Where each copy this node holds as a replica is in its primary's
    /// write stream (in memory only: a restart forgets it, see
    /// [`failover`]).
    positions: Mutex<HashMap<String, Arc<failover::Slot>>>,
    /// The task delivering pending deletions of copies runs ([`copies`]).
    delivering: std::sync::atomic::AtomicBool,
    /// This node's member of the volume map ([`registry`]).
    map: std::sync::OnceLock<Arc<crate::replication::map::MapNode>>,
}

fn poisoned() -> CoronaError {
    CoronaError::Io(std::io::Error::other("volume table poisoned"))
}

/// Splits `VOL@SNAP`, validating both names.
pub fn parse_snap(spec: &str) -> Result<(&str, &str)> {
    let (v, s) = spec
        .split_once('@')
        .ok_or_else(|| CoronaError::BadRequest(format!("{spec:?} is not of the form VOLUME@SNAPSHOT")))?;
    validate_name(v)?;
    validate_name(s)?;
    Ok((v, s))
}

fn check_size(size: u64) -> Result<()> {
    if size == 0 || size > MAX_SIZE {
        return Err(CoronaError::InvalidSize { input: size.to_string(), reason: "must be between 1 byte and 1 PiB" });
    }
    Ok(())
}

impl Volumes {
    /// Opens the data dir: the store, adoption of raw files dropped in by
    /// hand, and removal of whatever a crash left unreferenced.
    pub fn load(dir: PathBuf, opener: Opener, read_only: bool) -> Result<Self> {
        std::fs::create_dir_all(dir.join(files::LAYERS_DIR))?;
        let meta = Meta::open(&dir.join("meta.redb"))?;
        let mut cat = meta.load()?;
        let before = cat.clone();
        adopt_raw_files(&dir, &mut cat)?;
        let garbage = cat.collect_garbage();
        if cat != before {
            meta.commit(&before, &cat)?;
        }
        for (id, rec) in &garbage {
            files::remove_layer(&dir, *id, rec);
        }
        let strays = files::remove_strays(&dir, &cat)?;
        if !strays.is_empty() || !garbage.is_empty() {
            tracing::info!(?strays, garbage = garbage.len(), "removed files left by an interrupted change");
        }
        if let Err(e) = cat.check() {
            tracing::error!(error = %e, "metadata refers to a missing layer");
        }
        Ok(Volumes {
            dir,
            opener,
            read_only,
            meta: Arc::new(meta),
            cat: Mutex::new(cat),
            control: tokio::sync::Mutex::new(()),
            open: Mutex::new(HashMap::new()),
            faults: faults::Faults::default(),
            membership: std::sync::OnceLock::new(),
            this: std::sync::OnceLock::new(),
            map: std::sync::OnceLock::new(),
            positions: Mutex::new(HashMap::new()),
            delivering: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Makes this server node `m.node` of a cluster (once; later calls fail).
    pub fn join(self: &Arc<Self>, m: Membership) -> Result<()> {
        let _ = self.this.set(Arc::downgrade(self));
        self.membership.set(Arc::new(m)).map_err(|_| CoronaError::Config("the server already joined a cluster".into()))
    }

    /// Records `peer` as a stale replica of `name` (see [`VolumeRec::stale`]).
    pub async fn mark_stale(&self, name: &str, peer: &str) -> Result<()> {
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let mut cat = old.clone();
        let Some(rec) = cat.volumes.get_mut(name) else { return Ok(()) };
        if !rec.replicas.iter().any(|r| r == peer) || rec.stale.iter().any(|r| r == peer) {
            return Ok(());
        }
        rec.stale.push(peer.to_owned());
        self.commit(&old, cat)?;
        tracing::warn!(volume = name, peer, "replica recorded as stale: it will not be linked again");
        Ok(())
    }

    /// The cluster this server is a node of.
    pub fn membership(&self) -> Option<&Arc<Membership>> {
        self.membership.get()
    }

    pub fn opener(&self) -> &Opener {
        &self.opener
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn catalog(&self) -> Result<Catalog> {
        self.cat.lock().map(|c| c.clone()).map_err(|_| poisoned())
    }

    /// Commits `new` over the current catalog and makes it current.
    fn commit(&self, old: &Catalog, new: Catalog) -> Result<()> {
        self.faults.check("commit catalog")?;
        self.meta.commit(old, &new)?;
        *self.cat.lock().map_err(|_| poisoned())? = new;
        Ok(())
    }

    fn writable(&self) -> Result<()> {
        if self.read_only { Err(CoronaError::ReadOnly("volumes cannot be changed")) } else { Ok(()) }
    }

    /// Serves `backend` as export `name` until the server stops, without
    /// metadata: in-memory volumes for the bench's instruction-count gate
    /// and fault-injecting ones for the server's own tests.
    pub fn insert(&self, name: &str, backend: AnyBackend, read_only: bool) -> Result<Arc<Export>> {
        validate_name(name)?;
        let size = BlockBackend::size(&backend);
        let v = Arc::new(Export::new(name, Layered::new(Layer::base(0, size, backend)), read_only, 0));
        self.open.lock().map_err(|_| poisoned())?.insert(name.to_owned(), v.clone());
        Ok(v)
    }

    /// Opens (or shares the open) export `VOL` or `VOL@SNAP`.
    pub fn open(&self, name: &str) -> Result<Arc<Export>> {
        let mut open = self.open.lock().map_err(|_| poisoned())?;
        if let Some(v) = open.get(name) {
            return Ok(v.clone());
        }
        let cat = self.catalog()?;
        let (layer, ro, epoch) = if name.contains('@') {
            let (v, s) = parse_snap(name)?;
            let rec = cat.snapshots.get(name).ok_or_else(|| CoronaError::SnapshotNotFound(snap_key(v, s)))?;
            (files::open_layer(&self.dir, &self.opener, &cat, rec.layer, false, None, &self.faults)?, true, 0)
        } else {
            validate_name(name)?;
            let rec = cat.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
            let layer =
                files::open_layer(&self.dir, &self.opener, &cat, rec.head, !self.read_only, None, &self.faults)?;
            if !rec.replicas.is_empty() && !self.read_only {
                let local = Arc::new(Layered::new(layer));
                let (backend, handle) = self.replicated(name, rec, local.clone())?;
                let mut e = Export::new(name, Layered::new(Layer::base(0, rec.size, backend)), false, rec.epoch);
                e.replication = Some(handle);
                e.local = Some(local);
                let v = Arc::new(e);
                open.insert(name.to_owned(), v.clone());
                return Ok(v);
            }
            (layer, self.read_only, rec.epoch)
        };
        let v = Arc::new(Export::new(name, Layered::new(layer), ro, epoch));
        open.insert(name.to_owned(), v.clone());
        Ok(v)
    }

    /// Opens the export an NBD client named: `VOL`, `VOL@SNAP` or
    /// `VOL;epoch=N`, with the epoch it declares.
    pub fn open_export(&self, name: &str) -> Result<(Arc<Export>, Option<u64>)> {
        let (base, epoch) = fence::parse_export(name).map_err(CoronaError::BadRequest)?;
        if epoch.is_some() && base.contains('@') {
            return Err(CoronaError::BadRequest(format!(
                "export {name:?}: snapshots are read-only, an epoch applies only to volumes"
            )));
        }
        Ok((self.open(base)?, epoch))
    }

    /// Raises the write epoch of `name` to `epoch` (persisted first), then
    /// waits until no write from an older epoch is in flight. Raising to the
    /// current epoch only waits; lowering it is a conflict.
    ///
    /// On a node holding a replica copy (its record names another primary)
    /// the fence is the primary's to raise: it is forwarded to the
    /// primary's control API and its answer returned, changing nothing
    /// here (a copy's own fence follows its primary's stream and votes).
    pub async fn fence(&self, name: &str, epoch: u64) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.writable()?;
        if let Some(primary) = self.primary_elsewhere(name)? {
            let m = self.membership().cloned().ok_or_else(|| CoronaError::Config("no cluster".into()))?;
            let node = m.cluster.node(&primary)?;
            let api = m.peer_api(node);
            tracing::info!(volume = name, epoch, primary, "fence asked of a replica copy: forwarded to its primary");
            return api.fence(name, epoch).await.map_err(|e| {
                let why = format!("{name} is a replica on {}; its primary {primary} ({}): {e}", m.node, node.api);
                // The primary's refusal keeps its meaning (an epoch going
                // back is a conflict); anything else is a failed hop.
                match e {
                    CoronaError::Api { status: Some(409), .. } => CoronaError::Conflict(why),
                    CoronaError::Api { status: Some(404), .. } => CoronaError::NotFound(why),
                    _ => CoronaError::Replica(why),
                }
            });
        }
        {
            let _g = self.control.lock().await;
            let old = self.catalog()?;
            let rec = old.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
            if epoch < rec.epoch {
                return Err(CoronaError::Conflict(format!(
                    "volume {name:?} is at epoch {}; an epoch never goes back (asked for {epoch})",
                    rec.epoch
                )));
            }
            if epoch > rec.epoch {
                let mut cat = old.clone();
                if let Some(r) = cat.volumes.get_mut(name) {
                    r.epoch = epoch;
                    // The epoch a failover reached is passed: no client of
                    // the old primary may follow to this one.
                    r.promoted_from = None;
                }
                // Durable before any connection is told: a restart keeps it.
                self.commit(&old, cat)?;
            }
        }
        // After the commit, so a volume opened meanwhile read the new epoch.
        let open = self.open.lock().map_err(|_| poisoned())?.get(name).cloned();
        if let Some(v) = open {
            match v.fence.raise(epoch, FENCE_DRAIN_TIMEOUT).await {
                Ok(n) => tracing::info!(volume = name, epoch, drained = n, "volume fenced"),
                Err(left) => {
                    return Err(CoronaError::DrainTimeout { volume: name.to_owned(), epoch, inflight: left });
                }
            }
        } else {
            tracing::info!(volume = name, epoch, "volume fenced (not open)");
        }
        self.replicate_fence(name, epoch).await?;
        self.info(name)
    }

    /// The other node this node's copy of `name` names as its primary, if
    /// it holds a replica copy in a cluster.
    fn primary_elsewhere(&self, name: &str) -> Result<Option<String>> {
        let Some(m) = self.membership() else { return Ok(None) };
        let cat = self.cat.lock().map_err(|_| poisoned())?;
        let rec = cat.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        Ok(rec.primary.clone().filter(|p| rec.replicas.is_empty() && *p != m.node))
    }

    /// After a commit, the open export of `name` could not be brought in
    /// line with the catalog: it is dropped (its connections fail), so the
    /// next open reads the catalog. The change itself is done.
    fn reopen_later(&self, name: &str, e: &CoronaError) {
        tracing::error!(volume = name, error = %e, "cannot reopen the volume after a change; its connections are closed");
        if let Some(v) = self.open.lock().ok().and_then(|mut o| o.remove(name)) {
            v.backend.kill();
        }
    }

    fn connections(&self, name: &str) -> usize {
        self.open.lock().ok().and_then(|o| o.get(name).map(|v| v.connections.load(Ordering::Relaxed))).unwrap_or(0)
    }

    /// Drops open exports (flushing them first); `kill` makes their
    /// connections fail from now on (the volume is gone).
    async fn close(&self, names: &[String], kill: bool) {
        let vols: Vec<Arc<Export>> = match self.open.lock() {
            Ok(mut o) => names.iter().filter_map(|n| o.remove(n)).collect(),
            Err(_) => Vec::new(),
        };
        for v in vols {
            if kill {
                v.backend.kill();
                // No resync or log write for a volume that is gone.
                if let Some(h) = &v.replication {
                    h.abandon().await;
                }
            } else if let Err(e) = v.close().await {
                tracing::warn!(volume = %v.name, error = %e, "flush on close failed");
            }
        }
    }

    /// Drops every open volume without flushing or closing it (a crash, for
    /// tests), once its background tasks stopped.
    #[cfg(any(test, feature = "testing"))]
    pub async fn abandon(&self) {
        let vols: Vec<Arc<Export>> =
            self.open.lock().map(|mut o| o.drain().map(|(_, v)| v).collect()).unwrap_or_default();
        for v in vols {
            if let Some(h) = &v.replication {
                h.abandon().await;
            }
        }
        // Tasks of the dropped exports (a record write in the blocking
        // pool, a connection's helper) let go of the store soon after.
        for _ in 0..500 {
            if Arc::strong_count(&self.meta) == 1 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        tracing::warn!("the metadata store is still held after abandoning the volumes");
    }

    /// Flushes every open volume (server shutdown).
    pub async fn flush_all(&self) {
        let vols: Vec<Arc<Export>> = self.open.lock().map(|o| o.values().cloned().collect()).unwrap_or_default();
        for v in vols {
            if !v.read_only
                && let Err(e) = v.close().await
            {
                tracing::warn!(volume = %v.name, error = %e, "flush at shutdown failed");
            }
        }
    }

    fn allocated(&self, cat: &Catalog, layer: u64) -> u64 {
        cat.layers
            .get(&layer)
            .and_then(|l| std::fs::metadata(self.dir.join(&l.file)).ok())
            .map_or(0, |m| m.blocks() * 512)
    }

    fn volume_info(&self, cat: &Catalog, name: &str) -> Result<VolumeInfo> {
        let v = cat.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        Ok(VolumeInfo {
            name: name.to_owned(),
            size: v.size,
            allocated_bytes: self.allocated(cat, v.head),
            parent: v.origin.clone(),
            snapshots: cat.snapshots_of(name),
            connections: self.connections(name),
            read_only: self.read_only,
            nbd_export: name.to_owned(),
            epoch: v.epoch,
            replicas: v.replicas.clone(),
            stale_replicas: v.stale.clone(),
            replica_states: Vec::new(),
        })
    }

    fn snapshot_info(&self, cat: &Catalog, vol: &str, snap: &str) -> Result<SnapshotInfo> {
        let key = snap_key(vol, snap);
        let s = cat.snapshots.get(&key).ok_or_else(|| CoronaError::SnapshotNotFound(key.clone()))?;
        Ok(SnapshotInfo {
            volume: vol.to_owned(),
            name: snap.to_owned(),
            size: s.size,
            allocated_bytes: self.allocated(cat, s.layer),
            clones: cat.clones_of(&key),
            nbd_export: key,
            missing_on: s.missing.clone(),
        })
    }

    /// Describes one volume.
    pub fn info(&self, name: &str) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.volume_info(&self.catalog()?, name)
    }

    /// All volumes, sorted by name.
    pub fn list(&self) -> Result<Vec<VolumeInfo>> {
        let cat = self.catalog()?;
        cat.volumes.keys().map(|n| self.volume_info(&cat, n)).collect()
    }

    /// Snapshots of a volume, sorted by name.
    pub fn snapshots(&self, vol: &str) -> Result<Vec<SnapshotInfo>> {
        validate_name(vol)?;
        let cat = self.catalog()?;
        if !cat.volumes.contains_key(vol) {
            return Err(CoronaError::NotFound(vol.to_owned()));
        }
        cat.snapshots_of(vol).iter().map(|s| self.snapshot_info(&cat, vol, s)).collect()
    }

    /// Export names for NBD_OPT_LIST.
    pub fn export_names(&self) -> Vec<String> {
        self.catalog().map(|c| c.volumes.keys().chain(c.snapshots.keys()).cloned().collect()).unwrap_or_default()
    }

    /// Creates an empty thin volume.
    pub async fn create(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.create_with(name, size, Vec::new()).await
    }

    /// Creates a volume with `copies` copies: places them
    /// ([`crate::cluster::ClusterFile::place`]), creates a plain volume on
    /// each other node through its control API, then the local one, which
    /// records the others and forwards its writes to them. A failure undoes
    /// the copies already made.
    pub async fn create_replicated(&self, name: &str, size: u64, copies: usize) -> Result<VolumeInfo> {
        if copies <= 1 {
            return self.create(name, size).await;
        }
        validate_name(name)?;
        self.writable()?;
        check_size(size)?;
        let m = self.membership().cloned().ok_or_else(|| {
            CoronaError::BadRequest(format!(
                "{copies} copies asked, but this server is in no cluster (serve with a cluster file)"
            ))
        })?;
        if self.catalog()?.volumes.contains_key(name) {
            return Err(CoronaError::AlreadyExists(name.to_owned()));
        }
        self.no_pending_deletion(name)?;
        let placed: Vec<ClusterNode> = m.cluster.place(&m.node, copies)?.into_iter().cloned().collect();
        self.register(name, placed.iter().map(|n| n.name.clone()).collect(), 0).await?;
        let mut made: Vec<&ClusterNode> = Vec::new();
        let mut failure = None;
        for n in &placed[1..] {
            let api = m.peer_api(n);
            match api.create(name, size).await {
                Ok(_) => made.push(n),
                Err(e) => {
                    failure = Some(CoronaError::Replica(format!("creating the copy of {name} on {}: {e}", n.name)));
                    break;
                }
            }
        }
        let result = match failure {
            Some(e) => Err(e),
            None => self.create_with(name, size, placed[1..].iter().map(|n| n.name.clone()).collect()).await,
        };
        if result.is_err() {
            for n in made {
                let api = m.peer_api(n);
                if let Err(e) = api.delete(name, true).await {
                    tracing::warn!(node = %n.name, volume = name, error = %e, "could not undo a copy");
                }
            }
            self.unregister(name).await;
        } else {
            tracing::info!(volume = name, copies, nodes = ?placed.iter().map(|n| &n.name).collect::<Vec<_>>(), "created replicated volume");
        }
        result
    }

    async fn create_with(&self, name: &str, size: u64, replicas: Vec<String>) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.writable()?;
        check_size(size)?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        if old.volumes.contains_key(name) {
            return Err(CoronaError::AlreadyExists(name.to_owned()));
        }
        let mut cat = old.clone();
        let id = cat.alloc_layer();
        files::create_layer(&self.dir, id, size, false, &self.faults)?;
        let layer = LayerRec { file: files::data_name(id), size, parent: None, parent_limit: 0 };
        cat.layers.insert(id, layer.clone());
        // A new replicated volume starts with every copy in sync (all empty).
        let log = (!replicas.is_empty()).then(|| DrlRecord::fresh(size, &replicas));
        cat.volumes.insert(name.to_owned(), VolumeRec { size, head: id, replicas, ..Default::default() });
        // A volume of the same name deleted before left its position behind.
        self.forget_position(name);
        let r = self.meta.put_drl(name, log.as_ref()).and_then(|()| self.commit(&old, cat));
        if let Err(e) = r {
            files::remove_layer(&self.dir, id, &layer);
            return Err(e);
        }
        tracing::info!(volume = name, size, "created volume");
        self.info(name)
    }

    /// Creates `name` as a copy-on-write clone of `VOL@SNAP`: O(1) whatever
    /// the size. `size` defaults to the snapshot's and may only be larger.
    pub async fn clone_snapshot(&self, name: &str, from: &str, size: Option<u64>) -> Result<VolumeInfo> {
        self.clone_with(name, from, size, Vec::new()).await
    }

    /// [`Volumes::clone_snapshot`], recording `replicas` as the nodes of the
    /// clone's other copies (each made the same way on its node first).
    async fn clone_with(&self, name: &str, from: &str, size: Option<u64>, replicas: Vec<String>) -> Result<VolumeInfo> {
        validate_name(name)?;
        let (v, s) = parse_snap(from)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        if old.volumes.contains_key(name) {
            return Err(CoronaError::AlreadyExists(name.to_owned()));
        }
        let key = snap_key(v, s);
        let snap = old.snapshots.get(&key).ok_or_else(|| CoronaError::SnapshotNotFound(key.clone()))?.clone();
        let size = size.unwrap_or(snap.size);
        check_size(size)?;
        if size < snap.size {
            return Err(CoronaError::BadRequest(format!(
                "a clone cannot be smaller than its snapshot ({size} < {} bytes); clone, then resize with allow_shrink",
                snap.size
            )));
        }
        let depth = old.chain(snap.layer).len();
        if depth + 1 > MAX_DEPTH {
            return Err(CoronaError::Conflict(format!(
                "{key} already sits on {depth} layers (the limit is {MAX_DEPTH}); flatten {v} first"
            )));
        }
        let mut cat = old.clone();
        let id = cat.alloc_layer();
        files::create_layer(&self.dir, id, size, true, &self.faults)?;
        let layer = LayerRec { file: files::data_name(id), size, parent: Some(snap.layer), parent_limit: snap.size };
        cat.layers.insert(id, layer.clone());
        // A replicated clone starts with every copy in sync: each reads the
        // same snapshot through its own O(1) clone.
        let log = (!replicas.is_empty()).then(|| DrlRecord::fresh(size, &replicas));
        cat.volumes.insert(
            name.to_owned(),
            VolumeRec { size, head: id, origin: Some(key.clone()), replicas, ..Default::default() },
        );
        self.forget_position(name);
        if let Err(e) = self.meta.put_drl(name, log.as_ref()).and_then(|()| self.commit(&old, cat)) {
            files::remove_layer(&self.dir, id, &layer);
            return Err(e);
        }
        tracing::info!(volume = name, from = %key, size, "cloned volume");
        self.info(name)
    }

    /// Freezes the volume's head as snapshot `snap` and gives the volume a
    /// fresh empty head on top of it: O(1) plus one flush. On a replicated
    /// volume's primary every live copy takes it at the same point of the
    /// write stream ([`Volumes::snapshot_replicated`]); a replica copy
    /// refuses (its primary takes its snapshots).
    pub async fn snapshot(&self, vol: &str, snap: &str) -> Result<SnapshotInfo> {
        validate_name(vol)?;
        validate_name(snap)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let rec = old.volumes.get(vol).ok_or_else(|| CoronaError::NotFound(vol.to_owned()))?.clone();
        self.not_a_copy(vol, &rec, "snapshots")?;
        let cat = if rec.replicas.is_empty() {
            self.snapshot_plain(&old, vol, snap, &rec).await?
        } else {
            self.snapshot_replicated(&old, vol, snap, &rec).await?
        };
        self.snapshot_info(&cat, vol, snap)
    }

    /// Refuses a snapshot change asked of a copy this node holds for another
    /// node's primary: the copies take snapshots only through its stream.
    fn not_a_copy(&self, vol: &str, rec: &VolumeRec, what: &str) -> Result<()> {
        let me = self.membership().map(|m| m.node.as_str());
        match &rec.primary {
            Some(p) if rec.replicas.is_empty() && Some(p.as_str()) != me => Err(CoronaError::Conflict(format!(
                "{vol} is a copy of a replicated volume whose primary is {p}: ask the primary for {what}"
            ))),
            _ => Ok(()),
        }
    }

    /// Checks that `VOL@SNAP` can be taken (new, chain not too deep).
    fn check_new_snapshot(old: &Catalog, vol: &str, snap: &str, rec: &VolumeRec) -> Result<String> {
        let key = snap_key(vol, snap);
        if old.snapshots.contains_key(&key) {
            return Err(CoronaError::SnapshotExists(key));
        }
        let depth = old.chain(rec.head).len();
        if depth + 1 > MAX_DEPTH {
            return Err(CoronaError::Conflict(format!(
                "{vol} already sits on {depth} layers (the limit is {MAX_DEPTH}); delete snapshots and flatten it first"
            )));
        }
        Ok(key)
    }

    /// The snapshot of a volume served by its own layered backend (an
    /// ordinary volume, or a replica copy applying its primary's frame).
    /// Call holding the control lock; gives the committed catalog.
    async fn snapshot_plain(&self, old: &Catalog, vol: &str, snap: &str, rec: &VolumeRec) -> Result<Catalog> {
        let key = Self::check_new_snapshot(old, vol, snap, rec)?;
        let v = self.open(vol)?;
        let cat = self.freeze_head(&v.backend, old, vol, &key, rec).await?;
        tracing::info!(snapshot = %key, "snapshot taken");
        Ok(cat)
    }

    /// Freezes `layered`'s head as snapshot `key` of `vol` and puts a fresh
    /// head over it: the new layer's file first, then the commit, then the
    /// swap. Gives the committed catalog.
    async fn freeze_head(
        &self,
        layered: &Layered<AnyBackend>,
        old: &Catalog,
        vol: &str,
        key: &str,
        rec: &VolumeRec,
    ) -> Result<Catalog> {
        let mut head = layered.exclusive().await;
        self.faults.check("flush head")?;
        layered.flush_layer(&head).await?;
        let mut cat = old.clone();
        let id = cat.alloc_layer();
        files::create_layer(&self.dir, id, rec.size, true, &self.faults)?;
        let layer =
            LayerRec { file: files::data_name(id), size: rec.size, parent: Some(rec.head), parent_limit: rec.size };
        cat.layers.insert(id, layer);
        cat.snapshots.insert(key.to_owned(), SnapRec { layer: rec.head, size: rec.size, missing: Vec::new() });
        if let Some(r) = cat.volumes.get_mut(vol) {
            r.head = id;
        }
        // Opened before the commit: once the catalog names the new head,
        // nothing may fail before the volume writes to it.
        let new = files::open_layer(&self.dir, &self.opener, &cat, id, true, Some(head.clone()), &self.faults)
            .and_then(|new| self.commit(old, cat.clone()).map(|()| new));
        let new = match new {
            Ok(new) => new,
            Err(e) => {
                files::remove_layer(&self.dir, id, &cat.layers[&id]);
                return Err(e);
            }
        };
        layered.replace(&mut head, Arc::new(new));
        Ok(cat)
    }

    /// The snapshot of a replicated volume on its primary, at one point of
    /// the write stream: writes are held out, every live copy flushes, the
    /// primary freezes its own head and queues a SNAPSHOT frame to every
    /// live replica (both before any later write is numbered), then writes
    /// go on. It stands once `Q` copies (the primary included) took it; the
    /// replicas that did not are dropped from the live set (a failed one)
    /// and recorded as missing it. Below `Q` it is deleted again.
    async fn snapshot_replicated(&self, old: &Catalog, vol: &str, snap: &str, rec: &VolumeRec) -> Result<Catalog> {
        use crate::replica::wire::Body;
        let key = Self::check_new_snapshot(old, vol, snap, rec)?;
        let v = self.open(vol)?;
        let (Some(h), Some(local)) = (v.replication.clone(), v.local.clone()) else {
            return Err(CoronaError::Conflict(format!("{vol} is replicated but not open as its primary here")));
        };
        let refused = |e: std::io::Error| CoronaError::Replica(format!("snapshot {key}: {e}"));
        let gate = h.quiesce().await;
        h.flush_copies().await.map_err(refused)?;
        let cat = self.freeze_head(&local, old, vol, &key, rec).await?;
        let point = match h.send_point(Body::Snapshot { name: snap.to_owned() }).await {
            Ok(p) => p,
            Err(e) => {
                drop(gate);
                self.forget_snapshot(&cat, &key);
                return Err(refused(e));
            }
        };
        drop(gate);
        let took = h.settle(point).await;
        let quorum = h.write_quorum();
        if 1 + took.len() < quorum {
            // Undone on the copies that took it (best effort: those that
            // fail this too keep it) and here.
            if let Ok(p) = h.send_point(Body::DeleteSnapshot { name: snap.to_owned() }).await {
                h.settle(p).await;
            }
            self.forget_snapshot(&cat, &key);
            return Err(CoronaError::Replica(format!(
                "snapshot {key}: taken by {} of the copies, below the write quorum of {quorum}; deleted again",
                1 + took.len()
            )));
        }
        let missing: Vec<String> = h.replicas().await.into_iter().filter(|r| !took.contains(r)).collect();
        tracing::info!(snapshot = %key, ?took, ?missing, "snapshot of a replicated volume taken");
        if missing.is_empty() {
            return Ok(cat);
        }
        let mut with = cat.clone();
        if let Some(s) = with.snapshots.get_mut(&key) {
            s.missing = missing;
        }
        match self.commit(&cat, with.clone()) {
            Ok(()) => Ok(with),
            Err(e) => {
                tracing::error!(snapshot = %key, error = %e, "could not record the copies missing a snapshot");
                Ok(cat)
            }
        }
    }

    /// Drops the record of snapshot `key` just taken (its layer stays, as
    /// the head's parent): the snapshot did not stand.
    fn forget_snapshot(&self, cat: &Catalog, key: &str) {
        let mut without = cat.clone();
        without.snapshots.remove(key);
        if let Err(e) = self.commit(cat, without) {
            tracing::error!(snapshot = key, error = %e, "could not drop a snapshot that did not stand");
        }
    }

    /// A replica copy applies its primary's SNAPSHOT frame. A snapshot of
    /// that name the copy already has is one the primary no longer has (a
    /// deletion or an undone snapshot the copy missed): it is replaced.
    pub async fn snapshot_as_copy(&self, vol: &str, snap: &str) -> Result<()> {
        validate_name(vol)?;
        validate_name(snap)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let mut old = self.catalog()?;
        let rec = old.volumes.get(vol).ok_or_else(|| CoronaError::NotFound(vol.to_owned()))?.clone();
        let key = snap_key(vol, snap);
        if old.snapshots.contains_key(&key) {
            tracing::warn!(snapshot = %key, "replacing a snapshot the primary no longer has");
            self.drop_snapshot(&old, &key, true).await?;
            old = self.catalog()?;
        }
        self.snapshot_plain(&old, vol, snap, &rec).await.map(|_| ())
    }

    /// A replica copy applies its primary's DELETE_SNAPSHOT frame: as a
    /// forced delete, and done if the copy lacks it (it missed it).
    pub async fn delete_snapshot_as_copy(&self, vol: &str, snap: &str) -> Result<()> {
        validate_name(vol)?;
        validate_name(snap)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let key = snap_key(vol, snap);
        if !old.snapshots.contains_key(&key) {
            return Ok(());
        }
        self.drop_snapshot(&old, &key, true).await
    }

    /// Grows (or, with `allow_shrink`, shrinks) a volume. Connected clients
    /// see the new size when they reconnect.
    pub async fn resize(&self, name: &str, size: u64, allow_shrink: bool) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.writable()?;
        check_size(size)?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let rec = old.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?.clone();
        self.not_a_copy(name, &rec, "resizing")?;
        if size < rec.size && !allow_shrink {
            return Err(CoronaError::BadRequest(format!(
                "shrinking {name} from {} to {size} bytes destroys data; pass allow_shrink to do it",
                rec.size
            )));
        }
        if !rec.replicas.is_empty() {
            return self.resize_replicated(&old, name, &rec, size).await;
        }
        let v = self.open(name)?;
        self.resize_layer(&v.backend, &old, name, &rec, size).await?;
        self.info(name)
    }

    /// Sets the size of `layered` (the head of volume `name`, recorded as
    /// `rec` in `old`) to `size`: the head flushed, its files grown, the
    /// commit, then the head swapped for one of the new size. Call holding
    /// the control lock.
    async fn resize_layer(
        &self,
        layered: &Layered<AnyBackend>,
        old: &Catalog,
        name: &str,
        rec: &VolumeRec,
        size: u64,
    ) -> Result<()> {
        let mut head = layered.exclusive().await;
        self.faults.check("flush head")?;
        layered.flush_layer(&head).await?;
        let mut cat = old.clone();
        if let Some(r) = cat.volumes.get_mut(name) {
            r.size = size;
        }
        if let Some(l) = cat.layers.get_mut(&rec.head) {
            l.size = size;
            l.parent_limit = l.parent_limit.min(size);
        }
        if let Some(l) = old.layers.get(&rec.head) {
            files::grow(&self.dir, l, rec.head, size, &self.faults)?;
        }
        self.commit(old, cat.clone())?;
        let parent = head.cow.as_ref().map(|c| c.parent.clone());
        match files::open_layer(&self.dir, &self.opener, &cat, rec.head, true, parent, &self.faults) {
            Ok(new) => layered.replace(&mut head, Arc::new(new)),
            Err(e) => self.reopen_later(name, &e),
        }
        drop(head);
        tracing::info!(volume = name, from = rec.size, to = size, "resized volume");
        Ok(())
    }

    /// Copies every granule the volume does not own from its parents, then
    /// detaches it: the volume no longer depends on any snapshot.
    pub async fn flatten(&self, name: &str) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let rec = old.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?.clone();
        self.not_a_copy(name, &rec, "flattening")?;
        let v = self.open(name)?;
        if let (Some(h), Some(local)) = (v.replication.clone(), v.local.clone()) {
            // The primary's own copy under the replication (the export's
            // outer layer only forwards), then every live copy in the stream.
            self.materialize_all(&local, rec.size).await?;
            self.detach(&local, &old, name, &rec).await?;
            self.flatten_copies(name, &h).await;
            return self.info(name);
        }
        self.materialize_all(&v.backend, rec.size).await?;
        self.detach(&v.backend, &old, name, &rec).await?;
        self.info(name)
    }

    /// Copies every granule `layered` does not own from its parents (the
    /// bytes it shows do not change; writes go on meanwhile).
    async fn materialize_all(&self, layered: &Layered<AnyBackend>, size: u64) -> Result<()> {
        self.faults.check("copy granules")?;
        for g in 0..map::count(size) {
            layered.materialize(g).await?;
        }
        Ok(())
    }

    /// Detaches the head of `layered` (volume `name`, recorded as `rec` in
    /// `old`), which owns every granule now, from its parents: flush,
    /// commit, swap, then the files no layer needs any more go. Call
    /// holding the control lock.
    async fn detach(&self, layered: &Layered<AnyBackend>, old: &Catalog, name: &str, rec: &VolumeRec) -> Result<()> {
        let mut head = layered.exclusive().await;
        self.faults.check("flush head")?;
        layered.flush_layer(&head).await?;
        let mut cat = old.clone();
        if let Some(r) = cat.volumes.get_mut(name) {
            r.origin = None;
        }
        if let Some(l) = cat.layers.get_mut(&rec.head) {
            l.parent = None;
            l.parent_limit = 0;
        }
        let garbage = cat.collect_garbage();
        self.commit(old, cat.clone())?;
        match files::open_layer(&self.dir, &self.opener, &cat, rec.head, true, None, &self.faults) {
            Ok(new) => layered.replace(&mut head, Arc::new(new)),
            Err(e) => self.reopen_later(name, &e),
        }
        drop(head);
        let _ = std::fs::remove_file(files::map_path(&self.dir, rec.head));
        for (id, l) in &garbage {
            files::remove_layer(&self.dir, *id, l);
        }
        tracing::info!(volume = name, freed_layers = garbage.len(), "flattened volume");
        Ok(())
    }

    /// Deletes a volume and its snapshots. Refused while it has connections
    /// or clones unless `force`; clones keep working (the layers they need
    /// stay until nothing needs them). On a replicated volume's primary the
    /// copies on the other nodes are recorded as still to delete in the
    /// same commit, then told ([`copies`]); those that cannot be reached
    /// are told later, and the deletion answers without waiting for them.
    pub async fn delete(&self, name: &str, force: bool) -> Result<()> {
        let replicated = {
            let _g = self.control.lock().await;
            self.delete_locked(name, force).await?
        };
        // Outside the control lock: the copies' nodes take theirs.
        if replicated {
            self.unregister(name).await;
            self.deliver_deletion(name).await;
        }
        Ok(())
    }

    /// [`Volumes::delete`] on this node, holding the control lock; gives
    /// whether copies on other nodes are now to be deleted.
    async fn delete_locked(&self, name: &str, force: bool) -> Result<bool> {
        validate_name(name)?;
        self.writable()?;
        let old = self.catalog()?;
        if !old.volumes.contains_key(name) {
            return Err(CoronaError::NotFound(name.to_owned()));
        }
        let snaps = old.snapshots_of(name);
        let clones: Vec<String> = snaps.iter().flat_map(|s| old.clones_of(&snap_key(name, s))).collect();
        let mut exports: Vec<String> = snaps.iter().map(|s| snap_key(name, s)).collect();
        exports.push(name.to_owned());
        if !force {
            let conns: usize = exports.iter().map(|e| self.connections(e)).sum();
            if conns > 0 {
                return Err(CoronaError::Conflict(format!(
                    "volume {name:?} is in use: {conns} open NBD connection(s); disconnect them or delete with force"
                )));
            }
            if !clones.is_empty() {
                return Err(CoronaError::Conflict(format!(
                    "volume {name:?} has clones ({}); flatten or delete them, or delete with force",
                    clones.join(", ")
                )));
            }
        }
        let mut cat = old.clone();
        let rec = cat.volumes.remove(name).unwrap_or_default();
        for s in &snaps {
            cat.snapshots.remove(&snap_key(name, s));
        }
        let replicated = !rec.replicas.is_empty();
        if replicated {
            cat.deletions.insert(name.to_owned(), Deletion { nodes: rec.replicas.clone(), epoch: rec.epoch });
        }
        let garbage = cat.collect_garbage();
        self.commit(&old, cat)?;
        self.close(&exports, true).await;
        self.forget_position(name);
        if let Err(e) = self.meta.put_drl(name, None) {
            tracing::warn!(volume = name, error = %e, "could not remove the replication record");
        }
        for (id, l) in &garbage {
            files::remove_layer(&self.dir, *id, l);
        }
        tracing::info!(volume = name, force, freed_layers = garbage.len(), "deleted volume");
        Ok(replicated)
    }

    /// Deletes a snapshot; refused while it has clones unless `force`. Its
    /// data stays as long as the volume or a clone reads through it. On a
    /// replicated volume's primary the deletion then goes to every live
    /// copy in the write stream; a copy that fails it leaves the live set.
    pub async fn delete_snapshot(&self, vol: &str, snap: &str, force: bool) -> Result<()> {
        validate_name(vol)?;
        validate_name(snap)?;
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let key = snap_key(vol, snap);
        if !old.snapshots.contains_key(&key) {
            return Err(CoronaError::SnapshotNotFound(key));
        }
        let rec = old.volumes.get(vol).cloned();
        if let Some(rec) = &rec {
            self.not_a_copy(vol, rec, "deleting snapshots")?;
        }
        let clones = old.clones_of(&key);
        if !force {
            if !clones.is_empty() {
                return Err(CoronaError::Conflict(format!(
                    "snapshot {key:?} has clones ({}); flatten them or delete with force",
                    clones.join(", ")
                )));
            }
            if self.connections(&key) > 0 {
                return Err(CoronaError::Conflict(format!(
                    "snapshot {key:?} is exported to NBD clients; delete with force"
                )));
            }
        }
        let replicated = match &rec {
            Some(r) if !r.replicas.is_empty() => self.open(vol)?.replication.clone(),
            _ => None,
        };
        self.drop_snapshot(&old, &key, force).await?;
        if let Some(h) = replicated {
            use crate::replica::wire::Body;
            match h.send_point(Body::DeleteSnapshot { name: snap.to_owned() }).await {
                Ok(p) => {
                    let took = h.settle(p).await;
                    tracing::info!(snapshot = %key, ?took, "snapshot deletion forwarded");
                }
                Err(e) => tracing::warn!(snapshot = %key, error = %e, "snapshot deletion not forwarded"),
            }
        }
        Ok(())
    }

    /// Removes snapshot `key` from the catalog, closes its export and frees
    /// the layers nothing reads any more. Call holding the control lock.
    async fn drop_snapshot(&self, old: &Catalog, key: &str, force: bool) -> Result<()> {
        let mut cat = old.clone();
        cat.snapshots.remove(key);
        let garbage = cat.collect_garbage();
        self.commit(old, cat)?;
        self.close(&[key.to_owned()], true).await;
        for (id, l) in &garbage {
            files::remove_layer(&self.dir, *id, l);
        }
        tracing::info!(snapshot = %key, force, "deleted snapshot");
        Ok(())
    }

    /// Checks that metadata and files agree: every layer a volume or
    /// snapshot needs exists with its files, no layer is unreachable, and
    /// no file under `layers/` is unnamed. Returns what is wrong.
    pub fn verify(&self) -> std::result::Result<(), String> {
        let cat = self.catalog().map_err(|e| e.to_string())?;
        cat.check()?;
        if !cat.garbage().is_empty() {
            return Err(format!("unreachable layers kept: {:?}", cat.garbage()));
        }
        let mut want: Vec<String> = Vec::new();
        for (id, l) in &cat.layers {
            if l.file.starts_with(files::LAYERS_DIR) {
                want.push(l.file.clone());
            } else if !self.dir.join(&l.file).is_file() {
                return Err(format!("layer {id}: {} is missing", l.file));
            }
            if l.parent.is_some() {
                want.push(format!("{}/{id:016x}.map", files::LAYERS_DIR));
            }
        }
        want.sort();
        let mut on_disk: Vec<String> = std::fs::read_dir(self.dir.join(files::LAYERS_DIR))
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok())
            .map(|e| format!("{}/{}", files::LAYERS_DIR, e.file_name().to_string_lossy()))
            .collect();
        on_disk.sort();
        if on_disk != want {
            return Err(format!("files {on_disk:?} but the catalog names {want:?}"));
        }
        Ok(())
    }

    /// Drops every file of `name`'s layer chain from the page cache, so the
    /// next reads come from the disk (the bench's cross-worker read must
    /// not be served from this server's memory). Each file is synced first,
    /// since dirty pages cannot be dropped; data files go before maps, the
    /// order a flush keeps. Holds the control lock, so no delete or flatten
    /// removes a file meanwhile; NBD traffic goes on.
    pub async fn evict(&self, name: &str) -> Result<EvictReport> {
        validate_name(name)?;
        let _g = self.control.lock().await;
        let cat = self.catalog()?;
        let rec = cat.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        let (mut data, mut maps) = (Vec::new(), Vec::new());
        for id in cat.chain(rec.head) {
            let l = cat.layers.get(&id).ok_or_else(|| CoronaError::Meta(format!("layer {id} is missing")))?;
            data.push(self.dir.join(&l.file));
            if l.parent.is_some() {
                maps.push(files::map_path(&self.dir, id));
            }
        }
        data.append(&mut maps);
        let paths = data;
        let (bytes, before, after) = tokio::task::spawn_blocking({
            let paths = paths.clone();
            move || -> Result<(u64, u64, u64)> {
                let mut sums = (0, 0, 0);
                for p in &paths {
                    let f = std::fs::File::open(p)?;
                    sums.0 += f.metadata()?.len();
                    sums.1 += pagecache::resident_bytes(&f)?;
                    pagecache::evict(&f)?;
                    sums.2 += pagecache::resident_bytes(&f)?;
                }
                Ok(sums)
            }
        })
        .await
        .map_err(|e| CoronaError::Io(std::io::Error::other(format!("eviction worker failed: {e}"))))??;
        tracing::info!(volume = name, files = paths.len(), bytes, before, after, "evicted from the page cache");
        Ok(EvictReport {
            volume: name.to_owned(),
            files: paths.iter().map(|p| p.display().to_string()).collect(),
            bytes,
            resident_before: before,
            resident_after: after,
        })
    }

    /// Path of the data file a volume's writes go to (tests, tools).
    pub fn head_path(&self, name: &str) -> Result<PathBuf> {
        let cat = self.catalog()?;
        let v = cat.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        let l = cat.layers.get(&v.head).ok_or_else(|| CoronaError::Meta(format!("layer {} is missing", v.head)))?;
        Ok(self.dir.join(&l.file))
    }
}

/// The exports an NBD negotiation may name: every volume and snapshot, and
/// `VOL;epoch=N` (refused below the volume's fence).
impl ExportCatalog for Volumes {
    fn lookup(&self, name: &str) -> std::result::Result<ExportDesc, String> {
        self.primary_here(name)?;
        let (v, declared) = self.open_export(name).map_err(|e| e.to_string())?;
        let current = v.fence.current();
        if let Some(e) = declared
            && e < current
        {
            let note = self.failover_note(name, e, current).unwrap_or_default();
            return Err(format!(
                "export {name:?} declares epoch {e}, but the volume is fenced at epoch {current}{note}"
            ));
        }
        // A client that declares no epoch holds epoch 0: once the volume has
        // been fenced it may only read, so it is told the export is read-only.
        let read_only = v.read_only || (declared.is_none() && current > 0);
        Ok(ExportDesc {
            name: name.to_owned(),
            size: v.backend.size(),
            read_only,
            description: if v.read_only && name.contains('@') {
                format!("CoronaFS snapshot {name}")
            } else {
                format!("CoronaFS volume {name}")
            },
            min_block: 1,
            pref_block: PREF_BLOCK,
            max_block: MAX_BLOCK,
        })
    }

    fn names(&self) -> Vec<String> {
        self.export_names()
    }
}

/// Adopts regular files placed directly in the data dir as plain volumes
/// named after the file (the layout before volumes had metadata).
fn adopt_raw_files(dir: &Path, cat: &mut Catalog) -> Result<()> {
    let known: Vec<String> = cat.layers.values().map(|l| l.file.clone()).collect();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else { continue };
        if validate_name(&name).is_err() || !entry.file_type()?.is_file() || name.starts_with("meta.redb") {
            continue;
        }
        if known.contains(&name) {
            continue;
        }
        if cat.volumes.contains_key(&name) {
            tracing::warn!(file = %name, "a volume of that name exists; the raw file is ignored");
            continue;
        }
        let size = entry.metadata()?.len();
        if size == 0 {
            continue;
        }
        let id = cat.alloc_layer();
        cat.layers.insert(id, LayerRec { file: name.clone(), size, parent: None, parent_limit: 0 });
        cat.volumes.insert(name.clone(), VolumeRec { size, head: id, ..Default::default() });
        tracing::info!(volume = %name, size, "adopted a raw file as a volume");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
