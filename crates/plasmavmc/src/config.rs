//! Server configuration: a TOML file or flags, validated before start.

use crate::error::{PlasmaError, Result};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use svc_kit::api_token::{ApiToken, TokenSources};

/// Everything a PlasmaVMC server needs.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// REST API listen address (port 0 picks one).
    pub listen: SocketAddr,
    /// Directory for the metadata database and conversion scratch files.
    pub data_dir: PathBuf,
    /// LightningStor (S3) endpoint, e.g. `http://127.0.0.1:9000`.
    pub s3_endpoint: String,
    /// Bucket holding image artifacts (created if missing).
    pub s3_bucket: String,
    /// S3 access key.
    pub s3_access_key: String,
    /// S3 secret key.
    pub s3_secret_key: String,
    /// S3 region used in signatures.
    pub s3_region: String,
    /// CoronaFS control API, e.g. `http://127.0.0.1:7070`.
    pub coronafs_api: String,
    /// CoronaFS NBD address, e.g. `127.0.0.1:10809`.
    pub coronafs_nbd: String,
    /// The NBD addresses of the other nodes of a CoronaFS cluster
    /// (`host:port`), where in-process workers look for a replicated
    /// volume's primary after a failover. Empty: `coronafs_nbd` only.
    pub coronafs_nodes: Vec<String>,
    /// Largest accepted virtual image size in bytes.
    pub max_virtual_size: u64,
    /// Largest accepted artifact in bytes.
    pub max_artifact_size: u64,
    /// Multipart part size for uploads to LightningStor (default 8 MiB). The
    /// last part leaves only after the client's upload ends, so a smaller part
    /// shortens that tail: at 20 MiB/s an 8 MiB part is 0.4 s.
    pub part_size: u64,
    /// Parallel range GETs when fetching an artifact.
    pub fetch_parallelism: usize,
    /// Size of each range GET.
    pub fetch_chunk: u64,
    /// Most cached image bases kept in CoronaFS.
    pub cache_max_bases: usize,
    /// Most bytes (sum of virtual sizes) of cached bases.
    pub cache_max_bytes: u64,
    /// Allow imports from loopback, private and link-local addresses (tests).
    pub allow_private_urls: bool,
    /// An upload (or import) that receives no byte for this many seconds
    /// fails, so a stalled client cannot keep an image `uploading` forever.
    pub upload_idle_timeout_secs: u64,
    /// `plasmavmc agent` processes VMs are placed on (`[[workers]]` tables).
    /// Empty: workers are in-process objects created by name on first use.
    pub workers: Vec<WorkerConfig>,
    /// The REST API's bearer token (16 characters or more; every route but
    /// `GET /healthz` and `GET /metrics` needs it). Prefer `api_token_file`;
    /// `--api-token-file` and `PLASMAVMC_API_TOKEN` win over both.
    pub api_token: Option<String>,
    /// A file holding the REST API's token.
    pub api_token_file: Option<PathBuf>,
    /// The token of the CoronaFS control API (`coronafs_api`); prefer
    /// `coronafs_api_token_file`. `--coronafs-api-token-file` and
    /// `CORONAFS_API_TOKEN` win over both.
    pub coronafs_api_token: Option<String>,
    /// A file holding the CoronaFS control API's token.
    pub coronafs_api_token_file: Option<PathBuf>,
    /// The token of the worker agents (`[[workers]]`; one for all of them).
    /// `--agent-token-file` and `PLASMAVMC_AGENT_TOKEN` win over it and
    /// `agent_token_file`.
    pub agent_token: Option<String>,
    /// A file holding the worker agents' token.
    pub agent_token_file: Option<PathBuf>,
    /// `--no-api-token` (a flag only): serve without a token off loopback.
    #[serde(skip)]
    pub no_api_token: bool,
}

/// The tokens of a [`Config`], read and checked.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// What the REST API requires.
    pub api: Option<ApiToken>,
    /// What is sent to CoronaFS's control API.
    pub coronafs: Option<ApiToken>,
    /// What is sent to the worker agents.
    pub agents: Option<ApiToken>,
}

/// A token from a config's `NAME` / `NAME_file` pair (not both).
pub fn token(name: &str, text: &Option<String>, file: &Option<PathBuf>) -> Result<Option<ApiToken>> {
    TokenSources { config_token: text.clone(), config_file: file.clone(), ..Default::default() }
        .resolve()
        .map_err(|e| PlasmaError::Config(format!("{name}: {e}")))
}

/// One `[[workers]]` entry.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The worker's name (what `POST /v1/vms {worker}` names).
    pub name: String,
    /// Its agent's API, e.g. `http://10.0.0.2:8090`.
    pub url: String,
}

/// Refuses an address that is not `host:port`.
pub fn check_host_port(key: &str, v: &str) -> Result<()> {
    if v.rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()) {
        return Err(PlasmaError::Config(format!("{key} {v:?} must be host:port")));
    }
    Ok(())
}

/// The CoronaFS NBD addresses to look for a volume's primary at: `first`,
/// then the others of `more` in their order.
pub fn nbd_nodes(first: &str, more: &[String]) -> Vec<String> {
    std::iter::once(first.to_owned()).chain(more.iter().filter(|n| *n != first).cloned()).collect()
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from("./plasmavmc-data"),
            s3_endpoint: "http://127.0.0.1:9000".into(),
            s3_bucket: "images".into(),
            s3_access_key: String::new(),
            s3_secret_key: String::new(),
            s3_region: "us-east-1".into(),
            coronafs_api: "http://127.0.0.1:7070".into(),
            coronafs_nbd: "127.0.0.1:10809".into(),
            coronafs_nodes: Vec::new(),
            max_virtual_size: 16 << 40,
            max_artifact_size: 1 << 40,
            part_size: 8 << 20,
            fetch_parallelism: 8,
            fetch_chunk: 8 << 20,
            cache_max_bases: 16,
            cache_max_bytes: 1 << 40,
            allow_private_urls: false,
            upload_idle_timeout_secs: 120,
            workers: Vec::new(),
            api_token: None,
            api_token_file: None,
            coronafs_api_token: None,
            coronafs_api_token_file: None,
            agent_token: None,
            agent_token_file: None,
            no_api_token: false,
        }
    }
}

impl Config {
    /// Reads a TOML file (unknown fields are an error; errors name the
    /// file). Flags may still override it, so the caller validates the result.
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(svc_kit::config::load(path)?)
    }

    /// Parses TOML (unknown fields are an error).
    pub fn from_toml(text: &str) -> Result<Self> {
        Ok(svc_kit::config::parse(text)?)
    }

    /// The tokens, each read from its `NAME` or `NAME_file` field.
    pub fn tokens(&self) -> Result<Tokens> {
        Ok(Tokens {
            api: token("api_token", &self.api_token, &self.api_token_file)?,
            coronafs: token("coronafs_api_token", &self.coronafs_api_token, &self.coronafs_api_token_file)?,
            agents: token("agent_token", &self.agent_token, &self.agent_token_file)?,
        })
    }

    /// Checks the rules a configuration must follow before the server starts.
    pub fn validate(&self) -> Result<()> {
        self.tokens()?;
        let bad = |m: String| Err(PlasmaError::Config(m));
        if url::Url::parse(&self.s3_endpoint).is_err() {
            return bad(format!("s3_endpoint {:?} is not a URL", self.s3_endpoint));
        }
        if url::Url::parse(&self.coronafs_api).is_err() {
            return bad(format!("coronafs_api {:?} is not a URL", self.coronafs_api));
        }
        if self.s3_bucket.is_empty() {
            return bad("s3_bucket must not be empty".into());
        }
        if self.part_size < (5 << 20) || self.part_size > (5 << 30) {
            return bad("part_size must be between 5 MiB and 5 GiB (S3 multipart rules)".into());
        }
        if self.upload_idle_timeout_secs == 0 {
            return bad("upload_idle_timeout_secs must be at least 1".into());
        }
        if self.fetch_parallelism == 0 || self.fetch_parallelism > 64 {
            return bad("fetch_parallelism must be 1..=64".into());
        }
        if self.fetch_chunk < 65536 || self.fetch_chunk > (256 << 20) {
            return bad("fetch_chunk must be between 64 KiB and 256 MiB".into());
        }
        if self.cache_max_bases == 0 {
            return bad("cache_max_bases must be at least 1".into());
        }
        check_host_port("coronafs_nbd", &self.coronafs_nbd)?;
        for n in &self.coronafs_nodes {
            check_host_port("coronafs_nodes", n)?;
        }
        let mut seen = std::collections::HashSet::new();
        for w in &self.workers {
            crate::wire::check_worker(&w.name).map_err(|e| PlasmaError::Config(format!("workers: {e}")))?;
            if !seen.insert(w.name.as_str()) {
                return bad(format!("workers: {:?} is listed twice", w.name));
            }
            if !url::Url::parse(&w.url).is_ok_and(|u| matches!(u.scheme(), "http" | "https")) {
                return bad(format!("workers: url {:?} of {:?} is not an http(s) URL", w.url, w.name));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_refused() {
        let e = Config::from_toml("listen = \"127.0.0.1:1\"\nbogus = 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
    }

    #[test]
    fn a_partial_file_fills_in_defaults_and_validates() {
        let c = Config::from_toml("s3_bucket = \"b\"\ncache_max_bases = 2\n").expect("parse");
        assert_eq!(c.s3_bucket, "b");
        assert_eq!(c.cache_max_bases, 2);
        assert_eq!(c.part_size, Config::default().part_size);
        c.validate().expect("valid");
        let c = Config { part_size: 1, ..c };
        assert!(c.validate().is_err());
    }

    #[test]
    fn workers_are_listed_with_a_name_and_an_http_url() {
        let text = "[[workers]]\nname = \"a\"\nurl = \"http://127.0.0.1:8091\"\n[[workers]]\nname = \"b\"\nurl = \"http://127.0.0.1:8092\"\n";
        let c = Config::from_toml(text).expect("parse");
        assert_eq!(c.workers.len(), 2);
        c.validate().expect("valid");
        let dup = Config { workers: vec![c.workers[0].clone(), c.workers[0].clone()], ..c.clone() };
        assert!(dup.validate().unwrap_err().to_string().contains("twice"));
        let mut bad = c.clone();
        bad.workers[1].url = "ftp://x".into();
        assert!(bad.validate().is_err());
        let e = Config::from_toml("[[workers]]\nname = \"a\"\nurl = \"http://x\"\nport = 1\n").unwrap_err();
        assert!(e.to_string().contains("port"), "{e}");
    }

    #[test]
    fn file_errors_name_the_file_the_line_and_the_field() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("plasmavmc.toml");
        let e = Config::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("cannot read {}: ", path.display())), "{e}");
        std::fs::write(&path, "s3_bucket = \"b\"\n[[workers]]\nname = \"a\"\nurl = \"http://x\"\nport = 1\n")
            .expect("write");
        let e = Config::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}:5:1: unknown field `port`", path.display())), "{e}");
        std::fs::write(&path, "s3_bucket = \"b\"\npart_size = 1\n").expect("write");
        let c = Config::from_file(&path).expect("flags may still fix it: loading does not validate");
        assert!(c.validate().is_err());
    }
}
