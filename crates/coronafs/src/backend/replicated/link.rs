//! The primary's end of the replica RPC: [`ReplicaLink`], a small trait a
//! replicated backend forwards frames through, and [`TcpLink`], its TCP
//! implementation (tests add in-memory links that drop, stall or kill a
//! replica, `mem.rs`).
//!
//! A link is pipelined: [`ReplicaLink::send`] queues a frame behind every
//! earlier one and gives back a future of its answer, without waiting for
//! it. A link goes down for good on its first failure (a broken connection,
//! an error answer, a window that stays full past the timeout) and then
//! fails every frame it still holds; the backend above notices through
//! [`ReplicaLink::is_up`].

use crate::error::{CoronaError, Result};
use crate::replica::auth::{self, RpcSecret};
use crate::replica::wire::{Body, HEADER_LEN, Msg, Origin, REPLY_LEN, Reply};
use futures::future::BoxFuture;
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

/// The answer to one queued frame.
pub type Ack = BoxFuture<'static, io::Result<()>>;

/// One replica of one volume, as the primary sees it.
pub trait ReplicaLink: Send + Sync + 'static {
    /// The replica's node name, for logs.
    fn peer(&self) -> &str;
    /// False once the link failed; it never comes back up.
    fn is_up(&self) -> bool;
    /// Queues `msg` after every frame queued before (waiting while the
    /// link's window is full) and gives the future of its answer.
    fn send(&self, msg: Msg) -> BoxFuture<'_, io::Result<Ack>>;
    /// True once the replica refused the stream because its copy is fenced
    /// at a higher epoch (`EPERM`): another primary was elected since.
    fn fenced_out(&self) -> bool {
        false
    }
    /// The copy's incarnation, as its answer to OPEN said (0 until then).
    fn incarnation(&self) -> u64 {
        0
    }
    /// True once the replica refused the stream because its copy is not the
    /// incarnation the primary asked for (`ENXIO`: deleted and made again).
    fn replaced(&self) -> bool {
        false
    }
}

/// Bytes a TCP link may have queued and unanswered.
pub const WINDOW_BYTES: usize = 64 << 20;
/// Window accounting unit: one permit per KiB.
const UNIT: usize = 1024;

fn down_error(peer: &str) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, format!("replica {peer} is down"))
}

type Pending = VecDeque<(u64, oneshot::Sender<io::Result<()>>, OwnedSemaphorePermit)>;

struct LinkState {
    peer: String,
    up: AtomicBool,
    /// The replica answered `EPERM`: it is fenced above this stream.
    fenced_out: AtomicBool,
    /// The replica answered OPEN with `ENXIO`: another incarnation.
    replaced: AtomicBool,
    /// The copy's incarnation, from its answer to OPEN.
    incarnation: std::sync::atomic::AtomicU64,
    /// Frames sent and not answered, in order; also orders the writer queue.
    pending: Mutex<Pending>,
}

impl LinkState {
    /// Marks the link down and fails everything it holds.
    fn fail(&self, why: &str) {
        if self.up.swap(false, Ordering::SeqCst) {
            tracing::warn!(peer = %self.peer, why, "replica link down");
        }
        let drained: Pending = match self.pending.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => return,
        };
        for (_, tx, _) in drained {
            let _ = tx.send(Err(down_error(&self.peer)));
        }
    }
}

/// A replica link over TCP (see [`crate::replica::wire`]).
pub struct TcpLink {
    state: Arc<LinkState>,
    frames: mpsc::UnboundedSender<Msg>,
    window: Arc<Semaphore>,
    timeout: Duration,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink").field("peer", &self.state.peer).field("up", &self.is_up()).finish()
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The caller's half of the handshake (`replica/auth.rs`).
pub async fn handshake_as_caller(s: &mut TcpStream, secret: &RpcSecret) -> Result<()> {
    Ok(svc_kit::rpc_auth::io::as_caller(s, &auth::PROTOCOL, secret).await?)
}

/// Where and how to open a link.
#[derive(Debug, Clone)]
pub struct LinkTarget {
    /// The replica's node name.
    pub peer: String,
    /// Its replica RPC address.
    pub addr: SocketAddr,
    /// How long a frame may wait for window space before the link goes down.
    pub timeout: Duration,
    /// Sends a HEARTBEAT when no frame went out for this long (`None`: never).
    pub heartbeat: Option<Duration>,
}

/// What a link needs to open its replica's stream.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    pub volume: String,
    pub size: u64,
    pub epoch: u64,
    /// The number of the first frame after OPEN.
    pub first_seq: u64,
    /// The stream and who sends it (see [`Origin`]).
    pub origin: Origin,
}

/// Connects, authenticates and opens the stream; gives the connection.
async fn connect(target: &LinkTarget, secret: &RpcSecret, spec: &StreamSpec, state: &LinkState) -> Result<TcpStream> {
    let mut s = tokio::time::timeout(target.timeout, TcpStream::connect(target.addr))
        .await
        .map_err(|_| CoronaError::Replica(format!("connecting to {} ({}) timed out", target.peer, target.addr)))??;
    s.set_nodelay(true)?;
    handshake_as_caller(&mut s, secret).await?;
    let open = Msg {
        seq: spec.first_seq,
        epoch: spec.epoch,
        body: Body::Open { volume: spec.volume.clone(), size: spec.size, origin: spec.origin.clone() },
    };
    let (h, payload) = open.encode();
    s.write_all(&h).await?;
    s.write_all(&payload).await?;
    let mut r = [0u8; REPLY_LEN];
    s.read_exact(&mut r).await?;
    let reply = Reply::decode(&r)?;
    if reply.errno != 0 {
        if reply.errno == libc::EPERM as u32 {
            state.fenced_out.store(true, Ordering::SeqCst);
        }
        if reply.errno == libc::ENXIO as u32 {
            state.replaced.store(true, Ordering::SeqCst);
        }
        let e = io::Error::from_raw_os_error(reply.errno as i32);
        return Err(CoronaError::Replica(format!("{} refused volume {:?}: {e}", target.peer, spec.volume)));
    }
    state.incarnation.store(reply.seq, Ordering::SeqCst);
    Ok(s)
}

impl TcpLink {
    /// Starts a link in the background: frames sent before the connection
    /// is up wait in its queue; if connecting fails, the link goes down and
    /// fails them. `ready` says how connecting went.
    pub fn start(target: LinkTarget, secret: RpcSecret, spec: StreamSpec) -> (Self, oneshot::Receiver<Result<()>>) {
        let state = Arc::new(LinkState {
            peer: target.peer.clone(),
            up: AtomicBool::new(true),
            fenced_out: AtomicBool::new(false),
            replaced: AtomicBool::new(false),
            incarnation: Default::default(),
            pending: Mutex::new(VecDeque::new()),
        });
        let (frames, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready) = oneshot::channel();
        let st = state.clone();
        let timeout = target.timeout;
        let heartbeat = target.heartbeat;
        let task = tokio::spawn(async move {
            match connect(&target, &secret, &spec, &st).await {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    let (rd, wr) = s.into_split();
                    let reader = tokio::spawn(read_replies(rd, st.clone()));
                    write_frames(wr, rx, st, heartbeat, spec.epoch).await;
                    reader.abort();
                }
                Err(e) => {
                    st.fail(&format!("cannot open the stream: {e}"));
                    let _ = ready_tx.send(Err(e));
                }
            }
        });
        let link = TcpLink {
            state,
            frames,
            window: Arc::new(Semaphore::new(WINDOW_BYTES / UNIT)),
            timeout,
            tasks: vec![task],
        };
        (link, ready)
    }

    /// Opens a link and waits until the replica accepted the stream.
    pub async fn open(
        target: &LinkTarget,
        secret: &RpcSecret,
        volume: &str,
        size: u64,
        epoch: u64,
        first_seq: u64,
    ) -> Result<Self> {
        let spec = StreamSpec { volume: volume.to_owned(), size, epoch, first_seq, origin: Origin::default() };
        let (link, ready) = TcpLink::start(target.clone(), secret.clone(), spec);
        ready.await.map_err(|_| CoronaError::Replica("link task ended".into()))??;
        Ok(link)
    }
}

/// Frames gathered into one `writev` at most.
const BATCH_FRAMES: usize = 32;

async fn write_frames(
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    state: Arc<LinkState>,
    heartbeat: Option<Duration>,
    mut epoch: u64,
) {
    // Everything queued goes out in one vectored write (headers and
    // payloads side by side): no copy of a payload into a buffer, and no
    // header sent alone ahead of its payload.
    let mut batch: Vec<Msg> = Vec::with_capacity(BATCH_FRAMES);
    // `epoch`: the stream's, then that of the last frame sent; a heartbeat carries it.
    loop {
        let next = match heartbeat {
            Some(h) => match tokio::time::timeout(h, rx.recv()).await {
                Ok(m) => m,
                // Idle for a period: tell the replica the primary is alive.
                Err(_) => Some(Msg { seq: 0, epoch, body: Body::Heartbeat }),
            },
            None => rx.recv().await,
        };
        let Some(first) = next else { break };
        epoch = epoch.max(first.epoch);
        batch.push(first);
        while batch.len() < BATCH_FRAMES {
            match rx.try_recv() {
                Ok(m) => {
                    epoch = epoch.max(m.epoch);
                    batch.push(m);
                }
                Err(_) => break,
            }
        }
        let r = write_batch(&mut wr, &batch).await;
        batch.clear();
        if let Err(e) = r {
            state.fail(&format!("send: {e}"));
            return;
        }
    }
}

/// Writes every frame of `batch`, in order, with as few `writev` calls as
/// the socket takes.
async fn write_batch(wr: &mut tokio::net::tcp::OwnedWriteHalf, batch: &[Msg]) -> io::Result<()> {
    let encoded: Vec<([u8; HEADER_LEN], std::borrow::Cow<'_, [u8]>)> = batch.iter().map(Msg::encode).collect();
    let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * encoded.len());
    for (h, payload) in &encoded {
        parts.push(h);
        if !payload.is_empty() {
            parts.push(payload);
        }
    }
    // `first` parts are sent; `skip` bytes of the next one too.
    let (mut first, mut skip) = (0, 0);
    while first < parts.len() {
        let n = {
            let mut iov = Vec::with_capacity(parts.len() - first);
            iov.push(io::IoSlice::new(&parts[first][skip..]));
            iov.extend(parts[first + 1..].iter().map(|p| io::IoSlice::new(p)));
            wr.write_vectored(&iov).await?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let mut left = n;
        while left > 0 {
            let rest = parts[first].len() - skip;
            if left >= rest {
                left -= rest;
                (first, skip) = (first + 1, 0);
            } else {
                skip += left;
                left = 0;
            }
        }
    }
    Ok(())
}

async fn read_replies(mut rd: tokio::net::tcp::OwnedReadHalf, state: Arc<LinkState>) {
    let mut buf = [0u8; REPLY_LEN];
    loop {
        if let Err(e) = rd.read_exact(&mut buf).await {
            state.fail(&format!("connection lost: {e}"));
            return;
        }
        let reply = match Reply::decode(&buf) {
            Ok(r) => r,
            Err(e) => return state.fail(&e.to_string()),
        };
        let front = match state.pending.lock() {
            Ok(mut p) => p.pop_front(),
            Err(_) => return,
        };
        match front {
            Some((seq, tx, _permit)) if seq == reply.seq => {
                if reply.errno == 0 {
                    let _ = tx.send(Ok(()));
                } else {
                    if reply.errno == libc::EPERM as u32 {
                        state.fenced_out.store(true, Ordering::SeqCst);
                    }
                    let e = io::Error::from_raw_os_error(reply.errno as i32);
                    let _ = tx.send(Err(io::Error::new(e.kind(), format!("replica {}: {e}", state.peer))));
                    return state.fail(&format!("answered {e}"));
                }
            }
            _ => return state.fail(&format!("answer for seq {} out of order", reply.seq)),
        }
    }
}

impl ReplicaLink for TcpLink {
    fn peer(&self) -> &str {
        &self.state.peer
    }

    fn is_up(&self) -> bool {
        self.state.up.load(Ordering::SeqCst)
    }

    fn fenced_out(&self) -> bool {
        self.state.fenced_out.load(Ordering::SeqCst)
    }

    fn incarnation(&self) -> u64 {
        self.state.incarnation.load(Ordering::SeqCst)
    }

    fn replaced(&self) -> bool {
        self.state.replaced.load(Ordering::SeqCst)
    }

    fn send(&self, msg: Msg) -> BoxFuture<'_, io::Result<Ack>> {
        Box::pin(async move {
            let units = match &msg.body {
                Body::Write { data, .. } => (data.len() / UNIT).max(1),
                _ => 1,
            } as u32;
            let permit = match tokio::time::timeout(self.timeout, self.window.clone().acquire_many_owned(units)).await {
                Ok(Ok(p)) => p,
                _ => {
                    self.state.fail("window full past the timeout");
                    return Err(down_error(&self.state.peer));
                }
            };
            let (tx, rx) = oneshot::channel();
            {
                let mut p = self.state.pending.lock().map_err(|_| down_error(&self.state.peer))?;
                if !self.is_up() {
                    return Err(down_error(&self.state.peer));
                }
                p.push_back((msg.seq, tx, permit));
                // Queued under the same lock as `pending`, so both keep one order.
                self.frames.send(msg).map_err(|_| down_error(&self.state.peer))?;
            }
            let peer = self.state.peer.clone();
            let ack: Ack = Box::pin(async move { rx.await.unwrap_or_else(|_| Err(down_error(&peer))) });
            Ok(ack)
        })
    }
}
