//! `coronafs serve --config FILE`: the server's settings as one TOML file.
//!
//! Every field is optional in the file; a flag given on the command line
//! wins over the file, and what neither gives takes the default below.
//! Unknown fields are refused, so a typo never silently falls back to a
//! default. Example (`deploy/docker/config/node01/coronafs.toml`):
//!
//! ```toml
//! data_dir = "/var/lib/coronafs"
//! nbd = "10.89.0.11:10809"
//! api = "10.89.0.11:7070"
//! io_engine = "threads"
//! api_token_file = "/etc/photoncloud/coronafs-api.token"
//! ```
//!
//! The control API's token comes from `--api-token-file`, else
//! `CORONAFS_API_TOKEN`, else `api_token_file` or `api_token` here. Without
//! one the API may listen only on loopback, unless `--no-api-token`
//! (unsafe) is given ([`svc_kit::api_token::check_exposure`]).

use crate::backend::IoEngine;
use crate::error::{CoronaError, Result};
use crate::proto::handshake::TlsMode;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use svc_kit::api_token::{ApiToken, TokenSources};

/// Default NBD listen address.
pub const DEFAULT_NBD: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 10809);
/// Default control API listen address.
pub const DEFAULT_API: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7070);

/// How to run a server: the settings with every default filled in, what
/// [`crate::service::start`] takes.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Directory holding the metadata store and the layer files.
    pub data_dir: PathBuf,
    /// NBD listen address (port 0 picks a free port).
    pub nbd: SocketAddr,
    /// HTTP control API listen address (port 0 picks a free port).
    pub api: SocketAddr,
    /// Data path engine.
    pub engine: IoEngine,
    /// Export every volume read-only.
    pub read_only: bool,
    /// NBD over TLS (STARTTLS).
    pub tls: TlsConfig,
    /// The cluster this server is a node of, and the node's name in it.
    pub cluster: Option<(crate::cluster::ClusterFile, String)>,
    /// The bearer token the control API requires (all but `/healthz` and
    /// `/metrics`); also what this node sends to its cluster's other nodes.
    pub api_token: Option<ApiToken>,
    /// Serve the API without a token even off loopback (`--no-api-token`).
    pub no_api_token: bool,
}

/// NBD over TLS, as nbdkit's `--tls`, `--tls-certificates` and `--tls-verify-peer`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// Off, offered, or required before any other option.
    pub mode: TlsMode,
    /// Directory with `ca-cert.pem`, `server-cert.pem` and `server-key.pem`
    /// (see [`crate::server::tls`]); required unless `mode` is off.
    pub certificates: Option<PathBuf>,
    /// Clients must present a certificate signed by `ca-cert.pem`.
    pub verify_peer: bool,
}

impl ServerConfig {
    /// A config on loopback with OS-chosen ports: what tests and the bench use.
    pub fn ephemeral(data_dir: impl Into<PathBuf>, engine: IoEngine) -> Self {
        ServerConfig {
            data_dir: data_dir.into(),
            nbd: SocketAddr::from(([127, 0, 0, 1], 0)),
            api: SocketAddr::from(([127, 0, 0, 1], 0)),
            engine,
            read_only: false,
            tls: TlsConfig::default(),
            cluster: None,
            api_token: None,
            no_api_token: false,
        }
    }
}

/// The settings of `coronafs serve`, from a file or from flags.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// Directory holding meta.redb and the layer files (created if missing). Required.
    pub data_dir: Option<PathBuf>,
    /// NBD listen address, `IP:PORT` [default: 127.0.0.1:10809].
    pub nbd: Option<SocketAddr>,
    /// Control API and /metrics listen address, `IP:PORT` [default: 127.0.0.1:7070].
    pub api: Option<SocketAddr>,
    /// Data path engine, `threads` or `uring` [default: threads].
    #[serde(default, deserialize_with = "engine")]
    pub io_engine: Option<IoEngine>,
    /// Export every volume read-only [default: false].
    pub read_only: Option<bool>,
    /// NBD over TLS: `require`, `allow` (or `on`) or `off` [default: off].
    #[serde(default, deserialize_with = "tls_mode")]
    pub tls: Option<TlsMode>,
    /// Directory holding ca-cert.pem, server-cert.pem and server-key.pem
    /// (nbdkit's layout). Required when `tls` is not off.
    pub tls_certificates: Option<PathBuf>,
    /// nbdkit's TLS-PSK key file (`username:hexkey` lines). Not implemented:
    /// refused with the reason.
    pub tls_psk: Option<PathBuf>,
    /// Require client certificates signed by ca-cert.pem [default: false].
    pub tls_verify_peer: Option<bool>,
    /// The cluster file (see `crate::cluster`) naming every node and the
    /// replica RPC secret; with it this server is a node of that cluster and
    /// listens for replica connections. Needs `node`.
    pub cluster: Option<PathBuf>,
    /// This node's name in the cluster file; its `nbd` and `api` addresses
    /// there are the defaults of `nbd` and `api`.
    pub node: Option<String>,
    /// The control API's bearer token (at least 16 characters). Prefer
    /// `api_token_file`; `--api-token-file` and `CORONAFS_API_TOKEN` win
    /// over both. The nodes of a cluster share one token.
    pub api_token: Option<String>,
    /// A file holding the control API's bearer token (surrounding
    /// whitespace dropped).
    pub api_token_file: Option<PathBuf>,
    /// `--no-api-token` (a flag only, never from the file): serve without a
    /// token even off loopback.
    #[serde(skip)]
    pub no_api_token: bool,
}

fn tls_mode<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<TlsMode>, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map(Some).map_err(serde::de::Error::custom)
}

fn engine<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<IoEngine>, D::Error> {
    let s = String::deserialize(d)?;
    <IoEngine as clap::ValueEnum>::from_str(&s, false)
        .map(Some)
        .map_err(|_| serde::de::Error::custom(format!("unknown io_engine {s:?}: expected \"threads\" or \"uring\"")))
}

impl ServeSettings {
    /// Parses settings (unknown fields are an error).
    pub fn from_toml(text: &str) -> Result<Self> {
        Ok(svc_kit::config::parse(text)?)
    }

    /// Reads a settings file; errors name the file (and the line of a parse
    /// error). Flags may still override it, so it is checked later, by
    /// [`ServeSettings::into_server_config`].
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(svc_kit::config::load(path)?)
    }

    /// `self` with every field `over` sets replaced (flags over the file).
    pub fn overridden_by(self, over: ServeSettings) -> ServeSettings {
        let token_over = over.api_token.is_some() || over.api_token_file.is_some();
        ServeSettings {
            data_dir: over.data_dir.or(self.data_dir),
            nbd: over.nbd.or(self.nbd),
            api: over.api.or(self.api),
            io_engine: over.io_engine.or(self.io_engine),
            read_only: over.read_only.or(self.read_only),
            tls: over.tls.or(self.tls),
            tls_certificates: over.tls_certificates.or(self.tls_certificates),
            tls_psk: over.tls_psk.or(self.tls_psk),
            tls_verify_peer: over.tls_verify_peer.or(self.tls_verify_peer),
            cluster: over.cluster.or(self.cluster),
            node: over.node.or(self.node),
            // A token given by flag or environment replaces the file's,
            // whichever of its two fields the file used.
            api_token: if token_over { over.api_token } else { self.api_token },
            api_token_file: if token_over { over.api_token_file } else { self.api_token_file },
            no_api_token: over.no_api_token || self.no_api_token,
        }
    }

    /// The server configuration, defaults filled in; `data_dir` is required,
    /// the two listen addresses must differ, TLS needs a certificate
    /// directory (and TLS settings without TLS on are refused, not ignored),
    /// and `tls_psk` is refused as not implemented.
    pub fn into_server_config(self) -> Result<ServerConfig> {
        let data_dir = self.data_dir.ok_or_else(|| {
            CoronaError::Config("no data directory: give --data-dir or data_dir in the --config file".into())
        })?;
        if let Some(psk) = &self.tls_psk {
            return Err(crate::server::tls::psk_unsupported(psk));
        }
        let tls = TlsConfig {
            mode: self.tls.unwrap_or_default(),
            certificates: self.tls_certificates,
            verify_peer: self.tls_verify_peer.unwrap_or(false),
        };
        match (tls.mode, &tls.certificates) {
            (TlsMode::Off, Some(dir)) => {
                return Err(CoronaError::Config(format!(
                    "--tls-certificates {} given but TLS is off: add --tls require (or allow)",
                    dir.display()
                )));
            }
            (TlsMode::Off, None) if tls.verify_peer => {
                return Err(CoronaError::Config("--tls-verify-peer given but TLS is off".into()));
            }
            (mode @ (TlsMode::Allow | TlsMode::Require), None) => {
                return Err(CoronaError::Config(format!(
                    "--tls {mode} needs --tls-certificates DIR (ca-cert.pem, server-cert.pem, server-key.pem)"
                )));
            }
            _ => {}
        }
        let cluster = match (&self.cluster, self.node) {
            (Some(path), Some(node)) => {
                let file = crate::cluster::ClusterFile::load(path)?;
                file.node(&node).map_err(|e| CoronaError::Config(format!("{}: {e}", path.display())))?;
                Some((file, node))
            }
            (None, None) => None,
            (Some(_), None) => return Err(CoronaError::Config("cluster given without node: name this node".into())),
            (None, Some(_)) => return Err(CoronaError::Config("node given without a cluster file".into())),
        };
        let api_token =
            TokenSources { config_file: self.api_token_file, config_token: self.api_token, ..Default::default() }
                .resolve()?;
        let me = cluster.as_ref().and_then(|(f, n)| f.node(n).ok());
        let cfg = ServerConfig {
            data_dir,
            nbd: self.nbd.or(me.map(|n| n.nbd)).unwrap_or(DEFAULT_NBD),
            api: self.api.or(me.map(|n| n.api)).unwrap_or(DEFAULT_API),
            engine: self.io_engine.unwrap_or(IoEngine::Threads),
            read_only: self.read_only.unwrap_or(false),
            tls,
            cluster,
            api_token,
            no_api_token: self.no_api_token,
        };
        if cfg.nbd == cfg.api && cfg.nbd.port() != 0 {
            return Err(CoronaError::Config(format!("nbd and api both listen on {}", cfg.nbd)));
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_gives_every_setting() {
        let s = ServeSettings::from_toml(
            "data_dir = \"/srv/c\"\nnbd = \"10.0.0.1:10809\"\napi = \"10.0.0.1:7070\"\nio_engine = \"uring\"\nread_only = true\n",
        )
        .expect("parse");
        let c = s.into_server_config().expect("valid");
        assert_eq!(c.data_dir, PathBuf::from("/srv/c"));
        assert_eq!(c.nbd, "10.0.0.1:10809".parse().expect("addr"));
        assert_eq!(c.api.port(), 7070);
        assert_eq!(c.engine, IoEngine::Uring);
        assert!(c.read_only);
    }

    #[test]
    fn flags_win_over_the_file_and_defaults_fill_the_rest() {
        let file = ServeSettings::from_toml("data_dir = \"/a\"\nnbd = \"10.0.0.1:1\"\n").expect("parse");
        let flags = ServeSettings { nbd: Some("10.0.0.2:2".parse().expect("addr")), ..Default::default() };
        let c = file.overridden_by(flags).into_server_config().expect("valid");
        assert_eq!(c.data_dir, PathBuf::from("/a"));
        assert_eq!(c.nbd.port(), 2);
        assert_eq!(c.api, DEFAULT_API);
        assert_eq!(c.engine, IoEngine::Threads);
        assert!(!c.read_only);
    }

    #[test]
    fn unknown_fields_bad_values_and_missing_data_dir_are_refused() {
        let e = ServeSettings::from_toml("data_dir = \"/a\"\ndata-dir = \"/b\"\n").unwrap_err();
        assert!(e.to_string().contains("data-dir"), "{e}");
        let e = ServeSettings::from_toml("io_engine = \"aio\"\n").unwrap_err();
        assert!(e.to_string().contains("aio"), "{e}");
        assert!(ServeSettings::from_toml("nbd = \"somehost\"\n").is_err());
        let e = ServeSettings::default().into_server_config().unwrap_err();
        assert!(e.to_string().contains("data_dir"), "{e}");
        let same = ServeSettings {
            data_dir: Some("/a".into()),
            nbd: Some(DEFAULT_API),
            api: Some(DEFAULT_API),
            ..Default::default()
        };
        assert!(same.into_server_config().is_err());
    }

    #[test]
    fn tls_settings_need_each_other_and_psk_is_refused_as_not_implemented() {
        let s = ServeSettings::from_toml(
            "data_dir = \"/a\"\ntls = \"require\"\ntls_certificates = \"/pki\"\ntls_verify_peer = true\n",
        )
        .expect("parse");
        let c = s.into_server_config().expect("valid").tls;
        assert_eq!(c, TlsConfig { mode: TlsMode::Require, certificates: Some("/pki".into()), verify_peer: true });
        let on = ServeSettings::from_toml("data_dir = \"/a\"\ntls = \"on\"\ntls_certificates = \"/pki\"\n");
        assert_eq!(on.expect("parse").into_server_config().expect("valid").tls.mode, TlsMode::Allow, "nbdkit's on");
        let e = ServeSettings::from_toml("tls = \"maybe\"\n").expect_err("refused");
        assert!(e.to_string().contains("maybe"), "{e}");
        let base = || ServeSettings { data_dir: Some("/a".into()), ..Default::default() };
        let e = ServeSettings { tls: Some(TlsMode::Require), ..base() }.into_server_config().expect_err("refused");
        assert!(e.to_string().contains("--tls-certificates"), "{e}");
        let e = ServeSettings { tls_certificates: Some("/pki".into()), ..base() }
            .into_server_config()
            .expect_err("refused");
        assert!(e.to_string().contains("TLS is off"), "{e}");
        let e = ServeSettings { tls_verify_peer: Some(true), ..base() }.into_server_config().expect_err("refused");
        assert!(e.to_string().contains("TLS is off"), "{e}");
        let psk = ServeSettings {
            tls: Some(TlsMode::Require),
            tls_psk: Some("/k/keys.psk".into()),
            tls_certificates: Some("/pki".into()),
            ..base()
        };
        let e = psk.into_server_config().expect_err("refused").to_string();
        assert!(e.contains("--tls-psk /k/keys.psk is not implemented"), "{e}");
        assert_eq!(base().into_server_config().expect("valid").tls, TlsConfig::default(), "TLS is off by default");
    }

    #[test]
    fn a_cluster_node_takes_its_addresses_from_the_cluster_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("cluster.toml");
        let nodes = "[[nodes]]\nname = \"n1\"\nnbd = \"127.0.0.1:5001\"\napi = \"127.0.0.1:5002\"\nreplica = \"127.0.0.1:5003\"\n\
                     [[nodes]]\nname = \"n2\"\nnbd = \"127.0.0.1:6001\"\napi = \"127.0.0.1:6002\"\nreplica = \"127.0.0.1:6003\"\n";
        std::fs::write(&path, format!("rpc_secret = \"{}\"\n{nodes}", "0f".repeat(32))).expect("write");
        let text = format!("data_dir = \"/a\"\ncluster = \"{}\"\nnode = \"n2\"\n", path.display());
        let c = ServeSettings::from_toml(&text).expect("parse").into_server_config().expect("valid");
        assert_eq!(c.nbd.port(), 6001);
        assert_eq!(c.api.port(), 6002);
        assert_eq!(c.cluster.as_ref().map(|(f, n)| (f.nodes.len(), n.as_str())), Some((2, "n2")));
        let e = ServeSettings::from_toml(&text.replace("n2", "n9")).expect("parse").into_server_config();
        assert!(e.expect_err("unknown node").to_string().contains("n9"));
        let e = ServeSettings::from_toml(&text.replace("node = \"n2\"\n", "")).expect("parse").into_server_config();
        assert!(e.expect_err("no node").to_string().contains("without node"));
        std::fs::write(&path, format!("rpc_secret = \"abc\"\n{nodes}")).expect("write");
        let e = ServeSettings::from_toml(&text).expect("parse").into_server_config().expect_err("bad secret");
        assert!(e.to_string().contains("cluster.toml") && e.to_string().contains("64 hex digits"), "{e}");
    }

    #[test]
    fn the_api_token_comes_from_the_file_or_its_flag_and_a_bad_one_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("token");
        std::fs::write(&path, "from-the-token-file-0123\n").expect("write");
        let file =
            ServeSettings::from_toml("data_dir = \"/a\"\napi_token = \"from-the-config-0123456\"\n").expect("parse");
        let c = file.clone().into_server_config().expect("valid");
        assert_eq!(c.api_token.as_ref().map(|t| t.expose()), Some("from-the-config-0123456"));
        let flags = ServeSettings { api_token_file: Some(path.clone()), ..Default::default() };
        let c = file.clone().overridden_by(flags).into_server_config().expect("the flag's file replaces api_token");
        assert_eq!(c.api_token.as_ref().map(|t| t.expose()), Some("from-the-token-file-0123"));
        let both = ServeSettings { api_token_file: Some(path), ..file };
        let e = both.into_server_config().expect_err("both in one file").to_string();
        assert!(e.contains("both api_token and api_token_file"), "{e}");
        let short = ServeSettings::from_toml("data_dir = \"/a\"\napi_token = \"short\"\n").expect("parse");
        let e = short.into_server_config().expect_err("short").to_string();
        assert!(e.contains("api_token") && e.contains("at least 16"), "{e}");
        let none = ServeSettings::from_toml("data_dir = \"/a\"\n").expect("parse").into_server_config().expect("ok");
        assert!(none.api_token.is_none() && !none.no_api_token);
        assert!(ServeSettings::from_toml("no_api_token = true\n").is_err(), "--no-api-token is a flag only");
    }

    #[test]
    fn file_errors_name_the_file_and_the_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("coronafs.toml");
        let e = ServeSettings::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("cannot read {}: ", path.display())), "{e}");
        std::fs::write(&path, "data_dir = \"/a\"\nread_only = maybe\n").expect("write");
        let e = ServeSettings::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}:2:", path.display())), "{e}");
        std::fs::write(&path, "data_dir = \"/a\"\nio_engine = \"aio\"\n").expect("write");
        let e = ServeSettings::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}:2:13: unknown io_engine \"aio\"", path.display())), "{e}");
        std::fs::write(&path, "data_dir = \"/a\"\n").expect("write");
        assert_eq!(ServeSettings::from_file(&path).expect("good").data_dir, Some(PathBuf::from("/a")));
    }
}
