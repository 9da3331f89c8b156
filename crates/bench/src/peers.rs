//! Block peers to measure side by side: CoronaFS (as its own process), the
//! reference NBD servers nbdkit (file plugin) and qemu-nbd, and, with a
//! Ceph made by `bench peers ceph up`, Ceph RBD at 3 copies and at 1, both
//! through fio's rbd engine (librbd) and through an NBD export (nbdkit's
//! python plugin over librbd, `assets/nbdkit-rbd.py`), so Ceph also takes
//! the protocol path CoronaFS takes.

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
    /// An RBD image in the pool of `copies` copies; `nbd`: through an NBD
    /// export, else fio's rbd engine straight to librbd.
    Ceph {
        copies: u8,
        nbd: bool,
    },
}

impl Peer {
    pub fn label(&self) -> String {
        match self {
            Peer::Coronafs(e) => format!("coronafs-{e}"),
            Peer::Nbdkit => "nbdkit".into(),
            Peer::QemuNbd => "qemu-nbd".into(),
            Peer::Ceph { copies, nbd: false } => format!("ceph-rbd-{copies}x"),
            Peer::Ceph { copies, nbd: true } => format!("ceph-rbd-{copies}x-nbd"),
        }
    }

    /// How the peer is reached, for a report.
    pub fn path(&self) -> &'static str {
        match self {
            Peer::Ceph { nbd: false, .. } => "fio --ioengine=rbd (librbd)",
            Peer::Ceph { nbd: true, .. } => "fio --ioengine=nbd to nbdkit's python plugin over librbd",
            _ => "fio --ioengine=nbd",
        }
    }
}

/// The Ceph peers: RBD at 3 copies and at 1, each through librbd and NBD.
pub fn ceph_peers() -> Vec<Peer> {
    vec![
        Peer::Ceph { copies: 3, nbd: false },
        Peer::Ceph { copies: 3, nbd: true },
        Peer::Ceph { copies: 1, nbd: false },
        Peer::Ceph { copies: 1, nbd: true },
    ]
}

/// The nbdkit plugin that exports an RBD image (written next to the Ceph's conf).
const NBDKIT_RBD: &str = include_str!("../assets/nbdkit-rbd.py");

/// CoronaFS on each engine, then nbdkit and qemu-nbd.
pub fn default_peers(engines: &[IoEngine]) -> Vec<Peer> {
    let mut v: Vec<Peer> = engines.iter().map(|&e| Peer::Coronafs(e)).collect();
    v.push(Peer::Nbdkit);
    v.push(Peer::QemuNbd);
    v
}

/// A running peer serving one file as an export (or, for Ceph, an image).
#[derive(Debug)]
pub struct PeerProc {
    pub peer: Peer,
    /// `nbd://...`, or `rbd://POOL/IMAGE?conf=FILE` for fio's rbd engine.
    pub uri: String,
    /// The NBD server process (none for fio's rbd engine).
    child: Option<Child>,
    /// The Ceph whose daemons serve the image.
    ceph: Option<crate::ceph::Ceph>,
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
    /// Serves `file` (whose file name is the export name for coronafs); a
    /// Ceph peer serves an image `bench-peer` of the file's size in its pool
    /// (filled with data once) and needs `ceph`.
    pub fn start(peer: Peer, file: &Path, ceph: Option<&crate::ceph::Ceph>) -> anyhow::Result<PeerProc> {
        if let Peer::Ceph { copies, nbd } = peer {
            let c = ceph.context("a Ceph peer needs a Ceph (bench peers ceph up)")?;
            let pool = if copies == 1 { crate::ceph::POOL_SINGLE } else { crate::ceph::POOL_REPLICATED };
            let size = std::fs::metadata(file)?.len();
            crate::ceph::ensure_image(&c.conf, pool, "bench-peer", size)?;
            if !nbd {
                let uri = format!("rbd://{pool}/bench-peer?conf={}", c.conf.display());
                return Ok(PeerProc { peer, uri, child: None, ceph: Some(c.clone()) });
            }
            let plugin = c.dir.join("nbdkit-rbd.py");
            std::fs::write(&plugin, NBDKIT_RBD)?;
            let port = free_port()?;
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
            let mut child = Command::new("nbdkit")
                .args(["--foreground", "--exit-with-parent", "-i", "127.0.0.1", "-p", &port.to_string(), "python"])
                .arg(&plugin)
                .arg(format!("conf={}", c.conf.display()))
                .args([format!("pool={pool}"), "image=bench-peer".to_owned()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting nbdkit's python plugin (apt-get install nbdkit-plugin-python python3-rbd)")?;
            wait_for(addr, &mut child).with_context(|| peer.label())?;
            return Ok(PeerProc { peer, uri: format!("nbd://{addr}"), child: Some(child), ceph: Some(c.clone()) });
        }
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
            Peer::Ceph { .. } => unreachable!("handled above"),
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
        Ok(PeerProc { peer, uri: format!("nbd://{addr}/{name}"), child: Some(child), ceph: None })
    }

    /// CPU time (user + system, all threads) the server process has used so
    /// far, in seconds. Server CPU per operation is a figure that the noise of
    /// a shared machine disturbs far less than throughput.
    /// For Ceph: every daemon of the cluster, and nbdkit when it exports.
    pub fn cpu_seconds(&self) -> f64 {
        let own = self.child.as_ref().map_or(0.0, |c| process_cpu_seconds(c.id()));
        own + self
            .ceph
            .as_ref()
            .map_or(0.0, |c| crate::ceph::daemons(&c.dir).iter().map(|(_, p)| process_cpu_seconds(*p as u32)).sum())
    }

    /// Peak and current resident memory of the server process, in bytes
    /// (for Ceph, the sum over its daemons and nbdkit).
    pub fn memory(&self) -> (u64, u64) {
        let mut pids: Vec<u32> = self.child.as_ref().map(|c| c.id()).into_iter().collect();
        if let Some(c) = &self.ceph {
            pids.extend(crate::ceph::daemons(&c.dir).iter().map(|(_, p)| *p as u32));
        }
        pids.iter().map(|&p| process_memory(p)).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }
}

/// CPU seconds (user + system, all threads) process `pid` has used.
fn process_cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse::<u64>().ok()).sum();
    // /proc reports clock ticks of USER_HZ, which Linux fixes at 100 on every architecture we run on.
    ticks as f64 / 100.0
}

/// (peak, current) resident bytes of process `pid`.
fn process_memory(pid: u32) -> (u64, u64) {
    {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
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
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The body of the hidden `__serve-coronafs DIR ADDR ENGINE` subcommand: a
/// CoronaFS server as a separate process so its memory can be measured.
pub fn serve_coronafs(dir: &Path, addr: SocketAddr, engine: IoEngine) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        let mut cfg = coronafs::config::ServerConfig::ephemeral(dir, engine);
        cfg.nbd = addr;
        let srv = coronafs::service::start(cfg).await?;
        srv.run_until_signal().await;
        Ok(())
    })
}
