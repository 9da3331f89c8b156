//! The exports of a server: one per volume file directly under the data dir.
//!
//! Connections to the same export share one open backend, so a write answered
//! on one connection is visible to all and one `fdatasync` covers them all
//! (`NBD_FLAG_CAN_MULTI_CONN`).

use crate::backend::{AnyBackend, BlockBackend, Opener};
use crate::error::{CoronaError, Result};
use crate::proto::handshake::{ExportCatalog, ExportDesc};
use crate::util::validate_name;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

/// Largest READ or WRITE payload accepted (the protocol's customary maximum).
pub const MAX_BLOCK: u32 = 32 << 20;
/// Preferred request size advertised to clients.
pub const PREF_BLOCK: u32 = 4096;

/// An export in use: its backend and who is connected.
#[derive(Debug)]
pub struct Volume {
    pub name: String,
    pub backend: AnyBackend,
    pub read_only: bool,
    pub connections: AtomicUsize,
}

/// What the API shows of a volume.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size: u64,
    pub allocated_bytes: u64,
    pub read_only: bool,
    pub connections: usize,
    pub nbd_export: String,
}

#[derive(Debug)]
pub struct Exports {
    dir: PathBuf,
    opener: Opener,
    read_only: bool,
    open: Mutex<HashMap<String, Weak<Volume>>>,
    /// Volumes that live outside the data dir (in-memory, fault-injecting).
    pinned: Mutex<HashMap<String, Arc<Volume>>>,
}

impl Exports {
    pub fn new(dir: PathBuf, opener: Opener, read_only: bool) -> Self {
        Exports { dir, opener, read_only, open: Mutex::new(HashMap::new()), pinned: Mutex::new(HashMap::new()) }
    }

    pub fn opener(&self) -> &Opener {
        &self.opener
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        validate_name(name)?;
        Ok(self.dir.join(name))
    }

    /// Serves `backend` as export `name` until the server stops. Tests use it
    /// for in-memory and fault-injecting volumes.
    pub fn insert(&self, name: &str, backend: AnyBackend, read_only: bool) -> Result<Arc<Volume>> {
        validate_name(name)?;
        let v = Arc::new(Volume { name: name.to_owned(), backend, read_only, connections: AtomicUsize::new(0) });
        if let Ok(mut p) = self.pinned.lock() {
            p.insert(name.to_owned(), v.clone());
        }
        Ok(v)
    }

    /// Opens (or shares the already open) volume `name`.
    pub fn open(&self, name: &str) -> Result<Arc<Volume>> {
        if let Some(v) = self.pinned.lock().ok().and_then(|p| p.get(name).cloned()) {
            return Ok(v);
        }
        let path = self.path(name)?;
        let mut open = self.open.lock().map_err(|_| CoronaError::Io(std::io::Error::other("export table poisoned")))?;
        if let Some(v) = open.get(name).and_then(Weak::upgrade) {
            return Ok(v);
        }
        let file = std::fs::OpenOptions::new().read(true).write(!self.read_only).open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound { CoronaError::NotFound(name.to_owned()) } else { e.into() }
        })?;
        let backend = self.opener.open(file)?;
        let v = Arc::new(Volume {
            name: name.to_owned(),
            backend,
            read_only: self.read_only,
            connections: AtomicUsize::new(0),
        });
        open.retain(|_, w| w.strong_count() > 0);
        open.insert(name.to_owned(), Arc::downgrade(&v));
        Ok(v)
    }

    /// Creates a sparse volume of `size` bytes.
    pub fn create(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        let path = self.path(name)?;
        if self.read_only {
            return Err(CoronaError::ReadOnly("volumes cannot be created"));
        }
        if size == 0 || size > (1 << 50) {
            return Err(CoronaError::InvalidSize {
                input: size.to_string(),
                reason: "must be between 1 byte and 1 PiB",
            });
        }
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                CoronaError::AlreadyExists(name.to_owned())
            } else {
                e.into()
            }
        })?;
        file.set_len(size)?;
        file.sync_all()?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        tracing::info!(volume = name, size, "created volume");
        self.info(name)
    }

    /// Describes one volume.
    pub fn info(&self, name: &str) -> Result<VolumeInfo> {
        use std::os::unix::fs::MetadataExt;
        let path = self.path(name)?;
        let md = std::fs::metadata(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound { CoronaError::NotFound(name.to_owned()) } else { e.into() }
        })?;
        if !md.is_file() {
            return Err(CoronaError::NotFound(name.to_owned()));
        }
        let connections = self
            .open
            .lock()
            .ok()
            .and_then(|m| m.get(name).and_then(Weak::upgrade))
            .map_or(0, |v| v.connections.load(Ordering::Relaxed));
        Ok(VolumeInfo {
            name: name.to_owned(),
            size: md.len(),
            allocated_bytes: md.blocks() * 512,
            read_only: self.read_only,
            connections,
            nbd_export: name.to_owned(),
        })
    }

    /// All volumes, sorted by name.
    pub fn list(&self) -> Result<Vec<VolumeInfo>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            if validate_name(&name).is_ok() && entry.file_type()?.is_file() {
                out.push(self.info(&name)?);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

impl ExportCatalog for Exports {
    fn lookup(&self, name: &str) -> std::result::Result<ExportDesc, String> {
        let v = self.open(name).map_err(|e| e.to_string())?;
        Ok(ExportDesc {
            name: name.to_owned(),
            size: v.backend.size(),
            read_only: v.read_only,
            description: format!("CoronaFS volume {name}"),
            min_block: 1,
            pref_block: PREF_BLOCK,
            max_block: MAX_BLOCK,
        })
    }

    fn names(&self) -> Vec<String> {
        self.list().map(|l| l.into_iter().map(|v| v.name).collect()).unwrap_or_default()
    }
}
