//! A CoronaFS cluster of child processes on loopback, for the failover row
//! of the embedded run and the fault-schedule tests. Each node is `bench
//! __serve-coronafs-node`, so stopping a node is a SIGKILL (or a SIGSTOP)
//! of a process: the kernel closes its
//! sockets, nothing is flushed and no goodbye is sent. The report's other
//! CoronaFS rows run on the in-process nodes of [`super::Cluster`]; this
//! cluster is started for the failover row only, with short heartbeat and
//! failover timeouts that would be risky for the throughput rows on a busy
//! host.

use super::embedded::Proc;
use crate::fault::{Fault, FaultDriver, FaultKind};
use anyhow::{Context, bail};
use coronafs::cluster::ClusterFile;
use std::path::Path;
use tokio::sync::Mutex;

/// Nodes of the failover cluster (and copies of its volume).
pub const NODES: usize = 3;
/// Copies that must be live for writes.
pub const WRITE_QUORUM: usize = 2;
/// A primary's heartbeat on an idle replica link.
pub const HEARTBEAT_MS: u64 = 250;
/// Silence after which a copy starts a failover.
pub const FAILOVER_AFTER_MS: u64 = 1_500;

/// The running nodes, by name, and their cluster file.
#[derive(Debug)]
pub struct CoronaProcs {
    pub file: ClusterFile,
    nodes: Mutex<Vec<(String, Proc)>>,
}

/// The cluster file of the failover cluster: [`NODES`] nodes on loopback
/// addresses free right now, one zone each.
fn cluster_file() -> anyhow::Result<ClusterFile> {
    let mut file = ClusterFile::on_loopback(NODES).context("the failover cluster file")?;
    for (i, n) in file.nodes.iter_mut().enumerate() {
        n.name = format!("f{}", i + 1);
    }
    file.write_quorum = WRITE_QUORUM;
    (file.heartbeat_ms, file.failover_after_ms) = (HEARTBEAT_MS, FAILOVER_AFTER_MS);
    file.validate().context("the failover cluster file")?;
    Ok(file)
}

impl CoronaProcs {
    /// Starts every node under `base` (a data dir each). Addresses are
    /// chosen before any node starts, so a port taken in between makes the
    /// attempt fail; it is retried.
    pub async fn start(base: &Path) -> anyhow::Result<CoronaProcs> {
        let mut last = None;
        for attempt in 0..3 {
            let dir = base.join(format!("attempt-{attempt}"));
            std::fs::create_dir_all(&dir)?;
            let file = cluster_file()?;
            let path = dir.join("cluster.toml");
            std::fs::write(&path, toml::to_string(&file).context("writing the cluster file")?)?;
            let mut nodes = Vec::new();
            let mut failed = None;
            for n in &file.nodes {
                let args = vec![
                    "__serve-coronafs-node".to_owned(),
                    "--cluster".into(),
                    path.display().to_string(),
                    "--node".into(),
                    n.name.clone(),
                    "--data-dir".into(),
                    dir.join(&n.name).display().to_string(),
                ];
                match Proc::start(&format!("CoronaFS node {}", n.name), args, Vec::new()).await {
                    Ok(p) => nodes.push((n.name.clone(), p)),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            match failed {
                None => return Ok(CoronaProcs { file, nodes: Mutex::new(nodes) }),
                Some(e) => {
                    for (_, p) in nodes {
                        p.stop().await;
                    }
                    tracing::warn!(error = %format!("{e:#}"), attempt, "retrying the failover cluster's start");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("the failover cluster did not start")))
    }

    /// Stops every node (closes their stdin, kills what does not exit).
    pub async fn stop(self) {
        for (_, p) in self.nodes.into_inner() {
            p.stop().await;
        }
    }

    fn check(f: &Fault) -> anyhow::Result<()> {
        if f.service != "coronafs" || !matches!(f.kind, FaultKind::Kill | FaultKind::Pause) {
            bail!("{f}: the failover cluster takes only kill:coronafs@NODE and pause:coronafs@NODE");
        }
        Ok(())
    }
}

/// The node a fault names, among `nodes`.
fn node<'a>(nodes: &'a mut [(String, Proc)], f: &Fault) -> anyhow::Result<&'a mut Proc> {
    CoronaProcs::check(f)?;
    nodes.iter_mut().find(|(n, _)| *n == f.node).map(|(_, p)| p).with_context(|| format!("{f}: no such CoronaFS node"))
}

#[async_trait::async_trait]
impl FaultDriver for CoronaProcs {
    fn describe(&self) -> String {
        "SIGKILL of a node's process (a child of the bench on this host; the kernel closes its sockets, \
         nothing is flushed), restarted on the same data dir afterwards; or SIGSTOP, then SIGCONT"
            .into()
    }

    async fn inject(&self, f: &Fault) -> anyhow::Result<()> {
        let mut nodes = self.nodes.lock().await;
        let p = node(&mut nodes, f)?;
        match f.kind {
            FaultKind::Pause => p.pause(),
            _ => p.kill().await,
        }
    }

    async fn heal(&self, f: &Fault) -> anyhow::Result<()> {
        let mut nodes = self.nodes.lock().await;
        let p = node(&mut nodes, f)?;
        match f.kind {
            FaultKind::Pause => p.resume(),
            _ => p.restart().await,
        }
    }

    async fn is_down(&self, f: &Fault) -> anyhow::Result<bool> {
        Ok(node(&mut self.nodes.lock().await, f)?.is_down())
    }
}
