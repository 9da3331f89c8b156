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
use crate::replica::wire::{Body, Msg};
use bytes::Bytes;
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
/// Passes per attempt; writes that dirty more than [`FINAL_REGIONS`] per
/// pass for this long make the attempt give up (and retry later).
const MAX_PASSES: usize = 32;

/// Opens links to a volume's replicas.
pub trait Connector: Send + Sync + 'static {
    /// A link to `peer` whose first frame is numbered `first_seq`: a catch-up
    /// stream of its own (`resync`), or a link in the volume's write stream.
    fn connect(&self, peer: &str, resync: bool, first_seq: u64) -> io::Result<Arc<dyn ReplicaLink>>;
    /// The volume grew to `size` bytes: streams opened from now on say so.
    fn resized(&self, _size: u64) {}
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

/// The resync task of a volume: tries every replica out of the live set,
/// one after the other, then waits `retry`; until the volume is closed.
pub(super) async fn run<B: BlockBackend + 'static>(inner: Arc<Inner<B>>) {
    let Some(retry) = inner.resync.as_ref().map(|r| r.retry) else { return };
    loop {
        let behind: Vec<usize> = {
            let o = inner.order.lock().await;
            if o.closed {
                return;
            }
            (0..o.peers.len()).filter(|&i| !o.peers[i].live()).collect()
        };
        for i in behind {
            let started = Instant::now();
            match catch_up(&inner, i).await {
                Ok((peer, bytes)) => {
                    tracing::info!(peer, bytes, took = ?started.elapsed(), "replica caught up and rejoined")
                }
                Err((peer, e)) => tracing::info!(peer, error = %e, "replica not caught up; will retry"),
            }
            inner.order.lock().await.peers[i].left = None;
        }
        tokio::time::sleep(retry).await;
    }
}

/// Paces copying to `rate` bytes per second.
struct Throttle {
    rate: u64,
    start: Instant,
    sent: u64,
}

impl Throttle {
    async fn take(&mut self, bytes: u64) {
        self.sent += bytes;
        if self.rate > 0 {
            let due = self.start + Duration::from_secs_f64(self.sent as f64 / self.rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

type Failed = (String, io::Error);

/// One attempt to bring replica `i` back; gives its name and the bytes copied.
async fn catch_up<B: BlockBackend + 'static>(inner: &Arc<Inner<B>>, i: usize) -> Result<(String, u64), Failed> {
    let r = inner.resync.as_ref().expect("resync configured");
    let (name, turn, mut base) = {
        let o = inner.order.lock().await;
        let p: &Peer = &o.peers[i];
        (p.name.clone(), p.turn, p.history)
    };
    let fail = |e: io::Error| (name.clone(), e);
    let link = r.connector.connect(&name, true, 1).map_err(fail)?;
    // A FLUSH first: the replica is reachable and took the stream before
    // anything holds writes up for it.
    let probe = link.send(Msg { seq: 1, epoch: inner.epoch.load(Relaxed), body: Body::Flush }).await.map_err(fail)?;
    let timeout = inner.policy.ack_timeout;
    tokio::time::timeout(timeout, probe)
        .await
        .map_err(|_| fail(io::Error::other(format!("no answer within {timeout:?}"))))?
        .map_err(fail)?;
    let mut seq = 2;
    let mut copied = 0;
    let mut throttle = Throttle { rate: r.rate, start: Instant::now(), sent: 0 };
    for _pass in 0..MAX_PASSES {
        let (todo, start, region) = {
            let mut o = inner.order.lock().await;
            let todo = o.drl.dirty(base);
            o.peers[i].left = Some(o.drl.bytes(&todo));
            (todo, o.next_seq, o.drl.region())
        };
        if todo.len() <= FINAL_REGIONS {
            return finish(inner, i, turn, &*link, seq, base, copied).await.map_err(fail);
        }
        let mut acks = Vec::with_capacity(todo.len());
        for g in todo {
            let (frame, len) = {
                let _held = inner.gate.write().await;
                region_frame(inner, g, seq).await.map_err(fail)?
            };
            acks.push(link.send(frame).await.map_err(fail)?);
            seq += 1;
            copied += len;
            inner.metrics.resync_bytes.fetch_add(len, Relaxed);
            if let Some(left) = inner.order.lock().await.peers[i].left.as_mut() {
                *left = left.saturating_sub(len);
            }
            throttle.take(len).await;
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
    Err(fail(io::Error::other(format!("writes kept dirtying regions for {MAX_PASSES} passes"))))
}

/// The frame copying region `g` as the primary holds it now: a WRITE, or
/// a WRITE_ZEROES when it reads as zeroes.
async fn region_frame<B: BlockBackend>(inner: &Inner<B>, g: u64, seq: u64) -> io::Result<(Msg, u64)> {
    let (offset, len) = inner.order.lock().await.drl.span(g);
    let (r, buf) = inner.local.read_at(vec![0; len as usize], offset).await;
    r?;
    let body = if buf.iter().all(|&b| b == 0) {
        Body::WriteZeroes { offset, len, punch: false }
    } else {
        Body::Write { offset, data: Bytes::from(buf) }
    };
    Ok((Msg { seq, epoch: inner.epoch.load(Relaxed), body }, len))
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
        let (frame, len) = region_frame(inner, g, seq).await?;
        acks.push(link.send(frame).await?);
        seq += 1;
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
    let next = o.next_seq;
    let p = &mut o.peers[i];
    if p.turn != turn || p.live() {
        return Err(io::Error::other("the replica changed state during the resync"));
    }
    let was_unknown = p.history == History::Unknown;
    p.link = Some(r.connector.connect(&p.name, false, next)?);
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
    if was_unknown {
        // The record stops listing it as untracked (a crash before this
        // only costs a second full copy).
        inner.resave().await;
    }
    Ok((name, copied))
}
