//! CoronaFS as PlasmaVMC uses it (docs: the volume contract in
//! docs/plasmavmc.md): its control API through CoronaFS's own typed client
//! and bodies ([`coronafs::api_client`], [`coronafs::dto`]), with
//! PlasmaVMC's error mapping, and NBD connections to its exports.

use crate::error::{PlasmaError, Result};
use coronafs::CoronaError;
use coronafs::api_client::ApiClient;
use coronafs::client::NbdClient;

pub use coronafs::dto::{SnapshotInfo, VolumeInfo};

/// The CoronaFS API at one URL plus its NBD address.
#[derive(Debug, Clone)]
pub struct Corona {
    api: ApiClient,
    pub nbd: String,
}

/// What an API call answered when it failed.
#[derive(Debug)]
pub struct CallError {
    /// The HTTP status; 0 when CoronaFS was not reached.
    pub status: u16,
    pub message: String,
}

impl From<CoronaError> for CallError {
    fn from(e: CoronaError) -> Self {
        match e {
            CoronaError::Api { status: Some(status), message, .. } => CallError { status, message },
            CoronaError::Api { url, status: None, message } => {
                CallError { status: 0, message: format!("{url} unreachable: {message}") }
            }
            other => CallError { status: 0, message: other.to_string() },
        }
    }
}

impl From<CallError> for PlasmaError {
    fn from(e: CallError) -> Self {
        PlasmaError::Volume(format!("CoronaFS answered {}: {}", e.status, e.message))
    }
}

/// A missing volume or snapshot counts as deleted.
fn gone_is_ok(r: coronafs::Result<()>) -> Result<(), CallError> {
    match r.map_err(CallError::from) {
        Err(e) if e.status == 404 => Ok(()),
        other => other,
    }
}

impl Corona {
    /// The CoronaFS at control API `api` (sending `token`) and NBD `nbd`.
    pub fn new(api: &str, nbd: &str, token: Option<svc_kit::api_token::ApiToken>) -> Self {
        Corona { api: ApiClient::new(api).with_token(token), nbd: nbd.to_owned() }
    }

    /// `POST /v1/volumes {name, size}`.
    pub async fn create(&self, name: &str, size: u64) -> Result<VolumeInfo, CallError> {
        Ok(self.api.create(name, size).await?)
    }

    /// `POST /v1/volumes {name, from_snapshot, size?}`: an O(1) clone.
    pub async fn clone_from(&self, name: &str, snapshot: &str, size: Option<u64>) -> Result<VolumeInfo, CallError> {
        Ok(self.api.clone_snapshot(name, snapshot, size).await?)
    }

    pub async fn get(&self, name: &str) -> Result<VolumeInfo, CallError> {
        Ok(self.api.get(name).await?)
    }

    /// `DELETE /v1/volumes/{name}`; a missing volume counts as deleted.
    pub async fn delete(&self, name: &str, force: bool) -> Result<(), CallError> {
        gone_is_ok(self.api.delete(name, force).await)
    }

    /// `POST /v1/volumes/{name}/fence {epoch}`: returns once no write of an
    /// older epoch is in flight.
    pub async fn fence(&self, name: &str, epoch: u64) -> Result<VolumeInfo, CallError> {
        Ok(self.api.fence(name, epoch).await?)
    }

    /// `POST /v1/volumes/{name}/snapshots {name}`.
    pub async fn snapshot(&self, volume: &str, snap: &str) -> Result<SnapshotInfo, CallError> {
        Ok(self.api.snapshot(volume, snap).await?)
    }

    pub async fn snapshots(&self, volume: &str) -> Result<Vec<SnapshotInfo>, CallError> {
        Ok(self.api.snapshots(volume).await?)
    }

    /// `DELETE /v1/volumes/{volume}/snapshots/{snap}`; a missing one counts as deleted.
    pub async fn delete_snapshot(&self, volume: &str, snap: &str, force: bool) -> Result<(), CallError> {
        gone_is_ok(self.api.delete_snapshot(volume, snap, force).await)
    }

    /// `nbd://ADDR/EXPORT`.
    pub fn nbd_uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.nbd)
    }

    /// Opens an NBD connection to an export.
    pub async fn connect(&self, export: &str) -> Result<NbdClient> {
        NbdClient::connect(self.nbd.as_str(), export).await.map_err(PlasmaError::from)
    }
}
