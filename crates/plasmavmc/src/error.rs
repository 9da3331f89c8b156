//! The crate's one error type and the one place that maps it to HTTP.

use crate::probe::ProbeError;

/// Everything PlasmaVMC can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PlasmaError {
    /// The request was malformed or asked for something impossible.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// No such resource.
    #[error("{kind} {id:?} not found")]
    NotFound { kind: &'static str, id: String },
    /// The resource is not in a state that allows this.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The artifact was refused by the prober.
    #[error("image refused: {0}")]
    Probe(#[from] ProbeError),
    /// The checksum of what arrived differs from what was announced.
    #[error("sha256 mismatch: expected {expected}, got {actual}")]
    Checksum { expected: String, actual: String },
    /// An import URL is not allowed by the configured filter.
    #[error("URL refused: {0}")]
    UrlRefused(String),
    /// The artifact's contents broke the format while being converted.
    #[error("corrupt image: {0}")]
    Corrupt(String),
    /// LightningStor failed.
    #[error("object store: {0}")]
    ObjectStore(String),
    /// CoronaFS (its API or its NBD export) failed.
    #[error("volume service: {0}")]
    Volume(String),
    /// A download from an import URL failed.
    #[error("download: {0}")]
    Download(String),
    /// A write from a VM attachment whose epoch has been superseded
    /// (CoronaFS refused it).
    #[error("fenced: VM {vm}'s attachment at epoch {held} may no longer write: {reason}")]
    Fenced { vm: String, held: u64, reason: String },
    /// A worker (agent) could not be reached or answered an error.
    #[error("worker {worker}: {message}")]
    Worker { worker: String, message: String },
    /// The metadata database failed.
    #[error("metadata store: {0}")]
    Meta(String),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// A config file cannot be read or parsed (the message names it).
    #[error(transparent)]
    ConfigFile(#[from] svc_kit::config::ConfigError),
    /// A PlasmaVMC API answered an error ([`crate::client::Client`]).
    #[error("API answered {status}: {message}")]
    Api { status: u16, message: String },
    /// A PlasmaVMC API could not be reached, its answer not read, or it did
    /// not get where it was waited for in time ([`crate::client::Client`]).
    #[error("client: {0}")]
    Client(String),
    /// Host I/O.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

impl PlasmaError {
    /// The HTTP status the API answers this error with.
    pub fn http_status(&self) -> u16 {
        match self {
            PlasmaError::Invalid(_)
            | PlasmaError::Probe(_)
            | PlasmaError::Checksum { .. }
            | PlasmaError::UrlRefused(_)
            | PlasmaError::Corrupt(_)
            | PlasmaError::Config(_)
            | PlasmaError::ConfigFile(_) => 400,
            PlasmaError::NotFound { .. } => 404,
            PlasmaError::Conflict(_) | PlasmaError::Fenced { .. } => 409,
            PlasmaError::ObjectStore(_)
            | PlasmaError::Volume(_)
            | PlasmaError::Download(_)
            | PlasmaError::Worker { .. }
            | PlasmaError::Client(_) => 502,
            // A proxy of another PlasmaVMC passes its answer on.
            PlasmaError::Api { status, .. } => *status,
            PlasmaError::Meta(_) | PlasmaError::Io(_) => 500,
        }
    }

    /// The status a PlasmaVMC API answered, for an [`PlasmaError::Api`].
    pub fn api_status(&self) -> Option<u16> {
        match self {
            PlasmaError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    pub(crate) fn not_found(kind: &'static str, id: &str) -> Self {
        PlasmaError::NotFound { kind, id: id.to_owned() }
    }
}

macro_rules! meta_from {
    ($($t:ty),*) => {$(
        impl From<$t> for PlasmaError {
            fn from(e: $t) -> Self { PlasmaError::Meta(e.to_string()) }
        }
    )*};
}
meta_from!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    serde_json::Error
);

impl From<coronafs::CoronaError> for PlasmaError {
    fn from(e: coronafs::CoronaError) -> Self {
        PlasmaError::Volume(e.to_string())
    }
}

pub type Result<T, E = PlasmaError> = std::result::Result<T, E>;
