//! The server over fault-injecting exports ([`FaultBackend`], compiled for
//! this crate's tests only): a slow request does not hold back later
//! replies, and backend errors reach the client as NBD errnos on a
//! connection that survives them. The same server is driven by real
//! clients in tests/it/nbd/server.rs.

use super::*;
use crate::CoronaError;
use crate::backend::fault::{FaultAction, FaultBackend, FaultOp, FaultRule};
use crate::backend::{AnyBackend, Opener};
use crate::client::NbdClient;
use crate::proto::NbdErrno;
use crate::volume::Volumes;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const SIZE: u64 = 4 << 20;

/// A server on loopback serving one export, `faulty`, under `rules`.
struct FaultServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl FaultServer {
    async fn start(rules: Vec<FaultRule>) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let volumes = Arc::new(Volumes::load(dir.path().to_path_buf(), Opener::Threads, false).expect("volumes"));
        let backend = AnyBackend::Fault(FaultBackend::new(SIZE, rules));
        volumes.insert("faulty", backend, false).expect("insert");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(serve(listener, Arc::new(Shared::new(volumes, Arc::default())), stopped));
        FaultServer { addr, stop, _dir: dir }
    }
}

impl Drop for FaultServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_request_does_not_hold_back_later_replies() {
    let s = FaultServer::start(vec![FaultRule {
        op: FaultOp::Read,
        range: 0..4096,
        action: FaultAction::Delay(Duration::from_millis(600)),
    }])
    .await;
    let client = Arc::new(NbdClient::connect(s.addr, "faulty").await.expect("connect"));
    let slow_client = client.clone();
    let start = Instant::now();
    let slow = tokio::spawn(async move {
        slow_client.read(0, 4096).await.expect("slow read");
        start.elapsed()
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Sent after the slow read, on the same connection; answered first.
    client.write(1 << 20, &[1; 4096], false).await.expect("write");
    client.read(1 << 20, 4096).await.expect("fast read");
    let fast = start.elapsed();
    let slow = slow.await.expect("task");
    assert!(fast < Duration::from_millis(500), "fast requests waited for the slow one: {fast:?}");
    assert!(
        slow >= Duration::from_millis(600) && fast < slow,
        "replies came out of order: fast {fast:?}, slow {slow:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_errors_map_to_nbd_errnos_and_the_connection_survives() {
    let s = FaultServer::start(vec![
        FaultRule { op: FaultOp::Read, range: 0..4096, action: FaultAction::Fail(libc::EIO) },
        FaultRule { op: FaultOp::Write, range: 8192..12288, action: FaultAction::Fail(libc::ENOSPC) },
        FaultRule { op: FaultOp::Flush, range: 0..0, action: FaultAction::Fail(libc::EIO) },
    ])
    .await;
    let client = NbdClient::connect(s.addr, "faulty").await.expect("connect");
    let errno = |r: Result<_, CoronaError>| match r {
        Err(CoronaError::Nbd { errno, .. }) => errno,
        other => panic!("expected an NBD error, got {other:?}"),
    };
    assert_eq!(errno(client.read(0, 512).await.map(|_| ())), NbdErrno::Io);
    assert_eq!(errno(client.write(8192, &[0; 100], false).await), NbdErrno::NoSpc);
    assert_eq!(errno(client.flush().await), NbdErrno::Io);
    client.write(1 << 20, b"still here", false).await.expect("write after errors");
    assert_eq!(client.read(1 << 20, 10).await.expect("read"), b"still here");
}

/// A node holding the export may be down (restarting) while another node,
/// which never held it, answers "no such export": connect_primary then
/// reports the unreachable node, which a reconnecting client retries,
/// rather than the refusal, which it takes as final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_primary_reports_an_unreachable_node_before_another_nodes_unknown_export() {
    let s = FaultServer::start(Vec::new()).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    for nodes in [[dead, s.addr], [s.addr, dead]] {
        let e = NbdClient::connect_primary(&nodes, "elsewhere").await.expect_err("no node serves it");
        assert!(matches!(e, CoronaError::Io(_)), "{e:?}");
    }
    // With every node reachable, the refusal is the answer.
    let e = NbdClient::connect_primary(&[s.addr], "elsewhere").await.expect_err("unknown export");
    assert!(!matches!(e, CoronaError::Io(_) | CoronaError::Disconnected), "{e:?}");
    let (c, at) = NbdClient::connect_primary(&[dead, s.addr], "faulty").await.expect("the live node serves it");
    assert_eq!((at, c.size()), (s.addr, SIZE));
}

/// A node whose kernel accepts the connection but whose process never
/// answers (frozen, SIGSTOP) does not hold connect_primary: after
/// NEGOTIATION_TIMEOUT it counts as unreachable and the next node serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_primary_moves_past_a_node_that_accepts_and_never_negotiates() {
    let s = FaultServer::start(Vec::new()).await;
    // Listening, never accepting: the kernel completes the TCP handshake.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let frozen_addr = frozen.local_addr().expect("addr");
    let t = std::time::Instant::now();
    let (c, at) = NbdClient::connect_primary(&[frozen_addr, s.addr], "faulty").await.expect("the live node serves it");
    assert_eq!((at, c.size()), (s.addr, SIZE));
    let took = t.elapsed();
    assert!(took >= crate::client::NEGOTIATION_TIMEOUT, "{took:?}");
    assert!(took < crate::client::NEGOTIATION_TIMEOUT * 3, "{took:?}");
    // Alone, it is reported as unreachable (retried by a reconnecting client).
    let e = NbdClient::connect_primary(&[frozen_addr], "faulty").await.expect_err("nothing answers");
    assert!(matches!(&e, CoronaError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut), "{e:?}");
    drop(frozen);
}
