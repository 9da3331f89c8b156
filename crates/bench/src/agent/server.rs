//! The agent's HTTP service (axum). Every route but `GET /healthz` needs the
//! token ([`svc_kit::api_token::protect`], the layer every control API of
//! the stack uses); handlers run the work in [`super::work`] and answer
//! JSON; an error is `{"error": "..."}` with 400 (bad request), 401 (token,
//! with `WWW-Authenticate: Bearer`), or 500 (the work failed).

use super::work::{self, Links};
use super::{
    AgentInfo, CleanupRequest, ErrorBody, Iperf3ClientRequest, Iperf3ServerReply, Iperf3ServerRequest, JobRequest,
    ObjectsRequest, PatternRequest, ProbeRequest, SteadyRequest,
};
use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// How an agent is set up.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub name: String,
    /// HTTP address.
    pub listen: SocketAddr,
    /// TCP sink address (network baseline).
    pub sink: SocketAddr,
    /// Directory for the local-disk baseline's files.
    pub scratch: PathBuf,
    pub token: String,
}

struct Shared {
    cfg: AgentConfig,
    sink_port: u16,
    links: Links,
    stop: Arc<AtomicBool>,
}

type S = State<Arc<Shared>>;

/// A running agent.
#[derive(Debug)]
pub struct RunningAgent {
    pub addr: SocketAddr,
    pub sink: SocketAddr,
    stop: tokio::sync::watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    halt: Arc<AtomicBool>,
}

impl RunningAgent {
    /// Stops serving; work under way is told to stop.
    pub async fn shutdown(self) {
        self.halt.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Checks the token's shape before anything listens.
pub fn check_token(token: &str) -> anyhow::Result<svc_kit::api_token::ApiToken> {
    svc_kit::api_token::ApiToken::new(token).map_err(|e| {
        anyhow::anyhow!(
            "the agent token must be at least {} printable characters with no spaces (set {} or --token-file): {e}",
            super::MIN_TOKEN_LEN,
            super::TOKEN_ENV
        )
    })
}

/// Starts the HTTP service and the sink.
pub async fn start(cfg: AgentConfig) -> anyhow::Result<RunningAgent> {
    use anyhow::Context;
    let token = check_token(&cfg.token)?;
    std::fs::create_dir_all(&cfg.scratch).with_context(|| format!("scratch dir {}", cfg.scratch.display()))?;
    let (sink, sink_task) =
        crate::netprobe::sink_on(cfg.sink).await.with_context(|| format!("sink on {}", cfg.sink))?;
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("listening on {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let halt = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Shared { cfg, sink_port: sink.port(), links: Links::default(), stop: halt.clone() });
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let app = svc_kit::api_token::protect(router(shared), Some(token), |m| {
        ApiError(StatusCode::UNAUTHORIZED, m).into_response()
    });
    let serve = tokio::spawn(async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.changed().await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(error = %e, "agent server stopped");
        }
    });
    Ok(RunningAgent { addr, sink, stop, tasks: vec![serve, sink_task], halt })
}

fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/v1/info", get(info))
        .route("/v1/job", post(job))
        .route("/v1/pattern", post(pattern))
        .route("/v1/objects", post(objects))
        .route("/v1/steady", post(steady))
        .route("/v1/probe", post(probe))
        .route("/v1/iperf3/server", post(iperf3_server))
        .route("/v1/iperf3/client", post(iperf3_client))
        .route("/v1/cleanup", post(cleanup))
        .with_state(shared)
}

/// A failed call.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

fn body<T>(b: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    b.map(|Json(t)| t).map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))
}

async fn info(State(s): S) -> Result<Json<AgentInfo>, ApiError> {
    let scratch = s.cfg.scratch.clone();
    let info = tokio::task::spawn_blocking(move || AgentInfo {
        name: String::new(),
        version: env!("CARGO_PKG_VERSION").into(),
        commit: super::commit().into(),
        host: hostinfo::host(),
        scratch: hostinfo::fs_of(&scratch),
        o_direct: hostinfo::o_direct_works(&scratch),
        iperf3: work::iperf3_version(),
        sink_port: 0,
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(AgentInfo { name: s.cfg.name.clone(), sink_port: s.sink_port, ..info }))
}

async fn job(State(s): S, b: Result<Json<JobRequest>, JsonRejection>) -> Result<Response, ApiError> {
    let r = body(b)?;
    Ok(Json(work::job(&s.links, &s.cfg.scratch, r, s.stop.clone()).await?).into_response())
}

async fn pattern(State(s): S, b: Result<Json<PatternRequest>, JsonRejection>) -> Result<Response, ApiError> {
    Ok(Json(work::pattern(&s.links, body(b)?).await?).into_response())
}

async fn objects(State(s): S, b: Result<Json<ObjectsRequest>, JsonRejection>) -> Result<Response, ApiError> {
    Ok(Json(work::objects(&s.links, body(b)?).await?).into_response())
}

async fn steady(State(s): S, b: Result<Json<SteadyRequest>, JsonRejection>) -> Result<Response, ApiError> {
    Ok(Json(work::steady(&s.links, body(b)?).await?).into_response())
}

async fn probe(State(s): S, b: Result<Json<ProbeRequest>, JsonRejection>) -> Result<Response, ApiError> {
    let r = body(b)?;
    Ok(Json(work::probe(&s.links, r.to, r.duration, r.link).await?).into_response())
}

async fn iperf3_server(b: Result<Json<Iperf3ServerRequest>, JsonRejection>) -> Result<Response, ApiError> {
    let port = work::iperf3_server(body(b)?.port).await?;
    Ok(Json(Iperf3ServerReply { port }).into_response())
}

async fn iperf3_client(State(s): S, b: Result<Json<Iperf3ClientRequest>, JsonRejection>) -> Result<Response, ApiError> {
    let r = body(b)?;
    Ok(Json(work::iperf3_client(&s.links, r.to, r.duration, r.link).await?).into_response())
}

async fn cleanup(State(s): S, b: Result<Json<CleanupRequest>, JsonRejection>) -> Result<Response, ApiError> {
    body(b)?;
    let dir = s.cfg.scratch.clone();
    let removed = tokio::task::spawn_blocking(move || {
        let mut n = 0u64;
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if e.file_type().is_ok_and(|t| t.is_file()) && std::fs::remove_file(e.path()).is_ok() {
                    n += 1;
                }
            }
        }
        n
    })
    .await
    .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok(Json(serde_json::json!({ "removed_files": removed })).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_before_the_agent_listens() {
        assert!(check_token("short").is_err());
        assert!(check_token("with a space in it here").is_err());
        assert!(check_token("0123456789abcdef").is_ok());
    }
}
