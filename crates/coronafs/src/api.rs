//! The HTTP control API (JSON) and `/metrics`.
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | liveness |
//! | GET | `/metrics` | Prometheus text |
//! | GET | `/v1/volumes` | list volumes |
//! | POST | `/v1/volumes` | create `{name, size}` (size in bytes) |
//! | GET | `/v1/volumes/{name}` | show one |

use crate::error::CoronaError;
use crate::server::Shared;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// Volume name (see [`crate::util::validate_name`]).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
}

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
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{name}", get(show))
        .with_state(shared)
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    ([("content-type", "text/plain; version=0.0.4")], s.metrics.render())
}

async fn list(State(s): State<Arc<Shared>>) -> Result<impl IntoResponse, CoronaError> {
    let s2 = s.clone();
    Ok(Json(blocking(move || s2.exports.list()).await?))
}

async fn show(State(s): State<Arc<Shared>>, Path(name): Path<String>) -> Result<impl IntoResponse, CoronaError> {
    Ok(Json(blocking(move || s.exports.info(&name)).await?))
}

async fn create(
    State(s): State<Arc<Shared>>,
    body: Result<Json<CreateVolume>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, Json(ApiError { error: format!("bad request body: {}", e.body_text()) }))
                .into_response();
        }
    };
    match blocking(move || s.exports.create(&req.name, req.size)).await {
        Ok(info) => (StatusCode::CREATED, Json(info)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CoronaError> + Send + 'static,
) -> Result<T, CoronaError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| CoronaError::Io(std::io::Error::other(e.to_string())))?
}
