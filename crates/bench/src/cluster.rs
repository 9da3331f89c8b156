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
//! Services not in this build (PlasmaVMC; LightningStor replication) are
//! absent from [`Endpoints`], and the report says "not available in this
//! build" for their sections.

use crate::shaper::{LinkSpec, Shaper};
use anyhow::{Context, bail};
use coronafs::backend::IoEngine;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// LightningStor nodes the embedded cluster starts. One until replication
/// lands; then three, and the S3 sections address all of them.
pub const EMBEDDED_S3_NODES: usize = 1;
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
            c.nbd.parse::<SocketAddr>().with_context(|| format!("coronafs.nbd {:?} is not host:port", c.nbd))?;
        }
        Ok(e)
    }
}

/// `http://1.2.3.4:9000[/]` -> the socket address.
pub fn url_addr(url: &str) -> anyhow::Result<SocketAddr> {
    let rest = url.strip_prefix("http://").with_context(|| format!("{url}: only http:// endpoints are supported"))?;
    rest.trim_end_matches('/').parse().with_context(|| format!("{url}: expected http://IP:PORT"))
}

struct Embedded {
    dir: tempfile::TempDir,
    corona: coronafs::server::RunningServer,
    s3: Vec<lightningstor::server::Running>,
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
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("endpoints", &self.endpoints).field("origin", &self.origin).finish()
    }
}

impl Cluster {
    /// Starts CoronaFS and LightningStor in this process on loopback.
    pub async fn embedded(link: LinkSpec) -> anyhow::Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("fresh-bench-storage-").tempdir()?;
        let cfg = coronafs::server::ServerConfig::ephemeral(dir.path().join("coronafs"), IoEngine::Uring);
        let corona = coronafs::server::start(cfg).await.context("starting CoronaFS")?;
        let mut s3 = Vec::new();
        for i in 0..EMBEDDED_S3_NODES {
            let mut cfg = lightningstor::Config::new(dir.path().join(format!("lightningstor-{i}")))
                .with_keys(EMBEDDED_KEYS.0, EMBEDDED_KEYS.1);
            cfg.listen = SocketAddr::from(([127, 0, 0, 1], 0));
            let (running, _store) = lightningstor::server::start(cfg).await.context("starting LightningStor")?;
            s3.push(running);
        }
        let setup = Endpoints {
            coronafs: Some(CoronaEndpoint { nbd: corona.nbd_addr.to_string(), api: corona.api_url() }),
            lightningstor: Some(S3Endpoint {
                endpoints: s3.iter().map(|r| format!("http://{}", r.addr)).collect(),
                access_key: EMBEDDED_KEYS.0.into(),
                secret_key: EMBEDDED_KEYS.1.into(),
                region: default_region(),
            }),
            plasmavmc: None,
        };
        let mut c = Cluster {
            endpoints: setup.clone(),
            setup,
            link,
            origin: "embedded".into(),
            embedded: Some(Embedded { dir, corona, s3 }),
            shapers: Vec::new(),
        };
        c.shape().await?;
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
        };
        c.shape().await?;
        Ok(c)
    }

    /// Puts a shaping proxy in front of every NBD and S3 endpoint.
    async fn shape(&mut self) -> anyhow::Result<()> {
        if self.link.is_loopback() {
            return Ok(());
        }
        if let Some(c) = &mut self.endpoints.coronafs {
            let sh = Shaper::start(c.nbd.parse()?, self.link).await?;
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
        Ok(())
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
            v.extend(e.s3.iter().map(|r| r.addr));
        }
        v
    }

    /// Stops proxies and embedded services and removes their data.
    pub async fn shutdown(self) {
        for s in self.shapers {
            s.shutdown().await;
        }
        if let Some(e) = self.embedded {
            e.corona.shutdown().await;
            for r in e.s3 {
                r.shutdown().await;
            }
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
        assert!(Endpoints::from_toml("[coronafs]\nnbd = \"nohost\"\napi = \"y\"").is_err());
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
