//! Block peers to measure side by side: CoronaFS (as its own process), the
//! reference NBD servers nbdkit (file plugin) and qemu-nbd, and, with a
//! Ceph made by `bench peers ceph up`, Ceph RBD at 3 copies and at 1, both
//! through fio's rbd engine (librbd) and through an NBD export (nbdkit's
//! python plugin over librbd, `assets/nbdkit-rbd.py`), so Ceph also takes
//! the protocol path CoronaFS takes.

use anyhow::{Context, bail};
use coronafs::backend::IoEngine;
use std::net::{SocketAddr, TcpStream};
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

/// The last bytes a peer process wrote to stderr, drained by a thread so a
/// chatty server never blocks on a full pipe; shown when the peer fails to
/// start.
#[derive(Debug, Clone, Default)]
struct StderrTail(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl StderrTail {
    const KEEP: usize = 4096;

    fn drain(child: &mut Child) -> StderrTail {
        let tail = StderrTail::default();
        if let Some(mut err) = child.stderr.take() {
            let t = tail.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = std::io::Read::read(&mut err, &mut buf) {
                    if n == 0 {
                        break;
                    }
                    let mut v = t.0.lock().unwrap_or_else(|e| e.into_inner());
                    v.extend_from_slice(&buf[..n]);
                    let excess = v.len().saturating_sub(Self::KEEP);
                    v.drain(..excess);
                }
            });
        }
        tail
    }

    fn text(&self) -> String {
        let v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&v).trim().to_owned()
    }
}

/// Waits until `addr` accepts; on an early exit or a timeout the error
/// carries what the server wrote to stderr.
fn wait_for(addr: SocketAddr, child: &mut Child, tail: &StderrTail) -> anyhow::Result<()> {
    let start = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if let Some(st) = child.try_wait()? {
            // Let the drain thread read what the process wrote before it exited.
            std::thread::sleep(Duration::from_millis(100));
            bail!("server exited before listening ({st}); its stderr:\n{}", tail.text());
        }
        if start.elapsed() > Duration::from_secs(20) {
            bail!("nothing listening on {addr} after 20 s; the server's stderr:\n{}", tail.text());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Starts the server `make(port)` builds on a free port. A server that
/// exits before listening is started again, up to three times in all, with
/// what it wrote to stderr printed: the port may have been taken between
/// choosing it and the server binding it, and nbdkit's librbd plugin can
/// fail to reach a Ceph that is still settling.
fn spawn_listening(label: &str, mut make: impl FnMut(u16) -> Command) -> anyhow::Result<(Child, SocketAddr)> {
    const ATTEMPTS: u32 = 3;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let port = crate::ports::free_loopback_addrs(1)?[0].port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let mut child = make(port)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {label} (is it installed?)"))?;
        let tail = StderrTail::drain(&mut child);
        let res = wait_for(addr, &mut child, &tail);
        let exited = matches!(child.try_wait(), Ok(Some(_)));
        match res {
            Ok(()) => return Ok((child, addr)),
            Err(e) if exited && attempt < ATTEMPTS => {
                eprintln!("bench: {label} (attempt {attempt} of {ATTEMPTS}): {e:#}; starting it again");
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(500));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.context(label.to_owned()));
            }
        }
    }
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
            let c_conf = c.conf.clone();
            std::fs::write(&plugin, NBDKIT_RBD)?;
            let (child, addr) = spawn_listening(&peer.label(), |port| {
                let mut c = Command::new("nbdkit");
                c.args(["--foreground", "--exit-with-parent", "-i", "127.0.0.1", "-p", &port.to_string(), "python"])
                    .arg(&plugin)
                    .arg(format!("conf={}", c_conf.display()))
                    .args([format!("pool={pool}"), "image=bench-peer".to_owned()]);
                c
            })
            .context("nbdkit's python plugin over librbd (apt-get install nbdkit-plugin-python python3-rbd)")?;
            return Ok(PeerProc { peer, uri: format!("nbd://{addr}"), child: Some(child), ceph: Some(c.clone()) });
        }
        let name = file.file_name().and_then(|n| n.to_str()).context("file name")?;
        let dir = file.parent().context("file has no directory")?;
        let exe = std::env::current_exe()?;
        let (child, addr) = spawn_listening(&peer.label(), |port| match peer {
            Peer::Coronafs(engine) => {
                let mut c = Command::new(&exe);
                c.arg("__serve-coronafs").arg(dir).arg(format!("127.0.0.1:{port}")).arg(engine.to_string());
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
        })?;
        Ok(PeerProc { peer, uri: format!("nbd://{addr}/{name}"), child: Some(child), ceph: None })
    }

    /// Keeps every thread of the server process (those it has and, as
    /// threads inherit their creator's mask, those it starts later) to CPU
    /// `cpu`. Ceph's daemons are left where the scheduler puts them; for a
    /// Ceph peer this pins only nbdkit, when it exports.
    pub fn pin_to(&self, cpu: usize) -> anyhow::Result<()> {
        let Some(child) = &self.child else { return Ok(()) };
        crate::cpu::pin_process(child.id(), &[cpu])
            .with_context(|| format!("pinning the server's threads to CPU {cpu}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_that_exits_before_listening_is_tried_three_times_and_its_stderr_shown() {
        let starts = std::sync::atomic::AtomicU32::new(0);
        let err = spawn_listening("doomed", |port| {
            starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut c = Command::new("sh");
            c.args(["-c", &format!("echo cannot bind {port}: no such luck >&2; exit 3")]);
            c
        })
        .unwrap_err();
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 3);
        let msg = format!("{err:#}");
        assert!(msg.starts_with("doomed: server exited before listening"), "{msg}");
        assert!(msg.contains("no such luck") && msg.contains("exit status: 3"), "{msg}");
    }

    #[test]
    fn a_server_that_listens_is_started_once() {
        let starts = std::sync::atomic::AtomicU32::new(0);
        let (mut child, addr) = spawn_listening("python listener", |port| {
            starts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut c = Command::new("/usr/bin/python3");
            c.args([
                "-c",
                &format!(
                    "import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); time.sleep(30)"
                ),
            ]);
            c
        })
        .unwrap();
        assert_eq!(addr.ip().to_string(), "127.0.0.1");
        assert_eq!(starts.load(std::sync::atomic::Ordering::SeqCst), 1);
        let _ = child.kill();
        let _ = child.wait();
    }
}
