//! Starting a server in-process (the binary, the tests and the bench all use
//! [`Server::start`]).

use crate::app::App;
use crate::config::Config;
use crate::error::Result;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;

/// A running PlasmaVMC server.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Validates the config, opens the metadata, makes sure the artifact
    /// bucket exists and starts serving.
    pub async fn start(cfg: Config) -> Result<Server> {
        cfg.validate()?;
        let tokens = cfg.tokens()?;
        svc_kit::api_token::check_exposure(
            "PlasmaVMC",
            cfg.listen,
            tokens.api.as_ref(),
            cfg.no_api_token,
            "--api-token-file, PLASMAVMC_API_TOKEN, or api_token_file in --config",
        )
        .map_err(|e| crate::error::PlasmaError::Config(e.to_string()))?;
        let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
        let addr = listener.local_addr()?;
        let cfg2 = cfg.clone();
        let app = tokio::task::spawn_blocking(move || App::new(cfg2)).await??;
        app.s3.ensure_bucket().await?;
        app.clean_leftovers().await?;
        let (stop, mut stopped) = watch::channel(false);
        let router =
            svc_kit::api_token::protect(crate::api::router(app.clone()), tokens.api, crate::wire::unauthorized);
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(listener, router).with_graceful_shutdown(shutdown).await {
                tracing::error!(error = %e, "API server stopped");
            }
        });
        tracing::info!(%addr, "plasmavmc serving");
        Ok(Server { addr, app, stop, task })
    }

    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}
