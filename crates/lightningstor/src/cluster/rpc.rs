//! Node-to-node messages and their framing (sans-IO).
//!
//! A message is a postcard-encoded head plus an optional raw data part (a
//! block), so block bytes are never copied through the serializer. On a
//! stream each message is one frame:
//!
//! ```text
//! +-----------------+-----------------+--------------+-------------+
//! | head_len u32 LE | data_len u32 LE | head (postcard) | data       |
//! +-----------------+-----------------+--------------+-------------+
//! ```

use crate::block::BlockHash;
use crate::error::{LightningError, Result};
use crate::meta::types::{PartMeta, RawEntry, Row, UploadMeta};
use bytes::{Buf, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Largest head accepted (listings, digests).
pub const MAX_HEAD: usize = 64 * 1024 * 1024;
/// Largest data part accepted (one block).
pub const MAX_DATA: usize = 65 * 1024 * 1024;

/// Requests one node sends another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Req {
    /// Liveness and layout version check.
    Ping,
    /// Store the data part as block `hash`, pinned by upload `session` until it commits.
    PutBlock { session: u64, hash: BlockHash },
    /// Replace a corrupt or missing copy of `hash` with the data part.
    RepairBlock { hash: BlockHash },
    /// Read a block (answered with [`Resp::Block`] and the data part).
    GetBlock { hash: BlockHash },
    /// Which of these blocks are absent here.
    MissingBlocks { hashes: Vec<BlockHash> },
    /// Merge a row (object or tombstone); releases `session`'s pins.
    Commit {
        session: u64,
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        row: Row,
    },
    /// The replica's row for a key.
    GetRow {
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// Create a bucket row if missing.
    CreateBucket { name: String, created_ms: i64 },
    /// Whether a bucket row exists.
    HeadBucket { name: String },
    /// Drop a bucket row and remember it deleted; refused (BucketNotEmpty)
    /// while an object row of it is here.
    DeleteBucket { name: String },
    /// Every bucket row.
    ListBuckets,
    /// Store these key and grant rows (each only if newer than the one held).
    MergeAuth { rows: Vec<crate::keys::AuthRow> },
    /// Raw rows (objects and tombstones) of a bucket from `from`.
    ListRaw { bucket: String, from: Vec<u8>, prefix: Vec<u8>, limit: u32 },
    /// One digest per partition of (bucket, key, version) rows held here.
    Digests { partitions: Vec<u32> },
    /// The rows of one partition: (bucket, key, version, tombstone).
    PartitionRows { partition: u32 },
    /// Node health and repair backlog.
    Status,
    /// Record multipart upload `id` (idempotent; refused once it is gone).
    CreateUpload { id: String, upload: UploadMeta },
    /// Store a part whose blocks were sent under `session` (creates the
    /// upload first if this replica missed it); releases the session's pins.
    PutPart { session: u64, id: String, upload: UploadMeta, number: u32, part: PartMeta },
    /// The state of upload `id`, with its parts when `parts` is set.
    GetUpload { id: String, parts: bool },
    /// Drop upload `id` and remember it as gone (complete and abort).
    DropUpload { id: String, bucket: String },
    /// The uploads of a bucket in progress here, and those gone.
    ListUploads { bucket: String, prefix: String },
    /// The cluster file this node runs with (TOML), for `cluster layout apply`.
    GetConfig,
    /// Start a layout change from cluster file `old` to `new` (TOML):
    /// writes reach both replica sets until [`Req::FinishLayout`].
    ChangeLayout { old: String, new: String },
    /// Push every row held here to its replicas under the new layout;
    /// answered with the number of rows pushed.
    Rebalance,
    /// Drop the previous layout (every node has rebalanced).
    FinishLayout,
    /// Lease (bucket, key) to `token` for `ttl_ms` unless another token
    /// holds it; answered with whether it was granted.
    LockKey { bucket: String, key: Vec<u8>, token: u64, ttl_ms: u32 },
    /// Release a lease held by `token`.
    UnlockKey { bucket: String, key: Vec<u8>, token: u64 },
    /// Only the version of the replica's row for a key (0: none), answered
    /// with [`Resp::Version`]: what a read asks of the replicas it does not
    /// read the row from.
    RowVersion {
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// The hashes of anti-entropy tree nodes (partition, node), answered
    /// with [`Resp::Digests`] in request order (see [`crate::meta::merkle`]).
    TreeNodes { nodes: Vec<(u32, u16)> },
    /// The rows of tree leaves (partition, leaf), answered with [`Resp::Versions`].
    LeafRows { leaves: Vec<(u32, u8)> },
    /// Store a bucket's lifecycle configuration unless a newer one is held
    /// (creates the bucket row if this node missed it).
    SetLifecycle { bucket: String, lifecycle: crate::lifecycle::Lifecycle },
    /// The bucket's lifecycle configuration held here.
    GetLifecycle { bucket: String },
    /// The versions of the rows of several keys (0: none), answered with
    /// [`Resp::RowVersions`] in request order: the version asks of the reads
    /// a coordinator has under way to one replica, sent as one message
    /// (see [`super::batch`]).
    RowVersions { keys: Vec<(String, serde_bytes::ByteBuf)> },
    // New variants go last: postcard names a variant by its position, so
    // a variant in the middle would renumber the others for a node of an
    // older build (which would read a HeadBucket as a DeleteBucket).
    /// Merge the object row of completed upload `id` and drop the upload
    /// (remembered as gone) in one transaction; releases `session`'s pins.
    /// Refused with NoSuchUpload when the upload is already gone there.
    CompleteUpload {
        session: u64,
        id: String,
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        row: Row,
    },
    /// Create the bucket row unless it is here, or this node deleted the
    /// bucket at or after `created_ms` (the creation time of the row the
    /// coordinator holds). A node that missed the bucket's create after
    /// deleting it (down, or cut off, then) takes it, so it stops refusing
    /// the new bucket's writes; a write racing the delete, whose
    /// coordinator holds the old row, does not bring the bucket back.
    /// Answered with [`Resp::Flag`]: whether the bucket is here now.
    CreateBucketSince { name: String, created_ms: i64 },
    /// Delete the bucket as [`Req::DeleteBucket`] does, unless the row held
    /// here was created after `deleted_ms` (the time the coordinator of the
    /// delete deleted it): a delete that reaches a node late, from the
    /// resync queue, must not delete the bucket created again since.
    /// Remembers the bucket as deleted at `deleted_ms` (or later, if it
    /// already was). Answered with [`Resp::Flag`]: whether it deleted a row.
    DeleteBucketBefore { name: String, deleted_ms: i64 },
    /// Create the bucket again after a refused delete: a node that deleted
    /// it forgets the delete and takes a row created at `created_ms` with
    /// `lifecycle`; a node that holds the row keeps it with its
    /// configuration (a newer `lifecycle` replaces its own) and takes the
    /// later creation time. One transaction, so no configuration is lost
    /// between a create and a lifecycle put. Answered with [`Resp::Ok`].
    RecreateBucket { name: String, created_ms: i64, lifecycle: Option<crate::lifecycle::Lifecycle> },
    /// Anti-entropy of lifecycle configurations: (bucket, creation time of
    /// the sender's row, configuration). A node takes a configuration
    /// newer than its own for a bucket whose row it holds with the same
    /// creation time (a configuration of an older or newer incarnation of
    /// the bucket is not its own), as [`Req::SetLifecycle`] would; an
    /// empty configuration is a delete. Answered with [`Resp::Count`]: how
    /// many it took.
    MergeLifecycles { rows: Vec<(String, i64, crate::lifecycle::Lifecycle)> },
    /// Set a bucket's versioning state, changed at HLC version `at` (taken
    /// unless the node holds a newer change; the first change makes the
    /// objects held there their keys' `null` versions). [`Resp::Flag`]:
    /// whether it took it.
    SetVersioning { bucket: String, state: crate::meta::types::Versioning, at: u64 },
    /// Every version of a key held here and the ids of those deleted for
    /// good here ([`Resp::KeyVersions`]).
    KeyVersions {
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// Up to `limit` version summaries of `bucket` from key `from` with
    /// `prefix` (and the rest of the last key's), with the versions deleted
    /// for good among them ([`Resp::VersionEntries`]).
    VersionEntries { bucket: String, from: Vec<u8>, prefix: Vec<u8>, limit: u32 },
    /// A delete marker becomes a version of the key, and the key's row a
    /// tombstone at the marker's version (as [`Req::Commit`] merges it).
    /// [`Resp::Committed`].
    PutMarker {
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        marker: crate::meta::types::DeleteMarker,
    },
    /// Version `id` of a key is deleted for good (remembered, so it is not
    /// taken again). [`Resp::Flag`]: whether it was held here.
    DropVersion {
        bucket: String,
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        id: u64,
    },
}

/// Answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Resp {
    /// Done.
    Ok,
    /// Yes or no (bucket created or present, lease granted).
    Flag(bool),
    /// A block; the bytes are the data part.
    Block,
    /// Absent blocks.
    Missing(Vec<BlockHash>),
    /// A row, if any.
    Row(Option<Row>),
    /// Buckets with creation times.
    Buckets(Vec<(String, i64)>),
    /// Raw listing rows.
    Raw(Vec<(Vec<u8>, RawEntry)>),
    /// Partition digests or tree node hashes, in request order.
    Digests(Vec<[u8; 32]>),
    /// Rows of a partition or of tree leaves: (bucket, key, version, tombstone).
    Versions(Vec<(String, Vec<u8>, u64, bool)>),
    /// Node status.
    Status(NodeStatus),
    /// The request failed on the remote node.
    Err(RemoteError),
    /// An upload's state on a replica.
    Upload(UploadState),
    /// Uploads of a bucket: (key, id, upload) in progress, and ids gone.
    Uploads { live: Vec<(String, String, UploadMeta)>, gone: Vec<String> },
    /// A cluster file (TOML).
    Config(String),
    /// A count (rows pushed by a rebalance round).
    Count(u64),
    /// Answer to a commit: whether the row was applied, and the version
    /// the replica holds for the key afterwards (above the row's when a
    /// newer write got there first).
    Committed { applied: bool, current: u64 },
    /// The version of a row (0: no row).
    Version(u64),
    /// A bucket's lifecycle configuration, if the node holds one.
    Lifecycle(Option<crate::lifecycle::Lifecycle>),
    /// Row versions, in the order of a [`Req::RowVersions`].
    RowVersions(Vec<u64>),
    // New variants go last (see [`Req`]).
    /// The request is one this node's build does not know (a newer node's
    /// request during a rolling upgrade): its frame was read whole, its
    /// head did not decode. The caller may fall back to an older request;
    /// the connection stays usable. The text says which request it was.
    Unsupported(String),
    /// The versions of a key held by a replica (newest first) and the row
    /// versions of those it deleted for good.
    KeyVersions { versions: Vec<crate::meta::types::Version>, gone: Vec<u64> },
    /// A replica's version summaries of a key range, and the (key, row
    /// version) it deleted for good there.
    VersionEntries { entries: Vec<(Vec<u8>, crate::versioning::VersionSummary)>, gone: Vec<(Vec<u8>, u64)> },
}

/// What a replica knows of a multipart upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum UploadState {
    /// Never seen here.
    Absent,
    /// Completed or aborted: it can never come back.
    Gone,
    /// In progress, with the parts stored here (when asked for).
    Live(UploadMeta, Vec<(u32, PartMeta)>),
}

/// Status a node reports to `cluster status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Layout version the node runs.
    pub layout_version: u64,
    /// Entries in the node's resync queue.
    pub resync_queue: u64,
    /// Objects stored.
    pub objects: u64,
    /// Blocks stored.
    pub blocks: u64,
    /// Repairs done (resync, read repair, anti-entropy, scrub).
    pub repairs: u64,
    /// Corrupt blocks found.
    pub corrupt_blocks: u64,
    /// Version of the layout being moved away from, while a change is in progress.
    pub previous_layout: Option<u64>,
    /// The file system and device under the node's data dir.
    pub data_dir_fs: hostinfo::FsInfo,
    /// Block files are written with `O_DIRECT` (see [`crate::block::DirectIo`]).
    pub o_direct: bool,
    /// `O_DIRECT` was chosen when the store opened, but a write was refused
    /// with EINVAL: block writes go through the page cache since.
    pub o_direct_fell_back: bool,
    /// The machine the node runs on.
    pub host: hostinfo::Host,
}

/// A failure reported by a remote node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteError {
    /// The block failed verification there.
    Corrupt(String),
    /// The block is not there.
    Missing(String),
    /// Anything else.
    Other(String),
    /// The multipart upload is gone (completed or aborted) there.
    NoSuchUpload(String),
    /// The bucket was deleted there.
    NoSuchBucket(String),
    /// The bucket holds an object there.
    BucketNotEmpty(String),
}

impl From<&LightningError> for RemoteError {
    fn from(e: &LightningError) -> Self {
        match e {
            LightningError::CorruptBlock { hash } => RemoteError::Corrupt(hash.clone()),
            LightningError::MissingBlock { hash } => RemoteError::Missing(hash.clone()),
            LightningError::NoSuchUpload(id) => RemoteError::NoSuchUpload(id.clone()),
            LightningError::NoSuchBucket(b) => RemoteError::NoSuchBucket(b.clone()),
            LightningError::BucketNotEmpty(b) => RemoteError::BucketNotEmpty(b.clone()),
            other => RemoteError::Other(other.to_string()),
        }
    }
}

impl From<RemoteError> for LightningError {
    fn from(e: RemoteError) -> Self {
        match e {
            RemoteError::Corrupt(hash) => LightningError::CorruptBlock { hash },
            RemoteError::Missing(hash) => LightningError::MissingBlock { hash },
            RemoteError::Other(m) => LightningError::Unavailable(format!("replica: {m}")),
            RemoteError::NoSuchUpload(id) => LightningError::NoSuchUpload(id),
            RemoteError::NoSuchBucket(b) => LightningError::NoSuchBucket(b),
            RemoteError::BucketNotEmpty(b) => LightningError::BucketNotEmpty(b),
        }
    }
}

/// A message: head and data part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Msg<T> {
    /// What it is.
    pub head: T,
    /// Block bytes, if any.
    pub data: Bytes,
}

impl<T> Msg<T> {
    /// A message without data.
    pub fn new(head: T) -> Self {
        Msg { head, data: Bytes::new() }
    }

    /// A message carrying `data`.
    pub fn with_data(head: T, data: Bytes) -> Self {
        Msg { head, data }
    }
}

impl Msg<Resp> {
    /// The answer, or the remote failure as an error.
    pub fn ok(self) -> Result<Msg<Resp>> {
        match self.head {
            Resp::Err(e) => Err(e.into()),
            Resp::Unsupported(m) => Err(LightningError::UnsupportedRequest(m)),
            _ => Ok(self),
        }
    }
}

/// Encodes a frame header plus head; the data part follows on the wire.
pub fn encode<T: Serialize>(m: &Msg<T>) -> Result<Vec<u8>> {
    let head = postcard::to_allocvec(&m.head)?;
    let mut out = Vec::with_capacity(8 + head.len());
    out.extend_from_slice(&u32::try_from(head.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&u32::try_from(m.data.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&head);
    Ok(out)
}

/// Lengths from an 8-byte frame header, checked against the limits.
pub fn frame_lengths(h: [u8; 8]) -> Result<(usize, usize)> {
    let head = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    let data = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if head > MAX_HEAD || data > MAX_DATA {
        return Err(LightningError::Unavailable(format!("oversized frame ({head} + {data} bytes)")));
    }
    Ok((head, data))
}

/// The answer to a whole frame (`frame`: header, head and data) whose head
/// is no request of this build: [`Resp::Unsupported`] naming the request's
/// variant number, which postcard writes first (a varint).
pub fn unsupported(frame: &[u8]) -> Resp {
    let head = frame.get(8..).unwrap_or_default();
    let variant = postcard::take_from_bytes::<u32>(head).map(|(v, _)| v);
    Resp::Unsupported(match variant {
        Ok(v) => format!("request variant {v} is not one this node's build knows"),
        Err(_) => "the request's head is not one this node's build can decode".to_owned(),
    })
}

/// Decodes one whole frame from `buf`, if it holds one; consumes it.
pub fn decode<T: for<'de> Deserialize<'de>>(buf: &mut BytesMut) -> Result<Option<Msg<T>>> {
    if buf.len() < 8 {
        return Ok(None);
    }
    let (hl, dl) = frame_lengths([buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7]])?;
    if buf.len() < 8 + hl + dl {
        return Ok(None);
    }
    buf.advance(8);
    let head_bytes = buf.split_to(hl);
    let data = buf.split_to(dl).freeze();
    let head = postcard::from_bytes(&head_bytes)?;
    Ok(Some(Msg { head, data }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(m: &Msg<Req>) -> BytesMut {
        let mut b = BytesMut::from(&encode(m).expect("encode")[..]);
        b.extend_from_slice(&m.data);
        b
    }

    proptest! {
        #[test]
        fn frames_round_trip_and_partial_frames_wait(
            key in proptest::collection::vec(any::<u8>(), 0..100),
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            cut in 0usize..4000,
        ) {
            let m = Msg::with_data(
                Req::ListRaw { bucket: "b".into(), from: key.clone(), prefix: key, limit: 7 },
                Bytes::from(data),
            );
            let full = frame(&m);
            let cut = cut.min(full.len());
            let mut part = BytesMut::from(&full[..cut]);
            let got: Option<Msg<Req>> = decode(&mut part).expect("decode");
            if cut < full.len() {
                prop_assert!(got.is_none());
            } else {
                prop_assert_eq!(got, Some(m));
            }
        }

        #[test]
        fn garbage_frames_are_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut b = BytesMut::from(&bytes[..]);
            let _ = decode::<Req>(&mut b);
        }
    }

    /// Postcard names an enum variant by its position: the positions of
    /// the node RPC's requests and answers are part of the wire, and a node
    /// of an older build reads them by number.
    #[test]
    fn request_and_answer_variants_keep_their_wire_numbers() {
        let tag = |bytes: Vec<u8>| bytes[0];
        let req = |r: Req| tag(postcard::to_allocvec(&r).expect("encode"));
        let resp = |r: Resp| tag(postcard::to_allocvec(&r).expect("encode"));
        assert_eq!(req(Req::Ping), 0);
        assert_eq!(req(Req::GetRow { bucket: "b".into(), key: b"k".to_vec() }), 6);
        assert_eq!(req(Req::CreateBucket { name: "b".into(), created_ms: 0 }), 7);
        assert_eq!(req(Req::HeadBucket { name: "b".into() }), 8);
        assert_eq!(req(Req::DeleteBucket { name: "b".into() }), 9);
        assert_eq!(req(Req::Status), 15);
        assert_eq!(req(Req::LockKey { bucket: "b".into(), key: vec![], token: 1, ttl_ms: 1 }), 25);
        assert_eq!(req(Req::RowVersion { bucket: "b".into(), key: vec![] }), 27);
        assert_eq!(req(Req::GetLifecycle { bucket: "b".into() }), 31);
        assert_eq!(req(Req::RowVersions { keys: vec![] }), 32);
        let row = Row::Tombstone(1);
        let complete = Req::CompleteUpload { session: 1, id: "u".into(), bucket: "b".into(), key: b"k".to_vec(), row };
        assert_eq!(req(complete), 33);
        assert_eq!(req(Req::CreateBucketSince { name: "b".into(), created_ms: 0 }), 34);
        assert_eq!(req(Req::DeleteBucketBefore { name: "b".into(), deleted_ms: 0 }), 35);
        assert_eq!(req(Req::RecreateBucket { name: "b".into(), created_ms: 0, lifecycle: None }), 36);
        assert_eq!(req(Req::MergeLifecycles { rows: vec![] }), 37);
        assert_eq!(resp(Resp::Ok), 0);
        assert_eq!(resp(Resp::Err(RemoteError::Other(String::new()))), 10);
        assert_eq!(resp(Resp::RowVersions(vec![])), 18);
        assert_eq!(resp(Resp::Unsupported(String::new())), 19);
        assert_eq!(tag(postcard::to_allocvec(&RemoteError::NoSuchUpload(String::new())).expect("encode")), 3);
    }

    #[test]
    fn batched_version_asks_round_trip() {
        let keys = vec![("b".to_owned(), serde_bytes::ByteBuf::from(b"k".to_vec()))];
        for m in [Msg::new(Req::RowVersions { keys })] {
            let mut b = frame(&m);
            assert_eq!(decode::<Req>(&mut b).expect("decode"), Some(m));
        }
        let answers = [Resp::RowVersions(vec![0, 42, u64::MAX])];
        for head in answers {
            let m = Msg::new(head);
            let mut b = BytesMut::from(&encode(&m).expect("encode")[..]);
            assert_eq!(decode::<Resp>(&mut b).expect("decode"), Some(m));
        }
    }

    #[test]
    fn oversized_frames_are_refused() {
        let mut b = BytesMut::new();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        assert!(decode::<Req>(&mut b).is_err());
    }
}
