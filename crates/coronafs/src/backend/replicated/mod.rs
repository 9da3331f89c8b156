//! A block backend whose writes go to a local backend and to every live
//! replica ([`link::ReplicaLink`]), with FLUSH (and FUA) answered only once
//! every live replica made earlier writes durable, and a write quorum below
//! which writes fail. See docs/design/replication-volumes.md.
//!
//! - [`apply`]: the replica's side, shared by the TCP listener and tests;
//! - [`link`]: the link trait and its TCP implementation;
//! - [`local`]: the boxed local copy `AnyBackend` holds;
//! - `mem`: an in-memory link that can be killed or stalled (tests only).

pub mod apply;
pub mod link;
pub mod local;
#[cfg(any(test, feature = "testing"))]
pub mod mem;
#[cfg(test)]
mod tests;

use super::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use crate::metrics::Metrics;
use crate::replica::wire::{Body, Msg};
use bytes::Bytes;
use link::{Ack, ReplicaLink};
pub use local::DynBackend;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Default time a replica has to answer a FLUSH before it leaves the live set.
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// How a replicated volume behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicationPolicy {
    /// Copies (the primary included) that must be live for a write or a
    /// flush to be accepted.
    pub write_quorum: usize,
    /// The primary's epoch when the volume opened, sent with every frame
    /// (raised later by [`Replicated::raise_epoch`]).
    pub epoch: u64,
    /// How long a FLUSH waits for each replica.
    pub ack_timeout: Duration,
}

/// Where the write stream is: the next number and who still gets it.
#[derive(Debug)]
struct Order {
    next_seq: u64,
    live: Vec<bool>,
}

/// A local backend plus its replicas.
pub struct Replicated<B> {
    local: B,
    links: Vec<Arc<dyn ReplicaLink>>,
    policy: ReplicationPolicy,
    order: tokio::sync::Mutex<Order>,
    /// The epoch frames carry: the policy's, raised with the volume's fence.
    epoch: std::sync::atomic::AtomicU64,
    metrics: Arc<Metrics>,
    /// Told the name of each replica dropped, so the volume manager can
    /// record it as stale (it must not rejoin without a resync).
    on_drop: Option<DropHook>,
}

/// See [`Replicated::on_drop`].
pub type DropHook = Box<dyn Fn(&str) + Send + Sync>;

impl<B: std::fmt::Debug> std::fmt::Debug for Replicated<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<_> = self.links.iter().map(|l| (l.peer().to_owned(), l.is_up())).collect();
        f.debug_struct("Replicated").field("local", &self.local).field("replicas", &peers).finish()
    }
}

fn below_quorum(live: usize, quorum: usize) -> io::Error {
    io::Error::other(format!("only {live} live copies, below the write quorum of {quorum}: refusing the write"))
}

/// `EIO` with a message in the log (NBD carries only the errno).
fn eio(e: io::Error) -> io::Error {
    tracing::error!(error = %e, "replicated write refused");
    io::Error::from_raw_os_error(libc::EIO)
}

impl<B: BlockBackend> Replicated<B> {
    /// `local` replicated to `links`, each opened so that the next frame it
    /// expects is numbered `first_seq`.
    pub fn new(
        local: B,
        links: Vec<Arc<dyn ReplicaLink>>,
        policy: ReplicationPolicy,
        first_seq: u64,
        metrics: Arc<Metrics>,
    ) -> Self {
        let live = vec![true; links.len()];
        Replicated {
            local,
            links,
            policy,
            order: tokio::sync::Mutex::new(Order { next_seq: first_seq, live }),
            epoch: std::sync::atomic::AtomicU64::new(policy.epoch),
            metrics,
            on_drop: None,
        }
    }

    /// Calls `hook` with the name of every replica dropped from the live set.
    pub fn on_drop(mut self, hook: DropHook) -> Self {
        self.on_drop = Some(hook);
        self
    }

    /// Frames queued from now on carry `epoch` (if above the current one):
    /// the volume's fence was raised, and the copies must learn it, so that
    /// a failover elects a primary above it. Read under the order lock, so
    /// the epochs of a stream never go down as its `seq` goes up.
    pub fn raise_epoch(&self, epoch: u64) {
        self.epoch.fetch_max(epoch, Relaxed);
    }

    /// The local copy.
    pub fn local(&self) -> &B {
        &self.local
    }

    /// Names of the replicas still in the live set.
    pub async fn live_replicas(&self) -> Vec<String> {
        let o = self.order.lock().await;
        self.links.iter().zip(&o.live).filter(|(_, l)| **l).map(|(k, _)| k.peer().to_owned()).collect()
    }

    fn drop_replica(&self, o: &mut Order, i: usize, why: &dyn std::fmt::Display) {
        if o.live[i] {
            o.live[i] = false;
            self.metrics.replicas_dropped.fetch_add(1, Relaxed);
            tracing::warn!(peer = self.links[i].peer(), %why, "replica dropped from the live set");
            if let Some(hook) = &self.on_drop {
                hook(self.links[i].peer());
            }
        }
    }

    /// Live copies, the primary included, after dropping links that went down.
    fn refresh(&self, o: &mut Order) -> usize {
        for i in 0..self.links.len() {
            if o.live[i] && !self.links[i].is_up() {
                self.drop_replica(o, i, &"link down");
            }
        }
        1 + o.live.iter().filter(|l| **l).count()
    }

    /// Numbers `body` and queues it on every live replica, in number order;
    /// gives each replica's index and answer. Fails, queueing nothing more,
    /// when the live copies are below the quorum.
    async fn forward(&self, body: Body) -> io::Result<Vec<(usize, Ack)>> {
        let mut o = self.order.lock().await;
        let live = self.refresh(&mut o);
        if live < self.policy.write_quorum {
            return Err(below_quorum(live, self.policy.write_quorum));
        }
        let msg = Msg { seq: o.next_seq, epoch: self.epoch.load(Relaxed), body };
        o.next_seq = o.next_seq.wrapping_add(1);
        let mut acks = Vec::with_capacity(self.links.len());
        for i in 0..self.links.len() {
            if !o.live[i] {
                continue;
            }
            match self.links[i].send(msg.clone()).await {
                Ok(ack) => acks.push((i, ack)),
                Err(e) => self.drop_replica(&mut o, i, &e),
            }
        }
        let live = 1 + o.live.iter().filter(|l| **l).count();
        if live < self.policy.write_quorum {
            return Err(below_quorum(live, self.policy.write_quorum));
        }
        Ok(acks)
    }

    /// A FLUSH on every live replica and locally; Ok once the local flush
    /// and at least `quorum - 1` replicas succeeded. Replicas that fail or
    /// do not answer in time leave the live set.
    async fn flush_all(&self) -> io::Result<()> {
        let acks = self.forward(Body::Flush).await?;
        let timeout = self.policy.ack_timeout;
        let remote = futures::future::join_all(
            acks.into_iter().map(|(i, ack)| async move { (i, tokio::time::timeout(timeout, ack).await) }),
        );
        let (local, remote) = futures::join!(self.local.flush(), remote);
        local?;
        let mut o = self.order.lock().await;
        let mut acked = 1;
        for (i, r) in remote {
            match r {
                Ok(Ok(())) => acked += 1,
                Ok(Err(e)) => self.drop_replica(&mut o, i, &e),
                Err(_) => self.drop_replica(&mut o, i, &format!("no answer to FLUSH within {timeout:?}")),
            }
        }
        if acked < self.policy.write_quorum {
            return Err(below_quorum(acked, self.policy.write_quorum));
        }
        Ok(())
    }
}

impl<B: BlockBackend> BlockBackend for Replicated<B> {
    fn size(&self) -> u64 {
        self.local.size()
    }

    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        self.local.read_at(buf, offset).await
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.size()) {
            return (Err(io::Error::from_raw_os_error(libc::EINVAL)), buf);
        }
        if let Err(e) = self.forward(Body::Write { offset, data: Bytes::copy_from_slice(&buf) }).await {
            return (Err(eio(e)), buf);
        }
        let (r, buf) = self.local.write_at(buf, offset, false).await;
        if r.is_err() || !fua {
            return (r, buf);
        }
        (self.flush_all().await.map_err(eio), buf)
    }

    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size()) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // A replicated zero crosses to every copy, so it is never "fast":
        // refused before anything is forwarded (NBD_FLAG_FAST_ZERO lets the
        // client fall back to writing zeroes). Forwarding first and then
        // failing locally would leave the copies zeroed and the primary not.
        if fast_only {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        self.forward(Body::WriteZeroes { offset, len, punch }).await.map_err(eio)?;
        self.local.write_zeroes(offset, len, punch, fast_only).await
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size()) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        self.forward(Body::Trim { offset, len }).await.map_err(eio)?;
        self.local.trim(offset, len).await
    }

    async fn flush(&self) -> io::Result<()> {
        self.flush_all().await.map_err(eio)
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.local.cache(offset, len).await
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.local.extents(offset, len, max).await
    }

    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        self.local.try_read_now(buf, offset)
    }

    // try_write_now stays `false`: every write must be forwarded.

    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        self.local.splice_source(offset, len)
    }
}
