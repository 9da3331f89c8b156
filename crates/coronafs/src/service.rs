//! Start-up and shutdown of a CoronaFS server: builds the data path engine
//! ([`crate::backend::Opener`]), loads the volumes, binds the NBD listener
//! ([`crate::server`]) and the control API ([`crate::api`]) beside it from a
//! [`ServerConfig`], with the replica listener ([`crate::server::replica`])
//! and the volume map's member ([`crate::replication::map`]) when the
//! server is a node of a cluster, and stops them again.

use crate::backend::{IoEngine, Opener};
use crate::config::ServerConfig;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::proto::handshake::TlsMode;
use crate::server::Shared;
use crate::volume::Volumes;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A started server. Dropping it without [`RunningServer::shutdown`] leaves
/// it running until the runtime ends.
#[derive(Debug)]
pub struct RunningServer {
    pub nbd_addr: SocketAddr,
    pub api_addr: SocketAddr,
    /// Where replica connections are taken, when the server is in a cluster.
    pub replica_addr: Option<SocketAddr>,
    /// The engine in use (may differ from the one asked for after a fallback).
    pub engine: IoEngine,
    /// The volume manager both the NBD server and the API work on.
    pub volumes: Arc<Volumes>,
    /// The server's counters (rendered at `/metrics`).
    pub metrics: Arc<Metrics>,
    /// The token its control API requires, if any.
    pub api_token: Option<svc_kit::api_token::ApiToken>,
    /// Its member of the volume map, when the server is in a cluster.
    pub map: Option<Arc<crate::replication::map::MapNode>>,
    stop: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl RunningServer {
    /// `nbd://host:port/NAME` for a volume.
    pub fn nbd_uri(&self, name: &str) -> String {
        format!("nbd://{}/{}", self.nbd_addr, name)
    }

    /// `http://host:port` of the control API.
    pub fn api_url(&self) -> String {
        format!("http://{}", self.api_addr)
    }

    /// A client of the control API carrying its token.
    pub fn api_client(&self) -> crate::api_client::ApiClient {
        crate::api_client::ApiClient::new(&self.api_url()).with_token(self.api_token.clone())
    }

    /// Stops accepting, drops every connection and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        self.volumes.flush_all().await;
        if let Some(map) = &self.map {
            map.shutdown().await;
        }
    }

    /// Stops like a crash (kill -9) as far as the data dir can tell: the
    /// listeners and tasks stop, open volumes are dropped without a flush
    /// or a clean close, so every mark and record stays as it was.
    #[cfg(any(test, feature = "testing"))]
    pub async fn crash(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        if let Some(map) = &self.map {
            map.shutdown().await;
        }
        self.volumes.abandon().await;
        // The next start opens the same store: wait (at most 5 s) until no
        // task holds the volume manager any more.
        for _ in 0..500 {
            if Arc::strong_count(&self.volumes) == 1 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        tracing::warn!("the volume manager is still held after the crash");
    }

    /// Runs until ctrl-c or SIGTERM, then shuts down.
    pub async fn run_until_signal(self) {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
        tracing::info!("shutting down");
        self.shutdown().await;
    }
}

/// Loads the TLS credentials and the volumes, binds both listeners and
/// starts serving.
pub async fn start(cfg: ServerConfig) -> Result<RunningServer> {
    let tls = match (cfg.tls.mode, &cfg.tls.certificates) {
        (TlsMode::Off, _) => None,
        (mode, Some(dir)) => Some((mode, crate::server::tls::acceptor(dir, cfg.tls.verify_peer)?)),
        (mode, None) => {
            return Err(crate::CoronaError::Config(format!("--tls {mode} needs --tls-certificates DIR")));
        }
    };
    svc_kit::api_token::check_exposure(
        "CoronaFS",
        cfg.api,
        cfg.api_token.as_ref(),
        cfg.no_api_token,
        "--api-token-file, CORONAFS_API_TOKEN, or api_token_file in --config",
    )?;
    std::fs::create_dir_all(&cfg.data_dir)?;
    let opener = Opener::start(cfg.engine);
    let engine = opener.engine();
    let volumes = Arc::new(Volumes::load(cfg.data_dir.clone(), opener, cfg.read_only)?);
    let metrics = Arc::new(Metrics::default());
    let mut map = None;
    let replica = match &cfg.cluster {
        Some((file, node)) => {
            let mut m = crate::cluster::Membership::new(file.clone(), node, metrics.clone())?;
            m.api_token = cfg.api_token.clone();
            let listener = TcpListener::bind(m.me()?.replica).await?;
            let secret = m.secret.clone();
            // The volume map's member, before any primary opens (it
            // registers volumes made before the map); its peers reach it
            // through the listener bound above.
            let timing = crate::replication::map::Timing::for_cluster(&m.cluster);
            map = Some(crate::replication::map::MapNode::start(&m.cluster, &m.node, &cfg.data_dir, timing).await?);
            volumes.join(m)?;
            if let Some(map) = &map {
                volumes.attach_map(map.clone())?;
            }
            if !cfg.read_only {
                volumes.open_primaries();
                // Copies of volumes deleted before the stop that were not
                // reached yet.
                volumes.retry_deletions();
            }
            Some((listener, secret))
        }
        None => None,
    };
    let replica_addr = replica.as_ref().map(|(l, _)| l.local_addr()).transpose()?;
    let nbd = TcpListener::bind(cfg.nbd).await?;
    let api = TcpListener::bind(cfg.api).await?;
    let (nbd_addr, api_addr) = (nbd.local_addr()?, api.local_addr()?);
    let (stop, stopped) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let mut shared = Shared::new(volumes.clone(), metrics.clone());
    if let Some((mode, acceptor)) = tls {
        shared = shared.with_tls(mode, acceptor);
    }
    let shared = Arc::new(shared);
    tasks.spawn(crate::server::serve(nbd, shared, stopped.clone()));
    if let Some((listener, secret)) = replica {
        tasks.spawn(crate::server::replica::serve(listener, volumes.clone(), secret, stopped.clone()));
    }
    let app = svc_kit::api_token::protect(
        crate::api::router(volumes.clone(), metrics.clone()),
        cfg.api_token.clone(),
        crate::api::unauthorized,
    );
    let mut api_stop = stopped;
    tasks.spawn(async move {
        let shutdown = async move {
            let _ = api_stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(api, app).with_graceful_shutdown(shutdown).await {
            tracing::error!(error = %e, "control API stopped");
        }
    });
    let tls = cfg.tls.mode;
    tracing::info!(%nbd_addr, %api_addr, ?replica_addr, %engine, %tls, dir = %cfg.data_dir.display(), "coronafs serving");
    let api_token = cfg.api_token;
    Ok(RunningServer { nbd_addr, api_addr, replica_addr, engine, volumes, metrics, api_token, map, stop, tasks })
}
