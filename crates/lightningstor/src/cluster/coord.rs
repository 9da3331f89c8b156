//! The coordinator side: any node turns an S3 request into replica
//! requests, waits for the quorum, and repairs what it sees stale.
//!
//! Writes: the body is cut into blocks, each sent to every replica of the
//! key (`PutBlock`, pinned in an upload session there); after the body is
//! verified the row is committed on every replica that has all blocks
//! (`Commit`). The write is acknowledged once every write set (one set
//! normally, the old and the new replica set during a layout change) has
//! W commits; replicas known to have missed it go to the resync queue
//! *before* the acknowledgement, one still answering finishes after it.
//! Past the quorum, slower replicas get a bounded grace (a hung node never
//! holds a write or read up for long); one that misses it is queued for
//! resync. Reads ask R replicas (more when one fails or is slow): one (this
//! node, when a replica) for its row and the others for its version (the
//! version asks of concurrent reads batched per replica), and
//! answer once R have answered, with the
//! highest version among them (fetched from a replica that reported it,
//! should that not be the row read); blocks stream from any
//! replica holding that version (verified by hash here). Replicas that
//! answer with an older row, also after the read has been answered, get
//! the winning row pushed (read repair).

use super::NodeId;
use super::batch::VersionAsk;
use super::config::Consistency;
use super::metrics::ClusterMetrics;
use super::node::Node;
use super::placement::Replication;
use super::rpc::{Msg, Req, Resp};
use crate::block::BlockHash;
use crate::checksum::{BodyHasher, Checksum, ChecksumAlgo};
use crate::error::{LightningError, Result};
use crate::meta::types::{BlockRef, ObjectData, ObjectMeta, Row, Versioned};
use bytes::Bytes;
use futures::future::FusedFuture as _;
use futures::stream::{self, BoxStream, FuturesOrdered, FuturesUnordered};
use futures::{Stream, StreamExt};
use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Blocks one upload keeps in flight to its replicas.
const BLOCKS_IN_FLIGHT: usize = 4;
/// Blocks a download prefetches.
const READS_AHEAD: usize = 3;
/// How long the replicas beyond the write quorum may lag behind it (on a
/// block or a commit) before the coordinator stops waiting for them: one
/// that has not answered by then has missed the write.
const STRAGGLER_GRACE: Duration = Duration::from_secs(2);
/// How long a read waits for the replicas it asked before it asks the
/// others of the key too.
const HEDGE: Duration = Duration::from_millis(50);
/// How long a row read waits for the replicas beyond its read quorum.
const READ_GRACE: Duration = Duration::from_millis(200);

/// What the block sends of one upload share.
struct Fanout {
    session: u64,
    /// Write sets of the key (two during a layout change).
    sets: Vec<Vec<NodeId>>,
    /// Their union: every replica a block goes to.
    targets: Vec<NodeId>,
    /// Replicas that missed a block (an error, or no answer in the grace).
    failed: Mutex<HashSet<NodeId>>,
    /// Sends still running past their block's quorum.
    stragglers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Fanout {
    fn missed(&self, n: NodeId, why: &str) {
        tracing::debug!(node = n, error = why, "replica missed a block");
        if let Ok(mut f) = self.failed.lock() {
            f.insert(n);
        }
    }
}

/// A body sent to the replicas, not yet committed.
#[derive(Debug)]
pub struct Staged {
    /// Bytes received.
    pub size: u64,
    /// MD5 of the body.
    pub md5: [u8; 16],
    /// Extra checksum, if asked for.
    pub checksum: Option<Checksum>,
    /// Inline bytes or the block list.
    pub data: ObjectData,
    /// Upload session the replicas pinned the blocks under.
    pub session: u64,
    /// Replicas that stored every block.
    pub complete: Vec<NodeId>,
}

/// What a quorum read found.
#[derive(Debug, Clone)]
pub struct ReadOutcome {
    /// The newest row, if any replica has one.
    pub row: Option<Row>,
    /// Where to read blocks from, in order: the replicas that answered
    /// with exactly that row, then the key's other replicas (tried only
    /// when every one before has failed a block).
    pub holders: Vec<NodeId>,
}

/// What a replica answered to a row read: the row, or only its version.
#[derive(Debug)]
enum Heard {
    Row(Option<Row>),
    Version(u64),
}

impl Heard {
    fn from(r: Resp) -> Option<Heard> {
        match r {
            Resp::Row(r) => Some(Heard::Row(r)),
            Resp::Version(v) => Some(Heard::Version(v)),
            _ => None,
        }
    }

    fn version(&self) -> u64 {
        match self {
            Heard::Row(r) => r.as_ref().map_or(0, Row::version),
            Heard::Version(v) => *v,
        }
    }
}

pub(crate) fn union(sets: &[Vec<NodeId>]) -> Vec<NodeId> {
    let mut out: Vec<NodeId> = Vec::new();
    for s in sets {
        for n in s {
            if !out.contains(n) {
                out.push(*n);
            }
        }
    }
    out
}

/// The coordinator role of a node: it turns S3 requests into replica
/// requests through the node ([`Node::call`], its layout and clock) and
/// keeps what only coordinating needs: the memory budget of the uploads it
/// runs, the turns of the replicas its reads ask, and the batches of its
/// version asks. The S3 front end's engine ([`super::engine`]) and the
/// repair worker ([`super::repair`]) work over it.
pub struct Coordinator {
    /// The node this coordinator runs on.
    pub node: Arc<Node>,
    /// This coordinator, for work that needs an owning handle.
    pub(super) me: std::sync::Weak<Coordinator>,
    /// Blocks in memory over all uploads this node coordinates.
    pub(crate) budget: Arc<tokio::sync::Semaphore>,
    /// Turns of the remote replicas a read asks (see [`Coordinator::read_row`]).
    pub(crate) read_turn: std::sync::atomic::AtomicUsize,
    /// Reads' version asks waiting for their replica's next batch.
    pub(crate) version_asks: super::batch::Batches<VersionAsk>,
    /// Replicas that answered version asks as unsupported (an older
    /// build): reads ask them for rows for a while.
    pub(crate) old_builds: super::batch::OldBuilds,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("node", &self.node.id).finish_non_exhaustive()
    }
}

impl Coordinator {
    /// The coordinator of `node`.
    pub fn new(node: Arc<Node>) -> Arc<Self> {
        Arc::new_cyclic(|me| Coordinator {
            node,
            me: me.clone(),
            budget: Arc::new(tokio::sync::Semaphore::new(crate::store::BLOCK_BUDGET)),
            read_turn: std::sync::atomic::AtomicUsize::new(0),
            version_asks: super::batch::Batches::new(1),
            old_builds: super::batch::OldBuilds::default(),
        })
    }

    /// A repair worker that works through this coordinator.
    pub fn repair(self: &Arc<Self>) -> super::repair::Repair {
        super::repair::Repair::new(self.clone())
    }
}

pub(crate) fn session_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.finish()
}

impl Coordinator {
    pub(crate) fn need_w(&self, set: usize) -> usize {
        match self.node.consistency() {
            Consistency::Consistent => self.node.layout().write_quorum().min(set).max(1),
            Consistency::Degraded => 1,
        }
    }

    pub(crate) fn need_r(&self, set: usize) -> usize {
        match self.node.consistency() {
            Consistency::Consistent => self.node.layout().read_quorum().min(set).max(1),
            Consistency::Degraded => 1,
        }
    }

    pub(crate) fn quorum_failed(&self, what: &str) -> LightningError {
        ClusterMetrics::inc(&self.node.metrics.quorum_failures);
        LightningError::Unavailable(what.to_owned())
    }

    /// Streams a body to the replicas of (bucket, key), computing MD5 and
    /// `algo` on the way. Small bodies (when `inline`) stay in the row.
    ///
    /// Each block is done once every write set has W copies; the other
    /// replicas get [`STRAGGLER_GRACE`] more (awaited before this returns).
    /// One that errs or lags longer has missed the block: it gets no more
    /// blocks of this upload and is left out of `complete`, so a hung node
    /// costs an upload seconds, not the transport's timeout.
    pub async fn stage<S, E>(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        body: S,
        algo: Option<ChecksumAlgo>,
        inline: bool,
    ) -> Result<Staged>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let sets = self.node.write_sets(bucket, key);
        let fan = Arc::new(Fanout {
            session: session_id(),
            targets: union(&sets),
            sets,
            failed: Mutex::default(),
            stragglers: Mutex::default(),
        });
        let bs = self.node.store.config.block_size;
        let inline_max = self.node.store.config.inline_threshold;
        let mut hasher = BodyHasher::new(algo);
        let mut writes = FuturesOrdered::new();
        let mut refs: Vec<BlockRef> = Vec::new();
        let mut parts: Vec<Bytes> = Vec::new();
        let mut filled = 0usize;
        let mut received = 0u64;
        let mut sent_any = false;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let mut chunk = chunk.map_err(LightningError::body)?;
            received += chunk.len() as u64;
            hasher.update(&chunk);
            while !chunk.is_empty() {
                let take = (bs - filled).min(chunk.len());
                parts.push(chunk.split_to(take));
                filled += take;
                if filled == bs {
                    writes.push_back(self.send_block(std::mem::take(&mut parts), &fan));
                    sent_any = true;
                    filled = 0;
                    while writes.len() >= BLOCKS_IN_FLIGHT {
                        if let Some(r) = writes.next().await {
                            refs.push(r?);
                        }
                        self.check_alive(&fan)?;
                    }
                }
            }
        }
        let data = if !sent_any && inline && filled <= inline_max {
            ObjectData::Inline(parts.concat())
        } else {
            if filled > 0 {
                writes.push_back(self.send_block(parts, &fan));
            }
            while let Some(r) = writes.next().await {
                refs.push(r?);
            }
            ObjectData::Blocks(refs)
        };
        let stragglers = fan.stragglers.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default();
        for s in stragglers {
            let _ = s.await;
        }
        self.check_alive(&fan)?;
        let failed = fan.failed.lock().map(|f| f.clone()).unwrap_or_default();
        let complete = fan.targets.iter().copied().filter(|n| !failed.contains(n)).collect();
        let (md5, checksum) = hasher.finalize();
        self.node.store.metrics.add(&self.node.store.metrics.bytes_in, received);
        Ok(Staged { size: received, md5, checksum, data, session: fan.session, complete })
    }

    fn check_alive(&self, fan: &Fanout) -> Result<()> {
        let failed = fan.failed.lock().map(|f| f.clone()).unwrap_or_default();
        for s in &fan.sets {
            let alive = s.iter().filter(|n| !failed.contains(n)).count();
            if alive < self.need_w(s.len()) {
                return Err(self.quorum_failed(&format!(
                    "only {alive} of {} replicas accepted the data (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        Ok(())
    }

    /// Whether every write set in `sets` has W of `ok`.
    fn has_quorum(&self, sets: &[Vec<NodeId>], ok: &HashSet<NodeId>) -> bool {
        sets.iter().all(|s| s.iter().filter(|n| ok.contains(n)).count() >= self.need_w(s.len()))
    }

    fn send_block(self: &Arc<Self>, parts: Vec<Bytes>, fan: &Arc<Fanout>) -> BoxFuture {
        let node = self.clone();
        let fan = fan.clone();
        tokio::spawn(async move {
            let permit =
                node.budget.clone().acquire_owned().await.map_err(|e| LightningError::Io(std::io::Error::other(e)))?;
            let (hash, data) = tokio::task::spawn_blocking(move || {
                let data = if parts.len() == 1 {
                    parts.into_iter().next().unwrap_or_default()
                } else {
                    Bytes::from(parts.concat())
                };
                (BlockHash::of(&data), data)
            })
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?;
            let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
            let live: Vec<NodeId> = {
                let f = fan.failed.lock().map(|f| f.clone()).unwrap_or_default();
                fan.targets.iter().copied().filter(|n| !f.contains(n)).collect()
            };
            let session = fan.session;
            let mut pending: FuturesUnordered<_> = live
                .iter()
                .map(|&n| {
                    let node = node.clone();
                    let data = data.clone();
                    async move { (n, node.node.call(n, Msg::with_data(Req::PutBlock { session, hash }, data)).await) }
                })
                .collect();
            let mut ok = HashSet::new();
            while !node.has_quorum(&fan.sets, &ok) {
                match pending.next().await {
                    Some((n, Ok(_))) => {
                        ok.insert(n);
                    }
                    Some((n, Err(e))) => fan.missed(n, &e.to_string()),
                    None => break,
                }
            }
            node.node.store.metrics.inc(&node.node.store.metrics.blocks_written);
            if !pending.is_empty() {
                // The other replicas finish in the background, still holding
                // this block's share of the memory budget, for a bounded time.
                let f = fan.clone();
                let late = tokio::spawn(async move {
                    let deadline = tokio::time::sleep(STRAGGLER_GRACE);
                    tokio::pin!(deadline);
                    loop {
                        tokio::select! {
                            r = pending.next() => match r {
                                Some((n, Ok(_))) => {
                                    ok.insert(n);
                                }
                                Some((n, Err(e))) => f.missed(n, &e.to_string()),
                                None => break,
                            },
                            () = &mut deadline => {
                                for n in live.iter().filter(|n| !ok.contains(n)) {
                                    f.missed(*n, "no answer within the straggler grace");
                                }
                                break;
                            }
                        }
                    }
                    drop(permit);
                });
                if let Ok(mut s) = fan.stragglers.lock() {
                    s.push(late);
                }
            }
            Ok(BlockRef { hash, len })
        })
        .map_join()
    }

    /// Commits `row` on the replicas in `complete` (those that hold its
    /// blocks) and acknowledges as soon as every write set has its quorum.
    /// Replicas already known to have missed it (no blocks, an error) are
    /// queued for resync before the acknowledgement; a replica still
    /// answering then finishes in the background and is queued if it fails.
    /// (Should this node die in between, that replica lacks a row W others
    /// hold: reads still see it, R + W > N, and anti-entropy copies it.)
    ///
    /// A fresh row's version comes from this node's clock, which may trail
    /// another coordinator's by a little (two writes in one millisecond, a
    /// clock not yet advanced by the other's rows). When a replica of the
    /// quorum answers that it holds a newer row, that row may be a write
    /// acknowledged before this one began, which this one must replace: the
    /// row is committed once more at a version above it. (A newer row from a
    /// write that overlaps this one in time may be replaced too; either
    /// order is correct for overlapping writes.)
    pub async fn commit_row(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        row: Row,
        session: u64,
        complete: &[NodeId],
    ) -> Result<()> {
        let newest = self.commit_attempt(bucket, key, &row, session, complete).await?;
        if let Some(row) = self.above(newest, &row) {
            self.commit_attempt(bucket, key, &row, session, complete).await?;
        }
        Ok(())
    }

    /// `row` at a fresh version above `newest`, if a replica answered that
    /// it holds a newer one (see [`Coordinator::commit_row`]).
    pub(crate) fn above(&self, newest: u64, row: &Row) -> Option<Row> {
        if newest <= row.version() {
            return None;
        }
        // A version of a versioned bucket's key keeps its id: the replicas
        // keep it as a version whichever row is newest. (Its coordinator
        // read the key first, so only a write overlapping it is newer.)
        if let Row::Object(m) = row
            && matches!(m.versioned, Some(Versioned::Id | Versioned::Null))
        {
            return None;
        }
        ClusterMetrics::inc(&self.node.metrics.recommits);
        self.node.hlc.observe(newest);
        Some(row.clone().with_version(self.node.hlc.now()))
    }

    /// One round of [`Coordinator::commit_row`]; returns the newest version the
    /// acknowledging replicas hold for the key.
    async fn commit_attempt(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        row: &Row,
        session: u64,
        complete: &[NodeId],
    ) -> Result<u64> {
        let sets = self.node.write_sets(bucket, key);
        let targets = union(&sets);
        let mut pending: FuturesUnordered<_> = complete
            .iter()
            .filter(|n| targets.contains(n))
            .map(|&n| {
                let node = self.clone();
                let (bucket, key, row) = (bucket.to_owned(), key.to_vec(), row.clone());
                async move {
                    let make = || Req::Commit { session, bucket: bucket.clone(), key: key.clone(), row: row.clone() };
                    (n, node.call_write(n, &bucket, make).await)
                }
            })
            .collect();
        let mut ok = HashSet::new();
        let mut newest = 0;
        let mut missed: Vec<NodeId> = targets.iter().copied().filter(|n| !complete.contains(n)).collect();
        let mut bucket_gone = false;
        while !self.has_quorum(&sets, &ok) {
            match pending.next().await {
                Some((n, Ok(reply))) => {
                    if let Resp::Committed { current, .. } = reply.head {
                        newest = newest.max(current);
                    }
                    ok.insert(n);
                }
                Some((n, Err(e))) => {
                    tracing::debug!(node = n, error = %e, "replica missed a commit");
                    bucket_gone |= matches!(e, LightningError::NoSuchBucket(_));
                    missed.push(n);
                }
                None => break,
            }
        }
        for s in &sets {
            let acks = s.iter().filter(|n| ok.contains(n)).count();
            if acks < self.need_w(s.len()) {
                if bucket_gone {
                    self.undo_commit(bucket, key, row, &ok).await;
                    return Err(LightningError::NoSuchBucket(bucket.to_owned()));
                }
                return Err(self.quorum_failed(&format!(
                    "only {acks} of {} replicas committed (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        if !missed.is_empty() {
            self.queue_missed(bucket, key, &missed).await?;
        }
        if !pending.is_empty() {
            let (node, bucket, key) = (self.clone(), bucket.to_owned(), key.to_vec());
            let mut waiting: HashSet<NodeId> = complete
                .iter()
                .copied()
                .filter(|n| targets.contains(n) && !ok.contains(n) && !missed.contains(n))
                .collect();
            tokio::spawn(async move {
                // A replica that errs, or has not answered within the grace
                // (a hung node), is queued; resync is idempotent.
                let mut late = Vec::new();
                let deadline = tokio::time::sleep(STRAGGLER_GRACE);
                tokio::pin!(deadline);
                loop {
                    tokio::select! {
                        r = pending.next() => match r {
                            Some((n, r)) => {
                                waiting.remove(&n);
                                if let Err(e) = r {
                                    tracing::debug!(node = n, error = %e, "replica missed a commit after the acknowledgement");
                                    late.push(n);
                                }
                            }
                            None => break,
                        },
                        () = &mut deadline => {
                            tracing::debug!(nodes = ?waiting, "replicas gave no answer to a commit within the grace");
                            late.extend(waiting.drain());
                            break;
                        }
                    }
                }
                if !late.is_empty()
                    && let Err(e) = node.queue_missed(&bucket, &key, &late).await
                {
                    tracing::warn!(error = %e, "could not queue a resync; anti-entropy will repair it");
                }
            });
        }
        Ok(newest)
    }

    /// After a write failed because its bucket was deleted on the replicas
    /// that refused it (the write raced DeleteBucket): the replicas in `ok`,
    /// which committed `row` before the delete reached them (and so refuse
    /// the delete), get a tombstone above it, so the failed write leaves no
    /// object behind once the delete is retried or undone. Best effort: one
    /// that misses it keeps the row until a delete of the key.
    pub(crate) async fn undo_commit(self: &Arc<Self>, bucket: &str, key: &[u8], row: &Row, ok: &HashSet<NodeId>) {
        if ok.is_empty() || matches!(row, Row::Tombstone(_)) {
            return;
        }
        self.node.hlc.observe(row.version());
        let tomb = Row::Tombstone(self.node.hlc.now());
        let calls = ok.iter().map(|&n| {
            let node = self.clone();
            let req = Req::Commit { session: 0, bucket: bucket.to_owned(), key: key.to_vec(), row: tomb.clone() };
            async move { (n, node.node.call(n, Msg::new(req)).await) }
        });
        for (n, r) in futures::future::join_all(calls).await {
            if let Err(e) = r {
                tracing::warn!(node = n, error = %e, "a write refused for its deleted bucket left its row on a replica");
            }
        }
    }

    /// Queues (bucket, key) for resync to `nodes` (persisted before it returns).
    pub(super) async fn queue_missed(self: &Arc<Self>, bucket: &str, key: &[u8], nodes: &[NodeId]) -> Result<()> {
        ClusterMetrics::inc(&self.node.metrics.degraded_writes);
        let missed: Vec<(NodeId, String, Vec<u8>, bool)> =
            nodes.iter().map(|&n| (n, bucket.to_owned(), key.to_vec(), false)).collect();
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.node.resync.add(&missed))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// Writes a row whose blocks are already on the replicas (tombstones,
    /// copies within the same replica set) or inline.
    pub async fn write_row(self: &Arc<Self>, bucket: &str, key: &[u8], row: Row) -> Result<()> {
        let targets = union(&self.node.write_sets(bucket, key));
        self.commit_row(bucket, key, row, 0, &targets).await
    }

    /// Reads the row of a key from its replicas; `Unavailable` when fewer
    /// than R answer. Stale replicas are repaired in the background.
    ///
    /// A consistent read asks R replicas, not all: this node when it is a
    /// replica, and remote ones in turns; the others only when one of those
    /// fails or has not answered within [`HEDGE`]. Only one replica is asked
    /// for the row itself: this node when it is a replica (a local read),
    /// else the first asked. The others are asked for its version only
    /// ([`Req::RowVersions`], one message per replica for the asks of all
    /// the reads under way: [`super::batch`]), so a small object crosses
    /// the network once, not once per replica. Should a replica report a newer version than
    /// the row read, that row is fetched from it before answering. (During
    /// a layout change, and in degraded mode, every replica is asked for
    /// its row, as before.)
    ///
    /// With consistent reads the answer goes out as soon as R replicas of
    /// the (newest) set have answered, the one read the row from among them:
    /// R + W > N, so one of them holds every acknowledged write, and the
    /// holders the body is read from then include this node, whose blocks
    /// are read locally (and whose bad copies that read repairs). Replicas
    /// asked and still to answer are heard in the background (for read
    /// repair), not waited for. A degraded read (R = 1) still waits up to
    /// the grace for the others, so it returns the newest row any reachable
    /// replica has.
    pub async fn read_row(self: &Arc<Self>, bucket: &str, key: &[u8]) -> Result<ReadOutcome> {
        let sets = self.node.write_sets(bucket, key);
        // During a layout change the old set holds every acknowledged row.
        let quorum_set = sets.last().cloned().unwrap_or_default();
        let ask = union(&sets);
        let need = self.need_r(quorum_set.len());
        let wait_for_all = matches!(self.node.consistency(), Consistency::Degraded);
        // Whom to ask first. A consistent read in one replica set asks R
        // replicas: this node when it is one, and remote ones in turns (so
        // the load, and the read repair, go round them); the rest are
        // spares, asked only when one of those fails or is slow (HEDGE).
        // During a layout change and in degraded mode every replica is asked.
        let (first, mut spares): (Vec<NodeId>, Vec<NodeId>) = if sets.len() == 1 && !wait_for_all {
            let mut others: Vec<NodeId> = ask.iter().copied().filter(|n| *n != self.node.id).collect();
            // In id order, not the key's placement order: the turns then
            // go round the nodes, whatever the keys read.
            others.sort_unstable();
            if !others.is_empty() {
                let turn = self.read_turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % others.len();
                others.rotate_left(turn);
            }
            let mut first = Vec::new();
            if ask.contains(&self.node.id) {
                first.push(self.node.id);
            }
            let more = need.saturating_sub(first.len()).min(others.len());
            first.extend(others.drain(..more));
            (first, others)
        } else {
            (ask.clone(), Vec::new())
        };
        // The replica the row is read from; the others send versions.
        let reader = match sets.len() {
            1 => first.first().copied(),
            _ => None,
        };
        let call = |n: NodeId| {
            let node = self.clone();
            let (bucket, key) = (bucket.to_owned(), key.to_vec());
            let whole = reader.is_none_or(|r| r == n);
            async move {
                let version = if whole || node.old_builds.is_old(n, Instant::now()) {
                    None
                } else {
                    Some(node.ask_version(n, bucket.clone(), key.clone()).await)
                };
                let reply = match version {
                    Some(Ok(v)) => Ok(Msg::new(Resp::Version(v))),
                    Some(Err(e)) if !matches!(e, LightningError::UnsupportedRequest(_)) => Err(e),
                    // The row itself, also from a replica of an older build
                    // that knows no version asks (a rolling upgrade): every
                    // build answers GetRow, so the read keeps its quorum.
                    _ => {
                        ClusterMetrics::inc(&node.node.metrics.read_rows_fetched);
                        node.node.call(n, Msg::new(Req::GetRow { bucket, key })).await
                    }
                };
                (n, reply)
            }
        };
        let mut calls: FuturesUnordered<_> = first.iter().map(|&n| call(n)).collect();
        let mut replies: Vec<(NodeId, Heard)> = Vec::new();
        let answered =
            |replies: &[(NodeId, Heard)]| quorum_set.iter().filter(|n| replies.iter().any(|(m, _)| m == *n)).count();
        // This node's own answer (a local read) is always waited for; an
        // error counts as heard, so a failing local read does not make the
        // read wait for every remote one. (A remote reader is not waited
        // for: should the quorum come without its row, the row is fetched
        // from a replica that reported the newest version.)
        let mut local_pending = ask.contains(&self.node.id);
        // Every answer until the quorum; for a degraded read, past it, those
        // that come within a short grace, so a hung replica does not hold
        // the read up.
        let mut grace = std::pin::pin!(futures::future::Fuse::terminated());
        let mut hedge = std::pin::pin!(futures::FutureExt::fuse(tokio::time::sleep(HEDGE)));
        loop {
            if answered(&replies) >= need && !local_pending {
                if !wait_for_all {
                    break;
                }
                if grace.is_terminated() {
                    grace.set(futures::FutureExt::fuse(tokio::time::sleep(READ_GRACE)));
                }
            }
            if calls.is_empty() {
                if spares.is_empty() {
                    break;
                }
                // Every replica asked has answered, short of the quorum.
                calls.extend(spares.drain(..).map(call));
            }
            let next = tokio::select! {
                r = calls.next(), if !calls.is_empty() => r,
                () = &mut grace => None,
                () = &mut hedge, if !spares.is_empty() => {
                    ClusterMetrics::inc(&self.node.metrics.hedged_reads);
                    calls.extend(spares.drain(..).map(call));
                    continue;
                }
            };
            if next.as_ref().is_some_and(|(n, _)| *n == self.node.id) {
                local_pending = false;
            }
            let heard = match next {
                Some((n, Ok(m))) => Heard::from(m.head).map(|h| (n, h)),
                Some(_) => None,
                None => break,
            };
            match heard {
                Some(h) => replies.push(h),
                // A replica asked failed: ask the spares now.
                None if !spares.is_empty() => {
                    ClusterMetrics::inc(&self.node.metrics.hedged_reads);
                    calls.extend(spares.drain(..).map(call));
                }
                None => {}
            }
        }
        let answered = answered(&replies);
        if answered < need {
            return Err(self.quorum_failed(&format!(
                "only {answered} of {} replicas answered (read quorum {need})",
                quorum_set.len(),
            )));
        }
        let v = replies.iter().map(|(_, h)| h.version()).max().unwrap_or(0);
        let mut best = replies.iter().find_map(|(_, h)| match h {
            Heard::Row(Some(r)) if r.version() == v => Some(r.clone()),
            _ => None,
        });
        if best.is_none() && v > 0 {
            // A replica holds a newer row than the one read (or the reader
            // failed): read it from one that reported it.
            let newest: Vec<NodeId> = replies.iter().filter(|(_, h)| h.version() == v).map(|(n, _)| *n).collect();
            for n in &newest {
                ClusterMetrics::inc(&self.node.metrics.read_rows_fetched);
                let req = Req::GetRow { bucket: bucket.to_owned(), key: key.to_vec() };
                if let Ok(Msg { head: Resp::Row(Some(r)), .. }) = self.node.call(*n, Msg::new(req)).await
                    && r.version() >= v
                {
                    // (Newer still, if a write landed in between: it holds
                    // that row's blocks.)
                    for (m, h) in replies.iter_mut() {
                        if m == n {
                            *h = Heard::Version(r.version());
                        }
                    }
                    best = Some(r);
                    break;
                }
            }
            if best.is_none() {
                return Err(
                    self.quorum_failed(&format!("no replica that reported version {v} of the row answered with it"))
                );
            }
        }
        let v = best.as_ref().map_or(0, Row::version);
        // A write that follows this read gets a version above what it saw.
        self.node.hlc.observe(v);
        let mut holders: Vec<NodeId> = replies.iter().filter(|(_, h)| h.version() == v).map(|(n, _)| *n).collect();
        // Then the key's other replicas, for blocks every holder lacks or
        // holds corrupt: one that had not yet answered (or not yet
        // committed) may hold a good copy. Blocks are named by their hash
        // and verified here, so any copy that checks out is the right one.
        holders.extend(ask.iter().filter(|n| !holders.contains(n)).copied().collect::<Vec<_>>());
        if let Some(row) = &best {
            for (n, h) in &replies {
                if h.version() < v {
                    self.read_repair(*n, bucket, key, row);
                }
            }
            if !calls.is_empty() {
                // The replicas the read did not wait for: heard within the
                // grace, repaired if behind.
                let (node, b, k, row) = (self.clone(), bucket.to_owned(), key.to_vec(), row.clone());
                tokio::spawn(async move {
                    let late = tokio::time::timeout(READ_GRACE, async {
                        while let Some((n, reply)) = calls.next().await {
                            if let Some(h) = reply.ok().and_then(|m| Heard::from(m.head))
                                && h.version() < v
                            {
                                node.read_repair(n, &b, &k, &row);
                            }
                        }
                    });
                    let _ = late.await;
                });
            }
        }
        Ok(ReadOutcome { row: best, holders })
    }

    /// The version of replica `n`'s row for a key (0: none), asked in the
    /// next batch of version asks to `n` ([`super::batch`]): the sender
    /// for `n` is started here when none runs.
    async fn ask_version(self: &Arc<Self>, n: NodeId, bucket: String, key: Vec<u8>) -> Result<u64> {
        ClusterMetrics::inc(&self.node.metrics.read_versions_asked);
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.version_asks.push(n, VersionAsk { bucket, key, reply }) {
            // Its own task: a read that stops waiting (it has its quorum,
            // or failed) must not stop the batch the other reads wait on.
            tokio::spawn(self.clone().send_version_asks(n));
        }
        answer.await.map_err(|_| LightningError::Unavailable(format!("node {n}: version ask dropped")))?
    }

    /// Sends the batches of version asks waiting for `n`, one at a time,
    /// until none wait; asks whose reads have gone are left out.
    async fn send_version_asks(self: Arc<Self>, n: NodeId) {
        while let Some(batch) = self.version_asks.next(n, |a| !a.reply.is_closed()) {
            ClusterMetrics::inc(&self.node.metrics.version_batches);
            let (keys, replies): (Vec<_>, Vec<_>) =
                batch.into_iter().map(|a| ((a.bucket, serde_bytes::ByteBuf::from(a.key)), a.reply)).unzip();
            let count = keys.len();
            match self.node.call(n, Msg::new(Req::RowVersions { keys })).await {
                Ok(Msg { head: Resp::RowVersions(versions), .. }) if versions.len() == count => {
                    for (reply, v) in replies.into_iter().zip(versions) {
                        let _ = reply.send(Ok(v));
                    }
                }
                Err(LightningError::UnsupportedRequest(why)) => {
                    // An older build: these reads, and those of the next
                    // while, ask it for rows (see [`super::batch`]).
                    tracing::info!(node = n, %why, "replica answers version asks as unsupported; reads fetch its rows");
                    self.old_builds.mark(n, Instant::now());
                    for reply in replies {
                        let _ = reply.send(Err(super::batch::unsupported(n, &why)));
                    }
                }
                other => {
                    let why = match other {
                        Err(e) => e.to_string(),
                        Ok(m) => format!("unexpected answer to RowVersions: {:?}", m.head),
                    };
                    for reply in replies {
                        let _ = reply.send(Err(LightningError::Unavailable(format!("node {n}: {why}"))));
                    }
                }
            }
        }
    }

    /// Pushes `row` to replica `n`, which answered a read with an older one;
    /// queued for resync when that fails.
    fn read_repair(self: &Arc<Self>, n: NodeId, bucket: &str, key: &[u8], row: &Row) {
        ClusterMetrics::inc(&self.node.metrics.read_repairs);
        let (node, b, k, row) = (self.clone(), bucket.to_owned(), key.to_vec(), row.clone());
        tokio::spawn(async move {
            if let Err(e) = node.push_row(n, &b, &k, &row).await {
                tracing::debug!(node = n, error = %e, "read repair failed; queued");
                let _ = node.node.resync.add(&[(n, b, k, false)]);
            }
        });
    }

    /// Reads one block from the first of `holders` with a good copy
    /// (verified here), and repairs the bad copies it met on the way.
    pub async fn fetch_block(self: &Arc<Self>, hash: BlockHash, holders: &[NodeId]) -> Result<Bytes> {
        let mut order: Vec<NodeId> = holders.to_vec();
        order.sort_by_key(|n| *n != self.node.id);
        let mut bad = Vec::new();
        let mut last = LightningError::MissingBlock { hash: hash.to_hex() };
        for n in order {
            match self.node.call(n, Msg::new(Req::GetBlock { hash })).await {
                Ok(m) => {
                    let data = m.data;
                    let ok = {
                        let d = data.clone();
                        if n == self.node.id {
                            true
                        } else {
                            tokio::task::spawn_blocking(move || crate::block::verify(&hash, &d).is_ok())
                                .await
                                .unwrap_or(false)
                        }
                    };
                    if !ok {
                        bad.push(n);
                        continue;
                    }
                    for b in bad {
                        ClusterMetrics::inc(&self.node.metrics.bad_copies_found);
                        let node = self.clone();
                        let d = data.clone();
                        tokio::spawn(async move {
                            if node.node.call(b, Msg::with_data(Req::RepairBlock { hash }, d)).await.is_ok() {
                                ClusterMetrics::inc(&node.node.metrics.repairs);
                            }
                        });
                    }
                    return Ok(data);
                }
                Err(e @ (LightningError::CorruptBlock { .. } | LightningError::MissingBlock { .. })) => {
                    bad.push(n);
                    last = e;
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Streams `range` of an object from its holders.
    pub fn read_body(
        self: &Arc<Self>,
        meta: &ObjectMeta,
        range: Range<u64>,
        holders: Vec<NodeId>,
    ) -> BoxStream<'static, Result<Bytes>> {
        let len = range.end.saturating_sub(range.start);
        self.node.store.metrics.add(&self.node.store.metrics.bytes_out, len);
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
                    let cut_s = range.start.saturating_sub(start) as usize;
                    let cut_e = (range.end.min(end) - start) as usize;
                    plan.push((b.hash, cut_s..cut_e));
                }
                let node = self.clone();
                let holders = Arc::new(holders);
                stream::iter(plan)
                    .map(move |(hash, cut)| {
                        let node = node.clone();
                        let holders = holders.clone();
                        async move { Ok(node.fetch_block(hash, &holders).await?.slice(cut)) }
                    })
                    .buffered(READS_AHEAD)
                    .boxed()
            }
        }
    }

    /// Brings replica `to` up to `row`: sends the blocks it lacks (read
    /// from any other replica), then commits the row there. Returns the
    /// version `to` holds afterwards (above the row's if it had a newer one).
    pub async fn push_row(self: &Arc<Self>, to: NodeId, bucket: &str, key: &[u8], row: &Row) -> Result<u64> {
        self.push_row_of(to, bucket, key, row, None).await
    }

    /// [`Coordinator::push_row`]; with `upload`, the row is that completed
    /// upload's and the replica drops the upload with the commit
    /// ([`Req::CompleteUpload`]).
    pub(crate) async fn push_row_of(
        self: &Arc<Self>,
        to: NodeId,
        bucket: &str,
        key: &[u8],
        row: &Row,
        upload: Option<&str>,
    ) -> Result<u64> {
        let session = session_id();
        if let Row::Object(m) = row
            && !m.data.blocks().is_empty()
        {
            let hashes: Vec<BlockHash> = m.data.blocks().iter().map(|b| b.hash).collect();
            let missing = match self.node.call(to, Msg::new(Req::MissingBlocks { hashes })).await?.head {
                Resp::Missing(m) => m,
                _ => return Err(LightningError::Unavailable("unexpected answer to MissingBlocks".into())),
            };
            let sources: Vec<NodeId> =
                union(&self.node.write_sets(bucket, key)).into_iter().filter(|n| *n != to).collect();
            for hash in missing {
                let data = self.fetch_block(hash, &sources).await?;
                self.node.call(to, Msg::with_data(Req::PutBlock { session, hash }, data)).await?;
            }
        }
        let make = || {
            let (bucket, key, row) = (bucket.to_owned(), key.to_vec(), row.clone());
            match upload {
                None => Req::Commit { session, bucket, key, row },
                Some(id) => Req::CompleteUpload { session, id: id.to_owned(), bucket, key, row },
            }
        };
        match self.call_write(to, bucket, make).await?.head {
            Resp::Committed { applied, current } => {
                if applied && upload.is_none() {
                    ClusterMetrics::inc(&self.node.metrics.repairs);
                }
                Ok(current)
            }
            other => Err(LightningError::Unavailable(format!("unexpected answer to Commit: {other:?}"))),
        }
    }
}

trait MapJoin {
    fn map_join(self) -> BoxFuture;
}

type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<BlockRef>> + Send>>;

impl MapJoin for tokio::task::JoinHandle<Result<BlockRef>> {
    fn map_join(self) -> BoxFuture {
        Box::pin(async move { self.await.map_err(|e| LightningError::Io(std::io::Error::other(e)))? })
    }
}
