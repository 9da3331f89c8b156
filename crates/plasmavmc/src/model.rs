//! The resources the API serves (JSON) and the database stores.

use crate::probe::DiskFormat;
use serde::{Deserialize, Serialize};

/// Lifecycle of images and volumes. Lower-case words on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Image record made, no bytes yet.
    Queued,
    /// Image bytes arriving through `PUT /v1/images/{id}/file`.
    Uploading,
    /// Image bytes being pulled from a URL or an S3 object.
    Importing,
    /// Image stored, probed and checksummed.
    Active,
    /// Volume accepted, work not started.
    Creating,
    /// Volume waiting for its image's base (artifact fetch and conversion).
    Downloading,
    /// Volume exported and usable.
    Available,
    /// Failed; see `error_reason`.
    Error,
}

/// Lifecycle of a VM. Lower-case words on the wire and in the database
/// (they were plain strings before this enum, with the same spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmStatus {
    /// Attached on its worker; the guest may be writing.
    Running,
    /// Moving to another worker (see [`crate::vms`]).
    Migrating,
    /// A migration failed past the fence, or the attachment was lost; see
    /// `error_reason`.
    Error,
}

impl std::fmt::Display for VmStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VmStatus::Running => "running",
            VmStatus::Migrating => "migrating",
            VmStatus::Error => "error",
        })
    }
}

/// A VM image: an artifact in LightningStor plus what its header says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    pub id: String,
    pub name: String,
    pub status: Status,
    /// Format found in the header (null until the upload ends).
    pub disk_format: Option<DiskFormat>,
    /// Format the client declared (null = detect).
    pub declared_format: Option<DiskFormat>,
    /// Size of the disk the guest sees.
    pub virtual_size: Option<u64>,
    /// Size of the stored artifact.
    pub size: Option<u64>,
    /// sha256 of the artifact, hex.
    pub sha256: Option<String>,
    /// sha256 the client announced, checked at the end of the upload.
    pub expected_sha256: Option<String>,
    pub bytes_done: u64,
    /// Expected artifact bytes, when known (Content-Length), else null.
    pub bytes_total: Option<u64>,
    pub error_reason: Option<String>,
    /// Unix seconds.
    pub created_at: u64,
}

/// A volume: a CoronaFS volume cloned from an image's cached base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: String,
    pub image_id: String,
    pub status: Status,
    /// Size in bytes (at least the image's virtual size).
    pub size: u64,
    /// The CoronaFS volume name.
    pub coronafs_volume: String,
    /// Where the volume is exported, `nbd://host:port/name` (null until available).
    pub nbd_uri: Option<String>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// True when the image's base was already cached (warm path).
    pub cache_hit: bool,
    pub error_reason: Option<String>,
    pub created_at: u64,
    /// Milliseconds from the request to `available`.
    pub elapsed_ms: Option<u64>,
}

/// An emulated VM: a volume attached on a worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vm {
    pub id: String,
    pub volume_id: String,
    pub worker: String,
    /// Fencing epoch: only the attachment holding this epoch may write.
    pub epoch: u64,
    pub status: VmStatus,
    pub migrations: u64,
    /// Writes acknowledged by the volume (all attachments so far).
    pub writes_acked: u64,
    /// Of those, the writes acknowledged on attachments the VM has left
    /// (migrated away from); the current one's count comes on top.
    #[serde(default)]
    pub writes_acked_earlier: u64,
    /// Blocks read back and verified on the target at the last migration.
    pub verified_blocks: u64,
    pub error_reason: Option<String>,
    /// Set when the last migration could not flush the source (it was
    /// unreachable) and verified against the last report taken instead.
    #[serde(default)]
    pub notice: Option<String>,
}

/// A cached image base: a CoronaFS volume holding the converted image and
/// its snapshot, from which volumes are cloned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub image_id: String,
    pub base_volume: String,
    pub snapshot: String,
    pub virtual_size: u64,
    /// Unix milliseconds of the last clone (LRU order).
    pub last_used_ms: u64,
}

/// Body of `POST /v1/images`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateImage {
    pub name: String,
    /// Expected sha256 (hex); a mismatch ends the upload in `error`.
    #[serde(default)]
    pub sha256: Option<String>,
    /// `raw`, `qcow2` or `auto` (default).
    #[serde(default)]
    pub disk_format: Option<String>,
    /// Import from this http(s) URL instead of waiting for an upload.
    #[serde(default)]
    pub import_url: Option<String>,
    /// Import from this S3 object (in the configured LightningStor).
    #[serde(default)]
    pub import_s3: Option<S3Source>,
}

/// An S3 object to import.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Source {
    pub bucket: String,
    pub key: String,
}

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    pub image_id: String,
    /// Bytes; defaults to the image's virtual size, may be larger.
    #[serde(default)]
    pub size: Option<u64>,
}

/// Body of `POST /v1/vms`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVm {
    pub volume_id: String,
    pub worker: String,
    /// Guest writes to issue after attaching (default 64, at most 100000).
    #[serde(default)]
    pub io_ops: Option<u64>,
}

/// Body of `POST /v1/vms/{id}/migrate`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateVm {
    pub worker: String,
}

/// Cache counters and entries (`GET /v1/cache`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bases: Vec<CacheEntry>,
}

/// Unix seconds now.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Unix milliseconds now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A fresh id: `prefix-` and 16 hex digits from the clock, the pid and a counter.
pub fn new_id(prefix: &str) -> String {
    use sha2::Digest;
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let mut h = sha2::Sha256::new();
    h.update(nanos.to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(N.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    format!("{prefix}-{}", &hex::encode(h.finalize())[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A VM record as the server stored it while `status` was a String.
    const STORED_VM: &str = r#"{"id":"vm-0123456789abcdef","volume_id":"vol-1","worker":"w1","epoch":3,"status":"migrating","migrations":1,"writes_acked":10,"writes_acked_earlier":4,"verified_blocks":2,"error_reason":null,"notice":null}"#;

    #[test]
    fn vm_records_stored_with_string_statuses_still_load_and_save_the_same() {
        let vm: Vm = serde_json::from_str(STORED_VM).expect("old record");
        assert_eq!(vm.status, VmStatus::Migrating);
        assert_eq!(serde_json::to_string(&vm).expect("encode"), STORED_VM);
        for (s, want) in
            [("running", VmStatus::Running), ("migrating", VmStatus::Migrating), ("error", VmStatus::Error)]
        {
            let v: VmStatus = serde_json::from_value(serde_json::json!(s)).expect(s);
            assert_eq!((v, v.to_string().as_str()), (want, s));
        }
        assert!(serde_json::from_value::<VmStatus>(serde_json::json!("Running")).is_err());
    }

    #[test]
    fn a_vm_record_without_the_later_fields_loads_with_defaults() {
        let old = r#"{"id":"vm-1","volume_id":"vol-1","worker":"w1","epoch":1,"status":"running","migrations":0,"writes_acked":0,"verified_blocks":0,"error_reason":null}"#;
        let vm: Vm = serde_json::from_str(old).expect("old record");
        assert_eq!((vm.status, vm.writes_acked_earlier, vm.notice), (VmStatus::Running, 0, None));
    }
}
