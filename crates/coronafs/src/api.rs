//! The HTTP control API (JSON), `/metrics` and `/openapi.json`.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | liveness |
//! | GET | `/metrics` | Prometheus text |
//! | GET | `/openapi.json` | OpenAPI 3 description of this table |
//! | GET | `/v1/info` | version, engine in use, data dir and its file system, host |
//! | GET | `/v1/cluster/map` | the volume map as this node has it: Raft leader, term, every replicated volume's copies, primary, epoch, in-sync set |
//! | POST | `/v1/cluster/nodes` | `{name, replica}`: make a running node a voter of the map's Raft group |
//! | DELETE | `/v1/cluster/nodes/{name}` | take a node out of the map's Raft group (refused for a primary, a copy its volume needs, the last voter) |
//! | GET, POST | `/v1/volumes` | list; create `{name, size?, from_snapshot?, replicas?}` |
//! | GET, DELETE | `/v1/volumes/{name}` | show; delete (`?force=true`) |
//! | POST | `/v1/volumes/{name}/resize` | `{size, allow_shrink?}` |
//! | POST | `/v1/volumes/{name}/flatten` | copy parent data in, detach |
//! | POST | `/v1/volumes/{name}/fence` | `{epoch}`: raise the write epoch, drain older writes |
//! | POST | `/v1/volumes/{name}/promote` | make this node's copy the primary (a takeover the volume map grants) |
//! | POST | `/v1/volumes/{name}/replace-copy` | on the primary, `{copy, to?}`: replace a copy by a new one on another node |
//! | POST | `/v1/volumes/{name}/evict` | drop the volume's files from the page cache |
//! | GET, POST | `/v1/volumes/{name}/snapshots` | list; create `{name}` |
//! | DELETE | `/v1/volumes/{name}/snapshots/{snap}` | delete (`?force=true`) |
//!
//! Every error is `{"error": "..."}` with 400, 401, 403, 404, 409, 500, 503 or 507.
//! With an API token set (`coronafs serve --api-token-file`), every route
//! but `GET /healthz` and `GET /metrics` needs `Authorization: Bearer TOKEN`
//! and answers 401 without it ([`svc_kit::api_token::protect`], applied by
//! [`crate::service::start`] with [`unauthorized`]).
//! The bodies are [`crate::dto`]'s; [`crate::api_client`] is the client.

use crate::dto::{
    ApiError, BUFFERED_NOTE, CreateSnapshot, CreateVolume, FenceVolume, Force, ReplaceCopy, ResizeVolume, ServerInfo,
};
use crate::error::CoronaError;
use crate::metrics::Metrics;
use crate::volume::Volumes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use std::sync::Arc;

impl IntoResponse for CoronaError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ApiError { error: self.to_string() })).into_response()
    }
}

/// The 401 body of a request without the API token: the usual `{"error"}`.
pub fn unauthorized(message: String) -> Response {
    (StatusCode::UNAUTHORIZED, Json(ApiError { error: message })).into_response()
}

/// What the handlers work on: the volumes and the counters to render.
#[derive(Debug)]
pub struct ApiState {
    pub volumes: Arc<Volumes>,
    pub metrics: Arc<Metrics>,
}

/// The API's routes over `volumes`, rendering `counters` at `/metrics`.
pub fn router(volumes: Arc<Volumes>, counters: Arc<Metrics>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(crate::openapi::document()) }))
        .route("/v1/info", get(info))
        .route("/v1/cluster/map", get(cluster_map))
        .route("/v1/cluster/nodes", post(add_node))
        .route("/v1/cluster/nodes/{name}", delete(remove_node))
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{name}", get(show).delete(remove))
        .route("/v1/volumes/{name}/resize", post(resize))
        .route("/v1/volumes/{name}/flatten", post(flatten))
        .route("/v1/volumes/{name}/fence", post(fence))
        .route("/v1/volumes/{name}/promote", post(promote))
        .route("/v1/volumes/{name}/replace-copy", post(replace_copy))
        .route("/v1/volumes/{name}/evict", post(evict))
        .route("/v1/volumes/{name}/snapshots", get(snapshots).post(snapshot))
        .route("/v1/volumes/{name}/snapshots/{snap}", delete(remove_snapshot))
        .with_state(Arc::new(ApiState { volumes, metrics: counters }))
}

type S = State<Arc<ApiState>>;

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
    let dir = s.volumes.dir().to_owned();
    let engine = s.volumes.opener().engine();
    // Reads /proc and the mount table: small, but off the async threads.
    let (fs, host) = tokio::task::spawn_blocking(move || (hostinfo::fs_of(&dir), hostinfo::host()))
        .await
        .map_err(|e| CoronaError::Io(std::io::Error::other(e)))?;
    Ok(Json(ServerInfo {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        engine,
        data_dir: s.volumes.dir().display().to_string(),
        fs,
        o_direct: false,
        note: BUFFERED_NOTE.to_owned(),
        host,
    }))
}

async fn cluster_map(State(s): S) -> Result<impl IntoResponse, CoronaError> {
    let map = s.volumes.volume_map().ok_or_else(|| {
        CoronaError::NotFound("no volume map: this server is in no cluster (serve with a cluster file)".into())
    })?;
    Ok(Json(crate::dto::ClusterMap { status: map.status(), volumes: map.map().volumes.clone() }))
}

fn the_map(s: &ApiState) -> Result<Arc<crate::replication::map::MapNode>, CoronaError> {
    s.volumes.volume_map().cloned().ok_or_else(|| {
        CoronaError::NotFound("no volume map: this server is in no cluster (serve with a cluster file)".into())
    })
}

/// A membership change through the map's leader; the map after it.
async fn change_members(
    s: &ApiState,
    change: crate::replication::map::members::MemberChange,
) -> Result<crate::dto::ClusterMap, CoronaError> {
    use crate::replication::map::net::ProposeError;
    let map = the_map(s)?;
    let deadline = map.election_patience() * 3;
    match map.change_members(change, deadline).await {
        // The voters as the leader has them after the change (the node
        // asked may apply it a heartbeat later).
        Ok(voters) => {
            let status = crate::replication::map::MapStatus { voters, ..map.status() };
            Ok(crate::dto::ClusterMap { status, volumes: map.map().volumes.clone() })
        }
        Err(ProposeError::Refused(why)) => Err(CoronaError::Conflict(why)),
        Err(e) => Err(CoronaError::Map(format!("the membership change did not happen: {e}"))),
    }
}

async fn add_node(
    State(s): S,
    b: Result<Json<crate::dto::AddNode>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    crate::util::validate_name(&req.name)?;
    let replica: std::net::SocketAddr = req.replica.parse().map_err(|_| {
        CoronaError::BadRequest(format!("replica {:?} is not an address and port (host:port)", req.replica))
    })?;
    let peer = crate::replication::map::Peer { name: req.name, addr: replica.to_string() };
    Ok(Json(change_members(&s, crate::replication::map::members::MemberChange::Add(peer)).await?))
}

async fn remove_node(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(change_members(&s, crate::replication::map::members::MemberChange::Remove(name)).await?))
}

async fn list(State(s): S) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.list()?))
}

async fn show(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.show(&name).await?))
}

async fn create(State(s): S, b: Result<Json<CreateVolume>, JsonRejection>) -> Result<Response, CoronaError> {
    let req = body(b)?;
    let info = match (&req.from_snapshot, req.size) {
        (Some(from), size) => s.volumes.clone_replicated(&req.name, from, size, req.replicas.unwrap_or(1)).await?,
        (None, Some(size)) => s.volumes.create_replicated(&req.name, size, req.replicas.unwrap_or(1)).await?,
        (None, None) => return Err(CoronaError::BadRequest("size is required unless from_snapshot is given".into())),
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn remove(
    State(s): S,
    Path(name): Path<String>,
    q: Result<Query<Force>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, CoronaError> {
    s.volumes.delete(&name, query(q)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn resize(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<ResizeVolume>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    Ok(Json(s.volumes.resize(&name, req.size, req.allow_shrink).await?))
}

async fn flatten(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.flatten(&name).await?))
}

async fn fence(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<FenceVolume>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    Ok(Json(s.volumes.fence(&name, req.epoch).await?))
}

async fn promote(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.promote(&name).await?))
}

async fn replace_copy(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<ReplaceCopy>, JsonRejection>,
) -> Result<impl IntoResponse, CoronaError> {
    let req = body(b)?;
    Ok(Json(s.volumes.replace_copy(&name, &req.copy, req.to.as_deref()).await?))
}

async fn evict(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.evict(&name).await?))
}

async fn snapshots(State(s): S, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(s.volumes.snapshots(&name)?))
}

async fn snapshot(
    State(s): S,
    Path(name): Path<String>,
    b: Result<Json<CreateSnapshot>, JsonRejection>,
) -> Result<Response, CoronaError> {
    let req = body(b)?;
    let info = s.volumes.snapshot(&name, &req.name).await?;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn remove_snapshot(
    State(s): S,
    Path((name, snap)): Path<(String, String)>,
    q: Result<Query<Force>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, CoronaError> {
    s.volumes.delete_snapshot(&name, &snap, query(q)?).await?;
    Ok(StatusCode::NO_CONTENT)
}
