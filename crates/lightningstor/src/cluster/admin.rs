//! Operator actions over node-to-node RPC, behind `lightningstor cluster
//! status` and `lightningstor cluster layout apply`.
//!
//! A layout change runs in three phases, each sent to every node of the
//! old and the new cluster file:
//!
//! 1. `ChangeLayout{old, new}`: from then on a node writes to both replica
//!    sets of a key and counts read quorums in the old one;
//! 2. `Rebalance` rounds until a round pushes nothing: every node pushes
//!    the rows it holds (and their blocks) to their new replicas;
//! 3. `FinishLayout`: the old layout is dropped; nodes that left may stop.
//!
//! A phase that cannot reach every node stops the change with an error
//! naming the node; nodes left in phase 1 still write to both sets, which
//! is safe, and running `apply` again resumes.

use super::config::{ClusterConfig, NodeConfig};
use super::rpc::{Msg, NodeStatus, Req, Resp};
use super::transport::{Tcp, Transport};
use crate::error::{LightningError, Result};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// Rebalance rounds tried before giving up (each ends when every node has
/// pushed its rows; more than one is needed only when writes race the move).
const MAX_ROUNDS: usize = 10;

fn tcp(c: &ClusterConfig, nodes: &[NodeConfig], timeout: Duration) -> Result<Tcp> {
    Ok(Tcp::new(nodes.iter().map(|n| (n.id, n.rpc)).collect(), timeout, c.rpc_secret()?))
}

/// Asks every node of `c` for its status; `Err` holds why a node did not
/// answer. Fails when no node answers at all.
pub async fn status(
    c: &ClusterConfig,
    timeout: Duration,
) -> Result<Vec<(NodeConfig, std::result::Result<NodeStatus, String>)>> {
    let t = tcp(c, &c.nodes, timeout)?;
    let calls = c.nodes.iter().map(|n| {
        let t = &t;
        async move {
            let r = match t.call(n.id, Msg::new(Req::Status)).await.and_then(Msg::ok).map(|m| m.head) {
                Ok(Resp::Status(s)) => Ok(s),
                Ok(other) => Err(format!("unexpected answer {other:?}")),
                Err(e) => Err(e.to_string()),
            };
            (n.clone(), r)
        }
    });
    let out: Vec<_> = futures::future::join_all(calls).await;
    if out.iter().all(|(_, r)| r.is_err()) {
        let why = out.first().and_then(|(_, r)| r.as_ref().err().cloned()).unwrap_or_default();
        return Err(LightningError::Unavailable(format!(
            "no node of the cluster answered on its RPC address (is it running? first error: {why})"
        )));
    }
    Ok(out)
}

/// The cluster file the running cluster uses, from the first node of
/// `c` that answers.
pub async fn running_config(c: &ClusterConfig, timeout: Duration) -> Result<ClusterConfig> {
    let t = tcp(c, &c.nodes, timeout)?;
    let mut last = String::from("no nodes in the file");
    for n in &c.nodes {
        match t.call(n.id, Msg::new(Req::GetConfig)).await.and_then(Msg::ok).map(|m| m.head) {
            Ok(Resp::Config(text)) => return ClusterConfig::from_toml(&text),
            Ok(other) => last = format!("node {}: unexpected answer {other:?}", n.name),
            Err(e) => last = format!("node {}: {e}", n.name),
        }
    }
    Err(LightningError::Unavailable(format!("no node of the new cluster file answered ({last})")))
}

/// Applies cluster file `new` to a running cluster (add or remove nodes);
/// `progress` is told what happens. Nodes added by `new` must already run
/// (`serve --config NEW --node NAME`). Returns the rows moved.
pub async fn apply_layout(new: ClusterConfig, timeout: Duration, progress: impl Fn(&str)) -> Result<u64> {
    new.validate()?;
    let old = running_config(&new, Duration::from_secs(10)).await?;
    if new.layout_version <= old.layout_version {
        return Err(LightningError::Config(format!(
            "the new file's layout_version ({}) must be above the running one ({})",
            new.layout_version, old.layout_version
        )));
    }
    let mut all: BTreeMap<u8, NodeConfig> = old.nodes.iter().map(|n| (n.id, n.clone())).collect();
    all.extend(new.nodes.iter().map(|n| (n.id, n.clone())));
    let nodes: Vec<NodeConfig> = all.into_values().collect();
    if old.rpc_secret != new.rpc_secret {
        return Err(LightningError::Config(
            "the new file's rpc_secret differs from the running cluster's: a layout change keeps the secret".into(),
        ));
    }
    let t = tcp(&new, &nodes, timeout)?;
    let (old_text, new_text) = (old.to_toml(), new.to_toml());
    let every = |make: &dyn Fn() -> Req| {
        let calls = nodes.iter().map(|n| {
            let (t, req) = (&t, make());
            async move { (n.name.clone(), t.call(n.id, Msg::new(req)).await.and_then(Msg::ok)) }
        });
        futures::future::join_all(calls)
    };
    progress(&format!(
        "layout {} -> {}: {} -> {} nodes",
        old.layout_version,
        new.layout_version,
        old.nodes.len(),
        new.nodes.len()
    ));
    for (name, r) in every(&|| Req::ChangeLayout { old: old_text.clone(), new: new_text.clone() }).await {
        r.map_err(|e| LightningError::Unavailable(format!("node {name} did not take the new layout: {e}")))?;
    }
    progress("every node writes to the old and the new replicas; moving data");
    let mut moved = 0;
    for round in 1..=MAX_ROUNDS {
        let mut pushed: HashMap<String, u64> = HashMap::new();
        for (name, r) in every(&|| Req::Rebalance).await {
            match r.map(|m| m.head) {
                Ok(Resp::Count(n)) => {
                    pushed.insert(name, n);
                }
                Ok(other) => return Err(LightningError::Unavailable(format!("node {name}: unexpected {other:?}"))),
                Err(e) => return Err(LightningError::Unavailable(format!("node {name} failed to rebalance: {e}"))),
            }
        }
        let n: u64 = pushed.values().sum();
        moved += n;
        progress(&format!("round {round}: {n} rows pushed"));
        if n == 0 {
            for (name, r) in every(&|| Req::FinishLayout).await {
                r.map_err(|e| LightningError::Unavailable(format!("node {name} did not finish: {e}")))?;
            }
            progress(&format!("layout {} in place; {moved} rows moved", new.layout_version));
            return Ok(moved);
        }
    }
    Err(LightningError::Unavailable(format!(
        "rows still moving after {MAX_ROUNDS} rounds; run apply again (the change stays in progress, which is safe)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_reports_each_node_s_file_system_and_writes_and_the_running_file_comes_past_a_down_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cluster = crate::cluster::start_local(3, dir.path(), |c| {
            c.write_quorum = Some(3);
            c.read_quorum = Some(1);
        })
        .await
        .expect("start a cluster");
        let file = cluster.config.clone();
        let timeout = Duration::from_secs(5);
        let nodes = status(&file, timeout).await.expect("status");
        assert_eq!(nodes.len(), 3);
        for ((n, r), running) in nodes.iter().zip(&cluster.nodes) {
            let s = r.as_ref().expect("every node answers");
            assert_ne!(s.data_dir_fs.fs_type, "unknown", "{s:?}");
            assert_eq!(s.data_dir_fs.path, n.data_dir.display().to_string());
            assert!(n.data_dir.starts_with(&s.data_dir_fs.mount_point), "{s:?}");
            let mode = running.node.store.blocks.direct_io();
            assert_eq!((s.o_direct, s.o_direct_fell_back), (mode.o_direct, mode.o_direct_fell_back), "{s:?}");
            if matches!(s.data_dir_fs.fs_type.as_str(), "ext4" | "xfs") {
                assert!(s.o_direct, "a durable store on {} writes with O_DIRECT", s.data_dir_fs.fs_type);
            }
            assert!(s.host.cpus >= 1, "{s:?}");
        }
        let want = (3, 1, 3);
        let running = running_config(&file, timeout).await.expect("running file");
        assert_eq!((running.replication_factor, running.r(), running.w()), want);

        // The first node of the file is down: the next one answers.
        cluster.nodes.remove(0).shutdown().await;
        let running = running_config(&file, timeout).await.expect("running file with n1 down");
        assert_eq!((running.replication_factor, running.r(), running.w()), want);
        assert_eq!(running.nodes.len(), 3);
        let nodes = status(&file, timeout).await.expect("status with n1 down");
        assert!(nodes[0].1.is_err() && nodes[1].1.is_ok() && nodes[2].1.is_ok(), "{nodes:?}");
        cluster.shutdown().await;
    }
}
