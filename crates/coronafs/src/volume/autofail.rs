//! Automatic failover: a replica copy's watchdog.
//!
//! A primary sends a HEARTBEAT on every replica link that was idle for
//! `heartbeat_ms` (`backend/replicated/link.rs`); every frame and heartbeat
//! it applies tells the copy that the primary lives ([`Slot::heard`]). A copy
//! that heard nothing for `failover_after_ms` asks the volume map for a
//! takeover, as a promote by hand does ([`Volumes::promote`]); the map
//! grants it to a copy in sync once the primary's lease ran out. A round
//! that the lease refused waits as long as the lease may still run; one
//! that ends otherwise without a promotion waits a jittered pause, doubling
//! up to eight failover timeouts, and tries again, at most [`MAX_ROUNDS`]
//! times per silence. The design is in docs/design/replication-volumes.md
//! ("The volume map").

use super::Volumes;
use super::failover::{Promotion, Slot};
use crate::cluster::Membership;
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
        self.forget_replaced();
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

    /// One failover round: asks the volume map to make this copy the
    /// primary (granted once the old primary's lease ran out, to a copy in
    /// sync). `Err` says why nothing changed.
    async fn failover_round(&self, m: &Membership, name: &str) -> Result<u64, Round> {
        let Some(map) = self.volume_map() else { return Err(Round::No("no volume map".into())) };
        if let Some(st) = map.map().get(name)
            && !st.in_sync.contains(&m.node)
        {
            return Err(Round::No(format!(
                "this copy is not in sync in the volume map (in sync: {:?}); its primary brings it back",
                st.in_sync
            )));
        }
        match self.take_office(name, Duration::ZERO).await {
            Ok(info) => Ok(info.epoch),
            Err(Promotion::Wait(d)) => Err(Round::Wait(d)),
            Err(Promotion::Failed(e)) => Err(Round::No(e.to_string())),
        }
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
