//! An in-memory replica link for tests: frames go to a task that applies
//! them to a backend through the same [`Applier`] as the TCP listener, and
//! the test can kill the replica (it answers nothing more and goes down) or
//! make it stall (it takes frames and never answers, like a partition).

use super::apply::Applier;
use super::link::{Ack, ReplicaLink};
use crate::backend::traits::BlockBackend;
use crate::replica::wire::Msg;
use futures::future::BoxFuture;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use tokio::sync::{mpsc, oneshot};

const UP: u8 = 0;
const STALLED: u8 = 1;
const DEAD: u8 = 2;

/// A frame and where to send its answer.
type Queued = (Msg, oneshot::Sender<io::Result<()>>);

/// A replica in this process.
pub struct MemLink {
    peer: String,
    mode: Arc<AtomicU8>,
    /// The replica refused the stream as fenced above it.
    fenced: Arc<std::sync::atomic::AtomicBool>,
    frames: std::sync::Mutex<Option<mpsc::UnboundedSender<Queued>>>,
}

impl MemLink {
    /// A link to `backend`, expecting frames from `first_seq` at any epoch
    /// from `fence_epoch` up.
    pub fn new<B: BlockBackend>(peer: &str, backend: Arc<B>, first_seq: u64, fence_epoch: u64) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<Queued>();
        let mode = Arc::new(AtomicU8::new(UP));
        let m = mode.clone();
        tokio::spawn(async move {
            let mut applier = Applier::opened(first_seq);
            while let Some((msg, answer)) = rx.recv().await {
                match m.load(Ordering::SeqCst) {
                    DEAD => return,
                    STALLED => {
                        // Keep the sender alive so the answer never comes.
                        std::mem::forget(answer);
                        continue;
                    }
                    _ => {}
                }
                if let Err(errno) = applier.apply(&*backend, &super::apply::NoSnapshots, msg, fence_epoch).await {
                    let _ = answer.send(Err(io::Error::from_raw_os_error(errno as i32)));
                    m.store(DEAD, Ordering::SeqCst);
                    return;
                }
                let _ = answer.send(Ok(()));
            }
        });
        MemLink { peer: peer.to_owned(), mode, fenced: Default::default(), frames: std::sync::Mutex::new(Some(tx)) }
    }

    /// The replica dies: frames not yet applied never will be, the link goes down.
    pub fn kill(&self) {
        self.mode.store(DEAD, Ordering::SeqCst);
        if let Ok(mut f) = self.frames.lock() {
            f.take();
        }
    }

    /// The replica refuses the stream: another primary fenced it above this
    /// one's epoch (it answers `EPERM` and the link goes down).
    pub fn refuse_fenced(&self) {
        self.fenced.store(true, Ordering::SeqCst);
        self.kill();
    }

    /// The replica stops answering but the link looks up (a partition).
    pub fn stall(&self) {
        self.mode.store(STALLED, Ordering::SeqCst);
    }
}

impl ReplicaLink for MemLink {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn is_up(&self) -> bool {
        self.mode.load(Ordering::SeqCst) != DEAD
    }

    fn fenced_out(&self) -> bool {
        self.fenced.load(Ordering::SeqCst)
    }

    fn send(&self, msg: Msg) -> BoxFuture<'_, io::Result<Ack>> {
        Box::pin(async move {
            let down = || io::Error::new(io::ErrorKind::BrokenPipe, format!("replica {} is down", self.peer));
            let (tx, rx) = oneshot::channel();
            let f = self.frames.lock().map_err(|_| down())?;
            f.as_ref().ok_or_else(down)?.send((msg, tx)).map_err(|_| down())?;
            let peer = self.peer.clone();
            let ack: Ack = Box::pin(async move {
                rx.await
                    .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::BrokenPipe, format!("replica {peer} died"))))
            });
            Ok(ack)
        })
    }
}

/// Opens [`MemLink`]s to in-memory replicas by name (tests): a replica
/// taken offline gets links that are down from the start.
pub struct MemConnector<B> {
    pub replicas: std::collections::HashMap<String, Arc<B>>,
    pub offline: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Every link opened, newest last, with whether it was a resync stream.
    pub opened: std::sync::Mutex<Vec<(String, bool, Arc<MemLink>)>>,
    /// The epoch each link's OPEN carried, in the same order.
    pub epochs: std::sync::Mutex<Vec<(String, u64)>>,
    /// Replicas fenced at an epoch: they refuse links of older epochs.
    pub fences: std::sync::Mutex<std::collections::HashMap<String, u64>>,
    /// Replicas that hang: their links take frames and never answer (a
    /// node whose kernel takes the connection and whose process is stuck).
    pub hanging: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl<B: BlockBackend> MemConnector<B> {
    pub fn new(replicas: impl IntoIterator<Item = (String, Arc<B>)>) -> Self {
        MemConnector {
            replicas: replicas.into_iter().collect(),
            offline: Default::default(),
            opened: Default::default(),
            epochs: Default::default(),
            fences: Default::default(),
            hanging: Default::default(),
        }
    }

    /// Whether `peer` can be reached from now on.
    pub fn set_offline(&self, peer: &str, offline: bool) {
        if let Ok(mut o) = self.offline.lock() {
            if offline {
                o.insert(peer.to_owned());
            } else {
                o.remove(peer);
            }
        }
    }
}

impl<B: BlockBackend + 'static> super::resync::Connector for MemConnector<B> {
    fn connect(
        &self,
        peer: &str,
        resync: bool,
        first_seq: u64,
        epoch: u64,
        _expect: u64,
    ) -> io::Result<Arc<dyn ReplicaLink>> {
        if let Ok(mut e) = self.epochs.lock() {
            e.push((peer.to_owned(), epoch));
        }
        let backend = self.replicas.get(peer).cloned().ok_or_else(|| io::Error::other(format!("no replica {peer}")))?;
        let link = Arc::new(MemLink::new(peer, backend, first_seq, 0));
        if self.offline.lock().map(|o| o.contains(peer)).unwrap_or(false) {
            link.kill();
        }
        if self.hanging.lock().map(|h| h.contains(peer)).unwrap_or(false) {
            link.stall();
        }
        if self.fences.lock().ok().and_then(|f| f.get(peer).copied()).is_some_and(|f| f > epoch) {
            link.refuse_fenced();
        }
        if let Ok(mut o) = self.opened.lock() {
            o.push((peer.to_owned(), resync, link.clone()));
        }
        Ok(link)
    }
}
