//! The server's shared state and its startup work (recovering records the
//! last run left half done).

use crate::config::Config;
use crate::corona::Corona;
use crate::error::Result;
use crate::locks::KeyedLocks;
use crate::meta::{self, Meta};
use crate::metrics::Metrics;
use crate::model::{Image, Status, Vm, VmStatus, Volume};
use crate::objstore::ObjectStore;
use crate::worker::Workers;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Live progress of a long operation (artifact bytes, volume fill).
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

impl Progress {
    pub fn get(&self) -> (u64, u64) {
        (self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct App {
    pub cfg: Config,
    pub meta: Meta,
    pub s3: ObjectStore,
    pub corona: Corona,
    pub metrics: Metrics,
    /// Progress of uploads and fills, by image or volume id.
    pub progress: Mutex<HashMap<String, Arc<Progress>>>,
    /// One lock per image: whoever holds it fills the image's base.
    pub fills: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// One eviction pass at a time (see [`crate::cache::evict`]).
    pub evicting: tokio::sync::Mutex<()>,
    pub workers: Workers,
    /// One lock per VM (see [`crate::vms`]).
    pub vm_locks: KeyedLocks,
}

impl App {
    pub fn new(cfg: Config) -> Result<Arc<Self>> {
        let meta = Meta::open(&cfg.data_dir)?;
        let metrics = Metrics::default();
        let nodes = crate::config::nbd_nodes(&cfg.coronafs_nbd, &cfg.coronafs_nodes);
        let tokens = cfg.tokens()?;
        let workers = Workers::new(nodes, &cfg.workers, tokens.agents, metrics.fenced_writes.clone());
        let app = App {
            s3: ObjectStore::new(&cfg),
            corona: Corona::new(&cfg.coronafs_api, &cfg.coronafs_nbd, tokens.coronafs),
            meta,
            metrics,
            progress: Mutex::default(),
            fills: Mutex::default(),
            evicting: tokio::sync::Mutex::default(),
            workers,
            vm_locks: KeyedLocks::default(),
            cfg,
        };
        app.recover()?;
        Ok(Arc::new(app))
    }

    /// Work in flight when the last run stopped cannot resume (the upload
    /// stream or the fill task is gone): say so instead of leaving a record
    /// stuck in a busy state forever.
    fn recover(&self) -> Result<()> {
        for img in self.meta.list::<Image>(meta::IMAGES)? {
            if matches!(img.status, Status::Uploading | Status::Importing) {
                self.meta.update(meta::IMAGES, "image", &img.id, |i: &mut Image| {
                    i.status = Status::Error;
                    i.error_reason = Some("interrupted: the server restarted while the image was arriving".into());
                })?;
            }
        }
        for v in self.meta.list::<Volume>(meta::VOLUMES)? {
            if matches!(v.status, Status::Creating | Status::Downloading) {
                self.meta.update(meta::VOLUMES, "volume", &v.id, |x: &mut Volume| {
                    x.status = Status::Error;
                    x.error_reason =
                        Some("interrupted: the server restarted while the volume was being created".into());
                })?;
            }
        }
        for vm in self.meta.list::<Vm>(meta::VMS)? {
            // Agents keep their attachments across a control-plane restart;
            // in-process workers and half-done migrations do not.
            if !self.cfg.workers.is_empty() && vm.status != VmStatus::Migrating {
                continue;
            }
            self.meta.update(meta::VMS, "vm", &vm.id, |x: &mut Vm| {
                x.status = VmStatus::Error;
                x.error_reason = Some("the worker attachment was lost when the server restarted".into());
            })?;
        }
        Ok(())
    }

    /// Cleans up what a killed server left outside its records: multipart
    /// uploads of artifacts (no upload survives a restart: [`Self::recover`]
    /// marked their images `error`) and conversion scratch files (no fill
    /// survives either). Runs at start, before the API serves.
    pub async fn clean_leftovers(&self) -> Result<()> {
        let aborted = self.s3.abort_uploads(crate::objstore::KEY_PREFIX, false).await?;
        let mut removed = 0;
        match std::fs::read_dir(self.scratch_dir()) {
            Ok(entries) => {
                for e in entries.flatten() {
                    std::fs::remove_file(e.path())?;
                    removed += 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        if aborted + removed > 0 {
            tracing::info!(aborted, removed, "cleaned up uploads and scratch files an earlier run left");
        }
        Ok(())
    }

    /// Where fills keep qcow2 artifacts while converting them.
    pub fn scratch_dir(&self) -> std::path::PathBuf {
        self.cfg.data_dir.join("scratch")
    }

    /// The scratch file of a fill of `image_id`.
    pub fn scratch_path(&self, image_id: &str) -> std::path::PathBuf {
        self.scratch_dir().join(format!("{image_id}.qcow2"))
    }

    /// A progress tracker for `id`, created on first use.
    pub fn progress(&self, id: &str) -> Arc<Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).entry(id.to_owned()).or_default().clone()
    }

    pub fn peek_progress(&self, id: &str) -> Option<Arc<Progress>> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    pub fn drop_progress(&self, id: &str) {
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
    }

    pub fn fill_lock(&self, image_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.fills.lock().unwrap_or_else(|e| e.into_inner()).entry(image_id.to_owned()).or_default().clone()
    }
}
