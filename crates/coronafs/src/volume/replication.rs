//! A replicated volume on its primary, as the volume manager runs it: the
//! links to the replicas over TCP ([`TcpConnector`]), the persisted record
//! of the clean-shutdown mark and the dirty-region log ([`MetaStore`], in
//! its own table of the metadata store), and the start of the replicated
//! backend from that record (docs/design/replication-volumes.md).

use super::catalog::VolumeRec;
use super::meta::Meta;
use super::{Volumes, failover, poisoned};
use crate::backend::AnyBackend;
use crate::backend::layered::Layered;
use crate::backend::replicated::drl::{self, DrlRecord, History};
use crate::backend::replicated::link::{LinkTarget, ReplicaLink, StreamSpec, TcpLink};
use crate::backend::replicated::{
    ChangeHook, Connector, DrlStore, DynBackend, Inner, Replicated, ReplicationPolicy, Resync,
};
use crate::dto::{ReplicaStatus, ReplicaSync, VolumeInfo};
use crate::error::{CoronaError, Result};
use crate::replica::auth::RpcSecret;
use crate::replica::wire::Origin;
use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// The primary's handle on a replicated volume it has open.
pub type Handle = Arc<Inner<DynBackend>>;

/// Saves a volume's [`DrlRecord`] in the metadata store.
pub struct MetaStore {
    meta: Arc<Meta>,
    name: String,
}

impl DrlStore for MetaStore {
    fn save(&self, rec: &DrlRecord) -> io::Result<()> {
        self.meta.put_drl(&self.name, Some(rec)).map_err(|e| io::Error::other(e.to_string()))
    }
}

/// Opens TCP links to a volume's replicas: write-stream links carry the
/// primary's stream number; a resync stream carries stream 0, so a copy
/// catching up never reports a position comparable with the live copies'.
pub struct TcpConnector {
    targets: HashMap<String, LinkTarget>,
    secret: RpcSecret,
    volume: String,
    size: std::sync::atomic::AtomicU64,
    /// What OPEN says of the stream (its copies change when one is replaced).
    origin: std::sync::Mutex<Origin>,
}

impl Connector for TcpConnector {
    fn connect(
        &self,
        peer: &str,
        resync: bool,
        first_seq: u64,
        epoch: u64,
        expect: u64,
    ) -> io::Result<Arc<dyn ReplicaLink>> {
        let target = self
            .targets
            .get(peer)
            .cloned()
            .ok_or_else(|| io::Error::other(format!("{peer} is not a replica of {}", self.volume)))?;
        let mut origin = self.origin.lock().map_err(|_| io::Error::other("origin lock poisoned"))?.clone();
        if resync {
            origin.stream = 0;
        }
        origin.incarnation = expect;
        let size = self.size.load(std::sync::atomic::Ordering::Acquire);
        let spec = StreamSpec { volume: self.volume.clone(), size, epoch, first_seq, origin };
        Ok(Arc::new(TcpLink::start(target, self.secret.clone(), spec).0))
    }

    fn resized(&self, size: u64) {
        self.size.store(size, std::sync::atomic::Ordering::Release);
    }

    fn replaced(&self, old: &str, new: &str) {
        if let Ok(mut o) = self.origin.lock() {
            for c in o.copies.iter_mut().filter(|c| *c == old) {
                *c = new.to_owned();
            }
        }
    }
}

impl Volumes {
    /// The primary's backend of a replicated volume: `local`, forwarding to
    /// a link per replica in sync (connecting in the background) and
    /// bringing the others back. Before anything else it durably sets the
    /// clean-shutdown mark; found set, the last stop was unclean and no
    /// replica starts live.
    pub(super) fn replicated(
        &self,
        name: &str,
        rec: &VolumeRec,
        local: Arc<Layered<AnyBackend>>,
    ) -> Result<(AnyBackend, Handle)> {
        let m = self.membership().ok_or_else(|| {
            CoronaError::Config(format!("{name} has copies on {:?}, but this server is in no cluster", rec.replicas))
        })?;
        let timeout = Duration::from_millis(m.cluster.ack_timeout_ms);
        let heartbeat = Some(Duration::from_millis(m.cluster.heartbeat_ms));
        for peer in &rec.replicas {
            m.cluster.node(peer)?;
        }
        // Every other node of the cluster file: a lost copy may be replaced
        // by a copy on any of them (`Volumes::replace_copy`).
        let targets: HashMap<String, LinkTarget> = m
            .cluster
            .nodes
            .iter()
            .filter(|n| n.name != m.node)
            .map(|n| (n.name.clone(), LinkTarget { peer: n.name.clone(), addr: n.replica, timeout, heartbeat }))
            .collect();
        let prev = self.meta.drl(name)?;
        let plan = drl::plan(prev.as_ref(), rec.size, &rec.replicas, &rec.stale);
        let known = prev.as_ref().map(|p| p.incarnations.clone()).unwrap_or_default();
        if plan.unclean {
            tracing::warn!(
                volume = name,
                regions = plan.inherited.len(),
                "the primary stopped uncleanly: every replica catches up before it counts as in sync"
            );
        }
        let mark = DrlRecord {
            open: true,
            region: drl::region_size(rec.size),
            bits: drl::encode_bits(plan.inherited.iter().copied()),
            in_sync: Vec::new(),
            untracked: plan.behind.iter().filter(|(_, h)| *h == History::Unknown).map(|(n, _)| n.clone()).collect(),
            incarnations: known.clone(),
        };
        // Durable before the export exists, so before any write is answered.
        self.meta.put_drl(name, Some(&mark))?;
        let connector = Arc::new(TcpConnector {
            targets,
            secret: m.secret.clone(),
            volume: name.to_owned(),
            size: rec.size.into(),
            origin: std::sync::Mutex::new(failover::origin(&m.node, rec)),
        });
        let mut links = Vec::new();
        for peer in rec.replicas.iter().filter(|r| !plan.behind.iter().any(|(b, _)| b == *r)) {
            links.push(connector.connect(peer, false, 1, rec.epoch, known.get(peer).copied().unwrap_or(0))?);
        }
        let policy = ReplicationPolicy { write_quorum: m.cluster.write_quorum, epoch: rec.epoch, ack_timeout: timeout };
        let mut hook = self.state_recorder(name);
        // With a volume map, the primary answers to it: a lease, and the
        // in-sync set every departure and return of a replica is recorded in.
        let lease = match self.volume_map().cloned() {
            Some(map) => {
                let epoch = match map.map().get(name) {
                    // This node's map lags the catalog (a takeover granted
                    // here, not applied here yet): nothing to decide on.
                    Some(st) if st.primary != m.node && st.epoch < rec.epoch => {
                        return Err(CoronaError::Map(format!(
                            "{name}: this node's volume map is at epoch {}, behind its catalog's {}; try again",
                            st.epoch, rec.epoch
                        )));
                    }
                    Some(st) if st.primary != m.node => {
                        let (primary, epoch) = (st.primary.clone(), st.epoch);
                        self.demote_later(name, &primary, epoch);
                        return Err(CoronaError::Conflict(format!(
                            "{name}: the volume map names {primary} the primary at epoch {epoch}; this copy becomes its \
                             replica"
                        )));
                    }
                    Some(st) => st.epoch,
                    None => rec.epoch,
                };
                let out: Vec<String> = plan.behind.iter().map(|(n, _)| n.clone()).collect();
                let live = rec.replicas.iter().filter(|r| !out.contains(r)).cloned().collect();
                let lease = super::lease::PrimaryLease::start(self, map, name, epoch, live, out);
                let (l, catalog) = (lease.clone(), hook);
                hook = Box::new(move |peer: &str, in_sync: bool| {
                    l.note(peer, in_sync);
                    catalog(peer, in_sync);
                });
                Some(lease)
            }
            None => None,
        };
        let resync = Resync {
            connector,
            store: Arc::new(MetaStore { meta: self.meta.clone(), name: name.to_owned() }),
            rate: m.cluster.resync_bytes_per_sec,
            retry: Duration::from_millis(m.cluster.resync_retry_ms),
        };
        let mut r = Replicated::new(DynBackend::new(local), links, policy, 1, m.metrics.clone()).on_change(hook);
        if let Some(lease) = lease {
            r = r.with_authority(lease);
        }
        let r = r.with_resync(resync, plan.behind, plan.inherited).with_incarnations(&known).start();
        let handle = r.handle();
        Ok((AnyBackend::Replicated(Box::new(r)), handle))
    }

    /// The hook a replicated volume calls when a replica leaves (`false`)
    /// or rejoins (`true`) its live set: it records that in the catalog in
    /// the background, in the order the changes happened (one task per
    /// volume takes them from a queue), so a late 'stale' can never
    /// overwrite a newer 'in sync' or the reverse. The task ends with the
    /// volume's backend (the hook holds the queue).
    pub fn state_recorder(&self, name: &str) -> ChangeHook {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, bool)>();
        let this = self.this.get().cloned();
        let volume = name.to_owned();
        tokio::spawn(async move {
            while let Some((peer, in_sync)) = rx.recv().await {
                let Some(v) = this.as_ref().and_then(|w| w.upgrade()) else { return };
                let r = if in_sync { v.mark_in_sync(&volume, &peer).await } else { v.mark_stale(&volume, &peer).await };
                if let Err(e) = r {
                    tracing::error!(volume, peer, in_sync, error = %e, "could not record a replica's state");
                }
            }
        });
        Box::new(move |peer: &str, in_sync: bool| {
            let _ = tx.send((peer.to_owned(), in_sync));
        })
    }

    /// Takes `peer` off `name`'s stale list: it caught up and is live again.
    pub async fn mark_in_sync(&self, name: &str, peer: &str) -> Result<()> {
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let mut cat = old.clone();
        let Some(rec) = cat.volumes.get_mut(name) else { return Ok(()) };
        if !rec.stale.iter().any(|r| r == peer) {
            return Ok(());
        }
        rec.stale.retain(|r| r != peer);
        self.commit(&old, cat)?;
        tracing::info!(volume = name, peer, "replica caught up: in sync again");
        Ok(())
    }

    /// The record of a volume this node just became the primary of: the
    /// copies at its position are in sync, the others' history is unknown
    /// to it (it kept no log as a replica), so they get full copies.
    pub(super) fn reset_log(&self, name: &str, size: u64, replicas: &[String], stale: &[String]) -> Result<()> {
        let rec = DrlRecord {
            in_sync: replicas.iter().filter(|r| !stale.contains(r)).cloned().collect(),
            untracked: stale.to_vec(),
            ..DrlRecord::fresh(size, &[])
        };
        self.meta.put_drl(name, Some(&rec))
    }

    /// Whether this node is the primary of `name` (its record names replicas).
    pub fn is_primary(&self, name: &str) -> bool {
        self.cat.lock().map(|c| c.volumes.get(name).is_some_and(|r| !r.replicas.is_empty())).unwrap_or(false)
    }

    /// [`Volumes::info`] with each replica's state: from the running
    /// backend while this node has the volume open as its primary, else
    /// from the volume map; with when each copy left the in-sync set.
    pub async fn show(&self, name: &str) -> Result<VolumeInfo> {
        let mut info = self.info(name)?;
        if info.replicas.is_empty() {
            return Ok(info);
        }
        let handle = self.open.lock().map_err(|_| poisoned())?.get(name).and_then(|e| e.replication.clone());
        let running: HashMap<String, _> = match handle {
            Some(h) => h.states().await.into_iter().collect(),
            None => HashMap::new(),
        };
        let mapped = self.volume_map().and_then(|m| m.map().get(name).cloned());
        info.replica_states = info
            .replicas
            .iter()
            .filter_map(|r| {
                use crate::backend::replicated::PeerState as P;
                let (state, bytes_left) = match (running.get(r), &mapped) {
                    (Some(P::InSync), _) => (ReplicaSync::InSync, None),
                    (Some(P::CatchingUp { bytes_left }), _) => (ReplicaSync::CatchingUp, Some(*bytes_left)),
                    (Some(P::Stale), _) => (ReplicaSync::Stale, None),
                    (None, Some(st)) if st.in_sync.contains(r) => (ReplicaSync::InSync, None),
                    (None, Some(_)) => (ReplicaSync::Stale, None),
                    (None, None) => return None,
                };
                let out_since_ms = mapped.as_ref().and_then(|st| st.out_since.get(r).copied());
                Some(ReplicaStatus { node: r.clone(), state, bytes_left, out_since_ms })
            })
            .collect();
        Ok(info)
    }
}
