//! Replacing a lost copy of a replicated volume by a new one on a node that
//! holds none (docs/design/replication-volumes.md, "Replacing a lost
//! copy"), by hand (`coronafs volume replace-copy`) or by the primary once
//! a copy has been out of the in-sync set for `replace_after_ms`.
//!
//! On the primary, in this order, so that a failure leaves nothing
//! half-made: the new node gets an empty copy through its control API; the
//! volume map gives the old copy's place to it (refused, the empty copy is
//! deleted again); the catalog records it (out of sync); the running
//! backend drops the old link and its resync gives the new copy a full
//! copy, after which it rejoins the in-sync set through the map like any
//! copy that catches up. The old copy is asked to delete itself; one that
//! cannot be reached deletes itself when its node next starts and finds
//! the map does not list it ([`Volumes::forget_replaced`]).

use super::Volumes;
use super::copies::ask_delete;
use crate::backend::replicated::PeerState;
use crate::cluster::{ClusterNode, Membership};
use crate::dto::VolumeInfo;
use crate::error::{CoronaError, Result};
use crate::replication::map::state::{Command, Refusal};
use crate::util::validate_name;
use std::time::Duration;

impl Volumes {
    /// On `name`'s primary: replaces the copy on node `old` by a new copy
    /// on `to` (by default a node holding no copy, in a zone the other
    /// copies do not use if there is one), filled in the background.
    pub async fn replace_copy(&self, name: &str, old: &str, to: Option<&str>) -> Result<VolumeInfo> {
        validate_name(name)?;
        self.writable()?;
        let m = self.membership().cloned().ok_or_else(|| {
            CoronaError::BadRequest("replacing a copy needs a cluster (serve with a cluster file)".into())
        })?;
        let map = self.volume_map().cloned().ok_or_else(|| {
            CoronaError::Config("replacing a copy needs the cluster's volume map (serve with a cluster file)".into())
        })?;
        if let Some(p) = self.primary_elsewhere(name)? {
            return Err(CoronaError::Conflict(format!(
                "{name} is a replica on {}; its primary is {p}: replace its copies there",
                m.node
            )));
        }
        let rec = self.catalog()?.volumes.get(name).cloned().ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        if rec.replicas.is_empty() {
            return Err(CoronaError::Conflict(format!("{name} has no copies on other nodes")));
        }
        if old == m.node {
            return Err(CoronaError::Conflict(format!(
                "{old} is the primary of {name}: a primary's copy is not replaced (promote another copy first)"
            )));
        }
        if !rec.replicas.iter().any(|r| r == old) {
            return Err(CoronaError::BadRequest(format!(
                "{old} holds no copy of {name} (its copies: {}, {})",
                m.node,
                rec.replicas.join(", ")
            )));
        }
        let st = map.map().get(name).cloned().ok_or_else(|| {
            CoronaError::Conflict(format!("{name} is not in the volume map yet (registered at start); try again"))
        })?;
        if st.primary != m.node {
            return Err(CoronaError::Conflict(format!(
                "the volume map names {} the primary of {name}, not {}",
                st.primary, m.node
            )));
        }
        let new = match to {
            Some(n) => {
                m.cluster.node(n).map_err(|e| CoronaError::BadRequest(e.to_string()))?;
                if st.copies.iter().any(|c| c == n) {
                    return Err(CoronaError::Conflict(format!("{n} holds a copy of {name} already")));
                }
                n.to_owned()
            }
            None => spare(&m, &st.copies, old)?.name.clone(),
        };
        // The backend that takes the new link: the export, opened if no
        // client has it open.
        let export = self.open(name)?;
        let handle = export
            .replication
            .clone()
            .ok_or_else(|| CoronaError::Conflict(format!("{name} is not open as a replicated volume here")))?;
        let node = m.cluster.node(&new)?.clone();
        let api = m.peer_api(&node);
        match api.create(name, rec.size).await {
            Ok(_) => {}
            // Not a copy the map knows (it is not among the copies): left
            // by an earlier replacement that failed, or by an older volume.
            Err(e) if e.to_string().contains("409") || e.to_string().contains("exists") => {
                api.delete(name, true)
                    .await
                    .map_err(|e| CoronaError::Replica(format!("removing an old copy of {name} on {new}: {e}")))?;
                api.create(name, rec.size)
                    .await
                    .map_err(|e| CoronaError::Replica(format!("creating the new copy of {name} on {new}: {e}")))?;
            }
            Err(e) => return Err(CoronaError::Replica(format!("creating the new copy of {name} on {new}: {e}"))),
        }
        let cmd = Command::Replace {
            volume: name.to_owned(),
            by: m.node.clone(),
            epoch: st.epoch,
            old: old.to_owned(),
            new: new.clone(),
            at_ms: crate::util::unix_ms(),
        };
        let deadline = Duration::from_millis(m.cluster.ack_timeout_ms);
        let refused = match map.propose(cmd, deadline).await {
            Ok(Ok(_)) => None,
            Ok(Err(r @ Refusal::NotPrimary { .. })) => Some(CoronaError::Conflict(r.to_string())),
            Ok(Err(r)) => Some(CoronaError::Conflict(format!("the volume map refused: {r}"))),
            Err(e) => Some(CoronaError::Map(format!("{name}: the replacement was not recorded: {e}"))),
        };
        if let Some(e) = refused {
            if let Err(d) = api.delete(name, true).await {
                tracing::warn!(volume = name, node = %new, error = %d, "could not remove the unused new copy");
            }
            return Err(e);
        }
        {
            let _g = self.control.lock().await;
            let before = self.catalog()?;
            let mut cat = before.clone();
            if let Some(r) = cat.volumes.get_mut(name) {
                for list in [&mut r.replicas, &mut r.copies] {
                    for c in list.iter_mut().filter(|c| *c == old) {
                        c.clone_from(&new);
                    }
                }
                r.stale.retain(|s| s != old);
                r.stale.push(new.clone());
            }
            self.commit(&before, cat)?;
        }
        handle.replace_peer(old, &new).await?;
        tracing::warn!(volume = name, old, new = %new, "copy replaced: the new copy is filled in the background");
        // The old copy goes now if its node answers, or at its next start.
        if let Ok(n) = m.cluster.node(old) {
            let (addr, secret, volume, me) = (n.replica, m.secret.clone(), name.to_owned(), m.node.clone());
            let epoch = st.epoch;
            tokio::spawn(async move {
                let errno = ask_delete(addr, &secret, &volume, epoch, &me, deadline).await;
                tracing::info!(volume, ?errno, "asked the replaced copy to delete itself");
            });
        }
        self.show(name).await
    }

    /// Whether the primary's resync is copying to `copy` of `name` now.
    pub(super) async fn catching_up(&self, name: &str, copy: &str) -> bool {
        let handle = self.open.lock().ok().and_then(|o| o.get(name).and_then(|e| e.replication.clone()));
        let Some(h) = handle else { return false };
        h.states().await.iter().any(|(n, s)| n == copy && matches!(s, PeerState::CatchingUp { .. }))
    }

    /// At start, in the background: deletes this node's replica copies that
    /// the volume map no longer lists (replaced while this node was away),
    /// once this node's map has caught up with the leader's.
    pub(super) fn forget_replaced(&self) {
        // Weak: a server that stops meanwhile closes its stores.
        let Some(weak) = self.this.get().cloned() else { return };
        let Some(map) = self.volume_map().cloned() else { return };
        let Some(me) = self.membership().map(|m| m.node.clone()) else { return };
        tokio::spawn(async move {
            if !map.settled(map.lease() * 4).await {
                tracing::info!("the volume map did not settle: replaced copies are kept until the next start");
                return;
            }
            let Some(this) = weak.upgrade() else { return };
            let copies: Vec<String> = match this.cat.lock() {
                Ok(c) => c
                    .volumes
                    .iter()
                    .filter(|(_, r)| r.replicas.is_empty() && r.primary.as_deref().is_some_and(|p| p != me))
                    .map(|(n, _)| n.clone())
                    .collect(),
                Err(_) => return,
            };
            let now = map.map();
            for name in copies {
                let Some(st) = now.get(&name) else { continue };
                if st.copies.contains(&me) {
                    continue;
                }
                tracing::warn!(volume = %name, copies = ?st.copies, "this copy was replaced while the node was away: deleting it");
                if let Err(e) = this.delete(&name, true).await {
                    tracing::warn!(volume = %name, error = %e, "could not delete a replaced copy");
                }
            }
        });
    }
}

/// The node a new copy goes to in place of `old`: one holding no copy
/// (`copies`), in a zone no copy but `old` uses if there is one, else the
/// first in the file.
fn spare<'a>(m: &'a Membership, copies: &[String], old: &str) -> Result<&'a ClusterNode> {
    let used: Vec<&str> =
        copies.iter().filter(|c| *c != old).filter_map(|c| m.cluster.node(c).ok()).map(|n| n.zone.as_str()).collect();
    let free: Vec<&ClusterNode> = m.cluster.nodes.iter().filter(|n| !copies.contains(&n.name)).collect();
    free.iter().find(|n| !used.contains(&n.zone.as_str())).or(free.first()).copied().ok_or_else(|| {
        CoronaError::Conflict(format!(
            "every node of the cluster file holds a copy already ({}): add a node to replace one",
            copies.join(", ")
        ))
    })
}
