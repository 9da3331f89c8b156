//! The control API's JSON bodies: what the server answers ([`crate::api`]),
//! what the volume manager reports and what the one typed client
//! ([`crate::api_client`]) sends and reads. They sit below all three, so the
//! client's users (the CLI, PlasmaVMC, the bench, the tests) share the
//! server's own types instead of copies.

use crate::backend::IoEngine;
use serde::{Deserialize, Serialize};

/// A volume as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size: u64,
    /// Bytes this volume's own layer holds (inherited data is not counted).
    pub allocated_bytes: u64,
    /// `VOL@SNAP` this volume was cloned from, until flattened.
    pub parent: Option<String>,
    pub snapshots: Vec<String>,
    pub connections: usize,
    pub read_only: bool,
    pub nbd_export: String,
    /// Write epoch: exports opened as `VOL;epoch=N` with a lower N cannot write.
    #[serde(default)]
    pub epoch: u64,
    /// Nodes holding the other copies of a replicated volume (empty: this node only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<String>,
    /// Those of `replicas` out of the live set (dropped after a failure, or
    /// not in sync at the primary's start) until they caught up again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stale_replicas: Vec<String>,
    /// Each replica's state, while this node has the volume open as its
    /// primary (`GET /v1/volumes/{name}` only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_states: Vec<ReplicaStatus>,
}

/// One replica of a replicated volume, as its primary sees it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// The replica's node.
    pub node: String,
    pub state: ReplicaSync,
    /// While catching up: bytes of regions the running pass has still to copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_left: Option<u64>,
    /// Out of the in-sync set since then (Unix milliseconds), as the volume
    /// map holds it: a copy that is away, failing, or being filled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_since_ms: Option<u64>,
}

/// Where a replica stands.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaSync {
    /// In the live set: it gets every write and FLUSH waits for it.
    InSync,
    /// The primary is copying the regions it lacks (resync).
    CatchingUp,
    /// Out of the live set and not being copied to now (unreachable, or
    /// waiting for the next attempt).
    Stale,
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub volume: String,
    pub name: String,
    pub size: u64,
    pub allocated_bytes: u64,
    pub clones: Vec<String>,
    pub nbd_export: String,
    /// Of a replicated volume, on its primary: the copies that lack this
    /// snapshot (they were out of the live set or failed it when it was taken).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_on: Vec<String>,
}

/// What evicting a volume from the page cache did (`POST /v1/volumes/{name}/evict`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct EvictReport {
    pub volume: String,
    /// Every file of the volume's layer chain (its head, then each parent):
    /// data files and, for layers with a parent, their maps.
    pub files: Vec<String>,
    /// Their total length in bytes (sparse files count at their full length).
    pub bytes: u64,
    /// Bytes of those files in the server's page cache before the eviction.
    pub resident_before: u64,
    /// Bytes still there after it (pages someone has mapped or locked, or
    /// read back in meanwhile by a client).
    pub resident_after: u64,
}

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    /// Volume name (see [`crate::util::validate_name`]).
    pub name: String,
    /// Size in bytes; required unless cloning (then it defaults to the snapshot's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// `VOL@SNAP` to clone from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Copies on different nodes (this one the primary) [default: 1]; more
    /// than 1 needs a server in a cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<usize>,
}

/// Body of `POST /v1/volumes/{name}/resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeVolume {
    /// New size in bytes.
    pub size: u64,
    /// Allow a size below the current one (the data past it is lost).
    #[serde(default)]
    pub allow_shrink: bool,
}

/// Body of `POST /v1/volumes/{name}/fence`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FenceVolume {
    /// The new write epoch (at least the current one).
    pub epoch: u64,
}

/// Body of `POST /v1/volumes/{name}/replace-copy`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaceCopy {
    /// The node whose copy is replaced.
    pub copy: String,
    /// The node of the new copy [default: one holding no copy, in a zone
    /// the other copies do not use if there is one].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// Body of `POST /v1/volumes/{name}/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// Snapshot name (same rules as volume names).
    pub name: String,
}

/// Query of the DELETE calls.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Force {
    /// Delete even if in use or cloned.
    #[serde(default)]
    pub force: bool,
}

/// Answer of `GET /v1/info`: what a report needs to say about the server
/// its figures came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The server's version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The data path engine in use, after any fallback from `uring`.
    pub engine: IoEngine,
    /// The data dir, as given to the server.
    pub data_dir: String,
    /// The file system and device under the data dir.
    pub fs: hostinfo::FsInfo,
    /// Whether volume files are opened with `O_DIRECT`. They are not: both
    /// engines do buffered I/O through the page cache (see `note`).
    pub o_direct: bool,
    /// How volume data reaches the disk, in words.
    pub note: String,
    /// The machine the server runs on.
    pub host: hostinfo::Host,
}

/// [`ServerInfo::note`]: the data path as the code has it.
pub const BUFFERED_NOTE: &str = "buffered: volume files are opened without O_DIRECT, so reads and writes go \
     through the server's page cache; FLUSH and FUA make writes durable with fdatasync and RWF_DSYNC";

/// The JSON error body every failing call returns.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

/// `POST /v1/cluster/nodes`: a node to make a voter of the volume map's
/// Raft group (a node of the cluster file, running).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AddNode {
    /// Its name in the cluster file.
    pub name: String,
    /// Its replica address (`host:port`), where the map's RPC reaches it.
    pub replica: String,
}

/// `GET /v1/cluster/map`: what the asked node's member of the volume map
/// knows (its view may lag the leader's by the entries not applied yet).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterMap {
    pub status: crate::replication::map::MapStatus,
    /// Every replicated volume of the cluster.
    pub volumes: std::collections::BTreeMap<String, crate::replication::map::state::VolumeState>,
}
