//! Workers: where VMs run. A [`Worker`] attaches a VM's volume, runs and
//! pauses its guest, flushes and verifies its writes; [`local::LocalWorker`]
//! does that in this process, [`remote::RemoteWorker`] asks a `plasmavmc
//! agent` over HTTP (which runs a `LocalWorker`). The VM operations in
//! [`crate::vms`] see only the trait.
//!
//! [`Workers`] is the control plane's registry: in-process workers created by
//! name on first use when no `[[workers]]` are configured, else the
//! configured agents.

pub mod local;
pub mod remote;

use crate::config::WorkerConfig;
use crate::error::{PlasmaError, Result};
use crate::guest::Attachment;
use crate::wire::{self, Attach, FlushReq, Report, StartIo, Verified, VerifyReq};
use futures::future::BoxFuture;
use local::LocalWorker;
use remote::RemoteWorker;
use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// One worker, wherever it runs. The calls are those of the agent's API
/// ([`crate::wire`]); each acts on one VM's attachment.
///
/// (Boxed futures rather than `async fn` so that the control plane can hold
/// `Arc<dyn Worker>` whichever kind it was configured with.)
pub trait Worker: Send + Sync + std::fmt::Debug {
    /// The worker's name, as `POST /v1/vms {worker}` gives it.
    fn name(&self) -> &str;
    /// Connects `VOL;epoch=N` and starts `io_ops` guest writes; a VM already
    /// attached here is a conflict.
    fn attach(&self, req: Attach) -> BoxFuture<'_, Result<Report>>;
    /// The attachment's state and write log.
    fn report<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<Report>>;
    /// (Pauses the guest,) takes the log and FLUSHes: the report covers only
    /// flushed writes.
    fn flush<'a>(&'a self, vm: &'a str, req: FlushReq) -> BoxFuture<'a, Result<Report>>;
    /// Reads the logged blocks back (and with `adopt` makes what was found
    /// the guest's log).
    fn verify<'a>(&'a self, vm: &'a str, req: VerifyReq) -> BoxFuture<'a, Result<Verified>>;
    /// Runs more guest writes.
    fn start_io<'a>(&'a self, vm: &'a str, req: StartIo) -> BoxFuture<'a, Result<()>>;
    /// Stops the guest and disconnects; a VM not attached here is detached.
    fn detach<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<()>>;
}

/// The workers of one control plane.
#[derive(Debug)]
pub struct Workers {
    nodes: Vec<String>,
    remote: HashMap<String, Arc<RemoteWorker>>,
    local: Mutex<HashMap<String, Arc<LocalWorker>>>,
    fenced: Arc<AtomicU64>,
    /// The last report each VM's worker gave: what is known acknowledged
    /// if the worker is gone when it is needed.
    last: Mutex<HashMap<String, Report>>,
}

impl Workers {
    /// In-process workers on CoronaFS `nbd` if `configured` is empty, else
    /// the configured agents, called with `token`.
    pub fn new(
        nodes: Vec<String>,
        configured: &[WorkerConfig],
        token: Option<svc_kit::api_token::ApiToken>,
        fenced: Arc<AtomicU64>,
    ) -> Self {
        let http = remote::http_client();
        Workers {
            nodes,
            remote: configured
                .iter()
                .map(|w| {
                    let worker = RemoteWorker::new(&w.name, &w.url, http.clone()).with_token(token.clone());
                    (w.name.clone(), Arc::new(worker))
                })
                .collect(),
            local: Mutex::default(),
            fenced,
            last: Mutex::default(),
        }
    }

    /// The worker called `name`: a configured agent, or (none configured) an
    /// in-process one created on first use.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Worker>> {
        wire::check_worker(name)?;
        if self.remote.is_empty() {
            let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
            let w = local
                .entry(name.to_owned())
                .or_insert_with(|| Arc::new(LocalWorker::new(name, &self.nodes, self.fenced.clone())));
            return Ok(w.clone());
        }
        match self.remote.get(name) {
            Some(w) => Ok(w.clone()),
            None => {
                let mut known: Vec<&String> = self.remote.keys().collect();
                known.sort();
                Err(PlasmaError::Invalid(format!("unknown worker {name:?}; configured workers: {known:?}")))
            }
        }
    }

    /// The in-process attachment of `vm` on worker `name` (tests).
    pub async fn attachment(&self, name: &str, vm: &str) -> Option<Arc<Attachment>> {
        let w = self.local.lock().unwrap_or_else(|e| e.into_inner()).get(name).cloned()?;
        w.attachment(vm).await
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
