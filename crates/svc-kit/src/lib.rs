//! What every service does the same way, so that it is done one way:
//!
//! - [`config`]: read a TOML config file, parse it with serde and, where
//!   the file is the whole configuration, validate it; every error names
//!   the file (and the line and column of a parse error).
//! - [`prom`]: render counters, gauges and histograms in the Prometheus
//!   text exposition format for `/metrics`.
//! - [`api_token`]: the bearer token every HTTP control API that changes
//!   state requires (an axum layer, constant-time checks, where a server
//!   finds its token and when it may run without one).
//! - [`rpc_auth`]: the mutual HMAC challenge that opens every node-to-node
//!   RPC connection (LightningStor's node RPC, CoronaFS's replica RPC).
//!
//! It sits below every service crate and depends on nothing heavier than
//! serde, toml, the HMAC/SHA-256 crates, tokio's I/O traits and axum's
//! middleware, so CoronaFS,
//! LightningStor, PlasmaVMC and the bench can all use it without pulling
//! each other in.

pub mod api_token;
pub mod config;
pub mod prom;
pub mod rpc_auth;
