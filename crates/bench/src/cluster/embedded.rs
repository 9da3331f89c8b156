//! The embedded cluster's processes: LightningStor nodes and load agents run
//! as child processes of the bench binary (hidden subcommands of the same
//! executable), so a fault can SIGKILL or SIGSTOP a node and "worker A" and
//! "worker B" are different processes. Children exit when the bench does:
//! each watches its stdin, a pipe the bench holds, and stops at EOF.

use crate::fault::{Fault, FaultDriver, FaultKind};
use anyhow::{Context, bail};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

/// The bench executable: `BENCH_EXE`, else this process when it is the
/// bench, else `bench` next to the test binary's `deps/` directory.
pub fn bench_exe() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("BENCH_EXE") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().context("finding the bench executable")?;
    if me.file_stem().is_some_and(|s| s == "bench") {
        return Ok(me);
    }
    let beside = me.parent().and_then(Path::parent).map(|d| d.join("bench"));
    match beside {
        Some(p) if p.exists() => Ok(p),
        _ => bail!("cannot find the bench executable to start agents and nodes (set BENCH_EXE)"),
    }
}

/// A child process of the bench that printed `listening on ADDR`.
#[derive(Debug)]
pub struct Proc {
    pub what: String,
    pub addr: SocketAddr,
    child: Child,
    /// Held so the child sees EOF on its stdin when we go.
    args: Vec<String>,
    env: Vec<(String, String)>,
    paused: bool,
}

impl Proc {
    /// Starts `bench ARGS --exit-with-stdin` and waits (10 s at most) for
    /// its `listening on ADDR` line.
    pub async fn start(what: &str, args: Vec<String>, env: Vec<(String, String)>) -> anyhow::Result<Proc> {
        let exe = bench_exe()?;
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .arg("--exit-with-stdin")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| format!("starting {what} ({})", exe.display()))?;
        let out = child.stdout.take().context("child stdout")?;
        let mut lines = tokio::io::BufReader::new(out).lines();
        let found = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(l) = lines.next_line().await? {
                if let Some(a) = l.strip_prefix("listening on ") {
                    return Ok(a.split_whitespace().next().unwrap_or("").parse::<SocketAddr>()?);
                }
            }
            bail!("{what} exited before listening")
        })
        .await;
        let addr = match found {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                let _ = child.kill().await;
                return Err(e);
            }
            Err(_) => {
                let _ = child.kill().await;
                bail!("{what} did not start listening within 10 s");
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Proc { what: what.into(), addr, child, args, env, paused: false })
    }

    fn pid(&self) -> Option<i32> {
        self.child.id().and_then(|p| i32::try_from(p).ok())
    }

    fn signal(&self, sig: i32) -> anyhow::Result<()> {
        let pid = self.pid().with_context(|| format!("{} is not running", self.what))?;
        // SAFETY: kill(2) with our own child's pid and a valid signal number.
        if unsafe { libc::kill(pid, sig) } != 0 {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("signalling {}", self.what));
        }
        Ok(())
    }

    /// Whether it has exited (or is frozen).
    pub fn is_down(&mut self) -> bool {
        self.paused || !matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, and reap.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        if self.paused {
            self.signal(libc::SIGCONT)?;
            self.paused = false;
        }
        self.child.kill().await.with_context(|| format!("killing {}", self.what))
    }

    /// Starts it again with the same arguments (a restart after a crash).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        if !self.is_down() {
            return Ok(());
        }
        let again = Proc::start(&self.what, self.args.clone(), self.env.clone()).await?;
        *self = again;
        Ok(())
    }

    pub fn pause(&mut self) -> anyhow::Result<()> {
        self.signal(libc::SIGSTOP)?;
        self.paused = true;
        Ok(())
    }

    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.signal(libc::SIGCONT)?;
        self.paused = false;
        Ok(())
    }

    /// Asks it to stop (closes its stdin) and waits a little, then kills.
    pub async fn stop(mut self) {
        if self.paused {
            let _ = self.resume();
        }
        drop(self.child.stdin.take());
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

/// Starts one LightningStor node of the cluster file `config` in a child.
pub async fn lightningstor_node(config: &Path, node: &str) -> anyhow::Result<Proc> {
    Proc::start(
        &format!("LightningStor node {node}"),
        vec![
            "__serve-lightningstor".into(),
            "--config".into(),
            config.display().to_string(),
            "--node".into(),
            node.into(),
        ],
        Vec::new(),
    )
    .await
}

/// Starts a load agent in a child, on loopback.
pub async fn agent(name: &str, scratch: &Path, token: &str) -> anyhow::Result<Proc> {
    Proc::start(
        &format!("agent {name}"),
        vec![
            "agent".into(),
            "--name".into(),
            name.into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--sink".into(),
            "127.0.0.1:0".into(),
            "--scratch".into(),
            scratch.display().to_string(),
        ],
        vec![(crate::agent::TOKEN_ENV.into(), token.into())],
    )
    .await
}

/// A random token (hex of 16 bytes from the kernel).
pub fn random_token() -> anyhow::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Faults on the embedded cluster's LightningStor nodes: kill (SIGKILL, then
/// a restart from the same data dir) and pause (SIGSTOP / SIGCONT).
#[derive(Debug, Clone)]
pub struct EmbeddedFaults {
    pub nodes: Arc<Mutex<Vec<(String, Proc)>>>,
}

fn check(f: &Fault) -> anyhow::Result<()> {
    if f.service != "lightningstor" {
        bail!("{f}: the embedded cluster can fault only its LightningStor nodes (lightningstor@n1..)");
    }
    Ok(())
}

impl EmbeddedFaults {
    async fn with<T>(&self, f: &Fault, op: impl FnOnce(&mut Proc) -> T) -> anyhow::Result<T> {
        check(f)?;
        let mut nodes = self.nodes.lock().await;
        let names: Vec<String> = nodes.iter().map(|(n, _)| n.clone()).collect();
        let (_, p) = nodes
            .iter_mut()
            .find(|(n, _)| *n == f.node)
            .with_context(|| format!("{f}: no LightningStor node {} (nodes: {})", f.node, names.join(", ")))?;
        Ok(op(p))
    }
}

#[async_trait::async_trait]
impl FaultDriver for EmbeddedFaults {
    fn describe(&self) -> String {
        "the embedded cluster's LightningStor nodes are child processes: kill is SIGKILL then a restart on the same \
         data dir, pause is SIGSTOP/SIGCONT"
            .into()
    }

    async fn inject(&self, f: &Fault) -> anyhow::Result<()> {
        match f.kind {
            FaultKind::Partition => bail!("{f}: partitions need the Docker lab (the embedded cluster shares one host)"),
            FaultKind::Kill => {
                check(f)?;
                let mut nodes = self.nodes.lock().await;
                let (_, p) =
                    nodes.iter_mut().find(|(n, _)| *n == f.node).with_context(|| format!("{f}: no such node"))?;
                p.kill().await
            }
            FaultKind::Pause => self.with(f, Proc::pause).await?,
        }
    }

    async fn heal(&self, f: &Fault) -> anyhow::Result<()> {
        match f.kind {
            FaultKind::Partition => Ok(()),
            FaultKind::Kill => {
                check(f)?;
                let mut nodes = self.nodes.lock().await;
                let (_, p) =
                    nodes.iter_mut().find(|(n, _)| *n == f.node).with_context(|| format!("{f}: no such node"))?;
                p.restart().await
            }
            FaultKind::Pause => self.with(f, Proc::resume).await?,
        }
    }

    async fn is_down(&self, f: &Fault) -> anyhow::Result<bool> {
        self.with(f, Proc::is_down).await
    }
}
