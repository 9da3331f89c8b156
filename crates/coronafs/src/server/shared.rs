//! What every connection of one server shares: the volumes it opens
//! exports from, the counters, the buffer pool and the TLS policy.

use super::bufpool::BufPool;
use crate::metrics::Metrics;
use crate::proto::handshake::TlsMode;
use crate::volume::Volumes;
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// State shared by every connection.
pub struct Shared {
    /// The volumes, whose exports the connections open.
    pub volumes: Arc<Volumes>,
    /// Counters, also rendered by the control API.
    pub metrics: Arc<Metrics>,
    pub pool: BufPool,
    /// Whether STARTTLS is offered, and required.
    pub tls_mode: TlsMode,
    /// The credentials STARTTLS uses; `Some` exactly when `tls_mode` is not off.
    pub tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("volumes", &self.volumes).field("tls_mode", &self.tls_mode).finish()
    }
}

impl Shared {
    /// Connection state over `volumes`, counting into `metrics`, without TLS.
    pub fn new(volumes: Arc<Volumes>, metrics: Arc<Metrics>) -> Self {
        Shared { volumes, metrics, pool: BufPool::default(), tls_mode: TlsMode::Off, tls: None }
    }

    /// The same with STARTTLS offered (`Allow`) or required (`Require`).
    pub fn with_tls(mut self, mode: TlsMode, acceptor: TlsAcceptor) -> Self {
        if mode != TlsMode::Off {
            self.tls_mode = mode;
            self.tls = Some(acceptor);
        }
        self
    }
}
