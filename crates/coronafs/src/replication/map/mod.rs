//! The volume map: one Raft group of the CoronaFS nodes of a cluster file
//! (openraft), whose state machine ([`state`]) says for each replicated
//! volume which nodes hold copies, which is primary at which epoch, which
//! copies are in sync, and how often the primary's lease was renewed.
//!
//! - [`state`]: the map and its rules, pure;
//! - [`store`]: the Raft log and vote in the data dir (`.volume-map/`), the machine
//!   in memory;
//! - [`net`]: the map's RPC, on the replica listener after its handshake;
//! - [`members`]: founding the group, and nodes joining and leaving it;
//! - [`MapNode`]: this node's member of the group: starts it from the
//!   cluster file, proposes commands (forwarding them to the leader), and
//!   holds the leader's side of the lease ([`MapNode::propose`] refuses a
//!   takeover until a whole lease has passed, on the leader's own
//!   monotonic clock, since the lease was last renewed and since this node
//!   became leader).
//!
//! The design, and why it is safe, is in docs/design/replication-volumes.md
//! ("The volume map").

pub mod members;
pub mod net;
pub mod state;
pub mod store;

#[cfg(test)]
mod tests;

use crate::cluster::ClusterFile;
use crate::error::{CoronaError, Result};
use crate::replica::auth::RpcSecret;
use net::{Answer, Conn, ProposeError, Request};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{Raft, ServerState};
use serde::{Deserialize, Serialize};
use state::{Command, Outcome, VolumeMap};
use std::collections::BTreeMap;
// openraft's default snapshot type, named by the macro below.
use std::io::Cursor;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

/// A node's id in the group: from its name, so it does not depend on the
/// order of the cluster file.
pub type NodeId = u64;

/// A member of the group as Raft knows it: the node's name and replica
/// address (where its map RPC is taken).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    pub name: String,
    pub addr: String,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

openraft::declare_raft_types!(
    /// The map's Raft types.
    pub Cfg:
        D = Command,
        R = Option<Outcome>,
        NodeId = NodeId,
        Node = Peer,
);

/// The id of the node named `name`: the first 8 bytes of its SHA-256.
pub fn node_id(name: &str) -> NodeId {
    use sha2::Digest;
    let d = sha2::Sha256::digest(name.as_bytes());
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// How fast the group and the lease run.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long a primary's lease lasts from the moment it asked for it.
    pub lease: Duration,
    /// How often the Raft leader sends heartbeats.
    pub heartbeat: Duration,
    /// A follower that heard no leader for a time drawn from this range
    /// stands for leader.
    pub election: (Duration, Duration),
}

impl Timing {
    /// The timing for a lease of `lease`: Raft heartbeats every tenth of it
    /// (50 to 200 ms), elections after a third to two thirds of it (at
    /// least 0.5 to 1 s, so a loaded host does not change leaders for a late
    /// heartbeat).
    pub fn for_lease(lease: Duration) -> Timing {
        let ms = lease.as_millis() as u64;
        Timing {
            lease,
            heartbeat: Duration::from_millis((ms / 10).clamp(50, 200)),
            election: (Duration::from_millis((ms / 3).max(500)), Duration::from_millis((ms * 2 / 3).max(1_000))),
        }
    }
}

impl Timing {
    /// The timing of `cluster`: a lease of `lease_ms`, by default
    /// `failover_after_ms` (5 s when automatic failover is off).
    pub fn for_cluster(cluster: &ClusterFile) -> Timing {
        Timing::for_lease(cluster.lease())
    }
}

/// What a node knows of the group, for `volume show` and the tests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapStatus {
    /// This node's name.
    pub node: String,
    /// The leader's name, if this node knows one.
    pub leader: Option<String>,
    pub term: u64,
    /// The index of the last entry this node applied.
    pub applied: Option<u64>,
    /// The group's voters by name.
    pub voters: Vec<String>,
}

/// This node's member of the map's Raft group.
pub struct MapNode {
    raft: Raft<Cfg>,
    me: NodeId,
    name: String,
    peers: BTreeMap<NodeId, Peer>,
    secret: Arc<RpcSecret>,
    machine: Arc<store::Machine>,
    db: store::Db,
    timing: Timing,
    /// The term this node leads and since when (its own clock), if it leads.
    leading: Arc<Mutex<Option<(u64, Instant)>>>,
    watcher: tokio::task::JoinHandle<()>,
    /// Founds the group when this node's store is pristine ([`members`]).
    founder: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for MapNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MapNode").field("name", &self.name).field("me", &self.me).finish_non_exhaustive()
    }
}

fn raft_err(e: impl std::fmt::Display) -> CoronaError {
    CoronaError::Map(e.to_string())
}

impl MapNode {
    /// Starts node `node` of `cluster` on the store in `dir`. A pristine
    /// store founds the group with every node of the file as a voter, unless
    /// another node of the file holds the map already ([`members`]): in the
    /// background, since the other nodes ask this one through its replica
    /// listener, which serves once this returns.
    pub async fn start(cluster: &ClusterFile, node: &str, dir: &Path, timing: Timing) -> Result<Arc<MapNode>> {
        let me = node_id(node);
        let mut peers = BTreeMap::new();
        for n in &cluster.nodes {
            let p = Peer { name: n.name.clone(), addr: n.replica.to_string() };
            if peers.insert(node_id(&n.name), p).is_some() {
                return Err(CoronaError::Config(format!(
                    "two node names of the cluster file have the same map id ({})",
                    n.name
                )));
            }
        }
        if !peers.contains_key(&me) {
            return Err(CoronaError::Config(format!("node {node:?} is not in the cluster file")));
        }
        let secret = Arc::new(cluster.secret()?);
        let config = openraft::Config {
            cluster_name: "coronafs-volume-map".into(),
            heartbeat_interval: timing.heartbeat.as_millis() as u64,
            election_timeout_min: timing.election.0.as_millis() as u64,
            election_timeout_max: timing.election.1.as_millis() as u64,
            install_snapshot_timeout: 10_000,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(2_000),
            max_in_snapshot_log_to_keep: 200,
            ..Default::default()
        }
        .validate()
        .map_err(|e| CoronaError::Config(format!("volume map timing: {e}")))?;
        let db = store::open(dir)?;
        let machine = store::Machine::load(db.clone())?;
        let raft = Raft::new(
            me,
            Arc::new(config),
            net::Network { secret: secret.clone() },
            store::LogStore::new(db.clone()),
            store::MachineStore(machine.clone()),
        )
        .await
        .map_err(raft_err)?;
        let retry = timing.heartbeat.max(Duration::from_millis(100));
        let founder = tokio::spawn(members::found(raft.clone(), me, peers.clone(), secret.clone(), retry));
        let leading = Arc::new(Mutex::new(None));
        let watcher = tokio::spawn(watch_leadership(raft.metrics(), me, leading.clone()));
        let name = node.to_owned();
        Ok(Arc::new(MapNode { raft, me, name, peers, secret, machine, db, timing, leading, watcher, founder }))
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The lease a primary gets.
    pub fn lease(&self) -> Duration {
        self.timing.lease
    }

    /// How long a proposal may have to wait for the group to have a leader:
    /// a few election timeouts (split votes, a leader that died).
    pub fn election_patience(&self) -> Duration {
        self.timing.election.1 * 4
    }

    /// The map as this node has applied it.
    pub fn map(&self) -> Arc<VolumeMap> {
        self.machine.map()
    }

    /// Waits at most `within` until this node applied a state of `volume`
    /// at `epoch` or later (a follower applies what the leader committed a
    /// heartbeat later); whether it did.
    pub async fn applied(&self, volume: &str, epoch: u64, within: Duration) -> bool {
        self.machine.until(within, |m| m.get(volume).is_some_and(|st| st.epoch >= epoch)).await
    }

    /// Waits at most `within` until this node follows a leader and has
    /// applied every entry it holds, twice a heartbeat apart (entries come
    /// with heartbeats): its map is then as recent as the leader's was a
    /// moment ago. Whether it got there.
    pub async fn settled(&self, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        for _ in 0..2 {
            let mut rx = self.raft.metrics();
            let caught = rx.wait_for(|m| {
                m.current_leader.is_some() && m.last_applied.as_ref().map(|l| l.index) >= m.last_log_index
            });
            if tokio::time::timeout_at(until, caught).await.map_or(true, |r| r.is_err()) {
                return false;
            }
            tokio::time::sleep(self.timing.heartbeat * 2).await;
        }
        true
    }

    /// What this node knows of the group.
    pub fn status(&self) -> MapStatus {
        let m = self.raft.metrics().borrow().clone();
        MapStatus {
            node: self.name.clone(),
            leader: m.current_leader.map(|id| self.peer_name(id)),
            term: m.current_term,
            applied: m.last_applied.map(|l| l.index),
            voters: m.membership_config.membership().voter_ids().map(|id| self.peer_name(id)).collect(),
        }
    }

    /// Member `id` as the group's membership has it (a node added since
    /// this one read its cluster file too), else as the file has it.
    fn peer(&self, id: NodeId) -> Option<Peer> {
        let m = self.raft.metrics().borrow().membership_config.clone();
        m.membership().get_node(&id).cloned().or_else(|| self.peers.get(&id).cloned())
    }

    fn peer_name(&self, id: NodeId) -> String {
        self.peer(id).map_or_else(|| format!("#{id}"), |p| p.name)
    }

    /// Proposes `cmd` to the group and answers what applying it gave,
    /// forwarding it to the leader when this node is not the leader, for at
    /// most `deadline`. A takeover the leader refuses because the lease may
    /// still run is answered [`ProposeError::LeaseRuns`] at once.
    pub async fn propose(&self, cmd: Command, deadline: Duration) -> Result<Outcome, ProposeError> {
        let until = Instant::now() + deadline;
        let mut conns: BTreeMap<NodeId, Conn> = BTreeMap::new();
        let mut last = ProposeError::NotLeader(None);
        while Instant::now() < until {
            let leader = self.raft.metrics().borrow().current_leader;
            let r = match leader {
                Some(l) if l == self.me => self.propose_here(cmd.clone()).await,
                Some(l) => {
                    let addr = self.peer(l).map(|p| p.addr).unwrap_or_default();
                    let conn = conns.entry(l).or_insert_with(|| Conn::new(addr, self.secret.clone()));
                    // A leader that hangs (its process frozen, its address
                    // taken by something that never answers) holds one
                    // attempt only: a new leader may be elected meanwhile.
                    let left = until.saturating_duration_since(Instant::now()).min(self.timing.election.1);
                    match conn.call(&Request::Propose(cmd.clone()), left).await {
                        Ok(Answer::Propose(r)) => r,
                        Ok(_) => Err(ProposeError::Failed("a map answer of the wrong kind".into())),
                        Err((_, e)) => Err(ProposeError::Failed(format!("forwarding to the leader: {e}"))),
                    }
                }
                None => Err(ProposeError::NotLeader(None)),
            };
            match r {
                Ok(o) => return Ok(o),
                Err(e @ ProposeError::LeaseRuns { .. }) => return Err(e),
                Err(e) => last = e,
            }
            tokio::time::sleep(self.timing.heartbeat.min(Duration::from_millis(100))).await;
        }
        Err(last)
    }

    /// Proposes `cmd` as the leader (the receiving end of a forward too).
    pub async fn propose_here(&self, mut cmd: Command) -> Result<Outcome, ProposeError> {
        let since = match *self.leading.lock().map_err(|_| ProposeError::Failed("poisoned".into()))? {
            Some((_, since)) => since,
            None => return Err(ProposeError::NotLeader(self.raft.metrics().borrow().current_leader)),
        };
        if let Command::TakeOver { volume, renewals, .. } = &mut cmd {
            // The primary counts its lease from before it asked for it, and
            // every renewal committed before this node led was asked for
            // before it led: a whole lease after both, on this clock, the
            // primary has stopped (clock rates that differ by less than the
            // primary's margin, docs/design/replication-volumes.md).
            let base = self.machine.renewed_at(volume).map_or(since, |r| r.max(since));
            let runs = self.timing.lease.saturating_sub(base.elapsed());
            if !runs.is_zero() {
                return Err(ProposeError::LeaseRuns { left_ms: runs.as_millis() as u64 + 1 });
            }
            // The count as applied here: a renewal committed but not applied
            // yet makes the takeover fail when it applies after it.
            if let Some(st) = self.machine.map().get(volume) {
                *renewals = st.renewals;
            }
        }
        match self.raft.client_write(cmd).await {
            Ok(resp) => resp.data.ok_or_else(|| ProposeError::Failed("the entry applied as no command".into())),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => Err(ProposeError::NotLeader(f.leader_id)),
            Err(e) => Err(ProposeError::Failed(e.to_string())),
        }
    }

    /// Answers a map connection's requests (after its handshake and magic)
    /// until it ends.
    pub async fn serve<R, W>(&self, mut rd: R, mut wr: W) -> std::io::Result<()>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        while let Some(req) = net::receive::<_, Request>(&mut rd).await? {
            let answer = match req {
                Request::Append(r) => Answer::Append(self.raft.append_entries(r).await),
                Request::Vote(r) => Answer::Vote(self.raft.vote(r).await),
                Request::Snapshot(r) => Answer::Snapshot(self.raft.install_snapshot(r).await),
                Request::Propose(c) => Answer::Propose(self.propose_here(c).await),
                Request::Standing => Answer::Standing { holds_map: self.raft.is_initialized().await.unwrap_or(false) },
                Request::Members(c) => Answer::Members(self.change_members_here(c).await),
            };
            net::send(&mut wr, &answer).await?;
        }
        Ok(())
    }

    /// Stops this node's member of the group.
    pub async fn shutdown(&self) {
        self.watcher.abort();
        self.founder.abort();
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "the volume map's Raft did not stop cleanly");
        }
        self.db.close();
    }
}

/// Keeps `leading` at the term this node leads and the moment it first saw
/// itself lead it (later than it became leader, which only makes the lease
/// check wait longer).
async fn watch_leadership(
    mut metrics: watch::Receiver<openraft::RaftMetrics<NodeId, Peer>>,
    me: NodeId,
    leading: Arc<Mutex<Option<(u64, Instant)>>>,
) {
    loop {
        {
            let m = metrics.borrow_and_update();
            let leads = m.state == ServerState::Leader && m.current_leader == Some(me);
            if let Ok(mut l) = leading.lock() {
                *l = match (*l, leads) {
                    (Some((term, since)), true) if term == m.current_term => Some((term, since)),
                    (_, true) => Some((m.current_term, Instant::now())),
                    (_, false) => None,
                };
            }
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}
