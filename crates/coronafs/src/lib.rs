//! CoronaFS: shared block volumes for VM disks, exported over NBD.
//!
//! The crate is layered the way data flows:
//! - [`proto`]: the sans-IO NBD codec (negotiation, requests, replies);
//! - [`backend`]: the [`backend::BlockBackend`] trait and its engines
//!   (io_uring, thread pool, memory, crash injection, copy-on-write layering);
//! - [`volume`]: volumes, snapshots and clones over layered backends, with
//!   their metadata in redb;
//! - [`server`]: the async NBD server and the export table;
//! - [`api`]: the HTTP control API and `/metrics`;
//! - [`api_client`]: a typed client of its server-level calls (info, evict);
//! - [`config`]: the settings of `coronafs serve` (TOML file and flags);
//! - [`client`]: an async, pipelined NBD client (used by the bench and PlasmaVMC).

pub mod api;
pub mod api_client;
pub mod backend;
pub mod client;
pub mod config;
pub mod error;
pub mod metrics;
pub mod openapi;
pub mod proto;
pub mod server;
pub mod util;
pub mod volume;

pub use error::{CoronaError, Result};
