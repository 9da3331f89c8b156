//! Failover, end to end: three `coronafs serve` nodes in one process over
//! loopback (NBD, control API and replica RPC), a volume with three copies,
//! the primary lost, a copy promoted by election, the NBD client finding the
//! new primary through the cluster's node list.

use crate::CoronaError;
use crate::api_client::ApiClient;
use crate::client::{NbdClient, failover_hint, primary_hint};
use crate::cluster::ClusterFile;
use crate::config::ServerConfig;
use crate::dto::CreateVolume;
use crate::proto::NbdErrno;
use crate::service::RunningServer;
use std::net::SocketAddr;

const SIZE: u64 = 8 << 20;

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Three nodes in zones z1, z2, z3; `node[i]` is `None` while it is down.
struct Cluster {
    file: ClusterFile,
    cfgs: Vec<ServerConfig>,
    node: Vec<Option<RunningServer>>,
    _dirs: Vec<tempfile::TempDir>,
}

impl Cluster {
    async fn start() -> Self {
        Self::of(super::test_cluster::start_three(3000).await)
    }

    /// With heartbeats every `heartbeat_ms` and automatic failover after
    /// `failover_after_ms` of silence.
    async fn start_timed(heartbeat_ms: u64, failover_after_ms: u64) -> Self {
        Self::of(super::test_cluster::start_three_timed(3000, heartbeat_ms, failover_after_ms).await)
    }

    fn of(t: super::test_cluster::Three) -> Self {
        let node = t.servers.into_iter().map(Some).collect();
        Cluster { file: t.file, cfgs: t.cfgs, node, _dirs: t.dirs }
    }

    fn up(&self, i: usize) -> &RunningServer {
        self.node[i].as_ref().expect("node is up")
    }

    fn api(&self, i: usize) -> ApiClient {
        ApiClient::new(&self.up(i).api_url())
    }

    fn nbd(&self, i: usize) -> SocketAddr {
        self.file.nodes[i].nbd
    }

    async fn kill(&mut self, i: usize) {
        self.node[i].take().expect("node is up").shutdown().await;
    }

    /// Stops node `i` abruptly: its tasks are dropped, its sockets close
    /// without a last FLUSH, nothing is closed cleanly.
    async fn crash(&mut self, i: usize) {
        self.node[i].take().expect("node is up").crash().await;
    }

    async fn restart(&mut self, i: usize) {
        assert!(self.node[i].is_none());
        self.node[i] = Some(crate::service::start(self.cfgs[i].clone()).await.expect("restart"));
    }

    async fn image(&self, i: usize) -> Vec<u8> {
        let e = self.up(i).volumes.open("vm").expect("open");
        let (r, buf) = crate::backend::BlockBackend::read_at(&e.backend, vec![0; SIZE as usize], 0).await;
        r.expect("read");
        buf
    }

    async fn shutdown(mut self) {
        for i in 0..3 {
            if self.node[i].is_some() {
                self.kill(i).await;
            }
        }
    }

    /// A volume `vm` with 3 copies, primary n1, and 8 writes flushed.
    async fn with_volume() -> (Self, NbdClient) {
        Cluster::start().await.volume().await
    }

    async fn volume(self) -> (Self, NbdClient) {
        let c = self;
        let req = CreateVolume { name: "vm".into(), size: Some(SIZE), from_snapshot: None, replicas: Some(3) };
        assert_eq!(c.api(0).create_volume(&req).await.expect("create").replicas, ["n2", "n3"]);
        let client = NbdClient::connect(c.nbd(0), "vm").await.expect("connect to n1");
        for i in 0..8u64 {
            client.write(i * 500_000, &data(300_000, i as u8), false).await.expect("write");
        }
        client.flush().await.expect("flush on 3 of 3");
        (c, client)
    }
}

#[test]
fn a_refusal_names_the_primary_address_the_client_follows() {
    let msg = "vm (vm is a replica on n2; its primary is n1, primary-nbd=127.0.0.1:4000)";
    assert_eq!(primary_hint(msg), Some("127.0.0.1:4000".parse().expect("addr")));
    assert_eq!(primary_hint("vm (no such volume)"), None);
    assert_eq!(primary_hint("primary-nbd=unknown"), None);
    let fenced = "vm;epoch=1 (declares epoch 1, but the volume is fenced at epoch 2; a failover made this node the primary at epoch 2: failover-from=1 failover-epoch=2)";
    assert_eq!(failover_hint(fenced), Some((1, 2)));
    assert_eq!(failover_hint("declares epoch 1, but the volume is fenced at epoch 2"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_primary_dies_a_promoted_copy_serves_every_flushed_byte_and_the_old_primary_is_fenced() {
    let (mut c, client) = Cluster::with_volume().await;
    let flushed = c.image(0).await;
    assert_eq!(flushed[500_000..800_000], data(300_000, 1)[..]);
    // A copy that is not the primary refuses NBD clients, naming the primary.
    let e = NbdClient::connect(c.nbd(1), "vm").await.expect_err("n2 is a replica");
    assert_eq!(primary_hint(&e.to_string()), Some(c.nbd(0)), "{e}");
    let (_, at) = NbdClient::connect_primary(&[c.nbd(2), c.nbd(1), c.nbd(0)], "vm").await.expect("find n1");
    assert_eq!(at, c.nbd(0));
    drop(client);
    c.kill(0).await;

    let v = c.api(1).promote("vm").await.expect("promote n2");
    assert_eq!(v.epoch, 1);
    assert_eq!(v.replicas, ["n1", "n3"]);
    assert_eq!(v.stale_replicas, ["n1"], "n3 was at n2's position, n1 did not vote");
    // A second promote is refused: n2 is the primary now.
    let e = c.api(1).promote("vm").await.expect_err("already primary");
    assert!(e.to_string().contains("already the primary"), "{e}");

    // The client finds the new primary from the node list (n1 down, n3 a
    // replica that names n1 or n2) and reads every flushed byte.
    let (client, at) =
        NbdClient::connect_primary(&[c.nbd(0), c.nbd(2), c.nbd(1)], "vm;epoch=1").await.expect("find n2");
    assert_eq!(at, c.nbd(1));
    let got = client.read(0, SIZE as usize).await.expect("read from n2");
    assert!(got == flushed, "the new primary lacks flushed bytes");
    // New writes and FLUSH succeed on 2 live copies, and reach n3.
    for i in 0..4u64 {
        client.write(i * 700_000 + 4096, &data(100_000, 50 + i as u8), false).await.expect("write on n2");
    }
    client.flush().await.expect("flush on n2 and n3");
    let now = c.image(1).await;
    assert_eq!(now[4096..104_096], data(100_000, 50)[..]);
    assert!(c.image(2).await == now, "n3 differs from the new primary after FLUSH");
    // n3 now names n2 as the primary.
    let e = NbdClient::connect(c.nbd(2), "vm").await.expect_err("n3 is a replica");
    assert_eq!(primary_hint(&e.to_string()), Some(c.nbd(1)), "{e}");

    // The old primary comes back with its old state: its frames (epoch 0)
    // are refused by both copies, so nothing it takes is ever flushed.
    c.restart(0).await;
    let old = NbdClient::connect(c.nbd(0), "vm").await;
    if let Ok(old) = old {
        // Connected before its links learnt it was deposed.
        let _ = old.write(4096, &data(4096, 200), false).await;
        let e = old.flush().await.expect_err("the old primary cannot flush");
        assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
        let e = old.write(8192, &data(4096, 201), true).await.expect_err("nor write with FUA");
        assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Io, .. }), "{e}");
    }
    // Once n3 refused its stream as fenced above it, it knows it was
    // deposed: a client is refused at connect ('not primary') and
    // connect_primary moves on to the new primary instead of landing on
    // a node that answers EIO.
    let t = std::time::Instant::now();
    let refused = loop {
        match NbdClient::connect(c.nbd(0), "vm;epoch=1").await {
            Err(e) => break e,
            Ok(_) => assert!(t.elapsed() < std::time::Duration::from_secs(5), "the deposed n1 still takes clients"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert!(refused.to_string().contains("not primary"), "{refused}");
    let (moved, at) = NbdClient::connect_primary(&[c.nbd(0), c.nbd(2), c.nbd(1)], "vm;epoch=1").await.expect("find n2");
    assert_eq!(at, c.nbd(1), "the client did not move on from the deposed primary");
    drop(moved);
    assert!(c.image(1).await == now, "an old-primary frame reached n2");
    assert!(c.image(2).await == now, "an old-primary frame reached n3");
    drop(client);
    c.shutdown().await;
}

#[tokio::test]
async fn a_copy_votes_once_per_epoch_even_across_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let load = || crate::volume::Volumes::load(dir.path().to_path_buf(), crate::backend::Opener::Threads, false);
    let v = load().expect("volumes");
    v.create("vm", SIZE).await.expect("create");
    assert_eq!(v.vote("vm", 1, "n2").await.errno, 0);
    assert_eq!(v.vote("vm", 1, "n2").await.errno, 0, "the same vote again (a lost answer)");
    assert_eq!(v.vote("vm", 1, "n3").await.errno, libc::EPERM as u32, "a second vote at epoch 1");
    drop(v);
    let v = load().expect("reload");
    let r = v.vote("vm", 1, "n3").await;
    assert_eq!((r.errno, r.epoch), (libc::EPERM as u32, 1), "the restart forgot the vote");
    assert_eq!(r.position, None);
    let r = v.vote("vm", 2, "n3").await;
    assert_eq!((r.errno, r.position), (0, None), "a restarted copy does not know its position");
    assert_eq!(v.info("vm").expect("info").epoch, 2, "the copy is fenced to the epoch it voted at");
    assert_eq!(v.vote("nope", 3, "n3").await.errno, libc::ENOENT as u32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_candidates_racing_for_one_epoch_never_both_win() {
    let (mut c, client) = Cluster::with_volume().await;
    drop(client);
    c.kill(0).await;
    let (a2, a3) = (c.api(1), c.api(2));
    let (r2, r3) = tokio::join!(a2.promote("vm"), a3.promote("vm"));
    let winners = [&r2, &r3].iter().filter(|r| r.is_ok()).count();
    assert!(winners <= 1, "two primaries: {r2:?} {r3:?}");
    for r in [&r2, &r3] {
        if let Err(e) = r {
            assert!(e.to_string().contains("409") || e.to_string().contains("votes"), "{e}");
        }
    }
    if winners == 0 {
        // Each voted for itself at epoch 1; a later election succeeds.
        let v = a2.promote("vm").await.expect("promote n2 at the next epoch");
        assert_eq!(v.epoch, 2);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_out_of_the_in_sync_set_cannot_take_over_and_the_copy_in_sync_does_without_live_laggards() {
    // No resync while n1 lives (a retry once an hour), so n3 stays behind.
    let three = super::test_cluster::start_three_with(3000, 1000, 0, 3_600_000).await;
    let (mut c, client) = Cluster::of(three).volume().await;
    // n3 is taken away from n1's stream without a fence (a fence would
    // tell n1 it was deposed): another stream of the same epoch opened to
    // it supersedes n1's, whose frames it then refuses, so n1 drops it and
    // it misses what follows, knowing its (older) place.
    let target = crate::backend::replicated::link::LinkTarget {
        peer: "n3".into(),
        addr: c.file.nodes[2].replica,
        timeout: std::time::Duration::from_secs(3),
        heartbeat: None,
    };
    let secret = c.up(2).volumes.membership().expect("in a cluster").secret.clone();
    let other = crate::backend::replicated::link::TcpLink::open(&target, &secret, "vm", SIZE, 0, 1)
        .await
        .expect("n3 takes another stream");
    let _ = client.write(0, &data(4096, 9), false).await;
    let _ = client.flush().await;
    client.write(0, &data(65536, 10), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on n1 and n2");
    let flushed = c.image(0).await;
    drop((client, other));
    c.kill(0).await;

    // n1 dropped n3 from the in-sync set before it answered the flush n3
    // missed: the map does not let n3 take over.
    let e = c.api(2).promote("vm").await.expect_err("n3 is behind n2");
    assert!(e.to_string().contains("not in sync"), "{e}");
    let v = c.api(1).promote("vm").await.expect("n2 wins");
    assert_eq!(v.stale_replicas, ["n1", "n3"], "n3 lacks writes, so it is not live");
    let client = NbdClient::connect(c.nbd(1), &format!("vm;epoch={}", v.epoch)).await.expect("connect to n2");
    assert!(client.read(0, SIZE as usize).await.expect("read") == flushed);
    // One live copy of three is below the write quorum of 2 until n2's
    // resync has given n3 a full copy (its history is unknown to n2) and
    // taken it back. A flush meanwhile waits for that catch-up (at most
    // ack_timeout) instead of failing with EIO; then n3 equals n2.
    client.flush().await.expect("the first flush after the promotion waits for n3's catch-up, no EIO");
    assert!(c.image(2).await == c.image(1).await, "n3 rejoined without n2's bytes");
    drop(client);
    c.shutdown().await;
}

/// A listener on `addr` that accepts every connection and never sends or
/// reads a byte: a node whose kernel still takes connections while nothing
/// answers (a hung process), so a connect succeeds and the handshake hangs.
async fn silent_listener(addr: SocketAddr) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(addr).await.expect("bind the dead node's replica address");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_a_flush_waits_only_for_the_live_copys_catch_up_not_behind_the_dead_primary_that_hangs() {
    let ack = std::time::Duration::from_millis(3000);
    let (mut c, client) = Cluster::with_volume().await;
    // n3 misses a flushed write, then restarts once n1 is gone: it does not
    // know its place, so the next primary counts it stale (a full copy).
    c.kill(2).await;
    client.write(0, &data(65_536, 60), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    drop(client);
    c.kill(0).await;
    c.restart(2).await;
    // The old primary's replica address takes connections and never answers.
    let hung = silent_listener(c.file.nodes[0].replica).await;
    let v = c.api(1).promote("vm").await.expect("promote n2 (n1's vote times out)");
    // n2's resync knows its stale copies in the volume's order: n1 first.
    assert_eq!(v.replicas, ["n1", "n3"]);
    assert_eq!(v.stale_replicas, ["n1", "n3"], "n3 restarted, n1 did not vote");
    let client = NbdClient::connect(c.nbd(1), &format!("vm;epoch={}", v.epoch)).await.expect("connect to n2");
    // One live copy of the two the quorum needs: the flush waits for n3's
    // catch-up (8 MiB at the default 64 MiB/s), which must not wait for
    // n1's attempt to time out first (one ack timeout, and the flush's
    // wait is one ack timeout too: EIO).
    let t = std::time::Instant::now();
    client.flush().await.expect("the first flush after the failover: no EIO");
    let took = t.elapsed();
    eprintln!("the first flush after the failover took {took:?} (ack timeout {ack:?})");
    assert!(took < ack, "the flush waited {took:?}: behind n1's attempt");
    let v = c.api(1).get("vm").await.expect("show");
    let n1 = v.replica_states.iter().find(|s| s.node == "n1").expect("n1's state");
    assert_ne!(n1.state, crate::dto::ReplicaSync::InSync, "a node that never answered rejoined");
    client.write(4096, &data(4096, 61), true).await.expect("fua write on n2 and n3");
    assert!(c.image(2).await == c.image(1).await, "n3 differs from the new primary");
    drop(client);
    hung.abort();
    c.shutdown().await;
}

/// Polls `node`'s record of `vm` until it is the primary (it names
/// replicas), for at most `limit`; gives the record and how long it took.
async fn until_primary(
    c: &Cluster,
    node: usize,
    limit: std::time::Duration,
) -> (crate::dto::VolumeInfo, std::time::Duration) {
    let t = std::time::Instant::now();
    loop {
        let v = c.api(node).get("vm").await.expect("record");
        if !v.replicas.is_empty() {
            return (v, t.elapsed());
        }
        assert!(t.elapsed() < limit, "n{} did not become the primary within {limit:?}: {v:?}", node + 1);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_primary_dies_a_copy_promotes_itself_without_an_operator_and_serves_every_flushed_byte() {
    let (mut c, client) = Cluster::start_timed(100, 800).await.volume().await;
    let flushed = c.image(0).await;
    drop(client);
    c.kill(0).await;
    // n2 and n3 are both in sync: the volume map grants the takeover to the
    // first that asks, once n1's lease ran out, and to one only.
    let t = std::time::Instant::now();
    let (p, v) = loop {
        let mut found = Vec::new();
        for i in [1, 2] {
            let v = c.api(i).get("vm").await.expect("record");
            if !v.replicas.is_empty() {
                found.push((i, v));
            }
        }
        assert!(found.len() <= 1, "two primaries: {found:?}");
        if let Some(f) = found.pop() {
            break f;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "no copy took over");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    eprintln!("n{} became the primary {:?} after n1 stopped (failover and lease 800 ms)", p + 1, t.elapsed());
    assert_eq!(v.epoch, 1);
    assert_eq!(v.stale_replicas, ["n1"], "the other copy was at the same place and was fenced with it");
    let other = 3 - p;

    let (client, at) =
        NbdClient::connect_primary(&[c.nbd(0), c.nbd(other), c.nbd(p)], "vm;epoch=1").await.expect("find it");
    assert_eq!(at, c.nbd(p));
    assert!(client.read(0, SIZE as usize).await.expect("read") == flushed, "a flushed byte is missing");
    client.write(12_345, &data(50_000, 77), false).await.expect("write on the new primary");
    client.flush().await.expect("flush on both copies");
    let now = c.image(p).await;
    assert_eq!(now[12_345..62_345], data(50_000, 77)[..]);
    assert!(c.image(other).await == now, "the other copy differs from the new primary after FLUSH");
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_primary_lives_and_idles_its_heartbeats_keep_every_copy_from_standing() {
    let (c, client) = Cluster::start_timed(100, 1000).await.volume().await;
    // Three failover timeouts without a write: only heartbeats cross the links.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    // Each copy heard its primary within the last failover timeout (1 s),
    // and n1 kept renewing its lease: the map still names it primary.
    for i in [1, 2] {
        let heard = c.up(i).volumes.position("vm").is_some();
        assert!(heard, "n{} never took n1's stream", i + 1);
        let m = c.up(i).api_client().cluster_map().await.expect("map");
        let vm = &m.volumes["vm"];
        assert_eq!((vm.primary.as_str(), vm.epoch), ("n1", 0), "{m:?}");
        assert!(vm.renewals >= 4, "n1 renewed its lease only {} times in 3 s: {m:?}", vm.renewals);
    }
    for i in 0..3 {
        let v = c.api(i).get("vm").await.expect("record");
        assert_eq!(v.epoch, 0, "n{} moved to epoch {}", i + 1, v.epoch);
    }
    let p = c.api(0).get("vm").await.expect("n1");
    assert_eq!((p.replicas.len(), p.stale_replicas.len()), (2, 0), "{p:?}");
    assert!(c.api(1).get("vm").await.expect("n2").replicas.is_empty());
    client.write(0, &data(65_536, 3), false).await.expect("write on n1");
    client.flush().await.expect("flush on all three");
    let now = c.image(0).await;
    assert!(c.image(1).await == now && c.image(2).await == now, "a copy missed the write");
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_restarted_does_not_stand_and_the_copy_that_knows_its_place_wins() {
    // No resync while n1 lives (a retry once an hour): n1 would otherwise
    // give the restarted n2 its place back before n1 is stopped, and n2,
    // first by name, would rightly win.
    let three = super::test_cluster::start_three_with(3000, 100, 800, 3_600_000).await;
    let (mut c, client) = Cluster::of(three).volume().await;
    // n2 restarts: it forgets its place, and n1 drops it at the next write.
    c.kill(1).await;
    c.restart(1).await;
    client.write(0, &data(65_536, 20), false).await.expect("write on n1 and n3");
    client.flush().await.expect("flush on n1 and n3");
    let flushed = c.image(0).await;
    drop(client);
    c.kill(0).await;
    // n2 comes first by name, but only n3 knows its place.
    let (v, _) = until_primary(&c, 2, std::time::Duration::from_secs(30)).await;
    assert_eq!(v.epoch, 1);
    // n2 did not know its place, so n3 counted it stale; n3's resync may
    // already have given it a full copy and taken it back (resync_tests.rs).
    assert_eq!(v.stale_replicas.first().map(String::as_str), Some("n1"), "{v:?}");
    assert!(v.stale_replicas.len() == 2 || v.replica_states.iter().any(|s| s.node == "n2"), "{v:?}");
    let n2 = c.api(1).get("vm").await.expect("n2");
    assert!(n2.replicas.is_empty(), "the restarted copy became a primary: {n2:?}");
    let client = NbdClient::connect(c.nbd(2), "vm;epoch=1").await.expect("connect to n3");
    assert!(client.read(0, SIZE as usize).await.expect("read") == flushed, "a flushed byte is missing");
    drop(client);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_volume_deleted_on_its_primary_do_not_promote_themselves() {
    let (c, client) = Cluster::start_timed(100, 500).await.volume().await;
    drop(client);
    c.api(0).delete("vm", true).await.expect("delete on n1");
    // The deletion reaches both copies, and the volume leaves the map: a
    // copy that still ran a watchdog would find nothing to take over.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    for i in [1, 2] {
        let e = c.api(i).get("vm").await.expect_err("the copy is deleted");
        assert!(matches!(e, CoronaError::Api { status: Some(404), .. }), "n{}: {e}", i + 1);
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_rejoins_after_a_fence_takes_the_fenced_epoch_so_the_next_election_lands_above_it() {
    let (mut c, client) = Cluster::with_volume().await;
    drop(client);
    c.api(0).fence("vm", 5).await.expect("fence n1 at epoch 5 (acknowledged by a write quorum)");
    // n3 misses writes and comes back through a resync and a rejoin: links
    // opened after the fence.
    c.kill(2).await;
    let client = NbdClient::connect(c.nbd(0), "vm;epoch=5").await.expect("connect at epoch 5");
    client.write(0, &data(4096, 40), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    c.restart(2).await;
    let t = std::time::Instant::now();
    loop {
        let v = c.api(0).get("vm").await.expect("show");
        if v.stale_replicas.is_empty() && v.replica_states.iter().all(|s| s.state == crate::dto::ReplicaSync::InSync) {
            break;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "n3 did not rejoin: {v:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let p = c.up(2).volumes.position("vm").expect("n3 knows its place after the rejoin");
    assert_eq!(p.epoch, 5, "n3's stream was opened below the fence: {p:?}");
    assert_eq!(c.api(2).get("vm").await.expect("n3").epoch, 5, "n3 did not take the stream's epoch");
    drop(client);
    c.kill(0).await;
    // n3 stands above the fence, and n2 (also at epoch 5) votes for it.
    let v = c.api(2).promote("vm").await.expect("promote n3");
    assert!(v.epoch > 5, "elected at epoch {} at or below a fence that had answered", v.epoch);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_promotes_of_one_copy_at_once_take_office_once() {
    let (mut c, client) = Cluster::with_volume().await;
    drop(client);
    c.kill(0).await;
    let a = c.api(1);
    let (r1, r2) = tokio::join!(a.promote("vm"), a.promote("vm"));
    let won = [&r1, &r2].iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 1, "both or neither took office: {r1:?} {r2:?}");
    let e = [r1, r2].into_iter().find_map(Result::err).expect("one failed");
    assert!(e.to_string().contains("already the primary") || e.to_string().contains("superseded"), "{e}");
    c.shutdown().await;
}

#[test]
fn a_promotion_takes_office_only_while_its_own_vote_stands() {
    use crate::volume::catalog::VolumeRec;
    let voted = |epoch, who: &str| VolumeRec { epoch, voted_for: Some(who.into()), ..Default::default() };
    crate::volume::failover::still_elected("vm", &voted(3, "n2"), 3, "n2").expect("its vote stands");
    // While its ballots were out, the copy voted for n3 at a later epoch.
    let e = crate::volume::failover::still_elected("vm", &voted(4, "n3"), 3, "n2").expect_err("superseded");
    assert!(e.to_string().contains("superseded"), "{e}");
    let e = crate::volume::failover::still_elected("vm", &voted(3, "n3"), 3, "n2").expect_err("not its vote");
    assert!(e.to_string().contains("superseded"), "{e}");
    let primary = VolumeRec { replicas: vec!["n1".into()], ..voted(3, "n2") };
    let e = crate::volume::failover::still_elected("vm", &primary, 3, "n2").expect_err("in office");
    assert!(e.to_string().contains("already the primary"), "{e}");
}

#[tokio::test]
async fn a_copy_whose_data_cannot_be_made_durable_does_not_vote() {
    use crate::backend::fault::{FaultAction, FaultBackend, FaultOp, FaultRule};
    let dir = tempfile::tempdir().expect("tempdir");
    let v = crate::volume::Volumes::load(dir.path().to_path_buf(), crate::backend::Opener::Threads, false)
        .expect("volumes");
    v.create("vm", SIZE).await.expect("create");
    // The copy as the replica listener holds it open, with a flush that fails.
    let fail = FaultRule { op: FaultOp::Flush, range: 0..SIZE, action: FaultAction::Fail(libc::EIO) };
    let b = FaultBackend::new(SIZE, vec![fail]);
    v.insert("vm", crate::backend::AnyBackend::Fault(b), false).expect("replace the open copy");
    let r = v.vote("vm", 1, "n2").await;
    assert_eq!(r.errno, libc::EIO as u32, "voted with data that may not survive a power loss: {r:?}");
    // With a flush that works, the same vote (a retry) is granted.
    let b = FaultBackend::new(SIZE, Vec::new());
    v.insert("vm", crate::backend::AnyBackend::Fault(b), false).expect("replace the open copy");
    assert_eq!(v.vote("vm", 1, "n2").await.errno, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_took_a_stream_at_an_epoch_refuses_streams_of_older_epochs_even_after_a_restart() {
    use crate::backend::replicated::link::{LinkTarget, TcpLink};
    let (mut c, client) = Cluster::with_volume().await;
    drop(client);
    let secret = c.up(2).volumes.membership().expect("in a cluster").secret.clone();
    let target = LinkTarget {
        peer: "n3".into(),
        addr: c.file.nodes[2].replica,
        timeout: std::time::Duration::from_secs(3),
        heartbeat: None,
    };
    // A primary elected at epoch 4 without n3's vote opens a stream to it.
    let newer = TcpLink::open(&target, &secret, "vm", SIZE, 4, 1).await.expect("n3 takes the epoch-4 stream");
    assert_eq!(c.api(2).get("vm").await.expect("n3").epoch, 4, "n3 did not take the stream's epoch");
    // The deposed primary (epoch 0) can no longer open a stream to n3, to
    // resync it or otherwise: it cannot win n3 back into its live set.
    let e = TcpLink::open(&target, &secret, "vm", SIZE, 0, 1).await.err().expect("an epoch-0 stream is refused");
    assert!(e.to_string().contains("refused"), "{e}");
    drop(newer);
    c.kill(2).await;
    c.restart(2).await;
    assert!(TcpLink::open(&target, &secret, "vm", SIZE, 0, 1).await.is_err(), "the restart forgot the epoch");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_sent_to_a_copy_fences_the_primary() {
    let (c, client) = Cluster::with_volume().await;
    let v = c.api(1).fence("vm", 3).await.expect("fence through n2");
    assert_eq!(v.epoch, 3, "{v:?}");
    assert_eq!(c.api(0).get("vm").await.expect("n1").epoch, 3, "the primary was not fenced");
    // The client of epoch 0 may no longer write on the primary.
    let e = client.write(0, &data(4096, 1), false).await.expect_err("a fenced client wrote");
    assert!(matches!(e, CoronaError::Nbd { errno: NbdErrno::Perm, .. }), "{e}");
    // Every copy is still in the stream: a client of epoch 3 flushes on 3 of 3.
    let now = NbdClient::connect(c.nbd(0), "vm;epoch=3").await.expect("connect at epoch 3");
    now.write(0, &data(4096, 2), true).await.expect("fua write at epoch 3");
    assert!(c.api(0).get("vm").await.expect("n1").stale_replicas.is_empty());
    // Going back is refused through a copy as on the primary.
    let e = c.api(2).fence("vm", 2).await.expect_err("an epoch never goes back");
    assert!(e.to_string().contains("409"), "{e}");
    drop((client, now));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_stale_and_in_sync_records_land_in_the_order_they_happened() {
    let (c, client) = Cluster::with_volume().await;
    drop(client);
    // n1's stale list once it stayed the same for a second (the queue of
    // record changes drained; each change is a commit of its own).
    async fn settled(c: &Cluster) -> Vec<String> {
        let t = std::time::Instant::now();
        let (mut last, mut since) = (None, std::time::Instant::now());
        loop {
            let now = c.api(0).get("vm").await.expect("n1").stale_replicas;
            if last.as_ref() != Some(&now) {
                (last, since) = (Some(now), std::time::Instant::now());
            } else if since.elapsed() > std::time::Duration::from_secs(1) {
                return now;
            }
            assert!(t.elapsed() < std::time::Duration::from_secs(30), "the record never settled");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let hook = c.up(0).volumes.state_recorder("vm");
    for _ in 0..20 {
        hook("n3", false);
        hook("n3", true);
    }
    assert!(settled(&c).await.is_empty(), "a late 'stale' overwrote the newer 'in sync'");
    hook("n3", true);
    hook("n3", false);
    assert_eq!(settled(&c).await, ["n3"], "a late 'in sync' overwrote the newer 'stale'");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_primary_crashes_under_writes_a_copy_takes_over_with_every_flushed_byte() {
    let (mut c, client) = Cluster::start_timed(100, 800).await.volume().await;
    // Flushed writes, then writes answered but never flushed.
    client.write(1_000_000, &data(200_000, 90), false).await.expect("write");
    client.flush().await.expect("flush on 3 of 3");
    let flushed = c.image(0).await;
    for i in 0..16u64 {
        let _ = client.write(i * 400_000, &data(4096, 100 + i as u8), false).await;
    }
    drop(client);
    // No goodbye: no last FLUSH, no clean close, sockets dropped.
    c.crash(0).await;
    // The copy furthest in the stream stands (n2 when both are equal).
    let t = std::time::Instant::now();
    let (p, v) = loop {
        let mut found = None;
        for i in [1, 2] {
            let v = c.api(i).get("vm").await.expect("record");
            if !v.replicas.is_empty() {
                found = Some((i, v));
            }
        }
        if let Some(f) = found {
            break f;
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "no copy took over");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    eprintln!("n{} became the primary {:?} after n1 crashed", p + 1, t.elapsed());
    assert!(v.epoch >= 1, "{v:?}");
    let export = format!("vm;epoch={}", v.epoch);
    let (client, at) =
        NbdClient::connect_primary(&[c.nbd(0), c.nbd(1), c.nbd(2)], &export).await.expect("find the primary");
    assert_eq!(at, c.nbd(p));
    let got = client.read(0, SIZE as usize).await.expect("read");
    assert_eq!(got[1_000_000..1_200_000], flushed[1_000_000..1_200_000], "a flushed byte is missing");
    // Writes go on; a flush succeeds once the other copy is live (at once
    // if it was at the same place, else after its full copy).
    client.write(5000, &data(8192, 7), false).await.ok();
    let t = std::time::Instant::now();
    loop {
        match client.flush().await {
            Ok(()) => break,
            Err(CoronaError::Nbd { errno: NbdErrno::Io, .. }) => {}
            Err(e) => panic!("a flush failed otherwise than below the quorum: {e}"),
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(30), "the other copy never came back");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    client.write(5000, &data(8192, 7), true).await.expect("fua write on 2 of 3");
    let other = 3 - p;
    assert!(c.image(other).await == c.image(p).await, "the other copy differs from the new primary");
    drop(client);
    c.shutdown().await;
}
