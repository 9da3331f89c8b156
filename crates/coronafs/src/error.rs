//! The crate's error type, and the one place that maps it to HTTP.

use crate::proto::{NbdErrno, ProtoError};

/// Everything that can go wrong in CoronaFS outside the wire codec.
#[derive(Debug, thiserror::Error)]
pub enum CoronaError {
    /// A volume name broke the naming rules.
    #[error("invalid volume name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    /// A size could not be parsed or is out of range.
    #[error("invalid size {input:?}: {reason}")]
    InvalidSize { input: String, reason: &'static str },
    /// The volume already exists.
    #[error("volume {0:?} already exists")]
    AlreadyExists(String),
    /// No such volume.
    #[error("volume {0:?} not found")]
    NotFound(String),
    /// No such snapshot.
    #[error("snapshot {0:?} not found")]
    SnapshotNotFound(String),
    /// The snapshot already exists.
    #[error("snapshot {0:?} already exists")]
    SnapshotExists(String),
    /// The data dir's file system cannot hold a file that large (EFBIG; ext4
    /// stops at 16 TiB).
    #[error("the data dir's file system cannot hold a volume of {size} bytes (its largest file is smaller)")]
    TooLarge { size: u64 },
    /// The change conflicts with the state: in use, has clones, chain too deep.
    #[error("{0}")]
    Conflict(String),
    /// The request is well-formed JSON but asks for something invalid.
    #[error("{0}")]
    BadRequest(String),
    /// The metadata store failed.
    #[error("metadata store: {0}")]
    Meta(String),
    /// The server exports everything read-only.
    #[error("the server is read-only: {0}")]
    ReadOnly(&'static str),
    /// A fence raised the epoch, but writes of older epochs did not finish in time.
    #[error("volume {volume:?} is fenced at epoch {epoch}, but {inflight} older write(s) are still in flight")]
    DrainTimeout { volume: String, epoch: u64, inflight: u64 },
    /// A request to the control API failed: not answered (`status` none)
    /// or answered with an error.
    #[error("{}", api_message(.url, .status, .message))]
    Api { url: String, status: Option<u16>, message: String },
    /// The NBD server answered a request with an error.
    #[error("NBD server replied {errno}: {message}")]
    Nbd { errno: NbdErrno, message: String },
    /// The NBD server refused an option during negotiation.
    #[error("NBD negotiation failed: {0}")]
    Negotiation(String),
    /// The peer sent bytes that break the protocol.
    #[error("NBD protocol error: {0}")]
    Protocol(#[from] ProtoError),
    /// The connection is gone.
    #[error("NBD connection closed")]
    Disconnected,
    /// A settings file or flag is invalid (`coronafs serve --config`).
    #[error("configuration: {0}")]
    Config(String),
    /// The TLS credentials (`--tls-certificates DIR`) cannot be loaded, or
    /// a TLS setting cannot be served (the message says which file or why).
    #[error("TLS: {0}")]
    Tls(String),
    /// The `--config` file cannot be read or parsed (the message names it).
    #[error(transparent)]
    ConfigFile(#[from] svc_kit::config::ConfigError),
    /// The control API's token is invalid, unreadable, or missing where the
    /// API is reachable from the network (the message says which).
    #[error("API token: {0}")]
    ApiToken(#[from] svc_kit::api_token::ApiTokenError),
    /// The replica RPC failed: a refused handshake, a bad frame, a replica
    /// that refused a volume or is gone.
    #[error("replica: {0}")]
    Replica(String),
    /// The volume map (its Raft group) failed or could not decide in time.
    #[error("volume map: {0}")]
    Map(String),
    /// An I/O error from the host.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl CoronaError {
    /// The HTTP status this error is answered with by the control API.
    pub fn http_status(&self) -> u16 {
        match self {
            CoronaError::InvalidName { .. } | CoronaError::InvalidSize { .. } | CoronaError::BadRequest(_) => 400,
            CoronaError::Config(_) | CoronaError::ConfigFile(_) | CoronaError::Tls(_) | CoronaError::ApiToken(_) => 500,
            CoronaError::AlreadyExists(_) | CoronaError::SnapshotExists(_) | CoronaError::Conflict(_) => 409,
            CoronaError::NotFound(_) | CoronaError::SnapshotNotFound(_) => 404,
            CoronaError::Io(e) if e.raw_os_error() == Some(libc::ENOSPC) => 507,
            CoronaError::TooLarge { .. } => 507,
            CoronaError::Meta(_) => 500,
            CoronaError::ReadOnly(_) => 403,
            CoronaError::DrainTimeout { .. } => 503,
            CoronaError::Api { .. }
            | CoronaError::Nbd { .. }
            | CoronaError::Negotiation(_)
            | CoronaError::Protocol(_)
            | CoronaError::Disconnected
            | CoronaError::Replica(_) => 502,
            CoronaError::Map(_) => 503,
            CoronaError::Io(_) => 500,
        }
    }
}

pub type Result<T, E = CoronaError> = std::result::Result<T, E>;

/// The message of [`CoronaError::Api`].
fn api_message(url: &str, status: &Option<u16>, message: &str) -> String {
    match status {
        Some(s) => format!("control API at {url} answered {s}: {message}"),
        None => format!("cannot reach the control API at {url}: {message}"),
    }
}
