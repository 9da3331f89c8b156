//! The image base cache: per image, a CoronaFS volume holding the converted
//! image and a snapshot of it. Volumes are O(1) clones of that snapshot.
//!
//! A miss fetches and converts the artifact once (one fill per image at a
//! time: later requests wait for the first and then hit). The cache is
//! bounded by count and bytes; eviction picks bases without clones first
//! (oldest use first), then the least recently used of the rest. An image's
//! fill lock is held from the fill (or hit) until its clone is made, and
//! eviction only tries other images' locks, so no task ever waits on one
//! image's lock while holding another's. Deleting a
//! base that has clones is safe: CoronaFS keeps the layers its clones read
//! through, so the clones keep working and the space goes with the last one.

use crate::app::{App, Progress};
use crate::convert::{self, Arrivals, Piece, Streamed};
use crate::error::{PlasmaError, Result};
use crate::meta;
use crate::metrics::Metrics;
use crate::model::{CacheEntry, Image, now_ms};
use crate::objstore::object_key;
use crate::probe::DiskFormat;
use futures::StreamExt;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{OwnedMutexGuard, mpsc};

/// The snapshot name every base carries.
pub const SNAPSHOT: &str = "cached";

/// CoronaFS volume name of an image's base.
pub fn base_name(image_id: &str) -> String {
    format!("base-{image_id}")
}

/// How a volume got its base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    /// Another request filled it while we waited.
    Coalesced,
    Miss,
}

/// The image's base, filling it first if needed. `progress` sees the fill.
///
/// The returned guard is the image's fill lock: while it is held the base
/// is never evicted, so the caller clones from it and then drops the guard
/// before anything else (never holding it while waiting on another lock).
pub async fn ensure(
    app: &Arc<App>,
    img: &Image,
    progress: &Arc<Progress>,
) -> Result<(CacheEntry, Outcome, OwnedMutexGuard<()>)> {
    let was_cached = app.meta.get::<CacheEntry>(meta::CACHE, &img.id)?.is_some();
    let pin = app.fill_lock(&img.id).lock_owned().await;
    if let Some(e) = touch(app, &img.id)? {
        return Ok((e, if was_cached { Outcome::Hit } else { Outcome::Coalesced }, pin));
    }
    let entry = fill(app, img, progress).await?;
    app.meta.put(meta::CACHE, &img.id, &entry)?;
    Ok((entry, Outcome::Miss, pin))
}

fn touch(app: &App, image_id: &str) -> Result<Option<CacheEntry>> {
    if app.meta.get::<CacheEntry>(meta::CACHE, image_id)?.is_none() {
        return Ok(None);
    }
    app.meta.update(meta::CACHE, "cache entry", image_id, |e: &mut CacheEntry| e.last_used_ms = now_ms()).map(Some)
}

/// Fetches the artifact with parallel range GETs and writes the guest bytes
/// into a fresh base volume, then snapshots it.
async fn fill(app: &Arc<App>, img: &Image, progress: &Arc<Progress>) -> Result<CacheEntry> {
    let (Some(format), Some(vsize), Some(size)) = (img.disk_format, img.virtual_size, img.size) else {
        return Err(PlasmaError::Conflict(format!("image {} is not active", img.id)));
    };
    let base = base_name(&img.id);
    // A fill that died half way (crash) may have left the volume behind.
    app.corona.delete_snapshot(&base, SNAPSHOT, true).await?;
    app.corona.delete(&base, true).await?;
    app.corona.create(&base, vsize).await?;
    let total = size + if format == DiskFormat::Qcow2 { vsize } else { 0 };
    progress.total.store(total, Ordering::Relaxed);
    let r = write_base(app, img, format, size, &base, progress).await;
    if let Err(e) = r {
        app.corona.delete(&base, true).await.ok();
        return Err(e);
    }
    app.corona.snapshot(&base, SNAPSHOT).await?;
    Ok(CacheEntry {
        image_id: img.id.clone(),
        base_volume: base,
        snapshot: SNAPSHOT.into(),
        virtual_size: vsize,
        last_used_ms: now_ms(),
    })
}

async fn write_base(
    app: &Arc<App>,
    img: &Image,
    format: DiskFormat,
    size: u64,
    base: &str,
    progress: &Arc<Progress>,
) -> Result<()> {
    let nbd = Arc::new(app.corona.connect(base).await?);
    let (tx, rx) = mpsc::channel::<Piece>(8);
    let writer = tokio::spawn(crate::sink::drain(nbd.clone(), rx));
    let chunk = app.cfg.fetch_chunk;
    let key = object_key(&img.id);
    let chunks = size.div_ceil(chunk);
    let fetch = |i: u64| {
        let (app, key) = (app.clone(), key.clone());
        async move {
            let start = i * chunk;
            let end = (start + chunk).min(size);
            let data = app.s3.get_range(&key, start, end).await?;
            app.metrics.fill_bytes_fetched.fetch_add(data.len() as u64, Ordering::Relaxed);
            Ok::<_, PlasmaError>((i, start, data))
        }
    };
    let par = app.cfg.fetch_parallelism;
    let result = match format {
        DiskFormat::Raw => {
            let mut s = futures::stream::iter(0..chunks).map(fetch).buffer_unordered(par);
            let mut r = Ok(());
            while let Some(x) = s.next().await {
                match x {
                    Ok((_, start, data)) => {
                        let n = data.len() as u64;
                        if tx.send(Piece::Data { offset: start, data }).await.is_err() {
                            break; // the writer failed; its error is reported below
                        }
                        progress.done.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(e) => {
                        r = Err(e);
                        break;
                    }
                }
            }
            drop(tx);
            r
        }
        DiskFormat::Qcow2 => {
            std::fs::create_dir_all(app.scratch_dir())?;
            let path = app.scratch_path(&img.id);
            let file = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path)?;
            file.set_len(size)?;
            let arrivals = Arc::new(Arrivals::new(size, chunk));
            let storage = Streamed::new(file.try_clone()?, size, arrivals.clone());
            let p2 = progress.clone();
            let conv = tokio::task::spawn_blocking(move || convert::qcow2_to_pieces(storage, tx, &p2.done));
            let file = Arc::new(file);
            let mut s = futures::stream::iter(0..chunks).map(fetch).buffer_unordered(par);
            let mut r = Ok(());
            while let Some(x) = s.next().await {
                let step = async {
                    let (i, start, data) = x?;
                    let f = file.clone();
                    let n = data.len() as u64;
                    tokio::task::spawn_blocking(move || f.write_all_at(&data, start)).await??;
                    arrivals.mark(i as usize);
                    progress.done.fetch_add(n, Ordering::Relaxed);
                    Ok::<_, PlasmaError>(())
                };
                if let Err(e) = step.await {
                    r = Err(e);
                    break;
                }
                if conv.is_finished() {
                    break; // the converter stopped early (an error): stop fetching
                }
            }
            if let Err(e) = &r {
                arrivals.fail(e.to_string());
            }
            let c = conv.await;
            arrivals.fail("conversion ended".into());
            std::fs::remove_file(&path).ok();
            r.and(c?)
        }
    };
    let w = writer.await;
    let written = match (result, w) {
        (Err(e), _) => return Err(e),
        (Ok(()), Err(j)) => return Err(j.into()),
        (Ok(()), Ok(w)) => w?,
    };
    app.metrics.fill_bytes_written.fetch_add(written, Ordering::Relaxed);
    if let Ok(n) = Arc::try_unwrap(nbd) {
        n.disconnect().await.ok();
    }
    Ok(())
}

/// Number of clones of a base's snapshot (per CoronaFS).
async fn clones(app: &App, base: &str) -> Result<usize> {
    let snaps = app.corona.snapshots(base).await?;
    Ok(snaps.iter().find(|s| s.name == SNAPSHOT).map(|s| s.clones.len()).unwrap_or(0))
}

/// Evicts until the cache is within its limits; `keep` is never evicted.
///
/// Called with no fill lock held. One pass runs at a time (so two passes
/// never pick the same victim), and a victim's lock is only ever tried:
/// a base being filled or cloned from is skipped, never waited for. When
/// every candidate is busy the pass ends over the limit; the fill that
/// holds one of them evicts again when it is done.
pub async fn evict(app: &Arc<App>, keep: &str) {
    let _one_pass = app.evicting.lock().await;
    loop {
        let Ok(entries) = app.meta.list::<CacheEntry>(meta::CACHE) else { return };
        let bytes: u64 = entries.iter().map(|e| e.virtual_size).sum();
        if entries.len() <= app.cfg.cache_max_bases && bytes <= app.cfg.cache_max_bytes {
            return;
        }
        let mut ranked = Vec::new();
        for e in entries.into_iter().filter(|e| e.image_id != keep) {
            let n = clones(app, &e.base_volume).await.unwrap_or(1);
            ranked.push((n > 0, e.last_used_ms, e));
        }
        ranked.sort_by_key(|(busy, used, _)| (*busy, *used));
        let mut evicted = false;
        for (busy, _, victim) in ranked {
            let Ok(pin) = app.fill_lock(&victim.image_id).try_lock_owned() else { continue };
            // Gone meanwhile (its image was deleted)?
            if !matches!(app.meta.get::<CacheEntry>(meta::CACHE, &victim.image_id), Ok(Some(_))) {
                continue;
            }
            if let Err(e) = evict_one(app, &victim, busy).await {
                tracing::warn!(image = %victim.image_id, error = %e, "eviction failed");
                return;
            }
            drop(pin);
            evicted = true;
            break;
        }
        if !evicted {
            return;
        }
    }
}

/// Removes one base; the caller holds its fill lock.
async fn evict_one(app: &App, e: &CacheEntry, busy: bool) -> Result<()> {
    app.corona.delete_snapshot(&e.base_volume, SNAPSHOT, true).await?;
    app.corona.delete(&e.base_volume, true).await?;
    app.meta.delete(meta::CACHE, &e.image_id)?;
    Metrics::inc(&app.metrics.cache_evictions);
    tracing::info!(image = %e.image_id, had_clones = busy, "evicted cached base");
    Ok(())
}

/// Removes an image's base; the caller made sure no volume uses it.
pub async fn drop_base(app: &App, image_id: &str) -> Result<()> {
    let base = base_name(image_id);
    app.corona.delete_snapshot(&base, SNAPSHOT, true).await?;
    app.corona.delete(&base, true).await?;
    app.meta.delete(meta::CACHE, image_id)?;
    Ok(())
}

/// Cache counters and entries.
pub fn stats(app: &App) -> Result<crate::model::CacheStats> {
    Ok(crate::model::CacheStats {
        hits: app.metrics.cache_hits.load(Ordering::Relaxed),
        misses: app.metrics.cache_misses.load(Ordering::Relaxed),
        evictions: app.metrics.cache_evictions.load(Ordering::Relaxed),
        bases: app.meta.list(meta::CACHE)?,
    })
}
