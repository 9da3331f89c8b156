//! `plasmavmc agent`: a worker process holding the NBD connections of the
//! VMs placed on it and running their guest I/O ([`crate::guest`]). The
//! control plane (`plasmavmc serve` with `[[workers]]`) drives it over HTTP:
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | `ok` and the worker's name |
//! | GET | `/v1/attachments` | every attachment's [`Report`] |
//! | POST | `/v1/attachments` | [`Attach`]: connect `VOL;epoch=N`, start `io_ops` writes |
//! | GET | `/v1/attachments/{vm}` | [`Report`] with the write log |
//! | POST | `/v1/attachments/{vm}/flush` | [`FlushReq`]: (pause,) take the log, FLUSH; the [`Report`] |
//! | POST | `/v1/attachments/{vm}/verify` | [`VerifyReq`]: read the log back; [`Verified`] |
//! | POST | `/v1/attachments/{vm}/io` | [`StartIo`]: run more guest writes |
//! | DELETE | `/v1/attachments/{vm}` | stop the guest, disconnect |
//!
//! Errors answer `{"error": "..."}` with the status of [`PlasmaError::http_status`].
//! The same [`Agent`] type is the in-process worker the control plane uses
//! when no `[[workers]]` are configured.

use crate::error::{PlasmaError, Result};
use crate::guest::{Attachment, Report, Verified, WriteLog};
use crate::model::ApiError;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
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
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8090)),
            name: String::new(),
            coronafs_nbd: "127.0.0.1:10809".into(),
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
        crate::vms::check_worker(&self.name).map_err(|e| PlasmaError::Config(format!("name: {e}")))?;
        if self.coronafs_nbd.rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()) {
            return Err(PlasmaError::Config(format!("coronafs_nbd {:?} must be host:port", self.coronafs_nbd)));
        }
        Ok(())
    }
}

/// Body of `POST /v1/attachments`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attach {
    pub vm_id: String,
    /// CoronaFS volume name.
    pub volume: String,
    /// Epoch to declare when opening the export.
    pub epoch: u64,
    /// Guest writes to start right away (0: attach only).
    #[serde(default)]
    pub io_ops: u64,
    /// First write's sequence number.
    #[serde(default)]
    pub seq_start: u64,
}

/// Body of `POST /v1/attachments/{vm}/flush`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlushReq {
    /// Stop guest I/O first, so the returned log is final.
    #[serde(default)]
    pub pause: bool,
}

/// Body of `POST /v1/attachments/{vm}/verify`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyReq {
    /// Blocks and the write each must hold (or a later one).
    pub log: WriteLog,
    /// Make what was found this guest's log (the target of a migration).
    #[serde(default)]
    pub adopt: bool,
}

/// Body of `POST /v1/attachments/{vm}/io`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartIo {
    pub ops: u64,
    #[serde(default)]
    pub seq_start: u64,
}

/// One worker: its attachments by VM id.
#[derive(Debug)]
pub struct Agent {
    pub name: String,
    pub nbd: String,
    vms: tokio::sync::Mutex<HashMap<String, Arc<Attachment>>>,
    /// Guest writes CoronaFS refused as fenced.
    pub fenced_writes: Arc<AtomicU64>,
}

impl Agent {
    pub fn new(name: &str, nbd: &str, fenced_writes: Arc<AtomicU64>) -> Self {
        Agent { name: name.to_owned(), nbd: nbd.to_owned(), vms: Default::default(), fenced_writes }
    }

    async fn get(&self, vm: &str) -> Result<Arc<Attachment>> {
        self.vms.lock().await.get(vm).cloned().ok_or_else(|| PlasmaError::not_found("attachment", vm))
    }

    /// The attachment of `vm` here, if any (tests reach the guest through it).
    pub async fn attachment(&self, vm: &str) -> Option<Arc<Attachment>> {
        self.vms.lock().await.get(vm).cloned()
    }

    pub async fn attach(&self, req: Attach) -> Result<Report> {
        let mut vms = self.vms.lock().await;
        if vms.contains_key(&req.vm_id) {
            return Err(PlasmaError::Conflict(format!("VM {} is already attached on {}", req.vm_id, self.name)));
        }
        let att =
            Attachment::connect(&self.nbd, &req.vm_id, &self.name, &req.volume, req.epoch, self.fenced_writes.clone())
                .await?;
        if req.io_ops > 0 {
            att.start_io(req.io_ops, req.seq_start).await?;
        }
        vms.insert(req.vm_id.clone(), att.clone());
        tracing::info!(vm = %req.vm_id, volume = %req.volume, epoch = req.epoch, worker = %self.name, "attached");
        Ok(att.report().await)
    }

    pub async fn report(&self, vm: &str) -> Result<Report> {
        Ok(self.get(vm).await?.report().await)
    }

    pub async fn list(&self) -> Vec<Report> {
        let atts: Vec<Arc<Attachment>> = self.vms.lock().await.values().cloned().collect();
        let mut out = Vec::with_capacity(atts.len());
        for a in atts {
            out.push(a.report().await);
        }
        out
    }

    pub async fn flush(&self, vm: &str, req: FlushReq) -> Result<Report> {
        self.get(vm).await?.flush_report(req.pause).await
    }

    pub async fn verify(&self, vm: &str, req: VerifyReq) -> Result<Verified> {
        self.get(vm).await?.verify(&req.log, req.adopt).await
    }

    pub async fn start_io(&self, vm: &str, req: StartIo) -> Result<()> {
        self.get(vm).await?.start_io(req.ops, req.seq_start).await
    }

    /// Stops the guest and drops the connection; a missing VM is detached.
    pub async fn detach(&self, vm: &str) -> Result<()> {
        let att = self.vms.lock().await.remove(vm);
        if let Some(att) = att {
            att.pause().await;
            tracing::info!(vm, worker = %self.name, "detached");
        }
        Ok(())
    }
}

type St = State<Arc<Agent>>;
type Res<T> = std::result::Result<T, PlasmaError>;

fn body<T>(b: std::result::Result<Json<T>, JsonRejection>) -> Res<T> {
    b.map(|Json(x)| x).map_err(|e| PlasmaError::Invalid(format!("bad request body: {}", e.body_text())))
}

/// The agent's HTTP API.
pub fn router(agent: Arc<Agent>) -> Router {
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
    pub agent: Arc<Agent>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl AgentServer {
    /// Validates the config and starts serving.
    pub async fn start(cfg: AgentConfig) -> Result<AgentServer> {
        cfg.validate()?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| PlasmaError::Config(format!("cannot listen on {}: {e}", cfg.listen)))?;
        let addr = listener.local_addr()?;
        let agent = Arc::new(Agent::new(&cfg.name, &cfg.coronafs_nbd, Arc::default()));
        let (stop, mut stopped) = watch::channel(false);
        let app = router(agent.clone());
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
        let ids: Vec<String> = self.agent.vms.lock().await.keys().cloned().collect();
        for id in ids {
            let _ = self.agent.detach(&id).await;
        }
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
        assert!(AgentConfig { coronafs_nbd: "nowhere".into(), ..c }.validate().is_err());
    }
}
