//! PlasmaVMC: VM images stored in LightningStor, volumes made from them in
//! CoronaFS, and emulated VMs that attach and migrate.
//!
//! Layers, bottom up:
//! - [`probe`], [`urlfilter`]: sans-IO checks of untrusted input (image
//!   headers, import URLs), property-tested;
//! - [`convert`], [`sink`]: qcow2/raw to guest bytes (imago on a blocking
//!   thread) and NBD writes of those bytes;
//! - [`objstore`], [`corona`]: clients of LightningStor (S3) and CoronaFS;
//! - [`meta`]: redb tables of images, volumes, VMs and cached bases;
//! - [`images`], [`volumes`], [`cache`], [`vms`]: the operations;
//! - [`guest`], [`agent`], [`workers`]: emulated guests, the `plasmavmc
//!   agent` worker process, and the control plane's handle on workers;
//! - [`api`], [`openapi`], [`server`]: the REST API and an in-process server.

pub mod agent;
pub mod api;
pub mod app;
pub mod cache;
pub mod config;
pub mod convert;
pub mod corona;
pub mod error;
pub mod guest;
pub mod images;
pub mod meta;
pub mod metrics;
pub mod model;
pub mod objstore;
pub mod openapi;
pub mod probe;
pub mod server;
pub mod sink;
pub mod urlfilter;
pub mod vms;
pub mod volumes;
pub mod workers;

pub use config::Config;
pub use error::{PlasmaError, Result};
pub use server::Server;
