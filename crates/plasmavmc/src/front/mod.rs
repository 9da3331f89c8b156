//! `plasmavmc nbd-front`: a local NBD export in front of one CoronaFS
//! volume that survives the volume's failovers, for NBD clients that never
//! reconnect themselves (fio's `nbd` engine, qemu-img, nbdinfo, a
//! hypervisor's block layer).
//!
//! ```text
//!  fio / qemu-img ──NBD (loopback TCP or a Unix socket)──► nbd-front ──NBD `VOL;epoch=N`──► primary
//!                                                            │ journal of acknowledged,      (reconnects to the new
//!                                                            │ unflushed writes               primary, epoch M, and
//!                                                            └─ replayed after a reconnect    replays the journal)
//! ```
//!
//! Local clients negotiate with coronafs's sans-IO [`Negotiator`], offering
//! less than CoronaFS does ([`offer`]): no extended headers, no metadata
//! context, no CACHE, no DF; those are refused, never accepted. READ,
//! WRITE, FLUSH, TRIM and WRITE_ZEROES go to the volume's primary over one
//! [`Reconnecting`] connection shared by every local client (the code the
//! emulated guest uses), so a request in flight when the primary dies is
//! sent again on the new primary.
//!
//! Writes CoronaFS acknowledged but no FLUSH has covered yet are kept in
//! the [`journal`] (up to a byte budget; at the budget the front FLUSHes
//! itself) and written again on every new connection before any other
//! request goes out on it: a primary answers a write once it is local, so
//! a failover may lose it, and a local client that read it back after the
//! failover would see the old data. With the journal nothing acknowledged
//! is lost while the front lives; if the front itself dies, only what a
//! FLUSH or FUA covered is durable, as NBD promises.

mod conn;
pub mod journal;

use crate::error::{PlasmaError, Result};
use crate::reconnect::{OnReconnect, Reconnecting};
use coronafs::client::NbdClient;
use coronafs::proto::handshake::{ExportDesc, Offer};
use coronafs::proto::{NbdErrno, tx_flags};
use journal::{Journal, Op};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default byte budget of the journal.
pub const REPLAY_BUDGET: u64 = 64 << 20;
/// Largest READ or WRITE a local client may send.
pub const MAX_BLOCK: u32 = 32 << 20;
/// Operations of the journal sent at once while replaying.
const REPLAY_BATCH: usize = 32;

/// The transmission flags the front can forward (the export's, cut to these
/// and to what CoronaFS announced).
pub const FORWARDED: u16 = tx_flags::HAS_FLAGS
    | tx_flags::READ_ONLY
    | tx_flags::SEND_FLUSH
    | tx_flags::SEND_FUA
    | tx_flags::SEND_TRIM
    | tx_flags::SEND_WRITE_ZEROES
    | tx_flags::SEND_FAST_ZERO;

/// What the front offers its local clients, given what CoronaFS announced
/// for the volume (`upstream`, its transmission flags).
pub fn offer(upstream: u16) -> Offer {
    Offer { extended_headers: false, base_allocation: false, tx_flags: FORWARDED & (upstream | tx_flags::HAS_FLAGS) }
}

/// Where local clients connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A loopback TCP address (port 0 picks one). The front has no
    /// authentication, so it refuses any other address.
    Tcp(SocketAddr),
    /// A Unix socket, made readable and writable by its owner only.
    Unix(PathBuf),
}

/// `plasmavmc nbd-front` configuration (flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontConfig {
    pub listen: Listen,
    /// The CoronaFS nodes' NBD addresses (`host:port`) the volume's primary
    /// is looked for among.
    pub coronafs_nodes: Vec<String>,
    /// The volume.
    pub volume: String,
    /// The write epoch it is opened with (`VOL;epoch=N`); a failover's new
    /// epoch is followed from there.
    pub epoch: u64,
    /// Bytes of acknowledged, unflushed writes kept for replay; at this much
    /// the front sends a FLUSH of its own.
    pub replay_budget: u64,
}

impl FrontConfig {
    pub fn validate(&self) -> Result<()> {
        if let Listen::Tcp(a) = &self.listen
            && !a.ip().is_loopback()
        {
            return Err(PlasmaError::Config(format!(
                "listen: {a} is not a loopback address; the front has no authentication (anyone who reaches it can \
                 write the volume), so it listens on loopback or a Unix socket only"
            )));
        }
        if self.coronafs_nodes.is_empty() {
            return Err(PlasmaError::Config("no CoronaFS node: give --coronafs-nodes or --cluster-file".into()));
        }
        for n in &self.coronafs_nodes {
            crate::config::check_host_port("coronafs_nodes", n)?;
        }
        if self.volume.is_empty() || self.volume.contains([';', '@', '/']) {
            return Err(PlasmaError::Config(format!("volume: {:?} is not a volume name", self.volume)));
        }
        if self.replay_budget < MAX_BLOCK as u64 {
            return Err(PlasmaError::Config(format!(
                "replay_budget: {} bytes is below the largest write a client may send ({MAX_BLOCK})",
                self.replay_budget
            )));
        }
        Ok(())
    }
}

/// The journal and what replaying it did; the hook of the front's connection.
#[derive(Debug, Default)]
pub struct Replay {
    journal: Mutex<Journal>,
    replayed_ops: AtomicU64,
    replayed_bytes: AtomicU64,
}

impl Replay {
    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn send(c: &NbdClient, op: &Op) -> coronafs::Result<()> {
    match op {
        Op::Write { offset, data } => c.write(*offset, data, false).await,
        Op::Zeroes { offset, len, flags } => c.write_zeroes(*offset, *len, *flags).await,
        Op::Trim { offset, len, flags } => {
            c.raw(coronafs::proto::request::Command::Trim, *flags, *offset, *len, &[]).await
        }
    }
}

impl OnReconnect for Replay {
    /// Writes the journal again on the new primary, keeping the order of
    /// overlapping operations. They stay in the journal until a FLUSH
    /// covers them there.
    async fn reconnected(&self, c: &NbdClient) -> coronafs::Result<()> {
        let ops = self.journal().ops();
        for batch in journal::batches(&ops, REPLAY_BATCH) {
            futures::future::try_join_all(batch.iter().map(|op| send(c, op))).await?;
        }
        self.replayed_ops.fetch_add(ops.len() as u64, Ordering::Relaxed);
        let bytes: u64 = ops.iter().map(|o| o.range().1 - o.range().0).sum();
        self.replayed_bytes.fetch_add(bytes, Ordering::Relaxed);
        tracing::info!(ops = ops.len(), bytes, "replayed the unflushed writes on the new connection");
        Ok(())
    }
}

/// The front's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct FrontStats {
    /// Local clients connected now.
    pub clients: u64,
    /// Requests answered (successes and errors).
    pub requests: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// WRITEs acknowledged.
    pub writes: u64,
    /// Connections to CoronaFS replaced.
    pub reconnects: u64,
    /// The epoch declared now.
    pub epoch: u64,
    /// Journal operations and bytes written again after reconnects.
    pub replayed_ops: u64,
    pub replayed_bytes: u64,
    /// FLUSHes the front sent because the journal was full.
    pub budget_flushes: u64,
    /// Bytes in the journal now.
    pub journal_bytes: u64,
    /// Clients dropped for breaking the protocol.
    pub protocol_errors: u64,
    /// The last reconnect: milliseconds from noticing the loss to the new
    /// connection being ready (the journal replayed).
    pub last_reconnect_ms: Option<u64>,
    /// The last I/O pause: milliseconds from noticing the loss to the
    /// first WRITE acknowledged after it.
    pub last_io_pause_ms: Option<u64>,
}

/// The state every local client shares.
#[derive(Debug)]
pub struct Front {
    link: Reconnecting<Replay>,
    desc: ExportDesc,
    offer: Offer,
    budget: u64,
    /// Held by the one writer that FLUSHes because the journal is full.
    budget_flush: tokio::sync::Mutex<()>,
    clients: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
    writes: AtomicU64,
    budget_flushes: AtomicU64,
    protocol_errors: AtomicU64,
    /// The outage the last I/O pause was measured for, and the pause.
    resumed: Mutex<Option<(Instant, Duration)>>,
}

/// An upstream failure as the local client is told it.
fn errno_of(e: &coronafs::CoronaError) -> (NbdErrno, String) {
    match e {
        coronafs::CoronaError::Nbd { errno, message } => (*errno, message.clone()),
        other => (NbdErrno::Io, other.to_string()),
    }
}

impl Front {
    /// Connects to the volume's primary.
    pub async fn connect(cfg: &FrontConfig) -> Result<Front> {
        let link = Reconnecting::connect(&cfg.coronafs_nodes, &cfg.volume, cfg.epoch, Replay::default()).await?;
        let info = link.info().await;
        let desc = ExportDesc {
            name: cfg.volume.clone(),
            size: link.size(),
            read_only: link.read_only(),
            description: format!("CoronaFS volume {} through plasmavmc nbd-front", cfg.volume),
            min_block: 1,
            pref_block: info.pref_block.clamp(512, MAX_BLOCK),
            max_block: info.max_block.min(MAX_BLOCK),
        };
        Ok(Front {
            link,
            desc,
            offer: offer(info.flags),
            budget: cfg.replay_budget,
            budget_flush: tokio::sync::Mutex::new(()),
            clients: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            budget_flushes: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            resumed: Mutex::new(None),
        })
    }

    /// The export local clients see.
    pub fn export(&self) -> &ExportDesc {
        &self.desc
    }

    pub fn stats(&self) -> FrontStats {
        let replay = self.link.hook();
        let outage = self.link.last_outage();
        let resumed = *self.resumed.lock().unwrap_or_else(|e| e.into_inner());
        FrontStats {
            clients: self.clients.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            reconnects: self.link.reconnects(),
            epoch: self.link.epoch(),
            replayed_ops: replay.replayed_ops.load(Ordering::Relaxed),
            replayed_bytes: replay.replayed_bytes.load(Ordering::Relaxed),
            budget_flushes: self.budget_flushes.load(Ordering::Relaxed),
            journal_bytes: replay.journal().bytes(),
            protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
            last_reconnect_ms: outage.map(|o| (o.reconnected_at - o.lost_at).as_millis() as u64),
            last_io_pause_ms: match (outage, resumed) {
                (Some(o), Some((lost, pause))) if o.lost_at == lost => Some(pause.as_millis() as u64),
                _ => None,
            },
        }
    }

    /// A WRITE was acknowledged: the first after an outage ends the I/O pause.
    fn wrote(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        if let Some(o) = self.link.last_outage() {
            let mut r = self.resumed.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none_or(|(lost, _)| lost != o.lost_at) {
                *r = Some((o.lost_at, o.lost_at.elapsed()));
            }
        }
    }

    pub async fn read(&self, offset: u64, len: u32) -> std::result::Result<Vec<u8>, (NbdErrno, String)> {
        self.link.call(|c| async move { c.read(offset, len as usize).await }).await.map_err(|e| errno_of(&e))
    }

    /// WRITE, WRITE_ZEROES or TRIM: sent, and once acknowledged kept in the
    /// journal (before the connection may be replaced, so a replay sees it).
    pub async fn change(&self, op: Op, fua: bool) -> std::result::Result<(), (NbdErrno, String)> {
        let fua_flag = if fua { coronafs::proto::cmd_flags::FUA } else { 0 };
        let op = &op;
        let r = self
            .link
            .call(|c| async move {
                match op {
                    Op::Write { offset, data } => c.write(*offset, data, fua).await?,
                    Op::Zeroes { offset, len, flags } => c.write_zeroes(*offset, *len, *flags | fua_flag).await?,
                    Op::Trim { offset, len, flags } => {
                        let flags = *flags | fua_flag;
                        c.raw(coronafs::proto::request::Command::Trim, flags, *offset, *len, &[]).await?
                    }
                }
                // A FAST_ZERO succeeded once; written again it need not be fast.
                let kept = match op {
                    Op::Zeroes { offset, len, flags } => {
                        Op::Zeroes { offset: *offset, len: *len, flags: flags & coronafs::proto::cmd_flags::NO_HOLE }
                    }
                    other => other.clone(),
                };
                self.link.hook().journal().record(kept);
                Ok(())
            })
            .await;
        r.map_err(|e| errno_of(&e))?;
        if matches!(op, Op::Write { .. }) {
            self.wrote();
        }
        if self.link.hook().journal().bytes() >= self.budget {
            // Every writer over the budget waits for a FLUSH (one at a
            // time), so the journal cannot grow past the budget by more
            // than the writes in flight while it runs.
            let _one = self.budget_flush.lock().await;
            if self.link.hook().journal().bytes() >= self.budget {
                self.budget_flushes.fetch_add(1, Ordering::Relaxed);
                self.flush().await?;
            }
        }
        Ok(())
    }

    /// FLUSH: when it succeeds, the journal drops what it covered.
    pub async fn flush(&self) -> std::result::Result<(), (NbdErrno, String)> {
        self.link
            .call(|c| async move {
                let mark = self.link.hook().journal().mark();
                c.flush().await?;
                self.link.hook().journal().covered(mark);
                Ok(())
            })
            .await
            .map_err(|e| errno_of(&e))
    }
}

/// A running front.
#[derive(Debug)]
pub struct FrontServer {
    pub front: Arc<Front>,
    /// Where it listens: `ADDR` or the Unix socket's path.
    pub listening: String,
    task: tokio::task::JoinHandle<()>,
    unix: Option<PathBuf>,
}

impl FrontServer {
    /// Validates the config, connects to the volume and starts listening.
    pub async fn start(cfg: FrontConfig) -> Result<FrontServer> {
        cfg.validate()?;
        let front = Arc::new(Front::connect(&cfg).await?);
        let (listening, task, unix) = match &cfg.listen {
            Listen::Tcp(a) => {
                let l = tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| PlasmaError::Config(format!("cannot listen on {a}: {e}")))?;
                let at = l.local_addr()?;
                let f = front.clone();
                let task = tokio::spawn(async move {
                    loop {
                        match l.accept().await {
                            Ok((s, peer)) => {
                                let _ = s.set_nodelay(true);
                                let (rd, wr) = s.into_split();
                                tokio::spawn(conn::serve(rd, wr, f.clone(), peer.to_string()));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "accept failed");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        }
                    }
                });
                (at.to_string(), task, None)
            }
            Listen::Unix(p) => {
                use std::os::unix::fs::{FileTypeExt, PermissionsExt};
                if let Ok(m) = std::fs::symlink_metadata(p) {
                    if !m.file_type().is_socket() {
                        return Err(PlasmaError::Config(format!("{} exists and is not a socket", p.display())));
                    }
                    std::fs::remove_file(p)?;
                }
                // The front has no authentication: the socket is 0600 before
                // anyone can reach it (bound in a private 0700 directory
                // beside it, then moved into place), not chmod-ed after a
                // bind in the open.
                let parent = p.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
                let private = parent.join(format!(".nbd-front.{}", std::process::id()));
                {
                    use std::os::unix::fs::DirBuilderExt;
                    std::fs::DirBuilder::new()
                        .mode(0o700)
                        .create(&private)
                        .map_err(|e| PlasmaError::Config(format!("cannot make {}: {e}", private.display())))?;
                }
                let tmp = private.join("s");
                let bound = tokio::net::UnixListener::bind(&tmp)
                    .and_then(|l| std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600)).map(|()| l))
                    .and_then(|l| std::fs::rename(&tmp, p).map(|()| l));
                let _ = std::fs::remove_file(&tmp);
                let _ = std::fs::remove_dir(&private);
                let l = bound.map_err(|e| PlasmaError::Config(format!("cannot listen on {}: {e}", p.display())))?;
                let f = front.clone();
                let task = tokio::spawn(async move {
                    loop {
                        match l.accept().await {
                            Ok((s, _)) => {
                                let (rd, wr) = s.into_split();
                                tokio::spawn(conn::serve(rd, wr, f.clone(), "unix".into()));
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "accept failed");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        }
                    }
                });
                (p.display().to_string(), task, Some(p.clone()))
            }
        };
        tracing::info!(%listening, volume = %cfg.volume, epoch = cfg.epoch, "plasmavmc nbd-front serving");
        Ok(FrontServer { front, listening, task, unix })
    }

    /// Stops listening (connected clients are cut as the process ends) and
    /// FLUSHes, so what the journal held is durable on CoronaFS.
    pub async fn shutdown(self) -> Result<()> {
        self.task.abort();
        if let Some(p) = &self.unix {
            let _ = std::fs::remove_file(p);
        }
        if !self.front.link.read_only() {
            self.front.flush().await.map_err(|(errno, m)| PlasmaError::Volume(format!("final FLUSH: {errno}: {m}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> FrontConfig {
        FrontConfig {
            listen: Listen::Tcp("127.0.0.1:0".parse().expect("addr")),
            coronafs_nodes: vec!["10.0.0.1:10809".into()],
            volume: "vol".into(),
            epoch: 1,
            replay_budget: REPLAY_BUDGET,
        }
    }

    #[test]
    fn front_configs_refuse_addresses_off_loopback_and_bad_values() {
        cfg().validate().expect("valid");
        let off = FrontConfig { listen: Listen::Tcp("0.0.0.0:10809".parse().expect("addr")), ..cfg() };
        assert!(off.validate().expect_err("refused").to_string().contains("loopback"));
        assert!(FrontConfig { coronafs_nodes: vec![], ..cfg() }.validate().is_err());
        assert!(FrontConfig { coronafs_nodes: vec!["nowhere".into()], ..cfg() }.validate().is_err());
        assert!(FrontConfig { volume: "vol;epoch=3".into(), ..cfg() }.validate().is_err());
        assert!(FrontConfig { replay_budget: 1 << 20, ..cfg() }.validate().is_err());
        FrontConfig { listen: Listen::Unix("/run/x.sock".into()), ..cfg() }.validate().expect("a socket");
    }

    #[test]
    fn the_offer_forwards_only_what_the_front_implements_and_coronafs_announced() {
        let all = offer(u16::MAX);
        assert!(!all.extended_headers && !all.base_allocation);
        assert_eq!(all.tx_flags, FORWARDED);
        assert_eq!(all.tx_flags & (tx_flags::SEND_CACHE | tx_flags::SEND_DF | tx_flags::CAN_MULTI_CONN), 0);
        let some = offer(tx_flags::SEND_FLUSH);
        assert_eq!(some.tx_flags, tx_flags::HAS_FLAGS | tx_flags::SEND_FLUSH);
    }
}
