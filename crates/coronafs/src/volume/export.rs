//! What the NBD side sees of a volume: an open export ([`Export`]) and the
//! limits it is served with. Owned by the volume manager
//! (`Volumes`, which also answers the negotiation's export
//! catalog), which opens exports and keeps them until the volume changes or
//! goes; the server above only uses them.
//!
//! Connections to the same export share one open backend, so a write answered
//! on one connection is visible to all and one `fdatasync` covers them all
//! (`NBD_FLAG_CAN_MULTI_CONN`).

use super::fence::Fence;
use crate::backend::layered::Layered;
use crate::backend::{AnyBackend, BlockBackend};
use std::sync::atomic::AtomicUsize;

/// Largest READ or WRITE payload accepted (the protocol's customary maximum).
pub const MAX_BLOCK: u32 = 32 << 20;
/// Preferred request size advertised to clients.
pub const PREF_BLOCK: u32 = 4096;

/// An export in use: a volume (`VOL`) or a snapshot (`VOL@SNAP`, read-only).
#[derive(Debug)]
pub struct Export {
    pub name: String,
    pub backend: Layered<AnyBackend>,
    pub read_only: bool,
    pub connections: AtomicUsize,
    /// The write epoch (see [`super::fence`]).
    pub fence: Fence,
    /// On a replicated volume's primary: its replicas' states and clean close.
    pub replication: Option<super::replication::Handle>,
    /// On a replicated volume's primary: its own copy, under the
    /// replication (a snapshot swaps this copy's head).
    pub local: Option<std::sync::Arc<Layered<AnyBackend>>>,
}

impl Export {
    pub fn new(name: &str, backend: Layered<AnyBackend>, read_only: bool, epoch: u64) -> Self {
        Export {
            name: name.to_owned(),
            backend,
            read_only,
            connections: AtomicUsize::new(0),
            fence: Fence::new(epoch),
            replication: None,
            local: None,
        }
    }

    /// Closes the export cleanly: a replicated one clears its clean-shutdown
    /// mark once every live copy has flushed (see [`super::replication::Handle`]),
    /// any other flushes.
    pub async fn close(&self) -> std::io::Result<()> {
        match &self.replication {
            Some(h) => h.close().await,
            None => BlockBackend::flush(&self.backend).await,
        }
    }
}
