//! A small typed client of the CoronaFS control API (docs: the volume
//! contract in docs/plasmavmc.md) and NBD connections to its exports.

use crate::error::{PlasmaError, Result};
use coronafs::client::NbdClient;
use serde::{Deserialize, Serialize};

/// A CoronaFS volume as its API reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeInfo {
    pub name: String,
    pub size: u64,
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default)]
    pub snapshots: Vec<String>,
    #[serde(default)]
    pub connections: usize,
    /// Write epoch (CoronaFS fencing).
    #[serde(default)]
    pub epoch: u64,
}

/// A snapshot as CoronaFS reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub volume: String,
    pub name: String,
    pub size: u64,
    #[serde(default)]
    pub clones: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: String,
}

/// The CoronaFS API at one URL plus its NBD address.
#[derive(Debug, Clone)]
pub struct Corona {
    http: reqwest::Client,
    api: String,
    pub nbd: String,
}

/// What an API call answered when it failed.
#[derive(Debug)]
pub struct CallError {
    pub status: u16,
    pub message: String,
}

impl From<CallError> for PlasmaError {
    fn from(e: CallError) -> Self {
        PlasmaError::Volume(format!("CoronaFS answered {}: {}", e.status, e.message))
    }
}

impl Corona {
    pub fn new(api: &str, nbd: &str) -> Self {
        Corona { http: reqwest::Client::new(), api: api.trim_end_matches('/').to_owned(), nbd: nbd.to_owned() }
    }

    async fn call<T: for<'de> Deserialize<'de>>(&self, req: reqwest::RequestBuilder) -> Result<Option<T>, CallError> {
        let resp =
            req.send().await.map_err(|e| CallError { status: 0, message: format!("{} unreachable: {e}", self.api) })?;
        let status = resp.status().as_u16();
        if status == 204 {
            return Ok(None);
        }
        let text = resp.text().await.map_err(|e| CallError { status, message: e.to_string() })?;
        if !(200..300).contains(&status) {
            let message = serde_json::from_str::<ErrorBody>(&text).map(|b| b.error).unwrap_or(text);
            return Err(CallError { status, message });
        }
        serde_json::from_str(&text).map(Some).map_err(|e| CallError { status, message: format!("bad JSON: {e}") })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.api)
    }

    /// `POST /v1/volumes {name, size}`.
    pub async fn create(&self, name: &str, size: u64) -> Result<VolumeInfo, CallError> {
        let body = serde_json::json!({ "name": name, "size": size });
        self.call(self.http.post(self.url("/v1/volumes")).json(&body)).await.map(Option::unwrap_or_default_info)
    }

    /// `POST /v1/volumes {name, from_snapshot, size?}`: an O(1) clone.
    pub async fn clone_from(&self, name: &str, snapshot: &str, size: Option<u64>) -> Result<VolumeInfo, CallError> {
        let mut body = serde_json::json!({ "name": name, "from_snapshot": snapshot });
        if let Some(s) = size {
            body["size"] = s.into();
        }
        self.call(self.http.post(self.url("/v1/volumes")).json(&body)).await.map(Option::unwrap_or_default_info)
    }

    pub async fn get(&self, name: &str) -> Result<VolumeInfo, CallError> {
        self.call(self.http.get(self.url(&format!("/v1/volumes/{name}")))).await.map(Option::unwrap_or_default_info)
    }

    /// `DELETE /v1/volumes/{name}`; a missing volume counts as deleted.
    pub async fn delete(&self, name: &str, force: bool) -> Result<(), CallError> {
        let q = if force { "?force=true" } else { "" };
        match self.call::<serde_json::Value>(self.http.delete(self.url(&format!("/v1/volumes/{name}{q}")))).await {
            Ok(_) => Ok(()),
            Err(e) if e.status == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `POST /v1/volumes/{name}/fence {epoch}`: returns once no write of an
    /// older epoch is in flight.
    pub async fn fence(&self, name: &str, epoch: u64) -> Result<VolumeInfo, CallError> {
        let body = serde_json::json!({ "epoch": epoch });
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/fence"))).json(&body))
            .await
            .map(Option::unwrap_or_default_info)
    }

    /// `POST /v1/volumes/{name}/snapshots {name}`.
    pub async fn snapshot(&self, volume: &str, snap: &str) -> Result<SnapshotInfo, CallError> {
        let body = serde_json::json!({ "name": snap });
        let r = self.call(self.http.post(self.url(&format!("/v1/volumes/{volume}/snapshots"))).json(&body)).await?;
        r.ok_or(CallError { status: 204, message: "empty snapshot reply".into() })
    }

    pub async fn snapshots(&self, volume: &str) -> Result<Vec<SnapshotInfo>, CallError> {
        self.call(self.http.get(self.url(&format!("/v1/volumes/{volume}/snapshots"))))
            .await
            .map(Option::unwrap_or_default)
    }

    /// `DELETE /v1/volumes/{volume}/snapshots/{snap}`; a missing one counts as deleted.
    pub async fn delete_snapshot(&self, volume: &str, snap: &str, force: bool) -> Result<(), CallError> {
        let q = if force { "?force=true" } else { "" };
        match self
            .call::<serde_json::Value>(self.http.delete(self.url(&format!("/v1/volumes/{volume}/snapshots/{snap}{q}"))))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.status == 404 => Ok(()),
            Err(e) => Err(e),
        }
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

trait UnwrapInfo {
    fn unwrap_or_default_info(self) -> VolumeInfo;
}

impl UnwrapInfo for Option<VolumeInfo> {
    fn unwrap_or_default_info(self) -> VolumeInfo {
        self.unwrap_or(VolumeInfo {
            name: String::new(),
            size: 0,
            parent: None,
            snapshots: vec![],
            connections: 0,
            epoch: 0,
        })
    }
}
