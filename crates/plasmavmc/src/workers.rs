//! The control plane's view of workers: an in-process [`Agent`] per worker
//! name (the default, when no `[[workers]]` are configured), or remote
//! `plasmavmc agent` processes reached over HTTP. Both answer the same calls.

use crate::agent::{Agent, Attach, FlushReq, StartIo, VerifyReq};
use crate::config::WorkerConfig;
use crate::error::{PlasmaError, Result};
use crate::guest::{Attachment, Report, Verified, WriteLog};
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Time allowed for one call to an agent (a verify reads up to 64 MiB).
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Time allowed to open a TCP connection to an agent.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// One worker, wherever it runs.
#[derive(Debug, Clone)]
pub enum Worker {
    Local(Arc<Agent>),
    Remote { name: String, url: String, http: reqwest::Client },
}

/// The workers of one control plane.
#[derive(Debug)]
pub struct Workers {
    nbd: String,
    remote: HashMap<String, String>,
    local: Mutex<HashMap<String, Arc<Agent>>>,
    http: reqwest::Client,
    fenced: Arc<AtomicU64>,
    /// The last report each VM's worker gave: what is known acknowledged
    /// if the worker is gone when it is needed.
    last: Mutex<HashMap<String, Report>>,
    /// Serializes VM operations (attach, migrate, delete): each is a short
    /// sequence of calls that must not interleave with another on the same VM.
    pub ops: tokio::sync::Mutex<()>,
}

impl Workers {
    pub fn new(nbd: &str, configured: &[WorkerConfig], fenced: Arc<AtomicU64>) -> Self {
        let http = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .unwrap_or_else(|_| reqwest::Client::new());
        Workers {
            nbd: nbd.to_owned(),
            remote: configured.iter().map(|w| (w.name.clone(), w.url.trim_end_matches('/').to_owned())).collect(),
            local: Mutex::default(),
            http,
            fenced,
            last: Mutex::default(),
            ops: tokio::sync::Mutex::new(()),
        }
    }

    /// The worker called `name`: a configured agent, or (none configured) an
    /// in-process one created on first use.
    pub fn get(&self, name: &str) -> Result<Worker> {
        crate::vms::check_worker(name)?;
        if self.remote.is_empty() {
            let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            let a = local
                .entry(name.to_owned())
                .or_insert_with(|| Arc::new(Agent::new(name, &self.nbd, self.fenced.clone())));
            return Ok(Worker::Local(a.clone()));
        }
        match self.remote.get(name) {
            Some(url) => Ok(Worker::Remote { name: name.to_owned(), url: url.clone(), http: self.http.clone() }),
            None => {
                let mut known: Vec<&String> = self.remote.keys().collect();
                known.sort();
                Err(PlasmaError::Invalid(format!("unknown worker {name:?}; configured workers: {known:?}")))
            }
        }
    }

    /// The in-process attachment of `vm` on worker `name` (tests).
    pub async fn attachment(&self, name: &str, vm: &str) -> Option<Arc<Attachment>> {
        let a = self.local.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned()?;
        a.attachment(vm).await
    }

    /// Remembers a VM's latest report.
    pub fn remember(&self, r: &Report) {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).insert(r.vm_id.clone(), r.clone());
    }

    /// The latest report remembered for `vm`.
    pub fn last(&self, vm: &str) -> Option<Report> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).get(vm).cloned()
    }

    pub fn forget(&self, vm: &str) {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).remove(vm);
    }
}

impl Worker {
    pub fn name(&self) -> &str {
        match self {
            Worker::Local(a) => &a.name,
            Worker::Remote { name, .. } => name,
        }
    }

    async fn call<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<Option<T>> {
        let err = |message: String| PlasmaError::Worker { worker: self.name().to_owned(), message };
        let resp = req.send().await.map_err(|e| err(format!("unreachable: {e}")))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let text = resp.text().await.map_err(|e| err(format!("reply cut short: {e}")))?;
        if !status.is_success() {
            let msg = serde_json::from_str::<crate::model::ApiError>(&text).map(|e| e.error).unwrap_or(text);
            if status.as_u16() == 409 {
                return Err(PlasmaError::Conflict(format!("worker {}: {msg}", self.name())));
            }
            return Err(err(format!("answered {status}: {msg}")));
        }
        serde_json::from_str(&text).map(Some).map_err(|e| err(format!("bad reply: {e}")))
    }

    fn url(&self, p: &str) -> String {
        match self {
            Worker::Remote { url, .. } => format!("{url}/v1/attachments{p}"),
            Worker::Local(_) => String::new(),
        }
    }

    fn need<T>(&self, v: Option<T>) -> Result<T> {
        v.ok_or_else(|| PlasmaError::Worker { worker: self.name().to_owned(), message: "empty reply".into() })
    }

    pub async fn attach(&self, req: Attach) -> Result<Report> {
        match self {
            Worker::Local(a) => a.attach(req).await,
            Worker::Remote { http, .. } => {
                let r = self.call(http.post(self.url("")).json(&req)).await?;
                self.need(r)
            }
        }
    }

    pub async fn report(&self, vm: &str) -> Result<Report> {
        match self {
            Worker::Local(a) => a.report(vm).await,
            Worker::Remote { http, .. } => {
                let r = self.call(http.get(self.url(&format!("/{vm}")))).await?;
                self.need(r)
            }
        }
    }

    pub async fn flush(&self, vm: &str, pause: bool) -> Result<Report> {
        let req = FlushReq { pause };
        match self {
            Worker::Local(a) => a.flush(vm, req).await,
            Worker::Remote { http, .. } => {
                let r = self.call(http.post(self.url(&format!("/{vm}/flush"))).json(&req)).await?;
                self.need(r)
            }
        }
    }

    pub async fn verify(&self, vm: &str, log: WriteLog, adopt: bool) -> Result<Verified> {
        let req = VerifyReq { log, adopt };
        match self {
            Worker::Local(a) => a.verify(vm, req).await,
            Worker::Remote { http, .. } => {
                let r = self.call(http.post(self.url(&format!("/{vm}/verify"))).json(&req)).await?;
                self.need(r)
            }
        }
    }

    pub async fn start_io(&self, vm: &str, ops: u64, seq_start: u64) -> Result<()> {
        let req = StartIo { ops, seq_start };
        match self {
            Worker::Local(a) => a.start_io(vm, req).await,
            Worker::Remote { http, .. } => {
                self.call::<serde_json::Value>(http.post(self.url(&format!("/{vm}/io"))).json(&req)).await.map(drop)
            }
        }
    }

    pub async fn detach(&self, vm: &str) -> Result<()> {
        match self {
            Worker::Local(a) => a.detach(vm).await,
            Worker::Remote { http, .. } => {
                self.call::<serde_json::Value>(http.delete(self.url(&format!("/{vm}")))).await.map(drop)
            }
        }
    }
}
