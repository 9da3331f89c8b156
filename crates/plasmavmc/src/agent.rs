//! `plasmavmc agent`: a worker process serving one
//! [`LocalWorker`](crate::worker::local::LocalWorker) over HTTP: the
//! attachments of the VMs placed on it and their guest I/O. The control
//! plane (`plasmavmc serve` with `[[workers]]`) drives it through
//! [`RemoteWorker`](crate::worker::remote::RemoteWorker); the routes and
//! bodies are in [`crate::wire`]. With a token every route but `GET
//! /healthz` needs `Authorization: Bearer TOKEN`.

use crate::error::{PlasmaError, Result};
use crate::wire::{self, ApiError, Attach, FlushReq, Report, StartIo, Verified, VerifyReq};
use crate::worker::local::LocalWorker;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::watch;

/// `plasmavmc agent` configuration (TOML file or flags).
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct AgentConfig {
    /// HTTP listen address of the agent API (port 0 picks one).
    pub listen: SocketAddr,
    /// This worker's name, as the control plane's `[[workers]]` lists it.
    pub name: String,
    /// CoronaFS NBD address the VMs' volumes are reached at, `host:port`.
    pub coronafs_nbd: String,
    /// The NBD addresses of the other nodes of a CoronaFS cluster, where a
    /// replicated volume's primary is looked for after a failover.
    pub coronafs_nodes: Vec<String>,
    /// The agent API's bearer token (16 characters or more; the control
    /// plane's `agent_token`). Prefer `api_token_file`; `--api-token-file`
    /// and `PLASMAVMC_AGENT_TOKEN` win over both.
    pub api_token: Option<String>,
    /// A file holding the agent API's token.
    pub api_token_file: Option<std::path::PathBuf>,
    /// `--no-api-token` (a flag only): serve without a token off loopback.
    #[serde(skip)]
    pub no_api_token: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8090)),
            name: String::new(),
            coronafs_nbd: "127.0.0.1:10809".into(),
            coronafs_nodes: Vec::new(),
            api_token: None,
            api_token_file: None,
            no_api_token: false,
        }
    }
}

impl AgentConfig {
    /// Reads a TOML file (unknown fields are an error; errors name the
    /// file). Flags may still override it, so the caller validates the result.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        Ok(svc_kit::config::load(path)?)
    }

    pub fn validate(&self) -> Result<()> {
        wire::check_worker(&self.name).map_err(|e| PlasmaError::Config(format!("name: {e}")))?;
        crate::config::check_host_port("coronafs_nbd", &self.coronafs_nbd)?;
        for n in &self.coronafs_nodes {
            crate::config::check_host_port("coronafs_nodes", n)?;
        }
        self.token()?;
        Ok(())
    }

    /// The token from `api_token` or `api_token_file`.
    pub fn token(&self) -> Result<Option<svc_kit::api_token::ApiToken>> {
        crate::config::token("api_token", &self.api_token, &self.api_token_file)
    }
}

type St = State<Arc<LocalWorker>>;
type Res<T> = std::result::Result<T, PlasmaError>;

fn body<T>(b: std::result::Result<Json<T>, JsonRejection>) -> Res<T> {
    b.map(|Json(x)| x).map_err(|e| PlasmaError::Invalid(format!("bad request body: {}", e.body_text())))
}

/// The agent's HTTP API.
pub fn router(agent: Arc<LocalWorker>) -> Router {
    Router::new()
        .route("/healthz", get(|State(a): St| async move { format!("ok {}\n", a.name) }))
        .route("/v1/attachments", get(list).post(attach))
        .route("/v1/attachments/{vm}", get(report).delete(detach))
        .route("/v1/attachments/{vm}/flush", post(flush))
        .route("/v1/attachments/{vm}/verify", post(verify))
        .route("/v1/attachments/{vm}/io", post(start_io))
        .fallback(|| async {
            (StatusCode::NOT_FOUND, Json(ApiError { error: "no such route on a plasmavmc agent".into() }))
        })
        .with_state(agent)
}

async fn list(State(a): St) -> Json<Vec<Report>> {
    Json(a.list().await)
}

async fn attach(State(a): St, b: std::result::Result<Json<Attach>, JsonRejection>) -> Res<Response> {
    let r = a.attach(body(b)?).await?;
    Ok((StatusCode::CREATED, Json(r)).into_response())
}

async fn report(State(a): St, Path(vm): Path<String>) -> Res<Json<Report>> {
    Ok(Json(a.report(&vm).await?))
}

async fn detach(State(a): St, Path(vm): Path<String>) -> Res<StatusCode> {
    a.detach(&vm).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn flush(
    State(a): St,
    Path(vm): Path<String>,
    b: std::result::Result<Json<FlushReq>, JsonRejection>,
) -> Res<Json<Report>> {
    Ok(Json(a.flush(&vm, body(b)?).await?))
}

async fn verify(
    State(a): St,
    Path(vm): Path<String>,
    b: std::result::Result<Json<VerifyReq>, JsonRejection>,
) -> Res<Json<Verified>> {
    Ok(Json(a.verify(&vm, body(b)?).await?))
}

async fn start_io(
    State(a): St,
    Path(vm): Path<String>,
    b: std::result::Result<Json<StartIo>, JsonRejection>,
) -> Res<StatusCode> {
    a.start_io(&vm, body(b)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A running agent API.
#[derive(Debug)]
pub struct AgentServer {
    pub addr: SocketAddr,
    pub agent: Arc<LocalWorker>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl AgentServer {
    /// Validates the config and starts serving.
    pub async fn start(cfg: AgentConfig) -> Result<AgentServer> {
        cfg.validate()?;
        let token = cfg.token()?;
        svc_kit::api_token::check_exposure(
            "the plasmavmc agent",
            cfg.listen,
            token.as_ref(),
            cfg.no_api_token,
            "--api-token-file, PLASMAVMC_AGENT_TOKEN, or api_token_file in --config",
        )
        .map_err(|e| PlasmaError::Config(e.to_string()))?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| PlasmaError::Config(format!("cannot listen on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr()?;
        let nodes = crate::config::nbd_nodes(&cfg.coronafs_nbd, &cfg.coronafs_nodes);
        let agent = Arc::new(LocalWorker::new(&cfg.name, &nodes, Arc::default()));
        let (stop, mut stopped) = watch::channel(false);
        let app = svc_kit::api_token::protect(router(agent.clone()), token, wire::unauthorized);
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::error!(error = %e, "agent API stopped");
            }
        });
        tracing::info!(%addr, name = %cfg.name, nbd = %cfg.coronafs_nbd, "plasmavmc agent serving");
        Ok(AgentServer { addr, agent, stop, task })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops serving, then detaches every VM (their guests stop; the
    /// connections close).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        self.agent.detach_all().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_configs_refuse_unknown_fields_and_bad_values() {
        let e = svc_kit::config::parse::<AgentConfig>("name = \"a\"\nbogus = 1\n").unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let c: AgentConfig =
            svc_kit::config::parse("name = \"w1\"\ncoronafs_nbd = \"10.0.0.1:10809\"\n").expect("parse");
        c.validate().expect("valid");
        assert!(AgentConfig { name: String::new(), ..c.clone() }.validate().is_err());
        assert!(AgentConfig { coronafs_nbd: "nowhere".into(), ..c.clone() }.validate().is_err());
        let c: AgentConfig = svc_kit::config::parse(
            "name = \"w1\"\ncoronafs_nbd = \"10.0.0.1:10809\"\ncoronafs_nodes = [\"10.0.0.2:10809\", \"10.0.0.1:10809\"]\n",
        )
        .expect("parse");
        c.validate().expect("valid");
        let nodes = crate::config::nbd_nodes(&c.coronafs_nbd, &c.coronafs_nodes);
        assert_eq!(nodes, ["10.0.0.1:10809", "10.0.0.2:10809"], "the configured address first, once");
        assert!(AgentConfig { coronafs_nodes: vec!["10.0.0.3".into()], ..c }.validate().is_err());
    }
}
