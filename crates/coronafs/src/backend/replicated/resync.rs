//! Bringing a replica that is out of the live set back into it: the
//! primary copies the regions the replica may lack ([`super::drl`]) over a
//! stream of their own, throttled, in passes while new writes go on (each
//! pass recopies what was written during the one before), then, with
//! writes held for the last few regions and one FLUSH, opens a write-stream
//! link at the current number and counts the replica live again.
//! docs/design/replication-volumes.md ("Resync") has the why.

use super::drl::{DrlRecord, History};
use super::link::ReplicaLink;
use super::{Inner, Peer};
use crate::backend::traits::BlockBackend;
use crate::replica::wire::{Body, MAX_PAYLOAD, Msg};
use bytes::Bytes;
use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// Default resync throttle: 64 MiB/s (half of a 1 Gbit/s link).
pub const DEFAULT_RATE: u64 = 64 << 20;
/// Default wait between attempts to reach a replica out of the live set.
pub const DEFAULT_RETRY: Duration = Duration::from_secs(2);
/// A pass that finds at most this many regions to copy is the last one:
/// they are copied with writes held.
const FINAL_REGIONS: usize = 16;
/// When passes stop shrinking (writers dirty regions as fast as a pass
/// copies them), the last pass may grow up to this many bytes of regions,
/// so the tail converges at the cost of holding writes that long.
const MAX_FINAL_BYTES: u64 = 64 << 20;
/// Passes per attempt; writes that keep more regions dirty than the last
/// pass may take for this long make the attempt give up (and retry later).
const MAX_PASSES: usize = 32;

/// How many regions the last pass may take after a pass found `found`
/// regions dirty, the one before it `before`, with `now` the limit so
/// far and `most` the regions of [`MAX_FINAL_BYTES`]: a pass that did not
/// halve what was left shows writers keeping pace with the copy, so the
/// limit rises to what it found (a quarter more, for the jitter of the
/// next pass), never above `most`.
pub fn final_limit(now: usize, before: usize, found: usize, most: usize) -> usize {
    if found.saturating_mul(2) > before { now.max((found + found / 4).min(most)) } else { now }
}

/// Opens links to a volume's replicas.
pub trait Connector: Send + Sync + 'static {
    /// A link to `peer` whose first frame is numbered `first_seq`: a catch-up
    /// stream of its own (`resync`), or a link in the volume's write stream.
    /// Its OPEN carries `epoch`: the volume's epoch now, which a fence may
    /// have raised since the volume opened (an OPEN at the older one would
    /// leave the copy's position below a fence that already answered).
    /// `expect` is the incarnation of the copy the primary knows (0: any).
    fn connect(
        &self,
        peer: &str,
        resync: bool,
        first_seq: u64,
        epoch: u64,
        expect: u64,
    ) -> io::Result<Arc<dyn ReplicaLink>>;
    /// The volume grew to `size` bytes: streams opened from now on say so.
    fn resized(&self, _size: u64) {}
    /// `new` holds `old`'s copy from now on: streams opened from now on
    /// name the copies so.
    fn replaced(&self, _old: &str, _new: &str) {}
}

/// Where the primary keeps its [`DrlRecord`].
pub trait DrlStore: Send + Sync + 'static {
    /// Replaces the record durably (blocking).
    fn save(&self, rec: &DrlRecord) -> io::Result<()>;
}

/// A store in memory (tests): keeps the last record and counts saves.
#[derive(Debug, Default)]
pub struct MemStore {
    pub last: std::sync::Mutex<Option<DrlRecord>>,
    pub saves: std::sync::atomic::AtomicU64,
}

impl DrlStore for MemStore {
    fn save(&self, rec: &DrlRecord) -> io::Result<()> {
        *self.last.lock().map_err(|_| io::Error::other("poisoned"))? = Some(rec.clone());
        self.saves.fetch_add(1, Relaxed);
        Ok(())
    }
}

/// How replicas out of the live set are brought back.
pub struct Resync {
    pub connector: Arc<dyn Connector>,
    pub store: Arc<dyn DrlStore>,
    /// Throttle: bytes of regions copied per second, at most.
    pub rate: u64,
    /// Wait between attempts.
    pub retry: Duration,
}

/// A replica that keeps failing is retried at most this many `retry`
/// periods apart (64 s at the default 2 s).
pub const MAX_BACKOFF: u32 = 32;

/// The resync task of a volume, until the volume is closed or this primary
/// learns it was deposed: an attempt for every replica out of the live
/// set, all of them at once (a task per replica), so a replica that is
/// back never waits behind another whose connect or first answer hangs
/// until `ack_timeout` (after a failover: the dead old primary). It looks
/// for replicas that left the live set whenever an attempt ends, and at
/// least every `retry`. A replica whose attempt failed is next tried after
/// a pause that doubles with each failure, from `retry` up to
/// [`MAX_BACKOFF`] times it, jittered (two primaries that each try the
/// other, or many volumes of one lost node, do not retry in step). The
/// throttle is the volume's: replicas catching up at once share it.
pub(super) async fn run<B: BlockBackend + 'static>(inner: Arc<Inner<B>>) {
    let Some((retry, rate)) = inner.resync.as_ref().map(|r| (r.retry, r.rate)) else { return };
    // However the task ends (closed, deposed, aborted), no request waits
    // for it any more.
    let _running = Running(inner.clone());
    let pace = Arc::new(Pace { rate, next: std::sync::Mutex::new(None) });
    // Per replica: the pause after its last failure, when to try again,
    // and its name (a copy replaced by another starts without a pause).
    let mut backoff: HashMap<usize, (Duration, Instant, String)> = HashMap::new();
    // The attempts running (dropping the set aborts them), by replica.
    let mut attempts = tokio::task::JoinSet::new();
    let mut busy: HashMap<tokio::task::Id, usize> = HashMap::new();
    loop {
        if inner.deposed.load(Relaxed) {
            tracing::warn!("deposed: the resync stops");
            break;
        }
        let behind: Vec<(usize, String)> = {
            let o = inner.order.lock().await;
            if o.closed {
                break;
            }
            (0..o.peers.len()).filter(|&i| !o.peers[i].live()).map(|i| (i, o.peers[i].name.clone())).collect()
        };
        backoff.retain(|i, (_, _, name)| behind.iter().any(|(b, n)| b == i && n == name));
        let now = Instant::now();
        for &(i, _) in &behind {
            if busy.values().any(|&b| b == i) || backoff.get(&i).is_some_and(|(_, at, _)| now < *at) {
                continue;
            }
            let (inner, pace) = (inner.clone(), pace.clone());
            let task = attempts.spawn(async move {
                let started = Instant::now();
                (started, catch_up(&inner, i, &pace).await)
            });
            busy.insert(task.id(), i);
        }
        inner.set_resyncing(!busy.is_empty());
        // Wake for the first replica due, and at least every `retry` for
        // replicas that leave the live set meanwhile.
        let wake = backoff
            .iter()
            .filter(|(i, _)| !busy.values().any(|b| b == *i))
            .map(|(_, (_, at, _))| at.saturating_duration_since(now))
            .min()
            .map_or(retry, |d| d.min(retry));
        tokio::select! {
            Some(joined) = attempts.join_next_with_id() => {
                let id = match &joined {
                    Ok((id, _)) => *id,
                    Err(e) => e.id(),
                };
                let Some(i) = busy.remove(&id) else { continue };
                let (took, outcome) = match joined {
                    Ok((_, (started, r))) => (started.elapsed(), r.map(|(_, bytes)| bytes).map_err(|(_, e)| e)),
                    Err(e) => (Duration::ZERO, Err(io::Error::other(format!("the attempt ended: {e}")))),
                };
                let peer = {
                    let mut o = inner.order.lock().await;
                    o.peers[i].left = None;
                    o.peers[i].name.clone()
                };
                match outcome {
                    Ok(bytes) => {
                        backoff.remove(&i);
                        tracing::info!(peer, bytes, ?took, "replica caught up and rejoined")
                    }
                    Err(e) => {
                        let pause = backoff.get(&i).map_or(retry, |(d, _, _)| (*d * 2).min(retry * MAX_BACKOFF));
                        let wait = crate::util::jitter(pause);
                        backoff.insert(i, (pause, Instant::now() + wait, peer.clone()));
                        tracing::info!(peer, error = %e, retry_in = ?wait, "replica not caught up; will retry");
                    }
                }
            }
            _ = tokio::time::sleep(wake) => {}
        }
    }
    // Attempts cut short leave no 'catching up' behind.
    attempts.shutdown().await;
    let mut o = inner.order.lock().await;
    for i in busy.into_values() {
        o.peers[i].left = None;
    }
}

/// Clears [`Inner::resyncing`] when the resync task ends, however it ends.
struct Running<B: BlockBackend>(Arc<Inner<B>>);

impl<B: BlockBackend> Drop for Running<B> {
    fn drop(&mut self) {
        self.0.set_resyncing(false);
    }
}

/// Paces the copying of every catch-up of a volume, together, to `rate`
/// bytes per second (0: unthrottled).
struct Pace {
    rate: u64,
    /// When the bytes taken so far are paid for.
    next: std::sync::Mutex<Option<Instant>>,
}

impl Pace {
    /// After sending `bytes`: books them from when sending them began at
    /// `rate` (now less their time at `rate`), or from when the bytes
    /// booked before are paid for if that is later, and waits until they
    /// are paid for. So copying runs at `rate` however many catch-ups share
    /// it, and time spent reading or waiting for the gate counts toward it.
    async fn take(&self, bytes: u64) {
        if self.rate == 0 {
            return;
        }
        let cost = Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        let due = {
            let Ok(mut next) = self.next.lock() else { return };
            let now = Instant::now();
            let began = now.checked_sub(cost).unwrap_or(now);
            let due = next.map_or(began, |n| n.max(began)) + cost;
            *next = Some(due);
            due
        };
        tokio::time::sleep_until(due.into()).await;
    }
}

type Failed = (String, io::Error);

/// One attempt to bring replica `i` back; gives its name and the bytes copied.
async fn catch_up<B: BlockBackend + 'static>(
    inner: &Arc<Inner<B>>,
    i: usize,
    pace: &Pace,
) -> Result<(String, u64), Failed> {
    let r = inner.resync.as_ref().expect("resync configured");
    let (name, turn, mut base, expect) = {
        let o = inner.order.lock().await;
        let p: &Peer = &o.peers[i];
        (p.name.clone(), p.turn, p.history, p.incarnation)
    };
    let fail = |e: io::Error| (name.clone(), e);
    let link = r.connector.connect(&name, true, 1, inner.epoch.load(Relaxed), expect).map_err(fail)?;
    // A copy fenced above this primary's epoch says another was elected.
    let fail = |e: io::Error| {
        if link.fenced_out() {
            inner.depose(&name);
        }
        (name.clone(), e)
    };
    // A FLUSH first: the replica is reachable and took the stream before
    // anything holds writes up for it.
    let timeout = inner.policy.ack_timeout;
    let probe = async {
        let ack = link.send(Msg { seq: 1, epoch: inner.epoch.load(Relaxed), body: Body::Flush }).await?;
        tokio::time::timeout(timeout, ack)
            .await
            .map_err(|_| io::Error::other(format!("no answer within {timeout:?}")))?
    };
    if let Err(e) = probe.await {
        if link.replaced() {
            // Not the copy the log speaks of (deleted and made again):
            // the next attempt copies everything, to whatever copy is there.
            let mut o = inner.order.lock().await;
            let p = &mut o.peers[i];
            if p.turn == turn {
                (p.history, p.incarnation) = (History::Unknown, 0);
                tracing::warn!(peer = %name, "the replica's copy was made again: it gets a full copy");
            }
        }
        return Err(fail(e));
    }
    let mut seq = 2;
    let mut copied = 0;
    let (mut last, mut final_at) = (usize::MAX, FINAL_REGIONS);
    for _pass in 0..MAX_PASSES {
        let (todo, start, most, region) = {
            let mut o = inner.order.lock().await;
            let todo = o.drl.dirty(base);
            o.peers[i].left = Some(o.drl.bytes(&todo));
            let most = usize::try_from(MAX_FINAL_BYTES / o.drl.region()).unwrap_or(usize::MAX).max(FINAL_REGIONS);
            (todo, o.next_seq, most, o.drl.region())
        };
        if todo.len() <= final_at {
            return finish(inner, i, turn, &*link, seq, base, copied).await.map_err(fail);
        }
        final_at = final_limit(final_at, last, todo.len(), most);
        last = todo.len();
        let mut acks = Vec::with_capacity(todo.len());
        for g in todo {
            let (frames, len) = {
                let _held = inner.gate.write().await;
                region_frames(inner, g, seq).await.map_err(fail)?
            };
            for frame in frames {
                acks.push(link.send(frame).await.map_err(fail)?);
                seq += 1;
            }
            copied += len;
            inner.metrics.resync_bytes.fetch_add(len, Relaxed);
            if let Some(left) = inner.order.lock().await.peers[i].left.as_mut() {
                *left = left.saturating_sub(len);
            }
            pace.take(len).await;
        }
        // A replica that stops answering must not hold the volume's resync
        // task (and its other replicas) forever.
        let timeout = inner.policy.ack_timeout;
        let answers = tokio::time::timeout(timeout, futures::future::join_all(acks))
            .await
            .map_err(|_| fail(io::Error::other(format!("a catch-up pass got no answer within {timeout:?}"))))?;
        for a in answers {
            a.map_err(fail)?;
        }
        // Every region written before this pass started is on the replica,
        // unless the volume grew past 1 TiB meanwhile: the regions counted
        // in the old unit were copied in the new one, so the pass counts
        // for nothing (a rare case: the next pass copies them again).
        if inner.order.lock().await.drl.region() == region {
            base = History::Acked(start);
        }
    }
    Err(fail(io::Error::other(format!("writes kept more than {final_at} regions dirty for {MAX_PASSES} passes"))))
}

/// The pieces a region of `len` bytes at `offset` is sent in: at most
/// [`MAX_PAYLOAD`] each (regions of volumes above 32 TiB are larger than
/// one frame may carry).
pub fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..len.div_ceil(MAX_PAYLOAD)).map(move |k| {
        let at = k * MAX_PAYLOAD;
        (offset + at, MAX_PAYLOAD.min(len - at))
    })
}

/// The frames copying region `g` as the primary holds it now, numbered
/// from `seq`, one per piece ([`pieces`]): a WRITE, or a WRITE_ZEROES for
/// a piece that reads as zeroes. Gives them and the region's length.
async fn region_frames<B: BlockBackend>(inner: &Inner<B>, g: u64, seq: u64) -> io::Result<(Vec<Msg>, u64)> {
    let (offset, len) = inner.order.lock().await.drl.span(g);
    let mut frames = Vec::new();
    for (k, (at, n)) in pieces(offset, len).enumerate() {
        let (r, buf) = inner.local.read_at(vec![0; n as usize], at).await;
        r?;
        let body = if buf.iter().all(|&b| b == 0) {
            Body::WriteZeroes { offset: at, len: n, punch: false }
        } else {
            Body::Write { offset: at, data: Bytes::from(buf) }
        };
        frames.push(Msg { seq: seq + k as u64, epoch: inner.epoch.load(Relaxed), body });
    }
    Ok((frames, len))
}

/// The last regions with writes held, a FLUSH, and the switch into the
/// live set.
async fn finish<B: BlockBackend + 'static>(
    inner: &Arc<Inner<B>>,
    i: usize,
    turn: u64,
    link: &dyn ReplicaLink,
    mut seq: u64,
    base: History,
    mut copied: u64,
) -> io::Result<(String, u64)> {
    let r = inner.resync.as_ref().expect("resync configured");
    let _held = inner.gate.write().await;
    let todo = inner.order.lock().await.drl.dirty(base);
    let mut acks = Vec::with_capacity(todo.len() + 1);
    for g in todo {
        let (frames, len) = region_frames(inner, g, seq).await?;
        for frame in frames {
            acks.push(link.send(frame).await?);
            seq += 1;
        }
        copied += len;
        inner.metrics.resync_bytes.fetch_add(len, Relaxed);
    }
    acks.push(link.send(Msg { seq, epoch: inner.epoch.load(Relaxed), body: Body::Flush }).await?);
    // One deadline for all of them: writes are held meanwhile.
    let timeout = inner.policy.ack_timeout;
    let answers = tokio::time::timeout(timeout, futures::future::join_all(acks))
        .await
        .map_err(|_| io::Error::other(format!("no answer within {timeout:?}")))?;
    for a in answers {
        a?;
    }
    let mut o = inner.order.lock().await;
    if inner.deposed.load(Relaxed) {
        return Err(io::Error::other("another copy was elected primary: no replica rejoins this one"));
    }
    let next = o.next_seq;
    let p = &mut o.peers[i];
    if p.turn != turn || p.live() {
        return Err(io::Error::other("the replica changed state during the resync"));
    }
    let was_unknown = p.history == History::Unknown;
    let learnt = link.incarnation() != p.incarnation;
    p.incarnation = link.incarnation();
    p.link = Some(r.connector.connect(&p.name, false, next, inner.epoch.load(Relaxed), p.incarnation)?);
    p.history = History::Acked(next);
    p.turn += 1;
    p.left = None;
    let name = p.name.clone();
    inner.metrics.replicas_rejoined.fetch_add(1, Relaxed);
    if let Some(hook) = &inner.on_change {
        hook(&name, true);
    }
    drop(o);
    drop(_held);
    // A request waiting for the quorum may go on now.
    inner.changed.notify_waiters();
    if was_unknown || learnt {
        // The record stops listing it as untracked (a crash before this
        // only costs a second full copy).
        inner.resave().await;
    }
    Ok((name, copied))
}
