//! The storage engine: streams bodies into blocks, reads them back verified,
//! and commits metadata only after the blocks are durable.
//!
//! Blocks written by an upload are *pinned* until its metadata commits (or
//! the upload fails), so a concurrent delete that drops the last reference
//! to an identical block cannot remove a file an upload is about to
//! reference. Deleting an unreferenced block happens under the pin lock after
//! re-reading its reference count.

use crate::block::{BlockHash, BlockStore};
use crate::checksum::{BodyHasher, Checksum, ChecksumAlgo};
use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::meta::MetaStore;
use crate::meta::types::{BlockRef, ObjectData, ObjectMeta};
use crate::metrics::Metrics;
use bytes::Bytes;
use futures::stream::{self, BoxStream, FuturesOrdered};
use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Block writes one upload keeps in flight while it reads the next block.
const WRITES_IN_FLIGHT: usize = 2;
/// Slices of one block kept before they are coalesced.
const MAX_PARTS: usize = 512;
/// Block reads a download prefetches.
const READS_AHEAD: usize = 2;

/// Shared engine state.
pub struct Store {
    /// Metadata.
    pub meta: MetaStore,
    /// Block storage.
    pub blocks: Arc<dyn BlockStore>,
    /// The configuration the node runs with.
    pub config: Config,
    /// Counters exported at /metrics.
    pub metrics: Arc<Metrics>,
    pins: Mutex<HashMap<BlockHash, usize>>,
    budget: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

/// Blocks an upload has written (or a reader is reading) that must not be
/// deleted yet. Shared with the upload's block-write tasks, so even a
/// cancelled upload (client gone) unpins and cleans up once its last write
/// finishes.
#[derive(Clone)]
pub struct Pins(Arc<PinSet>);

struct PinSet {
    store: Arc<Store>,
    hashes: Mutex<Vec<BlockHash>>,
}

impl Pins {
    pub(crate) fn new(store: &Arc<Store>) -> Self {
        Pins(Arc::new(PinSet { store: store.clone(), hashes: Mutex::new(Vec::new()) }))
    }

    /// Pins `hash` for as long as this set lives.
    pub(crate) fn add(&self, hash: BlockHash) {
        self.0.store.pin(hash);
        if let Ok(mut h) = self.0.hashes.lock() {
            h.push(hash);
        }
    }

    /// The upload committed: its blocks are referenced now, unpin them
    /// without looking for garbage.
    pub fn release(self) {
        let hashes = match self.0.hashes.lock() {
            Ok(mut h) => std::mem::take(&mut *h),
            Err(_) => return,
        };
        self.0.store.unpin(&hashes);
    }
}

impl Drop for PinSet {
    fn drop(&mut self) {
        let hashes = match self.hashes.get_mut() {
            Ok(h) => std::mem::take(h),
            Err(_) => return,
        };
        if hashes.is_empty() {
            return;
        }
        // Not committed (failed, cancelled) or a finished read: unpin and
        // delete whatever nothing references any more.
        let store = self.store.clone();
        let work = move || {
            store.unpin(&hashes);
            store.delete_unused(&hashes);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }
}

/// The result of streaming a body in.
pub struct Ingested {
    /// Bytes received.
    pub size: u64,
    /// MD5 of the body.
    pub md5: [u8; 16],
    /// The extra checksum computed, if one was asked for.
    pub checksum: Option<Checksum>,
    /// Where the bytes went.
    pub data: ObjectData,
    /// Pins on the written blocks; release after the metadata commit.
    pub pins: Pins,
}

impl Store {
    /// Opens the node's data directory: metadata, blocks, and collects orphans.
    pub fn open(config: Config) -> Result<Arc<Self>> {
        config.validate()?;
        std::fs::create_dir_all(&config.data_dir)?;
        let blocks: Arc<dyn BlockStore> =
            Arc::new(crate::block::file::FileBlockStore::open(&config.data_dir.join("blocks"), config.fsync)?);
        Self::with_backends(config, blocks)
    }

    /// Builds a store over a given block backend (metadata still under `data_dir`).
    pub fn with_backends(config: Config, blocks: Arc<dyn BlockStore>) -> Result<Arc<Self>> {
        std::fs::create_dir_all(&config.data_dir)?;
        let meta =
            MetaStore::open(&config.data_dir.join("meta.redb"), blocks.clone(), config.fsync, config.tree_partitions)?;
        let orphans = crate::meta::collect_orphans(&meta, &*blocks)?;
        if orphans > 0 {
            tracing::info!(orphans, "collected unreferenced blocks");
        }
        let metrics = Arc::new(Metrics::default());
        metrics.add(&metrics.gc_blocks_deleted, orphans as u64);
        Ok(Arc::new(Store {
            meta,
            blocks,
            config,
            metrics,
            pins: Mutex::new(HashMap::new()),
            budget: Arc::new(tokio::sync::Semaphore::new(BLOCK_BUDGET)),
        }))
    }

    /// An empty pin set (blocks added to it stay until it is released or dropped).
    pub fn new_pins(self: &Arc<Self>) -> Pins {
        Pins::new(self)
    }

    fn pin(&self, hash: BlockHash) {
        if let Ok(mut p) = self.pins.lock() {
            *p.entry(hash).or_insert(0) += 1;
        }
    }

    fn unpin(&self, hashes: &[BlockHash]) {
        if let Ok(mut p) = self.pins.lock() {
            for h in hashes {
                if let Some(n) = p.get_mut(h) {
                    *n -= 1;
                    if *n == 0 {
                        p.remove(h);
                    }
                }
            }
        }
    }

    /// Deletes each block that is neither pinned nor referenced. Blocking.
    pub fn delete_unused(&self, hashes: &[BlockHash]) {
        let Ok(pins) = self.pins.lock() else { return };
        let mut deleted = 0u64;
        for h in hashes {
            if pins.contains_key(h) {
                continue;
            }
            match self.meta.refcount(h) {
                Ok(0) => match self.blocks.delete(h) {
                    Ok(()) => deleted += 1,
                    Err(e) => tracing::warn!(block = %h, error = %e, "deleting a block failed"),
                },
                Ok(_) => {}
                Err(e) => tracing::warn!(block = %h, error = %e, "reading a refcount failed"),
            }
        }
        drop(pins);
        self.metrics.add(&self.metrics.gc_blocks_deleted, deleted);
    }

    /// Deletes freed blocks in the background after a commit.
    pub fn spawn_delete(self: &Arc<Self>, freed: Vec<BlockHash>) {
        if freed.is_empty() {
            return;
        }
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.delete_unused(&freed));
    }

    /// Streams a body into blocks (or inline data when `inline` allows and it
    /// is small), computing MD5 and `algo` on the way. Receiving, hashing and
    /// writing overlap; never more than a few blocks per upload, and
    /// [`BLOCK_BUDGET`] blocks over all uploads, are in memory.
    pub async fn ingest<S, E>(self: &Arc<Self>, body: S, algo: Option<ChecksumAlgo>, inline: bool) -> Result<Ingested>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let mut p = Pipeline {
            store: self.clone(),
            hasher: Some(BodyHasher::new(algo)),
            writes: FuturesOrdered::new(),
            refs: Vec::new(),
            pins: Pins::new(self),
            received: 0,
        };
        match p.run(body, inline).await {
            Ok(r) => Ok(r),
            Err(e) => {
                // Dropping `p` drops its pins; in-flight writes hold the
                // same set, which cleans up after the last of them.
                Err(e)
            }
        }
    }

    /// Streams `range` of an object, verifying every block as it is read.
    pub fn read(self: &Arc<Self>, meta: &ObjectMeta, range: Range<u64>) -> BoxStream<'static, Result<Bytes>> {
        let len = range.end.saturating_sub(range.start);
        self.metrics.add(&self.metrics.bytes_out, len);
        match &meta.data {
            ObjectData::Inline(d) => {
                let s = usize::try_from(range.start).unwrap_or(usize::MAX).min(d.len());
                let e = usize::try_from(range.end).unwrap_or(usize::MAX).min(d.len());
                let b = Bytes::copy_from_slice(&d[s..e]);
                stream::once(async move { Ok(b) }).boxed()
            }
            ObjectData::Blocks(blocks) => {
                let mut plan = Vec::new();
                let mut off = 0u64;
                for b in blocks {
                    let (start, end) = (off, off + u64::from(b.len));
                    off = end;
                    if end <= range.start || start >= range.end {
                        continue;
                    }
                    let cut_s = range.start.saturating_sub(start);
                    let cut_e = range.end.min(end) - start;
                    plan.push((b.hash, cut_s as usize..cut_e as usize));
                }
                let store = self.clone();
                // Pinned for the life of the stream: a concurrent delete of the
                // object leaves the files alone until this read is done.
                let pins = self.pin_all(plan.iter().map(|(h, _)| *h));
                stream::iter(plan)
                    .map(move |(hash, cut)| {
                        let _keep = &pins;
                        let store = store.clone();
                        async move {
                            let data = tokio::task::spawn_blocking(move || {
                                let r = store.blocks.get(&hash);
                                match &r {
                                    Ok(_) => store.metrics.inc(&store.metrics.blocks_read),
                                    Err(LightningError::CorruptBlock { .. }) => {
                                        store.metrics.inc(&store.metrics.corrupt_blocks);
                                    }
                                    Err(_) => {}
                                }
                                r
                            })
                            .await
                            .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
                            Ok(data.slice(cut))
                        }
                    })
                    .buffered(READS_AHEAD)
                    .boxed()
            }
        }
    }

    fn pin_all(self: &Arc<Self>, hashes: impl Iterator<Item = BlockHash>) -> Pins {
        let pins = Pins::new(self);
        for h in hashes {
            pins.add(h);
        }
        pins
    }

    /// Pins `blocks` and checks they are all present: the caller may then
    /// reference them from a new row without racing a delete.
    pub fn pin_existing(self: &Arc<Self>, blocks: &[BlockRef]) -> Result<Pins> {
        let pins = self.pin_all(blocks.iter().map(|b| b.hash));
        for b in blocks {
            if !self.blocks.contains(&b.hash)? {
                return Err(LightningError::MissingBlock { hash: b.hash.to_hex() });
            }
        }
        Ok(pins)
    }
}

/// Blocks in memory (being hashed or written) over all uploads.
pub const BLOCK_BUDGET: usize = 32;

type WriteJob = tokio::task::JoinHandle<(BlockHash, u32, Result<()>)>;

/// One upload's ingest state: the running body digests and the block writes
/// in flight.
struct Pipeline {
    store: Arc<Store>,
    hasher: Option<BodyHasher>,
    writes: FuturesOrdered<WriteJob>,
    refs: Vec<BlockRef>,
    pins: Pins,
    received: u64,
}

fn join_err(e: tokio::task::JoinError) -> LightningError {
    LightningError::Io(std::io::Error::other(e))
}

impl Pipeline {
    async fn run<S, E>(&mut self, body: S, inline: bool) -> Result<Ingested>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let bs = self.store.config.block_size;
        let mut body = std::pin::pin!(body);
        // The current block, as the body's own chunks (no copy).
        let mut parts: Vec<Bytes> = Vec::new();
        let mut filled = 0usize;
        while let Some(chunk) = body.next().await {
            let mut chunk = chunk.map_err(LightningError::body)?;
            self.received += chunk.len() as u64;
            // MD5 and the CRCs are sequential; hashing each chunk as it
            // arrives (like any streaming server) avoids a thread hand-off per
            // block. BLAKE3 runs with the block write on a blocking thread.
            if let Some(h) = self.hasher.as_mut() {
                h.update(&chunk);
            }
            while !chunk.is_empty() {
                let take = (bs - filled).min(chunk.len());
                parts.push(chunk.split_to(take));
                filled += take;
                if parts.len() >= MAX_PARTS {
                    // A client sending tiny chunks: coalesce rather than keep
                    // thousands of slices.
                    parts = vec![Bytes::from(parts.concat())];
                }
                if filled == bs {
                    self.push_block(std::mem::take(&mut parts), filled).await?;
                    filled = 0;
                }
            }
        }
        let data =
            if self.writes.is_empty() && self.refs.is_empty() && inline && filled <= self.store.config.inline_threshold
            {
                ObjectData::Inline(parts.concat())
            } else {
                if filled > 0 {
                    self.push_block(parts, filled).await?;
                }
                self.drain().await?;
                ObjectData::Blocks(std::mem::take(&mut self.refs))
            };
        let h = self.take_hasher()?;
        let (md5, checksum) = h.finalize();
        self.store.metrics.add(&self.store.metrics.bytes_in, self.received);
        Ok(Ingested { size: self.received, md5, checksum, data, pins: self.pins.clone() })
    }

    fn take_hasher(&mut self) -> Result<BodyHasher> {
        self.hasher.take().ok_or_else(|| LightningError::Db("body hasher lost".into()))
    }

    async fn push_block(&mut self, block: Vec<Bytes>, len: usize) -> Result<()> {
        let permit = self
            .store
            .budget
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?;
        let store = self.store.clone();
        let pins = self.pins.clone();
        self.writes.push_back(tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let hash = BlockHash::of_parts(&block);
            let len = u32::try_from(len).unwrap_or(u32::MAX);
            // Pin before writing: an existing identical block must not be
            // deleted between this put finding it and the commit.
            pins.add(hash);
            let r = store.blocks.put_parts(&hash, &block);
            if r.is_ok() {
                store.metrics.inc(&store.metrics.blocks_written);
            }
            (hash, len, r)
        }));
        while self.writes.len() > WRITES_IN_FLIGHT {
            self.finish_one().await?;
        }
        Ok(())
    }

    async fn finish_one(&mut self) -> Result<()> {
        let Some(job) = self.writes.next().await else {
            return Ok(());
        };
        let (hash, len, r) = job.map_err(join_err)?;
        r?;
        self.refs.push(BlockRef { hash, len });
        Ok(())
    }

    /// Waits for every write in flight; the first error wins.
    async fn drain(&mut self) -> Result<()> {
        let mut first = Ok(());
        while !self.writes.is_empty() {
            let r = self.finish_one().await;
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

/// A single node's keyring: its own metadata database.
#[async_trait::async_trait]
impl crate::keys::Keyring for Store {
    fn key(&self, id: &str) -> Result<Option<crate::keys::KeyMeta>> {
        Ok(self.meta.key_row(id)?.and_then(|r| r.key))
    }

    fn keys(&self) -> Result<Vec<(String, crate::keys::KeyMeta)>> {
        self.meta.keys()
    }

    fn perms(&self, bucket: &str, id: &str) -> Result<crate::keys::Perms> {
        self.meta.perms(bucket, id)
    }

    fn grants(&self) -> Result<Vec<(String, String, crate::keys::Perms)>> {
        let rows = self.meta.grant_rows()?;
        Ok(rows.into_iter().filter(|(_, _, g)| !g.perms.is_empty()).map(|(b, k, g)| (b, k, g.perms)).collect())
    }

    fn next_version(&self) -> u64 {
        self.meta.next_version()
    }

    async fn bucket_exists(&self, bucket: &str) -> Result<bool> {
        Ok(self.meta.get_bucket(bucket)?.is_some())
    }

    async fn apply(&self, rows: Vec<crate::keys::AuthRow>) -> Result<()> {
        self.meta.write(move |t| crate::meta::ops::merge_auth(t, &rows)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::memory::MemoryBlockStore;
    use crate::meta::ops;
    use futures::TryStreamExt;

    fn store(dir: &std::path::Path) -> (Arc<Store>, Arc<MemoryBlockStore>) {
        let mem = Arc::new(MemoryBlockStore::new());
        let cfg = Config { block_size: 4096, inline_threshold: 100, anonymous: true, ..Config::new(dir) };
        (Store::with_backends(cfg, mem.clone()).expect("store"), mem)
    }

    fn body(data: &[u8], piece: usize) -> impl Stream<Item = std::result::Result<Bytes, String>> + Send + use<> {
        let chunks: Vec<_> = data.chunks(piece.max(1)).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
        stream::iter(chunks)
    }

    async fn read_all(store: &Arc<Store>, meta: &ObjectMeta, r: Range<u64>) -> Result<Vec<u8>> {
        let parts: Vec<Bytes> = store.read(meta, r).try_collect().await?;
        Ok(parts.concat())
    }

    fn object(ing: &Ingested) -> ObjectMeta {
        ObjectMeta {
            version: 1,
            size: ing.size,
            etag: hex::encode(ing.md5),
            last_modified_ms: 0,
            headers: Default::default(),
            checksum: None,
            parts: vec![],
            data: ing.data.clone(),
            sse_c: None,
            versioned: None,
        }
    }

    #[tokio::test]
    async fn bodies_are_cut_into_blocks_and_read_back_in_any_range() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = store(dir.path());
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 256) as u8).collect();
        let ing = store.ingest(body(&data, 1000), None, true).await.expect("ingest");
        assert_eq!(ing.data.blocks().len(), 5);
        let meta = object(&ing);
        for r in [0..20_000u64, 0..1, 4095..4097, 8192..8192, 19_999..20_000, 100..12_345] {
            let got = read_all(&store, &meta, r.clone()).await.expect("read");
            assert_eq!(got, &data[r.start as usize..r.end as usize]);
        }
    }

    #[tokio::test]
    async fn small_bodies_are_stored_inline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, mem) = store(dir.path());
        let ing = store.ingest(body(b"tiny", 2), None, true).await.expect("ingest");
        assert_eq!(ing.data, ObjectData::Inline(b"tiny".to_vec()));
        assert!(mem.list().expect("list").is_empty());
    }

    #[tokio::test]
    async fn a_failed_upload_leaves_no_blocks_behind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, mem) = store(dir.path());
        let ing = store.ingest(body(&vec![3u8; 10_000], 500), None, true).await.expect("ingest");
        assert!(!mem.list().expect("list").is_empty());
        drop(ing); // never committed
        for _ in 0..100 {
            if mem.list().expect("list").is_empty() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("uncommitted blocks were not deleted");
    }

    #[tokio::test]
    async fn overwriting_an_object_frees_the_old_blocks_but_keeps_shared_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, mem) = store(dir.path());
        store.meta.write(|t| ops::create_bucket(t, "b", 0)).await.expect("bucket");
        let a: Vec<u8> = vec![1u8; 8192];
        let mut b = vec![1u8; 4096];
        b.extend(vec![2u8; 4096]);
        for data in [a, b] {
            let ing = store.ingest(body(&data, 4096), None, true).await.expect("ingest");
            let meta = object(&ing);
            let freed =
                store.meta.write(move |t| ops::put_object(t, "b", "k", &meta, &Default::default())).await.expect("put");
            ing.pins.release();
            store.delete_unused(&freed);
        }
        // Only [1;4096] (shared) and [2;4096] remain.
        assert_eq!(mem.list().expect("list").len(), 2);
        let freed = store.meta.write(|t| ops::delete_object(t, "b", "k")).await.expect("delete");
        store.delete_unused(&freed);
        assert!(mem.list().expect("list").is_empty());
    }

    #[tokio::test]
    async fn deleting_an_object_during_a_read_keeps_its_blocks_until_the_read_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, mem) = store(dir.path());
        store.meta.write(|t| ops::create_bucket(t, "b", 0)).await.expect("bucket");
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
        let ing = store.ingest(body(&data, 4096), None, true).await.expect("ingest");
        let meta = object(&ing);
        let row = meta.clone();
        store.meta.write(move |t| ops::put_object(t, "b", "k", &row, &Default::default())).await.expect("put");
        ing.pins.release();
        let mut reader = store.read(&meta, 0..20_000);
        let first = reader.next().await.expect("first").expect("ok");
        let freed = store.meta.write(|t| ops::delete_object(t, "b", "k")).await.expect("delete");
        store.delete_unused(&freed);
        let mut got = first.to_vec();
        while let Some(chunk) = reader.next().await {
            got.extend_from_slice(&chunk.expect("block still readable"));
        }
        assert_eq!(got, data);
        drop(reader);
        for _ in 0..100 {
            if mem.list().expect("list").is_empty() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("blocks of the deleted object were not collected after the read");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, u8, usize),
        Copy(u8, u8),
        Delete(u8),
    }

    fn arb_op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            // Few keys and few fill bytes: overwrites and shared blocks are common.
            (0u8..4, 0u8..3, 0usize..13_000).prop_map(|(k, b, n)| Op::Put(k, b, n)),
            (0u8..4, 0u8..4).prop_map(|(a, b)| Op::Copy(a, b)),
            (0u8..4).prop_map(Op::Delete),
        ]
    }

    async fn apply(store: &Arc<Store>, op: &Op, model: &mut std::collections::BTreeMap<String, Vec<u8>>) {
        match op.clone() {
            Op::Put(k, fill, n) => {
                let key = format!("k{k}");
                let data: Vec<u8> = (0..n).map(|i| fill.wrapping_add((i / 4096) as u8)).collect();
                let ing = store.ingest(body(&data, 1000), None, true).await.expect("ingest");
                let meta = object(&ing);
                let freed = store
                    .meta
                    .write(move |t| ops::put_object(t, "b", &key, &meta, &Default::default()))
                    .await
                    .expect("put");
                ing.pins.release();
                store.delete_unused(&freed);
                model.insert(format!("k{k}"), data);
            }
            Op::Copy(a, b) => {
                let (src, dst) = (format!("k{a}"), format!("k{b}"));
                let Some(meta) = store.meta.get_object("b", &src).expect("get") else {
                    return;
                };
                let pins = store.pin_existing(meta.data.blocks()).expect("pin");
                let d = dst.clone();
                let freed = store
                    .meta
                    .write(move |t| ops::put_object(t, "b", &d, &meta, &Default::default()))
                    .await
                    .expect("copy");
                pins.release();
                store.delete_unused(&freed);
                let v = model.get(&src).cloned().expect("model has source");
                model.insert(dst, v);
            }
            Op::Delete(k) => {
                let key = format!("k{k}");
                let freed = store.meta.write(move |t| ops::delete_object(t, "b", &key)).await.expect("delete");
                store.delete_unused(&freed);
                model.remove(&format!("k{k}"));
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        #[test]
        fn random_puts_copies_and_deletes_match_a_btreemap_and_leak_no_blocks(
            ops_list in proptest::collection::vec(arb_op(), 1..25)
        ) {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let dir = tempfile::tempdir().expect("tempdir");
                let (store, mem) = store(dir.path());
                store.meta.write(|t| ops::create_bucket(t, "b", 0)).await.expect("bucket");
                let mut model = std::collections::BTreeMap::new();
                for op in &ops_list {
                    apply(&store, op, &mut model).await;
                }
                // Contents.
                for (k, v) in &model {
                    let meta = store.meta.get_object("b", k).expect("get").expect("present");
                    assert_eq!(&read_all(&store, &meta, 0..meta.size).await.expect("read"), v);
                }
                // Listing.
                let page = store
                    .meta
                    .list_objects("b", &crate::listing::ListQuery { max_keys: 1000, ..Default::default() })
                    .expect("list");
                let listed: Vec<Vec<u8>> = page.entries.iter().map(|e| e.name().to_vec()).collect();
                let want: Vec<Vec<u8>> = model.keys().map(|k| k.as_bytes().to_vec()).collect();
                assert_eq!(listed, want);
                // Exactly the referenced blocks remain, with exact counts.
                let mut referenced = std::collections::HashMap::<BlockHash, u64>::new();
                for k in model.keys() {
                    let meta = store.meta.get_object("b", k).expect("get").expect("present");
                    for b in meta.data.blocks() {
                        *referenced.entry(b.hash).or_default() += 1;
                    }
                }
                let mut stored = mem.list().expect("list");
                stored.sort();
                let mut want_blocks: Vec<BlockHash> = referenced.keys().copied().collect();
                want_blocks.sort();
                assert_eq!(stored, want_blocks);
                for (h, n) in referenced {
                    assert_eq!(store.meta.refcount(&h).expect("refcount"), n);
                }
            });
        }
    }

    #[tokio::test]
    async fn a_corrupt_block_fails_the_read_instead_of_returning_bad_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, mem) = store(dir.path());
        let data = vec![9u8; 5000];
        let ing = store.ingest(body(&data, 5000), None, true).await.expect("ingest");
        let meta = object(&ing);
        let first = meta.data.blocks()[0].hash;
        mem.corrupt(&first, vec![0u8; 4096]);
        assert!(matches!(read_all(&store, &meta, 0..5000).await, Err(LightningError::CorruptBlock { .. })));
    }
}
