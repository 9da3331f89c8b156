//! NBD servers to measure side by side: CoronaFS (as its own process) and
//! the reference servers nbdkit (file plugin) and qemu-nbd.

use anyhow::{Context, bail};
use coronafs::backend::IoEngine;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A server to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Peer {
    Coronafs(IoEngine),
    Nbdkit,
    QemuNbd,
}

impl Peer {
    pub fn label(&self) -> String {
        match self {
            Peer::Coronafs(e) => format!("coronafs-{e}"),
            Peer::Nbdkit => "nbdkit".into(),
            Peer::QemuNbd => "qemu-nbd".into(),
        }
    }
}

/// CoronaFS on each engine, then nbdkit and qemu-nbd.
pub fn default_peers(engines: &[IoEngine]) -> Vec<Peer> {
    let mut v: Vec<Peer> = engines.iter().map(|&e| Peer::Coronafs(e)).collect();
    v.push(Peer::Nbdkit);
    v.push(Peer::QemuNbd);
    v
}

/// A running peer serving one file as an export.
#[derive(Debug)]
pub struct PeerProc {
    pub peer: Peer,
    pub uri: String,
    child: Child,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for(addr: SocketAddr, child: &mut Child) -> anyhow::Result<()> {
    let start = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Some(st) = child.try_wait()? {
            bail!("server exited before listening: {st}");
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("nothing listening on {addr} after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

impl PeerProc {
    /// Serves `file` (whose file name is the export name for coronafs).
    pub fn start(peer: Peer, file: &Path) -> anyhow::Result<PeerProc> {
        let port = free_port()?;
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let name = file.file_name().and_then(|n| n.to_str()).context("file name")?;
        let mut cmd = match peer {
            Peer::Coronafs(engine) => {
                let mut c = Command::new(std::env::current_exe()?);
                c.arg("__serve-coronafs")
                    .arg(file.parent().context("file has no directory")?)
                    .arg(addr.to_string())
                    .arg(engine.to_string());
                c
            }
            Peer::Nbdkit => {
                let mut c = Command::new("nbdkit");
                c.args(["--foreground", "--exit-with-parent", "-i", "127.0.0.1", "-p", &port.to_string(), "file"])
                    .arg(file);
                c
            }
            Peer::QemuNbd => {
                let mut c = Command::new("qemu-nbd");
                c.args(["-f", "raw", "-b", "127.0.0.1", "-p", &port.to_string(), "-x", name, "--persistent"])
                    .args(["--shared=64", "--cache=writeback", "--aio=threads"])
                    .arg(file);
                c
            }
        };
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} (is it installed?)", peer.label()))?;
        wait_for(addr, &mut child).with_context(|| peer.label())?;
        Ok(PeerProc { peer, uri: format!("nbd://{addr}/{name}"), child })
    }

    /// CPU time (user + system, all threads) the server process has used so
    /// far, in seconds. Server CPU per operation is a figure that the noise of
    /// a shared machine disturbs far less than throughput.
    pub fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let ticks: u64 = rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse::<u64>().ok()).sum();
        // /proc reports clock ticks of USER_HZ, which Linux fixes at 100 on every architecture we run on.
        ticks as f64 / 100.0
    }

    /// Peak and current resident memory of the server process, in bytes.
    pub fn memory(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let field = |k: &str| {
            status
                .lines()
                .find(|l| l.starts_with(k))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        };
        (field("VmHWM:"), field("VmRSS:"))
    }
}

impl Drop for PeerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of the hidden `__serve-coronafs DIR ADDR ENGINE` subcommand: a
/// CoronaFS server as a separate process so its memory can be measured.
pub fn serve_coronafs(dir: &Path, addr: SocketAddr, engine: IoEngine) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let mut cfg = coronafs::server::ServerConfig::ephemeral(dir, engine);
        cfg.nbd = addr;
        let srv = coronafs::server::start(cfg).await?;
        srv.run_until_signal().await;
        Ok(())
    })
}
