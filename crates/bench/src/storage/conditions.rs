//! What a run was measured under, read from the coordinator, every agent
//! and the running services: time, commit, hosts, file systems, the CoronaFS
//! engine, LightningStor's replication and quorums, the link, the faults.

use crate::agent::AgentInfo;
use crate::cluster::Cluster;
use serde::Serialize;
use std::time::Duration;

/// One agent and the roles it played.
#[derive(Debug, Clone, Serialize)]
pub struct AgentConditions {
    pub name: String,
    pub roles: String,
    pub addr: String,
    /// What the agent said about itself (None: it did not answer).
    pub info: Option<AgentInfo>,
    /// Why it did not answer.
    pub error: Option<String>,
}

/// One LightningStor node as `cluster status` saw it.
#[derive(Debug, Clone, Serialize)]
pub struct NodeConditions {
    pub name: String,
    pub s3: String,
    /// The node's status (data dir file system, O_DIRECT, resync queue, ...).
    pub status: Option<serde_json::Value>,
    /// Why it did not answer.
    pub down: Option<String>,
}

/// LightningStor as read from the running cluster.
#[derive(Debug, Clone, Serialize)]
pub struct S3Conditions {
    pub replication_factor: usize,
    pub read_quorum: usize,
    pub write_quorum: usize,
    pub consistency: String,
    pub nodes: Vec<NodeConditions>,
}

/// Everything the report records about how it was measured.
#[derive(Debug, Clone, Serialize)]
pub struct Conditions {
    /// When the run started (RFC 3339, UTC).
    pub started_at: String,
    /// The bench's commit.
    pub commit: String,
    pub coordinator: hostinfo::Host,
    /// The coordinator's scratch directory (VM test images).
    pub coordinator_scratch: hostinfo::FsInfo,
    pub agents_origin: String,
    pub agents: Vec<AgentConditions>,
    /// CoronaFS's `GET /v1/info` (engine, data dir file system, O_DIRECT), or why not.
    pub coronafs: Option<serde_json::Value>,
    /// LightningStor's replication, quorums and nodes, or why not.
    pub lightningstor: Option<Result<S3Conditions, String>>,
    /// The emulated link (or none), per agent interface.
    pub link: String,
    /// Where the reference peers ran.
    pub peers: String,
    /// What applies `--fault` here.
    pub fault_driver: Option<String>,
}

/// CoronaFS's self-description (`GET /v1/info`).
async fn coronafs_info(c: &crate::cluster::CoronaEndpoint) -> serde_json::Value {
    let api = &c.api;
    let client = match c.client() {
        Ok(client) => client,
        Err(e) => return serde_json::json!({ "error": format!("{e:#}") }),
    };
    let r = tokio::time::timeout(Duration::from_secs(10), client.info()).await;
    match r {
        Ok(Ok(i)) => serde_json::to_value(i).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() })),
        Ok(Err(e)) => serde_json::json!({ "error": format!("GET {api}/v1/info: {e}") }),
        Err(_) => serde_json::json!({ "error": format!("GET {api}/v1/info: no answer within 10 s") }),
    }
}

/// LightningStor's running configuration and node status.
pub async fn lightningstor(c: &lightningstor::cluster::ClusterConfig) -> Result<S3Conditions, String> {
    use lightningstor::cluster::admin;
    let running = admin::running_config(c, Duration::from_secs(5)).await.map_err(|e| e.to_string())?;
    let status = admin::status(&running, Duration::from_secs(5)).await.map_err(|e| e.to_string())?;
    Ok(S3Conditions {
        replication_factor: running.replication_factor,
        read_quorum: running.r(),
        write_quorum: running.w(),
        consistency: format!("{:?}", running.consistency).to_lowercase(),
        nodes: status
            .into_iter()
            .map(|(n, r)| NodeConditions {
                name: n.name.clone(),
                s3: n.s3.to_string(),
                status: r.as_ref().ok().and_then(|s| serde_json::to_value(s).ok()),
                down: r.err(),
            })
            .collect(),
    })
}

/// Reads every condition (bounded: each call has its own timeout).
pub async fn read(cluster: &Cluster, started_at: String, scratch: &std::path::Path) -> Conditions {
    let mut agents = Vec::new();
    for (name, a) in &cluster.agents {
        let r = tokio::time::timeout(Duration::from_secs(20), a.info()).await;
        let (info, error) = match r {
            Ok(Ok(i)) => (Some(i), None),
            Ok(Err(e)) => (None, Some(format!("{e:#}"))),
            Err(_) => (None, Some("no answer within 20 s".into())),
        };
        agents.push(AgentConditions {
            name: name.clone(),
            roles: cluster.roles.of(name),
            addr: a.addr.to_string(),
            info,
            error,
        });
    }
    let coronafs = match &cluster.setup.coronafs {
        Some(c) => Some(coronafs_info(c).await),
        None => None,
    };
    let lightningstor = match (&cluster.s3_config, &cluster.setup.lightningstor) {
        (Some(c), _) => Some(lightningstor(c).await),
        (None, Some(_)) => Some(Err(
            "the cluster file gives no lightningstor.cluster_file, so replication and quorums are unknown".into(),
        )),
        (None, None) => None,
    };
    Conditions {
        started_at,
        commit: crate::agent::commit().into(),
        coordinator: hostinfo::host(),
        coordinator_scratch: hostinfo::fs_of(scratch),
        agents_origin: cluster.agents_origin.clone(),
        agents,
        coronafs,
        lightningstor,
        link: if cluster.link.is_unshaped() {
            "none: no link emulation (traffic between agents and services crosses whatever network joins them; \
             in the embedded cluster that is loopback)"
                .into()
        } else {
            format!(
                "{} on each agent's interface (one token bucket per direction shared by all its connections)",
                cluster.link.describe()
            )
        },
        peers: "nbdkit, qemu-nbd and CoronaFS on the coordinator's host over loopback, unshaped".into(),
        fault_driver: cluster.faults.as_ref().map(|f| f.describe()),
    }
}
