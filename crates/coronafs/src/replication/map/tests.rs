//! The map's Raft group end to end: three members in this process, each
//! with a listener of its own on loopback that runs the replica RPC's
//! handshake and then the map RPC, as `coronafs serve`'s replica listener
//! does; stopped and started again on the same store.

use super::net::{self, ProposeError};
use super::state::{Command, Refusal, VolumeState};
use super::{MapNode, Timing};
use crate::cluster::ClusterFile;
use crate::replica::auth::{self, RpcSecret};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

const LEASE: Duration = Duration::from_millis(1_500);
const WAIT: Duration = Duration::from_secs(20);

struct Member {
    map: Arc<MapNode>,
    listener: tokio::task::JoinHandle<()>,
}

struct Group {
    file: ClusterFile,
    dirs: Vec<tempfile::TempDir>,
    members: Vec<Option<Member>>,
}

async fn accept(mut s: TcpStream, map: Arc<MapNode>, secret: Arc<RpcSecret>) -> std::io::Result<()> {
    svc_kit::rpc_auth::io::as_listener(&mut s, &auth::PROTOCOL, &secret)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).await?;
    if magic != net::MAGIC {
        return Err(std::io::Error::other("not a map connection"));
    }
    let (r, w) = s.into_split();
    map.serve(BufReader::new(r), w).await
}

impl Group {
    async fn start() -> Group {
        let file = ClusterFile::on_loopback(3).expect("a loopback cluster");
        let dirs = (0..3).map(|_| tempfile::tempdir().expect("tempdir")).collect();
        let mut g = Group { file, dirs, members: vec![None, None, None] };
        for i in 0..3 {
            g.up(i).await;
        }
        g
    }

    async fn up(&mut self, i: usize) {
        let node = &self.file.nodes[i];
        let listener = TcpListener::bind(node.replica).await.expect("bind the replica address");
        let map = MapNode::start(&self.file, &node.name, self.dirs[i].path(), Timing::for_lease(LEASE))
            .await
            .expect("start a map member");
        let secret = Arc::new(self.file.secret().expect("secret"));
        let m = map.clone();
        let listener = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    Ok((s, _)) = listener.accept() => {
                        conns.spawn(accept(s, m.clone(), secret.clone()));
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        self.members[i] = Some(Member { map, listener });
    }

    /// Stops member `i` as a kill would: its listener and connections go,
    /// its Raft stops; its store stays.
    async fn down(&mut self, i: usize) {
        let m = self.members[i].take().expect("member is up");
        m.listener.abort();
        let _ = m.listener.await;
        m.map.shutdown().await;
    }

    fn map(&self, i: usize) -> &Arc<MapNode> {
        &self.members[i].as_ref().expect("member is up").map
    }

    fn name(&self, i: usize) -> String {
        self.file.nodes[i].name.clone()
    }

    /// Waits until every member that is up names the same leader, and
    /// answers its index.
    async fn leader(&self) -> usize {
        let until = Instant::now() + WAIT;
        loop {
            let seen: Vec<Option<String>> = self.members.iter().flatten().map(|m| m.map.status().leader).collect();
            if let Some(Some(l)) = seen.first()
                && seen.iter().all(|s| s.as_deref() == Some(l.as_str()))
                && let Some(i) = self.file.nodes.iter().position(|n| &n.name == l)
                && self.members[i].is_some()
            {
                return i;
            }
            assert!(Instant::now() < until, "no common leader within {WAIT:?}: {seen:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until member `i` has applied a map where `volume` satisfies `f`.
    async fn sees(&self, i: usize, volume: &str, f: impl Fn(Option<&VolumeState>) -> bool) {
        let until = Instant::now() + WAIT;
        while !f(self.map(i).map().get(volume)) {
            assert!(Instant::now() < until, "member {i} never saw the change of {volume}: {:?}", self.map(i).map());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn register(g: &Group, volume: &str) -> Command {
    Command::Register {
        volume: volume.into(),
        copies: (0..3).map(|i| g.name(i)).collect(),
        primary: g.name(0),
        quorum: 2,
        epoch: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_proposed_on_a_follower_is_applied_on_every_member_and_survives_a_restart_of_all() {
    let mut g = Group::start().await;
    let leader = g.leader().await;
    let follower = (leader + 1) % 3;
    let st = g.map(follower).propose(register(&g, "vol"), WAIT).await.expect("committed").expect("applied");
    assert_eq!((st.primary.clone(), st.epoch, st.in_sync.len()), (g.name(0), 1, 3));
    for i in 0..3 {
        g.sees(i, "vol", |s| s == Some(&st)).await;
    }
    for i in 0..3 {
        g.down(i).await;
    }
    for i in 0..3 {
        g.up(i).await;
    }
    g.leader().await;
    for i in 0..3 {
        g.sees(i, "vol", |s| s == Some(&st)).await;
    }
    // And the group takes new commands after the restart.
    let renew = Command::Renew { volume: "vol".into(), node: g.name(0), epoch: 1 };
    let st = g.map(2).propose(renew, WAIT).await.expect("committed").expect("applied");
    assert_eq!(st.renewals, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_waits_out_the_lease_and_then_deposes_the_primary_whose_renewals_fail() {
    let g = Group::start().await;
    g.leader().await;
    g.map(1).propose(register(&g, "vol"), WAIT).await.expect("committed").expect("applied");
    let renew = Command::Renew { volume: "vol".into(), node: g.name(0), epoch: 1 };
    let asked = Instant::now();
    g.map(0).propose(renew.clone(), WAIT).await.expect("committed").expect("renewed");
    let takeover = Command::TakeOver { volume: "vol".into(), node: g.name(1), renewals: 0, seen: 1, at_ms: 0 };
    // While the lease runs, the leader refuses (and says for how long).
    match g.map(1).propose(takeover.clone(), WAIT).await {
        Err(ProposeError::LeaseRuns { left_ms }) => assert!(left_ms <= LEASE.as_millis() as u64 + 1),
        other => panic!("a takeover within the lease: {other:?}"),
    }
    // After a whole lease without renewal it is granted, never earlier.
    let st = loop {
        match g.map(1).propose(takeover.clone(), WAIT).await {
            Ok(Ok(st)) => break st,
            Err(ProposeError::LeaseRuns { left_ms }) => tokio::time::sleep(Duration::from_millis(left_ms)).await,
            other => panic!("takeover: {other:?}"),
        }
    };
    assert!(asked.elapsed() >= LEASE, "granted {:?} after the renewal was asked", asked.elapsed());
    assert_eq!((st.primary.clone(), st.epoch), (g.name(1), 2));
    // The old primary's next renewal tells it it was deposed.
    match g.map(0).propose(renew, WAIT).await {
        Ok(Err(Refusal::NotPrimary { primary, current, .. })) => assert_eq!((primary, current), (g.name(1), 2)),
        other => panic!("the deposed primary's renewal: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_leader_dies_the_others_commit_and_the_dead_one_catches_up_when_it_returns() {
    let mut g = Group::start().await;
    let leader = g.leader().await;
    g.map(leader).propose(register(&g, "a"), WAIT).await.expect("committed").expect("applied");
    g.down(leader).await;
    let other = (leader + 1) % 3;
    let st = g.map(other).propose(register(&g, "b"), WAIT).await.expect("committed by two").expect("applied");
    g.up(leader).await;
    g.sees(leader, "b", |s| s == Some(&st)).await;
    g.sees(leader, "a", |s| s.is_some()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_without_the_clusters_secret_gets_no_map_answer() {
    let g = Group::start().await;
    g.leader().await;
    let wrong = Arc::new(RpcSecret::random().expect("random"));
    let mut conn = net::Conn::new(g.file.nodes[0].replica.to_string(), wrong);
    let r = conn.call(&net::Request::Propose(register(&g, "x")), Duration::from_secs(5)).await;
    let (unreachable, e) = r.expect_err("refused");
    assert!(unreachable, "refused at the handshake, before any request: {e}");
    // Nothing was proposed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(g.map(0).map().get("x").is_none());
    // With the secret the same request is answered.
    let right = Arc::new(g.file.secret().expect("secret"));
    let leader = g.leader().await;
    let mut conn = net::Conn::new(g.file.nodes[leader].replica.to_string(), right);
    let a = conn.call(&net::Request::Propose(register(&g, "x")), Duration::from_secs(5)).await.expect("answered");
    assert!(matches!(a, net::Answer::Propose(Ok(Ok(_)))), "{a:?}");
}
