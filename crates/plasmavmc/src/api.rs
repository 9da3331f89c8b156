//! The REST API (axum). Every failure answers `{"error": "..."}` with the
//! status [`PlasmaError::http_status`] gives; [`ROUTES`] lists every route and
//! is what the OpenAPI test walks.

use crate::app::App;
use crate::error::PlasmaError;
use crate::model::{CreateImage, CreateVm, CreateVolume, MigrateVm};
use crate::wire::ApiError;
use crate::{cache, images, meta, openapi, vms, volumes};
use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures::StreamExt;
use std::sync::Arc;

/// Every route: (method, path as in OpenAPI).
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/v1/images"),
    ("post", "/v1/images"),
    ("get", "/v1/images/{id}"),
    ("delete", "/v1/images/{id}"),
    ("put", "/v1/images/{id}/file"),
    ("get", "/v1/volumes"),
    ("post", "/v1/volumes"),
    ("get", "/v1/volumes/{id}"),
    ("delete", "/v1/volumes/{id}"),
    ("get", "/v1/vms"),
    ("post", "/v1/vms"),
    ("get", "/v1/vms/{id}"),
    ("delete", "/v1/vms/{id}"),
    ("post", "/v1/vms/{id}/migrate"),
    ("get", "/v1/cache"),
];

impl IntoResponse for PlasmaError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(ApiError { error: self.to_string() })).into_response()
    }
}

type Res<T> = Result<T, PlasmaError>;
type St = State<Arc<App>>;

fn body<T>(b: Result<Json<T>, JsonRejection>) -> Res<T> {
    b.map(|Json(x)| x).map_err(|e| PlasmaError::Invalid(format!("bad request body: {}", e.body_text())))
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(|| async { Json(openapi::document()) }))
        .route("/v1/images", get(list_images).post(create_image))
        .route("/v1/images/{id}", get(show_image).delete(delete_image))
        .route("/v1/images/{id}/file", put(upload_image))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route("/v1/volumes/{id}", get(show_volume).delete(delete_volume))
        .route("/v1/vms", get(list_vms).post(create_vm))
        .route("/v1/vms/{id}", get(show_vm).delete(delete_vm))
        .route("/v1/vms/{id}/migrate", post(migrate_vm))
        .route("/v1/cache", get(cache_stats))
        .fallback(|| async { PlasmaError::NotFound { kind: "route", id: "this path".into() } })
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

async fn metrics(State(app): St) -> impl IntoResponse {
    let images = app.meta.list::<crate::model::Image>(meta::IMAGES).map(|v| v.len() as u64).unwrap_or(0);
    let volumes = app.meta.list::<crate::model::Volume>(meta::VOLUMES).map(|v| v.len() as u64).unwrap_or(0);
    let bases = app.meta.list::<crate::model::CacheEntry>(meta::CACHE).unwrap_or_default();
    let bytes = bases.iter().map(|b| b.virtual_size).sum();
    let text = app.metrics.render(&[
        ("images", "image records", images),
        ("volumes", "volume records", volumes),
        ("cache_bases", "cached image bases", bases.len() as u64),
        ("cache_bytes", "virtual bytes of cached bases", bytes),
    ]);
    ([("content-type", "text/plain; version=0.0.4")], text)
}

async fn create_image(State(app): St, b: Result<Json<CreateImage>, JsonRejection>) -> Res<Response> {
    let img = images::create(&app, body(b)?).await?;
    let code = if img.status == crate::model::Status::Importing { StatusCode::ACCEPTED } else { StatusCode::CREATED };
    Ok((code, Json(img)).into_response())
}

async fn list_images(State(app): St) -> Res<impl IntoResponse> {
    Ok(Json(images::list(&app)?))
}

async fn show_image(State(app): St, Path(id): Path<String>) -> Res<impl IntoResponse> {
    Ok(Json(images::get(&app, &id)?))
}

async fn delete_image(State(app): St, Path(id): Path<String>) -> Res<StatusCode> {
    images::delete(&app, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn upload_image(State(app): St, Path(id): Path<String>, headers: HeaderMap, b: Body) -> Res<impl IntoResponse> {
    let len = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let stream = b.into_data_stream().map(|r| r.map_err(|e| e.to_string()));
    Ok(Json(images::upload(&app, &id, stream, len).await?))
}

async fn create_volume(State(app): St, b: Result<Json<CreateVolume>, JsonRejection>) -> Res<Response> {
    let v = volumes::create(&app, body(b)?).await?;
    Ok((StatusCode::ACCEPTED, Json(v)).into_response())
}

async fn list_volumes(State(app): St) -> Res<impl IntoResponse> {
    Ok(Json(volumes::list(&app)?))
}

async fn show_volume(State(app): St, Path(id): Path<String>) -> Res<impl IntoResponse> {
    Ok(Json(volumes::get(&app, &id)?))
}

async fn delete_volume(State(app): St, Path(id): Path<String>) -> Res<StatusCode> {
    volumes::delete(&app, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn create_vm(State(app): St, b: Result<Json<CreateVm>, JsonRejection>) -> Res<Response> {
    let vm = vms::create(&app, body(b)?).await?;
    Ok((StatusCode::CREATED, Json(vm)).into_response())
}

async fn list_vms(State(app): St) -> Res<impl IntoResponse> {
    Ok(Json(vms::list(&app).await?))
}

async fn show_vm(State(app): St, Path(id): Path<String>) -> Res<impl IntoResponse> {
    Ok(Json(vms::get(&app, &id).await?))
}

async fn delete_vm(State(app): St, Path(id): Path<String>) -> Res<StatusCode> {
    vms::delete(&app, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn migrate_vm(
    State(app): St,
    Path(id): Path<String>,
    b: Result<Json<MigrateVm>, JsonRejection>,
) -> Res<impl IntoResponse> {
    Ok(Json(vms::migrate(&app, &id, body(b)?).await?))
}

async fn cache_stats(State(app): St) -> Res<impl IntoResponse> {
    Ok(Json(cache::stats(&app)?))
}
