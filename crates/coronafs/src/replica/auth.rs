//! Node-to-node authentication for the replica RPC: every connection opens
//! with the mutual HMAC challenge of [`svc_kit::rpc_auth`] (the scheme
//! LightningStor's node RPC uses too), keyed by the cluster file's
//! `rpc_secret`, under CoronaFS's own magic. The listener checks the
//! caller's tag before it reads any frame, and the caller checks the
//! listener's before it sends one: a process without the secret can
//! neither write to a replica nor pose as one. The frames after it are
//! neither encrypted nor signed (the RPC is for the cluster's own network).
//! `backend/replicated/link.rs` and `server/replica.rs` run it.

use crate::error::CoronaError;
use svc_kit::rpc_auth::Protocol;
pub use svc_kit::rpc_auth::{ANSWER_LEN, HELLO_LEN, RpcAuthError, RpcSecret};

/// CoronaFS's replica RPC.
pub const PROTOCOL: Protocol = Protocol { magic: *b"CFSREP\x00\x01", listener: "a CoronaFS replica listener" };

impl From<RpcAuthError> for CoronaError {
    fn from(e: RpcAuthError) -> Self {
        match e {
            RpcAuthError::BadSecret => CoronaError::Config(e.to_string()),
            RpcAuthError::NoRandom(_) => CoronaError::Io(std::io::Error::other(e.to_string())),
            RpcAuthError::Refused(_) => CoronaError::Replica(e.to_string()),
            RpcAuthError::Io(io) => CoronaError::Io(io),
        }
    }
}
