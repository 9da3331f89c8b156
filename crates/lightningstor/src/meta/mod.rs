//! Metadata in redb: buckets, objects, multipart uploads, block references.
//!
//! Reads open their own read transaction and run concurrently. Writes are
//! closures sent to one writer thread that runs everything queued in a
//! single transaction (group commit): it calls [`BlockStore::flush`] so every
//! block the batch references is durable, then commits with fsync, and only
//! then answers the callers. One fsync pays for many small PUTs.
//!
//! Write closures must check before they change anything: a closure that
//! returns a client error leaves the transaction as it found it, so the rest
//! of the batch still commits. A storage error aborts the whole batch.

pub mod merkle;
pub mod ops;
pub mod types;
pub mod versions;

use crate::block::{BlockHash, BlockStore};
use crate::error::{LightningError, Result};
use crate::keys::{GrantRow, KeyMeta, KeyRow, Perms};
use crate::listing::{self, Cursor, ListPage, ListQuery};
use redb::{
    Database, Durability, ReadOnlyTable, ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use tokio::sync::oneshot;
use types::{BucketMeta, ObjectMeta, ObjectSummary, PartMeta, RawEntry, Row, UploadMeta, VersionRow};

/// bucket name -> [`BucketMeta`].
pub const BUCKETS: TableDefinition<&str, &[u8]> = TableDefinition::new("buckets");
/// (bucket, key bytes) -> [`ObjectMeta`].
pub const OBJECTS: TableDefinition<(&str, &[u8]), &[u8]> = TableDefinition::new("objects");
/// upload id -> [`UploadMeta`].
pub const UPLOADS: TableDefinition<&str, &[u8]> = TableDefinition::new("uploads");
/// (bucket, key bytes, upload id) -> (), to list uploads by bucket.
pub const UPLOAD_INDEX: TableDefinition<(&str, &[u8], &str), ()> = TableDefinition::new("upload_index");
/// (upload id, part number) -> [`PartMeta`].
pub const PARTS: TableDefinition<(&str, u32), &[u8]> = TableDefinition::new("parts");
/// (bucket, key bytes) -> version of the delete (replicated mode only).
pub const TOMBSTONES: TableDefinition<(&str, &[u8]), u64> = TableDefinition::new("tombstones");
/// upload id -> postcard `(bucket, Unix ms)`: uploads completed or aborted
/// (replicated mode only), so a replica that still lists one, or a late
/// part, cannot bring it back.
pub const UPLOADS_GONE: TableDefinition<&str, &[u8]> = TableDefinition::new("uploads_gone");
/// Cluster replicas: buckets deleted here (name -> Unix ms of the delete),
/// so a write that raced the delete cannot bring the bucket back; removed
/// when the bucket is created again.
pub const BUCKETS_GONE: TableDefinition<&str, i64> = TableDefinition::new("buckets_gone");
/// access key id -> postcard [`KeyRow`] (deleted keys stay as `key: None`).
pub const KEYS: TableDefinition<&str, &[u8]> = TableDefinition::new("keys");
/// (bucket, access key id) -> postcard [`GrantRow`].
pub const GRANTS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("grants");
/// (bucket, key bytes, !version) -> postcard [`types::Version`]: every
/// version and delete marker of the keys of versioned buckets, newest first
/// per key. The current object is in [`OBJECTS`] too (one reference each).
pub const VERSIONS: TableDefinition<(&str, &[u8], u64), &[u8]> = TableDefinition::new("versions");
/// (bucket, key bytes, row version) -> (): in a cluster, the versions of a
/// key deleted for good here, so a version still held by a replica that
/// missed the delete is not read (or stored) again (cluster mode only).
pub const VERSIONS_GONE: TableDefinition<(&str, &[u8], u64), ()> = TableDefinition::new("versions_gone");
/// block hash -> number of references from objects, versions and parts.
pub const REFS: TableDefinition<&[u8], u64> = TableDefinition::new("block_refs");
/// (partition, leaf, bucket, key bytes) -> (version, tombstone) of the key's
/// row, the index of the hash trees ([`merkle`]; cluster mode only).
pub const TREE_ROWS: TableDefinition<TreeKey, (u64, bool)> = TableDefinition::new("tree_rows");
/// The key of [`TREE_ROWS`]: (partition, leaf, bucket, key bytes).
pub type TreeKey = (u32, u8, &'static str, &'static [u8]);
/// The tree nodes as builds before they moved to memory stored them; an
/// open drops the table ([`merkle::ensure`]).
pub const LEGACY_TREE_NODES: TableDefinition<(u32, u16), [u8; 32]> = TableDefinition::new("tree_nodes");
/// `"partitions"` -> the partition count the trees were built for (cluster mode only).
pub const TREE_META: TableDefinition<&str, u64> = TableDefinition::new("tree_meta");

/// A write transaction, with what the writers of object rows must keep in
/// step in it: the partition count of the hash trees, when the store keeps
/// them ([`merkle`]), and the tree node changes queued by the batch so far.
/// Derefs to the redb transaction.
pub struct Txn<'a> {
    inner: &'a WriteTransaction,
    tree: Option<u32>,
    deltas: std::cell::RefCell<std::collections::BTreeMap<(u32, u16), merkle::Hash>>,
    /// The tree's index, opened by the first row change of the transaction
    /// and kept open to its end (opening a table per row is a name lookup).
    rows: std::cell::RefCell<Option<redb::Table<'a, TreeKey, (u64, bool)>>>,
}

impl<'a> Txn<'a> {
    /// Wraps `inner`; `tree` is the partition count when hash trees are kept.
    pub fn new(inner: &'a WriteTransaction, tree: Option<u32>) -> Self {
        Txn { inner, tree, deltas: Default::default(), rows: Default::default() }
    }

    /// The partition count of the hash trees, if the store keeps them.
    pub fn tree(&self) -> Option<u32> {
        self.tree
    }

    /// Runs `f` on the tree's index (only [`merkle`] writes it).
    fn with_tree_rows<R>(&self, f: impl FnOnce(&mut redb::Table<'a, TreeKey, (u64, bool)>) -> Result<R>) -> Result<R> {
        let mut rows = self.rows.borrow_mut();
        if rows.is_none() {
            *rows = Some(self.inner.open_table(TREE_ROWS)?);
        }
        match rows.as_mut() {
            Some(t) => f(t),
            None => Err(LightningError::Db("tree index not open".into())),
        }
    }

    fn queue_delta(&self, partition: u32, leaf: u8, delta: &merkle::Hash) {
        merkle::queue(&mut self.deltas.borrow_mut(), partition, leaf, delta);
    }

    /// The tree node changes queued so far, to apply to the in-memory
    /// [`merkle::Nodes`] once the transaction has committed (the writer
    /// thread does, before it answers the batch).
    pub fn take_deltas(&self) -> std::collections::BTreeMap<(u32, u16), merkle::Hash> {
        self.rows.borrow_mut().take();
        std::mem::take(&mut *self.deltas.borrow_mut())
    }
}

impl std::ops::Deref for Txn<'_> {
    type Target = WriteTransaction;
    fn deref(&self) -> &WriteTransaction {
        self.inner
    }
}

trait PendingOp: Send {
    fn run(&mut self, txn: &Txn<'_>) -> bool;
    fn finish(self: Box<Self>, commit: std::result::Result<(), String>);
}

struct Op<T, F> {
    f: Option<F>,
    result: Option<Result<T>>,
    tx: Option<oneshot::Sender<Result<T>>>,
}

impl<T: Send, F: FnOnce(&Txn<'_>) -> Result<T> + Send> PendingOp for Op<T, F> {
    /// Returns false when the op hit a storage error (the batch must abort).
    fn run(&mut self, txn: &Txn<'_>) -> bool {
        let Some(f) = self.f.take() else { return true };
        let r = f(txn);
        let ok = !matches!(r, Err(LightningError::Db(_) | LightningError::Io(_)));
        self.result = Some(r);
        ok
    }

    fn finish(mut self: Box<Self>, commit: std::result::Result<(), String>) {
        let r = match commit {
            Ok(()) => self.result.take().unwrap_or_else(|| Err(LightningError::Db("operation did not run".into()))),
            Err(e) => match self.result.take() {
                Some(Err(own)) => Err(own),
                _ => Err(LightningError::Db(e)),
            },
        };
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(r);
        }
    }
}

/// The metadata store.
pub struct MetaStore {
    db: Arc<Database>,
    writer: mpsc::Sender<Box<dyn PendingOp>>,
    version: AtomicU64,
    tree: Option<u32>,
    /// The hash tree nodes when the store keeps them ([`merkle::Nodes`]).
    nodes: Option<Arc<RwLock<merkle::Nodes>>>,
}

impl std::fmt::Debug for MetaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaStore").finish_non_exhaustive()
    }
}

/// Current time in Unix milliseconds.
pub fn now_ms() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl MetaStore {
    /// Opens (creating) the database at `path` and starts the writer thread.
    /// `blocks` is flushed before every commit. With `tree` (a cluster
    /// node's partition count) the store keeps the hash trees of
    /// [`merkle`], building them once if they are missing.
    pub fn open(path: &std::path::Path, blocks: Arc<dyn BlockStore>, fsync: bool, tree: Option<u32>) -> Result<Self> {
        let db = Arc::new(Database::create(path)?);
        {
            let txn = db.begin_write()?;
            txn.open_table(BUCKETS)?;
            txn.open_table(OBJECTS)?;
            txn.open_table(UPLOADS)?;
            txn.open_table(UPLOAD_INDEX)?;
            txn.open_table(PARTS)?;
            txn.open_table(REFS)?;
            txn.open_table(TOMBSTONES)?;
            txn.open_table(UPLOADS_GONE)?;
            txn.open_table(BUCKETS_GONE)?;
            txn.open_table(KEYS)?;
            txn.open_table(GRANTS)?;
            txn.open_table(VERSIONS)?;
            txn.open_table(VERSIONS_GONE)?;
            match tree {
                Some(p) => {
                    if merkle::ensure(&txn, p)? {
                        tracing::info!(partitions = p, "built the anti-entropy hash trees from the rows");
                    }
                }
                None => merkle::drop_tree(&txn)?,
            }
            txn.commit()?;
        }
        let nodes = match tree {
            Some(_) => {
                let started = std::time::Instant::now();
                let nodes = merkle::load(&db.begin_read()?.open_table(TREE_ROWS)?)?;
                tracing::debug!(nodes = nodes.as_map().len(), took = ?started.elapsed(), "loaded the hash trees");
                Some(Arc::new(RwLock::new(nodes)))
            }
            None => None,
        };
        let (tx, rx) = mpsc::channel::<Box<dyn PendingOp>>();
        let wdb = db.clone();
        let wnodes = nodes.clone();
        std::thread::Builder::new()
            .name("ls-meta-writer".into())
            .spawn(move || writer_loop(&wdb, &rx, &*blocks, fsync, tree, wnodes.as_deref()))?;
        let start = u64::try_from(now_ms()).unwrap_or(0).saturating_mul(1000);
        Ok(MetaStore { db, writer: tx, version: AtomicU64::new(start), tree, nodes })
    }

    /// A fresh row version, unique and increasing on this node.
    pub fn next_version(&self) -> u64 {
        let now = u64::try_from(now_ms()).unwrap_or(0).saturating_mul(1000);
        let mut cur = self.version.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(1).max(now);
            match self.version.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return next,
                Err(c) => cur = c,
            }
        }
    }

    /// Runs `f` in the next group-committed write transaction; resolves after commit.
    pub async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Txn<'_>) -> Result<T> + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let op: Box<dyn PendingOp> = Box::new(Op { f: Some(f), result: None, tx: Some(tx) });
        self.writer.send(op).map_err(|_| LightningError::Db("metadata writer is gone".into()))?;
        rx.await.map_err(|_| LightningError::Db("metadata writer dropped a request".into()))?
    }

    fn table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        def: TableDefinition<K, V>,
    ) -> Result<ReadOnlyTable<K, V>> {
        Ok(self.db.begin_read()?.open_table(def)?)
    }

    /// A bucket's row.
    pub fn get_bucket(&self, name: &str) -> Result<Option<BucketMeta>> {
        let t = self.table(BUCKETS)?;
        match t.get(name)? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
    }

    /// When this cluster node deleted bucket `name` (Unix ms), if it
    /// remembers deleting it and has not seen it created again.
    pub fn bucket_deleted_ms(&self, name: &str) -> Result<Option<i64>> {
        let t = self.table(BUCKETS_GONE)?;
        Ok(t.get(name)?.map(|v| v.value()))
    }

    /// Every bucket this cluster node remembers deleting (and has not seen
    /// created again), with the time of the delete (Unix ms), by name.
    pub fn buckets_gone(&self) -> Result<Vec<(String, i64)>> {
        let t = self.table(BUCKETS_GONE)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            out.push((k.value().to_owned(), v.value()));
        }
        Ok(out)
    }

    /// Every bucket, by name.
    pub fn list_buckets(&self) -> Result<Vec<(String, BucketMeta)>> {
        let t = self.table(BUCKETS)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            out.push((k.value().to_owned(), postcard::from_bytes(v.value())?));
        }
        Ok(out)
    }

    /// An object's row.
    pub fn get_object(&self, bucket: &str, key: &str) -> Result<Option<ObjectMeta>> {
        let t = self.table(OBJECTS)?;
        match t.get((bucket, key.as_bytes()))? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
    }

    /// Version `v` of a key of a versioned bucket (none in other buckets).
    pub fn get_version(
        &self,
        bucket: &str,
        key: &str,
        v: crate::versioning::VersionRef,
    ) -> Result<Option<types::Version>> {
        let t = self.table(VERSIONS)?;
        versions::find(&t, bucket, key.as_bytes(), v)
    }

    /// A key's latest version in a versioned bucket (an object or a delete marker).
    pub fn latest_version(&self, bucket: &str, key: &str) -> Result<Option<types::Version>> {
        let t = self.table(VERSIONS)?;
        match versions::of_key(&t, bucket, key.as_bytes())?.next() {
            Some(row) => Ok(Some(postcard::from_bytes(row?.1.value())?)),
            None => Ok(None),
        }
    }

    /// In a cluster: every version of a key held here (newest first) and
    /// the row versions of those deleted for good here.
    pub fn key_versions(&self, bucket: &str, key: &[u8]) -> Result<(Vec<types::Version>, Vec<u64>)> {
        let txn = self.db.begin_read()?;
        let t = txn.open_table(VERSIONS)?;
        let mut out = Vec::new();
        for row in versions::of_key(&t, bucket, key)? {
            out.push(postcard::from_bytes(row?.1.value())?);
        }
        let gone = versions::gone_of_key(&txn.open_table(VERSIONS_GONE)?, bucket, key)?;
        Ok((out, gone))
    }

    /// In a cluster: the versions of `bucket` held here for keys `>= from`
    /// starting with `prefix`, in listing order, as summaries: up to `limit`
    /// of them, then the rest of the last key's (a key's versions are never
    /// split between two answers); and the versions deleted for good here
    /// among the keys covered (up to the last key, or all when the answer
    /// is not cut short).
    pub fn version_entries(&self, bucket: &str, from: &[u8], prefix: &[u8], limit: usize) -> Result<versions::Entries> {
        let txn = self.db.begin_read()?;
        versions::entries(&txn.open_table(VERSIONS)?, &txn.open_table(VERSIONS_GONE)?, bucket, from, prefix, limit)
    }

    /// One page of ListObjectVersions of a bucket.
    pub fn list_versions(
        &self,
        bucket: &str,
        q: &crate::versioning::VersionQuery,
    ) -> Result<crate::versioning::VersionPage> {
        let mut cur = versions::Cursor::new(self.table(VERSIONS)?, bucket);
        crate::versioning::page(&mut cur, q)
    }

    /// An object's replicated row: the object or its tombstone, whichever is newer.
    pub fn get_row(&self, bucket: &str, key: &[u8]) -> Result<Option<Row>> {
        let txn = self.db.begin_read()?;
        let obj: Option<ObjectMeta> = match txn.open_table(OBJECTS)?.get((bucket, key))? {
            Some(v) => Some(postcard::from_bytes(v.value())?),
            None => None,
        };
        let tomb = txn.open_table(TOMBSTONES)?.get((bucket, key))?.map(|v| v.value());
        Ok(match (obj, tomb) {
            (Some(o), Some(t)) if t > o.version => Some(Row::Tombstone(t)),
            (Some(o), _) => Some(Row::Object(o)),
            (None, Some(t)) => Some(Row::Tombstone(t)),
            (None, None) => None,
        })
    }

    /// The version of the row of each (bucket, key) (0: no row), in one read
    /// transaction. Only the version, the first field of an object row, is
    /// decoded: a small object's bytes stay where they are.
    pub fn get_versions<'a>(&self, keys: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Result<Vec<u64>> {
        let txn = self.db.begin_read()?;
        let objects = txn.open_table(OBJECTS)?;
        let tombs = txn.open_table(TOMBSTONES)?;
        let mut out = Vec::new();
        for (bucket, key) in keys {
            let obj = match objects.get((bucket, key))? {
                Some(v) => postcard::take_from_bytes::<u64>(v.value())?.0,
                None => 0,
            };
            let tomb = tombs.get((bucket, key))?.map_or(0, |v| v.value());
            out.push(obj.max(tomb));
        }
        Ok(out)
    }

    /// Up to `limit` rows of `bucket` with keys `>= from` that start with
    /// `prefix`, objects and tombstones merged in key order.
    pub fn list_raw(&self, bucket: &str, from: &[u8], prefix: &[u8], limit: usize) -> Result<Vec<(Vec<u8>, RawEntry)>> {
        let txn = self.db.begin_read()?;
        let objects = txn.open_table(OBJECTS)?;
        let tombs = txn.open_table(TOMBSTONES)?;
        let from = if from < prefix { prefix } else { from };
        let mut out: std::collections::BTreeMap<Vec<u8>, RawEntry> = std::collections::BTreeMap::new();
        for row in objects.range((bucket, from)..)? {
            let (k, v) = row?;
            let (b, key) = k.value();
            if b != bucket || !key.starts_with(prefix) || out.len() >= limit {
                break;
            }
            let (summary, _) = postcard::take_from_bytes::<ObjectSummary>(v.value())?;
            out.insert(key.to_vec(), RawEntry { version: summary.version, summary: Some(summary) });
        }
        let last = if out.len() >= limit { out.keys().next_back().cloned() } else { None };
        for row in tombs.range((bucket, from)..)? {
            let (k, v) = row?;
            let (b, key) = k.value();
            if b != bucket || !key.starts_with(prefix) || last.as_deref().is_some_and(|l| key > l) {
                break;
            }
            let t = v.value();
            match out.get(key) {
                Some(e) if e.version >= t => {}
                _ => {
                    out.insert(key.to_vec(), RawEntry { version: t, summary: None });
                }
            }
        }
        Ok(out.into_iter().take(limit).collect())
    }

    /// Every row (bucket, key, version), objects and tombstones, for
    /// anti-entropy digests. Tombstones are marked by `true`.
    pub fn all_versions(&self) -> Result<Vec<VersionRow>> {
        let txn = self.db.begin_read()?;
        let mut out = Vec::new();
        for row in txn.open_table(OBJECTS)?.iter()? {
            let (k, v) = row?;
            let (b, key) = k.value();
            let (s, _) = postcard::take_from_bytes::<ObjectSummary>(v.value())?;
            out.push((b.to_owned(), key.to_vec(), s.version, false));
        }
        for row in txn.open_table(TOMBSTONES)?.iter()? {
            let (k, v) = row?;
            let (b, key) = k.value();
            out.push((b.to_owned(), key.to_vec(), v.value(), true));
        }
        Ok(out)
    }

    /// In a cluster: every (bucket, key) with a version or a record of a
    /// version deleted for good here, in order, once each.
    pub fn version_keys(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let txn = self.db.begin_read()?;
        let mut out: std::collections::BTreeSet<(String, Vec<u8>)> = std::collections::BTreeSet::new();
        for row in txn.open_table(VERSIONS)?.iter()? {
            let (k, _) = row?;
            let (b, key, _) = k.value();
            out.insert((b.to_owned(), key.to_vec()));
        }
        for row in txn.open_table(VERSIONS_GONE)?.iter()? {
            let (k, _) = row?;
            let (b, key, _) = k.value();
            out.insert((b.to_owned(), key.to_vec()));
        }
        Ok(out.into_iter().collect())
    }

    /// The partition count of the hash trees, if this store keeps them.
    pub fn tree(&self) -> Option<u32> {
        self.tree
    }

    fn require_tree(&self) -> Result<()> {
        match self.tree {
            Some(_) => Ok(()),
            None => Err(LightningError::InvalidRequest("this store keeps no anti-entropy hash trees".into())),
        }
    }

    /// The hashes of tree nodes (partition, node); zeros for an empty one.
    pub fn tree_nodes(&self, nodes: &[(u32, u16)]) -> Result<Vec<[u8; 32]>> {
        self.require_tree()?;
        let Some(held) = &self.nodes else { return Ok(vec![[0; 32]; nodes.len()]) };
        let held = held.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(nodes.iter().map(|n| held.get(*n)).collect())
    }

    /// The rows (bucket, key, version, tombstone) of tree leaves
    /// (partition, leaf), read from the tree's index (no other row is read).
    pub fn leaf_rows(&self, leaves: &[(u32, u8)]) -> Result<Vec<VersionRow>> {
        self.require_tree()?;
        let t = self.table(TREE_ROWS)?;
        let mut out = Vec::new();
        for &(p, leaf) in leaves {
            for row in t.range((p, leaf, "", &b""[..])..)? {
                let (k, v) = row?;
                let (rp, rl, b, key) = k.value();
                if (rp, rl) != (p, leaf) {
                    break;
                }
                let (version, tomb) = v.value();
                out.push((b.to_owned(), key.to_vec(), version, tomb));
            }
        }
        Ok(out)
    }

    /// The rows of one partition, sorted, read from the tree's index.
    pub fn partition_rows(&self, partition: u32) -> Result<Vec<VersionRow>> {
        self.require_tree()?;
        let t = self.table(TREE_ROWS)?;
        let mut rows = Vec::new();
        for row in t.range((partition, 0u8, "", &b""[..])..)? {
            let (k, v) = row?;
            let (p, _, b, key) = k.value();
            if p != partition {
                break;
            }
            let (version, tomb) = v.value();
            rows.push((b.to_owned(), key.to_vec(), version, tomb));
        }
        rows.sort();
        Ok(rows)
    }

    /// Tombstones made before `before_ms` (for collection).
    pub fn old_tombstones(&self, before_version: u64) -> Result<Vec<(String, Vec<u8>, u64)>> {
        let t = self.table(TOMBSTONES)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            if v.value() < before_version {
                let (b, key) = k.value();
                out.push((b.to_owned(), key.to_vec(), v.value()));
            }
        }
        Ok(out)
    }

    /// One page of a bucket's objects.
    pub fn list_objects(&self, bucket: &str, q: &ListQuery) -> Result<ListPage<ObjectSummary>> {
        let mut cur = ObjectCursor { table: self.table(OBJECTS)?, bucket: bucket.to_owned(), range: None };
        listing::list(&mut cur, q)
    }

    /// A multipart upload's row.
    pub fn get_upload(&self, id: &str) -> Result<Option<UploadMeta>> {
        let t = self.table(UPLOADS)?;
        match t.get(id)? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
    }

    /// Parts of an upload with numbers above `marker`, at most `max` (+1 to tell truncation).
    pub fn list_parts(&self, id: &str, marker: u32, max: usize) -> Result<Vec<(u32, PartMeta)>> {
        let t = self.table(PARTS)?;
        let mut out = Vec::new();
        let start = marker.saturating_add(1);
        if marker == u32::MAX {
            return Ok(out);
        }
        for row in t.range((id, start)..=(id, u32::MAX))? {
            let (k, v) = row?;
            out.push((k.value().1, postcard::from_bytes(v.value())?));
            if out.len() >= max {
                break;
            }
        }
        Ok(out)
    }

    /// Uploads of a bucket in (key, upload id) order, starting after the markers.
    pub fn list_uploads(
        &self,
        bucket: &str,
        prefix: &str,
        key_marker: Option<&str>,
        upload_id_marker: Option<&str>,
        max: usize,
    ) -> Result<Vec<(String, String, UploadMeta)>> {
        let index = self.table(UPLOAD_INDEX)?;
        let uploads = self.table(UPLOADS)?;
        let start: &[u8] = match key_marker {
            Some(m) if m.as_bytes() > prefix.as_bytes() => m.as_bytes(),
            _ => prefix.as_bytes(),
        };
        let mut out = Vec::new();
        for row in index.range((bucket, start, "")..)? {
            let (k, _) = row?;
            let (b, key, id) = k.value();
            if b != bucket || !key.starts_with(prefix.as_bytes()) {
                break;
            }
            if let Some(m) = key_marker {
                let after = match upload_id_marker {
                    Some(um) => (key, id) > (m.as_bytes(), um),
                    None => key > m.as_bytes(),
                };
                if !after {
                    continue;
                }
            }
            let key = String::from_utf8(key.to_vec())
                .map_err(|_| LightningError::Db("non-UTF-8 key in upload index".into()))?;
            if let Some(meta) = uploads.get(id)? {
                out.push((key, id.to_owned(), postcard::from_bytes(meta.value())?));
            }
            if out.len() >= max {
                break;
            }
        }
        Ok(out)
    }

    /// Whether an upload was completed or aborted (replicated mode).
    pub fn upload_gone(&self, id: &str) -> Result<bool> {
        Ok(self.table(UPLOADS_GONE)?.get(id)?.is_some())
    }

    /// Ids of the uploads of `bucket` completed or aborted here, and of every
    /// bucket's gone uploads older than `before_ms` (for collection), in one scan.
    pub fn gone_uploads(&self, bucket: &str, before_ms: i64) -> Result<(Vec<String>, Vec<String>)> {
        let t = self.table(UPLOADS_GONE)?;
        let (mut of_bucket, mut old) = (Vec::new(), Vec::new());
        for row in t.iter()? {
            let (k, v) = row?;
            let (b, ms): (String, i64) = postcard::from_bytes(v.value())?;
            if b == bucket {
                of_bucket.push(k.value().to_owned());
            }
            if ms < before_ms {
                old.push(k.value().to_owned());
            }
        }
        Ok((of_bucket, old))
    }

    /// Ids of the uploads in progress here, with their bucket and key.
    pub fn all_uploads(&self) -> Result<Vec<(String, UploadMeta)>> {
        let t = self.table(UPLOADS)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            out.push((k.value().to_owned(), postcard::from_bytes(v.value())?));
        }
        Ok(out)
    }

    /// A key's row (live or deleted).
    pub fn key_row(&self, id: &str) -> Result<Option<KeyRow>> {
        match self.table(KEYS)?.get(id)? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
    }

    /// Every live key, by id.
    pub fn keys(&self) -> Result<Vec<(String, KeyMeta)>> {
        let mut out = Vec::new();
        for row in self.table(KEYS)?.iter()? {
            let (k, v) = row?;
            let r: KeyRow = postcard::from_bytes(v.value())?;
            if let Some(key) = r.key {
                out.push((k.value().to_owned(), key));
            }
        }
        Ok(out)
    }

    /// A grant's row.
    pub fn grant_row(&self, bucket: &str, id: &str) -> Result<Option<GrantRow>> {
        match self.table(GRANTS)?.get((bucket, id))? {
            Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
            None => Ok(None),
        }
    }

    /// Every grant row, revoked ones included: (bucket, key id, row).
    pub fn grant_rows(&self) -> Result<Vec<(String, String, GrantRow)>> {
        let mut out = Vec::new();
        for row in self.table(GRANTS)?.iter()? {
            let (k, v) = row?;
            let (b, id) = k.value();
            out.push((b.to_owned(), id.to_owned(), postcard::from_bytes(v.value())?));
        }
        Ok(out)
    }

    /// Every key and grant row, tombstones included (to bring a replica up to date).
    pub fn auth_rows(&self) -> Result<Vec<crate::keys::AuthRow>> {
        use crate::keys::AuthRow;
        let mut out = Vec::new();
        for row in self.table(KEYS)?.iter()? {
            let (k, v) = row?;
            out.push(AuthRow::Key { id: k.value().to_owned(), row: postcard::from_bytes(v.value())? });
        }
        for (bucket, id, row) in self.grant_rows()? {
            out.push(AuthRow::Grant { bucket, id, row });
        }
        Ok(out)
    }

    /// What key `id` may do on `bucket`.
    pub fn perms(&self, bucket: &str, id: &str) -> Result<Perms> {
        Ok(self.grant_row(bucket, id)?.map_or(Perms::NONE, |g| g.perms))
    }

    /// The reference count of a block.
    pub fn refcount(&self, hash: &BlockHash) -> Result<u64> {
        let t = self.table(REFS)?;
        Ok(t.get(hash.0.as_slice())?.map(|v| v.value()).unwrap_or(0))
    }

    /// Number of referenced blocks and of objects (for metrics).
    pub fn counts(&self) -> Result<(u64, u64)> {
        let txn = self.db.begin_read()?;
        Ok((txn.open_table(REFS)?.len()?, txn.open_table(OBJECTS)?.len()?))
    }
}

fn writer_loop(
    db: &Database,
    rx: &mpsc::Receiver<Box<dyn PendingOp>>,
    blocks: &dyn BlockStore,
    fsync: bool,
    tree: Option<u32>,
    nodes: Option<&RwLock<merkle::Nodes>>,
) {
    while let Ok(first) = rx.recv() {
        let mut ops = vec![first];
        while ops.len() < 256 {
            match rx.try_recv() {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        let outcome = run_batch(db, &mut ops, blocks, fsync, tree, nodes);
        for op in ops {
            op.finish(outcome.clone());
        }
    }
}

fn run_batch(
    db: &Database,
    ops: &mut [Box<dyn PendingOp>],
    blocks: &dyn BlockStore,
    fsync: bool,
    tree: Option<u32>,
    nodes: Option<&RwLock<merkle::Nodes>>,
) -> std::result::Result<(), String> {
    let mut txn = db.begin_write().map_err(|e| e.to_string())?;
    if !fsync {
        txn.set_durability(Durability::Eventual);
    }
    let mut ok = true;
    let deltas = {
        let t = Txn::new(&txn, tree);
        for op in ops.iter_mut() {
            // A panicking operation (a bug) must not take the writer thread down.
            ok &= std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op.run(&t))).unwrap_or(false);
            if !ok {
                break;
            }
        }
        // The batch's tree node changes, once each (nothing without a tree).
        t.take_deltas()
    };
    if !ok {
        let _ = txn.abort();
        return Err("a storage error aborted the transaction".into());
    }
    // Durability order: every block the batch references is on disk
    // (file fsynced at write, directory entry fsynced here) before the rows
    // that reference it are committed.
    if let Err(e) = blocks.flush() {
        let _ = txn.abort();
        return Err(e.to_string());
    }
    txn.commit().map_err(|e| e.to_string())?;
    // The rows are committed: the nodes follow them before any writer of
    // the batch is answered (a lock poisoned by a panic is taken over: the
    // nodes are only ever changed whole, here).
    if let Some(nodes) = nodes {
        nodes.write().unwrap_or_else(std::sync::PoisonError::into_inner).apply(&deltas);
    }
    Ok(())
}

type ObjectKey = (&'static str, &'static [u8]);

/// A [`Cursor`] over one bucket of the objects table.
struct ObjectCursor {
    table: ReadOnlyTable<ObjectKey, &'static [u8]>,
    bucket: String,
    range: Option<redb::Range<'static, ObjectKey, &'static [u8]>>,
}

impl Cursor for ObjectCursor {
    type Value = ObjectSummary;
    type Error = LightningError;

    fn seek(&mut self, from: &[u8]) -> Result<()> {
        self.range = Some(self.table.range((self.bucket.as_str(), from)..)?);
        Ok(())
    }

    fn next(&mut self) -> Result<Option<(Vec<u8>, ObjectSummary)>> {
        let Some(range) = self.range.as_mut() else {
            return Ok(None);
        };
        match range.next() {
            None => Ok(None),
            Some(row) => {
                let (k, v) = row?;
                let (b, key) = k.value();
                if b != self.bucket {
                    return Ok(None);
                }
                let (summary, _) = postcard::take_from_bytes::<ObjectSummary>(v.value())?;
                Ok(Some((key.to_vec(), summary)))
            }
        }
    }
}

/// Deletes every stored block no row references. Run at startup, before
/// any upload can be in flight.
pub fn collect_orphans(meta: &MetaStore, blocks: &dyn BlockStore) -> Result<usize> {
    let refs = meta.table(REFS)?;
    let mut n = 0;
    for hash in blocks.list()? {
        if refs.get(hash.0.as_slice())?.is_none() {
            blocks.delete(&hash)?;
            n += 1;
        }
    }
    blocks.flush()?;
    Ok(n)
}
