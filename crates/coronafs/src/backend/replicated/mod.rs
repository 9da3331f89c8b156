//! A block backend whose writes go to a local backend and to every live
//! replica ([`link::ReplicaLink`]), with FLUSH (and FUA) answered only once
//! every live replica made earlier writes durable, and a write quorum below
//! which writes fail. See docs/design/replication-volumes.md.
//!
//! - [`apply`]: the replica's side, shared by the TCP listener and tests;
//! - [`link`]: the link trait and its TCP implementation;
//! - [`local`]: the boxed local copy `AnyBackend` holds;
//! - [`drl`]: the dirty-region log (sans-IO) and its persisted record;
//! - [`resync`]: bringing a replica that is behind back into the live set;
//! - `mem`: an in-memory link that can be killed or stalled (tests only).

pub mod apply;
pub mod drl;
pub mod link;
pub mod local;
#[cfg(any(test, feature = "testing"))]
pub mod mem;
pub mod resync;
#[cfg(test)]
mod resync_tests;
#[cfg(test)]
mod tests;

use super::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use crate::metrics::Metrics;
use crate::replica::wire::{Body, Msg};
use bytes::Bytes;
use drl::{Drl, History};
use link::{Ack, ReplicaLink};
pub use local::DynBackend;
pub use resync::{Connector, DrlStore, Resync};
use std::collections::BTreeSet;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering::{self, Relaxed};
use std::time::Duration;

/// What a primary answers to beyond its copies: the cluster's volume map
/// (`volume/lease.rs`). Without one (tests of the backend alone, a server
/// in no cluster) the live set alone decides.
pub trait Authority: Send + Sync + 'static {
    /// Whether this primary holds its lease right now.
    fn may_write(&self) -> bool;
    /// Waits at most `within` for the lease (at start, or after a renewal
    /// came late); whether it is held then.
    fn acquire(&self, within: Duration) -> futures::future::BoxFuture<'_, bool>;
    /// Waits at most `within` until every replica that left the live set
    /// so far is out of the map's in-sync set: a FLUSH that such a replica
    /// did not acknowledge is answered only then, so no copy the map could
    /// make primary lacks a write a FLUSH answered.
    fn settle(&self, within: Duration) -> futures::future::BoxFuture<'_, io::Result<()>>;
}

/// Regions logged beyond a write's own when it dirties a new one.
const LOG_AHEAD: usize = 7;

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

/// One replica as the primary sees it.
struct Peer {
    name: String,
    /// The write-stream link, while the replica is live.
    link: Option<Arc<dyn ReplicaLink>>,
    /// What the replica holds: every frame below `Acked(F)` durably.
    history: History,
    /// Bytes still to copy while a resync pass runs.
    left: Option<u64>,
    /// Bumped whenever the replica leaves or joins the live set, so an
    /// answer to a frame of an earlier link is not taken for this one.
    turn: u64,
    /// The incarnation of the replica's copy as known (0: unknown; its
    /// link's answer to OPEN tells it).
    incarnation: u64,
}

impl Peer {
    fn live(&self) -> bool {
        self.link.is_some()
    }
}

/// Where the write stream is: the next number, who gets it, what each
/// replica may lack.
struct Order {
    next_seq: u64,
    peers: Vec<Peer>,
    drl: Drl,
    /// Closed cleanly: no write is taken any more.
    closed: bool,
}

/// A control frame (SNAPSHOT, DELETE_SNAPSHOT) queued at a point of the
/// write stream, and each live replica's answer to come.
pub struct Point {
    acks: Vec<(usize, u64, Ack)>,
}

/// A replica's state, for `volume show`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerState {
    /// In the live set: gets every write; FLUSH waits for it.
    InSync,
    /// A resync pass is copying what it lacks; `bytes_left` of this pass.
    CatchingUp { bytes_left: u64 },
    /// Out of the live set, not being copied to right now (unreachable,
    /// or waiting for the next attempt).
    Stale,
}

/// What the persisted record of the log is, and how it is written.
struct Saver {
    store: Arc<dyn DrlStore>,
    /// Regions the record holds now.
    durable: std::sync::Mutex<BTreeSet<u64>>,
    /// Held while the record is being written (one writer; later ones find
    /// their regions already written: a group commit).
    writing: tokio::sync::Mutex<()>,
    /// When the record last dropped regions (at most once a second).
    last_trim: std::sync::Mutex<std::time::Instant>,
}

/// The shared part of [`Replicated`], also held by its resync task and by
/// the volume manager (for `volume show` and a clean close).
pub struct Inner<B> {
    local: B,
    policy: ReplicationPolicy,
    /// The epoch frames carry: the policy's, raised with the volume's fence.
    epoch: std::sync::atomic::AtomicU64,
    order: tokio::sync::Mutex<Order>,
    /// Writes hold it shared from before their region is recorded until
    /// their local write is done; a resync reads a region holding it
    /// exclusively, so the copy holds every write numbered before it.
    gate: tokio::sync::RwLock<()>,
    metrics: Arc<Metrics>,
    /// Told the name of each replica that leaves (false) or rejoins (true)
    /// the live set, so the volume manager records it.
    on_change: Option<ChangeHook>,
    saver: Option<Saver>,
    resync: Option<Resync>,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// A replica refused this primary as fenced at a higher epoch: another
    /// copy was elected primary. From then on no write, flush or resync.
    deposed: std::sync::atomic::AtomicBool,
    /// The resync task is trying to bring a replica back (an attempt is
    /// running): a request below the quorum waits ([`Inner::await_quorum`]).
    resyncing: std::sync::atomic::AtomicBool,
    /// Told when what a request below the quorum waits for may have
    /// changed: a replica rejoined, no attempt runs any more, the volume
    /// was closed, or this primary was deposed.
    changed: tokio::sync::Notify,
    /// [`Replicated`] values sharing this (see [`Replicated::share`]): the
    /// resync task stops when the last one is dropped.
    owners: std::sync::atomic::AtomicUsize,
    /// The lease and in-sync set this primary answers to, if any.
    authority: Option<Arc<dyn Authority>>,
}

/// A local backend plus its replicas.
pub struct Replicated<B> {
    inner: Arc<Inner<B>>,
}

/// See [`Replicated::on_change`].
pub type ChangeHook = Box<dyn Fn(&str, bool) + Send + Sync>;

impl<B: std::fmt::Debug> std::fmt::Debug for Replicated<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let peers: Vec<_> = match self.inner.order.try_lock() {
            Ok(o) => o.peers.iter().map(|p| (p.name.clone(), p.live())).collect(),
            Err(_) => Vec::new(),
        };
        f.debug_struct("Replicated").field("local", &self.inner.local).field("replicas", &peers).finish()
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for Inner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner").field("local", &self.local).field("policy", &self.policy).finish()
    }
}

impl<B> Drop for Replicated<B> {
    fn drop(&mut self) {
        if self.inner.owners.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if let Some(t) = self.inner.task.lock().ok().and_then(|mut t| t.take()) {
            t.abort();
        }
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

/// The byte range a frame writes.
fn range(body: &Body) -> Option<(u64, u64)> {
    match body {
        Body::Write { offset, data } => Some((*offset, data.len() as u64)),
        Body::WriteZeroes { offset, len, .. } | Body::Trim { offset, len } => Some((*offset, *len)),
        _ => None,
    }
}

impl<B: BlockBackend> Replicated<B> {
    /// `local` replicated to `links`, each opened so that the next frame it
    /// expects is numbered `first_seq`; every replica starts in sync, and
    /// none that leaves is brought back (see [`Replicated::with_resync`]).
    pub fn new(
        local: B,
        links: Vec<Arc<dyn ReplicaLink>>,
        policy: ReplicationPolicy,
        first_seq: u64,
        metrics: Arc<Metrics>,
    ) -> Self {
        let size = local.size();
        let peers = links
            .into_iter()
            .map(|l| Peer {
                name: l.peer().to_owned(),
                link: Some(l),
                history: History::Acked(first_seq),
                left: None,
                turn: 0,
                incarnation: 0,
            })
            .collect();
        let order = Order { next_seq: first_seq, peers, drl: Drl::new(size, &BTreeSet::new()), closed: false };
        Replicated {
            inner: Arc::new(Inner {
                local,
                policy,
                epoch: std::sync::atomic::AtomicU64::new(policy.epoch),
                order: tokio::sync::Mutex::new(order),
                gate: tokio::sync::RwLock::new(()),
                metrics,
                on_change: None,
                saver: None,
                resync: None,
                task: std::sync::Mutex::new(None),
                deposed: std::sync::atomic::AtomicBool::new(false),
                resyncing: std::sync::atomic::AtomicBool::new(false),
                changed: tokio::sync::Notify::new(),
                owners: std::sync::atomic::AtomicUsize::new(1),
                authority: None,
            }),
        }
    }

    fn setup(&mut self) -> &mut Inner<B> {
        Arc::get_mut(&mut self.inner).expect("configured before it is shared")
    }

    /// Calls `hook` with the name of every replica that leaves (`false`)
    /// or rejoins (`true`) the live set.
    pub fn on_change(mut self, hook: ChangeHook) -> Self {
        self.setup().on_change = Some(hook);
        self
    }

    /// Takes writes only under `a`'s lease, and answers a FLUSH only once
    /// `a` says every replica dropped so far is out of the in-sync set.
    pub fn with_authority(mut self, a: Arc<dyn Authority>) -> Self {
        self.setup().authority = Some(a);
        self
    }

    /// Keeps the dirty-region log in `r.store`, starts the replicas of
    /// `r.behind` out of the live set with their history, with `inherited`
    /// regions dirty from before, and starts the task that brings every
    /// replica out of the live set back (see [`resync`]).
    pub fn with_resync(mut self, r: Resync, behind: Vec<(String, History)>, inherited: BTreeSet<u64>) -> Self {
        let inner = self.setup();
        let order = inner.order.get_mut();
        order.drl = Drl::new(inner.local.size(), &inherited);
        for (name, history) in behind {
            match order.peers.iter_mut().find(|p| p.name == name) {
                Some(p) => (p.link, p.history) = (None, history),
                None => order.peers.push(Peer { name, link: None, history, left: None, turn: 0, incarnation: 0 }),
            }
        }
        inner.saver = Some(Saver {
            store: r.store.clone(),
            durable: std::sync::Mutex::new(inherited),
            writing: tokio::sync::Mutex::new(()),
            last_trim: std::sync::Mutex::new(std::time::Instant::now()),
        });
        inner.resync = Some(r);
        self
    }

    /// The incarnations of the replicas' copies as the primary last knew
    /// them (its record): a resync opens a copy only if it is still that
    /// one, and gives any other a full copy.
    pub fn with_incarnations(mut self, known: &std::collections::BTreeMap<String, u64>) -> Self {
        for p in &mut self.setup().order.get_mut().peers {
            p.incarnation = known.get(&p.name).copied().unwrap_or(0);
        }
        self
    }

    /// Starts the resync task (after [`Replicated::with_resync`]).
    pub fn start(self) -> Self
    where
        B: 'static,
    {
        if self.inner.resync.is_some() {
            // A request that comes before the task's first look waits for
            // it too (the task clears this when nothing is to be tried).
            let behind = self.inner.order.try_lock().is_ok_and(|o| o.peers.iter().any(|p| !p.live()));
            self.inner.resyncing.store(behind, Relaxed);
            let task = tokio::spawn(resync::run(self.inner.clone()));
            if let Ok(mut t) = self.inner.task.lock() {
                *t = Some(task);
            }
        }
        self
    }

    /// Frames queued from now on carry `epoch` (if above the current one):
    /// the volume's fence was raised, and the copies must learn it, so that
    /// a failover elects a primary above it. Read under the order lock, so
    /// the epochs of a stream never go down as its `seq` goes up.
    pub fn raise_epoch(&self, epoch: u64) {
        self.inner.epoch.fetch_max(epoch, Relaxed);
    }

    /// Another backend over the same volume, replicas and resync task
    /// (the volume manager swaps the export's outer layer for one of
    /// another size when the volume grows); the task runs until the last
    /// of them is dropped.
    pub fn share(&self) -> Self {
        self.inner.owners.fetch_add(1, Ordering::AcqRel);
        Replicated { inner: self.inner.clone() }
    }

    /// The local copy.
    pub fn local(&self) -> &B {
        &self.inner.local
    }

    /// The part the volume manager keeps (states, clean close).
    pub fn handle(&self) -> Arc<Inner<B>> {
        self.inner.clone()
    }

    /// Names of the replicas in the live set.
    pub async fn live_replicas(&self) -> Vec<String> {
        self.inner.live_replicas().await
    }
}

impl<B: BlockBackend> Inner<B> {
    /// Names of the replicas in the live set.
    pub async fn live_replicas(&self) -> Vec<String> {
        let o = self.order.lock().await;
        o.peers.iter().filter(|p| p.live()).map(|p| p.name.clone()).collect()
    }

    /// Every replica's state, in the order the volume names them.
    pub async fn states(&self) -> Vec<(String, PeerState)> {
        let o = self.order.lock().await;
        o.peers
            .iter()
            .map(|p| {
                let s = match (p.live(), p.left) {
                    (true, _) => PeerState::InSync,
                    (false, Some(bytes_left)) => PeerState::CatchingUp { bytes_left },
                    (false, None) => PeerState::Stale,
                };
                (p.name.clone(), s)
            })
            .collect()
    }

    /// Whether a replica told this primary that another one was elected
    /// (see [`ReplicaLink::fenced_out`]), also through a link not yet
    /// dropped (a sync look for the NBD handshake).
    pub fn deposed(&self) -> bool {
        self.deposed.load(Relaxed)
            || self
                .order
                .try_lock()
                .is_ok_and(|o| o.peers.iter().any(|p| p.link.as_ref().is_some_and(|l| l.fenced_out())))
    }

    /// A replica refused `peer`'s stream as fenced above this primary.
    fn depose(&self, peer: &str) {
        if !self.deposed.swap(true, Relaxed) {
            self.changed.notify_waiters();
            tracing::error!(
                peer,
                "a copy is fenced at a higher epoch: another primary was elected; this one takes no more writes \
                 and resyncs nothing (delete or recreate its copy)"
            );
        }
    }

    fn drop_replica(&self, o: &mut Order, i: usize, why: &dyn std::fmt::Display) {
        let p = &mut o.peers[i];
        let (replaced, known) = p.link.as_ref().map_or((false, 0), |l| (l.replaced(), l.incarnation()));
        if replaced {
            // Another copy than the one the log speaks of: a full copy.
            (p.history, p.incarnation) = (History::Unknown, 0);
            tracing::warn!(peer = %p.name, "the replica's copy was made again: it gets a full copy");
        } else if p.incarnation == 0 {
            p.incarnation = known;
        }
        if p.link.as_ref().is_some_and(|l| l.fenced_out()) {
            self.depose(&p.name);
        }
        if p.link.take().is_some() {
            p.turn += 1;
            self.metrics.replicas_dropped.fetch_add(1, Relaxed);
            tracing::warn!(peer = %p.name, %why, "replica dropped from the live set");
            if let Some(hook) = &self.on_change {
                hook(&p.name, false);
            }
        }
    }

    /// Live copies, the primary included, after dropping links that went down.
    fn refresh(&self, o: &mut Order) -> usize {
        for i in 0..o.peers.len() {
            if o.peers[i].link.as_ref().is_some_and(|l| !l.is_up()) {
                self.drop_replica(o, i, &"link down");
            }
        }
        1 + o.peers.iter().filter(|p| p.live()).count()
    }

    /// Waits, at most `ack_timeout`, while the live copies are below the
    /// write quorum and the resync task is trying to bring a replica back:
    /// after a failover the new primary catches the other copies up before
    /// they count, and a write or flush arriving meanwhile would otherwise
    /// fail at once (a guest sees EIO). Returns as soon as a catch-up
    /// brought the live copies up to the quorum (it wakes the waiters), not
    /// when every attempt ended. Called before the write gate is taken (a
    /// resync's last pass holds it). Nothing is acknowledged on fewer
    /// copies: [`Inner::forward`] still checks the quorum.
    async fn await_quorum(&self) {
        // The common case, no attempt running, costs one atomic load (no
        // lock on the write path).
        if !self.resyncing.load(Relaxed) {
            return;
        }
        let deadline = tokio::time::Instant::now() + self.policy.ack_timeout;
        loop {
            // Registered before looking, so a wake between the look and
            // the wait is not missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut o = self.order.lock().await;
                if o.closed || self.refresh(&mut o) >= self.policy.write_quorum {
                    return;
                }
            }
            if self.deposed.load(Relaxed) || !self.resyncing.load(Relaxed) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return;
            }
        }
    }

    /// Says whether the resync task has an attempt running; waiters
    /// ([`Inner::await_quorum`]) look again when that ends.
    fn set_resyncing(&self, on: bool) {
        if self.resyncing.swap(on, Relaxed) && !on {
            self.changed.notify_waiters();
        }
    }

    /// Numbers `body` and queues it on every live replica, in number order;
    /// gives its number and each replica's index, generation and answer.
    /// Fails, queueing nothing more, when the live copies are below the
    /// quorum or the volume was closed.
    async fn forward(&self, body: Body) -> io::Result<(u64, Vec<(usize, u64, Ack)>)> {
        if let Some(a) = &self.authority
            && !a.may_write()
            && !a.acquire(self.policy.ack_timeout).await
        {
            return Err(io::Error::other(
                "this primary holds no lease in the volume map (lapsed, not granted yet, or deposed)",
            ));
        }
        let mut o = self.order.lock().await;
        if o.closed && !matches!(body, Body::Flush) {
            return Err(io::Error::other("the volume was closed"));
        }
        let live = self.refresh(&mut o);
        if self.deposed.load(Relaxed) {
            return Err(io::Error::other("another copy was elected primary at a higher epoch: this one is deposed"));
        }
        // Deleting a snapshot, or flattening (which changes no byte), is
        // safe on any number of copies.
        let floor =
            if matches!(body, Body::DeleteSnapshot { .. } | Body::Flatten) { 1 } else { self.policy.write_quorum };
        if live < floor {
            return Err(below_quorum(live, self.policy.write_quorum));
        }
        let seq = o.next_seq;
        let msg = Msg { seq, epoch: self.epoch.load(Relaxed), body };
        o.next_seq = o.next_seq.wrapping_add(1);
        if let Some((offset, len)) = range(&msg.body) {
            o.drl.mark(offset, len, seq);
        }
        let mut acks = Vec::with_capacity(o.peers.len());
        for i in 0..o.peers.len() {
            let Some(link) = o.peers[i].link.clone() else { continue };
            match link.send(msg.clone()).await {
                Ok(ack) => acks.push((i, o.peers[i].turn, ack)),
                Err(e) => self.drop_replica(&mut o, i, &e),
            }
        }
        let live = 1 + o.peers.iter().filter(|p| p.live()).count();
        if live < floor {
            return Err(below_quorum(live, self.policy.write_quorum));
        }
        Ok((seq, acks))
    }

    /// Waits for `acks` (each at most `ack_timeout`); replicas that fail or
    /// do not answer in time leave the live set. Gives the index and
    /// generation of each replica that answered 0.
    async fn answers(&self, acks: Vec<(usize, u64, Ack)>, what: &str) -> Vec<(usize, u64)> {
        let timeout = self.policy.ack_timeout;
        let remote = futures::future::join_all(
            acks.into_iter().map(|(i, g, ack)| async move { (i, g, tokio::time::timeout(timeout, ack).await) }),
        )
        .await;
        let mut ok = Vec::new();
        let mut o = self.order.lock().await;
        for (i, g, r) in remote {
            match r {
                Ok(Ok(())) => ok.push((i, g)),
                Ok(Err(e)) if o.peers[i].turn == g => self.drop_replica(&mut o, i, &e),
                Err(_) if o.peers[i].turn == g => {
                    self.drop_replica(&mut o, i, &format!("no answer to {what} within {timeout:?}"))
                }
                _ => {}
            }
        }
        ok
    }

    /// Holds every write out until the guard is dropped (writes hold the
    /// same gate from before they are numbered until their local write is
    /// done): meanwhile the primary's copy is at the same point of the
    /// stream as the frames queued so far.
    pub async fn quiesce(&self) -> tokio::sync::RwLockWriteGuard<'_, ()> {
        self.gate.write().await
    }

    /// A FLUSH of every live copy (see [`BlockBackend::flush`]), without
    /// trimming the dirty-region log: callable holding [`Inner::quiesce`]
    /// (the trim takes the same gate).
    pub async fn flush_copies(&self) -> io::Result<()> {
        self.flush_stream().await
    }

    /// Copies, the primary included, that must take a change for it to stand.
    pub fn write_quorum(&self) -> usize {
        self.policy.write_quorum
    }

    /// Every replica's name, in the volume's order.
    pub async fn replicas(&self) -> Vec<String> {
        self.order.lock().await.peers.iter().map(|p| p.name.clone()).collect()
    }

    /// Gives `old`'s place among the replicas to `new`, which holds no copy
    /// the primary knows of: `old` leaves the live set (the change hook is
    /// told), answers to its frames are ignored from now on, and the resync
    /// task gives `new` a full copy; the record of the log names `new` as
    /// untracked first, so a restart copies it fully too.
    pub async fn replace_peer(&self, old: &str, new: &str) -> io::Result<()> {
        {
            let mut o = self.order.lock().await;
            if o.peers.iter().any(|p| p.name == new) {
                return Err(io::Error::other(format!("{new} is a replica already")));
            }
            let i = o
                .peers
                .iter()
                .position(|p| p.name == old)
                .ok_or_else(|| io::Error::other(format!("{old} is no replica of this volume")))?;
            self.drop_replica(&mut o, i, &"replaced by another copy");
            let p = &mut o.peers[i];
            (p.name, p.history, p.incarnation, p.left) = (new.to_owned(), History::Unknown, 0, None);
            // An attempt running for the old copy does not count for the new.
            p.turn += 1;
        }
        if let Some(r) = &self.resync {
            r.connector.replaced(old, new);
        }
        self.resave().await;
        tracing::info!(old, new, "replica replaced: the new copy gets a full copy");
        Ok(())
    }

    /// Numbers a SNAPSHOT, DELETE_SNAPSHOT or FLATTEN frame and queues it
    /// on every live replica after every write queued so far. A SNAPSHOT is
    /// refused below the write quorum, as a write.
    pub async fn send_point(&self, body: Body) -> io::Result<Point> {
        debug_assert!(matches!(body, Body::Snapshot { .. } | Body::DeleteSnapshot { .. } | Body::Flatten));
        let (_, acks) = self.forward(body).await?;
        Ok(Point { acks })
    }

    /// Waits for every replica's answer to `p`; those that fail it or do
    /// not answer within `ack_timeout` leave the live set (and are recorded
    /// stale, as after a failed write). Gives the replicas that took it.
    pub async fn settle(&self, p: Point) -> Vec<String> {
        let ok = self.answers(p.acks, "a control frame").await;
        let o = self.order.lock().await;
        ok.into_iter().filter(|&(i, g)| o.peers[i].turn == g).map(|(i, _)| o.peers[i].name.clone()).collect()
    }

    /// The local copy grew to `size` bytes (call holding
    /// [`Inner::quiesce`], so no write is numbered meanwhile): the log grows
    /// with it, a catch-up from now on opens the copy at the new size (a
    /// copy that misses the RESIZE grows itself then), and a RESIZE frame
    /// is queued on every live replica after every write queued so far.
    /// Refused below the write quorum, as a write (the local copy stays
    /// grown: the copies that missed it grow when they catch up).
    pub async fn grow(&self, size: u64) -> io::Result<Point> {
        let k = self.order.lock().await.drl.grow(size);
        if k > 1
            && let Some(s) = &self.saver
            && let Ok(mut d) = s.durable.lock()
        {
            *d = d.iter().map(|g| g / k).collect();
        }
        if let Some(r) = &self.resync {
            r.connector.resized(size);
        }
        if k > 1 {
            // The record names regions of the new size from now on.
            self.resave().await;
        }
        let (_, acks) = self.forward(Body::Resize { size }).await?;
        Ok(Point { acks })
    }

    /// The record of the log as it stands, holding `regions`.
    fn record(&self, o: &Order, regions: &BTreeSet<u64>, open: bool) -> drl::DrlRecord {
        let in_sync = if open {
            Vec::new()
        } else {
            o.peers.iter().filter(|p| p.live() && o.drl.dirty(p.history).is_empty()).map(|p| p.name.clone()).collect()
        };
        drl::DrlRecord {
            open,
            region: o.drl.region(),
            bits: drl::encode_bits(regions.iter().copied()),
            in_sync,
            untracked: o.peers.iter().filter(|p| p.history == History::Unknown).map(|p| p.name.clone()).collect(),
            incarnations: o
                .peers
                .iter()
                .filter_map(|p| {
                    let known = match p.incarnation {
                        0 => p.link.as_ref().map_or(0, |l| l.incarnation()),
                        n => n,
                    };
                    (known != 0).then(|| (p.name.clone(), known))
                })
                .collect(),
        }
    }

    /// Writes the record (through the blocking pool: the store commits to disk).
    async fn save(&self, s: &Saver, rec: drl::DrlRecord) -> io::Result<()> {
        let store = s.store.clone();
        tokio::task::spawn_blocking(move || store.save(&rec))
            .await
            .map_err(|e| io::Error::other(format!("saving the dirty-region log: {e}")))?
    }

    /// Makes the record hold the regions of `[offset, offset + len)` before
    /// the write is sent anywhere; no disk write when it holds them already.
    async fn log_dirty(&self, offset: u64, len: u64) -> io::Result<()> {
        let Some(s) = &self.saver else { return Ok(()) };
        if len == 0 {
            return Ok(());
        }
        let want: Vec<u64> = drl::regions_of(self.local.size(), offset, len).collect();
        let missing = |d: &BTreeSet<u64>| want.iter().any(|g| !d.contains(g));
        if !missing(&*s.durable.lock().map_err(|_| io::Error::other("log poisoned"))?) {
            return Ok(());
        }
        let _w = s.writing.lock().await;
        let mut all = s.durable.lock().map_err(|_| io::Error::other("log poisoned"))?.clone();
        if !missing(&all) {
            return Ok(());
        }
        all.extend(want.iter().copied());
        // And the next few regions in the same commit: a sequential writer
        // then pays one record write per LOG_AHEAD + 1 regions. A region
        // logged and never written costs only copying after a restart.
        if let Some(&last) = want.last() {
            let count = drl::regions_of(self.local.size(), 0, self.local.size()).end() + 1;
            all.extend((last + 1..count).take(LOG_AHEAD));
        }
        let rec = {
            let o = self.order.lock().await;
            self.record(&o, &all, true)
        };
        self.save(s, rec).await?;
        *s.durable.lock().map_err(|_| io::Error::other("log poisoned"))? = all;
        Ok(())
    }

    /// Drops from the record the regions every tracked copy holds (at most
    /// once a second: each costs a disk write, and stale bits only cost
    /// extra copying after a crash).
    async fn trim_log(&self) {
        let Some(s) = &self.saver else { return };
        match s.last_trim.lock() {
            Ok(t) if t.elapsed() >= Duration::from_secs(1) => {}
            _ => return,
        }
        {
            let o = self.order.lock().await;
            let union = o.drl.union(o.peers.iter().map(|p| p.history));
            if s.durable.lock().map(|d| *d == union).unwrap_or(true) {
                return;
            }
        }
        // No write between recording its region and marking it: a write
        // that found its region in the record and is not marked yet would
        // lose it from the record (writes wait for this one disk write).
        let _g = self.gate.write().await;
        let _w = s.writing.lock().await;
        let (union, rec) = {
            let o = self.order.lock().await;
            let union = o.drl.union(o.peers.iter().map(|p| p.history));
            if s.durable.lock().map(|d| *d == union).unwrap_or(true) {
                return;
            }
            let rec = self.record(&o, &union, !o.closed);
            (union, rec)
        };
        if let Ok(mut t) = s.last_trim.lock() {
            *t = std::time::Instant::now();
        }
        match self.save(s, rec).await {
            Ok(()) => {
                if let Ok(mut d) = s.durable.lock() {
                    *d = union;
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not trim the dirty-region log"),
        }
    }

    /// Writes the record again as it stands (after a replica's history
    /// became known).
    async fn resave(&self) {
        let Some(s) = &self.saver else { return };
        let _w = s.writing.lock().await;
        let regions = s.durable.lock().map(|d| d.clone()).unwrap_or_default();
        let rec = {
            let o = self.order.lock().await;
            self.record(&o, &regions, !o.closed)
        };
        if let Err(e) = self.save(s, rec).await {
            tracing::warn!(error = %e, "could not save the dirty-region log");
        }
    }

    /// A FLUSH on every live replica and locally; Ok once the local flush
    /// and at least `quorum - 1` replicas succeeded. Replicas that fail or
    /// do not answer in time leave the live set.
    async fn flush_all(&self) -> io::Result<()> {
        self.flush_stream().await?;
        self.trim_log().await;
        Ok(())
    }

    /// [`Inner::flush_all`] without the trim of the log.
    async fn flush_stream(&self) -> io::Result<()> {
        let (seq, acks) = self.forward(Body::Flush).await?;
        let (local, ok) = futures::join!(self.local.flush(), self.answers(acks, "FLUSH"));
        local?;
        let acked = 1 + ok.len();
        {
            let mut o = self.order.lock().await;
            for (i, g) in ok {
                let p = &mut o.peers[i];
                if p.turn == g
                    && let History::Acked(f) = p.history
                {
                    p.history = History::Acked(f.max(seq));
                }
            }
        }
        if acked < self.policy.write_quorum {
            return Err(below_quorum(acked, self.policy.write_quorum));
        }
        if let Some(a) = &self.authority {
            a.settle(self.policy.ack_timeout).await?;
            // The lease must hold when the answer goes out: a primary whose
            // lease lapsed during the flush may have been replaced. Renewed
            // at the same epoch it was not (a takeover would have made the
            // renewal fail), so the answer may wait for that.
            if !a.may_write() && !a.acquire(self.policy.ack_timeout).await {
                return Err(io::Error::other("this primary's lease lapsed during the flush"));
            }
        }
        Ok(())
    }

    /// Stops the resync task and takes no write any more, leaving the
    /// record as it is (a crash, for tests).
    pub async fn abandon(&self) {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = task {
            t.abort();
            let _ = t.await;
        }
        self.order.lock().await.closed = true;
        self.changed.notify_waiters();
    }

    /// A clean close: no write is taken from now on, a last FLUSH, and the
    /// record says which replicas hold everything (they relink as live at
    /// the next open; the others resync). Stops the resync task.
    pub async fn close(&self) -> io::Result<()> {
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = task {
            t.abort();
            let _ = t.await;
        }
        {
            let _g = self.gate.write().await;
            self.order.lock().await.closed = true;
        }
        self.changed.notify_waiters();
        if let Err(e) = self.flush_all().await {
            tracing::warn!(error = %e, "the last flush before closing failed");
        }
        let Some(s) = &self.saver else { return Ok(()) };
        let _w = s.writing.lock().await;
        let rec = {
            let o = self.order.lock().await;
            let union = o.drl.union(o.peers.iter().map(|p| p.history));
            self.record(&o, &union, false)
        };
        self.save(s, rec).await
    }
}

impl<B: BlockBackend> BlockBackend for Replicated<B> {
    fn size(&self) -> u64 {
        self.inner.local.size()
    }

    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        self.inner.local.read_at(buf, offset).await
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.size()) {
            return (Err(io::Error::from_raw_os_error(libc::EINVAL)), buf);
        }
        let i = &self.inner;
        i.await_quorum().await;
        let gate = i.gate.read().await;
        if let Err(e) = i.log_dirty(offset, buf.len() as u64).await {
            return (Err(eio(e)), buf);
        }
        if let Err(e) = i.forward(Body::Write { offset, data: Bytes::copy_from_slice(&buf) }).await {
            return (Err(eio(e)), buf);
        }
        let (r, buf) = i.local.write_at(buf, offset, false).await;
        drop(gate);
        if r.is_err() || !fua {
            return (r, buf);
        }
        (i.flush_all().await.map_err(eio), buf)
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
        let i = &self.inner;
        i.await_quorum().await;
        let _gate = i.gate.read().await;
        i.log_dirty(offset, len).await.map_err(eio)?;
        i.forward(Body::WriteZeroes { offset, len, punch }).await.map_err(eio)?;
        i.local.write_zeroes(offset, len, punch, fast_only).await
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.size()) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let i = &self.inner;
        i.await_quorum().await;
        let _gate = i.gate.read().await;
        i.log_dirty(offset, len).await.map_err(eio)?;
        i.forward(Body::Trim { offset, len }).await.map_err(eio)?;
        i.local.trim(offset, len).await
    }

    async fn flush(&self) -> io::Result<()> {
        self.inner.await_quorum().await;
        self.inner.flush_all().await.map_err(eio)
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.local.cache(offset, len).await
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.inner.local.extents(offset, len, max).await
    }

    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        self.inner.local.try_read_now(buf, offset)
    }

    // try_write_now stays `false`: every write must be forwarded.

    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        self.inner.local.splice_source(offset, len)
    }
}
