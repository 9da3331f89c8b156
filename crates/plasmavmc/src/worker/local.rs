//! The in-process worker: the attachments of the VMs placed on it, by VM
//! id, each an emulated guest ([`crate::guest`]). The control plane uses
//! one per worker name when no agents are configured, and every `plasmavmc
//! agent` serves one ([`crate::agent`]).

use super::Worker;
use crate::error::{PlasmaError, Result};
use crate::guest::Attachment;
use crate::wire::{Attach, FlushReq, Report, StartIo, Verified, VerifyReq};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// One worker's attachments by VM id.
#[derive(Debug)]
pub struct LocalWorker {
    pub name: String,
    /// CoronaFS NBD addresses the volumes' primaries are looked for at.
    pub nodes: Vec<String>,
    vms: tokio::sync::Mutex<HashMap<String, Arc<Attachment>>>,
    /// Guest writes CoronaFS refused as fenced.
    pub fenced_writes: Arc<AtomicU64>,
}

impl LocalWorker {
    pub fn new(name: &str, nodes: &[String], fenced_writes: Arc<AtomicU64>) -> Self {
        LocalWorker { name: name.to_owned(), nodes: nodes.to_vec(), vms: Default::default(), fenced_writes }
    }

    async fn get(&self, vm: &str) -> Result<Arc<Attachment>> {
        self.vms.lock().await.get(vm).cloned().ok_or_else(|| PlasmaError::not_found("attachment", vm))
    }

    /// The attachment of `vm` here, if any (tests reach the guest through it).
    pub async fn attachment(&self, vm: &str) -> Option<Arc<Attachment>> {
        self.vms.lock().await.get(vm).cloned()
    }

    pub async fn attach(&self, req: Attach) -> Result<Report> {
        let mut vms = self.vms.lock().await;
        if vms.contains_key(&req.vm_id) {
            return Err(PlasmaError::Conflict(format!("VM {} is already attached on {}", req.vm_id, self.name)));
        }
        let att = Attachment::connect(
            &self.nodes,
            &req.vm_id,
            &self.name,
            &req.volume,
            req.epoch,
            self.fenced_writes.clone(),
        )
        .await?;
        if req.io_ops > 0 {
            att.start_io(req.io_ops, req.seq_start).await?;
        }
        vms.insert(req.vm_id.clone(), att.clone());
        tracing::info!(vm = %req.vm_id, volume = %req.volume, epoch = req.epoch, worker = %self.name, "attached");
        Ok(att.report().await)
    }

    pub async fn report(&self, vm: &str) -> Result<Report> {
        Ok(self.get(vm).await?.report().await)
    }

    /// Every attachment's report.
    pub async fn list(&self) -> Vec<Report> {
        let atts: Vec<Arc<Attachment>> = self.vms.lock().await.values().cloned().collect();
        let mut out = Vec::with_capacity(atts.len());
        for a in atts {
            out.push(a.report().await);
        }
        out
    }

    pub async fn flush(&self, vm: &str, req: FlushReq) -> Result<Report> {
        self.get(vm).await?.flush_report(req.pause).await
    }

    pub async fn verify(&self, vm: &str, req: VerifyReq) -> Result<Verified> {
        self.get(vm).await?.verify(&req.log, req.adopt).await
    }

    pub async fn start_io(&self, vm: &str, req: StartIo) -> Result<()> {
        self.get(vm).await?.start_io(req.ops, req.seq_start).await
    }

    /// Stops the guest and drops the connection; a missing VM is detached.
    pub async fn detach(&self, vm: &str) -> Result<()> {
        let att = self.vms.lock().await.remove(vm);
        if let Some(att) = att {
            att.pause().await;
            tracing::info!(vm, worker = %self.name, "detached");
        }
        Ok(())
    }

    /// Detaches every VM (their guests stop; the connections close).
    pub async fn detach_all(&self) {
        let ids: Vec<String> = self.vms.lock().await.keys().cloned().collect();
        for id in ids {
            let _ = self.detach(&id).await;
        }
    }
}

impl Worker for LocalWorker {
    fn name(&self) -> &str {
        &self.name
    }
    fn attach(&self, req: Attach) -> BoxFuture<'_, Result<Report>> {
        Box::pin(LocalWorker::attach(self, req))
    }
    fn report<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<Report>> {
        Box::pin(LocalWorker::report(self, vm))
    }
    fn flush<'a>(&'a self, vm: &'a str, req: FlushReq) -> BoxFuture<'a, Result<Report>> {
        Box::pin(LocalWorker::flush(self, vm, req))
    }
    fn verify<'a>(&'a self, vm: &'a str, req: VerifyReq) -> BoxFuture<'a, Result<Verified>> {
        Box::pin(LocalWorker::verify(self, vm, req))
    }
    fn start_io<'a>(&'a self, vm: &'a str, req: StartIo) -> BoxFuture<'a, Result<()>> {
        Box::pin(LocalWorker::start_io(self, vm, req))
    }
    fn detach<'a>(&'a self, vm: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(LocalWorker::detach(self, vm))
    }
}
