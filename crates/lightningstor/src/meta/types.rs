//! The rows stored in the metadata tables (serialized with postcard).
//!
//! Field order matters: [`ObjectSummary`] is a prefix of [`ObjectMeta`], so a
//! listing decodes only the summary and never the block list.

use crate::block::BlockHash;
use crate::checksum::{Checksum, ChecksumAlgo};
use crate::lifecycle::Lifecycle;
use serde::{Deserialize, Serialize};

/// A bucket row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketMeta {
    /// Creation time, Unix milliseconds.
    pub created_ms: i64,
    /// The lifecycle configuration, if one was ever put (an empty one after
    /// a delete). Rows of builds before lifecycle end before it: `None`.
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub lifecycle: Option<Lifecycle>,
    /// The versioning state: `None` for a bucket that never had versioning
    /// (rows of builds before versioning end before it).
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub versioning: Option<Versioning>,
    /// In a cluster: the HLC version of the last versioning change, so a
    /// replica takes only a newer one (`None` on a single node, and in rows
    /// of builds before cluster versioning).
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub versioning_at: Option<u64>,
}

/// A bucket's versioning state once it was ever set (S3 never turns it off).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Versioning {
    /// Every write makes a new version with its own id.
    Enabled,
    /// Writes make (and replace) the `null` version; older versions stay.
    Suspended,
}

impl BucketMeta {
    /// A new bucket's row.
    pub fn new(created_ms: i64) -> Self {
        BucketMeta { created_ms, lifecycle: None, versioning: None, versioning_at: None }
    }

    /// The lifecycle rules in force (none when none were put or they were deleted).
    pub fn rules(&self) -> &[crate::lifecycle::Rule] {
        self.lifecycle.as_ref().map_or(&[], |l| &l.rules)
    }
}

/// A block of an object or part: its hash and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRef {
    /// Content hash.
    pub hash: BlockHash,
    /// Length in bytes.
    pub len: u32,
}

/// A key's row as anti-entropy compares it: (bucket, key, version, tombstone).
pub type VersionRow = (String, Vec<u8>, u64, bool);

/// Where an object's bytes are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ObjectData {
    /// Small objects: the bytes themselves (as one byte string: postcard
    /// encodes it exactly as it did a `Vec<u8>`, without a call per byte).
    Inline(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Larger objects: blocks in order.
    Blocks(Vec<BlockRef>),
}

impl ObjectData {
    /// The blocks referenced (none for inline data).
    pub fn blocks(&self) -> &[BlockRef] {
        match self {
            ObjectData::Inline(_) => &[],
            ObjectData::Blocks(b) => b,
        }
    }
}

/// Standard headers and user metadata stored with an object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectHeaders {
    /// Content-Type.
    pub content_type: Option<String>,
    /// Content-Encoding.
    pub content_encoding: Option<String>,
    /// Content-Disposition.
    pub content_disposition: Option<String>,
    /// Content-Language.
    pub content_language: Option<String>,
    /// Cache-Control.
    pub cache_control: Option<String>,
    /// Expires, Unix seconds.
    pub expires: Option<i64>,
    /// x-amz-meta-* pairs, sorted by name.
    pub user: Vec<(String, String)>,
}

/// The first fields of every [`ObjectMeta`], enough for a listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectSummary {
    /// Row version: unique and increasing per node (replication will order by it).
    pub version: u64,
    /// Size in bytes.
    pub size: u64,
    /// ETag without quotes.
    pub etag: String,
    /// Last modification, Unix milliseconds.
    pub last_modified_ms: i64,
}

/// An object row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    /// Row version: unique and increasing per node.
    pub version: u64,
    /// Size in bytes.
    pub size: u64,
    /// ETag without quotes.
    pub etag: String,
    /// Last modification, Unix milliseconds.
    pub last_modified_ms: i64,
    /// Standard headers and user metadata.
    pub headers: ObjectHeaders,
    /// Full-object or composite checksum, if one was given or asked for.
    pub checksum: Option<Checksum>,
    /// Part sizes for a multipart object (empty otherwise).
    pub parts: Vec<u64>,
    /// The bytes.
    pub data: ObjectData,
    /// SSE-C: the data is encrypted under the customer's key (see [`crate::sse`]).
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub sse_c: Option<SseC>,
    /// In a bucket with versioning: which version this row is (its id is
    /// derived from `version`, or `null`). `None` in a bucket that never had
    /// versioning, whose answers carry no version id.
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub versioned: Option<Versioned>,
}

/// Which version of its key a row of a versioned bucket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Versioned {
    /// A version with its own id ([`crate::versioning::VersionRef::Id`] of the row's version).
    Id,
    /// The `null` version (written while versioning was suspended, or held
    /// by the bucket before versioning was enabled).
    Null,
    /// In a cluster: a key's current row that is a copy of an older version
    /// (row version `id`, or the `null` version), made current again at a
    /// new row version when the versions above it were deleted for good
    /// (rows only grow in version there). It answers that version's id.
    Restored { id: u64, null: bool },
}

/// One version of a key in a versioned bucket: an object or a delete marker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Version {
    /// An object version (its `versioned` is set).
    Object(ObjectMeta),
    /// A delete marker.
    Marker(DeleteMarker),
}

/// A delete marker: what a DELETE without a version id leaves in a versioned bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteMarker {
    /// Row version (its id, unless `null`).
    pub version: u64,
    /// When the delete happened, Unix milliseconds.
    pub last_modified_ms: i64,
    /// Whether it is the `null` version (made while versioning was suspended).
    pub null: bool,
}

impl Version {
    /// The row version.
    pub fn version(&self) -> u64 {
        match self {
            Version::Object(m) => m.version,
            Version::Marker(d) => d.version,
        }
    }

    /// Whether this is the key's `null` version.
    pub fn is_null(&self) -> bool {
        match self {
            Version::Object(m) => m.versioned == Some(Versioned::Null),
            Version::Marker(d) => d.null,
        }
    }

    /// The version id answered to clients.
    pub fn id(&self) -> String {
        crate::versioning::version_id(self.version(), self.is_null())
    }
}

/// Rows written before SSE-C existed end before `sse_c`: postcard finds no
/// byte left for it, which means none. (A stored row is one whole value, so
/// the end of the input is the end of the row.)
fn none_past_the_end<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    Ok(Option::<T>::deserialize(d).ok().flatten())
}

/// What an SSE-C object keeps about its encryption (never the key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SseC {
    /// MD5 of the customer's key: a request's key must hash to it.
    pub key_md5: [u8; 16],
    /// The CTR mode's initial counter block, random per object (for a
    /// multipart object: its first part's).
    pub iv: [u8; 16],
    /// A multipart object: each part's own random initial counter block,
    /// in part order (each part is a CTR stream of its own, see
    /// [`crate::sse`]). Empty otherwise: one stream from `iv`. Rows of
    /// builds before SSE-C multipart end before it.
    #[serde(default, deserialize_with = "empty_past_the_end")]
    pub part_ivs: Vec<[u8; 16]>,
}

/// Like [`none_past_the_end`], for a list: no byte left means empty.
fn empty_past_the_end<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Vec::<T>::deserialize(d).unwrap_or_default())
}

impl ObjectMeta {
    /// The version id answered to clients (`None` outside versioned buckets).
    pub fn version_id(&self) -> Option<String> {
        self.versioned.map(|v| match v {
            Versioned::Id => crate::versioning::version_id(self.version, false),
            Versioned::Null => crate::versioning::version_id(self.version, true),
            Versioned::Restored { id, null } => crate::versioning::version_id(id, null),
        })
    }

    /// Whether this object is its key's `null` version.
    pub fn is_null_version(&self) -> bool {
        matches!(self.versioned, Some(Versioned::Null | Versioned::Restored { null: true, .. }))
    }

    /// Last modification in Unix seconds (the resolution of HTTP dates).
    pub fn last_modified_secs(&self) -> i64 {
        self.last_modified_ms.div_euclid(1000)
    }
}

/// A replicated object row: the object, or the tombstone of its deletion.
/// Replicas keep whichever of two rows has the higher version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Row {
    /// The object as written.
    Object(ObjectMeta),
    /// Deleted at this version.
    Tombstone(u64),
}

impl Row {
    /// The row's version.
    pub fn version(&self) -> u64 {
        match self {
            Row::Object(m) => m.version,
            Row::Tombstone(v) => *v,
        }
    }

    /// The same row at another version.
    #[must_use]
    pub fn with_version(self, version: u64) -> Row {
        match self {
            Row::Object(m) => Row::Object(ObjectMeta { version, ..m }),
            Row::Tombstone(_) => Row::Tombstone(version),
        }
    }
}

/// One raw listing entry of a replica: an object's summary or a tombstone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawEntry {
    /// Row version.
    pub version: u64,
    /// The summary; `None` for a tombstone.
    pub summary: Option<ObjectSummary>,
}

/// A multipart upload in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadMeta {
    /// Destination bucket.
    pub bucket: String,
    /// Destination key.
    pub key: String,
    /// Creation time, Unix milliseconds.
    pub initiated_ms: i64,
    /// Headers the object will get.
    pub headers: ObjectHeaders,
    /// Checksum algorithm asked for at creation.
    pub checksum_algo: Option<ChecksumAlgo>,
    /// The object gets a FULL_OBJECT checksum (a CRC of the whole object,
    /// combined from the parts' CRCs) instead of a COMPOSITE one.
    #[serde(default, deserialize_with = "false_past_the_end")]
    pub full_object: bool,
    /// SSE-C: the MD5 of the customer key given at creation; every part
    /// must come with that key and is encrypted under it.
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub sse_c_key_md5: Option<[u8; 16]>,
}

/// Upload rows written before FULL_OBJECT checksums end before
/// `full_object`: like [`none_past_the_end`], no byte left means false.
fn false_past_the_end<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(bool::deserialize(d).unwrap_or(false))
}

/// An uploaded part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartMeta {
    /// Size in bytes.
    pub size: u64,
    /// MD5 of the part as stored (its ETag; of the ciphertext under SSE-C).
    pub md5: [u8; 16],
    /// Checksum given or computed for the part (of the plaintext).
    pub checksum: Option<Checksum>,
    /// Upload time, Unix milliseconds.
    pub last_modified_ms: i64,
    /// The part's blocks.
    pub blocks: Vec<BlockRef>,
    /// SSE-C: the part's own random initial counter block (its key is the
    /// upload's). Rows of builds before SSE-C multipart end before it.
    #[serde(default, deserialize_with = "none_past_the_end")]
    pub sse_iv: Option<[u8; 16]>,
}

impl PartMeta {
    /// The part's ETag (hex MD5, unquoted).
    pub fn etag(&self) -> String {
        hex::encode(self.md5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_decodes_from_the_front_of_an_object_row() {
        let meta = ObjectMeta {
            version: 7,
            size: 3,
            etag: "abc".into(),
            last_modified_ms: 1234,
            headers: ObjectHeaders { user: vec![("a".into(), "b".into())], ..Default::default() },
            checksum: None,
            parts: vec![],
            data: ObjectData::Inline(b"xyz".to_vec()),
            sse_c: None,
            versioned: None,
        };
        let bytes = postcard::to_allocvec(&meta).expect("encode");
        // A row of a build before versioning (no `versioned` byte), and
        // before SSE-C (no `sse_c` byte either) decodes as plain.
        let old: ObjectMeta = postcard::from_bytes(&bytes[..bytes.len() - 1]).expect("decode an old row");
        assert_eq!(old, meta);
        let old: ObjectMeta = postcard::from_bytes(&bytes[..bytes.len() - 2]).expect("decode an older row");
        assert_eq!(old, meta);
        let tagged = ObjectMeta { versioned: Some(Versioned::Null), ..meta.clone() };
        let back: ObjectMeta = postcard::from_bytes(&postcard::to_allocvec(&tagged).expect("encode")).expect("decode");
        assert_eq!(back, tagged);
        assert_eq!(back.version_id().as_deref(), Some("null"));
        assert_eq!(meta.version_id(), None);
        let sealed =
            ObjectMeta { sse_c: Some(SseC { key_md5: [1; 16], iv: [2; 16], part_ivs: vec![] }), ..meta.clone() };
        let bytes = postcard::to_allocvec(&sealed).expect("encode");
        let back: ObjectMeta = postcard::from_bytes(&bytes).expect("decode");
        assert_eq!(back, sealed);
        // An SSE-C row of a build before SSE-C multipart (no `part_ivs` byte).
        let old: ObjectMeta = postcard::from_bytes(&bytes[..bytes.len() - 2]).expect("decode an old SSE-C row");
        assert_eq!(old, sealed);
        let parts = ObjectMeta {
            sse_c: Some(SseC { key_md5: [1; 16], iv: [2; 16], part_ivs: vec![[2; 16], [3; 16]] }),
            ..meta.clone()
        };
        let back: ObjectMeta = postcard::from_bytes(&postcard::to_allocvec(&parts).expect("encode")).expect("decode");
        assert_eq!(back, parts);
        let bytes = postcard::to_allocvec(&meta).expect("encode");
        let (s, _) = postcard::take_from_bytes::<ObjectSummary>(&bytes).expect("decode");
        assert_eq!(s.version, 7);
        assert_eq!(s.etag, "abc");
        assert_eq!(s.last_modified_ms, 1234);
        let back: ObjectMeta = postcard::from_bytes(&bytes).expect("decode");
        assert_eq!(back, meta);
    }

    #[test]
    fn a_bucket_row_of_a_build_before_lifecycle_decodes_without_rules() {
        #[derive(Serialize)]
        struct OldBucketMeta {
            created_ms: i64,
        }
        let old = postcard::to_allocvec(&OldBucketMeta { created_ms: 42 }).expect("encode");
        let back: BucketMeta = postcard::from_bytes(&old).expect("decode an old row");
        assert_eq!(back, BucketMeta::new(42));
        assert!(back.rules().is_empty());
        let rule = crate::lifecycle::Rule {
            id: "r".into(),
            enabled: true,
            scope: crate::lifecycle::Scope::All,
            expiration_days: Some(1),
            abort_days: None,
        };
        let with = BucketMeta {
            created_ms: 42,
            lifecycle: Some(Lifecycle { version: 3, rules: vec![rule] }),
            versioning: None,
            versioning_at: None,
        };
        let back: BucketMeta = postcard::from_bytes(&postcard::to_allocvec(&with).expect("encode")).expect("decode");
        assert_eq!(back, with);
        assert_eq!(back.rules().len(), 1);
    }

    #[test]
    fn an_upload_row_of_a_build_before_full_object_checksums_decodes_as_composite() {
        let up = UploadMeta {
            bucket: "b".into(),
            key: "k".into(),
            initiated_ms: 5,
            headers: ObjectHeaders::default(),
            checksum_algo: Some(ChecksumAlgo::Crc32),
            full_object: true,
            sse_c_key_md5: None,
        };
        let bytes = postcard::to_allocvec(&up).expect("encode");
        let back: UploadMeta = postcard::from_bytes(&bytes).expect("decode");
        assert_eq!(back, up);
        // Rows of builds before SSE-C multipart (no `sse_c_key_md5` byte),
        // and before FULL_OBJECT (neither).
        let old: UploadMeta = postcard::from_bytes(&bytes[..bytes.len() - 1]).expect("decode an old row");
        assert_eq!(old, up);
        let old: UploadMeta = postcard::from_bytes(&bytes[..bytes.len() - 2]).expect("decode an older row");
        assert_eq!(old, UploadMeta { full_object: false, ..up.clone() });
        let sealed = UploadMeta { sse_c_key_md5: Some([9; 16]), ..up };
        let back: UploadMeta = postcard::from_bytes(&postcard::to_allocvec(&sealed).expect("encode")).expect("decode");
        assert_eq!(back, sealed);
    }
}
