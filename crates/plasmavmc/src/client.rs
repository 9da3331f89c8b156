//! The typed client of PlasmaVMC's REST API ([`crate::api`]), on the API's
//! own request and response types ([`crate::model`]). The `plasmavmc` CLI,
//! the bench and the tests all use it.
//!
//! A failing call is [`PlasmaError::Api`] with the status and the server's
//! message, or [`PlasmaError::Client`] when no answer came.

use crate::error::{PlasmaError, Result};
use crate::model::{CacheStats, CreateImage, CreateVm, CreateVolume, Image, MigrateVm, Status, Vm, Volume};
use crate::wire::ApiError;
use serde::de::DeserializeOwned;
use std::path::Path;
use std::time::{Duration, Instant};

/// What [`Client::with_token`] takes.
pub type Token = Option<svc_kit::api_token::ApiToken>;

/// Time allowed to open a connection to the API.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A PlasmaVMC API at one base URL.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    http: reqwest::Client,
    token: Option<svc_kit::api_token::ApiToken>,
}

impl Client {
    /// A client of the API at `base` (`http://host:port`).
    pub fn new(base: &str) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        Self::with_http(base, http)
    }

    /// A client on a configured `reqwest` client (timeouts, pools).
    pub fn with_http(base: &str, http: reqwest::Client) -> Self {
        Client { base: base.trim_end_matches('/').to_owned(), http, token: None }
    }

    /// The same client sending `Authorization: Bearer TOKEN` on every call
    /// (none with `None`).
    pub fn with_token(mut self, token: Option<svc_kit::api_token::ApiToken>) -> Self {
        self.token = token;
        self
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Sends `req`; the answer's body if it succeeded, else its error.
    async fn send(&self, req: reqwest::RequestBuilder, what: &str) -> Result<bytes::Bytes> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t.expose()),
            None => req,
        };
        let resp =
            req.send().await.map_err(|e| PlasmaError::Client(format!("{what}: no answer from {}: {e}", self.base)))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| PlasmaError::Client(format!("{what}: answer cut short: {e}")))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<ApiError>(&body)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            return Err(PlasmaError::Api { status: status.as_u16(), message: format!("{what}: {message}") });
        }
        Ok(body)
    }

    async fn json<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder, what: &str) -> Result<T> {
        let body = self.send(req, what).await?;
        serde_json::from_slice(&body).map_err(|e| PlasmaError::Client(format!("{what}: unexpected answer: {e}")))
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.json(self.http.get(self.url(path)), &format!("GET {path}")).await
    }

    async fn delete(&self, path: &str) -> Result<()> {
        self.send(self.http.delete(self.url(path)), &format!("DELETE {path}")).await.map(drop)
    }

    /// `GET /healthz`.
    pub async fn healthz(&self) -> Result<()> {
        self.send(self.http.get(self.url("/healthz")), "GET /healthz").await.map(drop)
    }

    /// `GET /metrics`: Prometheus text.
    pub async fn metrics(&self) -> Result<String> {
        let body = self.send(self.http.get(self.url("/metrics")), "GET /metrics").await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// `GET /openapi.json`.
    pub async fn openapi(&self) -> Result<serde_json::Value> {
        self.get("/openapi.json").await
    }

    /// `POST /v1/images`: an image waiting for its upload (or importing).
    pub async fn create_image(&self, req: &CreateImage) -> Result<Image> {
        self.json(self.http.post(self.url("/v1/images")).json(req), "POST /v1/images").await
    }

    /// `PUT /v1/images/{id}/file` with `body` of `len` bytes; the image as
    /// the upload left it. `timeout` bounds the whole upload.
    pub async fn upload(&self, id: &str, body: reqwest::Body, len: u64, timeout: Option<Duration>) -> Result<Image> {
        let mut req = self
            .http
            .put(self.url(&format!("/v1/images/{id}/file")))
            .header(reqwest::header::CONTENT_LENGTH, len)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body);
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        self.json(req, &format!("PUT /v1/images/{id}/file")).await
    }

    /// [`Self::upload`] of a local file, streamed in 1 MiB chunks.
    pub async fn upload_file(&self, id: &str, path: &Path, timeout: Option<Duration>) -> Result<Image> {
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|e| PlasmaError::Client(format!("cannot open {}: {e}", path.display())))?;
        let len = file.metadata().await?.len();
        let stream = futures::stream::try_unfold(file, |mut f| async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; 1 << 20];
            let n = f.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            buf.truncate(n);
            Ok(Some((bytes::Bytes::from(buf), f)))
        });
        self.upload(id, reqwest::Body::wrap_stream(stream), len, timeout).await
    }

    /// `GET /v1/images/{id}`.
    pub async fn image(&self, id: &str) -> Result<Image> {
        self.get(&format!("/v1/images/{id}")).await
    }

    /// `GET /v1/images`.
    pub async fn images(&self) -> Result<Vec<Image>> {
        self.get("/v1/images").await
    }

    /// `DELETE /v1/images/{id}`.
    pub async fn delete_image(&self, id: &str) -> Result<()> {
        self.delete(&format!("/v1/images/{id}")).await
    }

    /// `POST /v1/volumes`: the volume as accepted (`creating`).
    pub async fn create_volume(&self, req: &CreateVolume) -> Result<Volume> {
        self.json(self.http.post(self.url("/v1/volumes")).json(req), "POST /v1/volumes").await
    }

    /// `GET /v1/volumes/{id}`.
    pub async fn volume(&self, id: &str) -> Result<Volume> {
        self.get(&format!("/v1/volumes/{id}")).await
    }

    /// `GET /v1/volumes`.
    pub async fn volumes(&self) -> Result<Vec<Volume>> {
        self.get("/v1/volumes").await
    }

    /// `DELETE /v1/volumes/{id}`.
    pub async fn delete_volume(&self, id: &str) -> Result<()> {
        self.delete(&format!("/v1/volumes/{id}")).await
    }

    /// Polls `GET /v1/volumes/{id}` every `every` until the volume is no
    /// longer being made (`available` or `error`: the caller checks which).
    pub async fn wait_volume(&self, id: &str, every: Duration, timeout: Duration) -> Result<Volume> {
        let t0 = Instant::now();
        loop {
            let v = self.volume(id).await?;
            if !matches!(v.status, Status::Creating | Status::Downloading) {
                return Ok(v);
            }
            if t0.elapsed() > timeout {
                return Err(PlasmaError::Client(format!(
                    "volume {id} still {:?} after {timeout:?} ({} of {} bytes)",
                    v.status, v.bytes_done, v.bytes_total
                )));
            }
            tokio::time::sleep(every).await;
        }
    }

    /// `POST /v1/vms`: a VM attached and running.
    pub async fn create_vm(&self, req: &CreateVm) -> Result<Vm> {
        self.json(self.http.post(self.url("/v1/vms")).json(req), "POST /v1/vms").await
    }

    /// `GET /v1/vms/{id}` (with the worker's live write count).
    pub async fn vm(&self, id: &str) -> Result<Vm> {
        self.get(&format!("/v1/vms/{id}")).await
    }

    /// `GET /v1/vms`.
    pub async fn vms(&self) -> Result<Vec<Vm>> {
        self.get("/v1/vms").await
    }

    /// `POST /v1/vms/{id}/migrate`: the VM on its new worker.
    pub async fn migrate_vm(&self, id: &str, req: &MigrateVm) -> Result<Vm> {
        let path = format!("/v1/vms/{id}/migrate");
        self.json(self.http.post(self.url(&path)).json(req), &format!("POST {path}")).await
    }

    /// `DELETE /v1/vms/{id}`.
    pub async fn delete_vm(&self, id: &str) -> Result<()> {
        self.delete(&format!("/v1/vms/{id}")).await
    }

    /// `GET /v1/cache`.
    pub async fn cache(&self) -> Result<CacheStats> {
        self.get("/v1/cache").await
    }
}
