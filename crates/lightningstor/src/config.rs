//! Server configuration: a TOML file, overridden by CLI flags and environment.
//!
//! [`Config`] is what the server runs with; [`Config::validate`] enforces the
//! rules that keep a misconfigured node from starting (notably: no keys and no
//! explicit `anonymous = true` is refused).

use crate::error::{LightningError, Result};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Default block size: objects are cut into blocks of this many bytes.
pub const DEFAULT_BLOCK_SIZE: usize = 1024 * 1024;
/// Default inline threshold: objects up to this size live in the metadata row.
pub const DEFAULT_INLINE_THRESHOLD: usize = 8 * 1024;

/// Everything a LightningStor node needs to run.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Directory holding the metadata database and the block files.
    pub data_dir: PathBuf,
    /// S3 (and /metrics) listen address.
    pub listen: SocketAddr,
    /// Access key id clients sign with. Needs `secret_key`.
    pub access_key: Option<String>,
    /// Secret key clients sign with. Needs `access_key`.
    pub secret_key: Option<String>,
    /// Accept unsigned requests. Must be set explicitly to run without keys.
    pub anonymous: bool,
    /// Region reported by GetBucketLocation and used in signatures.
    pub region: String,
    /// Base domains for virtual-hosted-style requests (`BUCKET.DOMAIN`).
    pub domains: Vec<String>,
    /// Size in bytes of the blocks objects are cut into.
    pub block_size: usize,
    /// Objects up to this many bytes are stored inline in the metadata row.
    pub inline_threshold: usize,
    /// fsync blocks and metadata before acknowledging a write (never turn off in production).
    pub fsync: bool,
    /// Set by the cluster, never read from a file: the partition count of a
    /// cluster node, whose store then keeps the anti-entropy hash trees
    /// ([`crate::meta::merkle`]). `None` for a single node, which keeps none.
    #[serde(skip)]
    pub tree_partitions: Option<u32>,
    /// Length in seconds of a lifecycle "day" (rule `Days` count in these).
    /// 86400; smaller only in tests, so they can age objects in seconds.
    pub lifecycle_day_secs: u64,
    /// Seconds between rounds of the lifecycle task.
    pub lifecycle_interval_secs: u64,
}

/// A lifecycle day: 24 hours.
pub const DEFAULT_LIFECYCLE_DAY_SECS: u64 = 86_400;
/// The lifecycle task runs hourly by default.
pub const DEFAULT_LIFECYCLE_INTERVAL_SECS: u64 = 3600;

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("./lightningstor-data"),
            listen: SocketAddr::from(([127, 0, 0, 1], 9000)),
            access_key: None,
            secret_key: None,
            anonymous: false,
            region: "us-east-1".to_owned(),
            domains: vec!["localhost".to_owned()],
            block_size: DEFAULT_BLOCK_SIZE,
            inline_threshold: DEFAULT_INLINE_THRESHOLD,
            fsync: true,
            tree_partitions: None,
            lifecycle_day_secs: DEFAULT_LIFECYCLE_DAY_SECS,
            lifecycle_interval_secs: DEFAULT_LIFECYCLE_INTERVAL_SECS,
        }
    }
}

impl Config {
    /// A configuration for `data_dir` with every other field at its default.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Config { data_dir: data_dir.into(), ..Config::default() }
    }

    /// Sets the access and secret key (builder style).
    pub fn with_keys(mut self, access_key: &str, secret_key: &str) -> Self {
        self.access_key = Some(access_key.to_owned());
        self.secret_key = Some(secret_key.to_owned());
        self
    }

    /// Reads a TOML configuration file (unknown fields are an error; errors
    /// name the file). Flags and the environment may still supply the keys,
    /// so the caller validates the merged configuration.
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(svc_kit::config::load(path)?)
    }

    /// Parses a TOML configuration (unknown fields are an error).
    pub fn from_toml(text: &str) -> Result<Self> {
        Ok(svc_kit::config::parse(text)?)
    }

    /// The access/secret key pair, if both are configured.
    pub fn keys(&self) -> Option<(&str, &str)> {
        match (&self.access_key, &self.secret_key) {
            (Some(a), Some(s)) => Some((a, s)),
            _ => None,
        }
    }

    /// Checks the rules a configuration must follow before the server starts.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(LightningError::Config(m.to_owned()));
        match (&self.access_key, &self.secret_key) {
            (Some(_), None) | (None, Some(_)) => {
                return bad("access key and secret key must be given together");
            }
            (Some(a), Some(s)) if a.is_empty() || s.is_empty() => {
                return bad("access key and secret key must not be empty");
            }
            (None, None) if !self.anonymous => {
                return bad("no access key configured: give --access-key and --secret-key \
                     (or LIGHTNINGSTOR_ACCESS_KEY / LIGHTNINGSTOR_SECRET_KEY), \
                     or pass --anonymous to accept unsigned requests");
            }
            _ => {}
        }
        if !(4096..=64 * 1024 * 1024).contains(&self.block_size) {
            return bad("block_size must be between 4 KiB and 64 MiB");
        }
        if self.inline_threshold > 256 * 1024 {
            return bad("inline_threshold must be at most 256 KiB");
        }
        if self.region.is_empty() {
            return bad("region must not be empty");
        }
        if self.lifecycle_day_secs == 0 || self.lifecycle_day_secs > DEFAULT_LIFECYCLE_DAY_SECS {
            return bad("lifecycle_day_secs must be between 1 and 86400 (only tests shorten the day)");
        }
        if self.lifecycle_interval_secs == 0 {
            return bad("lifecycle_interval_secs must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_without_keys_is_refused_unless_anonymous() {
        let c = Config::new("/tmp/x");
        assert!(c.validate().is_err());
        let c = Config { anonymous: true, ..Config::new("/tmp/x") };
        assert!(c.validate().is_ok());
        assert!(Config::new("/tmp/x").with_keys("a", "b").validate().is_ok());
    }

    #[test]
    fn half_a_key_pair_is_refused() {
        let c = Config { access_key: Some("a".into()), anonymous: true, ..Config::new("/tmp/x") };
        assert!(c.validate().is_err());
    }

    #[test]
    fn toml_files_parse_and_reject_unknown_fields() {
        let c = Config::from_toml(
            "data_dir = \"/srv/ls\"\nlisten = \"127.0.0.1:9100\"\naccess_key = \"k\"\nsecret_key = \"s\"\n",
        )
        .expect("valid config");
        assert_eq!(c.data_dir, PathBuf::from("/srv/ls"));
        assert_eq!(c.listen.port(), 9100);
        assert_eq!(c.block_size, DEFAULT_BLOCK_SIZE);
        assert!(Config::from_toml("data_dir = \"/x\"\nbogus = 1\n").is_err());
        assert_eq!(c.lifecycle_day_secs, 86_400);
        let c = Config::from_toml(
            "data_dir = \"/x\"\nanonymous = true\nlifecycle_day_secs = 1\nlifecycle_interval_secs = 2\n",
        )
        .expect("lifecycle fields");
        assert_eq!((c.lifecycle_day_secs, c.lifecycle_interval_secs), (1, 2));
        assert!(c.validate().is_ok());
        assert!(Config { lifecycle_day_secs: 0, ..c.clone() }.validate().is_err());
        assert!(Config { lifecycle_day_secs: 86_401, ..c.clone() }.validate().is_err());
        assert!(Config { lifecycle_interval_secs: 0, ..c }.validate().is_err());
    }

    #[test]
    fn file_errors_name_the_file_the_line_and_the_field() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("ls.toml");
        let e = Config::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("cannot read {}: ", path.display())), "{e}");
        std::fs::write(&path, "data_dir = \"/x\"\nbogus = 1\n").expect("write");
        let e = Config::from_file(&path).expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}:2:1: unknown field `bogus`", path.display())), "{e}");
        // Keys may come from flags or the environment: loading does not validate.
        std::fs::write(&path, "data_dir = \"/x\"\n").expect("write");
        assert!(Config::from_file(&path).expect("parses").validate().is_err());
    }
}
