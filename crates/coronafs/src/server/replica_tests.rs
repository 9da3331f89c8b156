//! Three nodes in one process over loopback TCP: the primary serves NBD
//! over a replicated backend, the two others run the replica listener on
//! file-backed volumes. Writes go through the real NBD client and server.

use super::*;
use crate::CoronaError;
use crate::backend::memory::MemBackend;
use crate::backend::replicated::link::{LinkTarget, ReplicaLink, TcpLink};
use crate::backend::replicated::{DEFAULT_ACK_TIMEOUT, DynBackend, Replicated, ReplicationPolicy};
use crate::backend::{AnyBackend, BlockBackend, Opener};
use crate::client::NbdClient;
use crate::metrics::Metrics;
use crate::proto::NbdErrno;
use crate::replica::auth::RpcSecret;
use crate::volume::Volumes;
use std::net::SocketAddr;
use std::time::Duration;

const SIZE: u64 = 8 << 20;

/// A replica node: its volumes and its replica listener.
struct ReplicaNode {
    volumes: Arc<Volumes>,
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl ReplicaNode {
    async fn start(secret: &RpcSecret) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let volumes = Arc::new(Volumes::load(dir.path().to_path_buf(), Opener::Threads, false).expect("volumes"));
        volumes.create("vol", SIZE).await.expect("create the replica's copy");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(replica::serve(listener, volumes.clone(), secret.clone(), stopped));
        ReplicaNode { volumes, addr, stop, _dir: dir }
    }

    async fn image(&self) -> Vec<u8> {
        let e = self.volumes.open("vol").expect("open");
        let (r, buf) = e.backend.read_at(vec![0; SIZE as usize], 0).await;
        r.expect("read");
        buf
    }

    /// The node dies: its listener and every replica connection close.
    fn kill(&self) {
        let _ = self.stop.send(true);
    }

    fn target(&self, peer: &str) -> LinkTarget {
        LinkTarget { peer: peer.to_owned(), addr: self.addr, timeout: Duration::from_secs(5), heartbeat: None }
    }
}

/// The primary, NBD on loopback, replicated to `replicas`.
struct Primary {
    nbd: SocketAddr,
    volumes: Arc<Volumes>,
    metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

impl Primary {
    async fn start(secret: &RpcSecret, replicas: &[&ReplicaNode]) -> Self {
        let mut links: Vec<Arc<dyn ReplicaLink>> = Vec::new();
        for (i, r) in replicas.iter().enumerate() {
            let link =
                TcpLink::open(&r.target(&format!("node{}", i + 2)), secret, "vol", SIZE, 0, 1).await.expect("link");
            links.push(Arc::new(link));
        }
        let metrics = Arc::new(Metrics::default());
        let policy = ReplicationPolicy { write_quorum: 2, epoch: 0, ack_timeout: DEFAULT_ACK_TIMEOUT };
        let local = DynBackend::new(AnyBackend::Memory(MemBackend::new(SIZE)));
        let backend = AnyBackend::Replicated(Box::new(Replicated::new(local, links, policy, 1, metrics.clone())));
        let dir = tempfile::tempdir().expect("tempdir");
        let volumes = Arc::new(Volumes::load(dir.path().to_path_buf(), Opener::Threads, false).expect("volumes"));
        volumes.insert("vol", backend, false).expect("insert");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let nbd = listener.local_addr().expect("addr");
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(serve(listener, Arc::new(Shared::new(volumes.clone(), metrics.clone())), stopped));
        Primary { nbd, volumes, metrics, stop, _dir: dir }
    }

    async fn image(&self) -> Vec<u8> {
        let e = self.volumes.open("vol").expect("open");
        let (r, buf) = e.backend.read_at(vec![0; SIZE as usize], 0).await;
        r.expect("read");
        buf
    }
}

impl Drop for Primary {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

async fn three_nodes() -> (RpcSecret, ReplicaNode, ReplicaNode, Primary) {
    let secret = RpcSecret::random().expect("secret");
    let b = ReplicaNode::start(&secret).await;
    let c = ReplicaNode::start(&secret).await;
    let a = Primary::start(&secret, &[&b, &c]).await;
    (secret, b, c, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_nbd_are_on_every_replica_after_flush() {
    let (_s, b, c, a) = three_nodes().await;
    let client = Arc::new(NbdClient::connect(a.nbd, "vol").await.expect("connect"));
    // 64 writes in flight at once, of assorted sizes.
    let mut tasks = Vec::new();
    for i in 0..64u64 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            client.write(i * 120_000, &data(4096 + (i as usize * 1531) % 100_000, i as u8), false).await
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("write");
    }
    client.write_zeroes(10_000, 50_000, 0).await.expect("write_zeroes");
    client.trim(1 << 20, 65536).await.expect("trim");
    client.flush().await.expect("flush");
    let want = a.image().await;
    assert!(want.iter().filter(|&&x| x != 0).count() > 1 << 20, "the writes reached the primary");
    assert!(b.image().await == want, "replica b differs after FLUSH");
    assert!(c.image().await == want, "replica c differs after FLUSH");
    // A FUA write is on both replicas when it is answered.
    client.write(3 << 20, &data(70_000, 99), true).await.expect("fua write");
    for r in [&b, &c] {
        assert_eq!(r.image().await[3 << 20..(3 << 20) + 70_000], data(70_000, 99)[..]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_dead_replica_of_three_is_dropped_and_writes_go_on() {
    let (_s, b, c, a) = three_nodes().await;
    let client = NbdClient::connect(a.nbd, "vol").await.expect("connect");
    client.write(0, &data(8192, 1), false).await.expect("write");
    client.flush().await.expect("flush");
    b.kill();
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..20u64 {
        client.write(i * 8192, &data(8192, i as u8 + 2), false).await.expect("write on 2 of 3");
    }
    client.flush().await.expect("flush on 2 of 3");
    assert_eq!(c.image().await, a.image().await, "the live replica has everything flushed");
    assert_eq!(a.metrics.replicas_dropped.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_dead_writes_fail_and_none_is_acknowledged() {
    let (_s, b, c, a) = three_nodes().await;
    let client = NbdClient::connect(a.nbd, "vol").await.expect("connect");
    client.write(0, &data(8192, 1), true).await.expect("fua write on 3 of 3");
    b.kill();
    c.kill();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = a.image().await;
    // The first request may still be queued before the links notice; the
    // FLUSH that follows can never succeed, and after it nothing can.
    let first = client.write(0, &data(8192, 2), false).await;
    let e = client.flush().await.expect_err("flush on 1 of 3");
    assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
    for fua in [false, true] {
        let e = client.write(65536, &data(4096, 3), fua).await.expect_err("write on 1 of 3");
        assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
    }
    let after = a.image().await;
    assert_eq!(after[65536..65536 + 4096], before[65536..65536 + 4096], "a refused write reached the primary");
    if first.is_err() {
        assert_eq!(after, before);
    }
    assert_eq!(client.read(0, 4).await.expect("reads still work").len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_secret_is_refused_both_ways() {
    let secret = RpcSecret::random().expect("secret");
    let b = ReplicaNode::start(&secret).await;
    let rogue = RpcSecret::random().expect("rogue secret");
    // A rogue primary cannot open the replica's volume.
    let e = TcpLink::open(&b.target("b"), &rogue, "vol", SIZE, 0, 1).await.expect_err("refused");
    assert!(e.to_string().contains("rpc_secret"), "{e}");
    // A rogue that skips the handshake and sends frames gets nothing applied.
    let mut s = tokio::net::TcpStream::connect(b.addr).await.expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut hello = [0u8; crate::replica::auth::HELLO_LEN];
    s.read_exact(&mut hello).await.expect("hello");
    let w = crate::replica::wire::Msg {
        seq: 1,
        epoch: 0,
        body: crate::replica::wire::Body::Write { offset: 0, data: bytes::Bytes::from(vec![0xFF; 64]) },
    };
    let (h, p) = w.encode();
    let mut junk = vec![0u8; crate::replica::auth::ANSWER_LEN];
    junk.extend_from_slice(&h);
    junk.extend_from_slice(&p);
    let _ = s.write_all(&junk).await;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await.expect("closed");
    assert!(rest.is_empty(), "the listener answered a caller without the secret");
    assert!(b.image().await.iter().all(|&x| x == 0), "a rogue frame was applied");
    // A rogue listener cannot pose as a replica to a real primary.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        if let Ok((mut s, _)) = listener.accept().await {
            let _ = replica::handshake_as_listener(&mut s, &rogue).await;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let target = LinkTarget { peer: "rogue".into(), addr, timeout: Duration::from_secs(5), heartbeat: None };
    assert!(TcpLink::open(&target, &secret, "vol", SIZE, 0, 1).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_refuses_a_volume_it_lacks_or_of_another_size() {
    let secret = RpcSecret::random().expect("secret");
    let b = ReplicaNode::start(&secret).await;
    let e = TcpLink::open(&b.target("b"), &secret, "nope", SIZE, 0, 1).await.expect_err("no such volume");
    assert!(e.to_string().contains("refused volume \"nope\""), "{e}");
    assert!(TcpLink::open(&b.target("b"), &secret, "vol", SIZE + 4096, 0, 1).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_with_three_copies_made_through_the_api_replicates_and_keeps_its_quorum_across_restarts() {
    let super::test_cluster::Three { cfgs, mut servers, dirs: _dirs, .. } =
        super::test_cluster::start_three(5000).await;
    let api = crate::api_client::ApiClient::new(&servers[0].api_url());
    let req = crate::dto::CreateVolume { name: "vm".into(), size: Some(SIZE), from_snapshot: None, replicas: Some(3) };
    let v = api.create_volume(&req).await.expect("create with 3 copies");
    assert_eq!(v.replicas, ["n2", "n3"]);
    for s in &servers[1..] {
        assert_eq!(s.volumes.info("vm").expect("the copy exists").size, SIZE);
    }
    let too_many = crate::dto::CreateVolume { name: "big".into(), replicas: Some(4), ..req.clone() };
    let e = api.create_volume(&too_many).await.expect_err("4 copies on 3 nodes");
    assert!(e.to_string().contains("3 nodes"), "{e}");
    assert!(servers[1].volumes.info("big").is_err(), "a refused create left no copy behind");
    // A shrink could leave a copy that missed it with bytes past the end:
    // refused (growth, flatten and clones: copies_tests.rs).
    let e = api.resize("vm", SIZE / 2, true).await.expect_err("shrink of a replicated volume");
    assert!(e.to_string().contains("replicated"), "{e}");

    let client = NbdClient::connect(servers[0].nbd_addr, "vm").await.expect("connect");
    for i in 0..16u64 {
        client.write(i * 300_000, &data(200_000, i as u8), false).await.expect("write");
    }
    client.flush().await.expect("flush");
    let image = |s: &crate::service::RunningServer| {
        let e = s.volumes.open("vm").expect("open");
        async move {
            let (r, buf) = e.backend.read_at(vec![0; SIZE as usize], 0).await;
            r.expect("read");
            buf
        }
    };
    let want = image(&servers[0]).await;
    assert_eq!(want[300_000..500_000], data(200_000, 1)[..]);
    for s in &servers[1..] {
        assert!(image(s).await == want, "a copy differs after FLUSH");
    }
    // Node 3 goes away: the primary goes on with 2 of 3 and records n3 as
    // stale, so it is not linked as live when the volume reopens.
    servers.pop().expect("node 3").shutdown().await;
    client.write(0, &data(4096, 77), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    let mut stale = Vec::new();
    for _ in 0..100 {
        stale = servers[0].volumes.info("vm").expect("info").stale_replicas;
        if !stale.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stale, ["n3"]);
    assert_eq!(image(&servers[1]).await, image(&servers[0]).await);

    // Node 2 goes too: 1 of 3 is below the quorum, nothing more is taken.
    servers.pop().expect("node 2").shutdown().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = client.write(0, &data(4096, 78), false).await;
    let e = client.flush().await.expect_err("flush on 1 of 3");
    assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
    drop(client);
    let primary = servers.pop().expect("node 1");
    for _ in 0..100 {
        if primary.volumes.info("vm").expect("info").stale_replicas.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(primary.volumes.info("vm").expect("info").stale_replicas, ["n3", "n2"]);

    // After a restart the primary links to neither stale copy, so it still
    // refuses writes: the floor holds across restarts.
    primary.shutdown().await;
    let primary = crate::service::start(cfgs[0].clone()).await.expect("restart");
    let client = NbdClient::connect(primary.nbd_addr, "vm").await.expect("connect after restart");
    let e = client.write(8192, &data(4096, 79), false).await.expect_err("write with both replicas stale");
    assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
    assert_eq!(client.read(300_000, 16).await.expect("read")[..], data(200_000, 1)[..16]);
    drop(client);
    primary.shutdown().await;
}
