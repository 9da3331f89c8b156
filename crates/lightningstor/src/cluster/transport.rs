//! The transport between nodes: a small trait ([`Transport`], and
//! [`Handler`] for the receiving node) with a TCP implementation. The
//! in-process transport (a cluster inside one test process) and the
//! fault-injecting wrapper that drops, delays and partitions its traffic
//! are test doubles outside this crate (`testkit::lightningstor`), over the
//! same traits.

use super::NodeId;
use super::auth::{self, RpcSecret};
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

/// TCP transport: pooled connections, one request at a time per connection,
/// each opened with the mutual [`auth`] handshake.
pub struct Tcp {
    peers: RwLock<HashMap<NodeId, SocketAddr>>,
    pool: Mutex<HashMap<NodeId, Vec<TcpStream>>>,
    timeout: Duration,
    secret: RpcSecret,
}

/// Time a peer has to complete the handshake (a connection that stalls in
/// it is closed, so it cannot hold a listener's resources).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The caller's side of the handshake ([`auth`]).
async fn handshake_as_caller(s: &mut TcpStream, secret: &RpcSecret) -> Result<()> {
    Ok(svc_kit::rpc_auth::io::as_caller(s, &auth::PROTOCOL, secret).await?)
}

/// The listener's side of the handshake ([`auth`]).
async fn handshake_as_listener(s: &mut TcpStream, secret: &RpcSecret) -> Result<()> {
    Ok(svc_kit::rpc_auth::io::as_listener(s, &auth::PROTOCOL, secret).await?)
}

/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 32;

impl Tcp {
    /// A transport to `peers`, authenticated with `secret`; each call must
    /// finish within `timeout`.
    pub fn new(peers: HashMap<NodeId, SocketAddr>, timeout: Duration, secret: RpcSecret) -> Self {
        Tcp { peers: RwLock::new(peers), pool: Mutex::new(HashMap::new()), timeout, secret }
    }

    /// A pooled connection to `to`, if one is idle.
    fn pooled(&self, to: NodeId) -> Option<TcpStream> {
        self.pool.lock().ok().and_then(|mut p| p.get_mut(&to).and_then(Vec::pop))
    }

    /// A new, authenticated connection to `to`.
    async fn connection(&self, to: NodeId) -> Result<TcpStream> {
        let addr = self
            .peers
            .read()
            .ok()
            .and_then(|p| p.get(&to).copied())
            .ok_or_else(|| unreachable(to, "no address in the layout"))?;
        let mut s = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(addr))
            .await
            .map_err(|_| unreachable(to, "connect timed out"))?
            .map_err(|e| unreachable(to, &e.to_string()))?;
        let _ = s.set_nodelay(true);
        tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake_as_caller(&mut s, &self.secret))
            .await
            .map_err(|_| unreachable(to, "rpc handshake timed out"))?
            .map_err(|e| unreachable(to, &e.to_string()))?;
        Ok(s)
    }

    fn put_back(&self, to: NodeId, s: TcpStream) {
        if let Ok(mut p) = self.pool.lock() {
            let v = p.entry(to).or_default();
            if v.len() < POOL_PER_PEER {
                v.push(s);
            }
        }
    }

    /// Sends `req` and reads the answer; `None` when the peer closed the
    /// connection (between frames) instead of answering.
    async fn exchange(s: &mut TcpStream, req: &Msg<Req>) -> Result<Option<Msg<Resp>>> {
        write_msg(s, req).await?;
        read_msg(s).await
    }
}

#[async_trait::async_trait]
impl Transport for Tcp {
    async fn call(&self, to: NodeId, req: Msg<Req>) -> Result<Msg<Resp>> {
        let mut s = match self.pooled(to) {
            Some(mut s) => match tokio::time::timeout(self.timeout, Self::exchange(&mut s, &req)).await {
                Ok(Ok(Some(r))) => {
                    self.put_back(to, s);
                    return Ok(r);
                }
                // An idle connection the peer closed (it restarted, or
                // dropped it): the others idle to it went the same way, and
                // the request goes once more on a new connection. Requests
                // are idempotent (versioned rows, content-addressed blocks,
                // token leases), so a peer that did take it before the
                // connection broke takes it again harmlessly.
                Ok(Ok(None) | Err(_)) => {
                    if let Ok(mut p) = self.pool.lock() {
                        p.remove(&to);
                    }
                    self.connection(to).await?
                }
                Err(_) => return Err(unreachable(to, "request timed out")),
            },
            None => self.connection(to).await?,
        };
        match tokio::time::timeout(self.timeout, Self::exchange(&mut s, &req)).await {
            Ok(Ok(Some(r))) => {
                self.put_back(to, s);
                Ok(r)
            }
            // A peer that took the handshake on this new connection, read
            // the request and closed the connection without an answer:
            // what a node of a build before `Resp::Unsupported` does with
            // a request it cannot decode (a newer node's, during a rolling
            // upgrade). Typed as such, so the caller may fall back to an
            // older request; a node that died just then fails that too.
            Ok(Ok(None)) => Err(LightningError::UnsupportedRequest(format!(
                "node {to} closed the connection on the request without an answer (a node of an older build \
                 does that with a request it cannot decode)"
            ))),
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
    match read_frame(s).await? {
        Some(mut buf) => rpc::decode(&mut buf),
        None => Ok(None),
    }
}

/// One whole frame (header, head and data), not yet decoded; `None` when
/// the peer closed the connection between frames.
async fn read_frame(s: &mut TcpStream) -> Result<Option<BytesMut>> {
    let mut h = [0u8; 8];
    match s.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let (hl, dl) = rpc::frame_lengths(h)?;
    // Read into the buffer's spare capacity: no zeroing of a block's
    // megabyte before it is overwritten, and never past this frame.
    let mut buf = BytesMut::with_capacity(8 + hl + dl);
    buf.extend_from_slice(&h);
    let mut rest = AsyncReadExt::take(&mut *s, (hl + dl) as u64);
    while buf.len() < 8 + hl + dl {
        if rest.read_buf(&mut buf).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    Ok(Some(buf))
}

/// Serves node-to-node requests on `listener` until the task is aborted.
/// A connection whose peer fails the [`auth`] handshake is closed before
/// any request of it is read.
pub fn serve_tcp(listener: TcpListener, handler: Arc<dyn Handler>, secret: RpcSecret) -> tokio::task::JoinHandle<()> {
    let secret = Arc::new(secret);
    tokio::spawn(async move {
        loop {
            let (mut sock, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "rpc accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = sock.set_nodelay(true);
            let h = handler.clone();
            let secret = secret.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake_as_listener(&mut sock, &secret)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "rpc connection refused");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(%peer, "rpc connection refused: handshake timed out");
                        return;
                    }
                }
                loop {
                    let mut frame = match read_frame(&mut sock).await {
                        Ok(Some(f)) => f,
                        Ok(None) => return,
                        Err(e) => {
                            tracing::debug!(error = %e, "bad rpc frame; closing");
                            return;
                        }
                    };
                    // The header and the head's first bytes (its variant
                    // number), for the answer to an unknown request.
                    let start = frame[..frame.len().min(16)].to_vec();
                    // A whole frame whose head is no request of this build
                    // (a newer node's, during a rolling upgrade) is
                    // answered Unsupported: the stream is still in step,
                    // and the caller can fall back to an older request.
                    let resp = match rpc::decode::<Req>(&mut frame) {
                        Ok(Some(req)) => h.handle(req).await,
                        Ok(None) | Err(_) => {
                            let resp = rpc::unsupported(&start);
                            tracing::debug!(%peer, answer = ?resp, "rpc request this build does not know");
                            Msg::new(resp)
                        }
                    };
                    if write_msg(&mut sock, &resp).await.is_err() {
                        return;
                    }
                }
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster secret and a loopback listener for a test peer.
    async fn peer() -> (RpcSecret, TcpListener, std::net::SocketAddr) {
        let secret = RpcSecret::random().expect("secret");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        (secret, listener, addr)
    }

    #[tokio::test]
    async fn a_call_over_an_idle_connection_the_peer_closed_goes_again_on_a_new_one() {
        let (secret, listener, addr) = peer().await;
        let theirs = secret.clone();
        // A peer that answers one request per connection, then closes it
        // (as a restarted node has closed every connection to its old self).
        let peer = tokio::spawn(async move {
            for _ in 0..2 {
                let (mut s, _) = listener.accept().await.expect("accept");
                handshake_as_listener(&mut s, &theirs).await.expect("handshake");
                let _req: Msg<Req> = read_msg(&mut s).await.expect("read").expect("a request");
                write_msg(&mut s, &Msg::new(Resp::Ok)).await.expect("answer");
            }
        });
        let t = Tcp::new(HashMap::from([(1, addr)]), Duration::from_secs(5), secret);
        assert_eq!(t.call(1, Msg::new(Req::Ping)).await.expect("first call").head, Resp::Ok);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = t.call(1, Msg::new(Req::Ping)).await;
        assert_eq!(second.expect("the call over the closed pooled connection goes again").head, Resp::Ok);
        tokio::time::timeout(Duration::from_secs(5), peer).await.expect("two connections").expect("peer");
    }

    /// A request of a newer build (a variant this build does not know),
    /// as a node sends it during a rolling upgrade, is answered with the
    /// typed `Unsupported`, and the connection goes on serving.
    #[tokio::test]
    async fn a_request_this_build_cannot_decode_is_answered_unsupported_and_the_connection_stays() {
        struct Answers;
        #[async_trait::async_trait]
        impl Handler for Answers {
            async fn handle(&self, _req: Msg<Req>) -> Msg<Resp> {
                Msg::new(Resp::Ok)
            }
        }
        let (secret, listener, addr) = peer().await;
        let server = serve_tcp(listener, Arc::new(Answers), secret.clone());
        let mut s = TcpStream::connect(addr).await.expect("connect");
        handshake_as_caller(&mut s, &secret).await.expect("handshake");
        // Variant 200 (varint C8 01) with a string field, and a data part.
        let head = [0xC8u8, 0x01, 3, b'a', b'b', b'c'];
        let mut frame = Vec::new();
        frame.extend_from_slice(&(head.len() as u32).to_le_bytes());
        frame.extend_from_slice(&4u32.to_le_bytes());
        frame.extend_from_slice(&head);
        frame.extend_from_slice(b"data");
        s.write_all(&frame).await.expect("send");
        let answer: Msg<Resp> = tokio::time::timeout(Duration::from_secs(5), read_msg(&mut s))
            .await
            .expect("answered in time")
            .expect("read")
            .expect("an answer, not a closed connection");
        match &answer.head {
            Resp::Unsupported(m) => assert!(m.contains("200"), "{m}"),
            other => panic!("answered {other:?}"),
        }
        assert!(matches!(answer.ok(), Err(LightningError::UnsupportedRequest(_))));
        write_msg(&mut s, &Msg::new(Req::Ping)).await.expect("send ping");
        let pong: Msg<Resp> = read_msg(&mut s).await.expect("read").expect("answer");
        assert_eq!(pong.head, Resp::Ok, "the connection still serves");
        server.abort();
    }

    /// A node of a build before `Resp::Unsupported` reads a request it
    /// cannot decode and closes the connection: on a new connection that
    /// is the typed UnsupportedRequest, so callers can fall back.
    #[tokio::test]
    async fn a_peer_that_closes_a_new_connection_on_a_request_gives_unsupported_request() {
        let (secret, listener, addr) = peer().await;
        let theirs = secret.clone();
        let peer = tokio::spawn(async move {
            for _ in 0..2 {
                let (mut s, _) = listener.accept().await.expect("accept");
                handshake_as_listener(&mut s, &theirs).await.expect("handshake");
                let _frame = read_frame(&mut s).await.expect("read").expect("a request");
            }
        });
        let t = Tcp::new(HashMap::from([(1, addr)]), Duration::from_secs(5), secret);
        let keys = vec![("b".to_owned(), serde_bytes::ByteBuf::from(b"k".to_vec()))];
        let e = t.call(1, Msg::new(Req::RowVersions { keys })).await.expect_err("no answer");
        assert!(matches!(e, LightningError::UnsupportedRequest(_)), "{e:?}");
        peer.abort();
    }
}
