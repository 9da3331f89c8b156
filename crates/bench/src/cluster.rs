//! The cluster the storage bench measures: either started in-process on
//! loopback (each service with its own data dir under one temporary
//! directory, removed at shutdown) or already deployed and described by a
//! TOML file. Either way the bench only sees [`Endpoints`] and speaks the
//! services' real protocols to them.
//!
//! With link emulation each endpoint is fronted by a [`Shaper`]; the bench's
//! own set-up traffic (creating and filling volumes) uses the unshaped
//! addresses so only measured traffic crosses the emulated link.
//!
//! The embedded cluster is one CoronaFS node, a LightningStor cluster of
//! [`EMBEDDED_S3_NODES`] nodes replicating every object [`EMBEDDED_RF`] ways
//! over TCP between them, and PlasmaVMC using both. Where the emulated link
//! sits for PlasmaVMC is explained at [`Cluster::embedded`].

use crate::shaper::{LinkSpec, Nic, Shaper};
use anyhow::{Context, bail};
use coronafs::backend::IoEngine;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// LightningStor nodes the embedded cluster starts (the S3 sections spread
/// their clients over all of them).
pub const EMBEDDED_S3_NODES: usize = 3;
/// Copies of every object in the embedded LightningStor cluster.
pub const EMBEDDED_RF: usize = 3;
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
}

impl Endpoints {
    /// Reads and checks a cluster file.
    pub fn from_file(path: &Path) -> anyhow::Result<Endpoints> {
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        Self::from_toml(&text).with_context(|| path.display().to_string())
    }

    pub fn from_toml(text: &str) -> anyhow::Result<Endpoints> {
        let e: Endpoints = toml::from_str(text)?;
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
        }
        if let Some(p) = &e.plasmavmc {
            url_addr(&p.url).context("plasmavmc.url")?;
        }
        Ok(e)
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
    corona: coronafs::server::RunningServer,
    s3: Vec<lightningstor::cluster::RunningNode>,
    /// Node-to-node addresses of the LightningStor nodes.
    rpc: Vec<SocketAddr>,
    plasma: plasmavmc::Server,
}

/// A loopback address nothing listens on right now (bound, then released).
fn free_addr() -> anyhow::Result<SocketAddr> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?)
}

/// Starts a LightningStor cluster in this process: every node with its own
/// data dir under `base`, S3 and node-to-node RPC on loopback TCP. Node
/// addresses go into the shared cluster file before any node starts, so a
/// port taken in between makes the attempt fail; it is retried.
async fn start_s3_cluster(base: &Path) -> anyhow::Result<(Vec<lightningstor::cluster::RunningNode>, Vec<SocketAddr>)> {
    let mut last = None;
    for attempt in 0..3 {
        let dir = base.join(format!("attempt-{attempt}"));
        let mut cfg = lightningstor::cluster::ClusterConfig::init(EMBEDDED_S3_NODES, &dir, 1)?;
        cfg.replication_factor = EMBEDDED_RF;
        cfg.access_key = Some(EMBEDDED_KEYS.0.into());
        cfg.secret_key = Some(EMBEDDED_KEYS.1.into());
        cfg.anonymous = false;
        for n in &mut cfg.nodes {
            n.s3 = free_addr()?;
            n.rpc = free_addr()?;
        }
        cfg.validate()?;
        let rpc = cfg.nodes.iter().map(|n| n.rpc).collect();
        let mut nodes = Vec::new();
        let mut failed = None;
        for n in &cfg.nodes {
            match lightningstor::cluster::start(cfg.clone(), &n.name).await {
                Ok(r) => nodes.push(r),
                Err(e) => {
                    failed = Some(anyhow::anyhow!("starting LightningStor node {}: {e}", n.name));
                    break;
                }
            }
        }
        match failed {
            None => return Ok((nodes, rpc)),
            Some(e) => {
                for n in nodes {
                    n.shutdown().await;
                }
                tracing::warn!(error = %e, attempt, "retrying the LightningStor cluster start");
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("LightningStor did not start")))
}

/// A cluster to measure.
pub struct Cluster {
    /// What measured clients connect to (through the shapers, if any).
    pub endpoints: Endpoints,
    /// The same services without link emulation, for set-up traffic.
    pub setup: Endpoints,
    pub link: LinkSpec,
    /// `embedded` or the cluster file's path.
    pub origin: String,
    embedded: Option<Embedded>,
    shapers: Vec<Shaper>,
    /// The PlasmaVMC host's interface on the emulated link (embedded only).
    nic: Option<Nic>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("endpoints", &self.endpoints).field("origin", &self.origin).finish()
    }
}

impl Cluster {
    /// Starts CoronaFS, a replicated LightningStor cluster and PlasmaVMC in
    /// this process on loopback.
    ///
    /// With link emulation, the bench's clients reach every service through
    /// their own shaping proxy (the client's link). PlasmaVMC models the
    /// seed's `node01`, which ran PlasmaVMC and the CoronaFS export while the
    /// LightningStor replicas sat on other machines: it gets one emulated
    /// interface ([`Nic`], a rate per direction) that carries both the client's
    /// uploads to it (received) and its own S3 traffic to LightningStor
    /// (multipart parts sent, range GETs received). Its writes into CoronaFS
    /// stay local (same host), and LightningStor's node-to-node replication
    /// runs on its own, unemulated network.
    pub async fn embedded(link: LinkSpec) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("fresh-bench-storage-").tempdir()?;
        let cfg = coronafs::server::ServerConfig::ephemeral(dir.path().join("coronafs"), IoEngine::Uring);
        let corona = coronafs::server::start(cfg).await.context("starting CoronaFS")?;
        let (s3, rpc) = match start_s3_cluster(&dir.path().join("lightningstor")).await {
            Ok(x) => x,
            Err(e) => {
                corona.shutdown().await;
                return Err(e);
            }
        };
        let nic = (!link.is_loopback()).then(|| Nic::new(link));
        let mut shapers = Vec::new();
        let s3_for_plasma = match &nic {
            Some(n) => {
                let sh = n.outbound(s3[0].s3.addr).await?;
                let a = sh.addr;
                shapers.push(sh);
                a
            }
            None => s3[0].s3.addr,
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
            ..plasmavmc::Config::default()
        };
        let plasma = match plasmavmc::Server::start(pcfg).await {
            Ok(p) => p,
            Err(e) => {
                for sh in shapers {
                    sh.shutdown().await;
                }
                for n in s3 {
                    n.shutdown().await;
                }
                corona.shutdown().await;
                return Err(anyhow::anyhow!("starting PlasmaVMC: {e}"));
            }
        };
        let setup = Endpoints {
            coronafs: Some(CoronaEndpoint { nbd: corona.nbd_addr.to_string(), api: corona.api_url() }),
            lightningstor: Some(S3Endpoint {
                endpoints: s3.iter().map(|r| format!("http://{}", r.s3.addr)).collect(),
                access_key: EMBEDDED_KEYS.0.into(),
                secret_key: EMBEDDED_KEYS.1.into(),
                region: default_region(),
            }),
            plasmavmc: Some(PlasmaEndpoint { url: plasma.url() }),
        };
        let mut c = Cluster {
            endpoints: setup.clone(),
            setup,
            link,
            origin: "embedded".into(),
            embedded: Some(Embedded { dir, corona, s3, rpc, plasma }),
            shapers,
            nic,
        };
        if let Err(e) = c.shape().await {
            c.shutdown().await;
            return Err(e);
        }
        Ok(c)
    }

    /// A deployed cluster described by `endpoints`.
    pub async fn external(endpoints: Endpoints, origin: &str, link: LinkSpec) -> anyhow::Result<Cluster> {
        let mut c = Cluster {
            endpoints: endpoints.clone(),
            setup: endpoints,
            link,
            origin: origin.into(),
            embedded: None,
            shapers: Vec::new(),
            nic: None,
        };
        c.shape().await?;
        Ok(c)
    }

    /// Puts a shaping proxy in front of every endpoint: PlasmaVMC's through
    /// its host's interface when embedded, the others each their own link.
    async fn shape(&mut self) -> anyhow::Result<()> {
        if self.link.is_loopback() {
            return Ok(());
        }
        if let Some(c) = &mut self.endpoints.coronafs {
            let sh = Shaper::start(host_port(&c.nbd)?, self.link).await?;
            c.nbd = sh.addr.to_string();
            self.shapers.push(sh);
        }
        if let Some(s) = &mut self.endpoints.lightningstor {
            for u in s.endpoints.iter_mut() {
                let sh = Shaper::start(url_addr(u)?, self.link).await?;
                *u = format!("http://{}", sh.addr);
                self.shapers.push(sh);
            }
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
        if self.link.is_loopback() {
            return "loopback: no link emulation anywhere on the path".into();
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

    /// Every listening address of the embedded services and proxies.
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        let mut v: Vec<SocketAddr> = self.shapers.iter().map(|s| s.addr).collect();
        if let Some(e) = &self.embedded {
            v.push(e.corona.nbd_addr);
            v.push(e.corona.api_addr);
            v.extend(e.s3.iter().map(|r| r.s3.addr));
            v.extend(e.rpc.iter().copied());
            v.push(e.plasma.addr);
        }
        v
    }

    /// Stops proxies and embedded services and removes their data.
    pub async fn shutdown(self) {
        for s in self.shapers {
            s.shutdown().await;
        }
        if let Some(e) = self.embedded {
            e.plasma.shutdown().await;
            for r in e.s3 {
                r.shutdown().await;
            }
            e.corona.shutdown().await;
            let path = e.dir.path().to_owned();
            if let Err(err) = e.dir.close() {
                tracing::warn!(error = %err, path = %path.display(), "could not remove the cluster's data");
            }
        }
    }
}

/// Creates a CoronaFS volume through the control API.
pub async fn create_volume(api: &str, name: &str, size: u64) -> anyhow::Result<()> {
    let resp = reqwest::Client::new()
        .post(format!("{api}/v1/volumes"))
        .json(&coronafs::api::CreateVolume { name: name.into(), size: Some(size), from_snapshot: None })
        .send()
        .await
        .with_context(|| format!("POST {api}/v1/volumes"))?;
    if !resp.status().is_success() {
        bail!("creating volume {name}: {} {}", resp.status(), resp.text().await.unwrap_or_default());
    }
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
}
