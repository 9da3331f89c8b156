//! Emulated VMs: a volume attached on a named worker through an NBD
//! connection that runs a guest-like write pattern, and migration between
//! workers with epoch fencing.
//!
//! Fencing: every VM has a [`Fence`] holding its current epoch. An
//! [`Attachment`] holds the epoch it was granted and takes the fence's read
//! lock for the whole of each write, until the volume acknowledges it. A
//! migration takes the write lock (so it waits for the source's in-flight
//! writes), bumps the epoch, and from then on every write of the old
//! attachment fails with [`PlasmaError::Fenced`] before reaching the volume.
//! Workers live in this process for now; the fence check sits in the worker's
//! data path, which is where a separate agent process will keep it.

use crate::app::App;
use crate::error::{PlasmaError, Result};
use crate::meta;
use crate::metrics::Metrics;
use crate::model::{CreateVm, MigrateVm, Status, Vm, Volume, new_id};
use coronafs::client::NbdClient;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Size of one guest write.
pub const BLOCK: u64 = 64 * 1024;
/// The guest writes within the first this many bytes of the volume.
const WORKING_SET: u64 = 64 << 20;
/// Most guest writes one attach or migration may issue.
pub const MAX_IO_OPS: u64 = 100_000;

/// The epoch only the current attachment may write with.
#[derive(Debug)]
pub struct Fence {
    epoch: tokio::sync::RwLock<u64>,
}

/// A volume attached on a worker, holding one epoch.
#[derive(Debug)]
pub struct Attachment {
    pub vm_id: String,
    pub worker: String,
    pub epoch: u64,
    nbd: Arc<NbdClient>,
    fence: Arc<Fence>,
    app_fenced: Arc<AtomicU64>,
}

impl Attachment {
    /// Writes through the fence: refused once a newer epoch exists.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let g = self.fence.epoch.read().await;
        if *g != self.epoch {
            self.app_fenced.fetch_add(1, Ordering::Relaxed);
            return Err(PlasmaError::Fenced { vm: self.vm_id.clone(), held: self.epoch, current: *g });
        }
        self.nbd.write(offset, data, false).await?;
        drop(g);
        Ok(())
    }

    pub async fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.nbd.read(offset, len).await?)
    }

    pub async fn flush(&self) -> Result<()> {
        Ok(self.nbd.flush().await?)
    }
}

/// The guest's content for `block` at write number `seq`: deterministic, so
/// anyone can check what a block must hold. Pure.
pub fn pattern(vm_id: &str, block: u64, seq: u64) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ block.rotate_left(29) ^ 0x5851_f42d_4c95_7f2d;
    for b in vm_id.bytes() {
        x = (x ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut out = Vec::with_capacity(BLOCK as usize);
    while out.len() < BLOCK as usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// What the guest has written and had acknowledged: block -> last seq.
pub type WriteLog = BTreeMap<u64, u64>;

#[derive(Debug)]
struct Runtime {
    fence: Arc<Fence>,
    current: Arc<Attachment>,
    log: Arc<Mutex<WriteLog>>,
    seq: Arc<AtomicU64>,
    acked: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    io: Option<tokio::task::JoinHandle<()>>,
}

/// The in-process workers' attachments, by VM id.
#[derive(Debug, Default)]
pub struct Workers {
    vms: tokio::sync::Mutex<HashMap<String, Runtime>>,
}

impl Workers {
    /// The VM's current attachment.
    pub async fn attachment(&self, vm_id: &str) -> Option<Arc<Attachment>> {
        self.vms.lock().await.get(vm_id).map(|r| r.current.clone())
    }

    /// A copy of the VM's write log.
    pub async fn log(&self, vm_id: &str) -> Option<WriteLog> {
        let g = self.vms.lock().await;
        g.get(vm_id).map(|r| r.log.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Waits until the VM's guest I/O has run its course.
    pub async fn wait_idle(&self, vm_id: &str) {
        let io = self.vms.lock().await.get_mut(vm_id).and_then(|r| r.io.take());
        if let Some(io) = io {
            let _ = io.await;
        }
    }
}

fn check_worker(w: &str) -> Result<()> {
    let ok = !w.is_empty() && w.len() <= 64 && w.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok { Ok(()) } else { Err(PlasmaError::Invalid(format!("worker {w:?} must match [A-Za-z0-9._-]{{1,64}}"))) }
}

/// The guest: `ops` writes of [`BLOCK`] bytes at pseudo-random blocks of the
/// working set, a flush every 16, until done, stopped or fenced.
fn spawn_guest(
    att: Arc<Attachment>,
    rt_log: Arc<Mutex<WriteLog>>,
    seq: Arc<AtomicU64>,
    acked: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    ops: u64,
    size: u64,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let blocks = (size.min(WORKING_SET) / BLOCK).max(1);
        for n in 0..ops {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let s = seq.fetch_add(1, Ordering::Relaxed);
            let block = (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 17) % blocks;
            let data = pattern(&att.vm_id, block, s);
            match att.write(block * BLOCK, &data).await {
                Ok(()) => {
                    rt_log.lock().unwrap_or_else(|e| e.into_inner()).insert(block, s);
                    acked.fetch_add(1, Ordering::Relaxed);
                }
                Err(PlasmaError::Fenced { .. }) => return,
                Err(e) => {
                    tracing::warn!(vm = %att.vm_id, error = %e, "guest write failed");
                    return;
                }
            }
            if n % 16 == 15 && att.flush().await.is_err() {
                return;
            }
        }
    })
}

async fn volume_for(app: &App, id: &str) -> Result<Volume> {
    let v: Volume = app.meta.get(meta::VOLUMES, id)?.ok_or_else(|| PlasmaError::not_found("volume", id))?;
    if v.status != Status::Available {
        return Err(PlasmaError::Conflict(format!("volume {id} is not available")));
    }
    Ok(v)
}

/// `POST /v1/vms`: attaches the volume on the worker and starts the guest.
pub async fn create(app: &Arc<App>, req: CreateVm) -> Result<Vm> {
    check_worker(&req.worker)?;
    let ops = req.io_ops.unwrap_or(64);
    if ops > MAX_IO_OPS {
        return Err(PlasmaError::Invalid(format!("io_ops must be at most {MAX_IO_OPS}")));
    }
    let vol = volume_for(app, &req.volume_id).await?;
    let mut vms = app.workers.vms.lock().await;
    if let Some(vm) = app.meta.list::<Vm>(meta::VMS)?.into_iter().find(|vm| vm.volume_id == vol.id) {
        return Err(PlasmaError::Conflict(format!("volume {} is already attached to VM {}", vol.id, vm.id)));
    }
    let nbd = Arc::new(app.corona.connect(&vol.coronafs_volume).await?);
    let id = new_id("vm");
    let fence = Arc::new(Fence { epoch: tokio::sync::RwLock::new(1) });
    let att = Arc::new(Attachment {
        vm_id: id.clone(),
        worker: req.worker.clone(),
        epoch: 1,
        nbd,
        fence: fence.clone(),
        app_fenced: app.metrics.fenced_writes.clone(),
    });
    let (log, seq, acked, stop) = Default::default();
    let io = spawn_guest(
        att.clone(),
        Arc::clone(&log),
        Arc::clone(&seq),
        Arc::clone(&acked),
        Arc::clone(&stop),
        ops,
        vol.size,
    );
    let vm = Vm {
        id: id.clone(),
        volume_id: vol.id,
        worker: req.worker,
        epoch: 1,
        status: "running".into(),
        migrations: 0,
        writes_acked: 0,
        verified_blocks: 0,
        error_reason: None,
    };
    app.meta.put(meta::VMS, &id, &vm)?;
    vms.insert(id, Runtime { fence, current: att, log, seq, acked, stop, io: Some(io) });
    Ok(vm)
}

/// With the live write count.
pub async fn get(app: &App, id: &str) -> Result<Vm> {
    let mut vm: Vm = app.meta.get(meta::VMS, id)?.ok_or_else(|| PlasmaError::not_found("vm", id))?;
    if let Some(rt) = app.workers.vms.lock().await.get(id) {
        vm.writes_acked = rt.acked.load(Ordering::Relaxed);
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

/// `POST /v1/vms/{id}/migrate`: target attaches, source is fenced, every
/// acknowledged write is read back on the target, the guest resumes there.
pub async fn migrate(app: &Arc<App>, id: &str, req: MigrateVm) -> Result<Vm> {
    check_worker(&req.worker)?;
    let mut vms = app.workers.vms.lock().await;
    let vm = get_locked(app, id)?;
    let rt = vms.get_mut(id).ok_or_else(|| PlasmaError::Conflict(format!("VM {id} has no live attachment")))?;
    if vm.worker == req.worker {
        return Err(PlasmaError::Invalid(format!("VM {id} already runs on {}", req.worker)));
    }
    let vol = volume_for(app, &vm.volume_id).await?;
    // 1. The target attaches (its epoch is not valid yet).
    let nbd = Arc::new(app.corona.connect(&vol.coronafs_volume).await?);
    let new_epoch = vm.epoch + 1;
    let target = Arc::new(Attachment {
        vm_id: id.to_owned(),
        worker: req.worker.clone(),
        epoch: new_epoch,
        nbd,
        fence: rt.fence.clone(),
        app_fenced: rt.current.app_fenced.clone(),
    });
    // 2. Fence: waits for the source's in-flight writes, then stales it.
    *rt.fence.epoch.write().await = new_epoch;
    if let Some(io) = rt.io.take() {
        let _ = io.await;
    }
    let source = std::mem::replace(&mut rt.current, target.clone());
    // 3. Everything the guest had acknowledged must read back on the target.
    let log = rt.log.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut verified = 0u64;
    for (block, seq) in &log {
        let got = target.read(block * BLOCK, BLOCK as usize).await?;
        if got != pattern(id, *block, *seq) {
            let reason = format!("block {block} (write {seq}) did not read back on {}", req.worker);
            app.meta.update(meta::VMS, "vm", id, |v: &mut Vm| {
                v.status = "error".into();
                v.error_reason = Some(reason.clone());
            })?;
            return Err(PlasmaError::Volume(reason));
        }
        verified += 1;
    }
    drop(source);
    // 4. The guest resumes on the target.
    rt.stop.store(false, Ordering::Relaxed);
    rt.io = Some(spawn_guest(target, rt.log.clone(), rt.seq.clone(), rt.acked.clone(), rt.stop.clone(), 64, vol.size));
    Metrics::inc(&app.metrics.migrations);
    let acked = rt.acked.load(Ordering::Relaxed);
    app.meta.update(meta::VMS, "vm", id, |v: &mut Vm| {
        v.worker = req.worker.clone();
        v.epoch = new_epoch;
        v.migrations += 1;
        v.verified_blocks = verified;
        v.writes_acked = acked;
        v.status = "running".into();
    })
}

fn get_locked(app: &App, id: &str) -> Result<Vm> {
    app.meta.get(meta::VMS, id)?.ok_or_else(|| PlasmaError::not_found("vm", id))
}

/// `DELETE /v1/vms/{id}`: stops the guest and detaches.
pub async fn delete(app: &App, id: &str) -> Result<()> {
    let mut vms = app.workers.vms.lock().await;
    get_locked(app, id)?;
    if let Some(mut rt) = vms.remove(id) {
        rt.stop.store(true, Ordering::Relaxed);
        *rt.fence.epoch.write().await = u64::MAX;
        if let Some(io) = rt.io.take() {
            let _ = io.await;
        }
    }
    app.meta.delete(meta::VMS, id)?;
    Ok(())
}
