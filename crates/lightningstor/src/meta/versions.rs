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
use super::{BUCKETS, OBJECTS, Txn, VERSIONS, VERSIONS_GONE};
use crate::block::BlockHash;
use crate::conditions::DeleteConditions;
use crate::error::{LightningError, Result};
use crate::versioning::{VersionCursor, VersionRef, VersionSummary};
use redb::{ReadableTable, WriteTransaction};

type GoneKey = (&'static str, &'static [u8], u64);

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

/// What a version listing shows of a version.
pub fn summary(version: &Version) -> VersionSummary {
    match version {
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
    }
}

// A cluster replica's side of versioning. Each replica of a key keeps the
// versions it received in [`VERSIONS`] (each with its own block
// references), and the ids of the versions deleted for good in
// [`VERSIONS_GONE`]; the key's current row ([`OBJECTS`] / tombstones)
// stays the replicated last-writer-wins row. Versions are immutable and
// have unique ids, so replicas merge them as sets: a coordinator reads a
// read quorum and takes the union, less the versions deleted for good (and
// of `null` versions only the newest), which holds every acknowledged
// version since R + W > N.

/// The row versions of a key's versions deleted for good here.
pub(super) fn gone_of_key<T: ReadableTable<GoneKey, ()>>(t: &T, bucket: &str, key: &[u8]) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for row in t.range((bucket, key, 0u64)..=(bucket, key, u64::MAX))? {
        out.push(row?.0.value().2);
    }
    Ok(out)
}

/// A replica's versions of a key range ([`super::Meta::version_entries`]):
/// (key, summary) in listing order, and (key, row version) deleted for good.
pub type Entries = (Vec<(Vec<u8>, VersionSummary)>, Vec<(Vec<u8>, u64)>);

/// See [`super::Meta::version_entries`].
pub(super) fn entries<V, G>(
    versions: &V,
    gone: &G,
    bucket: &str,
    from: &[u8],
    prefix: &[u8],
    limit: usize,
) -> Result<Entries>
where
    V: ReadableTable<VersionKey, &'static [u8]>,
    G: ReadableTable<GoneKey, ()>,
{
    let from = if from < prefix { prefix } else { from };
    let mut out: Vec<(Vec<u8>, VersionSummary)> = Vec::new();
    let mut cut = false;
    for row in versions.range((bucket, from, 0u64)..)? {
        let (k, v) = row?;
        let (b, key, _) = k.value();
        if b != bucket || !key.starts_with(prefix) {
            break;
        }
        if out.len() >= limit && out.last().is_some_and(|(last, _)| last.as_slice() != key) {
            cut = true;
            break;
        }
        let version: Version = postcard::from_bytes(v.value())?;
        out.push((key.to_vec(), summary(&version)));
    }
    let mut deleted = Vec::new();
    for row in gone.range((bucket, from, 0u64)..)? {
        let (k, _) = row?;
        let (b, key, v) = k.value();
        if b != bucket || !key.starts_with(prefix) {
            break;
        }
        if cut && out.last().is_some_and(|(last, _)| key > last.as_slice()) {
            break;
        }
        deleted.push((key.to_vec(), v));
    }
    Ok((out, deleted))
}

/// A replica takes version `v` of a key (a committed write, a delete
/// marker, or a current row repaired to it), unless it holds it already or
/// it was deleted for good here. A `null` version replaces an older `null`
/// version of the key and is dropped if a newer one is here. Returns
/// whether it was stored.
pub fn replica_add(
    txn: &WriteTransaction,
    bucket: &str,
    key: &[u8],
    v: &Version,
    freed: &mut Vec<BlockHash>,
) -> Result<bool> {
    let id = v.version();
    if txn.open_table(VERSIONS_GONE)?.get((bucket, key, id))?.is_some()
        || txn.open_table(VERSIONS)?.get((bucket, key, !id))?.is_some()
    {
        return Ok(false);
    }
    if v.is_null() {
        let held = find(&txn.open_table(VERSIONS)?, bucket, key, VersionRef::Null)?;
        if let Some(old) = held {
            if old.version() > id {
                return Ok(false);
            }
            // Replaced for good: a replica that missed this write must not
            // bring the old null version back into a read's union.
            remove(txn, bucket, key, &old, freed)?;
            txn.open_table(VERSIONS_GONE)?.insert((bucket, key, old.version()), ())?;
        }
    }
    insert(txn, bucket, key, v)?;
    Ok(true)
}

/// A replica's side of a delete marker: the key's row becomes a tombstone
/// at the marker's version (merged as [`super::ops::apply_row`] does) and
/// the marker a version of the key. Returns what `apply_row` does.
pub fn replica_marker(
    txn: &Txn<'_>,
    bucket: &str,
    key: &[u8],
    marker: DeleteMarker,
) -> Result<(bool, u64, Vec<BlockHash>)> {
    let (applied, current, mut freed) =
        super::ops::apply_row(txn, bucket, key, &super::types::Row::Tombstone(marker.version))?;
    if txn.open_table(BUCKETS)?.get(bucket)?.is_some() {
        replica_add(txn, bucket, key, &Version::Marker(marker), &mut freed)?;
    }
    Ok((applied, current, freed))
}

/// A replica's side of a version deleted for good: remembers the delete and
/// drops the version if it is here. Returns whether it was here.
pub fn replica_drop(
    txn: &WriteTransaction,
    bucket: &str,
    key: &[u8],
    id: u64,
    freed: &mut Vec<BlockHash>,
) -> Result<bool> {
    txn.open_table(VERSIONS_GONE)?.insert((bucket, key, id), ())?;
    let held: Option<Version> = match txn.open_table(VERSIONS)?.get((bucket, key, !id))? {
        Some(row) => Some(postcard::from_bytes(row.value())?),
        None => None,
    };
    match held {
        Some(v) => {
            remove(txn, bucket, key, &v, freed)?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// A replica takes a bucket's versioning state set at HLC version `at`,
/// unless it holds a newer change. The first time, the objects held here
/// that are no version yet (written before versioning) become their keys'
/// `null` versions; rows already tagged (versions this replica took before
/// it heard of the change) stay as they are. A replica that missed the
/// bucket's create makes its row (unless it deleted the bucket: then it
/// takes nothing). Returns whether it took it, and the blocks freed (of
/// `null` versions replaced).
pub fn replica_set_versioning(
    txn: &Txn<'_>,
    bucket: &str,
    state: Versioning,
    at: u64,
) -> Result<(bool, Vec<BlockHash>)> {
    if !super::ops::replica_bucket(txn, bucket)? {
        return Ok((false, Vec::new()));
    }
    let mut row = bucket_row(txn, bucket)?;
    if row.versioning_at.is_some_and(|held| held >= at) {
        return Ok((false, Vec::new()));
    }
    let mut freed = Vec::new();
    if row.versioning.is_none() {
        let mut plain = Vec::new();
        for r in txn.open_table(OBJECTS)?.range((bucket, &b""[..])..)? {
            let (k, v) = r?;
            let (b, key) = k.value();
            if b != bucket {
                break;
            }
            let meta: ObjectMeta = postcard::from_bytes(v.value())?;
            if meta.versioned.is_none() {
                plain.push((key.to_vec(), meta));
            }
        }
        for (key, mut meta) in plain {
            meta.versioned = Some(Versioned::Null);
            txn.open_table(OBJECTS)?.insert((bucket, key.as_slice()), postcard::to_allocvec(&meta)?.as_slice())?;
            replica_add(txn, bucket, &key, &Version::Object(meta), &mut freed)?;
        }
    }
    row.versioning = Some(state);
    row.versioning_at = Some(at);
    txn.open_table(BUCKETS)?.insert(bucket, postcard::to_allocvec(&row)?.as_slice())?;
    Ok((true, freed))
}

/// A replica drops a bucket: every version it holds of it (dropping their
/// block references) and its records of versions deleted for good.
pub(super) fn drop_all(txn: &WriteTransaction, bucket: &str, freed: &mut Vec<BlockHash>) -> Result<()> {
    let mut held: Vec<(Vec<u8>, Version)> = Vec::new();
    for row in txn.open_table(VERSIONS)?.range((bucket, &b""[..], 0u64)..)? {
        let (k, v) = row?;
        let (b, key, _) = k.value();
        if b != bucket {
            break;
        }
        held.push((key.to_vec(), postcard::from_bytes(v.value())?));
    }
    for (key, v) in &held {
        remove(txn, bucket, key, v, freed)?;
    }
    let mut gone = txn.open_table(VERSIONS_GONE)?;
    let mut keys: Vec<(Vec<u8>, u64)> = Vec::new();
    for row in gone.range((bucket, &b""[..], 0u64)..)? {
        let (k, _) = row?;
        let (b, key, v) = k.value();
        if b != bucket {
            break;
        }
        keys.push((key.to_vec(), v));
    }
    for (k, v) in keys {
        gone.remove((bucket, k.as_slice(), v))?;
    }
    Ok(())
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
        let summary = summary(&version);
        Ok(Some((key.to_vec(), summary)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::ops;
    use super::super::types::{BlockRef, ObjectData};
    use super::super::{BUCKETS, OBJECTS, REFS, VERSIONS};
    use super::*;
    use crate::block::BlockHash;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Op {
        Put { key: u8, body: u8 },
        Delete { key: u8 },
        DeleteVersion { key: u8, pick: usize },
        State(Versioning),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..4, 0u8..4).prop_map(|(key, body)| Op::Put { key, body }),
            2 => (0u8..4).prop_map(|key| Op::Delete { key }),
            2 => (0u8..4, 0usize..6).prop_map(|(key, pick)| Op::DeleteVersion { key, pick }),
            1 => prop_oneof![Just(Versioning::Enabled), Just(Versioning::Suspended)].prop_map(Op::State),
        ]
    }

    /// A model version: (row version, null, body; `None` for a delete marker).
    type M = (u64, bool, Option<u8>);

    fn hash(body: u8) -> BlockHash {
        BlockHash([body; 32])
    }

    fn object(version: u64, body: u8) -> ObjectMeta {
        ObjectMeta {
            version,
            size: 1,
            etag: format!("e{body}"),
            last_modified_ms: 0,
            headers: Default::default(),
            checksum: None,
            parts: Vec::new(),
            data: ObjectData::Blocks(vec![BlockRef { hash: hash(body), len: 1 }]),
            sse_c: None,
            versioned: None,
        }
    }

    struct Model {
        state: Option<Versioning>,
        /// Unversioned bucket: the current object per key.
        plain: BTreeMap<u8, (u64, u8)>,
        /// Versioned bucket: the versions per key, newest first.
        versions: BTreeMap<u8, Vec<M>>,
    }

    impl Model {
        fn apply(&mut self, op: &Op, version: u64) {
            match (op, self.state) {
                (Op::Put { key, body }, None) => {
                    self.plain.insert(*key, (version, *body));
                }
                (Op::Delete { key }, None) => {
                    self.plain.remove(key);
                }
                (Op::DeleteVersion { .. }, None) => {}
                (Op::State(s), None) => {
                    for (k, (v, b)) in std::mem::take(&mut self.plain) {
                        self.versions.insert(k, vec![(v, true, Some(b))]);
                    }
                    self.state = Some(*s);
                }
                (Op::State(s), Some(_)) => self.state = Some(*s),
                (Op::Put { key, body }, Some(s)) => self.add(*key, s, Some(*body), version),
                (Op::Delete { key }, Some(s)) => self.add(*key, s, None, version),
                (Op::DeleteVersion { key, pick }, Some(_)) => {
                    let vs = self.versions.entry(*key).or_default();
                    if *pick < vs.len() {
                        vs.remove(*pick);
                    }
                }
            }
        }

        fn add(&mut self, key: u8, s: Versioning, body: Option<u8>, version: u64) {
            let vs = self.versions.entry(key).or_default();
            let null = s == Versioning::Suspended;
            if null {
                vs.retain(|v| !v.1);
            }
            vs.insert(0, (version, null, body));
        }

        /// The version a DeleteVersion names (the model's pick, or one that does not exist).
        fn named(&self, key: u8, pick: usize) -> VersionRef {
            match self.versions.get(&key).and_then(|vs| vs.get(pick)) {
                Some((_, true, _)) => VersionRef::Null,
                Some((v, false, _)) => VersionRef::Id(*v),
                None => VersionRef::Id(u64::MAX / 2),
            }
        }
    }

    fn name(key: u8) -> String {
        format!("k{key}")
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Random writes, deletes, deletes of versions and state changes
        /// leave the versions, the current objects and the block reference
        /// counts exactly as a model says.
        #[test]
        fn versions_current_objects_and_block_references_follow_a_model(ops_ in proptest::collection::vec(op(), 1..40)) {
            let dir = tempfile::tempdir().expect("tempdir");
            let db = redb::Database::create(dir.path().join("m.redb")).expect("db");
            let w = db.begin_write().expect("write");
            w.open_table(OBJECTS).expect("table");
            w.open_table(VERSIONS).expect("table");
            w.open_table(REFS).expect("table");
            w.open_table(BUCKETS).expect("table");
            ops::create_bucket(&w, "b", 0).expect("bucket");
            w.commit().expect("commit");
            let mut model = Model { state: None, plain: BTreeMap::new(), versions: BTreeMap::new() };
            for (i, o) in ops_.iter().enumerate() {
                let version = 100 + i as u64;
                let w = db.begin_write().expect("write");
                {
                    let t = Txn::new(&w, None);
                    match o {
                        Op::Put { key, body } => {
                            ops::write_object(&t, "b", &name(*key), object(version, *body), &Default::default())
                                .expect("put");
                        }
                        Op::Delete { key } => {
                            ops::delete_any(&t, "b", &name(*key), None, &Default::default(), version).expect("delete");
                        }
                        Op::DeleteVersion { key, pick } => {
                            let v = model.named(*key, *pick);
                            ops::delete_any(&t, "b", &name(*key), Some(v), &Default::default(), version)
                                .expect("delete a version");
                        }
                        Op::State(s) => set_versioning(&t, "b", *s).expect("state"),
                    }
                }
                w.commit().expect("commit");
                model.apply(o, version);
            }

            let r = db.begin_read().expect("read");
            let mut stored: BTreeMap<u8, Vec<M>> = BTreeMap::new();
            for row in r.open_table(VERSIONS).expect("versions").iter().expect("iter") {
                let (k, v) = row.expect("row");
                let key: u8 = std::str::from_utf8(&k.value().1[1..]).expect("utf8").parse().expect("key");
                let v: Version = postcard::from_bytes(v.value()).expect("decode");
                let body = match &v {
                    Version::Object(m) => Some(m.etag[1..].parse::<u8>().expect("body")),
                    Version::Marker(_) => None,
                };
                stored.entry(key).or_default().push((v.version(), v.is_null(), body));
            }
            let mut want = model.versions.clone();
            want.retain(|_, vs| !vs.is_empty());
            prop_assert_eq!(&stored, &want);
            // The current object is the latest version when it is one.
            let mut current: BTreeMap<u8, (u64, u8)> = BTreeMap::new();
            for row in r.open_table(OBJECTS).expect("objects").iter().expect("iter") {
                let (k, v) = row.expect("row");
                let key: u8 = std::str::from_utf8(&k.value().1[1..]).expect("utf8").parse().expect("key");
                let m: ObjectMeta = postcard::from_bytes(v.value()).expect("decode");
                current.insert(key, (m.version, m.etag[1..].parse().expect("body")));
            }
            let want_current: BTreeMap<u8, (u64, u8)> = match model.state {
                None => model.plain.clone(),
                Some(_) => want
                    .iter()
                    .filter_map(|(k, vs)| match vs.first() {
                        Some((v, _, Some(b))) => Some((*k, (*v, *b))),
                        _ => None,
                    })
                    .collect(),
            };
            prop_assert_eq!(&current, &want_current);
            // One reference per row (version or current object) using a block.
            let mut refs_want: BTreeMap<[u8; 32], u64> = BTreeMap::new();
            let bodies = want.values().flatten().filter_map(|v| v.2).chain(want_current.values().map(|c| c.1));
            for b in bodies {
                *refs_want.entry(hash(b).0).or_default() += 1;
            }
            let mut refs: BTreeMap<[u8; 32], u64> = BTreeMap::new();
            for row in r.open_table(REFS).expect("refs").iter().expect("iter") {
                let (k, v) = row.expect("row");
                refs.insert(k.value().try_into().expect("hash"), v.value());
            }
            prop_assert_eq!(refs, refs_want);
        }
    }
}
