//! A primary's standing in the volume map (`replication/map`), as the
//! replicated backend consults it ([`Authority`]):
//!
//! - **the lease**: renewed through the map's leader every quarter lease;
//!   counted from the moment the renewal was sent, and held for 80 % of the
//!   lease, so the primary stops taking writes before the leader can grant a
//!   takeover (which waits a whole lease on its own clock); a renewal the
//!   map refuses because another copy took over deposes this primary, and
//!   the volume manager turns its copy into a replica of the new one
//!   ([`Volumes::demote`]);
//! - **the in-sync set**: every replica that leaves the live set is dropped
//!   from it (and every one that rejoins is added back) by one task, in the
//!   order the changes happened, retrying until the map takes each; a FLUSH
//!   waits for the drops before it is answered ([`Authority::settle`]).

use super::Volumes;
use crate::backend::replicated::Authority;
use crate::replication::map::MapNode;
use crate::replication::map::net::ProposeError;
use crate::replication::map::state::{Command, Refusal, VolumeState};
use futures::future::BoxFuture;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// The part of the lease a primary keeps for itself: it stops this much
/// before the lease ends (clock rates may differ between nodes).
const HELD: (u32, u32) = (8, 10);

/// One open replicated volume's lease and in-sync bookkeeping on its primary.
pub struct PrimaryLease {
    volume: String,
    me: String,
    map: Arc<MapNode>,
    /// The map epoch this node is primary at.
    epoch: AtomicU64,
    base: Instant,
    /// Nanoseconds after `base` until which writes may be answered (0: none).
    until: AtomicU64,
    held: watch::Sender<bool>,
    deposed: AtomicBool,
    queue: mpsc::UnboundedSender<(String, bool)>,
    queued: AtomicU64,
    done: watch::Sender<u64>,
    /// `replace_after_ms` of the cluster file: a copy out of sync this long
    /// is replaced ([`Volumes::replace_copy`]), one at a time.
    replace_after: Option<Duration>,
    replacing: Arc<AtomicBool>,
}

impl std::fmt::Debug for PrimaryLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrimaryLease").field("volume", &self.volume).field("epoch", &self.epoch).finish_non_exhaustive()
    }
}

impl PrimaryLease {
    /// Starts the lease of `volume`, whose primary this node is at map
    /// `epoch`: first `live` (the replicas linked live at the start, which
    /// hold every byte this copy holds) are recorded in sync and `out` (the
    /// others) out of sync, before the first FLUSH is answered and before
    /// any later change. Its tasks end when the lease is dropped (with the
    /// volume's backend).
    pub fn start(
        volumes: &Volumes,
        map: Arc<MapNode>,
        volume: &str,
        epoch: u64,
        live: Vec<String>,
        out: Vec<String>,
    ) -> Arc<Self> {
        let (queue, rx) = mpsc::unbounded_channel();
        let lease = Arc::new(PrimaryLease {
            volume: volume.to_owned(),
            me: map.name().to_owned(),
            map,
            epoch: AtomicU64::new(epoch),
            base: Instant::now(),
            until: AtomicU64::new(0),
            held: watch::channel(false).0,
            deposed: AtomicBool::new(false),
            queue,
            queued: AtomicU64::new(0),
            done: watch::channel(0).0,
            replace_after: volumes.membership().and_then(|m| m.cluster.replace_after_ms).map(Duration::from_millis),
            replacing: Arc::new(AtomicBool::new(false)),
        });
        for peer in live {
            lease.note(&peer, true);
        }
        for peer in out {
            lease.note(&peer, false);
        }
        let volumes = volumes.this.get().cloned().unwrap_or_default();
        tokio::spawn(renew(Arc::downgrade(&lease), volumes));
        tokio::spawn(record(Arc::downgrade(&lease), rx));
        lease
    }

    /// A replica left (`false`) or rejoined (`true`) the live set.
    pub fn note(&self, peer: &str, in_sync: bool) {
        self.queued.fetch_add(1, SeqCst);
        let _ = self.queue.send((peer.to_owned(), in_sync));
    }

    fn now(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64
    }

    fn grant(&self, asked: Instant, lease: Duration) {
        let held = lease * HELD.0 / HELD.1;
        let until = (asked.saturating_duration_since(self.base) + held).as_nanos() as u64;
        self.until.fetch_max(until, SeqCst);
        self.held.send_replace(true);
    }
}

impl PrimaryLease {
    /// Starts replacing the first copy out of sync for longer than
    /// `replace_after`, unless a replacement runs.
    fn replace_lost(&self, st: &VolumeState, volumes: &Weak<Volumes>) {
        let Some(after) = self.replace_after else { return };
        let now = crate::util::unix_ms();
        let Some(lost) = st
            .out_since
            .iter()
            .find(|(c, since)| **c != self.me && now.saturating_sub(**since) >= after.as_millis() as u64)
            .map(|(c, _)| c.clone())
        else {
            return;
        };
        let Some(v) = volumes.upgrade() else { return };
        if self.replacing.swap(true, SeqCst) {
            return;
        }
        let (name, busy) = (self.volume.clone(), self.replacing.clone());
        tokio::spawn(async move {
            // A copy being filled (a replacement itself, or a long catch-up)
            // is on its way back.
            if v.catching_up(&name, &lost).await {
                busy.store(false, SeqCst);
                return;
            }
            tracing::warn!(volume = %name, copy = %lost, ?after, "a copy is out of sync for longer than replace_after: replacing it");
            match v.replace_copy(&name, &lost, None).await {
                Ok(info) => {
                    tracing::warn!(volume = %name, copy = %lost, replicas = ?info.replicas, "lost copy replaced")
                }
                Err(e) => {
                    tracing::warn!(volume = %name, copy = %lost, error = %e, "could not replace a lost copy; will try again")
                }
            }
            busy.store(false, SeqCst);
        });
    }
}

impl Authority for PrimaryLease {
    fn may_write(&self) -> bool {
        !self.deposed.load(SeqCst) && self.now() < self.until.load(SeqCst)
    }

    fn acquire(&self, within: Duration) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let deadline = Instant::now() + within;
            let mut rx = self.held.subscribe();
            loop {
                if self.may_write() {
                    return true;
                }
                if self.deposed.load(SeqCst) {
                    return false;
                }
                rx.borrow_and_update();
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || tokio::time::timeout(left, rx.changed()).await.is_err() {
                    return self.may_write();
                }
            }
        })
    }

    fn settle(&self, within: Duration) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async move {
            let want = self.queued.load(SeqCst);
            let mut rx = self.done.subscribe();
            let r = tokio::time::timeout(within, rx.wait_for(|d| *d >= want)).await;
            match r {
                Ok(Ok(_)) => Ok(()),
                _ => Err(io::Error::other(
                    "a replica left the live set and the volume map did not record it in time: the flush is not \
                     answered",
                )),
            }
        })
    }
}

/// Renews the lease every quarter lease until it is dropped or deposed.
async fn renew(lease: Weak<PrimaryLease>, volumes: Weak<Volumes>) {
    loop {
        let Some(l) = lease.upgrade() else { return };
        let every = l.map.lease() / 4;
        let asked = Instant::now();
        let cmd = Command::Renew { volume: l.volume.clone(), node: l.me.clone(), epoch: l.epoch.load(SeqCst) };
        match l.map.propose(cmd, every.max(Duration::from_millis(100))).await {
            Ok(Ok(st)) => {
                l.grant(asked, l.map.lease());
                l.replace_lost(&st, &volumes);
            }
            Ok(Err(Refusal::NotPrimary { primary, current, .. })) => {
                l.deposed.store(true, SeqCst);
                l.held.send_replace(false);
                tracing::error!(
                    volume = %l.volume, primary = %primary, epoch = current,
                    "the volume map names another primary: this one is deposed and becomes its replica"
                );
                if let Some(v) = volumes.upgrade() {
                    let name = l.volume.clone();
                    drop(l);
                    tokio::spawn(async move {
                        if let Err(e) = v.demote(&name, &primary, current).await {
                            tracing::error!(volume = %name, error = %e, "could not turn the deposed copy into a replica");
                        }
                    });
                }
                return;
            }
            Ok(Err(Refusal::Unknown(_))) => {
                // Made before this node ran a map, or its registration was
                // lost: registered at start in the background; try again.
                tracing::warn!(volume = %l.volume, "the volume is not in the volume map yet: no lease");
            }
            Ok(Err(r)) => tracing::warn!(volume = %l.volume, refusal = %r, "lease renewal refused"),
            Err(ProposeError::LeaseRuns { .. }) => {}
            Err(e) => tracing::warn!(volume = %l.volume, error = %e, "lease renewal failed"),
        }
        let next = every.saturating_sub(asked.elapsed());
        drop(l);
        tokio::time::sleep(next).await;
    }
}

/// Records the replicas' departures and returns in the map, in order.
async fn record(lease: Weak<PrimaryLease>, mut rx: mpsc::UnboundedReceiver<(String, bool)>) {
    while let Some((peer, in_sync)) = rx.recv().await {
        loop {
            let Some(l) = lease.upgrade() else { return };
            let (volume, by, epoch) = (l.volume.clone(), l.me.clone(), l.epoch.load(SeqCst));
            let cmd = if in_sync {
                Command::Rejoin { volume, by, epoch, copy: peer.clone() }
            } else {
                Command::Drop { volume, by, epoch, copy: peer.clone(), at_ms: crate::util::unix_ms() }
            };
            match l.map.propose(cmd, l.map.lease()).await {
                // Taken; or moot: not in the map (nothing to keep in sync),
                // or no longer the primary (no more writes are answered).
                Ok(Ok(_) | Err(Refusal::Unknown(_) | Refusal::NotPrimary { .. })) => {
                    l.done.send_modify(|d| *d += 1);
                    break;
                }
                Ok(Err(r)) => {
                    tracing::error!(volume = %l.volume, peer, in_sync, refusal = %r, "the volume map refused a change");
                    l.done.send_modify(|d| *d += 1);
                    break;
                }
                Err(e) => {
                    tracing::warn!(volume = %l.volume, peer, in_sync, error = %e, "cannot record a replica's change yet");
                    drop(l);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}
