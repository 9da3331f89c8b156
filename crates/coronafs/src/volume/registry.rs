//! The volume manager's side of the volume map (`replication/map`):
//! replicated volumes are registered in the map when they are made (before
//! any copy exists, so a volume the map cannot take is not made at all) and
//! removed from it when deleted; volumes made before this node ran a map
//! are registered when their primary opens them at start. A primary the
//! map has replaced turns its copy into a replica of the new one
//! ([`Volumes::demote`]), which then catches it up like any copy that was
//! away: no operator step.

use super::Volumes;
use crate::error::{CoronaError, Result};
use crate::replication::map::MapNode;
use crate::replication::map::state::{Command, Refusal};
use std::sync::Arc;
use std::time::Duration;

impl Volumes {
    /// Gives the manager its node's member of the volume map.
    pub fn attach_map(&self, map: Arc<MapNode>) -> Result<()> {
        self.map.set(map).map_err(|_| CoronaError::Config("the server already runs a volume map".into()))
    }

    /// This node's member of the volume map, when the server is in a cluster.
    pub fn volume_map(&self) -> Option<&Arc<MapNode>> {
        self.map.get()
    }

    fn map_deadline(&self) -> Duration {
        Duration::from_millis(self.membership().map_or(10_000, |m| m.cluster.ack_timeout_ms))
    }

    /// Registers `name` with `copies` (this node, the primary, first) at
    /// `epoch`; a no-op on a server without a map.
    pub(super) async fn register(&self, name: &str, copies: Vec<String>, epoch: u64) -> Result<()> {
        let Some(map) = self.volume_map() else { return Ok(()) };
        let quorum = self.membership().map_or(1, |m| m.cluster.write_quorum).min(copies.len());
        let cmd = Command::Register { volume: name.to_owned(), primary: map.name().to_owned(), copies, quorum, epoch };
        match map.propose(cmd, self.map_deadline()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(Refusal::Exists(_))) => Err(CoronaError::Conflict(format!(
                "the volume map holds {name:?} with other copies (a volume of that name on other nodes?)"
            ))),
            Ok(Err(r)) => Err(CoronaError::BadRequest(r.to_string())),
            Err(e) => Err(CoronaError::Map(format!("could not register {name:?}: {e}"))),
        }
    }

    /// Removes `name` from the map (logged when it cannot).
    pub(super) async fn unregister(&self, name: &str) {
        let Some(map) = self.volume_map() else { return };
        match map.propose(Command::Unregister { volume: name.to_owned() }, self.map_deadline()).await {
            Ok(Ok(_) | Err(Refusal::Unknown(_))) => {}
            Ok(Err(r)) => tracing::warn!(volume = name, refusal = %r, "the volume map kept a deleted volume"),
            Err(e) => tracing::warn!(volume = name, error = %e, "could not remove a volume from the volume map"),
        }
    }

    /// Turns this node's copy of `name`, whose record still names this node
    /// the primary, into a replica of `primary` (the map's primary at
    /// `epoch`): the export closes (its NBD clients are dropped and move
    /// on), the record names `primary` and takes `epoch` as its own (so the
    /// new primary's stream, at that epoch or above, is accepted), and the
    /// replication record goes (a replica keeps none). The new primary
    /// counts this copy as one to catch up in full, and its resync does so.
    pub async fn demote(&self, name: &str, primary: &str, epoch: u64) -> Result<()> {
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let Some(rec) = old.volumes.get(name) else { return Ok(()) };
        if rec.replicas.is_empty() {
            return Ok(());
        }
        self.close(&[name.to_owned()], true).await;
        let mut cat = old.clone();
        if let Some(r) = cat.volumes.get_mut(name) {
            r.replicas.clear();
            r.stale.clear();
            r.primary = Some(primary.to_owned());
            r.epoch = r.epoch.max(epoch);
            r.voted_for = None;
            r.promoted_from = None;
        }
        self.commit(&old, cat)?;
        if let Err(e) = self.meta.put_drl(name, None) {
            tracing::warn!(volume = name, error = %e, "could not remove the replication record of a deposed copy");
        }
        self.forget_position(name);
        tracing::warn!(volume = name, primary, epoch, "deposed: this copy is now a replica of the map's primary");
        Ok(())
    }

    /// [`Volumes::demote`] in the background.
    pub(super) fn demote_later(&self, name: &str, primary: &str, epoch: u64) {
        let Some(this) = self.this.get().and_then(|w| w.upgrade()) else { return };
        let (name, primary) = (name.to_owned(), primary.to_owned());
        tokio::spawn(async move {
            if let Err(e) = this.demote(&name, &primary, epoch).await {
                tracing::error!(volume = %name, error = %e, "could not turn a deposed copy into a replica");
            }
        });
    }

    /// Registers, in the background, the replicated volumes this node is
    /// the primary of that the map does not hold yet (made before the map).
    pub(super) fn register_missing(&self, names: Vec<(String, Vec<String>, u64)>) {
        let Some(this) = self.this.get().and_then(|w| w.upgrade()) else { return };
        tokio::spawn(async move {
            let Some(map) = this.volume_map().cloned() else { return };
            for (name, copies, epoch) in names {
                if map.map().get(&name).is_some() {
                    continue;
                }
                if let Err(e) = this.register(&name, copies, epoch).await {
                    tracing::warn!(volume = %name, error = %e, "could not register a volume in the volume map");
                }
            }
        });
    }
}
