//! The CoronaFS server: an NBD listener and the HTTP control API, sharing one
//! export table.

pub mod bufpool;
pub mod conn;
pub mod exports;

use crate::backend::{IoEngine, Opener};
use crate::error::Result;
use crate::metrics::Metrics;
use bufpool::BufPool;
use exports::Exports;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How to run a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Directory holding the metadata store and the layer files.
    pub data_dir: PathBuf,
    /// NBD listen address (port 0 picks a free port).
    pub nbd: SocketAddr,
    /// HTTP control API listen address (port 0 picks a free port).
    pub api: SocketAddr,
    /// Data path engine.
    pub engine: IoEngine,
    /// Export every volume read-only.
    pub read_only: bool,
}

impl ServerConfig {
    /// A config on loopback with OS-chosen ports: what tests and the bench use.
    pub fn ephemeral(data_dir: impl Into<PathBuf>, engine: IoEngine) -> Self {
        ServerConfig {
            data_dir: data_dir.into(),
            nbd: SocketAddr::from(([127, 0, 0, 1], 0)),
            api: SocketAddr::from(([127, 0, 0, 1], 0)),
            engine,
            read_only: false,
        }
    }
}

/// State shared by every connection and the API.
#[derive(Debug)]
pub struct Shared {
    pub exports: Exports,
    pub metrics: Metrics,
    pub pool: BufPool,
}

/// A started server. Dropping it without [`RunningServer::shutdown`] leaves
/// it running until the runtime ends.
#[derive(Debug)]
pub struct RunningServer {
    pub nbd_addr: SocketAddr,
    pub api_addr: SocketAddr,
    /// The engine in use (may differ from the one asked for after a fallback).
    pub engine: IoEngine,
    pub shared: Arc<Shared>,
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

    /// Stops accepting, drops every connection and waits for the tasks to end.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        self.shared.exports.flush_all().await;
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

/// Binds both listeners and starts serving.
pub async fn start(cfg: ServerConfig) -> Result<RunningServer> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    let opener = Opener::start(cfg.engine);
    let engine = opener.engine();
    let shared = Arc::new(Shared {
        exports: Exports::load(cfg.data_dir.clone(), opener, cfg.read_only)?,
        metrics: Metrics::default(),
        pool: BufPool::default(),
    });
    let nbd = TcpListener::bind(cfg.nbd).await?;
    let api = TcpListener::bind(cfg.api).await?;
    let (nbd_addr, api_addr) = (nbd.local_addr()?, api.local_addr()?);
    let (stop, stopped) = watch::channel(false);
    let mut tasks = JoinSet::new();
    tasks.spawn(accept_nbd(nbd, shared.clone(), stopped.clone()));
    let app = crate::api::router(shared.clone());
    let mut api_stop = stopped.clone();
    tasks.spawn(async move {
        let shutdown = async move {
            let _ = api_stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(api, app).with_graceful_shutdown(shutdown).await {
            tracing::error!(error = %e, "control API stopped");
        }
    });
    tracing::info!(%nbd_addr, %api_addr, %engine, dir = %cfg.data_dir.display(), "coronafs serving");
    Ok(RunningServer { nbd_addr, api_addr, engine, shared, stop, tasks })
}

async fn accept_nbd(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(conn::serve(stream, shared.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = async { let _ = stopped.wait_for(|s| *s).await; } => break,
        }
    }
    conns.shutdown().await;
}
