//! LightningStor: an S3-compatible object store on s3s.
//!
//! The module list is the dependency stack, bottom up:
//!
//! - [`block`]: content-addressed blocks (trait + file and memory backends);
//! - [`keys`]: access keys, per-bucket permissions, the [`keys::Keyring`] trait;
//! - [`lifecycle`]: bucket lifecycle rules, their (pure) evaluation, the task's round;
//! - [`meta`]: metadata tables in redb with a group-committing writer;
//! - [`admin`]: the admin API (keys, grants) over HTTP: wire format and client;
//! - [`checksum`], [`listing`], [`conditions`]: pure protocol logic;
//! - [`store`]: the local engine that streams bodies into blocks and commits rows;
//! - [`engine`]: the [`engine::Engine`] trait S3 is served over, and its local implementation;
//! - [`sse`]: SSE-C (AES-256-CTR under the customer's key);
//! - [`s3`]: `impl S3`, one method per operation;
//! - [`server`]: hyper serving, auth, virtual hosts, `/metrics`;
//! - [`cluster`]: replication across nodes (placement, quorums, repair).

pub mod admin;
pub mod block;
pub mod checksum;
pub mod cluster;
pub mod conditions;
pub mod config;
pub mod engine;
pub mod error;
pub mod keys;
pub mod lifecycle;
pub mod listing;
pub mod meta;
pub mod metrics;
pub mod s3;
pub mod server;
pub mod sse;
pub mod store;
pub mod versioning;

pub use config::Config;
pub use error::{LightningError, Result};
pub use store::Store;
