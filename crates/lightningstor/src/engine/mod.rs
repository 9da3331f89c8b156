//! The engine interface the S3 front end ([`crate::s3`]) runs on: what S3
//! needs of a place that keeps buckets, objects and uploads, and nothing of
//! how it keeps them.
//!
//! Two engines implement it: the local store (`Arc<Store>`, [`local`]) and
//! the cluster coordinator (`Arc<Coordinator>`, in `cluster::engine`), which
//! turns each call into quorum requests to the key's replicas. A single
//! node is served by the same front end as a cluster. The front end parses
//! the request, refuses options it does not implement, verifies bodies and
//! checksums, handles SSE-C and answers; an engine stores and finds, checks
//! write conditions atomically with its commit, and assembles uploads.
//!
//! The calls are shaped by the S3 operations: a PUT stages its body
//! ([`Engine::stage`]), the front end verifies it, and commits the row
//! with the request's write conditions ([`Engine::commit`]), which the
//! engine checks atomically with the commit (in the metadata transaction,
//! or under the key's lease in a cluster). Versions of rows are the
//! engine's to give: a row handed to `commit` has its version set there.

pub mod local;

use crate::checksum::{Checksum, ChecksumAlgo};
use crate::conditions::DeleteConditions;
use crate::config::Config;
use crate::error::Result;
use crate::keys::Keyring;
use crate::lifecycle::Rule;
use crate::listing::{ListPage, ListQuery};
use crate::meta::ops::{Claimed, CompletedPart, Removed, WriteConditions};
use crate::meta::types::{ObjectData, ObjectMeta, ObjectSummary, PartMeta, UploadMeta, Versioning};
use crate::metrics::Metrics;
use crate::versioning::{VersionPage, VersionQuery, VersionRef};
use bytes::Bytes;
use futures::Stream;
use futures::stream::BoxStream;
use std::future::Future;
use std::ops::Range;

/// A body written to the engine's blocks, not yet referenced by a row.
#[derive(Debug)]
pub struct Staged<H> {
    /// Bytes received.
    pub size: u64,
    /// MD5 of the bytes stored.
    pub md5: [u8; 16],
    /// The extra checksum computed, if one was asked for.
    pub checksum: Option<Checksum>,
    /// Inline bytes or the block list.
    pub data: ObjectData,
    /// What keeps the blocks until a row references them (pins, a replica
    /// session); given back to [`Engine::commit`] or [`Engine::put_part`].
    /// Dropped uncommitted, the blocks are collected: at once on the local
    /// store, after the replicas' session timeout in a cluster.
    pub hold: H,
}

/// Where buckets, objects and multipart uploads are kept: the local store
/// or the cluster. Every failure is a [`crate::LightningError`] the front
/// end turns into the S3 error.
pub trait Engine: Send + Sync + 'static {
    /// Keeps a staged body's blocks until its row commits.
    type Hold: Send + 'static;
    /// Where an object's bytes are read from (nothing for the local store,
    /// the replicas that hold the row for a cluster).
    type Source: Send + 'static;

    /// The node's configuration (region, keys, limits).
    fn config(&self) -> &Config;
    /// The request counters exported at /metrics.
    fn metrics(&self) -> &Metrics;
    /// Access keys and grants.
    fn keyring(&self) -> &dyn Keyring;

    /// Creates a bucket; BucketAlreadyExists if it exists.
    fn create_bucket(&self, name: &str) -> impl Future<Output = Result<()>> + Send;
    /// NoSuchBucket unless the bucket exists.
    fn require_bucket(&self, name: &str) -> impl Future<Output = Result<()>> + Send;
    /// Deletes a bucket holding no object (its uploads in progress go with
    /// it); NoSuchBucket, BucketNotEmpty.
    fn delete_bucket(&self, name: &str) -> impl Future<Output = Result<()>> + Send;
    /// Every bucket, with its creation time (Unix ms).
    fn list_buckets(&self) -> impl Future<Output = Result<Vec<(String, i64)>>> + Send;
    /// A bucket's lifecycle rules (none when it has no configuration).
    fn lifecycle(&self, bucket: &str) -> impl Future<Output = Result<Vec<Rule>>> + Send;
    /// Replaces a bucket's lifecycle rules (no rules deletes the configuration).
    fn set_lifecycle(&self, bucket: &str, rules: Vec<Rule>) -> impl Future<Output = Result<()>> + Send;

    /// The current object of a key, and where its bytes are (no bucket check).
    fn get(&self, bucket: &str, key: &str) -> impl Future<Output = Result<Option<(ObjectMeta, Self::Source)>>> + Send;
    /// Streams `range` of an object found by [`Engine::get`], every block verified.
    fn read(&self, meta: &ObjectMeta, from: Self::Source, range: Range<u64>) -> BoxStream<'static, Result<Bytes>>;
    /// Streams a body into blocks for (bucket, key), computing its MD5 and
    /// `algo` on the way; a small body stays inline when `inline` allows.
    fn stage<S, E>(
        &self,
        bucket: &str,
        key: &str,
        body: S,
        algo: Option<ChecksumAlgo>,
        inline: bool,
    ) -> impl Future<Output = Result<Staged<Self::Hold>>> + Send
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display + Send;
    /// Makes the bytes of `src` (found by [`Engine::get`]) referable by a
    /// row of (bucket, key) without changing them: the data to put in that
    /// row and what keeps it until the row commits.
    fn copy_data(
        &self,
        bucket: &str,
        key: &str,
        src: &ObjectMeta,
        from: Self::Source,
    ) -> impl Future<Output = Result<(ObjectData, Self::Hold)>> + Send;
    /// Commits `row` (its version set here) as the object of (bucket, key)
    /// if `cond` holds for the current object, checked atomically with the
    /// commit; returns the row committed. NoSuchBucket, PreconditionFailed.
    fn commit(
        &self,
        bucket: &str,
        key: &str,
        row: ObjectMeta,
        hold: Self::Hold,
        cond: &WriteConditions,
    ) -> impl Future<Output = Result<ObjectMeta>> + Send;
    /// Deletes the object of (bucket, key), or its version `version`, if
    /// `cond` holds, checked atomically with the delete (a missing key is
    /// no error without conditions). In a versioned bucket a delete without
    /// a version makes a delete marker. NoSuchBucket, PreconditionFailed.
    fn delete(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionRef>,
        cond: &DeleteConditions,
    ) -> impl Future<Output = Result<Removed>> + Send;
    /// [`Engine::delete`] for many keys of an existing bucket: one result
    /// per key, in order. Locally an error of the store fails the whole
    /// call; in a cluster a key whose quorum or lease failed gets its own
    /// ServiceUnavailable entry and the call succeeds.
    fn delete_many(
        &self,
        bucket: &str,
        keys: Vec<(String, Option<VersionRef>, DeleteConditions)>,
    ) -> impl Future<Output = Result<Vec<Result<Removed>>>> + Send;
    /// One listing page of a bucket. NoSuchBucket.
    fn list(&self, bucket: &str, q: ListQuery) -> impl Future<Output = Result<ListPage<ObjectSummary>>> + Send;

    /// A bucket's versioning state (`None`: never set). NoSuchBucket.
    fn versioning(&self, bucket: &str) -> impl Future<Output = Result<Option<Versioning>>> + Send;
    /// Sets a bucket's versioning state (the first time, the objects it
    /// holds become their keys' `null` versions). NoSuchBucket.
    fn set_versioning(&self, bucket: &str, state: Versioning) -> impl Future<Output = Result<()>> + Send;
    /// Version `version` of (bucket, key) and where its bytes are:
    /// NoSuchVersion, or DeleteMarker (`named`) for a delete marker. In a
    /// bucket that never had versioning only the `null` version, the
    /// current object, exists.
    fn get_version(
        &self,
        bucket: &str,
        key: &str,
        version: VersionRef,
    ) -> impl Future<Output = Result<(ObjectMeta, Self::Source)>> + Send;
    /// The id of the delete marker that is the latest version of (bucket,
    /// key), if it is one (asked when [`Engine::get`] found no object).
    fn latest_marker(&self, bucket: &str, key: &str) -> impl Future<Output = Result<Option<String>>> + Send;
    /// One page of a bucket's versions and delete markers. NoSuchBucket.
    fn list_versions(&self, bucket: &str, q: VersionQuery) -> impl Future<Output = Result<VersionPage>> + Send;

    /// Records a new multipart upload `id`. NoSuchBucket.
    fn create_upload(&self, id: &str, upload: UploadMeta) -> impl Future<Output = Result<()>> + Send;
    /// Upload `id` of (bucket, key). NoSuchUpload.
    fn upload(&self, bucket: &str, key: &str, id: &str) -> impl Future<Output = Result<UploadMeta>> + Send;
    /// Stores part `number` of `upload` (replacing an earlier one), whose
    /// blocks `hold` keeps. NoSuchUpload.
    fn put_part(
        &self,
        id: &str,
        upload: &UploadMeta,
        number: u32,
        part: PartMeta,
        hold: Self::Hold,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Upload `id` of (bucket, key) and up to `limit` of its parts numbered
    /// above `after`, in number order. NoSuchUpload.
    fn parts(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        after: u32,
        limit: usize,
    ) -> impl Future<Output = Result<(UploadMeta, Vec<(u32, PartMeta)>)>> + Send;
    /// Turns upload `id` into the object of (bucket, key): `accept` sees
    /// the upload first, then the `wanted` parts are assembled, checked
    /// against `claimed` and committed under `cond`, and the upload is
    /// gone. Returns the object committed. NoSuchUpload, InvalidPart,
    /// PreconditionFailed, ...
    #[allow(clippy::too_many_arguments)]
    fn complete_upload(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        wanted: Vec<CompletedPart>,
        claimed: Claimed,
        cond: WriteConditions,
        accept: impl FnOnce(&UploadMeta) -> Result<()> + Send,
    ) -> impl Future<Output = Result<ObjectMeta>> + Send;
    /// Drops upload `id` of (bucket, key) and its parts. NoSuchUpload.
    fn abort_upload(&self, bucket: &str, key: &str, id: &str) -> impl Future<Output = Result<()>> + Send;
    /// The uploads in progress in a bucket whose keys start with `prefix`,
    /// as (key, id, upload) in key then id order, past the markers. NoSuchBucket.
    fn uploads(
        &self,
        bucket: &str,
        prefix: &str,
        key_marker: Option<&str>,
        id_marker: Option<&str>,
    ) -> impl Future<Output = Result<Vec<(String, String, UploadMeta)>>> + Send;
}
