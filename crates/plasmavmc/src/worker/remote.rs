//! A `plasmavmc agent` reached over HTTP: the client of the agent's API
//! ([`crate::wire`]), built on the same DTOs the agent serves.

use super::Worker;
use crate::error::{PlasmaError, Result};
use crate::wire::{ApiError, Attach, FlushReq, Report, StartIo, Verified, VerifyReq};
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Time allowed for one call to an agent (a verify reads up to 64 MiB).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Time allowed to open a TCP connection to an agent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The HTTP client every remote worker of a control plane shares.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(CALL_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .unwrap_or_else(|_| reqwest::Client::new())
}

/// One agent.
#[derive(Debug, Clone)]
pub struct RemoteWorker {
    name: String,
    /// `http://host:port`, no trailing slash.
    url: String,
    http: reqwest::Client,
    token: Option<svc_kit::api_token::ApiToken>,
}

impl RemoteWorker {
    pub fn new(name: &str, url: &str, http: reqwest::Client) -> Self {
        RemoteWorker { name: name.to_owned(), url: url.trim_end_matches('/').to_owned(), http, token: None }
    }

    /// The same worker, sending `Authorization: Bearer TOKEN` (the agent's
    /// `--api-token-file`) on every call.
    pub fn with_token(mut self, token: Option<svc_kit::api_token::ApiToken>) -> Self {
        self.token = token;
        self
    }

    fn err(&self, message: String) -> PlasmaError {
        PlasmaError::Worker { worker: self.name.clone(), message }
    }

    fn url(&self, vm: Option<&str>, op: &str) -> String {
        match vm {
            Some(vm) => format!("{}/v1/attachments/{vm}{op}", self.url),
            None => format!("{}/v1/attachments", self.url),
        }
    }

    /// Sends `req`; 204 is `None`, another success the decoded body. The
    /// agent's 409 stays a conflict; every other failure is the worker's.
    async fn call<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<Option<T>> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t.expose()),
            None => req,
        };
        let resp = req.send().await.map_err(|e| self.err(format!("unreachable: {e}")))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let text = resp.text().await.map_err(|e| self.err(format!("reply cut short: {e}")))?;
        if !status.is_success() {
            let msg = serde_json::from_str::<ApiError>(&text).map(|e| e.error).unwrap_or(text);
            if status == reqwest::StatusCode::CONFLICT {
                return Err(PlasmaError::Conflict(format!("worker {}: {msg}", self.name)));
            }
            return Err(self.err(format!("answered {status}: {msg}")));
        }
        serde_json::from_str(&text).map(Some).map_err(|e| self.err(format!("bad reply: {e}")))
    }

    /// A call whose answer has a body.
    async fn fetch<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<T> {
        self.call(req).await?.ok_or_else(|| self.err("empty reply".into()))
    }

    /// A call answered 204.
    async fn run(&self, req: reqwest::RequestBuilder) -> Result<()> {
        self.call::<serde::de::IgnoredAny>(req).await.map(drop)
    }
}

impl Worker for RemoteWorker {
    fn name(&self) -> &str {
        &self.name
    }
    fn attach(&self, req: Attach) -> BoxFuture<'_, Result<Report>> {
        Box::pin(async move { self.fetch(self.http.post(self.url(None, "")).json(&req)).await })
    }
    fn report<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<Report>> {
        Box::pin(self.fetch(self.http.get(self.url(Some(vm), ""))))
    }
    fn flush<'a>(&'a self, vm: &'a str, req: FlushReq) -> BoxFuture<'a, Result<Report>> {
        Box::pin(async move { self.fetch(self.http.post(self.url(Some(vm), "/flush")).json(&req)).await })
    }
    fn verify<'a>(&'a self, vm: &'a str, req: VerifyReq) -> BoxFuture<'a, Result<Verified>> {
        Box::pin(async move { self.fetch(self.http.post(self.url(Some(vm), "/verify")).json(&req)).await })
    }
    fn start_io<'a>(&'a self, vm: &'a str, req: StartIo) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.run(self.http.post(self.url(Some(vm), "/io")).json(&req)).await })
    }
    fn detach<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.run(self.http.delete(self.url(Some(vm), ""))))
    }
}
