//! A typed client of the control API's server-level calls: what the bench
//! and the CLI use to read a server's conditions (`GET /v1/info`) and to
//! drop a volume from its page cache (`POST /v1/volumes/{name}/evict`).
//! Failures are [`CoronaError::Api`] with the HTTP status and the server's
//! `{"error"}` message.

use crate::api::{ApiError, ServerInfo};
use crate::error::{CoronaError, Result};
use crate::volume::EvictReport;
use serde::de::DeserializeOwned;

/// The control API of one server.
#[derive(Debug, Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: String,
}

impl ApiClient {
    /// A client of the API at `base` (`http://host:7070`).
    pub fn new(base: &str) -> Self {
        ApiClient { http: reqwest::Client::new(), base: base.trim_end_matches('/').to_owned() }
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET /v1/info`: version, engine in use, data dir and its file
    /// system, whether O_DIRECT is used, host.
    pub async fn info(&self) -> Result<ServerInfo> {
        self.call(self.http.get(format!("{}/v1/info", self.base))).await
    }

    /// `POST /v1/volumes/{name}/evict`: syncs the volume's files and drops
    /// them from the server's page cache; says how much was resident.
    pub async fn evict(&self, volume: &str) -> Result<EvictReport> {
        self.call(self.http.post(format!("{}/v1/volumes/{volume}/evict", self.base))).await
    }

    async fn call<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<T> {
        let err = |status: Option<u16>, message: String| CoronaError::Api { url: self.base.clone(), status, message };
        let resp = req.send().await.map_err(|e| err(None, format!("unreachable: {e}")))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| err(Some(status.as_u16()), e.to_string()))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<ApiError>(&body)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            return Err(err(Some(status.as_u16()), message));
        }
        serde_json::from_slice(&body).map_err(|e| err(Some(status.as_u16()), format!("unexpected answer: {e}")))
    }
}
