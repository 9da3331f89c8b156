//! Replication of volumes between the nodes of a cluster: [`map`], the
//! volume map on Raft (who holds copies, who is primary at which epoch,
//! which copies are in sync, the primary's lease).
//!
//! The data path of replication (`backend/replicated`, `server/replica.rs`,
//! the failover parts of `volume/`) moves here in later steps
//! (docs/design/replication-volumes.md).

pub mod map;
