//! A connection to a CoronaFS volume that survives CoronaFS restarts and
//! failovers of a replicated volume, as a hypervisor's NBD client does:
//! when the connection breaks, [`Reconnecting::call`] reconnects (retrying
//! for up to [`RECONNECT_FOR`]) to whichever of the CoronaFS nodes it knows
//! is the volume's primary ([`NbdClient::connect_primary`]) and sends the
//! request again. NBD writes are idempotent, so resending one is safe.
//!
//! A failover elects the new primary at a higher epoch than the one the
//! connection declared (`VOL;epoch=N`). The new primary refuses the old
//! epoch, and says in its refusal which epoch the stream it took over was
//! written at (`failover-from=N failover-epoch=M`,
//! [`coronafs::client::failover_hint`]); only a connection that held
//! exactly that epoch N follows to M. One that was fenced out before (a
//! migration's source, at a lower epoch) is refused as before, so a
//! failover never lets a stale writer write again.
//!
//! What a user must do on a new connection before anything else is sent on
//! it is an [`OnReconnect`]: the emulated guest forgets what no FLUSH
//! covered ([`crate::guest`]); the NBD front writes it again
//! ([`crate::front`]). Two users, one reconnect loop.

use crate::error::{PlasmaError, Result};
use coronafs::client::{NbdClient, failover_hint, primary_hint};
use coronafs::proto::NbdErrno;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a connection keeps trying to reconnect after it broke.
pub const RECONNECT_FOR: Duration = Duration::from_secs(60);
/// Pause between reconnect attempts.
const RECONNECT_EVERY: Duration = Duration::from_millis(200);

/// `VOL;epoch=N`.
pub fn export_name(volume: &str, epoch: u64) -> String {
    format!("{volume}{}{epoch}", coronafs::volume::fence::EPOCH_SUFFIX)
}

/// An error that means the connection (or the server) went away, as
/// opposed to an answer from the server.
pub fn connection_lost(e: &coronafs::CoronaError) -> bool {
    matches!(e, coronafs::CoronaError::Disconnected | coronafs::CoronaError::Io(_))
}

/// Whether a failed connect may succeed later: the node was unreachable, or
/// it holds only a replica whose primary is not reachable yet (a failover
/// may be under way).
fn may_come_back(e: &coronafs::CoronaError) -> bool {
    connection_lost(e) || primary_hint(&e.to_string()).is_some()
}

/// Resolves `host:port` names (unresolvable ones are left out, logged).
async fn resolve(nodes: &[String]) -> Vec<std::net::SocketAddr> {
    let mut out = Vec::with_capacity(nodes.len());
    for n in nodes {
        match tokio::net::lookup_host(n.as_str()).await.map(|mut a| a.next()) {
            Ok(Some(a)) => out.push(a),
            _ => tracing::warn!(node = %n, "cannot resolve a CoronaFS NBD address"),
        }
    }
    out
}

/// What runs on a new connection, under the reconnect, before any request
/// is sent (again) on it. An error that says the connection was lost (or
/// `EIO`, a new primary still below its write quorum) makes the reconnect
/// try again; any other error ends it.
pub trait OnReconnect: Send + Sync {
    fn reconnected(&self, c: &NbdClient) -> impl Future<Output = coronafs::Result<()>> + Send;
}

/// Nothing to do on a new connection.
impl OnReconnect for () {
    async fn reconnected(&self, _: &NbdClient) -> coronafs::Result<()> {
        Ok(())
    }
}

/// The last time a connection was lost and replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    /// When the request that found the connection broken began reconnecting.
    pub lost_at: Instant,
    /// When the new connection was ready (after [`OnReconnect`]).
    pub reconnected_at: Instant,
    /// The epoch declared on the new connection.
    pub epoch: u64,
}

/// A connection to one volume at one epoch (a higher one after following
/// a failover), replaced when it breaks.
#[derive(Debug)]
pub struct Reconnecting<H> {
    volume: String,
    epoch: AtomicU64,
    size: u64,
    read_only: bool,
    /// The CoronaFS NBD addresses to find the primary among.
    nodes: Vec<String>,
    /// Held shared while a request runs, exclusively while the connection
    /// is replaced: a request that finished on the old connection (and
    /// recorded what it did) is done before [`OnReconnect`] runs.
    nbd: tokio::sync::RwLock<Arc<NbdClient>>,
    reconnects: AtomicU64,
    outage: Mutex<Option<Outage>>,
    hook: H,
}

impl<H: OnReconnect> Reconnecting<H> {
    /// Connects to `volume` declaring `epoch`, at the primary among `nodes`
    /// (CoronaFS NBD addresses, `host:port`; one for a CoronaFS without
    /// replicas).
    pub async fn connect(nodes: &[String], volume: &str, epoch: u64, hook: H) -> Result<Self> {
        let export = export_name(volume, epoch);
        let (nbd, _) = NbdClient::connect_primary(&resolve(nodes).await, &export)
            .await
            .map_err(|e| PlasmaError::Volume(format!("attaching {export} at {}: {e}", nodes.join(", "))))?;
        Ok(Reconnecting {
            volume: volume.to_owned(),
            epoch: AtomicU64::new(epoch),
            size: nbd.size(),
            read_only: nbd.info().read_only(),
            nodes: nodes.to_vec(),
            nbd: tokio::sync::RwLock::new(Arc::new(nbd)),
            reconnects: AtomicU64::new(0),
            outage: Mutex::new(None),
            hook,
        })
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }

    /// The epoch declared now.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    pub fn export(&self) -> String {
        export_name(&self.volume, self.epoch())
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    pub fn hook(&self) -> &H {
        &self.hook
    }

    /// What the first connection was told about the export.
    pub async fn info(&self) -> coronafs::client::ExportInfo {
        self.nbd.read().await.info().clone()
    }

    /// Connections replaced so far.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// The last connection lost and replaced, if any was.
    pub fn last_outage(&self) -> Option<Outage> {
        *self.outage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `op` on the current connection; when the connection is lost,
    /// reconnects (for up to [`RECONNECT_FOR`]) and runs it again. The
    /// connection is not replaced while `op` runs, so what `op` records
    /// after its answer is in place before [`OnReconnect`] runs.
    pub async fn call<T, F, Fut>(&self, op: F) -> coronafs::Result<T>
    where
        F: Fn(Arc<NbdClient>) -> Fut,
        Fut: Future<Output = coronafs::Result<T>>,
    {
        let started = Instant::now();
        loop {
            let guard = self.nbd.read().await;
            let c = guard.clone();
            let r = op(c.clone()).await;
            drop(guard);
            match r {
                Err(e) if connection_lost(&e) => {
                    tracing::warn!(export = %self.export(), error = %e, "NBD connection lost; reconnecting");
                    self.reconnect(&c, started).await?;
                }
                r => return r,
            }
        }
    }

    /// Replaces the broken connection `old` (unless another request already
    /// did) with one to the volume's primary, following a failover's new
    /// epoch when this connection held the epoch the failover took over,
    /// and runs the hook on it. Gives up after [`RECONNECT_FOR`] since
    /// `started`, or at once when CoronaFS answers but refuses the export
    /// (fenced, deleted).
    async fn reconnect(&self, old: &Arc<NbdClient>, started: Instant) -> coronafs::Result<()> {
        let mut cur = self.nbd.write().await;
        if !Arc::ptr_eq(&cur, old) {
            return Ok(());
        }
        let lost_at = Instant::now();
        loop {
            let export = self.export();
            let retry = match NbdClient::connect_primary(&resolve(&self.nodes).await, &export).await {
                Ok((c, at)) if c.size() == self.size && c.info().read_only() == self.read_only => {
                    match self.hook.reconnected(&c).await {
                        Ok(()) => {
                            *cur = Arc::new(c);
                            self.reconnects.fetch_add(1, Ordering::Relaxed);
                            let outage = Outage { lost_at, reconnected_at: Instant::now(), epoch: self.epoch() };
                            *self.outage.lock().unwrap_or_else(|e| e.into_inner()) = Some(outage);
                            tracing::info!(%export, %at, "NBD connection re-established");
                            return Ok(());
                        }
                        Err(e)
                            if connection_lost(&e)
                                || matches!(&e, coronafs::CoronaError::Nbd { errno: NbdErrno::Io, .. }) =>
                        {
                            tracing::warn!(%export, %at, error = %e, "the new connection failed before it was used");
                            e
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok((c, _)) => {
                    return Err(coronafs::CoronaError::Negotiation(format!(
                        "{export} reopened with size {} (was {}){}",
                        c.size(),
                        self.size,
                        if c.info().read_only() != self.read_only { ", read-only changed" } else { "" }
                    )));
                }
                Err(e) => match failover_hint(&e.to_string()) {
                    // The primary a failover elected took over the stream of
                    // this connection's epoch: follow it (the epoch only rises).
                    Some((from, to)) if from == self.epoch() && to > from && started.elapsed() < RECONNECT_FOR => {
                        tracing::warn!(volume = %self.volume, from, to, "following a failover to its new epoch");
                        self.epoch.store(to, Ordering::SeqCst);
                        continue;
                    }
                    _ if may_come_back(&e) => e,
                    _ => return Err(e),
                },
            };
            if started.elapsed() >= RECONNECT_FOR {
                return Err(retry);
            }
            tokio::time::sleep(RECONNECT_EVERY).await;
        }
    }
}
