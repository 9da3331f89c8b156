//! The operations of a replicated volume that change every copy, beside
//! snapshots (in `mod.rs`): deletion, growth, flattening and replicated
//! clones; on the primary, and each copy's side of them
//! (docs/design/replication-volumes.md, "Deleting, growing, flattening and
//! cloning").
//!
//! - **Delete**: the primary commits the deletion together with a
//!   [`Deletion`] naming every other copy, then sends each a DELETE_VOLUME
//!   on a connection of its own; the copies it cannot reach stay named and
//!   are asked again every `resync_retry_ms` (and after a restart) until
//!   they answer. A copy fenced past the deletion's epoch, or that is a
//!   primary itself now, refuses for good: it belongs to a newer primary.
//! - **Grow**: with the NBD requests and writes held, the primary flushes
//!   every live copy, grows its own copy, and queues RESIZE in the stream;
//!   a copy that misses it grows itself when it catches up (its catch-up
//!   OPEN carries the new size).
//! - **Flatten**: the primary flattens its own copy, then queues FLATTEN;
//!   each copy flattens itself in the background (no byte changes, so the
//!   stream does not wait for it).
//! - **Clone with copies**: an O(1) clone on each node that holds the
//!   snapshot (placed as `volume create --replicas` places, among them
//!   only), then the local one records the others as its replicas.

use super::catalog::{Catalog, VolumeRec, snap_key};
use super::{Volumes, check_size, parse_snap};
use crate::backend::AnyBackend;
use crate::backend::layered::Layer;
use crate::backend::replicated::link::handshake_as_caller;
use crate::cluster::ClusterNode;
use crate::dto::VolumeInfo;
use crate::error::{CoronaError, Result};
use crate::replica::auth::RpcSecret;
use crate::replica::wire::{Body, Msg, REPLY_LEN, Reply};
use crate::util::validate_name;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

impl Volumes {
    /// Refuses a new replicated volume of a name whose earlier copies are
    /// still to be deleted (the deletion would reach the new copies).
    pub(super) fn no_pending_deletion(&self, name: &str) -> Result<()> {
        match self.catalog()?.deletions.get(name) {
            Some(d) => Err(CoronaError::Conflict(format!(
                "the copies of an earlier volume {name} on {} are still to be deleted (unreachable so far); \
                 retry once they are",
                d.nodes.join(", ")
            ))),
            None => Ok(()),
        }
    }

    /// Deleted replicated volumes whose copies on other nodes are still to
    /// be deleted, with those nodes.
    pub fn pending_deletions(&self) -> Vec<(String, Vec<String>)> {
        self.catalog().map(|c| c.deletions.into_iter().map(|(n, d)| (n, d.nodes)).collect()).unwrap_or_default()
    }

    /// Tells the copies of the deleted volume `name` to delete themselves;
    /// those not reached are asked again in the background.
    pub(super) async fn deliver_deletion(&self, name: &str) {
        if self.try_deliver(name).await {
            self.retry_deletions();
        }
    }

    /// One round of asking every copy still named for `name`; gives whether
    /// some are left.
    async fn try_deliver(&self, name: &str) -> bool {
        let Some(m) = self.membership().cloned() else { return false };
        let Some(d) = self.catalog().ok().and_then(|c| c.deletions.get(name).cloned()) else { return false };
        let (timeout, epoch) = (Duration::from_millis(m.cluster.ack_timeout_ms), d.epoch);
        let asks = d.nodes.iter().map(|n| {
            let m = m.clone();
            async move {
                let answer = match m.cluster.node(n) {
                    Ok(node) => ask_delete(node.replica, &m.secret, name, epoch, &m.node, timeout).await,
                    // Gone from the cluster file: nothing to reach.
                    Err(_) => Some(libc::ENOENT as u32),
                };
                (n.clone(), answer)
            }
        });
        let mut done = Vec::new();
        for (node, answer) in futures::future::join_all(asks).await {
            match answer {
                None => tracing::info!(volume = name, node, "copy not reached; its deletion is retried"),
                Some(0) => {
                    tracing::info!(volume = name, node, "copy deleted");
                    done.push(node);
                }
                Some(errno) => {
                    let e = std::io::Error::from_raw_os_error(errno as i32);
                    tracing::warn!(volume = name, node, error = %e, "copy refused its deletion: it has another primary now; kept");
                    done.push(node);
                }
            }
        }
        if !done.is_empty() {
            let _g = self.control.lock().await;
            if let Ok(old) = self.catalog() {
                let mut cat = old.clone();
                if let Some(d) = cat.deletions.get_mut(name) {
                    d.nodes.retain(|n| !done.contains(n));
                    if d.nodes.is_empty() {
                        cat.deletions.remove(name);
                    }
                }
                if cat != old
                    && let Err(e) = self.commit(&old, cat)
                {
                    tracing::warn!(volume = name, error = %e, "could not record the copies deleted");
                }
            }
        }
        self.catalog().map(|c| c.deletions.contains_key(name)).unwrap_or(false)
    }

    /// Starts (unless it runs) the task that asks the copies of deleted
    /// volumes again every `resync_retry_ms` until none is left: after a
    /// deletion that did not reach every copy, and at start.
    pub fn retry_deletions(&self) {
        let (Some(this), Some(m)) = (self.this.get().cloned(), self.membership().cloned()) else { return };
        if self.delivering.swap(true, SeqCst) {
            return;
        }
        let pause = Duration::from_millis(m.cluster.resync_retry_ms.max(50));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(pause).await;
                let Some(v) = this.upgrade() else { return };
                let names: Vec<String> = v.catalog().map(|c| c.deletions.keys().cloned().collect()).unwrap_or_default();
                if names.is_empty() {
                    v.delivering.store(false, SeqCst);
                    // A deletion recorded just now found the task running.
                    let again = v.catalog().map(|c| !c.deletions.is_empty()).unwrap_or(false);
                    if !again || v.delivering.swap(true, SeqCst) {
                        return;
                    }
                }
                for n in names {
                    v.try_deliver(&n).await;
                }
            }
        });
    }

    /// This copy's answer to `primary` deleting `name` at `epoch`: 0 once
    /// it is deleted (or was not here), `EBUSY` if this node is the
    /// volume's primary, `EPERM` if the copy was fenced past `epoch` or
    /// follows another primary (a newer one owns it).
    pub async fn delete_as_copy(&self, name: &str, epoch: u64, primary: &str) -> u32 {
        let _g = self.control.lock().await;
        let Ok(old) = self.catalog() else { return libc::EIO as u32 };
        let Some(rec) = old.volumes.get(name) else { return 0 };
        if !rec.replicas.is_empty() {
            return libc::EBUSY as u32;
        }
        let seen = rec.epoch.max(self.position(name).map_or(0, |p| p.epoch));
        if epoch < seen || rec.primary.as_deref().is_some_and(|p| p != primary) {
            tracing::warn!(volume = name, primary, epoch, seen, follows = ?rec.primary, "refused a deletion of this copy");
            return libc::EPERM as u32;
        }
        match self.delete_locked(name, true).await {
            Ok(_) => {
                tracing::info!(volume = name, primary, "copy deleted by its primary");
                0
            }
            Err(e) => {
                tracing::warn!(volume = name, error = %e, "could not delete this copy");
                libc::EIO as u32
            }
        }
    }

    /// Grows the replicated volume `name` (its record `rec` in `old`) on its
    /// primary to `size`, at one point of the write stream. Call holding
    /// the control lock.
    pub(super) async fn resize_replicated(
        &self,
        old: &Catalog,
        name: &str,
        rec: &VolumeRec,
        size: u64,
    ) -> Result<VolumeInfo> {
        if size < rec.size {
            return Err(CoronaError::BadRequest(format!(
                "{name} is replicated: shrinking is not supported (a copy that missed the shrink could keep \
                 bytes past the end that a later growth would show); it can only grow (from {} bytes)",
                rec.size
            )));
        }
        if size == rec.size {
            return self.info(name);
        }
        let v = self.open(name)?;
        let (Some(h), Some(local)) = (v.replication.clone(), v.local.clone()) else {
            return Err(CoronaError::Conflict(format!("{name} is replicated but not open as its primary here")));
        };
        // No NBD request in flight through the export, then no write or
        // resync copy between numbering and the local write.
        let mut outer = v.backend.exclusive().await;
        let gate = h.quiesce().await;
        h.flush_copies().await.map_err(|e| CoronaError::Replica(format!("resize of {name}: {e}")))?;
        self.resize_layer(&local, old, name, rec, size).await?;
        let point = h.grow(size).await;
        // The export's outer layer at the new size, over the same backend.
        if let AnyBackend::Replicated(r) = &outer.data {
            let layer = Layer::base(0, size, AnyBackend::Replicated(Box::new(r.share())));
            v.backend.replace(&mut outer, Arc::new(layer));
        }
        drop(gate);
        drop(outer);
        let point = point.map_err(|e| {
            CoronaError::Replica(format!(
                "{name} grew to {size} bytes here but was not sent to its copies ({e}); they grow when they catch up"
            ))
        })?;
        let took = h.settle(point).await;
        let quorum = h.write_quorum();
        if 1 + took.len() < quorum {
            return Err(CoronaError::Replica(format!(
                "{name} grew to {size} bytes here and on {took:?} only, below the write quorum of {quorum}; \
                 the other copies grow when they catch up"
            )));
        }
        tracing::info!(volume = name, size, ?took, "replicated volume grown");
        self.info(name)
    }

    /// A replica copy applies its primary's RESIZE frame (or the size of
    /// a catch-up OPEN): grows to `size`; a copy only grows.
    pub async fn resize_as_copy(&self, name: &str, size: u64) -> Result<()> {
        validate_name(name)?;
        self.writable()?;
        check_size(size)?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let rec = old.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?.clone();
        if size < rec.size {
            return Err(CoronaError::BadRequest(format!("a copy only grows ({name} has {} bytes)", rec.size)));
        }
        if size == rec.size {
            return Ok(());
        }
        let v = self.open(name)?;
        self.resize_layer(&v.backend, &old, name, &rec, size).await
    }

    /// Queues FLATTEN on every live copy of `name` (its primary flattened
    /// its own copy). A copy that misses it stays layered with the same
    /// bytes.
    pub(super) async fn flatten_copies(&self, name: &str, h: &super::replication::Handle) {
        match h.send_point(Body::Flatten).await {
            Ok(p) => {
                let took = h.settle(p).await;
                tracing::info!(volume = name, ?took, "flatten sent to the copies");
            }
            Err(e) => tracing::warn!(volume = name, error = %e, "flatten not sent to the copies"),
        }
    }

    /// A replica copy applies its primary's FLATTEN frame: flattens itself
    /// in the background, so the stream goes on meanwhile. If its head or
    /// size changed before the end (a snapshot or growth in the stream), it
    /// stays layered: the bytes are the same either way.
    pub fn flatten_as_copy(&self, name: &str) -> Result<()> {
        let this = self
            .this
            .get()
            .and_then(|w| w.upgrade())
            .ok_or_else(|| CoronaError::Io(std::io::Error::other("the volume manager is shutting down")))?;
        let rec = self.catalog()?.volumes.get(name).cloned().ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        let v = self.open(name)?;
        let name = name.to_owned();
        tokio::spawn(async move {
            let r: Result<()> = async {
                this.materialize_all(&v.backend, rec.size).await?;
                let _g = this.control.lock().await;
                let old = this.catalog()?;
                match old.volumes.get(&name) {
                    Some(now) if now.head == rec.head && now.size == rec.size => {}
                    _ => {
                        tracing::info!(volume = %name, "the copy changed while it flattened: it stays layered");
                        return Ok(());
                    }
                }
                this.detach(&v.backend, &old, &name, &rec).await
            }
            .await;
            if let Err(e) = r {
                tracing::warn!(volume = %name, error = %e, "the copy could not flatten; it stays layered");
            }
        });
        Ok(())
    }

    /// A clone of `from` (`VOL@SNAP`, a snapshot of a volume this node is
    /// the primary of) with `copies` copies: an O(1) clone on each node
    /// placed among those holding the snapshot (the primary's replicas
    /// not in its `missing_on`), then this node's, which records the others
    /// as its replicas. A failure undoes the clones already made.
    pub async fn clone_replicated(
        &self,
        name: &str,
        from: &str,
        size: Option<u64>,
        copies: usize,
    ) -> Result<VolumeInfo> {
        if copies <= 1 {
            return self.clone_snapshot(name, from, size).await;
        }
        validate_name(name)?;
        let (vol, snap) = parse_snap(from)?;
        self.writable()?;
        let m = self.membership().cloned().ok_or_else(|| {
            CoronaError::BadRequest(format!(
                "{copies} copies asked, but this server is in no cluster (serve with a cluster file)"
            ))
        })?;
        let cat = self.catalog()?;
        if cat.volumes.contains_key(name) {
            return Err(CoronaError::AlreadyExists(name.to_owned()));
        }
        self.no_pending_deletion(name)?;
        let key = snap_key(vol, snap);
        let s = cat.snapshots.get(&key).ok_or_else(|| CoronaError::SnapshotNotFound(key.clone()))?;
        let src = cat.volumes.get(vol).ok_or_else(|| CoronaError::NotFound(vol.to_owned()))?;
        self.not_a_copy(vol, src, "clones with copies")?;
        let size = size.unwrap_or(s.size);
        check_size(size)?;
        if size < s.size {
            return Err(CoronaError::BadRequest(format!(
                "a clone cannot be smaller than its snapshot ({size} < {} bytes)",
                s.size
            )));
        }
        let holders: Vec<String> = std::iter::once(m.node.clone())
            .chain(src.replicas.iter().filter(|r| !s.missing.contains(r)).cloned())
            .collect();
        if holders.len() < copies {
            let missing =
                if s.missing.is_empty() { String::new() } else { format!("; missing on {}", s.missing.join(", ")) };
            return Err(CoronaError::Conflict(format!(
                "{copies} copies asked, but {key} is on {} node(s) only ({}{missing}): a clone's copy can only be \
                 made where the snapshot is",
                holders.len(),
                holders.join(", ")
            )));
        }
        let placed: Vec<ClusterNode> =
            m.cluster.place_on(&m.node, copies, |n| holders.iter().any(|h| h == n))?.into_iter().cloned().collect();
        self.register(name, placed.iter().map(|n| n.name.clone()).collect(), 0).await?;
        let mut made: Vec<&ClusterNode> = Vec::new();
        let mut failure = None;
        for n in &placed[1..] {
            let api = m.peer_api(n);
            match api.clone_snapshot(name, from, Some(size)).await {
                Ok(_) => made.push(n),
                Err(e) => {
                    failure = Some(CoronaError::Replica(format!("cloning {from} as {name} on {}: {e}", n.name)));
                    break;
                }
            }
        }
        let result = match failure {
            Some(e) => Err(e),
            None => self.clone_with(name, from, Some(size), placed[1..].iter().map(|n| n.name.clone()).collect()).await,
        };
        if result.is_err() {
            for n in made {
                let api = m.peer_api(n);
                if let Err(e) = api.delete(name, true).await {
                    tracing::warn!(node = %n.name, volume = name, error = %e, "could not undo a clone's copy");
                }
            }
            self.unregister(name).await;
        } else {
            tracing::info!(volume = name, from, copies, nodes = ?placed.iter().map(|n| &n.name).collect::<Vec<_>>(), "created replicated clone");
        }
        result
    }
}

/// Sends DELETE_VOLUME for `volume` at `epoch` from `primary` to the copy
/// at `addr` on a connection of its own; gives its answer (errno), or
/// `None` (logged) when it could not be reached within `timeout`.
pub async fn ask_delete(
    addr: SocketAddr,
    secret: &RpcSecret,
    volume: &str,
    epoch: u64,
    primary: &str,
    timeout: Duration,
) -> Option<u32> {
    let ask = async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        handshake_as_caller(&mut s, secret).await?;
        let msg =
            Msg { seq: 0, epoch, body: Body::DeleteVolume { volume: volume.to_owned(), primary: primary.to_owned() } };
        let (h, payload) = msg.encode();
        s.write_all(&h).await?;
        s.write_all(&payload).await?;
        let mut r = [0u8; REPLY_LEN];
        s.read_exact(&mut r).await?;
        Reply::decode(&r)
    };
    match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(r)) => Some(r.errno),
        Ok(Err(e)) => {
            tracing::debug!(%addr, error = %e, "no answer to a volume deletion");
            None
        }
        Err(_) => None,
    }
}
