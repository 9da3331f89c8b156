//! The HTTP control API (JSON), `/metrics` and `/openapi.json`.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | liveness |
//! | GET | `/metrics` | Prometheus text |
//! | GET | `/openapi.json` | OpenAPI 3 description of this table |
//! | GET | `/v1/info` | version, engine in use, data dir and its file system, host |
//! | GET, POST | `/v1/volumes` | list; create `{name, size?, from_snapshot?}` |
//! | GET, DELETE | `/v1/volumes/{name}` | show; delete (`?force=true`) |
//! | POST | `/v1/volumes/{name}/resize` | `{size, allow_shrink?}` |
//! | POST | `/v1/volumes/{name}/flatten` | copy parent data in, detach |
//! | POST | `/v1/volumes/{name}/fence` | `{epoch}`: raise the write epoch, drain older writes |
//! | POST | `/v1/volumes/{name}/evict` | drop the volume's files from the page cache |
//! | GET, POST | `/v1/volumes/{name}/snapshots` | list; create `{name}` |
//! | DELETE | `/v1/volumes/{name}/snapshots/{snap}` | delete (`?force=true`) |
//!
//! Every error is `{"error": "..."}` with 400, 403, 404, 409, 500, 503 or 507.

use crate::backend::IoEngine;
use crate::error::CoronaError;
use crate::server::Shared;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// Volume name (see [`crate::util::validate_name`]).
    pub name: String,
    /// Size in bytes; required unless cloning (then it defaults to the snapshot's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// `VOL@SNAP` to clone from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

/// Body of `POST /v1/volumes/{name}/resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeVolume {
    /// New size in bytes.
    pub size: u64,
    /// Allow a size below the current one (the data past it is lost).
    #[serde(default)]
    pub allow_shrink: bool,
}

/// Body of `POST /v1/volumes/{name}/fence`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceVolume {
    /// The new write epoch (at least the current one).
    pub epoch: u64,
}

/// Body of `POST /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// Snapshot name (same rules as volume names).
    pub name: String,
}

/// Query of the DELETE calls.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Force {
    /// Delete even if in use or cloned.
    #[serde(default)]
    pub force: bool,
}

/// Answer of `GET /v1/info`: what a report needs to say about the server
/// its figures came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The server's version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The data path engine in use, after any fallback from `uring`.
    pub engine: IoEngine,
    /// The data dir, as given to the server.
    pub data_dir: String,
    /// The file system and device under the data dir.
    pub fs: hostinfo::FsInfo,
    /// Whether volume files are opened with `O_DIRECT`. They are not: both
    /// engines do buffered I/O through the page cache (see `note`).
    pub o_direct: bool,
    /// How volume data reaches the disk, in words.
    pub note: String,
    /// The machine the server runs on.
    pub host: hostinfo::Host,
}

/// [`ServerInfo::note`]: the data path as the code has it.
pub const BUFFERED_NOTE: &str = "buffered: volume files are opened without O_DIRECT, so reads and writes go \
     through the server's page cache; FLUSH and FUA make writes durable with fdatasync and RWF_DSYNC";

/// The JSON error body every failing call returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

impl IntoResponse for CoronaError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ApiError { error: self.to_string() })).into_response()
    }
}

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(crate::openapi::document()) }))
        .route("/v1/info", get(info))
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{name}", get(show).delete(remove))
        .route("/v1/volumes/{name}/resize", post(resize))
        .route("/v1/volumes/{name}/flatten", post(flatten))
        .route("/v1/volumes/{name}/fence", post(fence))
        .route("/v1/volumes/{name}/evict", post(evict))
        .route("/v1/volumes/{name}/snapshots", get(snapshots).post(snapshot))
        .route("/v1/volumes/{name}/snapshots/{snap}", delete(remove_snapshot))
        .with_state(shared)
}

type S = State<Arc<Shared>>;

/// A JSON body, or a 400 that says what is wrong with it.
fn body<T>(b: Result<Json<T>, JsonRejection>) -> Result<T, CoronaError> {
    b.map(|Json(t)| t).map_err(|e| CoronaError::BadRequest(format!("bad request body: {}", e.body_text())))
}

fn query(q: Result<Query<Force>, axum::extract::rejection::QueryRejection>) -> Result<bool, CoronaError> {
    q.map(|Query(f)| f.force).map_err(|e| CoronaError::BadRequest(format!("bad query: {}", e.body_text())))
}

async fn metrics(State(s): S) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render())
}

async fn info(State(s): S) -> Result<impl IntoResponse, CoronaError> {
    let dir = s.exports.dir().to_owned();
    let engine = s.exports.opener().engine();
    // Reads /proc and the mount table: small, but off the async threads.
    let (fs, host) = tokio::task::spawn_blocking(move || (hostinfo::fs_of(&dir), hostinfo::host()))
        .await
        .map_err(|e| CoronaError::Io(std::io::Error::other(e)))?;
    Ok(Json(ServerInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        engine,
        data_dir: s.exports.dir().display().to_string(),
        fs,
        o_direct: false,
        note: BUFFERED_NOTE.to_owned(),
        host,
    }))
}

async fn list(State(s): S) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.exports.list()?))
}

async fn show(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.exports.info(&name)?))
}

async fn create(State(s): S, b: Result<Json<CreateVolume>, JsonRejection>) -> Result<Response, CoronaError> {
    let req = body(b)?;
    let info = match (&req.from_snapshot, req.size) {
        (Some(from), size) => s.exports.clone_from(&req.name, from, size).await?,
        (None, Some(size)) => s.exports.create(&req.name, size).await?,
        (None, None) => return Err(CoronaError::BadRequest("size is required unless from_snapshot is given".into())),
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn remove(
    State(s): S,
    Path(name): Path<String>,
    q: Result<Query<Force>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, CoronaError> {
    s.exports.delete(&name, query(q)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resize(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<ResizeVolume>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    Ok(Json(s.exports.resize(&name, req.size, req.allow_shrink).await?))
}

async fn flatten(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.exports.flatten(&name).await?))
}

async fn fence(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<FenceVolume>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    Ok(Json(s.exports.fence(&name, req.epoch).await?))
}

async fn evict(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.exports.evict(&name).await?))
}

async fn snapshots(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.exports.snapshots(&name)?))
}

async fn snapshot(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<CreateSnapshot>, JsonRejection>,
) -> Result<Response, CoronaError> {
    let req = body(b)?;
    let info = s.exports.snapshot(&name, &req.name).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn remove_snapshot(
    State(s): S,
    Path((name, snap)): Path<(String, String)>,
    q: Result<Query<Force>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, CoronaError> {
    s.exports.delete_snapshot(&name, &snap, query(q)?).await?;
    Ok(StatusCode::NO_CONTENT)
}
