//! The typed client of the control API, built on the server's own bodies
//! ([`crate::dto`]): what the `coronafs` CLI, PlasmaVMC, the bench and the
//! tests use. One method per route; failures are [`CoronaError::Api`] with
//! the HTTP status (none when the server was not reached) and the server's
//! `{"error"}` message.

use crate::dto::{
    ApiError, CreateSnapshot, CreateVolume, EvictReport, FenceVolume, ReplaceCopy, ResizeVolume, ServerInfo,
    SnapshotInfo, VolumeInfo,
};
use crate::error::{CoronaError, Result};
use serde::de::DeserializeOwned;
use svc_kit::api_token::ApiToken;

/// The control API of one server.
#[derive(Debug, Clone)]
pub struct ApiClient {
    http: reqwest::Client,
    base: String,
    token: Option<ApiToken>,
}

impl ApiClient {
    /// A client of the API at `base` (`http://host:7070`).
    pub fn new(base: &str) -> Self {
        ApiClient { http: reqwest::Client::new(), base: base.trim_end_matches('/').to_owned(), token: None }
    }

    /// The same client sending `Authorization: Bearer TOKEN` on every call
    /// (none with `None`): what a server started with an API token needs.
    pub fn with_token(mut self, token: Option<ApiToken>) -> Self {
        self.token = token;
        self
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET /v1/info`: version, engine in use, data dir and its file
    /// system, whether O_DIRECT is used, host.
    pub async fn info(&self) -> Result<ServerInfo> {
        self.call(self.http.get(self.url("/v1/info"))).await
    }

    /// `GET /v1/volumes`: every volume, sorted by name.
    pub async fn list(&self) -> Result<Vec<VolumeInfo>> {
        self.call(self.http.get(self.url("/v1/volumes"))).await
    }

    /// `POST /v1/volumes {name, size, from_snapshot}` as given.
    pub async fn create_volume(&self, body: &CreateVolume) -> Result<VolumeInfo> {
        self.call(self.http.post(self.url("/v1/volumes")).json(body)).await
    }

    /// `POST /v1/volumes {name, size}`: an empty thin volume.
    pub async fn create(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.create_volume(&CreateVolume {
            name: name.to_owned(),
            size: Some(size),
            from_snapshot: None,
            replicas: None,
        })
        .await
    }

    /// `POST /v1/volumes {name, from_snapshot, size?}`: an O(1) clone of
    /// `VOL@SNAP` (the snapshot's size unless `size` is given).
    pub async fn clone_snapshot(&self, name: &str, snapshot: &str, size: Option<u64>) -> Result<VolumeInfo> {
        self.create_volume(&CreateVolume {
            name: name.to_owned(),
            size,
            from_snapshot: Some(snapshot.to_owned()),
            replicas: None,
        })
        .await
    }

    /// `GET /v1/cluster/map`: the volume map as the node asked has it.
    pub async fn cluster_map(&self) -> Result<crate::dto::ClusterMap> {
        self.call(self.http.get(self.url("/v1/cluster/map"))).await
    }

    /// `POST /v1/cluster/nodes`: makes the running node `name`, whose
    /// replica address is `replica`, a voter of the volume map's group.
    pub async fn add_node(&self, name: &str, replica: &str) -> Result<crate::dto::ClusterMap> {
        let body = crate::dto::AddNode { name: name.to_owned(), replica: replica.to_owned() };
        self.call(self.http.post(self.url("/v1/cluster/nodes")).json(&body)).await
    }

    /// `DELETE /v1/cluster/nodes/{name}`: takes `name` out of the group.
    pub async fn remove_node(&self, name: &str) -> Result<crate::dto::ClusterMap> {
        self.call(self.http.delete(self.url(&format!("/v1/cluster/nodes/{name}")))).await
    }

    /// `GET /v1/volumes/{name}`.
    pub async fn get(&self, name: &str) -> Result<VolumeInfo> {
        self.call(self.http.get(self.url(&format!("/v1/volumes/{name}")))).await
    }

    /// `DELETE /v1/volumes/{name}?force=`: with `force`, even in use or cloned.
    pub async fn delete(&self, name: &str, force: bool) -> Result<()> {
        self.call_empty(self.http.delete(self.url(&format!("/v1/volumes/{name}?force={force}")))).await
    }

    /// `POST /v1/volumes/{name}/resize {size, allow_shrink}`.
    pub async fn resize(&self, name: &str, size: u64, allow_shrink: bool) -> Result<VolumeInfo> {
        let body = ResizeVolume { size, allow_shrink };
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/resize"))).json(&body)).await
    }

    /// `POST /v1/volumes/{name}/flatten`: copies the inherited data in and
    /// detaches the clone from its snapshot.
    pub async fn flatten(&self, name: &str) -> Result<VolumeInfo> {
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/flatten")))).await
    }

    /// `POST /v1/volumes/{name}/fence {epoch}`: returns once no write of an
    /// older epoch is in flight.
    /// `POST /v1/volumes/{name}/replace-copy`, on the volume's primary:
    /// the copy on `copy` is replaced by a new one on `to` (or a node the
    /// server picks), filled in the background.
    pub async fn replace_copy(&self, name: &str, copy: &str, to: Option<&str>) -> Result<VolumeInfo> {
        let body = ReplaceCopy { copy: copy.to_owned(), to: to.map(str::to_owned) };
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/replace-copy"))).json(&body)).await
    }

    pub async fn fence(&self, name: &str, epoch: u64) -> Result<VolumeInfo> {
        let body = FenceVolume { epoch };
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/fence"))).json(&body)).await
    }

    /// `POST /v1/volumes/{name}/promote`: the node asked holds a copy of a
    /// replicated volume and becomes its primary, if the volume map grants it.
    pub async fn promote(&self, name: &str) -> Result<VolumeInfo> {
        self.call(self.http.post(self.url(&format!("/v1/volumes/{name}/promote")))).await
    }

    /// `POST /v1/volumes/{name}/evict`: syncs the volume's files and drops
    /// them from the server's page cache; says how much was resident.
    pub async fn evict(&self, volume: &str) -> Result<EvictReport> {
        self.call(self.http.post(self.url(&format!("/v1/volumes/{volume}/evict")))).await
    }

    /// `GET /v1/volumes/{volume}/snapshots`, sorted by name.
    pub async fn snapshots(&self, volume: &str) -> Result<Vec<SnapshotInfo>> {
        self.call(self.http.get(self.url(&format!("/v1/volumes/{volume}/snapshots")))).await
    }

    /// `POST /v1/volumes/{volume}/snapshots {name}`: snapshot `VOL@SNAP`.
    pub async fn snapshot(&self, volume: &str, snap: &str) -> Result<SnapshotInfo> {
        let body = CreateSnapshot { name: snap.to_owned() };
        self.call(self.http.post(self.url(&format!("/v1/volumes/{volume}/snapshots"))).json(&body)).await
    }

    /// `DELETE /v1/volumes/{volume}/snapshots/{snap}?force=`: with `force`,
    /// even if it has clones.
    pub async fn delete_snapshot(&self, volume: &str, snap: &str, force: bool) -> Result<()> {
        self.call_empty(self.http.delete(self.url(&format!("/v1/volumes/{volume}/snapshots/{snap}?force={force}"))))
            .await
    }

    fn error(&self, status: Option<u16>, message: String) -> CoronaError {
        CoronaError::Api { url: self.base.clone(), status, message }
    }

    /// Sends `req`; the body of a 2xx answer, or the error it carries.
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<(u16, Vec<u8>)> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t.expose()),
            None => req,
        };
        let resp = req.send().await.map_err(|e| self.error(None, e.to_string()))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| self.error(Some(status.as_u16()), e.to_string()))?;
        if !status.is_success() {
            let message = serde_json::from_slice::<ApiError>(&body)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            return Err(self.error(Some(status.as_u16()), message));
        }
        Ok((status.as_u16(), body.to_vec()))
    }

    async fn call<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<T> {
        let (status, body) = self.send(req).await?;
        serde_json::from_slice(&body).map_err(|e| self.error(Some(status), format!("unexpected answer: {e}")))
    }

    /// A call answered with no body (204).
    async fn call_empty(&self, req: reqwest::RequestBuilder) -> Result<()> {
        self.send(req).await.map(drop)
    }
}
