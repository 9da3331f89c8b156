//! Failover of replicated volumes: where each replica copy is in its
//! primary's write stream, the copy's side of the fencing vote
//! ([`Volumes::vote`]), and promotion ([`Volumes::promote`]): once the
//! volume map granted this copy the takeover, it fences every copy at the
//! new epoch and becomes the primary with the copies at its own position as
//! live replicas. The design is in docs/design/replication-volumes.md.
//!
//! Positions are kept in memory only (one lock per applied frame, no disk
//! write): a copy that restarted does not know its position, votes as a
//! copy that may lack writes, and cannot be promoted itself.

use super::{Volumes, catalog::VolumeRec, fence, poisoned};
use crate::backend::replicated::link::handshake_as_caller;
use crate::cluster::Membership;
use crate::dto::VolumeInfo;
use crate::error::{CoronaError, Result};
use crate::replica::auth::RpcSecret;
use crate::replica::election::{self, Ballot, VoteState};
use crate::replica::wire::{Body, Msg, Origin, Position, VOTE_REPLY_LEN, VoteReply};
use crate::replication::map::MapNode;
use crate::replication::map::net::ProposeError;
use crate::replication::map::state::{Command, VolumeState};
use crate::util::validate_name;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One copy's position, shared by the replica connections writing to it,
/// when it last heard its primary (for the watchdog, `autofail.rs`), and
/// the number of the latest OPEN it accepted: held while a frame is
/// applied, so a stream superseded by a later OPEN applies nothing more.
#[derive(Debug, Default)]
pub struct Slot {
    pos: Mutex<Option<Position>>,
    heard: Mutex<Option<Instant>>,
    /// A watchdog runs for this copy.
    pub(super) watching: AtomicBool,
    turn: tokio::sync::Mutex<u64>,
}

impl Slot {
    /// When a frame or heartbeat of a primary last arrived (`None`: no
    /// stream was opened to this copy since the node started).
    pub fn heard(&self) -> Option<Instant> {
        self.heard.lock().ok().and_then(|h| *h)
    }

    pub(super) fn hear(&self) {
        if let Ok(mut h) = self.heard.lock() {
            *h = Some(Instant::now());
        }
    }
}

/// A replica connection's hold on its copy's position: it moves the
/// position only while its own stream is the latest one opened.
#[derive(Debug)]
pub struct Tracker {
    slot: Arc<Slot>,
    epoch: u64,
    stream: u64,
    /// Which OPEN of this copy this stream is.
    opened: u64,
    /// The copy's incarnation (its OPEN's answer tells the primary).
    pub incarnation: u64,
}

impl Tracker {
    /// This stream's turn to apply a frame; `None` once a later OPEN (a new
    /// stream or a resync) superseded it.
    pub async fn turn(&self) -> Option<tokio::sync::MutexGuard<'_, u64>> {
        let g = self.slot.turn.lock().await;
        (*g == self.opened).then_some(g)
    }

    /// Frame `seq` of this stream, carrying `epoch`, was applied. A
    /// primary's epoch rises within a stream when its fence is raised
    /// (`Volumes::fence`), so the position's epoch follows the frames'.
    pub fn applied(&self, seq: u64, epoch: u64) {
        if let Ok(mut p) = self.slot.pos.lock()
            && let Some(p) = p.as_mut()
            && p.stream == self.stream
            && p.epoch >= self.epoch
        {
            p.seq = seq;
            p.epoch = p.epoch.max(epoch);
        }
    }

    /// A frame or heartbeat of this stream arrived inside the fence.
    pub fn heard(&self) {
        self.slot.hear();
    }
}

/// The [`Origin`] a primary sends with OPEN: a stream number from the
/// clock (a later stream of this node is higher), itself and every copy.
pub(super) fn origin(me: &str, rec: &VolumeRec) -> Origin {
    let stream = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let copies = if rec.copies.is_empty() {
        std::iter::once(me.to_owned()).chain(rec.replicas.iter().cloned()).collect()
    } else {
        rec.copies.clone()
    };
    Origin { stream, primary: me.to_owned(), copies, incarnation: 0 }
}

/// A new copy's incarnation: the clock and a per-process random key mixed,
/// never 0.
fn fresh_incarnation() -> u64 {
    use std::hash::BuildHasher;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::collections::hash_map::RandomState::new().hash_one(now).max(1)
}

/// Whether `rec`, this node's record of `name` as it stands, still holds
/// the vote this node cast for itself at `epoch`, as a replica copy: a
/// promotion may take office only then (see [`Volumes::promote`]).
pub fn still_elected(name: &str, rec: &VolumeRec, epoch: u64, me: &str) -> Result<()> {
    if !rec.replicas.is_empty() {
        return Err(CoronaError::Conflict(format!("{name} is already the primary on {me}")));
    }
    if rec.epoch != epoch || rec.voted_for.as_deref() != Some(me) {
        return Err(CoronaError::Conflict(format!(
            "{name}: the election at epoch {epoch} was superseded while its ballots were counted (this copy is at \
             epoch {}, voted for {:?})",
            rec.epoch, rec.voted_for
        )));
    }
    Ok(())
}

/// Why [`Volumes::take_office`] did not make this copy the primary.
#[derive(Debug)]
pub(super) enum Promotion {
    /// The old primary's lease may run this much longer.
    Wait(Duration),
    Failed(CoronaError),
}

impl From<CoronaError> for Promotion {
    fn from(e: CoronaError) -> Self {
        Promotion::Failed(e)
    }
}

/// The answer a copy sends when it cannot vote for another reason than an
/// epoch (`errno`), saying its epoch.
pub(super) fn refusal(errno: i32, epoch: u64) -> VoteReply {
    VoteReply { errno: errno as u32, epoch, position: None }
}

impl Volumes {
    pub(super) fn slot(&self, name: &str) -> Result<Arc<Slot>> {
        let mut p = self.positions.lock().map_err(|_| poisoned())?;
        Ok(p.entry(name.to_owned()).or_default().clone())
    }

    /// Drops what is known of `name`'s position (a new volume of that name).
    pub(super) fn forget_position(&self, name: &str) {
        if let Ok(mut p) = self.positions.lock() {
            p.remove(name);
        }
    }

    /// The incarnation of this node's copy of `name` (0: none drawn yet, or
    /// no such volume).
    pub fn incarnation(&self, name: &str) -> u64 {
        self.cat.lock().ok().and_then(|c| c.volumes.get(name).map(|r| r.incarnation)).unwrap_or(0)
    }

    /// Where this node's copy of `name` is in its primary's write stream.
    pub fn position(&self, name: &str) -> Option<Position> {
        let slot = self.positions.lock().ok()?.get(name).cloned()?;
        *slot.pos.lock().ok()?
    }

    /// A primary opened a write stream to this copy at `epoch`, expecting
    /// `first_seq` next: records who the primary and the copies are and
    /// the stream's epoch as the copy's own (persisted when they changed;
    /// the caller then raises the copy's fence to it) and starts tracking
    /// the position.
    pub async fn stream_opened(&self, name: &str, epoch: u64, origin: &Origin, first_seq: u64) -> Result<Tracker> {
        {
            let _g = self.control.lock().await;
            let old = self.catalog()?;
            let rec = old.volumes.get(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
            let named = !origin.primary.is_empty()
                && (rec.primary.as_deref() != Some(&origin.primary) || rec.copies != origin.copies);
            if named || epoch > rec.epoch || rec.incarnation == 0 {
                let mut cat = old.clone();
                if let Some(r) = cat.volumes.get_mut(name) {
                    if !origin.primary.is_empty() {
                        r.primary = Some(origin.primary.clone());
                        r.copies = origin.copies.clone();
                    }
                    if epoch > r.epoch {
                        // A vote at an earlier epoch says nothing about this one.
                        (r.epoch, r.voted_for) = (epoch, None);
                    }
                    if r.incarnation == 0 {
                        r.incarnation = fresh_incarnation();
                    }
                }
                self.commit(&old, cat)?;
            }
        }
        let slot = self.slot(name)?;
        let start = Position { epoch, stream: origin.stream, seq: first_seq.wrapping_sub(1) };
        let opened = {
            // After every frame of an earlier stream being applied now.
            let mut turn = slot.turn.lock().await;
            *turn += 1;
            *slot.pos.lock().map_err(|_| poisoned())? = Some(start);
            *turn
        };
        slot.hear();
        if !origin.primary.is_empty() {
            self.watch(name, &slot);
        }
        let incarnation = self.incarnation(name);
        Ok(Tracker { slot, epoch, stream: origin.stream, opened, incarnation })
    }

    /// This copy's answer to `candidate` asking for its vote at `epoch`:
    /// the vote is persisted, then the copy is fenced to `epoch` (frames of
    /// older epochs in flight drain, later ones are refused) and flushed
    /// (what it reports holding is durable), then it says where it is. A
    /// copy that is itself the primary refuses (`EBUSY`); one whose flush
    /// fails refuses (`EIO`).
    pub async fn vote(&self, name: &str, epoch: u64, candidate: &str) -> VoteReply {
        match self.record_vote(name, epoch, candidate).await {
            Ok(Ok(())) => {}
            Ok(Err(answer)) => return answer,
            Err(e) => {
                tracing::warn!(volume = name, candidate, error = %e, "cannot vote");
                return refusal(libc::EIO, 0);
            }
        }
        let open = self.open.lock().ok().and_then(|o| o.get(name).cloned());
        if let Some(v) = open {
            if let Err(left) = v.fence.raise(epoch, super::FENCE_DRAIN_TIMEOUT).await {
                tracing::error!(volume = name, epoch, left, "writes of an older epoch did not drain");
                return refusal(libc::EIO, epoch);
            }
            // The position this vote reports must survive a power loss: the
            // candidate may win on it, and every byte up to it is then what
            // the volume holds (frames answered before a FLUSH may still sit
            // in the page cache). No frame of the old stream lands after the
            // fence, so this flush covers the whole position.
            if let Err(e) = crate::backend::BlockBackend::flush(&v.backend).await {
                tracing::error!(volume = name, epoch, error = %e, "cannot make the copy durable before voting");
                return refusal(libc::EIO, epoch);
            }
        }
        let position = self.position(name);
        tracing::info!(volume = name, epoch, candidate, ?position, "voted");
        VoteReply { errno: 0, epoch, position }
    }

    /// Persists the vote, or says the refusal to answer.
    async fn record_vote(&self, name: &str, epoch: u64, candidate: &str) -> Result<std::result::Result<(), VoteReply>> {
        self.writable()?;
        let _g = self.control.lock().await;
        let old = self.catalog()?;
        let Some(rec) = old.volumes.get(name) else { return Ok(Err(refusal(libc::ENOENT, 0))) };
        if !rec.replicas.is_empty() {
            return Ok(Err(refusal(libc::EBUSY, rec.epoch)));
        }
        let seen = rec.epoch.max(self.position(name).map_or(0, |p| p.epoch));
        let state = VoteState { epoch: seen, voted_for: rec.voted_for.clone() };
        let new = match election::grant(&state, epoch, candidate) {
            Ok(s) => s,
            Err(r) => return Ok(Err(refusal(libc::EPERM, r.epoch))),
        };
        if new != state || rec.epoch != new.epoch {
            let mut cat = old.clone();
            if let Some(r) = cat.volumes.get_mut(name) {
                (r.epoch, r.voted_for) = (new.epoch, new.voted_for);
            }
            // Durable before the candidate hears of it: a restart keeps it.
            self.commit(&old, cat)?;
        }
        Ok(Ok(()))
    }

    /// Makes this node's copy of `name` the primary. The volume map must
    /// grant the takeover (this copy in sync, the old primary's lease run
    /// out: waited for, at most one lease and the ack timeout). Then the
    /// copies are fenced at the new epoch and say where they are, and the volume reopens as the primary
    /// with the copies at this copy's position as live replicas and the
    /// others recorded stale.
    pub async fn promote(&self, name: &str) -> Result<VolumeInfo> {
        let wait = self.membership().map(|m| Duration::from_millis(m.cluster.ack_timeout_ms));
        let wait = self.volume_map().map(|map| map.lease() + wait.unwrap_or_default());
        match self.take_office(name, wait.unwrap_or_default()).await {
            Ok(info) => Ok(info),
            Err(Promotion::Failed(e)) => Err(e),
            Err(Promotion::Wait(d)) => Err(CoronaError::Conflict(format!(
                "{name}: the primary's lease may still run for {} ms (it may be alive); try again then",
                d.as_millis()
            ))),
        }
    }

    /// [`Volumes::promote`], waiting at most `wait` for the old primary's
    /// lease; [`Promotion::Wait`] says how long it may still run.
    pub(super) async fn take_office(&self, name: &str, wait: Duration) -> std::result::Result<VolumeInfo, Promotion> {
        validate_name(name)?;
        self.writable()?;
        let m: Arc<Membership> = self
            .membership()
            .cloned()
            .ok_or_else(|| CoronaError::Config("promoting needs a cluster (serve with a cluster file)".into()))?;
        let rec = self.catalog()?.volumes.get(name).cloned().ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
        if !rec.replicas.is_empty() {
            return Err(CoronaError::Conflict(format!("{name} is already the primary on {}", m.node)).into());
        }
        if rec.copies.is_empty() {
            return Err(CoronaError::Conflict(format!(
                "{name} on {} is no replica: no primary ever opened a write stream to it",
                m.node
            ))
            .into());
        }
        let seen = rec.epoch.max(self.position(name).map_or(0, |p| p.epoch));
        let map = self.volume_map().cloned().ok_or_else(|| {
            CoronaError::Config("promoting needs the cluster's volume map (serve with a cluster file)".into())
        })?;
        let granted = self.granted(&map, name, &m.node, seen, wait, &m).await?;
        let epoch = granted.epoch;
        // The map's copies, not this copy's record of them: a copy replaced
        // since this copy's last stream opened is not one any more.
        let copies = if granted.copies.is_empty() { rec.copies.clone() } else { granted.copies.clone() };
        let mine = self.vote(name, epoch, &m.node).await;
        if mine.errno != 0 {
            return Err(CoronaError::Conflict(format!(
                "{name}: this copy cannot vote for itself at epoch {epoch} (errno {}, at epoch {})",
                mine.errno, mine.epoch
            ))
            .into());
        }
        let timeout = Duration::from_millis(m.cluster.ack_timeout_ms);
        let asks = copies.iter().filter(|c| **c != m.node).map(|c| {
            let (m, c) = (m.clone(), c.clone());
            async move {
                let ballot = match m.cluster.node(&c) {
                    Ok(n) => ask_vote(n.replica, &m.secret, name, epoch, &m.node, timeout).await,
                    Err(_) => Ballot::Silent,
                };
                (c, ballot)
            }
        });
        let ballots = futures::future::join_all(asks).await;
        tracing::info!(volume = name, epoch, own = ?mine.position, ?ballots, "copies fenced at the new epoch");
        // The map decided; the ballots only fence the copies and say which
        // are exactly where this copy is (those hold the same bytes, and
        // stay live).
        let (live, stale) = election::at_position(mine.position, &ballots);
        {
            let _g = self.control.lock().await;
            let old = self.catalog()?;
            let mut cat = old.clone();
            let r = cat.volumes.get_mut(name).ok_or_else(|| CoronaError::NotFound(name.to_owned()))?;
            // The vote must still stand: while the ballots were out, this
            // copy may have voted for another candidate at a later epoch (an
            // automatic round racing a promote by hand), or another promote
            // of this node may have taken office. Checked and committed under
            // the control lock, which every vote takes too.
            still_elected(name, r, epoch, &m.node)?;
            r.replicas = copies.iter().filter(|c| **c != m.node).cloned().collect();
            r.stale = stale;
            r.primary = Some(m.node.clone());
            r.copies = copies.clone();
            r.promoted_from = mine.position.map(|p| p.epoch);
            // The log first: a crash before the commit leaves this copy a
            // replica, whose log is unused until it is promoted.
            self.reset_log(name, r.size, &r.replicas, &r.stale)?;
            self.commit(&old, cat)?;
        }
        tracing::warn!(volume = name, epoch, ?live, "promoted to primary");
        // The copy was open as a plain volume for the old primary's stream;
        // it reopens as the primary, linking to the live copies now.
        self.close(&[name.to_owned()], false).await;
        self.open(name)?;
        Ok(self.info(name)?)
    }

    /// Asks the map to make this node the primary of `name` (`seen`: the
    /// highest epoch this copy knows), waiting at most `wait` for the old
    /// primary's lease to run out; the epoch granted.
    async fn granted(
        &self,
        map: &MapNode,
        name: &str,
        me: &str,
        seen: u64,
        wait: Duration,
        m: &Membership,
    ) -> std::result::Result<VolumeState, Promotion> {
        let until = Instant::now() + wait;
        // Long enough for the map to elect a leader when the old primary's
        // node led it too.
        let deadline = Duration::from_millis(m.cluster.ack_timeout_ms).max(map.election_patience());
        loop {
            let cmd = Command::TakeOver {
                volume: name.to_owned(),
                node: me.to_owned(),
                renewals: 0,
                seen,
                at_ms: crate::util::unix_ms(),
            };
            match map.propose(cmd, deadline).await {
                Ok(Ok(st)) if st.primary == me => {
                    tracing::warn!(volume = name, epoch = st.epoch, "the volume map made this copy the primary");
                    // The leader applied it; this node's own map must show it
                    // too before the export opens and reads it there.
                    if !map.applied(name, st.epoch, deadline).await {
                        return Err(CoronaError::Map(format!(
                            "{name}: the map granted epoch {} but this node did not apply it within {deadline:?}",
                            st.epoch
                        ))
                        .into());
                    }
                    return Ok(st);
                }
                Ok(Ok(st)) => {
                    return Err(CoronaError::Conflict(format!(
                        "{name}: the volume map made {} the primary",
                        st.primary
                    ))
                    .into());
                }
                Ok(Err(r)) => return Err(CoronaError::Conflict(format!("{name}: {r}")).into()),
                Err(ProposeError::LeaseRuns { left_ms }) => {
                    let left = Duration::from_millis(left_ms);
                    if Instant::now() + left > until {
                        return Err(Promotion::Wait(left));
                    }
                    tokio::time::sleep(left).await;
                }
                Err(e) => return Err(CoronaError::Map(format!("{name}: no takeover: {e}")).into()),
            }
        }
    }

    /// On the primary of a replicated volume, after its fence was raised to
    /// `epoch`: frames carry `epoch` from now on, and a FLUSH makes sure a
    /// write quorum of copies applied one, so any later election picks an
    /// epoch above it (a failover never goes back below a fence, and the
    /// NBD clients fenced out stay out). Nothing to do on other volumes.
    pub(super) async fn replicate_fence(&self, name: &str, epoch: u64) -> Result<()> {
        let replicated = self.catalog()?.volumes.get(name).is_some_and(|r| !r.replicas.is_empty());
        if !replicated || self.read_only {
            return Ok(());
        }
        let v = self.open(name)?;
        let head = v.backend.head().await;
        if let crate::backend::AnyBackend::Replicated(r) = &head.data {
            r.raise_epoch(epoch);
        }
        drop(head);
        crate::backend::BlockBackend::flush(&v.backend).await.map_err(|e| {
            CoronaError::Replica(format!(
                "{name} is fenced at epoch {epoch} here, but a write quorum of its copies did not acknowledge it: {e}"
            ))
        })
    }

    /// For an NBD client of `export` that declared `declared` while the
    /// volume is at `current`: if `current` is the epoch a failover elected
    /// this primary at, from a stream of epoch `declared`, a note saying so
    /// (`failover-from=N failover-epoch=M`, which the reconnecting client of
    /// an attachment follows, `client::failover_hint`).
    pub(super) fn failover_note(&self, export: &str, declared: u64, current: u64) -> Option<String> {
        let (base, _) = fence::parse_export(export).ok()?;
        let from = self.cat.lock().ok()?.volumes.get(base)?.promoted_from?;
        (from == declared).then(|| {
            format!("; a failover made this node the primary at epoch {current}: failover-from={from} failover-epoch={current}")
        })
    }

    /// NBD clients may open a volume only on its primary: a copy that knows
    /// another node is the primary refuses, naming where the primary is
    /// (`primary-nbd=ADDR`, which the reconnecting client follows).
    pub(super) fn primary_here(&self, export: &str) -> std::result::Result<(), String> {
        let Ok((base, _)) = fence::parse_export(export) else { return Ok(()) };
        let Some(m) = self.membership() else { return Ok(()) };
        // The primary's name only, not a copy of the whole catalog.
        let primary = match self.cat.lock() {
            Ok(cat) => cat.volumes.get(base).filter(|r| r.replicas.is_empty()).and_then(|r| r.primary.clone()),
            Err(_) => return Ok(()),
        };
        match primary {
            Some(p) if p != m.node => {
                let addr = m.cluster.node(&p).map(|n| n.nbd.to_string()).unwrap_or_else(|_| "unknown".into());
                Err(format!("{base} is a replica on {}; its primary is {p}, primary-nbd={addr}", m.node))
            }
            _ => {
                // A primary a copy refused as fenced above it (a copy was
                // elected meanwhile) would only answer EIO to writes: the
                // client is refused here, at connect, and moves on.
                let handle = self.open.lock().ok().and_then(|o| o.get(base).and_then(|e| e.replication.clone()));
                if handle.is_some_and(|h| h.deposed()) {
                    return Err(format!(
                        "{base} on {} is not primary: it was deposed (a copy is fenced at a higher epoch)",
                        m.node
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Sends `body` (a VOTE) at `epoch` to the copy at `addr` on a
/// connection of its own and gives its answer, or `None` (logged) when it
/// did not answer within `timeout`.
pub(super) async fn ask(
    addr: SocketAddr,
    secret: &RpcSecret,
    epoch: u64,
    body: Body,
    timeout: Duration,
) -> Option<VoteReply> {
    let ask = async {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        handshake_as_caller(&mut s, secret).await?;
        let msg = Msg { seq: 0, epoch, body };
        let (h, payload) = msg.encode();
        s.write_all(&h).await?;
        s.write_all(&payload).await?;
        let mut r = [0u8; VOTE_REPLY_LEN];
        s.read_exact(&mut r).await?;
        VoteReply::decode(&r)
    };
    match tokio::time::timeout(timeout, ask).await {
        Ok(Ok(r)) => Some(r),
        Ok(Err(e)) => {
            tracing::warn!(%addr, error = %e, "no answer from a copy");
            None
        }
        Err(_) => None,
    }
}

/// Asks the copy at `addr` for its vote; any failure is a silent ballot.
pub async fn ask_vote(
    addr: SocketAddr,
    secret: &RpcSecret,
    volume: &str,
    epoch: u64,
    candidate: &str,
    timeout: Duration,
) -> Ballot {
    let body = Body::Vote { volume: volume.to_owned(), candidate: candidate.to_owned() };
    match ask(addr, secret, epoch, body, timeout).await {
        Some(r) if r.errno == 0 => Ballot::Granted { position: r.position },
        Some(r) => Ballot::Refused { epoch: r.epoch },
        None => Ballot::Silent,
    }
}
