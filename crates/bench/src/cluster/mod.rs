//! The cluster the storage bench measures, and the agents that measure it.
//!
//! Either started here on loopback (each service with its own data dir
//! under one temporary directory, removed at shutdown) or already deployed
//! and described by a TOML file. Either way the bench speaks the services'
//! real protocols to them, and the load comes from **agents**
//! (`bench agent`, [`crate::agent`]): separate processes, one per worker
//! node, each playing a role of the seed report ([`Roles`]).
//!
//! The embedded cluster is one CoronaFS node (in this process) joined by a
//! CoronaFS cluster file with [`EMBEDDED_CORONA_COPIES`]` - 1` more nodes
//! (also in this process, on loopback) that hold the copies of the report's
//! replicated volume, a
//! LightningStor cluster of [`EMBEDDED_S3_NODES`] nodes replicating every
//! object [`EMBEDDED_RF`] ways (child processes, so a fault can kill or
//! freeze one), PlasmaVMC (in this process), two worker agents (child
//! processes) and an agent on the services' host (in this process, where
//! the services are) as the network baseline's sink.
//!
//! With link emulation each agent sends all of its traffic through one
//! emulated interface; the coordinator's own client of PlasmaVMC goes
//! through a [`Shaper`], and PlasmaVMC's host interface is explained at
//! [`Cluster::embedded`]. Set-up traffic (creating and filling volumes) is
//! the coordinator's and is not shaped.

pub mod corona_procs;
pub mod embedded;

use crate::agent::client::AgentClient;
use crate::fault::FaultDriver;
use crate::shaper::{LinkSpec, Nic, Shaper};
use anyhow::{Context, bail};
use coronafs::backend::IoEngine;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// LightningStor nodes the embedded cluster starts (the S3 sections spread
/// their clients over all of them).
pub const EMBEDDED_S3_NODES: usize = 3;
/// Copies of every object in the embedded LightningStor cluster.
pub const EMBEDDED_RF: usize = 3;
/// CoronaFS nodes of the embedded cluster, and copies of its replicated
/// volume (one on each node; the first node is the primary).
pub const EMBEDDED_CORONA_COPIES: usize = 3;
/// Copies that must be live for the embedded replicated volume to take writes.
pub const EMBEDDED_CORONA_QUORUM: usize = 2;
/// Bucket PlasmaVMC keeps image artifacts in.
pub const EMBEDDED_IMAGE_BUCKET: &str = "images";
/// Keys of the embedded LightningStor nodes.
pub const EMBEDDED_KEYS: (&str, &str) = ("bench-access-key", "bench-secret-key-0123456789");

/// A CoronaFS node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoronaEndpoint {
    /// NBD `host:port`.
    pub nbd: String,
    /// Control API base URL, e.g. `http://10.0.0.1:7070`.
    pub api: String,
    /// The control API's bearer token (`coronafs serve --api-token-file`),
    /// when the server has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_token: Option<String>,
    /// The CoronaFS cluster file the nodes run with (`coronafs serve`'s
    /// `cluster`): the failover row reads the nodes' names and addresses,
    /// `heartbeat_ms` and `failover_after_ms` from it. Without it (or
    /// without `[faults]`) that row is not measured.
    #[serde(default)]
    pub cluster_file: Option<PathBuf>,
}

impl CoronaEndpoint {
    /// The typed client of the control API, with the token.
    pub fn client(&self) -> anyhow::Result<coronafs::api_client::ApiClient> {
        Ok(coronafs::api_client::ApiClient::new(&self.api).with_token(token(self.api_token.as_deref())?))
    }
}

/// A `api_token` field of the cluster file, checked.
fn token(text: Option<&str>) -> anyhow::Result<Option<svc_kit::api_token::ApiToken>> {
    Ok(text.map(svc_kit::api_token::ApiToken::new).transpose()?)
}

/// The S3 side: one or more LightningStor nodes sharing keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Endpoint {
    /// Endpoint URLs (`http://host:port`), one per node.
    pub endpoints: Vec<String>,
    /// Access key id.
    pub access_key: String,
    /// Secret key.
    pub secret_key: String,
    /// Signing region.
    #[serde(default = "default_region")]
    pub region: String,
    /// The cluster's own file (`lightningstor serve --config`), from which
    /// the bench reads replication factor, quorums and node health
    /// (`cluster status`) of the running cluster; without it they are
    /// reported as unknown and the time back to full redundancy after a
    /// fault cannot be measured.
    #[serde(default)]
    pub cluster_file: Option<PathBuf>,
}

fn default_region() -> String {
    "us-east-1".into()
}

/// A PlasmaVMC control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlasmaEndpoint {
    /// API base URL.
    pub url: String,
    /// The REST API's bearer token (`plasmavmc serve --api-token-file`),
    /// when the server has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_token: Option<String>,
}

impl PlasmaEndpoint {
    /// The typed client of the REST API, with the token.
    pub fn client(&self) -> anyhow::Result<plasmavmc::client::Client> {
        Ok(plasmavmc::client::Client::new(&self.url).with_token(token(self.api_token.as_deref())?))
    }
}

/// The load agents (`bench agent`) of a deployed cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentsConfig {
    /// The token every agent was started with (`BENCH_AGENT_TOKEN`).
    pub token: String,
    /// Agent name -> `host:port` of its HTTP service.
    pub nodes: BTreeMap<String, String>,
}

/// Which agent plays which part of the seed report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Roles {
    /// Runs the local-disk and CoronaFS block jobs, and the TCP baseline
    /// to `coronafs_host` (the seed's node04).
    pub block: String,
    /// The agent on CoronaFS's node: the sink of that baseline (node01).
    pub coronafs_host: String,
    /// Writes the cross-worker range (node04).
    pub cross_write: String,
    /// Reads it back on another node (node05).
    pub cross_read: String,
    /// Runs the S3 sections and the degraded-cluster load (node03).
    pub s3: String,
    /// The agent on an S3 node: the sink of the S3 client's baseline.
    pub s3_host: String,
}

impl Roles {
    /// Every (role, agent) pair.
    pub fn pairs(&self) -> [(&'static str, &str); 6] {
        [
            ("block", &self.block),
            ("coronafs_host", &self.coronafs_host),
            ("cross_write", &self.cross_write),
            ("cross_read", &self.cross_read),
            ("s3", &self.s3),
            ("s3_host", &self.s3_host),
        ]
    }

    /// The roles an agent plays, comma-separated.
    pub fn of(&self, agent: &str) -> String {
        self.pairs().iter().filter(|(_, a)| *a == agent).map(|(r, _)| *r).collect::<Vec<_>>().join(", ")
    }
}

/// How faults are applied to a deployed cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsConfig {
    /// The Docker engine's socket (the Docker lab); the Compose project is
    /// `$BENCH_COMPOSE_PROJECT`, else `lab`.
    pub docker_socket: Option<PathBuf>,
}

/// Where the services are: the shape of `--cluster lab.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoints {
    /// CoronaFS (block volumes over NBD).
    pub coronafs: Option<CoronaEndpoint>,
    /// LightningStor (S3).
    pub lightningstor: Option<S3Endpoint>,
    /// PlasmaVMC (VM images and volumes).
    pub plasmavmc: Option<PlasmaEndpoint>,
    /// The load agents; without them the bench starts two on this host.
    pub agents: Option<AgentsConfig>,
    /// Which agent does what (needs `agents`).
    pub roles: Option<Roles>,
    /// How `--fault` is applied.
    pub faults: Option<FaultsConfig>,
}

impl Endpoints {
    /// Reads and checks a cluster file; errors name the file (and the line
    /// of a parse error).
    pub fn from_file(path: &Path) -> anyhow::Result<Endpoints> {
        Ok(svc_kit::config::load_validated(path, Endpoints::validate)?)
    }

    /// Parses and checks a cluster file's text.
    pub fn from_toml(text: &str) -> anyhow::Result<Endpoints> {
        let e: Endpoints = svc_kit::config::parse(text)?;
        e.validate()?;
        Ok(e)
    }

    /// Checks what the types cannot: addresses parse, roles name agents.
    pub fn validate(&self) -> anyhow::Result<()> {
        let e = self;
        if let Some(s) = &e.lightningstor {
            if s.endpoints.is_empty() {
                bail!("lightningstor.endpoints is empty");
            }
            for u in &s.endpoints {
                url_addr(u)?;
            }
        }
        if let Some(c) = &e.coronafs {
            host_port(&c.nbd).with_context(|| format!("coronafs.nbd {:?}", c.nbd))?;
            url_addr(&c.api).context("coronafs.api")?;
            token(c.api_token.as_deref()).context("coronafs.api_token")?;
        }
        if let Some(p) = &e.plasmavmc {
            url_addr(&p.url).context("plasmavmc.url")?;
            token(p.api_token.as_deref()).context("plasmavmc.api_token")?;
        }
        match (&e.agents, &e.roles) {
            (Some(a), Some(r)) => {
                crate::agent::server::check_token(&a.token).context("agents.token")?;
                for (name, addr) in &a.nodes {
                    host_port(addr).with_context(|| format!("agents.nodes.{name}"))?;
                }
                for (role, agent) in r.pairs() {
                    if !a.nodes.contains_key(agent) {
                        bail!("roles.{role} = {agent:?} is not in agents.nodes");
                    }
                }
                if r.cross_write == r.cross_read {
                    bail!("roles.cross_write and roles.cross_read must be different agents (the read must cross)");
                }
            }
            (None, None) => {}
            (Some(_), None) => bail!("[agents] needs [roles] (which agent measures what)"),
            (None, Some(_)) => bail!("[roles] needs [agents] (their addresses and token)"),
        }
        Ok(())
    }
}

/// `host:port` (an IP or a name that resolves) -> its first socket address.
pub fn host_port(s: &str) -> anyhow::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    if !s.contains(':') {
        bail!("{s:?} is not host:port");
    }
    s.to_socket_addrs()
        .with_context(|| format!("cannot resolve {s:?}"))?
        .next()
        .with_context(|| format!("{s:?} resolves to no address"))
}

/// `http://host:port[/]` -> the socket address (names are resolved).
pub fn url_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let rest = url.strip_prefix("http://").with_context(|| format!("{url}: only http:// endpoints are supported"))?;
    host_port(rest.trim_end_matches('/')).with_context(|| format!("{url}: expected http://HOST:PORT"))
}

struct Embedded {
    dir: tempfile::TempDir,
    corona: coronafs::service::RunningServer,
    /// The other CoronaFS nodes of its cluster (copies of replicated volumes).
    corona_copies: Vec<coronafs::service::RunningServer>,
    /// The LightningStor nodes (child processes), shared with the fault driver.
    s3: embedded::EmbeddedFaults,
    plasma: plasmavmc::Server,
    /// The worker agents (child processes).
    agents: Vec<embedded::Proc>,
    /// The agent on the services' host (this process).
    services_agent: crate::agent::server::RunningAgent,
}

/// How the bench can make a CoronaFS volume with several copies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicatedCorona {
    /// Copies of the volume, the primary's included.
    pub copies: usize,
    /// Copies that must be live for writes and flushes.
    pub write_quorum: usize,
    /// Where the copies are and what links them, for the report.
    pub placement: String,
}

/// Starts the embedded CoronaFS cluster in this process: [`EMBEDDED_CORONA_COPIES`]
/// nodes, each with its own data dir under `base`, named in one cluster file
/// (`n1` first, the primary of the volumes the bench makes). Addresses are
/// chosen before any node starts, so a port taken in between makes the
/// attempt fail; it is retried.
async fn start_corona_cluster(
    base: &Path,
    engine: IoEngine,
    api_token: &svc_kit::api_token::ApiToken,
) -> anyhow::Result<(coronafs::service::RunningServer, Vec<coronafs::service::RunningServer>)> {
    use coronafs::cluster::ClusterFile;
    let mut last = None;
    for attempt in 0..3 {
        let mut file =
            ClusterFile::on_loopback(EMBEDDED_CORONA_COPIES).context("the embedded CoronaFS cluster file")?;
        file.write_quorum = EMBEDDED_CORONA_QUORUM;
        (file.ack_timeout_ms, file.resync_retry_ms, file.heartbeat_ms, file.failover_after_ms) =
            (10_000, 2_000, 1_000, 5_000);
        file.validate().context("the embedded CoronaFS cluster file")?;
        let mut started = Vec::new();
        let mut failed = None;
        for n in &file.nodes {
            let dir = base.join(format!("attempt-{attempt}")).join(&n.name);
            let mut cfg = coronafs::config::ServerConfig::ephemeral(dir, engine);
            (cfg.nbd, cfg.api, cfg.cluster) = (n.nbd, n.api, Some((file.clone(), n.name.clone())));
            cfg.api_token = Some(api_token.clone());
            match coronafs::service::start(cfg).await {
                Ok(s) => started.push(s),
                Err(e) => {
                    failed = Some(anyhow::Error::new(e).context(format!("starting CoronaFS node {}", n.name)));
                    break;
                }
            }
        }
        match failed {
            None => {
                let primary = started.remove(0);
                return Ok((primary, started));
            }
            Some(e) => {
                for s in started {
                    s.shutdown().await;
                }
                tracing::warn!(error = %format!("{e:#}"), attempt, "retrying the CoronaFS cluster start");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("CoronaFS did not start")))
}

async fn stop_corona(primary: coronafs::service::RunningServer, copies: Vec<coronafs::service::RunningServer>) {
    primary.shutdown().await;
    for s in copies {
        s.shutdown().await;
    }
}

/// Starts a LightningStor cluster as child processes: every node with its
/// own data dir under `base`, S3 and node-to-node RPC on loopback TCP.
/// Node addresses go into the shared cluster file before any node starts,
/// so a port taken in between makes the attempt fail; it is retried.
async fn start_s3_cluster(
    base: &Path,
) -> anyhow::Result<(Vec<(String, embedded::Proc)>, lightningstor::cluster::ClusterConfig)> {
    let mut last = None;
    for attempt in 0..3 {
        let dir = base.join(format!("attempt-{attempt}"));
        let mut cfg = lightningstor::cluster::ClusterConfig::init(EMBEDDED_S3_NODES, &dir, 1, false)?;
        cfg.replication_factor = EMBEDDED_RF;
        cfg.access_key = Some(EMBEDDED_KEYS.0.into());
        cfg.secret_key = Some(EMBEDDED_KEYS.1.into());
        cfg.anonymous = false;
        let addrs = crate::ports::free_loopback_addrs(2 * cfg.nodes.len())?;
        for (n, pair) in cfg.nodes.iter_mut().zip(addrs.chunks(2)) {
            (n.s3, n.rpc) = (pair[0], pair[1]);
        }
        cfg.validate()?;
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("cluster.toml");
        std::fs::write(&file, cfg.to_toml())?;
        let mut nodes = Vec::new();
        let mut failed = None;
        for n in &cfg.nodes {
            match embedded::lightningstor_node(&file, &n.name).await {
                Ok(p) => nodes.push((n.name.clone(), p)),
                Err(e) => {
                    failed = Some(e.context(format!("starting LightningStor node {}", n.name)));
                    break;
                }
            }
        }
        match failed {
            None => return Ok((nodes, cfg)),
            Some(e) => {
                for (_, p) in nodes {
                    p.stop().await;
                }
                tracing::warn!(error = %format!("{e:#}"), attempt, "retrying the LightningStor cluster start");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("LightningStor did not start")))
}

/// A LightningStor cluster alone ([`EMBEDDED_S3_NODES`] child processes
/// on loopback, [`EMBEDDED_RF`] copies of every object), for commands that
/// need only S3 (`bench check`). Its data dir is removed at shutdown.
pub struct EmbeddedS3 {
    dir: tempfile::TempDir,
    /// The nodes, and the driver that kills and pauses them.
    pub faults: embedded::EmbeddedFaults,
    /// The cluster file the nodes run with.
    pub config: lightningstor::cluster::ClusterConfig,
}

impl std::fmt::Debug for EmbeddedS3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedS3").field("dir", &self.dir.path()).finish()
    }
}

impl EmbeddedS3 {
    /// Starts the nodes under a new temporary directory.
    pub async fn start() -> anyhow::Result<EmbeddedS3> {
        let dir = tempfile::Builder::new().prefix("bench-check-").tempdir()?;
        let (nodes, config) = start_s3_cluster(&dir.path().join("lightningstor")).await?;
        Ok(EmbeddedS3 {
            dir,
            faults: embedded::EmbeddedFaults { nodes: Arc::new(tokio::sync::Mutex::new(nodes)) },
            config,
        })
    }

    /// The S3 endpoints and keys.
    pub fn endpoint(&self) -> S3Endpoint {
        S3Endpoint {
            endpoints: self.config.nodes.iter().map(|n| format!("http://{}", n.s3)).collect(),
            access_key: EMBEDDED_KEYS.0.into(),
            secret_key: EMBEDDED_KEYS.1.into(),
            region: default_region(),
            cluster_file: None,
        }
    }

    /// The nodes' names (`n1`...), in the order of [`EmbeddedS3::endpoint`].
    pub fn node_names(&self) -> Vec<String> {
        self.config.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// Stops every node and removes the data.
    pub async fn shutdown(self) {
        let nodes = std::mem::take(&mut *self.faults.nodes.lock().await);
        for (_, p) in nodes {
            p.stop().await;
        }
        let path = self.dir.path().to_owned();
        if let Err(err) = self.dir.close() {
            tracing::warn!(error = %err, path = %path.display(), "could not remove the cluster's data");
        }
    }
}

/// A cluster to measure, and the agents that measure it.
pub struct Cluster {
    /// The services (the coordinator's view; agents apply the link themselves).
    pub endpoints: Endpoints,
    /// The same services without link emulation, for set-up traffic.
    pub setup: Endpoints,
    pub link: LinkSpec,
    /// `embedded` or the cluster file's path.
    pub origin: String,
    /// The agents by name.
    pub agents: BTreeMap<String, AgentClient>,
    /// Which agent does what.
    pub roles: Roles,
    /// Where the agents come from, for the report.
    pub agents_origin: String,
    /// The running LightningStor cluster's file (embedded, or `cluster_file`).
    pub s3_config: Option<lightningstor::cluster::ClusterConfig>,
    /// What applies `--fault` (None: faults cannot be applied here).
    pub faults: Option<Arc<dyn FaultDriver>>,
    /// Whether the bench can make a CoronaFS volume with several copies
    /// here, and how they sit; or why not.
    pub coronafs_replicated: Result<ReplicatedCorona, String>,
    embedded: Option<Embedded>,
    /// Agents this bench started for a cluster file without `[agents]`.
    local_agents: Vec<embedded::Proc>,
    shapers: Vec<Shaper>,
    /// The PlasmaVMC host's interface on the emulated link (embedded only).
    nic: Option<Nic>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("endpoints", &self.endpoints).field("origin", &self.origin).finish()
    }
}

/// The embedded cluster's agents and roles: worker-a does the block jobs
/// and writes the cross-worker range, worker-b reads it and runs the S3
/// load; `services` is the agent in this process, on the services' host.
fn embedded_roles() -> Roles {
    Roles {
        block: "worker-a".into(),
        coronafs_host: "services".into(),
        cross_write: "worker-a".into(),
        cross_read: "worker-b".into(),
        s3: "worker-b".into(),
        s3_host: "services".into(),
    }
}

/// Starts worker-a and worker-b as child processes under `dir`.
async fn start_workers(
    dir: &Path,
    token: &str,
) -> anyhow::Result<(Vec<embedded::Proc>, BTreeMap<String, AgentClient>)> {
    let mut procs = Vec::new();
    let mut clients = BTreeMap::new();
    for name in ["worker-a", "worker-b"] {
        let scratch = dir.join(name);
        match embedded::agent(name, &scratch, token).await {
            Ok(p) => {
                clients.insert(name.to_owned(), AgentClient::new(name, p.addr, token));
                procs.push(p);
            }
            Err(e) => {
                for p in procs {
                    p.stop().await;
                }
                return Err(e);
            }
        }
    }
    Ok((procs, clients))
}

impl Cluster {
    /// Starts CoronaFS, a replicated LightningStor cluster, PlasmaVMC and the
    /// agents on loopback.
    ///
    /// With link emulation, each worker agent sends all its traffic through
    /// one emulated interface, and the coordinator reaches PlasmaVMC through
    /// a shaping proxy. PlasmaVMC models the seed's `node01`, which ran
    /// PlasmaVMC and the CoronaFS export while the LightningStor replicas sat
    /// on other machines: it gets one emulated interface ([`Nic`], a rate per
    /// direction) that carries both the client's uploads to it (received)
    /// and its own S3 traffic to LightningStor (multipart parts sent, range
    /// GETs received). Its writes into CoronaFS stay local (same host), and
    /// LightningStor's node-to-node replication runs on its own, unemulated
    /// network.
    pub async fn embedded(link: LinkSpec) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("fresh-bench-storage-").tempdir()?;
        let token = embedded::random_token()?;
        // Every API gets a random token, as a deployment would.
        let corona_token = svc_kit::api_token::ApiToken::random()?;
        let plasma_token = svc_kit::api_token::ApiToken::random()?;
        let (corona, corona_copies) =
            start_corona_cluster(&dir.path().join("coronafs"), IoEngine::Uring, &corona_token)
                .await
                .context("starting CoronaFS")?;
        let (s3, s3_config) = match start_s3_cluster(&dir.path().join("lightningstor")).await {
            Ok(x) => x,
            Err(e) => {
                stop_corona(corona, corona_copies).await;
                return Err(e);
            }
        };
        let s3_addrs: Vec<SocketAddr> = s3_config.nodes.iter().map(|n| n.s3).collect();
        let s3 = embedded::EmbeddedFaults { nodes: Arc::new(tokio::sync::Mutex::new(s3)) };
        let stop_s3 = |s3: embedded::EmbeddedFaults| async move {
            let nodes = std::mem::take(&mut *s3.nodes.lock().await);
            for (_, p) in nodes {
                p.stop().await;
            }
        };
        let nic = (!link.is_unshaped()).then(|| Nic::new(link));
        let mut shapers = Vec::new();
        let s3_for_plasma = match &nic {
            Some(n) => {
                let sh = n.outbound(s3_addrs[0]).await?;
                let a = sh.addr;
                shapers.push(sh);
                a
            }
            None => s3_addrs[0],
        };
        let pcfg = plasmavmc::Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_dir: dir.path().join("plasmavmc"),
            s3_endpoint: format!("http://{s3_for_plasma}"),
            s3_bucket: EMBEDDED_IMAGE_BUCKET.into(),
            s3_access_key: EMBEDDED_KEYS.0.into(),
            s3_secret_key: EMBEDDED_KEYS.1.into(),
            s3_region: default_region(),
            coronafs_api: corona.api_url(),
            coronafs_nbd: corona.nbd_addr.to_string(),
            coronafs_api_token: Some(corona_token.expose().to_owned()),
            api_token: Some(plasma_token.expose().to_owned()),
            ..plasmavmc::Config::default()
        };
        let plasma = match plasmavmc::Server::start(pcfg).await {
            Ok(p) => p,
            Err(e) => {
                for sh in shapers {
                    sh.shutdown().await;
                }
                stop_s3(s3).await;
                stop_corona(corona, corona_copies).await;
                return Err(anyhow::anyhow!("starting PlasmaVMC: {e}"));
            }
        };
        let agents_dir = dir.path().join("agents");
        let started = async {
            let services_agent = crate::agent::server::start(crate::agent::server::AgentConfig {
                name: "services".into(),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                sink: SocketAddr::from(([127, 0, 0, 1], 0)),
                scratch: agents_dir.join("services"),
                token: token.clone(),
            })
            .await?;
            match start_workers(&agents_dir, &token).await {
                Ok((procs, clients)) => anyhow::Ok((services_agent, procs, clients)),
                Err(e) => {
                    services_agent.shutdown().await;
                    Err(e)
                }
            }
        }
        .await;
        let (services_agent, agent_procs, mut agents) = match started {
            Ok(x) => x,
            Err(e) => {
                plasma.shutdown().await;
                for sh in shapers {
                    sh.shutdown().await;
                }
                stop_s3(s3).await;
                stop_corona(corona, corona_copies).await;
                return Err(e.context("starting the agents"));
            }
        };
        agents.insert("services".into(), AgentClient::new("services", services_agent.addr, &token));
        let setup = Endpoints {
            coronafs: Some(CoronaEndpoint {
                nbd: corona.nbd_addr.to_string(),
                api: corona.api_url(),
                api_token: Some(corona_token.expose().to_owned()),
                cluster_file: None,
            }),
            lightningstor: Some(S3Endpoint {
                endpoints: s3_addrs.iter().map(|a| format!("http://{a}")).collect(),
                access_key: EMBEDDED_KEYS.0.into(),
                secret_key: EMBEDDED_KEYS.1.into(),
                region: default_region(),
                cluster_file: None,
            }),
            plasmavmc: Some(PlasmaEndpoint { url: plasma.url(), api_token: Some(plasma_token.expose().to_owned()) }),
            agents: None,
            roles: None,
            faults: None,
        };
        let faults: Arc<dyn FaultDriver> = Arc::new(s3.clone());
        let mut c = Cluster {
            endpoints: setup.clone(),
            setup,
            link,
            origin: "embedded".into(),
            agents,
            roles: embedded_roles(),
            agents_origin: "worker-a and worker-b: `bench agent` child processes on this host; services: an agent \
                            in the coordinator's process, beside the embedded services"
                .into(),
            s3_config: Some(s3_config),
            faults: Some(faults),
            coronafs_replicated: Ok(ReplicatedCorona {
                copies: EMBEDDED_CORONA_COPIES,
                write_quorum: EMBEDDED_CORONA_QUORUM,
                placement: format!(
                    "{EMBEDDED_CORONA_COPIES} CoronaFS nodes in the bench's own process on this one host, each with \
                     its own data dir on the same file system: the copies share one disk, one page cache and the \
                     CPU, and the primary forwards writes to the others over loopback TCP (no network crossed, \
                     never link-emulated); write quorum {EMBEDDED_CORONA_QUORUM}"
                ),
            }),
            embedded: Some(Embedded { dir, corona, corona_copies, s3, plasma, agents: agent_procs, services_agent }),
            local_agents: Vec::new(),
            shapers,
            nic,
        };
        if let Err(e) = c.shape().await {
            c.shutdown().await;
            return Err(e);
        }
        Ok(c)
    }

    /// A deployed cluster described by `endpoints`. Without `[agents]`, two
    /// agents are started on this host (and the report says so).
    pub async fn external(endpoints: Endpoints, origin: &str, link: LinkSpec) -> anyhow::Result<Cluster> {
        let s3_config = match endpoints.lightningstor.as_ref().and_then(|s| s.cluster_file.as_ref()) {
            Some(f) => Some(
                lightningstor::cluster::ClusterConfig::from_file(f)
                    .with_context(|| format!("lightningstor.cluster_file {}", f.display()))?,
            ),
            None => None,
        };
        // The Docker lab: containers found by Compose labels of $BENCH_COMPOSE_PROJECT (else `lab`).
        let faults: Option<Arc<dyn FaultDriver>> = endpoints
            .faults
            .as_ref()
            .and_then(|f| f.docker_socket.clone())
            .map(|sock| Arc::new(crate::fault::DockerDriver::from_env(sock)) as Arc<dyn FaultDriver>);
        let (agents, roles, agents_origin, local_agents) = match (&endpoints.agents, &endpoints.roles) {
            (Some(a), Some(r)) => {
                let mut m = BTreeMap::new();
                for (name, addr) in &a.nodes {
                    m.insert(name.clone(), AgentClient::new(name, host_port(addr)?, &a.token));
                }
                (m, r.clone(), format!("the agents of {origin} ([agents])"), Vec::new())
            }
            _ => {
                let token = embedded::random_token()?;
                let dir = std::env::temp_dir().join(format!("bench-agents-{}", std::process::id()));
                let (procs, clients) = start_workers(&dir, &token).await?;
                let mut roles = embedded_roles();
                // No agent runs on the services' hosts: no crossing baseline.
                roles.coronafs_host = String::new();
                roles.s3_host = String::new();
                (
                    clients,
                    roles,
                    format!(
                        "{origin} names no agents: worker-a and worker-b were started on the coordinator's host, \
                         and no agent runs on the services' nodes"
                    ),
                    procs,
                )
            }
        };
        let mut c = Cluster {
            endpoints: endpoints.clone(),
            setup: endpoints,
            link,
            origin: origin.into(),
            agents,
            roles,
            agents_origin,
            s3_config,
            faults,
            coronafs_replicated: Err("the cluster file's [coronafs] names one node's NBD and API addresses and has \
                                      no way yet to ask for a volume with several copies (or to say which nodes \
                                      hold them), so no replicated volume is measured"
                .into()),
            embedded: None,
            local_agents,
            shapers: Vec::new(),
            nic: None,
        };
        if let Err(e) = c.shape().await {
            c.shutdown().await;
            return Err(e);
        }
        Ok(c)
    }

    /// The agent playing `role`'s part (None when nobody plays it).
    pub fn agent(&self, name: &str) -> Option<&AgentClient> {
        self.agents.get(name)
    }

    /// Puts the coordinator's client of PlasmaVMC behind the link: through
    /// its host's interface when embedded, its own shaper otherwise. The
    /// agents shape their own traffic.
    async fn shape(&mut self) -> anyhow::Result<()> {
        if self.link.is_unshaped() {
            return Ok(());
        }
        if let Some(p) = &mut self.endpoints.plasmavmc {
            let addr = url_addr(&p.url)?;
            let sh = match &self.nic {
                Some(n) => n.inbound(addr).await?,
                None => Shaper::start(addr, self.link).await?,
            };
            p.url = format!("http://{}", sh.addr);
            self.shapers.push(sh);
        }
        Ok(())
    }

    /// Where the emulated link sits on the VM image path, for the report.
    pub fn vm_link_placement(&self) -> String {
        if self.link.is_unshaped() {
            return if self.embedded.is_some() {
                "no link emulation: every service of the embedded cluster is on this host, reached over loopback".into()
            } else {
                "no link emulation: the bench client reaches PlasmaVMC over the network as it is".into()
            };
        }
        if self.embedded.is_some() {
            format!(
                "{}, on PlasmaVMC's interface: the client's upload into PlasmaVMC and PlasmaVMC's S3 traffic \
                 (multipart parts out, range GETs in) share one rate per direction, like the seed's node01; \
                 PlasmaVMC's writes into CoronaFS are host-local and LightningStor's replication between its \
                 nodes is not on the emulated link",
                self.link.describe()
            )
        } else {
            format!(
                "{}, between the bench client and PlasmaVMC only; the deployed services reach each other over \
                 their own network",
                self.link.describe()
            )
        }
    }

    /// Directory of the embedded cluster's data (None for an external one).
    pub fn data_dir(&self) -> Option<PathBuf> {
        self.embedded.as_ref().map(|e| e.dir.path().to_owned())
    }

    /// Every listening address of the embedded services, agents and proxies.
    pub async fn listen_addrs(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self.shapers.iter().map(|s| s.addr).collect();
        v.extend(self.agents.values().map(|a| a.addr));
        if let Some(e) = &self.embedded {
            v.push(e.corona.nbd_addr);
            v.push(e.corona.api_addr);
            for c in &e.corona_copies {
                v.extend([c.nbd_addr, c.api_addr]);
                v.extend(c.replica_addr);
            }
            v.extend(e.corona.replica_addr);
            v.push(e.services_agent.sink);
            v.push(e.plasma.addr);
        }
        if let Some(c) = &self.s3_config {
            v.extend(c.nodes.iter().flat_map(|n| [n.s3, n.rpc]));
        }
        v
    }

    /// Stops proxies, agents and embedded services and removes their data.
    pub async fn shutdown(self) {
        for s in self.shapers {
            s.shutdown().await;
        }
        for p in self.local_agents {
            p.stop().await;
        }
        if let Some(e) = self.embedded {
            for p in e.agents {
                p.stop().await;
            }
            e.services_agent.shutdown().await;
            e.plasma.shutdown().await;
            let nodes = std::mem::take(&mut *e.s3.nodes.lock().await);
            for (_, p) in nodes {
                p.stop().await;
            }
            stop_corona(e.corona, e.corona_copies).await;
            let path = e.dir.path().to_owned();
            if let Err(err) = e.dir.close() {
                tracing::warn!(error = %err, path = %path.display(), "could not remove the cluster's data");
            }
        }
    }
}

/// Creates a CoronaFS volume with `copies` copies through the control API
/// of its primary.
pub async fn create_replicated_volume(
    corona: &CoronaEndpoint,
    name: &str,
    size: u64,
    copies: usize,
) -> anyhow::Result<()> {
    let req = coronafs::dto::CreateVolume {
        name: name.into(),
        size: Some(size),
        from_snapshot: None,
        replicas: Some(copies),
    };
    corona
        .client()?
        .create_volume(&req)
        .await
        .with_context(|| format!("creating volume {name} with {copies} copies"))?;
    Ok(())
}

/// Creates a CoronaFS volume through the control API.
pub async fn create_volume(corona: &CoronaEndpoint, name: &str, size: u64) -> anyhow::Result<()> {
    corona.client()?.create(name, size).await.with_context(|| format!("creating volume {name}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_files_parse_and_unknown_keys_are_refused() {
        let e = Endpoints::from_toml(
            r#"
            [coronafs]
            nbd = "10.0.0.1:10809"
            api = "http://10.0.0.1:7070"
            [lightningstor]
            endpoints = ["http://10.0.0.2:9000", "http://10.0.0.3:9000"]
            access_key = "a"
            secret_key = "s"
            "#,
        )
        .unwrap();
        assert_eq!(e.lightningstor.unwrap().endpoints.len(), 2);
        assert!(e.plasmavmc.is_none());
        assert!(Endpoints::from_toml("[coronafs]\nnbd = \"x:1\"\napi = \"y\"\nfoo = 1").is_err());
        assert!(Endpoints::from_toml("[coronafs]\nnbd = \"nohost\"\napi = \"http://127.0.0.1:1\"").is_err());
        assert!(Endpoints::from_toml("[coronafs]\nnbd = \"localhost:1\"\napi = \"http://localhost:7070\"").is_ok());
        let e = Endpoints::from_toml("[plasmavmc]\nurl = \"ftp://h:1\"").unwrap_err();
        assert!(format!("{e:#}").contains("plasmavmc.url"), "{e:#}");
        let e = Endpoints::from_toml("[plasmavmc]\nurl = \"http://127.0.0.1:8080\"\n").unwrap();
        assert_eq!(e.plasmavmc.unwrap().url, "http://127.0.0.1:8080");
        let e = Endpoints::from_toml("[lightningstor]\nendpoints = []\naccess_key = \"a\"\nsecret_key = \"s\"");
        assert!(format!("{:#}", e.unwrap_err()).contains("empty"));
        assert!(
            Endpoints::from_toml(
                "[lightningstor]\nendpoints = [\"https://h\"]\naccess_key = \"a\"\nsecret_key = \"s\""
            )
            .is_err()
        );
    }

    /// The Docker lab's client file parses, and its agents agree with
    /// compose.yaml: the same token, an agent named after each node on
    /// that node's address, the fault socket mounted.
    #[test]
    fn the_lab_file_parses_and_matches_the_compose_file() {
        let lab = include_str!("../../../../deploy/docker/config/client/lab.toml");
        let compose = include_str!("../../../../deploy/docker/compose.yaml");
        let e = Endpoints::from_toml(lab).expect("deploy/docker/config/client/lab.toml");
        let agents = e.agents.expect("[agents]");
        assert!(
            compose.contains(&format!("BENCH_AGENT_TOKEN: \"{}\"", agents.token)),
            "token differs from compose.yaml"
        );
        assert_eq!(agents.nodes.len(), 6);
        for (name, addr) in &agents.nodes {
            let (ip, port) = addr.rsplit_once(':').expect("host:port");
            assert_eq!(port, "7900", "{name}");
            assert!(compose.contains(&format!("ipv4_address: {ip}")), "{name}: no container has {ip}");
            assert!(compose.contains(&format!("\"--name\", \"{name}\"]")), "{name}: no bench agent");
            assert!(compose.contains(&format!("network_mode: \"service:{name}\"")), "{name}: no namespace");
        }
        assert_eq!(e.roles.expect("[roles]").of("node04"), "block, cross_write");
        let sock = e.faults.and_then(|f| f.docker_socket).expect("[faults] docker_socket");
        assert!(compose.contains(&format!("- {0}:{0}", sock.display())), "the socket is not mounted");
        let ls = e.lightningstor.expect("[lightningstor]");
        let file = ls.cluster_file.expect("cluster_file");
        assert!(compose.contains(&format!(":{}:ro", file.display())), "the cluster file is not mounted");
        let corona = e.coronafs.expect("[coronafs]").cluster_file.expect("coronafs.cluster_file");
        assert!(
            compose.contains(&format!("- ./config/coronafs-cluster.toml:{}:ro", corona.display())),
            "the CoronaFS cluster file is not mounted where lab.toml says"
        );
        // The failover row kills kill:coronafs@NODE, the container NODE-coronafs.
        let cf = coronafs::cluster::ClusterFile::from_toml(include_str!(
            "../../../../deploy/docker/config/coronafs-cluster.toml"
        ))
        .expect("deploy/docker/config/coronafs-cluster.toml");
        assert_eq!(cf.nodes.len(), 3);
        for n in &cf.nodes {
            assert!(compose.contains(&format!("\n  {}-coronafs:", n.name)), "no container {}-coronafs", n.name);
        }
    }

    /// The Docker lab's API tokens agree: the client's lab.toml, the three
    /// CoronaFS nodes, PlasmaVMC's three tokens and its four agents.
    #[test]
    fn the_lab_configs_share_their_api_tokens() {
        let lab = Endpoints::from_toml(include_str!("../../../../deploy/docker/config/client/lab.toml")).expect("lab");
        let field = |text: &str, key: &str| -> String {
            let t: toml::Table = toml::from_str(text).expect("toml");
            t.get(key).and_then(|v| v.as_str()).unwrap_or_else(|| panic!("no {key}")).to_owned()
        };
        let corona = lab.coronafs.expect("[coronafs]").api_token.expect("coronafs api_token");
        for node in [
            include_str!("../../../../deploy/docker/config/node01/coronafs.toml"),
            include_str!("../../../../deploy/docker/config/node02/coronafs.toml"),
            include_str!("../../../../deploy/docker/config/node03/coronafs.toml"),
        ] {
            assert_eq!(field(node, "api_token"), corona);
        }
        let plasma = include_str!("../../../../deploy/docker/config/node01/plasmavmc.toml");
        assert_eq!(field(plasma, "coronafs_api_token"), corona);
        assert_eq!(field(plasma, "api_token"), lab.plasmavmc.expect("[plasmavmc]").api_token.expect("api_token"));
        let agent_token = field(plasma, "agent_token");
        for agent in [
            include_str!("../../../../deploy/docker/config/node02/agent.toml"),
            include_str!("../../../../deploy/docker/config/node03/agent.toml"),
            include_str!("../../../../deploy/docker/config/node04/agent.toml"),
            include_str!("../../../../deploy/docker/config/node05/agent.toml"),
        ] {
            assert_eq!(field(agent, "api_token"), agent_token);
        }
        let e = Endpoints::from_toml(
            "[coronafs]\nnbd = \"127.0.0.1:1\"\napi = \"http://127.0.0.1:2\"\napi_token = \"short\"\n",
        );
        assert!(format!("{:#}", e.expect_err("short")).contains("coronafs.api_token"));
    }
}
