//! Bucket versioning on a cluster, the coordinator's side.
//!
//! A versioned bucket's key keeps its replicated last-writer-wins row (the
//! current object, or a tombstone when the latest version is a delete
//! marker), and each replica of the key keeps the versions it received
//! ([`crate::meta::versions`]): a committed row tagged as a version, a
//! delete marker ([`Req::PutMarker`]). Versions are immutable and their ids
//! unique, so the replicas' sets merge by union ([`merge`]): a read asks a
//! read quorum, and R + W > N makes every acknowledged version part of the
//! answer; a version deleted for good is remembered where it was deleted
//! ([`Req::DropVersion`]) and dropped from the union, and of several `null`
//! versions only the newest counts.
//!
//! Deleting the latest version for good makes the one below it current
//! again: its row is written at a new row version, tagged
//! [`Versioned::Restored`] with the id it had, before the version is
//! dropped; both under the key's lease.
//!
//! A replica that misses a change of a key's versions gets it from the
//! resync queue, from the read repair of a version read, or, in a layout
//! change, from rebalancing ([`Coordinator::push_versions`]); the hash-tree
//! anti-entropy compares the current rows only.

use super::NodeId;
use super::coord::{Coordinator, union};
use super::list::{ROUND, Rounds, ask_every_node, lower_bound};
use super::rpc::{Msg, Req, Resp};
use crate::conditions::DeleteConditions;
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use crate::meta::ops::Removed;
use crate::meta::types::{DeleteMarker, ObjectMeta, Row, Version, Versioned, Versioning};
use crate::versioning::{self, VersionCursor, VersionPage, VersionQuery, VersionRef, VersionSummary, version_id};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

/// Merges the replicas' answers for one key: every version any of them
/// holds, less those any deleted for good, and of `null` versions only the
/// newest; newest first, each with the replicas that hold it.
pub fn merge(answers: Vec<(NodeId, Vec<Version>, Vec<u64>)>) -> Vec<(Version, Vec<NodeId>)> {
    let gone: HashSet<u64> = answers.iter().flat_map(|(_, _, g)| g.iter().copied()).collect();
    let mut by_id: BTreeMap<u64, (Version, Vec<NodeId>)> = BTreeMap::new();
    for (n, versions, _) in answers {
        for v in versions {
            if gone.contains(&v.version()) {
                continue;
            }
            by_id.entry(v.version()).or_insert_with(|| (v, Vec::new())).1.push(n);
        }
    }
    let mut out: Vec<(Version, Vec<NodeId>)> = by_id.into_values().rev().collect();
    let mut seen_null = false;
    out.retain(|(v, _)| {
        if !v.is_null() {
            return true;
        }
        let keep = !seen_null;
        seen_null = true;
        keep
    });
    out
}

/// [`merge`] for listing entries of many keys: (key, summary) in listing
/// order (key, then newest first).
pub fn merge_entries(
    answers: Vec<(Vec<(Vec<u8>, VersionSummary)>, Vec<(Vec<u8>, u64)>)>,
) -> Vec<(Vec<u8>, VersionSummary)> {
    let gone: HashSet<(Vec<u8>, u64)> = answers.iter().flat_map(|(_, g)| g.iter().cloned()).collect();
    let mut all: BTreeMap<(Vec<u8>, std::cmp::Reverse<u64>), VersionSummary> = BTreeMap::new();
    for (entries, _) in answers {
        for (k, s) in entries {
            if !gone.contains(&(k.clone(), s.version)) {
                all.insert((k, std::cmp::Reverse(s.version)), s);
            }
        }
    }
    let mut out: Vec<(Vec<u8>, VersionSummary)> = Vec::with_capacity(all.len());
    let mut null_of: Option<Vec<u8>> = None;
    for ((k, _), s) in all {
        if s.null {
            if null_of.as_ref() == Some(&k) {
                continue;
            }
            null_of = Some(k.clone());
        }
        out.push((k, s));
    }
    out
}

/// The versions of a bucket across the cluster, fetched in rounds from
/// every node and merged ([`merge_entries`]): the cursor of
/// ListObjectVersions.
struct ClusterVersions {
    coord: Arc<Coordinator>,
    rt: tokio::runtime::Handle,
    bucket: String,
    prefix: Vec<u8>,
    rounds: Rounds<VersionSummary>,
}

/// One round of [`ClusterVersions`]: every node's version summaries of
/// `bucket` from `from`, merged ([`merge_entries`]).
fn fetch_versions(
    coord: &Coordinator,
    rt: &tokio::runtime::Handle,
    bucket: &str,
    prefix: &[u8],
    from: Vec<u8>,
) -> Result<(Vec<(Vec<u8>, VersionSummary)>, Option<Vec<u8>>)> {
    let req = Req::VersionEntries { bucket: bucket.to_owned(), from, prefix: prefix.to_vec(), limit: ROUND };
    let mut answered: HashSet<NodeId> = HashSet::new();
    let mut answers = Vec::new();
    let mut bound: Option<Vec<u8>> = None;
    for (n, r) in ask_every_node(coord, rt, req) {
        let Ok(Msg { head: Resp::VersionEntries { entries, gone }, .. }) = r else { continue };
        answered.insert(n);
        lower_bound(&mut bound, entries.len(), entries.last().map(|(k, _)| k));
        answers.push((entries, gone));
    }
    coord.check_coverage(&answered, "version listing")?;
    Ok((merge_entries(answers), bound))
}

impl VersionCursor for ClusterVersions {
    fn seek(&mut self, from: &[u8]) -> Result<()> {
        self.rounds.seek(from);
        Ok(())
    }

    fn next(&mut self) -> Result<Option<(Vec<u8>, VersionSummary)>> {
        let (coord, rt, bucket, prefix) = (&self.coord, &self.rt, &self.bucket, &self.prefix);
        self.rounds.next(|from| fetch_versions(coord, rt, bucket, prefix, from))
    }
}

/// What the replicas of a key that answered hold of its versions.
struct KeyView {
    /// The merged versions ([`merge`]), newest first, with their holders.
    versions: Vec<(Version, Vec<NodeId>)>,
    /// Every version any of them deleted for good (or replaced, for `null`).
    gone: HashSet<u64>,
    /// Per replica that answered: the ids it holds and those it deleted.
    held: BTreeMap<NodeId, (HashSet<u64>, HashSet<u64>)>,
}

impl KeyView {
    /// The replicas that answered without some merged version or delete.
    fn behind(&self) -> Vec<NodeId> {
        self.held
            .iter()
            .filter(|(_, (held, gone))| {
                !self.gone.is_subset(gone)
                    || self.versions.iter().any(|(v, _)| !held.contains(&v.version()) && !gone.contains(&v.version()))
            })
            .map(|(n, _)| *n)
            .collect()
    }
}

impl Coordinator {
    /// A bucket's versioning state as this node holds it (every node holds
    /// every bucket row; one that missed a change gets it from the resync
    /// queue).
    pub fn bucket_versioning(&self, bucket: &str) -> Result<Option<Versioning>> {
        Ok(self.node.replica.bucket(bucket)?.and_then(|b| b.versioning))
    }

    /// Sets a bucket's versioning state on every node (a majority must take
    /// it; the others get it from the resync queue with the bucket row).
    pub async fn set_bucket_versioning(self: &Arc<Self>, bucket: &str, state: Versioning) -> Result<()> {
        self.require_bucket(bucket).await?;
        let req = Req::SetVersioning { bucket: bucket.to_owned(), state, at: self.node.hlc.now() };
        self.to_all_queue_missed(req, bucket, "put bucket versioning").await
    }

    /// What the replicas of a key hold of its versions: the answers of a
    /// read quorum (all its replicas are asked), and with `local` this
    /// node's own too (a node holding versions of a partition that moved
    /// away from it). Unavailable without a read quorum.
    async fn key_view(self: &Arc<Self>, bucket: &str, key: &[u8], local: bool) -> Result<KeyView> {
        let sets = self.node.write_sets(bucket, key);
        let calls = union(&sets).into_iter().map(|n| {
            let node = self.clone();
            let req = Req::KeyVersions { bucket: bucket.to_owned(), key: key.to_vec() };
            async move { (n, node.node.call(n, Msg::new(req)).await) }
        });
        let mut answers = Vec::new();
        let mut answered = HashSet::new();
        for (n, r) in futures::future::join_all(calls).await {
            match r {
                Ok(Msg { head: Resp::KeyVersions { versions, gone }, .. }) => {
                    answered.insert(n);
                    answers.push((n, versions, gone));
                }
                Ok(other) => tracing::debug!(node = n, answer = ?other.head, "unexpected answer to KeyVersions"),
                Err(e) => tracing::debug!(node = n, error = %e, "replica missed a version read"),
            }
        }
        for s in &sets {
            let got = s.iter().filter(|n| answered.contains(n)).count();
            if got < self.need_r(s.len()) {
                return Err(self.quorum_failed(&format!(
                    "only {got} of {} replicas answered a version read (read quorum {})",
                    s.len(),
                    self.need_r(s.len())
                )));
            }
        }
        if local && !answered.contains(&self.node.id) {
            let (versions, gone) = self.node.replica.key_versions(bucket, key)?;
            answers.push((self.node.id, versions, gone));
        }
        // Later rows of this key get versions above every version read.
        let newest = answers.iter().flat_map(|(_, v, g)| v.iter().map(Version::version).chain(g.iter().copied())).max();
        self.node.hlc.observe(newest.unwrap_or(0));
        let held = answers
            .iter()
            .map(|(n, v, g)| (*n, (v.iter().map(Version::version).collect(), g.iter().copied().collect())))
            .collect();
        let gone = answers.iter().flat_map(|(_, _, g)| g.iter().copied()).collect();
        Ok(KeyView { versions: merge(answers), gone, held })
    }

    /// The versions of a key, merged from a read quorum of its replicas
    /// ([`merge`]), newest first, each with the replicas holding it. A
    /// replica that answered without some of them (or without a delete of
    /// one) gets them in the background (read repair of versions).
    pub async fn key_versions(self: &Arc<Self>, bucket: &str, key: &[u8]) -> Result<Vec<(Version, Vec<NodeId>)>> {
        let view = Arc::new(self.key_view(bucket, key, false).await?);
        for n in view.behind() {
            let (coord, view, bucket, key) = (self.clone(), view.clone(), bucket.to_owned(), key.to_vec());
            tokio::spawn(async move {
                if let Err(e) = coord.push_versions(n, &bucket, &key, &view).await {
                    tracing::debug!(node = n, error = %e, "read repair of a key's versions failed");
                }
            });
        }
        Ok(view.versions.clone())
    }

    /// Brings replica `to` what `view` holds of a key's versions and it
    /// lacks: the deletes of versions, then each version (an object with
    /// the blocks it lacks, as [`Coordinator::push_row_of`] sends a row; a
    /// delete marker). Returns how many it got.
    async fn push_versions(self: &Arc<Self>, to: NodeId, bucket: &str, key: &[u8], view: &KeyView) -> Result<usize> {
        let (held, gone) = match view.held.get(&to) {
            Some(h) => h.clone(),
            None => {
                let req = Req::KeyVersions { bucket: bucket.to_owned(), key: key.to_vec() };
                match self.node.call(to, Msg::new(req)).await?.head {
                    Resp::KeyVersions { versions, gone } => {
                        (versions.iter().map(Version::version).collect(), gone.into_iter().collect())
                    }
                    other => {
                        return Err(LightningError::Unavailable(format!(
                            "unexpected answer to KeyVersions: {other:?}"
                        )));
                    }
                }
            }
        };
        let mut sent = 0;
        for id in view.gone.difference(&gone) {
            let drop = Req::DropVersion { bucket: bucket.to_owned(), key: key.to_vec(), id: *id };
            self.node.call(to, Msg::new(drop)).await?;
            sent += 1;
        }
        // Oldest first, so a replica holding none of them ends with the newest as its row.
        for (v, _) in view.versions.iter().rev() {
            if held.contains(&v.version()) || gone.contains(&v.version()) {
                continue;
            }
            match v {
                Version::Object(m) => {
                    self.push_row_of(to, bucket, key, &Row::Object(m.clone()), None).await?;
                }
                Version::Marker(marker) => {
                    let put = Req::PutMarker { bucket: bucket.to_owned(), key: key.to_vec(), marker: *marker };
                    self.node.call(to, Msg::new(put)).await?;
                }
            }
            sent += 1;
        }
        Ok(sent)
    }

    /// One page of ListObjectVersions of a bucket across the cluster.
    pub async fn list_bucket_versions(self: &Arc<Self>, bucket: &str, q: VersionQuery) -> Result<VersionPage> {
        let mut cur = ClusterVersions {
            coord: self.clone(),
            rt: tokio::runtime::Handle::current(),
            bucket: bucket.to_owned(),
            prefix: q.list.prefix.clone(),
            rounds: Rounds::new(),
        };
        tokio::task::spawn_blocking(move || versioning::page(&mut cur, &q))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }

    /// A DELETE without a version id in a bucket in `state`: if `cond`
    /// holds for the current object, a delete marker (a `null` one while
    /// versioning is suspended) becomes the key's latest version.
    pub async fn put_delete_marker(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        state: Versioning,
        cond: &DeleteConditions,
        even_degraded: bool,
    ) -> Result<Removed> {
        let mark = async {
            // Read first: the check, and a marker version above every
            // acknowledged write (the read moved the clock past them).
            let cur = self.read_row(bucket, key.as_bytes()).await?;
            if !cond.is_empty() {
                let current = match &cur.row {
                    Some(Row::Object(m)) => Some((m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))),
                    _ => None,
                };
                cond.check(current, key)?;
            }
            let marker = DeleteMarker {
                version: self.node.hlc.now(),
                last_modified_ms: now_ms(),
                null: state == Versioning::Suspended,
            };
            self.version_call(bucket, key.as_bytes(), || Req::PutMarker {
                bucket: bucket.to_owned(),
                key: key.as_bytes().to_vec(),
                marker,
            })
            .await?;
            Ok(Removed { version_id: Some(version_id(marker.version, marker.null)), delete_marker: true })
        };
        if cond.is_empty() {
            mark.await
        } else if even_degraded {
            self.with_key_lease_even_degraded(bucket, key.as_bytes(), mark).await
        } else {
            self.with_key_lease(bucket, key.as_bytes(), mark).await
        }
    }

    /// A DELETE of version `v` of a key of a versioned bucket: removes it
    /// for good if `cond` holds for it (one that does not exist is no error
    /// without conditions). When it was the latest, the next newest version
    /// becomes current first (or a tombstone, if that is a delete marker or
    /// there is none). Under the key's lease.
    pub async fn delete_version(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        v: VersionRef,
        cond: &DeleteConditions,
    ) -> Result<Removed> {
        let named = || Removed {
            version_id: Some(match v {
                VersionRef::Null => "null".into(),
                VersionRef::Id(id) => version_id(id, false),
            }),
            delete_marker: false,
        };
        self.with_key_lease(bucket, key.as_bytes(), async {
            let versions = self.key_versions(bucket, key.as_bytes()).await?;
            let Some(pos) = versions.iter().position(|(x, _)| v.names(x.version(), x.is_null())) else {
                cond.check(None, key)?;
                return Ok(named());
            };
            let target = &versions[pos].0;
            match target {
                Version::Object(m) => {
                    cond.check(Some((m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))), key)?
                }
                Version::Marker(_) => cond.check(None, key)?,
            }
            if pos == 0 {
                // The read moved the clock past every version: the new row is newer.
                let row = match versions.get(1).map(|(x, _)| x) {
                    Some(Version::Object(next)) => Row::Object(ObjectMeta {
                        version: self.node.hlc.now(),
                        versioned: Some(Versioned::Restored { id: next.version, null: next.is_null_version() }),
                        ..next.clone()
                    }),
                    _ => Row::Tombstone(self.node.hlc.now()),
                };
                self.restore_row(bucket, key.as_bytes(), &row).await?;
            }
            let id = target.version();
            self.version_call(bucket, key.as_bytes(), || Req::DropVersion {
                bucket: bucket.to_owned(),
                key: key.as_bytes().to_vec(),
                id,
            })
            .await?;
            Ok(Removed { version_id: Some(target.id()), delete_marker: matches!(target, Version::Marker(_)) })
        })
        .await
    }

    /// Sends a change of a key's versions to its replicas (a write quorum
    /// must take it); the ones that missed it are queued for resync of the
    /// key, which brings them the key's markers and deletes of versions
    /// ([`Coordinator::resync_versions`]).
    async fn version_call(self: &Arc<Self>, bucket: &str, key: &[u8], make: impl Fn() -> Req) -> Result<()> {
        let targets = union(&self.node.write_sets(bucket, key));
        let ok = self.quorum_call(bucket, key, &targets, make).await?;
        let missed: Vec<NodeId> = targets.into_iter().filter(|n| !ok.contains(n)).collect();
        if !missed.is_empty() {
            self.queue_missed(bucket, key, &missed).await?;
        }
        Ok(())
    }

    /// The resync of a versioned key's versions to replica `to` (after its
    /// row): what a read quorum holds and it lacks ([`Coordinator::push_versions`]).
    pub async fn resync_versions(self: &Arc<Self>, to: NodeId, bucket: &str, key: &[u8]) -> Result<()> {
        let view = self.key_view(bucket, key, false).await?;
        self.push_versions(to, bucket, key, &view).await.map(drop)
    }

    /// Rebalancing of a key's versions: every replica of the key (in the
    /// layout in force) gets what it lacks of the versions a read quorum
    /// and this node hold (this node may hold those of a partition that
    /// moved away from it). Returns how many were sent.
    pub async fn rebalance_versions(self: &Arc<Self>, bucket: &str, key: &[u8]) -> Result<usize> {
        let view = self.key_view(bucket, key, true).await?;
        let mut sent = 0;
        for to in self.node.replicas(bucket, key) {
            if to != self.node.id {
                sent += self.push_versions(to, bucket, key, &view).await?;
            }
        }
        Ok(sent)
    }

    /// Writes a key's current row whose blocks may be missing on some of
    /// its replicas (a version made current again): each replica gets the
    /// blocks it lacks first, then the row.
    /// A replica holding a newer row took a write that came after the read
    /// (unconditional writes take no lease): that write is the newest
    /// version, so the restored row is not committed again above it.
    async fn restore_row(self: &Arc<Self>, bucket: &str, key: &[u8], row: &Row) -> Result<()> {
        self.fill_attempt(bucket, key, row, None).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::types::{ObjectData, ObjectHeaders};

    fn object(version: u64, versioned: Versioned) -> Version {
        Version::Object(ObjectMeta {
            version,
            size: 1,
            etag: format!("e{version}"),
            last_modified_ms: 0,
            headers: ObjectHeaders::default(),
            checksum: None,
            parts: Vec::new(),
            data: ObjectData::Inline(vec![1]),
            sse_c: None,
            versioned: Some(versioned),
        })
    }

    fn marker(version: u64, null: bool) -> Version {
        Version::Marker(DeleteMarker { version, last_modified_ms: 0, null })
    }

    /// The union of what the replicas hold, less what any deleted for good,
    /// one `null` version (the newest), newest first, with the holders.
    #[test]
    fn replicas_versions_merge_by_union_less_the_deleted_and_older_nulls() {
        let a = (1, vec![object(9, Versioned::Id), object(5, Versioned::Null), object(3, Versioned::Id)], vec![]);
        let b = (2, vec![marker(12, false), object(9, Versioned::Id), object(7, Versioned::Null)], vec![3]);
        let c = (3, vec![object(3, Versioned::Id)], vec![]);
        let got: Vec<(u64, Vec<NodeId>)> = merge(vec![a, b, c])
            .into_iter()
            .map(|(v, mut n)| {
                (v.version(), {
                    n.sort_unstable();
                    n
                })
            })
            .collect();
        assert_eq!(got, vec![(12, vec![2]), (9, vec![1, 2]), (7, vec![2])]);
        let entries = |key: &[u8], v: &Version| (key.to_vec(), crate::meta::versions::summary(v));
        let one = (
            vec![entries(b"a", &object(4, Versioned::Id)), entries(b"b", &object(6, Versioned::Null))],
            vec![(b"a".to_vec(), 2)],
        );
        let two = (
            vec![
                entries(b"a", &object(4, Versioned::Id)),
                entries(b"a", &object(2, Versioned::Id)),
                entries(b"b", &object(8, Versioned::Null)),
                entries(b"b", &object(6, Versioned::Null)),
            ],
            vec![],
        );
        let got: Vec<(Vec<u8>, u64)> = merge_entries(vec![one, two]).into_iter().map(|(k, s)| (k, s.version)).collect();
        assert_eq!(got, vec![(b"a".to_vec(), 4), (b"b".to_vec(), 8)]);
    }
}
