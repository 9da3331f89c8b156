//! The transport between nodes: a small trait ([`Transport`], and
//! [`Handler`] for the receiving node) with a TCP implementation. The
//! in-process transport (a cluster inside one test process) and the
//! fault-injecting wrapper that drops, delays and partitions its traffic
//! are test doubles outside this crate (`testkit::lightningstor`), over the
//! same traits.

use super::NodeId;
use super::rpc::{self, Msg, Req, Resp};
use crate::error::{LightningError, Result};
use bytes::BytesMut;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Something that answers requests: a node.
#[async_trait::async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one request from another node.
    async fn handle(&self, req: Msg<Req>) -> Msg<Resp>;
}

/// Sends requests from one node to others.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// Sends `req` to node `to` and waits for its answer.
    async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>>;
    /// Learns (or forgets) a node's address after a layout change.
    fn set_peers(&self, _peers: HashMap<NodeId, SocketAddr>) {}
}

fn unreachable(to: NodeId, why: &str) -> LightningError {
    LightningError::Unavailable(format!("node {to} unreachable: {why}"))
}

/// TCP transport: pooled connections, one request at a time per connection.
pub struct Tcp {
    peers: RwLock<HashMap<NodeId, SocketAddr>>,
    pool: Mutex<HashMap<NodeId, Vec<TcpStream>>>,
    timeout: Duration,
}

/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 32;

impl Tcp {
    /// A transport to `peers`; each call must finish within `timeout`.
    pub fn new(peers: HashMap<NodeId, SocketAddr>, timeout: Duration) -> Self {
        Tcp { peers: RwLock::new(peers), pool: Mutex::new(HashMap::new()), timeout }
    }

    async fn connection(&self, to: NodeId) -> Result<TcpStream> {
        if let Some(c) = self.pool.lock().ok().and_then(|mut p| p.get_mut(&to).and_then(Vec::pop)) {
            return Ok(c);
        }
        let addr = self
            .peers
            .read()
            .ok()
            .and_then(|p| p.get(&to).copied())
            .ok_or_else(|| unreachable(to, "no address in the layout"))?;
        let s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable(to, "connect timed out"))?
            .map_err(|e| unreachable(to, &e.to_string()))?;
        let _ = s.set_nodelay(true);
        Ok(s)
    }

    async fn exchange(s: &mut TcpStream, req: &Msg<Req>) -> Result<Msg<Resp>> {
        write_msg(s, req).await?;
        read_msg(s).await?.ok_or_else(|| LightningError::Unavailable("connection closed".into()))
    }
}

#[async_trait::async_trait]
impl Transport for Tcp {
    async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        let mut s = self.connection(to).await?;
        match tokio::time::timeout(self.timeout, Self::exchange(&mut s, &req)).await {
            Ok(Ok(r)) => {
                if let Ok(mut p) = self.pool.lock() {
                    let v = p.entry(to).or_default();
                    if v.len() < POOL_PER_PEER {
                        v.push(s);
                    }
                }
                Ok(r)
            }
            Ok(Err(e)) => Err(unreachable(to, &e.to_string())),
            Err(_) => Err(unreachable(to, "request timed out")),
        }
    }

    fn set_peers(&self, peers: HashMap<NodeId, SocketAddr>) {
        if let Ok(mut p) = self.peers.write() {
            *p = peers;
        }
        if let Ok(mut p) = self.pool.lock() {
            p.clear();
        }
    }
}

async fn write_msg<T: serde::Serialize>(s: &mut TcpStream, m: &Msg<T>) -> Result<()> {
    let head = rpc::encode(m)?;
    s.write_all(&head).await?;
    if !m.data.is_empty() {
        s.write_all(&m.data).await?;
    }
    Ok(())
}

async fn read_msg<T: for<'de> serde::Deserialize<'de>>(s: &mut TcpStream) -> Result<Option<Msg<T>>> {
    let mut h = [0u8; 8];
    match s.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let (hl, dl) = rpc::frame_lengths(h)?;
    let mut buf = BytesMut::zeroed(8 + hl + dl);
    buf[..8].copy_from_slice(&h);
    s.read_exact(&mut buf[8..]).await?;
    rpc::decode(&mut buf)
}

/// Serves node-to-node requests on `listener` until the task is aborted.
pub fn serve_tcp(listener: TcpListener, handler: Arc<dyn Handler>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "rpc accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = sock.set_nodelay(true);
            let h = handler.clone();
            tokio::spawn(async move {
                loop {
                    let req: Msg<Req> = match read_msg(&mut sock).await {
                        Ok(Some(r)) => r,
                        Ok(None) => return,
                        Err(e) => {
                            tracing::debug!(error = %e, "bad rpc frame; closing");
                            return;
                        }
                    };
                    let resp = h.handle(req).await;
                    if write_msg(&mut sock, &resp).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}
