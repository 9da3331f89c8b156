//! Repeated failures of a replicated volume under the volume map: three
//! `coronafs serve` nodes in one process over loopback (heartbeat 100 ms,
//! failover and lease 800 ms, resync retried every 200 ms), a volume `vm`
//! with three copies. The primary is crashed (no last FLUSH, sockets
//! dropped) and restarted again and again; each time a copy in sync takes
//! over, the old primary comes back as a replica by itself and is caught
//! up, and no flushed byte is lost.

use super::test_cluster::{Three, start_three_with};
use crate::client::NbdClient;
use crate::dto::CreateVolume;
use crate::error::CoronaError;
use crate::proto::NbdErrno;
use crate::service::RunningServer;
use std::time::{Duration, Instant};

const SIZE: u64 = 8 << 20;
const LIMIT: Duration = Duration::from_secs(30);

struct Nodes {
    t: Three,
    up: Vec<Option<RunningServer>>,
}

fn block(writer: u8, round: u8) -> Vec<u8> {
    (0..65_536u32).map(|i| (i as u8).wrapping_mul(13) ^ writer.wrapping_add(round.wrapping_mul(37))).collect()
}

impl Nodes {
    async fn start() -> Nodes {
        let mut t = start_three_with(3_000, 100, 800, 200).await;
        let up = t.servers.drain(..).map(Some).collect();
        Nodes { t, up }
    }

    /// The nodes, `vm` with 3 copies made on n1, and round 0 written and
    /// flushed; the blocks each writer slot holds now.
    async fn with_volume() -> (Nodes, Vec<Vec<u8>>) {
        let c = Nodes::start().await;
        let req = CreateVolume { name: "vm".into(), size: Some(SIZE), from_snapshot: None, replicas: Some(3) };
        c.up(0).api_client().create_volume(&req).await.expect("create");
        let mut expect = vec![Vec::new(); 8];
        c.write_round(0, &mut expect).await;
        (c, expect)
    }

    async fn stop(mut self) {
        for s in self.up.drain(..).flatten() {
            s.shutdown().await;
        }
    }

    fn up(&self, i: usize) -> &RunningServer {
        self.up[i].as_ref().expect("node is up")
    }

    fn nbd_all(&self) -> Vec<std::net::SocketAddr> {
        self.t.file.nodes.iter().map(|n| n.nbd).collect()
    }

    async fn crash(&mut self, i: usize) {
        self.up[i].take().expect("up").crash().await;
    }

    async fn restart(&mut self, i: usize) {
        self.up[i] = Some(crate::service::start(self.t.cfgs[i].clone()).await.expect("restart"));
    }

    /// Waits until a node that is up names, in its map, a primary other
    /// than `not` that is up, at an epoch above `above` (a node that was
    /// away may still show an older map); gives its index and epoch.
    async fn new_primary(&self, not: Option<usize>, above: u64) -> (usize, u64) {
        let start = Instant::now();
        loop {
            for i in (0..3).filter(|i| self.up[*i].is_some()) {
                if let Ok(m) = self.up(i).api_client().cluster_map().await
                    && let Some(vm) = m.volumes.get("vm")
                    && let Some(p) = self.t.file.nodes.iter().position(|n| n.name == vm.primary)
                    && Some(p) != not
                    && vm.epoch > above
                    && self.up[p].is_some()
                {
                    return (p, vm.epoch);
                }
            }
            assert!(start.elapsed() < LIMIT, "no new primary within {LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every node's map has all three copies in sync.
    async fn all_in_sync(&self) -> Duration {
        let start = Instant::now();
        loop {
            let mut ok = true;
            for i in 0..3 {
                let m = self.up(i).api_client().cluster_map().await.expect("map");
                ok &= m.volumes.get("vm").is_some_and(|v| v.in_sync.len() == 3);
            }
            if ok {
                return start.elapsed();
            }
            assert!(start.elapsed() < LIMIT, "the copies were not all in sync again within {LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Connects to the primary and writes `round`'s blocks (one per
    /// writer slot) and flushes, retrying while the volume is below its
    /// quorum (a copy still catching up); gives how long it took.
    async fn write_round(&self, round: u8, expect: &mut [Vec<u8>]) -> Duration {
        let start = Instant::now();
        loop {
            let attempt = async {
                // A writer declares the epoch it writes at: after a failover,
                // the new primary's (a client declaring none is read-only).
                let export = self.export().await;
                let (client, _) = NbdClient::connect_primary(&self.nbd_all(), &export).await?;
                for w in 0..8u8 {
                    client.write(u64::from(w) * 1_000_000, &block(w, round), false).await?;
                }
                client.flush().await
            };
            match attempt.await {
                Ok(()) => break,
                Err(
                    CoronaError::Nbd { errno: NbdErrno::Io, .. } | CoronaError::Negotiation(_) | CoronaError::Io(_),
                ) => {}
                Err(CoronaError::Disconnected) => {}
                Err(e) => panic!("round {round}: {e}"),
            }
            assert!(start.elapsed() < LIMIT, "round {round}: not writable within {LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for w in 0..8u8 {
            expect[w as usize] = block(w, round);
        }
        start.elapsed()
    }

    /// `vm;epoch=N` with the epoch of the primary some node's map names
    /// (`vm` when none is known yet).
    async fn export(&self) -> String {
        for i in (0..3).filter(|i| self.up[*i].is_some()) {
            if let Ok(m) = self.up(i).api_client().cluster_map().await
                && let Some(vm) = m.volumes.get("vm")
                && let Some(p) = self.t.file.nodes.iter().position(|n| n.name == vm.primary)
                && let Some(s) = &self.up[p]
                && let Ok(info) = s.api_client().get("vm").await
            {
                return format!("vm;epoch={}", info.epoch);
            }
        }
        "vm".into()
    }

    /// Reads every block through the primary: each holds its last flushed write.
    async fn check(&self, expect: &[Vec<u8>]) {
        let (client, _) = NbdClient::connect_primary(&self.nbd_all(), "vm").await.expect("connect");
        for (w, want) in expect.iter().enumerate() {
            let got = client.read(w as u64 * 1_000_000, want.len()).await.expect("read");
            assert!(got == *want, "block {w} lost its last flushed write");
        }
    }

    async fn image(&self, i: usize) -> Vec<u8> {
        let e = self.up(i).volumes.open("vm").expect("open");
        let (r, buf) = crate::backend::BlockBackend::read_at(&e.backend, vec![0; SIZE as usize], 0).await;
        r.expect("read");
        buf
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_crashed_three_times_over_each_copy_in_turn_loses_no_flushed_write_and_every_copy_rejoins() {
    let (mut c, mut expect) = Nodes::with_volume().await;
    let mut primary = 0;
    let mut epoch = 0;
    for round in 1..=3u8 {
        c.crash(primary).await;
        let t = Instant::now();
        let (p, e) = c.new_primary(Some(primary), epoch).await;
        assert!(e > epoch, "round {round}: epoch {e} after {epoch}");
        let writable = c.write_round(round, &mut expect).await;
        eprintln!(
            "round {round}: n{} crashed; n{} primary at epoch {e}, writable {:?} after the crash ({writable:?} of retries)",
            primary + 1,
            p + 1,
            t.elapsed()
        );
        c.check(&expect).await;
        // The old primary comes back by itself as a replica and catches up.
        c.restart(primary).await;
        let back = c.all_in_sync().await;
        eprintln!("round {round}: n{} back in sync {back:?} after its restart", primary + 1);
        (primary, epoch) = (p, e);
    }
    c.write_round(9, &mut expect).await;
    c.check(&expect).await;
    let img = c.image(primary).await;
    for i in (0..3).filter(|i| *i != primary) {
        assert!(c.image(i).await == img, "n{} differs from the primary after it rejoined", i + 1);
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_every_node_crashed_and_restarted_the_volume_takes_writes_again_with_every_flushed_byte() {
    let (mut c, mut expect) = Nodes::with_volume().await;
    // A failover first, so the records disagree (n1's still names it).
    c.crash(0).await;
    c.new_primary(Some(0), 0).await;
    c.write_round(1, &mut expect).await;
    for i in 1..3 {
        c.crash(i).await;
    }
    for i in 0..3 {
        c.restart(i).await;
    }
    let t = Instant::now();
    c.write_round(2, &mut expect).await;
    eprintln!("writable {:?} after all three restarted", t.elapsed());
    c.check(&expect).await;
    c.all_in_sync().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_primary_and_one_copy_down_nothing_is_acknowledged_and_the_survivor_keeps_every_flushed_byte() {
    let (mut c, mut expect) = Nodes::with_volume().await;
    c.crash(0).await;
    c.crash(1).await;
    // n3 alone: no majority of the map, no lease, no takeover; nothing is
    // acknowledged, whatever it is asked.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let m = c.up(2).api_client().cluster_map().await.expect("map");
    assert_eq!(m.volumes["vm"].primary, "n1", "a lone copy took over: {m:?}");
    if let Ok((client, _)) = NbdClient::connect_primary(&c.nbd_all()[2..], "vm").await {
        let w = client.write(0, &block(0, 50), true).await;
        assert!(w.is_err(), "a FUA write was acknowledged by one copy");
        assert!(client.flush().await.is_err(), "a flush was acknowledged by one copy");
    }
    // n2 back: a majority; one of n2, n3 takes over with every flushed byte.
    c.restart(1).await;
    c.new_primary(Some(0), 0).await;
    c.write_round(1, &mut expect).await;
    c.check(&expect).await;
    c.stop().await;
}
