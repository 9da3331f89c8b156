//! What every connection of one server shares: the volumes it opens
//! exports from, the counters and the buffer pool.

use super::bufpool::BufPool;
use crate::metrics::Metrics;
use crate::volume::Volumes;
use std::sync::Arc;

/// State shared by every connection.
#[derive(Debug)]
pub struct Shared {
    /// The volumes, whose exports the connections open.
    pub volumes: Arc<Volumes>,
    /// Counters, also rendered by the control API.
    pub metrics: Arc<Metrics>,
    pub pool: BufPool,
}

impl Shared {
    /// Connection state over `volumes`, counting into `metrics`.
    pub fn new(volumes: Arc<Volumes>, metrics: Arc<Metrics>) -> Self {
        Shared { volumes, metrics, pool: BufPool::default() }
    }
}
