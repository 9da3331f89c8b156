//! `bench healthcheck`: does a service answer? The lab's container image has
//! no shell and no curl, so its Compose healthchecks run this; scripts that
//! start a service run it with `--wait` to go on once the service serves.
//!
//! A target is one of:
//! - `http://HOST:PORT/PATH`: a GET answered with a 2xx status (the
//!   services' `/healthz`, LightningStor's unsigned `/metrics`);
//! - `nbd://HOST:PORT`: the NBD newstyle handshake and the list of exports
//!   (`NBD_OPT_LIST`), then `NBD_OPT_ABORT`;
//! - `nbd://HOST:PORT/EXPORT`: the handshake up to that export being opened
//!   (`NBD_OPT_GO`), then a clean disconnect;
//! - `tcp://HOST:PORT`: a TCP connection accepted.
//!
//! Host names are resolved (the system resolver, as every client here).

use anyhow::{Context, bail};
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// One thing to check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// GET this URL, expect 2xx.
    Http(String),
    /// NBD handshake and export list at `host:port`.
    NbdList(String),
    /// NBD handshake opening `export` at `addr`.
    NbdExport { addr: String, export: String },
    /// A TCP connection to `host:port`.
    Tcp(String),
}

impl FromStr for Target {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        let host_port = |rest: &str| -> anyhow::Result<String> {
            let (host, port) = rest.rsplit_once(':').with_context(|| format!("{s}: no port (HOST:PORT)"))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                bail!("{s}: expected HOST:PORT with a port number");
            }
            Ok(rest.to_owned())
        };
        if let Some(rest) = s.strip_prefix("http://") {
            let authority = rest.split('/').next().unwrap_or_default();
            host_port(authority)?;
            return Ok(Target::Http(s.to_owned()));
        }
        if let Some(rest) = s.strip_prefix("nbd://") {
            return Ok(match rest.split_once('/') {
                Some((addr, export)) if !export.is_empty() => {
                    Target::NbdExport { addr: host_port(addr)?, export: export.to_owned() }
                }
                Some((addr, _)) => Target::NbdList(host_port(addr)?),
                None => Target::NbdList(host_port(rest)?),
            });
        }
        if let Some(rest) = s.strip_prefix("tcp://") {
            return Ok(Target::Tcp(host_port(rest.trim_end_matches('/'))?));
        }
        bail!("{s}: a target is http://HOST:PORT/PATH, nbd://HOST:PORT[/EXPORT] or tcp://HOST:PORT")
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Http(u) => f.write_str(u),
            Target::NbdList(a) => write!(f, "nbd://{a}"),
            Target::NbdExport { addr, export } => write!(f, "nbd://{addr}/{export}"),
            Target::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// Checks `target` once, within `timeout`; what it answered.
pub async fn check(target: &Target, timeout: Duration) -> anyhow::Result<String> {
    match tokio::time::timeout(timeout, check_inner(target, timeout)).await {
        Ok(r) => r,
        Err(_) => bail!("no answer within {timeout:?}"),
    }
}

async fn check_inner(target: &Target, timeout: Duration) -> anyhow::Result<String> {
    match target {
        Target::Http(url) => {
            let client = reqwest::Client::builder().timeout(timeout).build()?;
            let resp = client.get(url).send().await?;
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            let first = body.lines().next().unwrap_or_default().chars().take(120).collect::<String>();
            if !status.is_success() {
                bail!("HTTP {status}: {first}");
            }
            Ok(format!("HTTP {status}{}", if first.is_empty() { String::new() } else { format!(": {first}") }))
        }
        Target::NbdList(addr) => {
            let names = coronafs::client::list_exports(addr.as_str()).await?;
            Ok(format!("NBD handshake, {}", crate::text::count(names.len(), "export")))
        }
        Target::NbdExport { addr, export } => {
            let c = coronafs::client::NbdClient::connect(addr.as_str(), export).await?;
            let size = c.size();
            c.disconnect().await?;
            Ok(format!("NBD handshake, export {export} of {size} bytes"))
        }
        Target::Tcp(addr) => {
            tokio::net::TcpStream::connect(addr.as_str()).await?;
            Ok("connection accepted".to_owned())
        }
    }
}

/// Checks every target; with `wait`, tries again (every 200 ms) until all
/// answer or `wait` has passed. One line per target answered; the error
/// names every target that did not answer and why.
pub async fn run(targets: &[Target], wait: Option<Duration>, timeout: Duration) -> anyhow::Result<Vec<String>> {
    let start = Instant::now();
    let mut ok: Vec<Option<String>> = vec![None; targets.len()];
    loop {
        let mut failed = Vec::new();
        for (t, done) in targets.iter().zip(ok.iter_mut()) {
            if done.is_some() {
                continue;
            }
            match check(t, timeout).await {
                Ok(what) => *done = Some(format!("ok {t}: {what}")),
                Err(e) => failed.push(format!("{t}: {e:#}")),
            }
        }
        if failed.is_empty() {
            return Ok(ok.into_iter().flatten().collect());
        }
        match wait {
            Some(w) if start.elapsed() < w => tokio::time::sleep(Duration::from_millis(200)).await,
            _ => {
                let waited = wait.map(|w| format!(" after waiting {w:?}")).unwrap_or_default();
                bail!("not healthy{waited}:\n  {}", failed.join("\n  "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_print_back() {
        for s in [
            "http://10.89.0.11:7070/healthz",
            "nbd://127.0.0.1:10809",
            "nbd://node01:10809/vm1",
            "tcp://10.89.0.12:9100",
        ] {
            let t: Target = s.parse().unwrap_or_else(|e| panic!("{s}: {e:#}"));
            assert_eq!(t.to_string(), s);
        }
        assert_eq!("nbd://h:1/".parse::<Target>().ok(), Some(Target::NbdList("h:1".into())));
        for bad in ["https://x:1/", "nbd://nohost", "tcp://:80", "http://h:port/x", "ftp://h:1"] {
            assert!(bad.parse::<Target>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn a_closed_port_fails_and_names_the_target() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("bind").port();
        let t: Target = format!("tcp://127.0.0.1:{port}").parse().expect("target");
        let e = rt.block_on(run(&[t], None, Duration::from_secs(1))).expect_err("nothing listens");
        assert!(format!("{e:#}").contains(&format!("tcp://127.0.0.1:{port}")), "{e:#}");
    }
}
