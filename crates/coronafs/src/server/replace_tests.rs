//! Replacing a lost copy: four `coronafs serve` nodes of one cluster in this
//! process over loopback (heartbeat 100 ms, lease 1 s, resync retried every
//! 200 ms), a volume `vm` with three copies, so one node holds none. A copy
//! is crashed; it is replaced by hand (`replace-copy`) or by its primary
//! after `replace_after_ms`; the new copy is filled, joins the in-sync set
//! in the volume map, and the old one deletes itself when its node returns.

use super::test_cluster::{Three, start_nodes};
use crate::client::NbdClient;
use crate::dto::{CreateVolume, ReplicaSync, VolumeInfo};
use crate::service::RunningServer;
use std::time::{Duration, Instant};

const SIZE: u64 = 8 << 20;
const LIMIT: Duration = Duration::from_secs(30);

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

struct Four {
    t: Three,
    up: Vec<Option<RunningServer>>,
}

impl Four {
    async fn start(replace_after_ms: Option<u64>) -> Four {
        let mut t = start_nodes(4, 3_000, 100, 0, 200, |f| {
            f.lease_ms = Some(1_000);
            f.replace_after_ms = replace_after_ms;
        })
        .await;
        let up = t.servers.drain(..).map(Some).collect();
        Four { t, up }
    }

    fn up(&self, i: usize) -> &RunningServer {
        self.up[i].as_ref().expect("node is up")
    }

    fn index(&self, name: &str) -> usize {
        self.t.file.nodes.iter().position(|n| n.name == name).expect("a node of the cluster")
    }

    async fn image(&self, i: usize) -> Vec<u8> {
        let e = self.up(i).volumes.open("vm").expect("open");
        let (r, buf) = crate::backend::BlockBackend::read_at(&e.backend, vec![0; SIZE as usize], 0).await;
        r.expect("read");
        buf
    }

    /// `vm` with 3 copies on n1, 4 writes flushed; its replicas and the
    /// node holding no copy.
    async fn volume(&self) -> (NbdClient, Vec<String>, String) {
        let req = CreateVolume { name: "vm".into(), size: Some(SIZE), from_snapshot: None, replicas: Some(3) };
        let v = self.up(0).api_client().create_volume(&req).await.expect("create");
        let spare = self.t.file.nodes.iter().map(|n| n.name.clone()).find(|n| n != "n1" && !v.replicas.contains(n));
        let client = NbdClient::connect(self.t.file.nodes[0].nbd, "vm").await.expect("connect to n1");
        for i in 0..4u64 {
            client.write(i * 1_000_000, &data(200_000, i as u8), false).await.expect("write");
        }
        client.flush().await.expect("flush on 3 of 3");
        (client, v.replicas, spare.expect("one node holds no copy"))
    }

    /// Waits until the primary (n1) shows `copy` in sync; its view then.
    async fn in_sync(&self, copy: &str) -> VolumeInfo {
        let start = Instant::now();
        loop {
            let v = self.up(0).api_client().get("vm").await.expect("show");
            if v.replica_states.iter().any(|s| s.node == copy && s.state == ReplicaSync::InSync) {
                return v;
            }
            assert!(start.elapsed() < LIMIT, "{copy} did not get in sync: {:?}", v.replica_states);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until node `i` holds no copy of `vm`.
    async fn gone(&self, i: usize) {
        let start = Instant::now();
        while self.up(i).volumes.info("vm").is_ok() {
            assert!(start.elapsed() < LIMIT, "the replaced copy on node {i} was not deleted");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(mut self) {
        for s in self.up.drain(..).flatten() {
            s.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_copy_is_replaced_by_hand_filled_on_a_spare_node_and_deleted_when_its_node_returns() {
    let mut c = Four::start(None).await;
    let (client, replicas, spare) = c.volume().await;
    let (lost, kept) = (replicas[1].clone(), replicas[0].clone());
    let li = c.index(&lost);
    c.up[li].take().expect("up").crash().await;
    client.write(4096, &data(65_536, 77), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    // The map knows since when the lost copy is out of sync.
    let v = c.up(0).api_client().get("vm").await.expect("show");
    let st = v.replica_states.iter().find(|s| s.node == lost).expect("the lost copy is listed");
    assert_ne!(st.state, ReplicaSync::InSync);
    assert!(st.out_since_ms.is_some_and(|t| t > 0), "{st:?}");

    // What is refused changes nothing.
    let api = c.up(0).api_client();
    let e = api.replace_copy("vm", "n1", None).await.expect_err("the primary's own copy");
    assert!(e.to_string().contains("primary"), "{e}");
    let e = api.replace_copy("vm", &lost, Some(&kept)).await.expect_err("kept holds a copy");
    assert!(e.to_string().contains("already"), "{e}");
    let e = api.replace_copy("vm", &lost, Some("n9")).await.expect_err("no such node");
    assert!(e.to_string().contains("n9"), "{e}");
    let e = api.replace_copy("vm", &kept, None).await.expect_err("the last copy in sync but the primary");
    assert!(e.to_string().contains("quorum"), "{e}");
    let e = c.up(c.index(&kept)).api_client().replace_copy("vm", &lost, None).await.expect_err("not the primary");
    assert!(e.to_string().contains("its primary is n1"), "{e}");
    assert!(c.up(c.index(&spare)).volumes.info("vm").is_err(), "a refused replacement left a copy behind");

    let v = api.replace_copy("vm", &lost, None).await.expect("replace");
    assert!(v.replicas.contains(&spare) && !v.replicas.contains(&lost), "{:?}", v.replicas);
    let v = c.in_sync(&spare).await;
    assert!(v.stale_replicas.is_empty(), "{v:?}");
    // The primary records the rejoin in the map right after.
    let start = Instant::now();
    let vm = loop {
        let map = c.up(0).api_client().cluster_map().await.expect("map");
        let vm = map.volumes["vm"].clone();
        if vm.in_sync.len() == 3 || start.elapsed() > LIMIT {
            break vm;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(vm.copies.contains(&spare) && !vm.copies.contains(&lost), "{vm:?}");
    assert_eq!(vm.in_sync.len(), 3, "{vm:?}");
    assert!(vm.out_since.is_empty(), "{vm:?}");
    // The new copy holds every flushed byte, and takes new writes.
    let si = c.index(&spare);
    assert!(c.image(si).await == c.image(0).await, "the new copy differs from the primary");
    client.write(3_000_000, &data(100_000, 99), true).await.expect("FUA write on 3 copies");
    client.flush().await.expect("flush on 3 copies");
    let now = c.image(0).await;
    assert_eq!(now[3_000_000..3_100_000], data(100_000, 99)[..]);
    assert!(c.image(si).await == now, "the new copy missed a write");
    assert!(c.image(c.index(&kept)).await == now);

    // The old copy's node comes back: it is not a copy any more.
    c.up[li] = Some(crate::service::start(c.t.cfgs[li].clone()).await.expect("restart"));
    c.gone(li).await;
    drop(client);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_out_of_sync_for_replace_after_is_replaced_by_its_primary() {
    let mut c = Four::start(Some(2_500)).await;
    let (client, replicas, spare) = c.volume().await;
    let lost = replicas[0].clone();
    let li = c.index(&lost);
    c.up[li].take().expect("up").crash().await;
    let t = Instant::now();
    client.write(0, &data(65_536, 5), false).await.expect("write on 2 of 3");
    client.flush().await.expect("flush on 2 of 3");
    let v = c.in_sync(&spare).await;
    let took = t.elapsed();
    assert!(!v.replicas.contains(&lost), "{v:?}");
    assert!(took >= Duration::from_millis(2_000), "replaced after {took:?}, before replace_after");
    eprintln!("a copy lost at 0 s was replaced and in sync after {took:?} (replace_after 2.5 s, 8 MiB)");
    let si = c.index(&spare);
    assert!(c.image(si).await == c.image(0).await, "the new copy differs from the primary");
    let e = NbdClient::connect(c.t.file.nodes[si].nbd, "vm").await.expect_err("the new copy is a replica");
    assert!(e.to_string().contains("primary"), "{e}");
    drop(client);
    c.stop().await;
}
