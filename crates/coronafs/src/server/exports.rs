//! What the NBD side sees of volumes: an open export ([`Volume`]) and the
//! export catalog the negotiation asks. The volumes themselves are managed
//! by [`crate::volume::Volumes`].
//!
//! Connections to the same export share one open backend, so a write answered
//! on one connection is visible to all and one `fdatasync` covers them all
//! (`NBD_FLAG_CAN_MULTI_CONN`).

use crate::backend::AnyBackend;
use crate::backend::BlockBackend;
use crate::backend::layered::Layered;
use crate::proto::handshake::{ExportCatalog, ExportDesc};
use crate::volume::fence::Fence;
use std::sync::atomic::AtomicUsize;

pub use crate::volume::{SnapshotInfo, VolumeInfo, Volumes as Exports};

/// Largest READ or WRITE payload accepted (the protocol's customary maximum).
pub const MAX_BLOCK: u32 = 32 << 20;
/// Preferred request size advertised to clients.
pub const PREF_BLOCK: u32 = 4096;

/// An export in use: a volume (`VOL`) or a snapshot (`VOL@SNAP`, read-only).
#[derive(Debug)]
pub struct Volume {
    pub name: String,
    pub backend: Layered<AnyBackend>,
    pub read_only: bool,
    pub connections: AtomicUsize,
    /// The write epoch (see [`crate::volume::fence`]).
    pub fence: Fence,
}

impl Volume {
    pub fn new(name: &str, backend: Layered<AnyBackend>, read_only: bool, epoch: u64) -> Self {
        Volume { name: name.to_owned(), backend, read_only, connections: AtomicUsize::new(0), fence: Fence::new(epoch) }
    }
}

impl ExportCatalog for Exports {
    fn lookup(&self, name: &str) -> std::result::Result<ExportDesc, String> {
        let (v, declared) = self.open_export(name).map_err(|e| e.to_string())?;
        let current = v.fence.current();
        if let Some(e) = declared
            && e < current
        {
            return Err(format!("export {name:?} declares epoch {e}, but the volume is fenced at epoch {current}"));
        }
        // A client that declares no epoch holds epoch 0: once the volume has
        // been fenced it may only read, so it is told the export is read-only.
        let read_only = v.read_only || (declared.is_none() && current > 0);
        Ok(ExportDesc {
            name: name.to_owned(),
            size: v.backend.size(),
            read_only,
            description: if v.read_only && name.contains('@') {
                format!("CoronaFS snapshot {name}")
            } else {
                format!("CoronaFS volume {name}")
            },
            min_block: 1,
            pref_block: PREF_BLOCK,
            max_block: MAX_BLOCK,
        })
    }

    fn names(&self) -> Vec<String> {
        self.export_names()
    }
}
