//! Write-transaction bodies: each checks everything it can fail on before it
//! changes a table (see the module docs of [`crate::meta`]), keeps block
//! reference counts exact, and returns the blocks whose count reached zero
//! so the caller can delete them after the commit.

use super::merkle::{self, TreeEntry};
use super::types::ObjectSummary;
use super::types::{BlockRef, BucketMeta, ObjectData, ObjectMeta, PartMeta, Row, UploadMeta};
use super::types::{Version, Versioned};
use super::versions;
use super::{
    BUCKETS, BUCKETS_GONE, GRANTS, KEYS, OBJECTS, PARTS, REFS, TOMBSTONES, Txn, UPLOAD_INDEX, UPLOADS, UPLOADS_GONE,
};
use crate::block::BlockHash;
use crate::checksum::Checksum;
use crate::conditions;
use crate::conditions::DeleteConditions;
use crate::error::{LightningError, Result};
use crate::lifecycle::Lifecycle;
use crate::versioning::VersionRef;
use md5::Digest as _;
use redb::{ReadableTable, WriteTransaction};
use s3s::dto::ETagCondition;

/// S3's minimum size of every part but the last.
pub const MIN_PART_SIZE: u64 = 5 * 1024 * 1024;

/// Conditions a write is subject to (If-Match / If-None-Match).
#[derive(Debug, Clone, Default)]
pub struct WriteConditions {
    /// If-Match.
    pub if_match: Option<ETagCondition>,
    /// If-None-Match.
    pub if_none_match: Option<ETagCondition>,
}

pub(super) fn require_bucket(txn: &WriteTransaction, bucket: &str) -> Result<()> {
    if txn.open_table(BUCKETS)?.get(bucket)?.is_none() {
        return Err(LightningError::NoSuchBucket(bucket.to_owned()));
    }
    Ok(())
}

pub(super) fn incref(txn: &WriteTransaction, blocks: &[BlockRef]) -> Result<()> {
    let mut refs = txn.open_table(REFS)?;
    for b in blocks {
        let n = refs.get(b.hash.0.as_slice())?.map(|v| v.value()).unwrap_or(0);
        refs.insert(b.hash.0.as_slice(), n + 1)?;
    }
    Ok(())
}

pub(super) fn decref(txn: &WriteTransaction, blocks: &[BlockRef], freed: &mut Vec<BlockHash>) -> Result<()> {
    let mut refs = txn.open_table(REFS)?;
    for b in blocks {
        let n = refs.get(b.hash.0.as_slice())?.map(|v| v.value()).unwrap_or(0);
        if n <= 1 {
            refs.remove(b.hash.0.as_slice())?;
            freed.push(b.hash);
        } else {
            refs.insert(b.hash.0.as_slice(), n - 1)?;
        }
    }
    Ok(())
}

/// Keeps the hash tree (when the store has one) in step with a change of
/// the key's object or tombstone: `object` and `tomb` are the versions the
/// key holds after it, `None` meaning "read it from the table" for the one
/// the change did not touch. Must run with neither table open.
fn retree(txn: &Txn<'_>, bucket: &str, key: &[u8], object: Known, tomb: Known) -> Result<()> {
    let Some(partitions) = txn.tree() else { return Ok(()) };
    let object = match object {
        Known::Is(v) => v,
        Known::Read => match txn.open_table(OBJECTS)?.get((bucket, key))? {
            Some(v) => Some(postcard::take_from_bytes::<ObjectSummary>(v.value())?.0.version),
            None => None,
        },
    };
    let tomb = match tomb {
        Known::Is(v) => v,
        Known::Read => txn.open_table(TOMBSTONES)?.get((bucket, key))?.map(|v| v.value()),
    };
    merkle::set(txn, partitions, bucket, key, TreeEntry::of(object, tomb))
}

/// What a writer knows of one of a key's versions after its change.
enum Known {
    /// This version (`None`: no row).
    Is(Option<u64>),
    /// Unchanged: read it.
    Read,
}

/// Stores each key and grant row that is newer than the one it replaces.
pub fn merge_auth(txn: &WriteTransaction, rows: &[crate::keys::AuthRow]) -> Result<()> {
    use crate::keys::{AuthRow, GrantRow, KeyRow, newer};
    let mut keys = txn.open_table(KEYS)?;
    let mut grants = txn.open_table(GRANTS)?;
    for r in rows {
        match r {
            AuthRow::Key { id, row } => {
                let old: Option<KeyRow> = match keys.get(id.as_str())? {
                    Some(v) => Some(postcard::from_bytes(v.value())?),
                    None => None,
                };
                if newer(row.version, old.map(|o| o.version)) {
                    keys.insert(id.as_str(), postcard::to_allocvec(row)?.as_slice())?;
                }
            }
            AuthRow::Grant { bucket, id, row } => {
                let old: Option<GrantRow> = match grants.get((bucket.as_str(), id.as_str()))? {
                    Some(v) => Some(postcard::from_bytes(v.value())?),
                    None => None,
                };
                if newer(row.version, old.map(|o| o.version)) {
                    grants.insert((bucket.as_str(), id.as_str()), postcard::to_allocvec(row)?.as_slice())?;
                }
            }
        }
    }
    Ok(())
}

/// Creates a bucket.
pub fn create_bucket(txn: &WriteTransaction, name: &str, now_ms: i64) -> Result<()> {
    let mut t = txn.open_table(BUCKETS)?;
    if t.get(name)?.is_some() {
        return Err(LightningError::BucketAlreadyExists(name.to_owned()));
    }
    let row = postcard::to_allocvec(&BucketMeta::new(now_ms))?;
    t.insert(name, row.as_slice())?;
    Ok(())
}

/// Deletes a bucket that holds no object, with its multipart uploads in progress.
pub fn delete_bucket(txn: &WriteTransaction, name: &str) -> Result<Vec<BlockHash>> {
    require_bucket(txn, name)?;
    let objects = txn.open_table(OBJECTS)?;
    let has_object = match objects.range((name, &b""[..])..)?.next() {
        Some(row) => row?.0.value().0 == name,
        None => false,
    };
    if has_object || versions::any_in(txn, name)? {
        return Err(LightningError::BucketNotEmpty(name.to_owned()));
    }
    // As S3 does: multipart uploads in progress do not keep a bucket alive;
    // they go with it.
    let mut freed = Vec::new();
    for id in uploads_in(txn, name)? {
        freed.extend(drop_upload(txn, &id, name, super::now_ms())?);
    }
    txn.open_table(BUCKETS)?.remove(name)?;
    Ok(freed)
}

/// The ids of the multipart uploads in progress in `bucket`.
fn uploads_in(txn: &WriteTransaction, bucket: &str) -> Result<Vec<String>> {
    let index = txn.open_table(UPLOAD_INDEX)?;
    let mut ids = Vec::new();
    for row in index.range((bucket, &b""[..], "")..)? {
        let (k, _) = row?;
        let (b, _, id) = k.value();
        if b != bucket {
            break;
        }
        ids.push(id.to_owned());
    }
    Ok(ids)
}

pub(super) fn existing_object(txn: &WriteTransaction, bucket: &str, key: &str) -> Result<Option<ObjectMeta>> {
    let t = txn.open_table(OBJECTS)?;
    let row = t.get((bucket, key.as_bytes()))?;
    match row {
        Some(v) => Ok(Some(postcard::from_bytes(v.value())?)),
        None => Ok(None),
    }
}

pub(super) fn replace_object(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    old: Option<ObjectMeta>,
    meta: &ObjectMeta,
    freed: &mut Vec<BlockHash>,
) -> Result<()> {
    let row = postcard::to_allocvec(meta)?;
    incref(txn, meta.data.blocks())?;
    if let Some(old) = old {
        decref(txn, old.data.blocks(), freed)?;
    }
    txn.open_table(OBJECTS)?.insert((bucket, key.as_bytes()), row.as_slice())?;
    retree(txn, bucket, key.as_bytes(), Known::Is(Some(meta.version)), Known::Read)
}

/// Stores an object row (taking a reference on each of its blocks), replacing
/// any previous version. Returns the blocks no longer referenced.
pub fn put_object(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    meta: &ObjectMeta,
    cond: &WriteConditions,
) -> Result<Vec<BlockHash>> {
    write_object(txn, bucket, key, meta.clone(), cond).map(|(_, freed)| freed)
}

/// [`put_object`], returning the row as stored: in a versioned bucket it
/// becomes the key's latest version ([`versions::put`]), tagged with it.
pub fn write_object(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    mut meta: ObjectMeta,
    cond: &WriteConditions,
) -> Result<(ObjectMeta, Vec<BlockHash>)> {
    let state = versions::bucket_row(txn, bucket)?.versioning;
    let old = existing_object(txn, bucket, key)?;
    conditions::check_write(
        old.as_ref().map(|o| o.etag.as_str()),
        cond.if_match.as_ref(),
        cond.if_none_match.as_ref(),
        key,
    )?;
    let mut freed = Vec::new();
    let meta = match state {
        None => {
            // (A copy of a version of another bucket carries its tag.)
            meta.versioned = None;
            replace_object(txn, bucket, key, old, &meta, &mut freed)?;
            meta
        }
        Some(state) => versions::put(txn, bucket, key, meta, state, old, &mut freed)?,
    };
    Ok((meta, freed))
}

/// Deletes an object (a missing key is not an error). Returns freed blocks.
pub fn delete_object(txn: &Txn<'_>, bucket: &str, key: &str) -> Result<Vec<BlockHash>> {
    delete_object_if(txn, bucket, key, &DeleteConditions::default())
}

/// [`delete_object`] when `cond` holds for the current object, checked in
/// the same transaction (so no write can slip between check and delete).
pub fn delete_object_if(txn: &Txn<'_>, bucket: &str, key: &str, cond: &DeleteConditions) -> Result<Vec<BlockHash>> {
    require_bucket(txn, bucket)?;
    let mut freed = Vec::new();
    let current = existing_object(txn, bucket, key)?;
    cond.check(current.as_ref().map(|m| (m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))), key)?;
    if let Some(old) = current {
        decref(txn, old.data.blocks(), &mut freed)?;
        txn.open_table(OBJECTS)?.remove((bucket, key.as_bytes()))?;
        retree(txn, bucket, key.as_bytes(), Known::Is(None), Known::Read)?;
    }
    Ok(freed)
}

/// What a delete did in a versioned bucket.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Removed {
    /// The id of the version removed or of the delete marker made (none
    /// outside versioned buckets).
    pub version_id: Option<String>,
    /// Whether that version is a delete marker.
    pub delete_marker: bool,
}

/// A DELETE of (bucket, key), of version `v` when one is named, if `cond`
/// holds: in a bucket that never had versioning, [`delete_object_if`] (only
/// the `null` version exists there); in a versioned one a delete marker
/// ([`versions::delete_latest`], row version `version`) or the removal of
/// that version ([`versions::delete_version`]). Returns freed blocks.
pub fn delete_any(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    v: Option<VersionRef>,
    cond: &DeleteConditions,
    version: u64,
) -> Result<(Removed, Vec<BlockHash>)> {
    let state = versions::bucket_row(txn, bucket)?.versioning;
    let mut freed = Vec::new();
    let removed = match (state, v) {
        (None, None) => {
            freed = delete_object_if(txn, bucket, key, cond)?;
            Removed::default()
        }
        (None, Some(VersionRef::Null)) => {
            freed = delete_object_if(txn, bucket, key, cond)?;
            Removed { version_id: Some("null".into()), delete_marker: false }
        }
        (None, Some(VersionRef::Id(id))) => {
            cond.check(None, key)?;
            Removed { version_id: Some(crate::versioning::version_id(id, false)), delete_marker: false }
        }
        (Some(state), None) => {
            let m = versions::delete_latest(txn, bucket, key, cond, state, version, &mut freed)?;
            Removed { version_id: Some(crate::versioning::version_id(m.version, m.null)), delete_marker: true }
        }
        (Some(_), Some(v)) => match versions::delete_version(txn, bucket, key, v, cond, &mut freed)? {
            Some(gone) => Removed { version_id: Some(gone.id()), delete_marker: matches!(gone, Version::Marker(_)) },
            None => Removed {
                version_id: Some(match v {
                    VersionRef::Null => "null".into(),
                    VersionRef::Id(id) => crate::versioning::version_id(id, false),
                }),
                delete_marker: false,
            },
        },
    };
    Ok((removed, freed))
}

/// Records a new multipart upload.
pub fn create_upload(txn: &WriteTransaction, id: &str, meta: &UploadMeta) -> Result<()> {
    require_bucket(txn, &meta.bucket)?;
    let row = postcard::to_allocvec(meta)?;
    txn.open_table(UPLOADS)?.insert(id, row.as_slice())?;
    txn.open_table(UPLOAD_INDEX)?.insert((meta.bucket.as_str(), meta.key.as_bytes(), id), ())?;
    Ok(())
}

fn require_upload(txn: &WriteTransaction, id: &str, bucket: &str, key: &str) -> Result<UploadMeta> {
    let t = txn.open_table(UPLOADS)?;
    let row = t.get(id)?;
    let meta: UploadMeta = match row {
        Some(v) => postcard::from_bytes(v.value())?,
        None => return Err(LightningError::NoSuchUpload(id.to_owned())),
    };
    if meta.bucket != bucket || meta.key != key {
        return Err(LightningError::NoSuchUpload(id.to_owned()));
    }
    Ok(meta)
}

/// Stores (or replaces) a part. Returns freed blocks.
pub fn put_part(
    txn: &WriteTransaction,
    id: &str,
    bucket: &str,
    key: &str,
    number: u32,
    part: &PartMeta,
) -> Result<Vec<BlockHash>> {
    require_upload(txn, id, bucket, key)?;
    let row = postcard::to_allocvec(part)?;
    let mut parts = txn.open_table(PARTS)?;
    let old: Option<PartMeta> = match parts.get((id, number))? {
        Some(v) => Some(postcard::from_bytes(v.value())?),
        None => None,
    };
    let mut freed = Vec::new();
    incref(txn, &part.blocks)?;
    if let Some(old) = old {
        decref(txn, &old.blocks, &mut freed)?;
    }
    parts.insert((id, number), row.as_slice())?;
    Ok(freed)
}

fn all_parts(txn: &WriteTransaction, id: &str) -> Result<Vec<(u32, PartMeta)>> {
    let parts = txn.open_table(PARTS)?;
    let mut out = Vec::new();
    for row in parts.range((id, 0u32)..=(id, u32::MAX))? {
        let (k, v) = row?;
        out.push((k.value().1, postcard::from_bytes(v.value())?));
    }
    Ok(out)
}

fn remove_upload(txn: &WriteTransaction, id: &str, upload: &UploadMeta, parts: &[(u32, PartMeta)]) -> Result<()> {
    let mut t = txn.open_table(PARTS)?;
    for (n, _) in parts {
        t.remove((id, *n))?;
    }
    txn.open_table(UPLOADS)?.remove(id)?;
    txn.open_table(UPLOAD_INDEX)?.remove((upload.bucket.as_str(), upload.key.as_bytes(), id))?;
    Ok(())
}

/// Aborts an upload, dropping its parts. Returns freed blocks.
pub fn abort_upload(txn: &WriteTransaction, id: &str, bucket: &str, key: &str) -> Result<Vec<BlockHash>> {
    let upload = require_upload(txn, id, bucket, key)?;
    let parts = all_parts(txn, id)?;
    let mut freed = Vec::new();
    for (_, p) in &parts {
        decref(txn, &p.blocks, &mut freed)?;
    }
    remove_upload(txn, id, &upload, &parts)?;
    Ok(freed)
}

/// One entry of a CompleteMultipartUpload request.
#[derive(Debug, Clone)]
pub struct CompletedPart {
    /// Part number.
    pub number: u32,
    /// The ETag the client got for it (unquoted).
    pub etag: String,
    /// Checksum the client claims for it, if any.
    pub checksum: Option<Checksum>,
}

/// Builds the object a completed upload becomes (pure): checks the order,
/// ETags, checksums and sizes of the `requested` parts against `stored`
/// (which may hold several candidates per part number, as replicas may;
/// the one whose ETag the client names is taken), computes the multipart
/// ETag and composite checksum, and lists the blocks in order.
pub fn assemble_upload(
    upload: &UploadMeta,
    requested: &[CompletedPart],
    stored: &[(u32, PartMeta)],
    version: u64,
    now_ms: i64,
) -> Result<ObjectMeta> {
    if requested.is_empty() {
        return Err(LightningError::InvalidRequest("you must specify at least one part".into()));
    }
    if requested.windows(2).any(|w| w[0].number >= w[1].number) {
        return Err(LightningError::InvalidPartOrder);
    }
    let mut chosen: Vec<&PartMeta> = Vec::with_capacity(requested.len());
    for (i, want) in requested.iter().enumerate() {
        let mut same_number = stored.iter().filter(|(n, _)| *n == want.number).map(|(_, p)| p).peekable();
        let first = same_number
            .peek()
            .copied()
            .ok_or_else(|| LightningError::InvalidPart(format!("part {} was not uploaded", want.number)))?;
        let wanted_tag = want.etag.trim_matches('"');
        let part = same_number.find(|p| p.etag() == wanted_tag).ok_or_else(|| {
            LightningError::InvalidPart(format!("part {} has ETag {}, not {}", want.number, first.etag(), want.etag))
        })?;
        if let Some(c) = &want.checksum
            && part.checksum.as_ref().is_some_and(|p| p.algo == c.algo && p.raw != c.raw)
        {
            return Err(LightningError::InvalidPart(format!("part {} checksum does not match", want.number)));
        }
        if i + 1 < requested.len() && part.size < MIN_PART_SIZE {
            return Err(LightningError::EntityTooSmall { part: want.number, size: part.size, min: MIN_PART_SIZE });
        }
        chosen.push(part);
    }
    let mut md5s = md5::Md5::new();
    for p in &chosen {
        md5s.update(p.md5);
    }
    let etag = format!("{}-{}", hex::encode(md5s.finalize()), chosen.len());
    let checksum = upload.checksum_algo.and_then(|algo| {
        let parts: Option<Vec<(&[u8], u64)>> = chosen
            .iter()
            .map(|p| p.checksum.as_ref().filter(|c| c.algo == algo).map(|c| (c.raw.as_slice(), p.size)))
            .collect();
        let parts = parts?;
        if upload.full_object {
            Checksum::full_object(algo, &parts)
        } else {
            Some(Checksum::composite(algo, &parts.iter().map(|(d, _)| *d).collect::<Vec<_>>()))
        }
    });
    let blocks: Vec<BlockRef> = chosen.iter().flat_map(|p| p.blocks.iter().copied()).collect();
    // SSE-C: each part is a CTR stream of its own (see `crate::sse`).
    let sse_c = upload
        .sse_c_key_md5
        .map(|m| crate::sse::assembled(m, &chosen.iter().map(|p| p.sse_iv).collect::<Vec<_>>()))
        .transpose()?;
    Ok(ObjectMeta {
        version,
        size: chosen.iter().map(|p| p.size).sum(),
        etag,
        last_modified_ms: now_ms,
        headers: upload.headers.clone(),
        checksum,
        parts: chosen.iter().map(|p| p.size).collect(),
        data: ObjectData::Blocks(blocks),
        sse_c,
        versioned: None,
    })
}

/// Checks the whole-object checksums a CompleteMultipartUpload claims
/// (`x-amz-checksum-*`, as `BASE64` or `BASE64-N`) against the object it
/// assembles: a different value (or part count) is BadDigest; a checksum of
/// an algorithm the upload was not created with, or a checksum type
/// (`x-amz-checksum-type`) other than the upload's, is InvalidRequest.
/// Nothing is committed when this fails.
pub fn check_claimed_checksums(upload: &UploadMeta, meta: &ObjectMeta, claimed: &Claimed) -> Result<()> {
    if let Some(full) = claimed.full_object
        && full != upload.full_object
        && (full || upload.checksum_algo.is_some())
    {
        let kind = |f: bool| if f { "FULL_OBJECT" } else { "COMPOSITE" };
        return Err(LightningError::InvalidRequest(format!(
            "the upload's checksum type is {}, not the {} given",
            if upload.checksum_algo.is_some() { kind(upload.full_object) } else { "none" },
            kind(full)
        )));
    }
    for c in &claimed.checksums {
        match &meta.checksum {
            Some(m) if m.algo == c.algo => {
                if m.raw != c.raw || (c.parts.is_some() && c.parts != m.parts) {
                    return Err(LightningError::BadDigest(format!(
                        "the {} you specified did not match the calculated checksum of the object",
                        c.algo.name()
                    )));
                }
            }
            _ => {
                return Err(LightningError::InvalidRequest(format!(
                    "the upload was not created with checksum algorithm {}",
                    c.algo.name()
                )));
            }
        }
    }
    Ok(())
}

/// What a CompleteMultipartUpload says the object's checksum is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Whole-object checksum values (`x-amz-checksum-*`), a COMPOSITE one with its part count.
    pub checksums: Vec<Checksum>,
    /// `x-amz-checksum-type`: `Some(true)` for FULL_OBJECT, `Some(false)` for COMPOSITE.
    pub full_object: Option<bool>,
}

/// The ETag a completion of `requested` gives its object (the MD5 of the
/// parts' MD5s, then `-N`), computed from the part ETags the client names;
/// `None` when one of them is not an MD5. A completion repeated after its
/// upload is gone (an SDK retrying a lost reply) is recognised by it: when
/// the key holds an object with this ETag, that completion already happened,
/// and the retry gets the same answer instead of NoSuchUpload.
pub fn completed_etag(requested: &[CompletedPart]) -> Option<String> {
    if requested.is_empty() {
        return None;
    }
    let mut md5s = md5::Md5::new();
    for p in requested {
        let raw = hex::decode(p.etag.trim_matches('"')).ok().filter(|r| r.len() == 16)?;
        md5s.update(&raw);
    }
    Some(format!("{}-{}", hex::encode(md5s.finalize()), requested.len()))
}

/// Turns an upload into an object. Returns the object and freed blocks.
#[allow(clippy::too_many_arguments)]
pub fn complete_upload(
    txn: &Txn<'_>,
    id: &str,
    bucket: &str,
    key: &str,
    requested: &[CompletedPart],
    claimed: &Claimed,
    version: u64,
    now_ms: i64,
    cond: &WriteConditions,
) -> Result<(ObjectMeta, Vec<BlockHash>)> {
    let upload = require_upload(txn, id, bucket, key)?;
    let stored = all_parts(txn, id)?;
    let meta = assemble_upload(&upload, requested, &stored, version, now_ms)?;
    check_claimed_checksums(&upload, &meta, claimed)?;
    // The object takes its own references; dropping every part's afterwards
    // leaves exactly the object's, and frees the blocks of unused parts.
    let (meta, mut freed) = write_object(txn, bucket, key, meta, cond)?;
    for (_, p) in &stored {
        decref(txn, &p.blocks, &mut freed)?;
    }
    remove_upload(txn, id, &upload, &stored)?;
    Ok((meta, freed))
}

/// Merges a replicated row: it replaces the stored row (object or tombstone)
/// only when its version is higher, so replicas that receive the same rows
/// in any order end up equal. Creates the bucket row if this replica missed
/// its creation; an object of a bucket deleted here is refused
/// (NoSuchBucket, see [`drop_bucket`]). Returns whether the row was
/// applied, the version the key holds afterwards, and the blocks freed.
pub fn apply_row(txn: &Txn<'_>, bucket: &str, key: &[u8], row: &Row) -> Result<(bool, u64, Vec<BlockHash>)> {
    let mut objects = txn.open_table(OBJECTS)?;
    let mut tombs = txn.open_table(TOMBSTONES)?;
    let old: Option<ObjectMeta> = match objects.get((bucket, key))? {
        Some(v) => Some(postcard::from_bytes(v.value())?),
        None => None,
    };
    let tomb = tombs.get((bucket, key))?.map(|v| v.value());
    let current = old.as_ref().map(|o| o.version).max(tomb).unwrap_or(0);
    let mut freed = Vec::new();
    // A version of a versioned bucket's key is kept whether or not the row
    // is the key's newest (writes racing on a key are all versions).
    if let Row::Object(meta) = row
        && matches!(meta.versioned, Some(Versioned::Id | Versioned::Null))
        && replica_bucket(txn, bucket)?
    {
        versions::replica_add(txn, bucket, key, &Version::Object(meta.clone()), &mut freed)?;
    }
    if row.version() <= current {
        return Ok((false, current, freed));
    }
    if !replica_bucket(txn, bucket)? {
        // The bucket was deleted here: a tombstone has nothing to delete,
        // an object is refused (the write raced the bucket's delete).
        return match row {
            Row::Tombstone(_) => Ok((false, current, freed)),
            Row::Object(_) => Err(LightningError::NoSuchBucket(bucket.to_owned())),
        };
    }
    match row {
        Row::Object(meta) => {
            incref(txn, meta.data.blocks())?;
            let bytes = postcard::to_allocvec(meta)?;
            objects.insert((bucket, key), bytes.as_slice())?;
            if tomb.is_some() {
                tombs.remove((bucket, key))?;
            }
        }
        Row::Tombstone(v) => {
            if old.is_some() {
                objects.remove((bucket, key))?;
            }
            tombs.insert((bucket, key), *v)?;
        }
    }
    if let Some(o) = old {
        decref(txn, o.data.blocks(), &mut freed)?;
    }
    if let Some(partitions) = txn.tree() {
        let e = TreeEntry { version: row.version(), tombstone: matches!(row, Row::Tombstone(_)) };
        merkle::set(txn, partitions, bucket, key, Some(e))?;
    }
    Ok((true, row.version(), freed))
}

/// A replica's side of a completed multipart upload: merges the object
/// row the coordinator assembled (as [`apply_row`]) and drops the upload,
/// remembering it as gone, in one transaction. So wherever the object was
/// committed the upload is gone too, and a repeated complete finds it gone
/// (and the object) instead of committing again. Refused (NoSuchUpload)
/// when the upload is already gone here: another complete or an abort of
/// it got here first. Returns what [`apply_row`] does, with the freed
/// blocks of both.
pub fn replica_complete_upload(
    txn: &Txn<'_>,
    id: &str,
    bucket: &str,
    key: &[u8],
    row: &Row,
    now_ms: i64,
) -> Result<(bool, u64, Vec<BlockHash>)> {
    refuse_if_gone(txn, id)?;
    let (applied, current, mut freed) = apply_row(txn, bucket, key, row)?;
    freed.extend(drop_upload(txn, id, bucket, now_ms)?);
    Ok((applied, current, freed))
}

/// Removes a tombstone if it still has `version` (collection after the delay).
pub fn drop_tombstone(txn: &Txn<'_>, bucket: &str, key: &[u8], version: u64) -> Result<()> {
    let dropped = {
        let mut tombs = txn.open_table(TOMBSTONES)?;
        let cur = tombs.get((bucket, key))?.map(|v| v.value());
        cur == Some(version) && tombs.remove((bucket, key))?.is_some()
    };
    if dropped {
        retree(txn, bucket, key, Known::Read, Known::Is(None))?;
    }
    Ok(())
}

/// A replica's side of DeleteBucket: refused (BucketNotEmpty) while the
/// bucket holds an object row here, else deletes the row and its uploads in
/// progress and remembers the bucket as deleted ([`BUCKETS_GONE`]). In one
/// transaction, so on each replica a write and the bucket's delete are
/// ordered: a row committed first makes the delete fail, a delete first
/// makes the row's commit fail (see [`apply_row`]). Returns freed blocks.
pub fn drop_bucket(txn: &WriteTransaction, name: &str) -> Result<Vec<BlockHash>> {
    let has_object = match txn.open_table(OBJECTS)?.range((name, &b""[..])..)?.next() {
        Some(row) => row?.0.value().0 == name,
        None => false,
    };
    if has_object {
        return Err(LightningError::BucketNotEmpty(name.to_owned()));
    }
    // Versions left here are ones this replica missed the delete of (the
    // coordinator found none in the read quorum's union): they go.
    let mut freed = Vec::new();
    versions::drop_all(txn, name, &mut freed)?;
    for id in uploads_in(txn, name)? {
        freed.extend(drop_upload(txn, &id, name, super::now_ms())?);
    }
    txn.open_table(BUCKETS)?.remove(name)?;
    txn.open_table(BUCKETS_GONE)?.insert(name, super::now_ms())?;
    Ok(freed)
}

/// A late delete's side on a replica ([`crate::cluster::rpc::Req::DeleteBucketBefore`]):
/// deletes the bucket as [`drop_bucket`] does unless its row here was
/// created after `deleted_ms`, and remembers the bucket as deleted at
/// `deleted_ms` (a later time already remembered stays). `None` when the
/// row is newer than the delete and stays; else the freed blocks.
pub fn drop_bucket_before(txn: &WriteTransaction, name: &str, deleted_ms: i64) -> Result<Option<Vec<BlockHash>>> {
    let created = match txn.open_table(BUCKETS)?.get(name)? {
        Some(v) => Some(postcard::from_bytes::<BucketMeta>(v.value())?.created_ms),
        None => None,
    };
    if created.is_some_and(|c| c > deleted_ms) {
        return Ok(None);
    }
    let freed = if created.is_some() { drop_bucket(txn, name)? } else { Vec::new() };
    let mut gone = txn.open_table(BUCKETS_GONE)?;
    let known = gone.get(name)?.map(|v| v.value());
    // drop_bucket wrote this node's time; the delete's own time is what a
    // later create is compared with.
    let at = if created.is_some() { deleted_ms } else { known.map_or(deleted_ms, |k| k.max(deleted_ms)) };
    gone.insert(name, at)?;
    Ok(Some(freed))
}

/// On a replica, makes sure the bucket row of a replicated write exists:
/// creates it if this replica missed the bucket's creation. `false` when the
/// bucket was deleted here (the write raced its delete).
pub(crate) fn replica_bucket(txn: &WriteTransaction, name: &str) -> Result<bool> {
    let mut buckets = txn.open_table(BUCKETS)?;
    if buckets.get(name)?.is_some() {
        return Ok(true);
    }
    if txn.open_table(BUCKETS_GONE)?.get(name)?.is_some() {
        return Ok(false);
    }
    let b = postcard::to_allocvec(&BucketMeta::new(UNKNOWN_CREATED_MS))?;
    buckets.insert(name, b.as_slice())?;
    Ok(true)
}

/// The creation time of a bucket row a replica made itself, for a write
/// or a lifecycle configuration whose bucket create it missed: unknown, so
/// older than any create (which replaces it, keeping its configuration)
/// and any delete (which deletes it), and never sent to another node as a
/// create of its own.
pub const UNKNOWN_CREATED_MS: i64 = 0;

/// Stores `lc` as `bucket`'s lifecycle configuration unless the row holds
/// a newer one (replicas keep the newest; applying is idempotent). A
/// replica that missed the bucket's creation (`create_missing`) creates the
/// row, unless it deleted the bucket; otherwise a missing bucket is NoSuchBucket. Returns whether it applied.
pub fn set_lifecycle(txn: &WriteTransaction, bucket: &str, lc: &Lifecycle, create_missing: bool) -> Result<bool> {
    let gone = create_missing && txn.open_table(BUCKETS_GONE)?.get(bucket)?.is_some();
    let mut t = txn.open_table(BUCKETS)?;
    let mut row: BucketMeta = match t.get(bucket)? {
        Some(v) => postcard::from_bytes(v.value())?,
        None if create_missing && !gone => BucketMeta::new(UNKNOWN_CREATED_MS),
        None => return Err(LightningError::NoSuchBucket(bucket.to_owned())),
    };
    if row.lifecycle.as_ref().is_some_and(|old| old.version >= lc.version) {
        return Ok(false);
    }
    row.lifecycle = Some(lc.clone());
    t.insert(bucket, postcard::to_allocvec(&row)?.as_slice())?;
    Ok(true)
}

/// Takes lifecycle configuration `lc` of bucket `bucket` from a peer's
/// anti-entropy round when the bucket row here has the peer's creation
/// time (the same incarnation of the bucket) and an older configuration or
/// none. A missing row, or one created at another time, is left alone:
/// bucket rows have their own repair, which carries the configuration
/// with a create. Returns whether it wrote.
pub fn merge_lifecycle(txn: &WriteTransaction, bucket: &str, created_ms: i64, lc: &Lifecycle) -> Result<bool> {
    let same = match txn.open_table(BUCKETS)?.get(bucket)? {
        Some(v) => postcard::from_bytes::<BucketMeta>(v.value())?.created_ms == created_ms,
        None => false,
    };
    if !same {
        return Ok(false);
    }
    set_lifecycle(txn, bucket, lc, false)
}

/// Creates a bucket row created at `created_ms` (replicated create:
/// idempotent), forgetting that it was deleted. A row here that this
/// node made itself ([`UNKNOWN_CREATED_MS`]) takes the time and keeps its
/// configuration. A row here created earlier is one whose delete this node
/// missed (the bucket was deleted and created again while it was down or
/// cut off), or the row of a bucket created again after a refused delete
/// (the caller sends the configuration after it): it is replaced, without
/// its configuration. Returns whether it wrote a row.
pub fn ensure_bucket(txn: &WriteTransaction, name: &str, created_ms: i64) -> Result<bool> {
    txn.open_table(BUCKETS_GONE)?.remove(name)?;
    let mut t = txn.open_table(BUCKETS)?;
    let here = match t.get(name)? {
        Some(v) => Some(postcard::from_bytes::<BucketMeta>(v.value())?),
        None => None,
    };
    if here.as_ref().is_some_and(|h| h.created_ms >= created_ms) {
        return Ok(false);
    }
    let row = match here {
        Some(h) if h.created_ms == UNKNOWN_CREATED_MS => BucketMeta { created_ms, ..h },
        _ => BucketMeta::new(created_ms),
    };
    let row = postcard::to_allocvec(&row)?;
    t.insert(name, row.as_slice())?;
    Ok(true)
}

/// A replica's side of [`crate::cluster::rpc::Req::RecreateBucket`]: the
/// bucket is here afterwards, not remembered as deleted, created at the
/// later of its row's time and `created_ms`, with its own configuration
/// and `lifecycle` if that is newer.
pub fn recreate_bucket(
    txn: &WriteTransaction,
    name: &str,
    created_ms: i64,
    lifecycle: Option<&Lifecycle>,
) -> Result<()> {
    txn.open_table(BUCKETS_GONE)?.remove(name)?;
    let mut t = txn.open_table(BUCKETS)?;
    let mut row = match t.get(name)? {
        Some(v) => postcard::from_bytes::<BucketMeta>(v.value())?,
        None => BucketMeta::new(created_ms),
    };
    row.created_ms = row.created_ms.max(created_ms);
    if let Some(lc) = lifecycle
        && row.lifecycle.as_ref().is_none_or(|old| old.version < lc.version)
    {
        row.lifecycle = Some(lc.clone());
    }
    t.insert(name, postcard::to_allocvec(&row)?.as_slice())?;
    Ok(())
}

/// Creates (or renews, as [`ensure_bucket`] does) a bucket row created at
/// `created_ms` unless the bucket was deleted here at or after
/// `created_ms` (see [`crate::cluster::rpc::Req::CreateBucketSince`]).
/// Returns whether the bucket is here afterwards.
pub fn ensure_bucket_since(txn: &WriteTransaction, name: &str, created_ms: i64) -> Result<bool> {
    let deleted = txn.open_table(BUCKETS_GONE)?.get(name)?.map(|v| v.value());
    if deleted.is_some_and(|d| d >= created_ms) && txn.open_table(BUCKETS)?.get(name)?.is_none() {
        return Ok(false);
    }
    ensure_bucket(txn, name, created_ms)?;
    Ok(true)
}

fn refuse_if_gone(txn: &WriteTransaction, id: &str) -> Result<()> {
    if txn.open_table(UPLOADS_GONE)?.get(id)?.is_some() {
        return Err(LightningError::NoSuchUpload(id.to_owned()));
    }
    Ok(())
}

/// Records a replicated upload unless it is already here or gone
/// (completed or aborted); creates the bucket row if this replica missed
/// it, NoSuchBucket if the bucket was deleted here.
pub fn replica_create_upload(txn: &WriteTransaction, id: &str, meta: &UploadMeta) -> Result<()> {
    refuse_if_gone(txn, id)?;
    if txn.open_table(UPLOADS)?.get(id)?.is_some() {
        return Ok(());
    }
    if !replica_bucket(txn, &meta.bucket)? {
        return Err(LightningError::NoSuchBucket(meta.bucket.clone()));
    }
    create_upload(txn, id, meta)
}

/// Stores a replicated part, creating the upload first if this replica
/// missed its creation. Refused once the upload is gone. Returns freed blocks.
pub fn replica_put_part(
    txn: &WriteTransaction,
    id: &str,
    upload: &UploadMeta,
    number: u32,
    part: &PartMeta,
) -> Result<Vec<BlockHash>> {
    replica_create_upload(txn, id, upload)?;
    put_part(txn, id, &upload.bucket, &upload.key, number, part)
}

/// Drops a replicated upload (after its object committed, or on abort) and
/// remembers it as gone, so a late part or a stale replica cannot revive
/// it. Idempotent. Returns freed blocks.
pub fn drop_upload(txn: &WriteTransaction, id: &str, bucket: &str, now_ms: i64) -> Result<Vec<BlockHash>> {
    let upload: Option<UploadMeta> = match txn.open_table(UPLOADS)?.get(id)? {
        Some(v) => Some(postcard::from_bytes(v.value())?),
        None => None,
    };
    let mut freed = Vec::new();
    if let Some(upload) = upload {
        let parts = all_parts(txn, id)?;
        for (_, p) in &parts {
            decref(txn, &p.blocks, &mut freed)?;
        }
        remove_upload(txn, id, &upload, &parts)?;
    }
    let mut gone = txn.open_table(UPLOADS_GONE)?;
    if gone.get(id)?.is_none() {
        let v = postcard::to_allocvec(&(bucket, now_ms))?;
        gone.insert(id, v.as_slice())?;
    }
    Ok(freed)
}

/// Forgets that an upload is gone (collection after the tombstone delay).
pub fn forget_gone_upload(txn: &WriteTransaction, id: &str) -> Result<()> {
    txn.open_table(UPLOADS_GONE)?.remove(id)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_txn(f: impl FnOnce(&WriteTransaction)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = redb::Database::create(dir.path().join("m.redb")).expect("db");
        let w = db.begin_write().expect("write");
        f(&w);
        w.commit().expect("commit");
    }

    fn created(txn: &WriteTransaction, name: &str) -> Option<i64> {
        let t = txn.open_table(BUCKETS).expect("table");
        t.get(name).expect("get").map(|v| postcard::from_bytes::<BucketMeta>(v.value()).expect("row").created_ms)
    }

    fn gone(txn: &WriteTransaction, name: &str) -> Option<i64> {
        txn.open_table(BUCKETS_GONE).expect("table").get(name).expect("get").map(|v| v.value())
    }

    /// Late bucket creates and deletes, in either order, leave the newer.
    /// A row a replica made for a write or a configuration whose create it
    /// missed has no known time: the create gives it its time and keeps
    /// its configuration, a delete deletes it.
    #[test]
    fn a_row_a_replica_made_itself_takes_the_create_and_yields_to_the_delete() {
        with_txn(|t| {
            let lc = Lifecycle { version: 7, rules: Vec::new() };
            assert!(set_lifecycle(t, "a", &lc, true).expect("lifecycle"));
            assert_eq!(created(t, "a"), Some(UNKNOWN_CREATED_MS));
            assert!(ensure_bucket(t, "a", 30).expect("create"));
            let row: BucketMeta = {
                let b = t.open_table(BUCKETS).expect("table");
                postcard::from_bytes(b.get("a").expect("get").expect("row").value()).expect("decode")
            };
            assert_eq!(
                (row.created_ms, row.lifecycle.map(|l| l.version)),
                (30, Some(7)),
                "time taken, configuration kept"
            );
            assert!(replica_bucket(t, "b").expect("replica row"));
            assert_eq!(created(t, "b"), Some(UNKNOWN_CREATED_MS));
            assert_eq!(drop_bucket_before(t, "b", 20).expect("delete"), Some(Vec::new()));
            assert_eq!((created(t, "b"), gone(t, "b")), (None, Some(20)));
        });
    }

    /// After a refused delete the bucket comes back everywhere, timed
    /// after the delete, and no node loses a configuration newer than the
    /// one the coordinator sends.
    #[test]
    fn a_bucket_created_again_after_a_refused_delete_keeps_the_newest_configuration() {
        with_txn(|t| {
            let old = Lifecycle { version: 5, rules: Vec::new() };
            let new = Lifecycle { version: 9, rules: Vec::new() };
            let lifecycle = |t: &WriteTransaction, name: &str| {
                let b = t.open_table(BUCKETS).expect("table");
                let row: BucketMeta =
                    postcard::from_bytes(b.get(name).expect("get").expect("row").value()).expect("decode");
                row.lifecycle.map(|l| l.version)
            };
            // A node that refused the delete holds a newer configuration.
            ensure_bucket(t, "kept", 10).expect("create");
            set_lifecycle(t, "kept", &new, false).expect("lifecycle");
            recreate_bucket(t, "kept", 30, Some(&old)).expect("recreate");
            assert_eq!((created(t, "kept"), lifecycle(t, "kept")), (Some(30), Some(9)));
            // A node that deleted it takes it back with the configuration sent.
            ensure_bucket(t, "back", 10).expect("create");
            drop_bucket_before(t, "back", 20).expect("delete");
            recreate_bucket(t, "back", 30, Some(&old)).expect("recreate");
            assert_eq!((created(t, "back"), gone(t, "back"), lifecycle(t, "back")), (Some(30), None, Some(5)));
            // A late delete from before it leaves it.
            assert_eq!(drop_bucket_before(t, "back", 20).expect("late delete"), None);
        });
    }

    #[test]
    fn a_bucket_row_ends_as_the_newer_of_a_create_and_a_delete() {
        with_txn(|t| {
            // A node holding the old row (created at 10) missed its delete (at
            // 20) and the create again (at 30): the create comes first.
            ensure_bucket(t, "a", 10).expect("create");
            assert!(ensure_bucket_since(t, "a", 30).expect("since"), "the newer create is taken");
            assert_eq!(created(t, "a"), Some(30), "and replaces the stale row");
            assert_eq!(drop_bucket_before(t, "a", 20).expect("late delete"), None, "the late delete is refused");
            assert_eq!(created(t, "a"), Some(30));
            // The other order: the delete first, then the create.
            ensure_bucket(t, "b", 10).expect("create");
            assert_eq!(drop_bucket_before(t, "b", 20).expect("delete"), Some(Vec::new()));
            assert_eq!((created(t, "b"), gone(t, "b")), (None, Some(20)), "deleted at the delete's own time");
            assert!(ensure_bucket_since(t, "b", 30).expect("since"));
            assert_eq!((created(t, "b"), gone(t, "b")), (Some(30), None));
            // A create older than the delete stays refused; an older row
            // is not renewed by an older create.
            ensure_bucket(t, "c", 10).expect("create");
            drop_bucket_before(t, "c", 20).expect("delete");
            assert!(!ensure_bucket_since(t, "c", 15).expect("since"), "a create from before the delete");
            assert!(!ensure_bucket_since(t, "c", 20).expect("since"), "a create at the delete's time");
            assert_eq!(created(t, "c"), None);
            assert!(!ensure_bucket(t, "a", 25).expect("older create"), "an older create keeps the newer row");
            assert_eq!(created(t, "a"), Some(30));
            // A delete of a bucket this node never had is remembered, the
            // later of two kept.
            assert_eq!(drop_bucket_before(t, "d", 40).expect("delete"), Some(Vec::new()));
            drop_bucket_before(t, "d", 35).expect("an older delete");
            assert_eq!(gone(t, "d"), Some(40));
        });
    }
}
