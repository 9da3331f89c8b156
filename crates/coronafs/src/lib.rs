//! CoronaFS: shared block volumes for VM disks, exported over NBD.
//!
//! The modules form layers; each imports only from layers below it:
//! - [`proto`]: the sans-IO NBD codec (negotiation, requests, replies);
//!   [`error`], [`util`] (names and sizes) and [`metrics`] beside it;
//! - [`replica`]: the sans-IO replica RPC (handshake and frames) beside it,
//!   and [`cluster`], the cluster file (nodes, zones, secret) and placement;
//! - [`replication`]: the volume map on Raft (openraft), which decides
//!   who is primary of a replicated volume and which copies are in sync;
//! - [`backend`]: the [`backend::BlockBackend`] trait and its engines
//!   (io_uring, thread pool, memory, copy-on-write layering, replication
//!   to other nodes over the replica RPC);
//! - [`dto`]: the control API's JSON bodies; [`api_client`], the typed
//!   client over them; [`client`], an async pipelined NBD client;
//! - [`volume`]: volumes, snapshots and clones over layered backends, their
//!   metadata in redb, and the open exports ([`volume::export`]);
//! - [`server`]: the async NBD server over those exports, and [`api`]: the
//!   HTTP control API and `/metrics` over the volumes (neither imports the
//!   other);
//! - [`config`]: the settings of `coronafs serve` (TOML file and flags);
//! - [`service`]: start-up and shutdown, building the engine, the volumes,
//!   the NBD server and the API from a [`config::ServerConfig`];
//! - `main.rs`: the `coronafs` command (server and CLI).
//!
//! Test doubles (the crash and fault backends, fail points in volume
//! changes) are compiled only for the crate's own tests or with the
//! `testing` feature.

pub mod api;
pub mod api_client;
pub mod backend;
pub mod client;
pub mod cluster;
pub mod config;
pub mod dto;
pub mod error;
pub mod metrics;
pub mod openapi;
pub mod proto;
pub mod replica;
pub mod replication;
pub mod server;
pub mod service;
pub mod util;
pub mod volume;

pub use error::{CoronaError, Result};
