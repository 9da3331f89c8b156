//! Node-to-node authentication: every RPC connection between nodes (and
//! from the operator's `lightningstor cluster` commands) opens with the
//! mutual HMAC challenge of [`svc_kit::rpc_auth`], keyed by the cluster
//! file's `rpc_secret`, under LightningStor's own magic. So a process
//! without the secret can neither give a node an order (`ChangeLayout`, a
//! commit, a block read) nor pose as a node to a caller. `transport.rs`
//! runs it on every connection it opens or accepts.

use crate::error::LightningError;
use svc_kit::rpc_auth::Protocol;
pub use svc_kit::rpc_auth::{ANSWER_LEN, HELLO_LEN, RpcAuthError, RpcSecret};

/// LightningStor's node RPC.
pub const PROTOCOL: Protocol = Protocol { magic: *b"LSRPC\x00\x00\x01", listener: "a LightningStor node" };

impl From<RpcAuthError> for LightningError {
    fn from(e: RpcAuthError) -> Self {
        match e {
            RpcAuthError::BadSecret => LightningError::Config(e.to_string()),
            RpcAuthError::NoRandom(_) => LightningError::Io(std::io::Error::other(e.to_string())),
            RpcAuthError::Refused(_) => LightningError::Unavailable(e.to_string()),
            RpcAuthError::Io(io) => LightningError::Io(io),
        }
    }
}
