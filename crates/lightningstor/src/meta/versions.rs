//! Versions of the keys of versioned buckets ([`VERSIONS`]): reads, the
//! version cursor of ListObjectVersions, and the write-transaction bodies
//! that keep them (called from [`super::ops`] when the bucket row has a
//! versioning state).
//!
//! Every version and delete marker of a versioned bucket is a row of
//! [`VERSIONS`], newest first per key; the key's latest version, when it is
//! an object, is in [`OBJECTS`] too, so GET, HEAD and ListObjects read
//! exactly what they read in other buckets. Each of the two rows holds its
//! own reference on each block, so `block_refs` stays exact and a block is
//! freed when no version (and no current object) uses it any more.

use super::ops::{decref, existing_object, incref, replace_object};
use super::types::{BucketMeta, DeleteMarker, ObjectMeta, Version, Versioned, Versioning};
use super::{BUCKETS, OBJECTS, Txn, VERSIONS};
use crate::block::BlockHash;
use crate::conditions::DeleteConditions;
use crate::error::{LightningError, Result};
use crate::versioning::{VersionCursor, VersionRef, VersionSummary};
use redb::{ReadableTable, WriteTransaction};

type VersionKey = (&'static str, &'static [u8], u64);

/// The versions of one key, newest first.
pub(super) fn of_key<'a, T: ReadableTable<VersionKey, &'static [u8]>>(
    t: &'a T,
    bucket: &str,
    key: &[u8],
) -> Result<redb::Range<'a, VersionKey, &'static [u8]>> {
    Ok(t.range((bucket, key, 0u64)..=(bucket, key, u64::MAX))?)
}

/// Version `v` of a key, if it exists.
pub(super) fn find<T: ReadableTable<VersionKey, &'static [u8]>>(
    t: &T,
    bucket: &str,
    key: &[u8],
    v: VersionRef,
) -> Result<Option<Version>> {
    match v {
        VersionRef::Id(id) => match t.get((bucket, key, !id))? {
            Some(row) => {
                let found: Version = postcard::from_bytes(row.value())?;
                Ok((!found.is_null()).then_some(found))
            }
            None => Ok(None),
        },
        VersionRef::Null => {
            for row in of_key(t, bucket, key)? {
                let found: Version = postcard::from_bytes(row?.1.value())?;
                if found.is_null() {
                    return Ok(Some(found));
                }
            }
            Ok(None)
        }
    }
}

/// A bucket's row, or NoSuchBucket.
pub(super) fn bucket_row(txn: &WriteTransaction, bucket: &str) -> Result<BucketMeta> {
    match txn.open_table(BUCKETS)?.get(bucket)? {
        Some(v) => Ok(postcard::from_bytes(v.value())?),
        None => Err(LightningError::NoSuchBucket(bucket.to_owned())),
    }
}

/// Sets a bucket's versioning state. The first time, every object the
/// bucket holds becomes its key's `null` version (tagged and recorded in
/// [`VERSIONS`]), in this one transaction: from then on every key of the
/// bucket has its versions there.
pub fn set_versioning(txn: &Txn<'_>, bucket: &str, state: Versioning) -> Result<()> {
    let mut row = bucket_row(txn, bucket)?;
    if row.versioning.is_none() {
        let mut current = Vec::new();
        for r in txn.open_table(OBJECTS)?.range((bucket, &b""[..])..)? {
            let (k, v) = r?;
            let (b, key) = k.value();
            if b != bucket {
                break;
            }
            current.push((key.to_vec(), postcard::from_bytes::<ObjectMeta>(v.value())?));
        }
        let mut objects = txn.open_table(OBJECTS)?;
        for (key, mut meta) in current {
            meta.versioned = Some(Versioned::Null);
            objects.insert((bucket, key.as_slice()), postcard::to_allocvec(&meta)?.as_slice())?;
            insert(txn, bucket, &key, &Version::Object(meta))?;
        }
    }
    row.versioning = Some(state);
    txn.open_table(BUCKETS)?.insert(bucket, postcard::to_allocvec(&row)?.as_slice())?;
    Ok(())
}

/// Records a version (taking a reference on each of an object's blocks).
fn insert(txn: &WriteTransaction, bucket: &str, key: &[u8], v: &Version) -> Result<()> {
    if let Version::Object(m) = v {
        incref(txn, m.data.blocks())?;
    }
    txn.open_table(VERSIONS)?.insert((bucket, key, !v.version()), postcard::to_allocvec(v)?.as_slice())?;
    Ok(())
}

/// Removes a version (dropping an object's references).
fn remove(txn: &WriteTransaction, bucket: &str, key: &[u8], v: &Version, freed: &mut Vec<BlockHash>) -> Result<()> {
    txn.open_table(VERSIONS)?.remove((bucket, key, !v.version()))?;
    if let Version::Object(m) = v {
        decref(txn, m.data.blocks(), freed)?;
    }
    Ok(())
}

/// Removes the key's `null` version, if it has one (a write while
/// versioning is suspended replaces it).
fn drop_null(txn: &WriteTransaction, bucket: &str, key: &[u8], freed: &mut Vec<BlockHash>) -> Result<()> {
    let found = find(&txn.open_table(VERSIONS)?, bucket, key, VersionRef::Null)?;
    if let Some(v) = found {
        remove(txn, bucket, key, &v, freed)?;
    }
    Ok(())
}

/// The newest version of a key.
fn latest(txn: &WriteTransaction, bucket: &str, key: &[u8]) -> Result<Option<Version>> {
    let t = txn.open_table(VERSIONS)?;
    let first = of_key(&t, bucket, key)?.next();
    match first {
        Some(row) => Ok(Some(postcard::from_bytes(row?.1.value())?)),
        None => Ok(None),
    }
}

/// A write of `meta` as the new latest version of a key in a bucket in
/// `state` (conditions already checked against `old`, the current object).
/// Returns the row as stored.
pub(super) fn put(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    mut meta: ObjectMeta,
    state: Versioning,
    old: Option<ObjectMeta>,
    freed: &mut Vec<BlockHash>,
) -> Result<ObjectMeta> {
    meta.versioned = Some(match state {
        Versioning::Enabled => Versioned::Id,
        Versioning::Suspended => {
            drop_null(txn, bucket, key.as_bytes(), freed)?;
            Versioned::Null
        }
    });
    insert(txn, bucket, key.as_bytes(), &Version::Object(meta.clone()))?;
    replace_object(txn, bucket, key, old, &meta, freed)?;
    Ok(meta)
}

/// A DELETE without a version id in a bucket in `state`: if `cond` holds for
/// the current object, a delete marker (row version `version`) becomes the
/// latest version and the current object a noncurrent one.
pub(super) fn delete_latest(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    cond: &DeleteConditions,
    state: Versioning,
    version: u64,
    freed: &mut Vec<BlockHash>,
) -> Result<DeleteMarker> {
    let current = existing_object(txn, bucket, key)?;
    cond.check(current.as_ref().map(|m| (m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))), key)?;
    let null = state == Versioning::Suspended;
    if null {
        drop_null(txn, bucket, key.as_bytes(), freed)?;
    }
    let marker = DeleteMarker { version, last_modified_ms: super::now_ms(), null };
    insert(txn, bucket, key.as_bytes(), &Version::Marker(marker))?;
    if let Some(old) = current {
        decref(txn, old.data.blocks(), freed)?;
        txn.open_table(OBJECTS)?.remove((bucket, key.as_bytes()))?;
    }
    Ok(marker)
}

/// A DELETE of version `v`: removes it for good if `cond` holds for it (a
/// version that does not exist is no error without conditions). When it
/// was the latest, the next newest version becomes the current object (or
/// none, if that is a delete marker). Returns the version removed.
pub(super) fn delete_version(
    txn: &Txn<'_>,
    bucket: &str,
    key: &str,
    v: VersionRef,
    cond: &DeleteConditions,
    freed: &mut Vec<BlockHash>,
) -> Result<Option<Version>> {
    let k = key.as_bytes();
    let target = find(&txn.open_table(VERSIONS)?, bucket, k, v)?;
    let Some(target) = target else {
        cond.check(None, key)?;
        return Ok(None);
    };
    match &target {
        Version::Object(m) => cond.check(Some((m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))), key)?,
        Version::Marker(_) => cond.check(None, key)?,
    }
    let was_latest = latest(txn, bucket, k)?.is_some_and(|l| l.version() == target.version());
    remove(txn, bucket, k, &target, freed)?;
    if was_latest {
        if let Version::Object(m) = &target {
            decref(txn, m.data.blocks(), freed)?;
            txn.open_table(OBJECTS)?.remove((bucket, k))?;
        }
        if let Some(Version::Object(next)) = latest(txn, bucket, k)? {
            replace_object(txn, bucket, key, None, &next, freed)?;
        }
    }
    Ok(Some(target))
}

/// Whether a bucket holds any version or delete marker.
pub(super) fn any_in(txn: &WriteTransaction, bucket: &str) -> Result<bool> {
    let t = txn.open_table(VERSIONS)?;
    let first = t.range((bucket, &b""[..], 0u64)..)?.next();
    Ok(match first {
        Some(row) => row?.0.value().0 == bucket,
        None => false,
    })
}

/// A [`VersionCursor`] over one bucket of [`VERSIONS`].
pub(super) struct Cursor {
    table: redb::ReadOnlyTable<VersionKey, &'static [u8]>,
    bucket: String,
    range: Option<redb::Range<'static, VersionKey, &'static [u8]>>,
}

impl Cursor {
    pub(super) fn new(table: redb::ReadOnlyTable<VersionKey, &'static [u8]>, bucket: &str) -> Self {
        Cursor { table, bucket: bucket.to_owned(), range: None }
    }
}

impl VersionCursor for Cursor {
    fn seek(&mut self, from: &[u8]) -> Result<()> {
        self.range = Some(self.table.range((self.bucket.as_str(), from, 0u64)..)?);
        Ok(())
    }

    fn next(&mut self) -> Result<Option<(Vec<u8>, VersionSummary)>> {
        let Some(range) = self.range.as_mut() else { return Ok(None) };
        let Some(row) = range.next() else { return Ok(None) };
        let (k, v) = row?;
        let (b, key, _) = k.value();
        if b != self.bucket {
            return Ok(None);
        }
        let version: Version = postcard::from_bytes(v.value())?;
        let summary = match &version {
            Version::Object(m) => VersionSummary {
                version: m.version,
                null: version.is_null(),
                marker: false,
                size: m.size,
                etag: m.etag.clone(),
                last_modified_ms: m.last_modified_ms,
            },
            Version::Marker(d) => VersionSummary {
                version: d.version,
                null: d.null,
                marker: true,
                size: 0,
                etag: String::new(),
                last_modified_ms: d.last_modified_ms,
            },
        };
        Ok(Some((key.to_vec(), summary)))
    }
}
