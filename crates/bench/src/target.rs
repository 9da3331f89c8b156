//! Where a load run sends its I/O: an NBD export, a file, block device or
//! directory, or an S3 bucket. [`TargetSpec::parse`] is pure; the sessions
//! that do the I/O live in [`crate::loadgen`].

use anyhow::{Context, bail};
use std::net::SocketAddr;
use std::path::PathBuf;

/// Distinct objects an S3 job cycles over (its "size" in keys).
pub const S3_MAX_KEYS: u64 = 1024;

/// A parsed `--target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetSpec {
    /// `nbd://host[:port]/export` (port 10809 by default).
    Nbd { addr: String, export: String },
    /// A regular file, a block device or (with a trailing job file per job)
    /// a directory; `file:///path` or a bare path.
    Path(PathBuf),
    /// `s3://bucket[/prefix]?endpoint=URL[&region=R]`.
    S3 { bucket: String, prefix: String, endpoint: String, region: String },
    /// `rbd://pool/image[?conf=FILE]`: a Ceph RBD image, driven through
    /// fio's rbd engine (librbd); the cluster from `conf`, else `CEPH_CONF`,
    /// else Ceph's default `/etc/ceph/ceph.conf`.
    Rbd { pool: String, image: String, conf: Option<PathBuf> },
}

impl std::fmt::Display for TargetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetSpec::Nbd { addr, export } => write!(f, "nbd://{addr}/{export}"),
            TargetSpec::Path(p) => write!(f, "{}", p.display()),
            TargetSpec::S3 { bucket, prefix, endpoint, .. } => {
                write!(f, "s3://{bucket}/{prefix} at {endpoint}")
            }
            TargetSpec::Rbd { pool, image, conf } => match conf {
                Some(c) => write!(f, "rbd://{pool}/{image}?conf={}", c.display()),
                None => write!(f, "rbd://{pool}/{image}"),
            },
        }
    }
}

impl TargetSpec {
    pub fn parse(uri: &str) -> anyhow::Result<TargetSpec> {
        if let Some(rest) = uri.strip_prefix("nbd://") {
            let (hostport, export) = rest.split_once('/').unwrap_or((rest, ""));
            if hostport.is_empty() {
                bail!("{uri}: no host (expected nbd://host:port/export)");
            }
            let addr = if hostport.starts_with('[') {
                if hostport.contains("]:") { hostport.to_owned() } else { format!("{hostport}:10809") }
            } else if let Some((_, port)) = hostport.rsplit_once(':') {
                port.parse::<u16>().with_context(|| format!("{uri}: bad port {port:?}"))?;
                hostport.to_owned()
            } else {
                format!("{hostport}:10809")
            };
            return Ok(TargetSpec::Nbd { addr, export: export.to_owned() });
        }
        if let Some(rest) = uri.strip_prefix("s3://") {
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
            if bucket.is_empty() {
                bail!("{uri}: no bucket (expected s3://bucket?endpoint=http://host:port)");
            }
            let mut endpoint = None;
            let mut region = "us-east-1".to_owned();
            for kv in query.split('&').filter(|s| !s.is_empty()) {
                match kv.split_once('=') {
                    Some(("endpoint", v)) => endpoint = Some(v.to_owned()),
                    Some(("region", v)) => region = v.to_owned(),
                    _ => bail!("{uri}: unknown query parameter {kv:?} (endpoint=URL and region=R are known)"),
                }
            }
            let endpoint = endpoint.context(format!("{uri}: missing ?endpoint=http://host:port"))?;
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                bail!("{uri}: endpoint must start with http:// or https://");
            }
            return Ok(TargetSpec::S3 { bucket: bucket.to_owned(), prefix: prefix.to_owned(), endpoint, region });
        }
        if let Some(rest) = uri.strip_prefix("rbd://") {
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            let (pool, image) = path.split_once('/').unwrap_or((path, ""));
            let ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
            if !ok(pool) || !ok(image) {
                bail!("{uri}: expected rbd://POOL/IMAGE (letters, digits, . _ -)");
            }
            let mut conf = None;
            for kv in query.split('&').filter(|s| !s.is_empty()) {
                match kv.split_once('=') {
                    Some(("conf", v)) if !v.is_empty() => conf = Some(PathBuf::from(v)),
                    _ => bail!("{uri}: unknown query parameter {kv:?} (conf=FILE is known)"),
                }
            }
            return Ok(TargetSpec::Rbd { pool: pool.to_owned(), image: image.to_owned(), conf });
        }
        if let Some(p) = uri.strip_prefix("file://") {
            return Ok(TargetSpec::Path(PathBuf::from(p)));
        }
        if uri.contains("://") {
            bail!("{uri}: unknown scheme (use nbd://, s3://, rbd://, file:// or a path)");
        }
        if uri.is_empty() {
            bail!("empty target");
        }
        Ok(TargetSpec::Path(PathBuf::from(uri)))
    }

    /// The Ceph configuration an `rbd://` target uses.
    pub fn ceph_conf(conf: &Option<PathBuf>) -> PathBuf {
        conf.clone()
            .or_else(|| std::env::var_os("CEPH_CONF").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/etc/ceph/ceph.conf"))
    }

    /// The NBD address, resolved.
    pub fn nbd_addr(addr: &str) -> anyhow::Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        addr.to_socket_addrs()?.next().with_context(|| format!("{addr} does not resolve"))
    }
}

/// Credentials for S3 targets: flags, else `AWS_ACCESS_KEY_ID` /
/// `AWS_SECRET_ACCESS_KEY`.
#[derive(Debug, Clone, Default)]
pub struct S3Keys {
    pub access_key: Option<String>,
    pub secret_key: Option<String>,
}

impl S3Keys {
    pub fn resolve(&self) -> anyhow::Result<(String, String)> {
        let ak = self.access_key.clone().or_else(|| std::env::var("AWS_ACCESS_KEY_ID").ok());
        let sk = self.secret_key.clone().or_else(|| std::env::var("AWS_SECRET_ACCESS_KEY").ok());
        match (ak, sk) {
            (Some(a), Some(s)) => Ok((a, s)),
            _ => bail!("S3 target needs keys: --access-key/--secret-key or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"),
        }
    }
}

/// An aws-sdk-s3 client for `endpoint`, path style.
pub fn s3_client(endpoint: &str, region: &str, ak: &str, sk: &str) -> aws_sdk_s3::Client {
    aws_sdk_s3::Client::from_conf(s3_config(endpoint, region, ak, sk).build())
}

/// Like [`s3_client`], for a client that fails over to other nodes itself:
/// no SDK retries, a 3 s connect timeout and a 20 s read timeout (a node
/// that was killed, paused or cut off stops answering rather than refusing).
pub fn s3_client_failfast(endpoint: &str, region: &str, ak: &str, sk: &str) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::timeout::TimeoutConfig;
    let timeouts = TimeoutConfig::builder()
        .connect_timeout(std::time::Duration::from_secs(3))
        .read_timeout(std::time::Duration::from_secs(20))
        .build();
    s3_client_no_retries(endpoint, region, ak, sk, timeouts)
}

/// A client without SDK retries and with the given timeouts: every
/// request it makes is one attempt, so its outcome is that attempt's.
pub fn s3_client_no_retries(
    endpoint: &str,
    region: &str,
    ak: &str,
    sk: &str,
    timeouts: aws_sdk_s3::config::timeout::TimeoutConfig,
) -> aws_sdk_s3::Client {
    use aws_sdk_s3::config::retry::RetryConfig;
    let conf = s3_config(endpoint, region, ak, sk).retry_config(RetryConfig::disabled()).timeout_config(timeouts);
    aws_sdk_s3::Client::from_conf(conf.build())
}

fn s3_config(endpoint: &str, region: &str, ak: &str, sk: &str) -> aws_sdk_s3::config::Builder {
    use aws_sdk_s3::config::{BehaviorVersion, Region};
    aws_sdk_s3::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region.to_owned()))
        .credentials_provider(aws_credential_types::Credentials::new(ak, sk, None, None, "bench"))
        .endpoint_url(endpoint)
        .force_path_style(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nbd_uris_get_the_default_port() {
        assert_eq!(
            TargetSpec::parse("nbd://127.0.0.1/vol").unwrap(),
            TargetSpec::Nbd { addr: "127.0.0.1:10809".into(), export: "vol".into() }
        );
        assert_eq!(
            TargetSpec::parse("nbd://h:1234/").unwrap(),
            TargetSpec::Nbd { addr: "h:1234".into(), export: "".into() }
        );
        assert!(TargetSpec::parse("nbd://h:99999/x").is_err());
        assert!(TargetSpec::parse("nbd:///x").is_err());
    }

    #[test]
    fn s3_uris_need_an_http_endpoint() {
        let t = TargetSpec::parse("s3://b/p/q?endpoint=http://127.0.0.1:9000&region=eu").unwrap();
        assert_eq!(
            t,
            TargetSpec::S3 {
                bucket: "b".into(),
                prefix: "p/q".into(),
                endpoint: "http://127.0.0.1:9000".into(),
                region: "eu".into()
            }
        );
        assert!(format!("{:#}", TargetSpec::parse("s3://b").unwrap_err()).contains("endpoint"));
        assert!(TargetSpec::parse("s3://b?endpoint=ftp://x").is_err());
        assert!(TargetSpec::parse("s3://b?endpoint=http://x&color=red").is_err());
        assert!(TargetSpec::parse("s3://?endpoint=http://x").is_err());
    }

    #[test]
    fn paths_and_unknown_schemes() {
        assert_eq!(TargetSpec::parse("/dev/nvme0n1").unwrap(), TargetSpec::Path("/dev/nvme0n1".into()));
        assert_eq!(TargetSpec::parse("file:///mnt/nfs").unwrap(), TargetSpec::Path("/mnt/nfs".into()));
        assert!(TargetSpec::parse("iscsi://pool/img").is_err());
        assert!(TargetSpec::parse("").is_err());
    }

    #[test]
    fn rbd_images_with_and_without_a_conf() {
        assert_eq!(
            TargetSpec::parse("rbd://rbd/img").unwrap(),
            TargetSpec::Rbd { pool: "rbd".into(), image: "img".into(), conf: None }
        );
        let t = TargetSpec::parse("rbd://rbd1/vm-1?conf=/tmp/c/ceph.conf").unwrap();
        assert_eq!(
            t,
            TargetSpec::Rbd { pool: "rbd1".into(), image: "vm-1".into(), conf: Some("/tmp/c/ceph.conf".into()) }
        );
        assert_eq!(t.to_string(), "rbd://rbd1/vm-1?conf=/tmp/c/ceph.conf");
        for bad in [
            "rbd://",
            "rbd://pool",
            "rbd://pool/",
            "rbd:///img",
            "rbd://p/i/j",
            "rbd://p/i?keyring=x",
            "rbd://p/i?conf=",
        ] {
            assert!(TargetSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
