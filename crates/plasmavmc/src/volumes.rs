//! Volumes: `POST` answers 202 at once; a task gets the image's base (warm:
//! cached; cold: fetched and converted once) and clones it in CoronaFS.

use crate::app::App;
use crate::cache::{self, Outcome};
use crate::error::{PlasmaError, Result};
use crate::meta;
use crate::metrics::Metrics;
use crate::model::{CreateVolume, Image, Status, Vm, Volume, new_id, now_secs};
use std::sync::Arc;
use std::time::Instant;

/// `POST /v1/volumes`.
pub async fn create(app: &Arc<App>, req: CreateVolume) -> Result<Volume> {
    let t0 = Instant::now();
    let img: Image =
        app.meta.get(meta::IMAGES, &req.image_id)?.ok_or_else(|| PlasmaError::not_found("image", &req.image_id))?;
    if img.status != Status::Active {
        return Err(PlasmaError::Conflict(format!("image {} is not active", img.id)));
    }
    let vsize = img.virtual_size.unwrap_or(0);
    let size = req.size.unwrap_or(vsize);
    if size < vsize {
        return Err(PlasmaError::Invalid(format!("size {size} is smaller than the image's virtual size {vsize}")));
    }
    if size > app.cfg.max_virtual_size {
        return Err(PlasmaError::Invalid(format!("size {size} exceeds the {} limit", app.cfg.max_virtual_size)));
    }
    let id = new_id("vol");
    let vol = Volume {
        coronafs_volume: id.clone(),
        id,
        image_id: img.id.clone(),
        status: Status::Creating,
        size,
        nbd_uri: None,
        bytes_done: 0,
        bytes_total: 0,
        cache_hit: false,
        error_reason: None,
        created_at: now_secs(),
        elapsed_ms: None,
    };
    app.meta.put(meta::VOLUMES, &vol.id, &vol)?;
    let (app2, v2) = (app.clone(), vol.clone());
    tokio::spawn(async move {
        let id = v2.id.clone();
        if let Err(e) = run(&app2, v2, img, t0).await {
            tracing::warn!(volume = %id, error = %e, "volume failed");
            Metrics::inc(&app2.metrics.volumes_failed);
            let done = app2.peek_progress(&id).map(|p| p.get());
            let _ = app2.meta.update(meta::VOLUMES, "volume", &id, |v: &mut Volume| {
                v.status = Status::Error;
                v.error_reason = Some(e.to_string());
                if let Some((d, t)) = done {
                    v.bytes_done = d;
                    v.bytes_total = t;
                }
            });
        }
        app2.drop_progress(&id);
    });
    Ok(vol)
}

async fn run(app: &Arc<App>, vol: Volume, img: Image, t0: Instant) -> Result<()> {
    // Everyone waiting on one image's fill shares the filler's progress.
    let progress = app.progress(&format!("fill-{}", img.id));
    {
        let mut map = app.progress.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(vol.id.clone(), progress.clone());
    }
    if app.meta.get::<crate::model::CacheEntry>(meta::CACHE, &img.id)?.is_none() {
        app.meta.update(meta::VOLUMES, "volume", &vol.id, |v: &mut Volume| v.status = Status::Downloading)?;
    }
    let (entry, outcome, pin) = cache::ensure(app, &img, &progress).await?;
    match outcome {
        Outcome::Hit => Metrics::inc(&app.metrics.cache_hits),
        Outcome::Coalesced => {
            Metrics::inc(&app.metrics.cache_hits);
            Metrics::inc(&app.metrics.cache_coalesced);
        }
        Outcome::Miss => Metrics::inc(&app.metrics.cache_misses),
    }
    let snap = format!("{}@{}", entry.base_volume, entry.snapshot);
    let cloned = app.corona.clone_from(&vol.coronafs_volume, &snap, Some(vol.size)).await;
    // The base has its clone: let it go before evicting others. Every
    // create evicts, not only the one that filled: an eviction pass skips
    // bases whose fill lock another create holds, so the last create to let
    // go of its lock must be the one that brings the cache within its
    // limits (a pass within the limits returns at once).
    drop(pin);
    cache::evict(app, &img.id).await;
    cloned?;
    let (done, total) = progress.get();
    let uri = app.corona.nbd_uri(&vol.coronafs_volume);
    let elapsed = t0.elapsed().as_millis() as u64;
    app.meta.update(meta::VOLUMES, "volume", &vol.id, |v: &mut Volume| {
        v.status = Status::Available;
        v.nbd_uri = Some(uri);
        v.cache_hit = outcome != Outcome::Miss;
        v.bytes_done = if outcome == Outcome::Miss { done } else { total.max(done) };
        v.bytes_total = total;
        v.elapsed_ms = Some(elapsed);
    })?;
    if outcome == Outcome::Miss {
        app.drop_progress(&format!("fill-{}", img.id));
    }
    Metrics::inc(&app.metrics.volumes_created);
    tracing::info!(volume = %vol.id, image = %img.id, ?outcome, elapsed_ms = elapsed, "volume available");
    Ok(())
}

/// With live progress filled in.
pub fn get(app: &App, id: &str) -> Result<Volume> {
    let mut v: Volume = app.meta.get(meta::VOLUMES, id)?.ok_or_else(|| PlasmaError::not_found("volume", id))?;
    if matches!(v.status, Status::Creating | Status::Downloading)
        && let Some(p) = app.peek_progress(id)
    {
        (v.bytes_done, v.bytes_total) = p.get();
    }
    Ok(v)
}

pub fn list(app: &App) -> Result<Vec<Volume>> {
    app.meta.list::<Volume>(meta::VOLUMES)?.into_iter().map(|v| get(app, &v.id)).collect()
}

/// `DELETE /v1/volumes/{id}`: refused while a VM uses it or while it is being made.
pub async fn delete(app: &Arc<App>, id: &str) -> Result<()> {
    let v = get(app, id)?;
    if matches!(v.status, Status::Creating | Status::Downloading) {
        return Err(PlasmaError::Conflict(format!("volume {id} is still being created")));
    }
    if let Some(vm) = app.meta.list::<Vm>(meta::VMS)?.into_iter().find(|vm| vm.volume_id == id) {
        return Err(PlasmaError::Conflict(format!("volume {id} is attached to VM {}", vm.id)));
    }
    app.corona.delete(&v.coronafs_volume, false).await?;
    app.meta.delete(meta::VOLUMES, id)?;
    Ok(())
}
