//! The volume map's RPC between nodes. It rides on the replica listener:
//! a caller runs the replica RPC's HMAC handshake (`replica/auth.rs`, the
//! cluster file's secret), then sends [`MAGIC`] where a replica stream
//! would send its first frame, and from then on length-prefixed JSON
//! messages, one answer per request, in order. A peer without the secret
//! gets no further than the handshake.
//!
//! ```text
//! request / answer   len (4, big-endian, at most 16 MiB) | JSON
//! ```

// openraft's traits fix these error types (StorageError, RPCError), large as they are.
#![allow(clippy::result_large_err)]

use super::members::MemberChange;
use super::state::{Command, Outcome};
use super::{Cfg, NodeId, Peer};
use crate::replica::auth::{self, RpcSecret};
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// What a map connection sends where a replica stream's first frame goes.
pub const MAGIC: [u8; 4] = *b"CFM1";

/// The largest message either side takes.
pub const MAX_MESSAGE: usize = 16 << 20;

/// A request to a node's part of the map.
#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    Append(AppendEntriesRequest<Cfg>),
    Vote(VoteRequest<NodeId>),
    Snapshot(InstallSnapshotRequest<Cfg>),
    /// A command for the leader to propose (a follower forwards it).
    Propose(Command),
    /// Whether the node holds a map (its store was initialised): asked by
    /// a pristine node before it founds the group.
    Standing,
    /// A change of the group's voters for the leader to make.
    Members(MemberChange),
}

/// Why the leader did not propose a forwarded command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ProposeError {
    /// This node is not the leader (the one it knows, if any).
    #[error("not the map's leader (leader: {0:?})")]
    NotLeader(Option<NodeId>),
    /// A takeover asked for while the primary's lease may still run.
    #[error("the primary's lease may run for another {left_ms} ms")]
    LeaseRuns { left_ms: u64 },
    /// Raft failed the proposal.
    #[error("{0}")]
    Failed(String),
    /// The leader refuses the change (trying again does not help).
    #[error("{0}")]
    Refused(String),
}

/// The answer to a [`Request`], of the same kind.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    Propose(Result<Outcome, ProposeError>),
    Standing {
        holds_map: bool,
    },
    /// The voters after the change.
    Members(Result<Vec<String>, ProposeError>),
}

/// Writes one message.
pub async fn send<W: AsyncWrite + Unpin, T: Serialize>(w: &mut W, msg: &T) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    if body.len() > MAX_MESSAGE {
        return Err(std::io::Error::other(format!("a map message of {} bytes is too large", body.len())));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads one message; `None` at a clean end of the connection.
pub async fn receive<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(r: &mut R) -> std::io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a map message of {len} bytes is over the limit of {MAX_MESSAGE}"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    serde_json::from_slice(&body).map(Some).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// An authenticated map connection to one node, opened on first use and
/// again after a failure.
#[derive(Debug)]
pub struct Conn {
    addr: String,
    secret: Arc<RpcSecret>,
    io: Option<(BufReader<OwnedReadHalf>, OwnedWriteHalf)>,
}

impl Conn {
    pub fn new(addr: String, secret: Arc<RpcSecret>) -> Self {
        Conn { addr, secret, io: None }
    }

    async fn connect(&self) -> std::io::Result<(BufReader<OwnedReadHalf>, OwnedWriteHalf)> {
        let mut s = TcpStream::connect(&self.addr).await?;
        s.set_nodelay(true)?;
        svc_kit::rpc_auth::io::as_caller(&mut s, &auth::PROTOCOL, &self.secret)
            .await
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()))?;
        s.write_all(&MAGIC).await?;
        let (r, w) = s.into_split();
        Ok((BufReader::new(r), w))
    }

    /// Sends `req` and waits (at most `ttl`, the connect included) for its
    /// answer. `Err(true)`: the node could not be reached (no connection);
    /// `Err(false)`: the connection failed during the call.
    pub async fn call(&mut self, req: &Request, ttl: Duration) -> Result<Answer, (bool, std::io::Error)> {
        let fresh = self.io.is_none();
        let r = tokio::time::timeout(ttl, async {
            if self.io.is_none() {
                self.io = Some(self.connect().await.map_err(|e| (true, e))?);
            }
            let (r, w) = self.io.as_mut().expect("connected above");
            send(w, req).await.map_err(|e| (fresh, e))?;
            match receive(r).await {
                Ok(Some(a)) => Ok(a),
                Ok(None) => Err((false, std::io::Error::from(std::io::ErrorKind::UnexpectedEof))),
                Err(e) => Err((false, e)),
            }
        })
        .await
        .unwrap_or_else(|_| Err((fresh, std::io::Error::from(std::io::ErrorKind::TimedOut))));
        if r.is_err() {
            self.io = None;
        }
        r
    }
}

/// Makes a [`Conn`] per peer for openraft.
#[derive(Debug, Clone)]
pub struct Network {
    pub secret: Arc<RpcSecret>,
}

/// openraft's client of one peer.
#[derive(Debug)]
pub struct PeerClient {
    target: NodeId,
    conn: Conn,
}

impl RaftNetworkFactory<Cfg> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Peer) -> PeerClient {
        PeerClient { target, conn: Conn::new(node.addr.clone(), self.secret.clone()) }
    }
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, Peer, RaftError<NodeId, E>>;

impl PeerClient {
    async fn call<E: std::error::Error>(&mut self, req: Request, option: &RPCOption) -> Result<Answer, RpcErr<E>> {
        self.conn.call(&req, option.hard_ttl()).await.map_err(|(unreachable, e)| {
            if unreachable {
                RPCError::Unreachable(Unreachable::new(&e))
            } else {
                RPCError::Network(NetworkError::new(&e))
            }
        })
    }

    fn unexpected<E: std::error::Error>(&self) -> RpcErr<E> {
        RPCError::Network(NetworkError::new(&std::io::Error::other("a map answer of the wrong kind")))
    }

    fn remote<T, E: std::error::Error>(&self, r: Result<T, RaftError<NodeId, E>>) -> Result<T, RpcErr<E>> {
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<Cfg> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<Cfg>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        match self.call(Request::Append(rpc), &option).await? {
            Answer::Append(r) => self.remote(r),
            _ => Err(self.unexpected()),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<Cfg>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        match self.call(Request::Snapshot(rpc), &option).await? {
            Answer::Snapshot(r) => self.remote(r),
            _ => Err(self.unexpected()),
        }
    }

    async fn vote(&mut self, rpc: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcErr> {
        match self.call(Request::Vote(rpc), &option).await? {
            Answer::Vote(r) => self.remote(r),
            _ => Err(self.unexpected()),
        }
    }
}
