//! The replica RPC between CoronaFS nodes, sans-IO: the mutual HMAC
//! handshake every connection starts with ([`auth`]), the frames a
//! primary sends its replicas and their answers ([`wire`]), and the vote
//! that elects a new primary after a failover ([`election`]). The I/O is in
//! `backend/replicated` (the primary's side) and `server/replica.rs` (the
//! replica's). See docs/design/replication-volumes.md.

pub mod auth;
pub mod election;
pub mod wire;
