//! Emulated VMs: a volume attached on a [`Worker`] (in this process or a
//! `plasmavmc agent`), and migration between workers with CoronaFS epoch
//! fencing.
//!
//! Every attachment opens the volume as `VOL;epoch=N`. Attaching a VM and
//! migrating it each take a fresh epoch and raise the volume's fence in
//! CoronaFS (`POST /v1/volumes/{name}/fence`), which returns only once the
//! writes of older epochs in flight have finished. From then on CoronaFS
//! answers every write of an older attachment with EPERM, whatever worker
//! or process it runs in, so a stale source can never write again.
//!
//! Migration: (1) the target attaches with the new epoch (no guest I/O);
//! (2) the source pauses its guest, takes its write log and FLUSHes (if the
//! source is unreachable, the last report taken stands in for the log, and
//! the VM records a notice); (3) the fence is raised; (4) the source detaches;
//! (5) the target reads back every logged block and adopts the log; (6) the
//! guest resumes on the target. A failure after (3) leaves the VM in `error`
//! with the reason.
//!
//! Each VM has its own lock ([`App::vm_locks`], keyed by the VM's id; a
//! create holds its volume's id, so two creates cannot both take one
//! volume): the steps of one operation never interleave with another on the
//! same VM, and a slow worker call stalls only its own VM.
//!
//! [`Worker`]: crate::worker::Worker

use crate::app::App;
use crate::error::{PlasmaError, Result};
use crate::guest::MAX_IO_OPS;
use crate::meta;
use crate::metrics::Metrics;
use crate::model::{CreateVm, MigrateVm, Status, Vm, VmStatus, Volume, new_id};
use crate::wire::{Attach, FlushReq, Report, StartIo, VerifyReq, WriteLog};
use std::sync::Arc;

/// Guest writes a migrated VM runs on its target.
const OPS_AFTER_MIGRATION: u64 = 64;

async fn volume_for(app: &App, id: &str) -> Result<Volume> {
    let v: Volume = app.meta.get(meta::VOLUMES, id)?.ok_or_else(|| PlasmaError::not_found("volume", id))?;
    if v.status != Status::Available {
        return Err(PlasmaError::Conflict(format!("volume {id} is not available")));
    }
    Ok(v)
}

/// Raises the volume's fence in CoronaFS to `epoch`.
async fn fence(app: &App, vol: &Volume, epoch: u64) -> Result<()> {
    app.corona
        .fence(&vol.coronafs_volume, epoch)
        .await
        .map(drop)
        .map_err(|e| PlasmaError::Volume(format!("fencing {} at epoch {epoch}: {}", vol.coronafs_volume, e.message)))
}

/// The next epoch for a volume: above both CoronaFS's and the record's.
async fn next_epoch(app: &App, vol: &Volume, known: u64) -> Result<u64> {
    let info = app.corona.get(&vol.coronafs_volume).await?;
    Ok(info.epoch.max(known) + 1)
}

/// `POST /v1/vms`: fences the volume at a fresh epoch, attaches it on the
/// worker with that epoch and starts the guest.
pub async fn create(app: &Arc<App>, req: CreateVm) -> Result<Vm> {
    let worker = app.workers.get(&req.worker)?;
    let ops = req.io_ops.unwrap_or(64);
    if ops > MAX_IO_OPS {
        return Err(PlasmaError::Invalid(format!("io_ops must be at most {MAX_IO_OPS}")));
    }
    let vol = volume_for(app, &req.volume_id).await?;
    let _g = app.vm_locks.lock(&vol.id).await;
    if let Some(vm) = app.meta.list::<Vm>(meta::VMS)?.into_iter().find(|vm| vm.volume_id == vol.id) {
        return Err(PlasmaError::Conflict(format!("volume {} is already attached to VM {}", vol.id, vm.id)));
    }
    let id = new_id("vm");
    let epoch = next_epoch(app, &vol, 0).await?;
    fence(app, &vol, epoch).await?;
    let attach = Attach { vm_id: id.clone(), volume: vol.coronafs_volume.clone(), epoch, io_ops: ops, seq_start: 0 };
    let report = worker.attach(attach).await?;
    app.workers.remember(&report);
    let vm = Vm {
        id: id.clone(),
        volume_id: vol.id,
        worker: req.worker,
        epoch,
        status: VmStatus::Running,
        migrations: 0,
        writes_acked: 0,
        writes_acked_earlier: 0,
        verified_blocks: 0,
        error_reason: None,
        notice: None,
    };
    app.meta.put(meta::VMS, &id, &vm)?;
    Ok(vm)
}

fn get_record(app: &App, id: &str) -> Result<Vm> {
    app.meta.get(meta::VMS, id)?.ok_or_else(|| PlasmaError::not_found("vm", id))
}

/// With the live write count from the VM's worker (and the report
/// remembered); a worker that cannot be reached leaves the stored count.
pub async fn get(app: &App, id: &str) -> Result<Vm> {
    let mut vm = get_record(app, id)?;
    if vm.status == VmStatus::Running
        && let Ok(w) = app.workers.get(&vm.worker)
    {
        match w.report(id).await {
            Ok(r) => {
                vm.writes_acked = vm.writes_acked_earlier + r.writes_acked;
                app.workers.remember(&r);
            }
            Err(e) => tracing::debug!(vm = id, error = %e, "no report from the worker"),
        }
    }
    Ok(vm)
}

pub async fn list(app: &App) -> Result<Vec<Vm>> {
    let mut out = Vec::new();
    for vm in app.meta.list::<Vm>(meta::VMS)? {
        out.push(get(app, &vm.id).await?);
    }
    Ok(out)
}

fn set_error(app: &App, id: &str, reason: &str) {
    let r = app.meta.update(meta::VMS, "vm", id, |v: &mut Vm| {
        v.status = VmStatus::Error;
        v.error_reason = Some(reason.to_owned());
    });
    if let Err(e) = r {
        tracing::error!(vm = id, error = %e, "cannot record the VM's error");
    }
}

/// `POST /v1/vms/{id}/migrate`: see the module docs for the steps.
pub async fn migrate(app: &Arc<App>, id: &str, req: MigrateVm) -> Result<Vm> {
    let target = app.workers.get(&req.worker)?;
    let _g = app.vm_locks.lock(id).await;
    let vm = get_record(app, id)?;
    if vm.worker == req.worker {
        return Err(PlasmaError::Invalid(format!("VM {id} already runs on {}", req.worker)));
    }
    if vm.status != VmStatus::Running {
        return Err(PlasmaError::Conflict(format!("VM {id} is {}, not running", vm.status)));
    }
    let source = app.workers.get(&vm.worker)?;
    let vol = volume_for(app, &vm.volume_id).await?;
    let epoch = next_epoch(app, &vol, vm.epoch).await?;
    // 1. The target attaches; until the fence its epoch is ahead of the volume's.
    let attach = Attach { vm_id: id.to_owned(), volume: vol.coronafs_volume.clone(), epoch, io_ops: 0, seq_start: 0 };
    target.attach(attach).await?;
    app.meta.update(meta::VMS, "vm", id, |v: &mut Vm| v.status = VmStatus::Migrating)?;
    // 2. The source stops and flushes; what it reports is what must survive.
    let (report, notice) = match source.flush(id, FlushReq { pause: true }).await {
        Ok(r) => (r, None),
        Err(e) => {
            let last = app.workers.last(id).unwrap_or_else(|| empty_report(id, &vm, &vol));
            let notice = format!(
                "source worker {} could not be flushed ({e}); verified against its last report ({} blocks)",
                vm.worker,
                last.log.len()
            );
            tracing::warn!(vm = id, "{notice}");
            (last, Some(notice))
        }
    };
    // 3. Fence: from here on the source cannot write, wherever it runs.
    if let Err(e) = fence(app, &vol, epoch).await {
        let reason = format!("migration to {} failed at the fence: {e}", req.worker);
        set_error(app, id, &reason);
        let _ = target.detach(id).await;
        return Err(PlasmaError::Volume(reason));
    }
    // 4. The source lets go (it may be gone; the fence already stopped it).
    if let Err(e) = source.detach(id).await {
        tracing::warn!(vm = id, worker = %vm.worker, error = %e, "source did not detach");
    }
    // 5. Everything acknowledged must read back on the target.
    let verified = match target.verify(id, VerifyReq { log: report.log.clone(), adopt: true }).await {
        Ok(v) => v,
        Err(e) => {
            let reason = format!("after migrating to {}: {e}", req.worker);
            set_error(app, id, &reason);
            return Err(PlasmaError::Volume(reason));
        }
    };
    // 6. The guest resumes on the target.
    let seq = report.next_seq.max(verified.max_seq + 1);
    if let Err(e) = target.start_io(id, StartIo { ops: OPS_AFTER_MIGRATION, seq_start: seq }).await {
        let reason = format!("guest did not resume on {}: {e}", req.worker);
        set_error(app, id, &reason);
        return Err(e);
    }
    if let Ok(r) = target.report(id).await {
        app.workers.remember(&r);
    }
    Metrics::inc(&app.metrics.migrations);
    app.meta.update(meta::VMS, "vm", id, |v: &mut Vm| {
        v.worker = req.worker.clone();
        v.epoch = epoch;
        v.migrations += 1;
        v.verified_blocks = verified.verified;
        // The source's count ends here; the target's starts from zero.
        v.writes_acked_earlier += report.writes_acked;
        v.writes_acked = v.writes_acked_earlier;
        v.status = VmStatus::Running;
        v.error_reason = None;
        v.notice = notice.clone();
    })
}

fn empty_report(id: &str, vm: &Vm, vol: &Volume) -> Report {
    Report {
        vm_id: id.to_owned(),
        worker: vm.worker.clone(),
        volume: vol.coronafs_volume.clone(),
        epoch: vm.epoch,
        running: false,
        writes_acked: 0,
        next_seq: 0,
        log: WriteLog::new(),
        stopped_by: None,
        reconnects: 0,
    }
}

/// `DELETE /v1/vms/{id}`: detaches, and fences the volume past the VM's
/// epoch so that an attachment the worker failed to drop cannot write.
pub async fn delete(app: &App, id: &str) -> Result<()> {
    let _g = app.vm_locks.lock(id).await;
    let vm = get_record(app, id)?;
    if let Ok(w) = app.workers.get(&vm.worker)
        && let Err(e) = w.detach(id).await
    {
        tracing::warn!(vm = id, worker = %vm.worker, error = %e, "worker did not detach; fencing anyway");
    }
    if let Some(vol) = app.meta.get::<Volume>(meta::VOLUMES, &vm.volume_id)? {
        let epoch = next_epoch(app, &vol, vm.epoch).await?;
        fence(app, &vol, epoch).await?;
    }
    app.workers.forget(id);
    app.meta.delete(meta::VMS, id)?;
    Ok(())
}
