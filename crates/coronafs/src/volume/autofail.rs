//! Automatic failover: a replica copy's watchdog, and its side of a probe.
//!
//! A primary sends a HEARTBEAT on every replica link that was idle for
//! `heartbeat_ms` (`backend/replicated/link.rs`); every frame and heartbeat
//! it applies tells the copy that the primary lives ([`Slot::heard`]). A copy
//! that heard nothing for `failover_after_ms` probes the other copies
//! ([`Volumes::probe`]) and stands for election only if
//! [`election::stand`] says it is the best-placed copy; then it runs the
//! same election as a promote by hand ([`Volumes::promote`]). A round that
//! does not end in a promotion waits a jittered pause, doubling up to eight
//! failover timeouts, and tries again, at most [`MAX_ROUNDS`] times per
//! silence. The design is in
//! docs/design/replication-volumes.md ("Failover").

use super::Volumes;
use super::failover::{Promotion, Slot, ask, refusal};
use crate::cluster::Membership;
use crate::replica::election::{self, Probe};
use crate::replica::wire::{Body, VoteReply};
use crate::util::jitter;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Why a failover round changed nothing.
#[derive(Debug)]
enum Round {
    /// The old primary's lease may run this much longer.
    Wait(Duration),
    No(String),
}

/// Failover rounds one silence of the primary may start; after them the
/// copy waits for a primary to be heard again (or a promote by hand).
pub const MAX_ROUNDS: u32 = 8;

impl Volumes {
    /// This copy's answer to `candidate` probing before it stands at
    /// `epoch`: `EBUSY` when this node is the primary of `name` at an epoch
    /// the candidate has not passed, or heard from its primary within the
    /// failover timeout; otherwise 0 with where this copy is. Changes nothing.
    pub fn probe(&self, name: &str, epoch: u64, candidate: &str) -> VoteReply {
        let Some(m) = self.membership() else { return refusal(libc::ENOENT, 0) };
        let rec = match self.cat.lock() {
            Ok(c) => c.volumes.get(name).cloned(),
            Err(_) => return refusal(libc::EIO, 0),
        };
        let Some(rec) = rec else { return refusal(libc::ENOENT, 0) };
        let position = self.position(name);
        let seen = rec.epoch.max(position.map_or(0, |p| p.epoch));
        if !rec.replicas.is_empty() {
            // A primary the copies have not voted past is alive (it answers);
            // one at an older epoch was deposed and knows no position.
            if rec.epoch.saturating_add(1) >= epoch {
                tracing::info!(volume = name, candidate, epoch, "probed while primary: busy");
                return refusal(libc::EBUSY, rec.epoch);
            }
            return VoteReply { errno: 0, epoch: seen, position: None };
        }
        let after = Duration::from_millis(m.cluster.failover_after_ms);
        let heard = self.slot(name).ok().and_then(|s| s.heard());
        if heard.is_some_and(|h| h.elapsed() < after) {
            tracing::info!(volume = name, candidate, epoch, "probed while hearing the primary: busy");
            return refusal(libc::EBUSY, seen);
        }
        VoteReply { errno: 0, epoch: seen, position }
    }

    /// Opens every volume this node is the primary of, so its links start
    /// and its copies hear heartbeats from the moment the server runs, not
    /// only once an NBD client opens the volume.
    pub fn open_primaries(&self) {
        let Some(me) = self.membership().map(|m| m.node.clone()) else { return };
        let prim: Vec<(String, Vec<String>, u64)> = match self.cat.lock() {
            Ok(c) => c
                .volumes
                .iter()
                .filter(|(_, r)| !r.replicas.is_empty())
                .map(|(n, r)| {
                    let copies = if r.copies.is_empty() {
                        std::iter::once(me.clone()).chain(r.replicas.iter().cloned()).collect()
                    } else {
                        r.copies.clone()
                    };
                    (n.clone(), copies, r.epoch)
                })
                .collect(),
            Err(_) => return,
        };
        let names: Vec<String> = prim.iter().map(|(n, _, _)| n.clone()).collect();
        self.register_missing(prim);
        // Copies whose primary is another node watch it from the start, not
        // only from its first stream: after a restart of the whole cluster
        // the primary may never come back, and a copy in sync takes over.
        if self.volume_map().is_some() {
            let copies: Vec<String> = match self.cat.lock() {
                Ok(c) => c
                    .volumes
                    .iter()
                    .filter(|(_, r)| r.replicas.is_empty() && r.primary.as_deref().is_some_and(|p| p != me))
                    .map(|(n, _)| n.clone())
                    .collect(),
                Err(_) => Vec::new(),
            };
            for n in copies {
                if let Ok(slot) = self.slot(&n) {
                    slot.hear();
                    self.watch(&n, &slot);
                }
            }
        }
        for n in names {
            if let Err(e) = self.open(&n) {
                tracing::error!(volume = %n, error = %e, "cannot open a replicated volume at start");
            }
        }
    }

    /// Starts the watchdog of this copy of `name` unless one runs or
    /// automatic failover is off.
    pub(super) fn watch(&self, name: &str, slot: &Arc<Slot>) {
        let Some(m) = self.membership().cloned() else { return };
        if m.cluster.failover_after_ms == 0 {
            return;
        }
        let Some(this) = self.this.get().cloned() else { return };
        if slot.watching.swap(true, Ordering::SeqCst) {
            return;
        }
        let (name, slot) = (name.to_owned(), slot.clone());
        tokio::spawn(async move {
            watchdog(this, &m, &name, &slot).await;
            slot.watching.store(false, Ordering::SeqCst);
        });
    }

    /// Whether this node holds a replica copy of `name` whose primary is
    /// another node.
    fn is_replica_copy(&self, name: &str, me: &str) -> bool {
        self.cat.lock().ok().is_some_and(|c| {
            c.volumes.get(name).is_some_and(|r| r.replicas.is_empty() && r.primary.as_deref().is_some_and(|p| p != me))
        })
    }

    /// One failover round. With a volume map: asks the map to make this
    /// copy the primary (granted once the old primary's lease ran out, to a
    /// copy in sync). Without one: probes the other copies and, if this copy
    /// is the one to stand, runs the election. `Err` says why nothing
    /// changed.
    async fn failover_round(&self, m: &Membership, name: &str) -> Result<u64, Round> {
        if let Some(map) = self.volume_map() {
            if let Some(st) = map.map().get(name)
                && !st.in_sync.contains(&m.node)
            {
                return Err(Round::No(format!(
                    "this copy is not in sync in the volume map (in sync: {:?}); its primary brings it back",
                    st.in_sync
                )));
            }
            return match self.take_office(name, Duration::ZERO).await {
                Ok(info) => Ok(info.epoch),
                Err(Promotion::Wait(d)) => Err(Round::Wait(d)),
                Err(Promotion::Failed(e)) => Err(Round::No(e.to_string())),
            };
        }
        self.election_round(m, name).await.map_err(Round::No)
    }

    /// A failover round by probes and votes (a server without a volume map).
    async fn election_round(&self, m: &Membership, name: &str) -> Result<u64, String> {
        let rec = self.catalog().map_err(|e| e.to_string())?.volumes.get(name).cloned().ok_or("volume gone")?;
        let own = self.position(name);
        let epoch = rec.epoch.max(own.map_or(0, |p| p.epoch)) + 1;
        let timeout = Duration::from_millis(m.cluster.ack_timeout_ms);
        let primary = rec.primary.as_deref();
        let asks = rec.copies.iter().filter(|c| **c != m.node).map(|c| async move {
            let probe = match m.cluster.node(c) {
                Ok(n) => {
                    let body = Body::Probe { volume: name.to_owned(), candidate: m.node.clone() };
                    match ask(n.replica, &m.secret, epoch, body, timeout).await {
                        Some(r) if r.errno == 0 => Probe::Willing { position: r.position },
                        Some(r) if r.errno == libc::EBUSY as u32 => Probe::Busy,
                        // The primary answers that it has no such volume: it
                        // was deleted there, and its copies must not bring it
                        // back (an operator may still promote one).
                        Some(r) if r.errno == libc::ENOENT as u32 && primary == Some(c.as_str()) => Probe::Busy,
                        _ => Probe::Silent,
                    }
                }
                Err(_) => Probe::Silent,
            };
            (c.clone(), probe)
        });
        let probes = futures::future::join_all(asks).await;
        tracing::info!(volume = name, ?own, ?probes, "primary silent: probed the copies");
        election::stand(&rec.copies, &m.node, own, &probes)?;
        tracing::warn!(volume = name, epoch, "standing for election: the primary is silent");
        let info = self.promote(name).await.map_err(|e| e.to_string())?;
        Ok(info.epoch)
    }
}

/// Watches one replica copy until this node stops holding it as a replica
/// (promoted, deleted) or the volume manager is gone.
async fn watchdog(this: Weak<Volumes>, m: &Membership, name: &str, slot: &Slot) {
    let after = Duration::from_millis(m.cluster.failover_after_ms);
    let mut rounds = 0;
    // What `heard` was when the rounds were counted: a new sign of life resets them.
    let mut counted = slot.heard();
    loop {
        let pause = {
            let Some(v) = this.upgrade() else { return };
            if !v.is_replica_copy(name, &m.node) {
                return;
            }
            let heard = slot.heard();
            let quiet = heard.map_or(after, |h| h.elapsed());
            if heard != counted {
                (rounds, counted) = (0, heard);
            }
            if quiet < after {
                after - quiet
            } else if rounds >= MAX_ROUNDS {
                after
            } else {
                rounds += 1;
                match v.failover_round(m, name).await {
                    Ok(epoch) => {
                        tracing::warn!(volume = name, epoch, rounds, "automatic failover: this copy is the primary");
                        return;
                    }
                    // The old primary's lease may still run: not a round.
                    Err(Round::Wait(d)) => {
                        rounds -= 1;
                        d
                    }
                    Err(Round::No(why)) => {
                        if rounds == MAX_ROUNDS {
                            tracing::error!(volume = name, rounds, %why, "automatic failover gave up; promote by hand");
                        } else {
                            tracing::info!(volume = name, rounds, %why, "not standing for election this round");
                        }
                        // Longer after each round (a loaded or flaky cluster
                        // gets more time), at most eight timeouts.
                        jitter(after * (1 << (rounds - 1).min(3)))
                    }
                }
            }
        };
        tokio::time::sleep(pause).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jittered_pause_lies_in_the_upper_half_and_varies() {
        let d = Duration::from_millis(1000);
        let pauses: Vec<Duration> = (0..32).map(|_| jitter(d)).collect();
        assert!(pauses.iter().all(|p| *p >= d / 2 && *p < d), "{pauses:?}");
        assert!(pauses.iter().any(|p| *p != pauses[0]), "32 equal pauses: {pauses:?}");
    }
}
