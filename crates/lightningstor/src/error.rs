//! The crate's error type, and the one place that maps it to S3 error codes.
//!
//! Every fallible function in the crate returns [`LightningError`]; the S3
//! layer converts it with [`LightningError::to_s3_error`], so the wire code
//! and HTTP status of each failure are decided in exactly one match.

use s3s::{S3Error, S3ErrorCode, S3Response, S3Result};

/// Everything that can go wrong in LightningStor.
#[derive(Debug, thiserror::Error)]
pub enum LightningError {
    /// The bucket does not exist.
    #[error("bucket {0:?} does not exist")]
    NoSuchBucket(String),
    /// The bucket already exists (we have a single owner, so it is always ours).
    #[error("bucket {0:?} already exists")]
    BucketAlreadyExists(String),
    /// The bucket still holds objects or multipart uploads.
    #[error("bucket {0:?} is not empty")]
    BucketNotEmpty(String),
    /// The bucket name breaks the S3 naming rules.
    #[error("invalid bucket name {0:?}")]
    InvalidBucketName(String),
    /// The object does not exist.
    #[error("object {key:?} does not exist")]
    NoSuchKey { key: String },
    /// The version named does not exist.
    #[error("version {version_id:?} of object {key:?} does not exist")]
    NoSuchVersion { key: String, version_id: String },
    /// The latest version of the key (or the version named) is a delete
    /// marker: 404 NoSuchKey for a GET/HEAD of the key, 405 MethodNotAllowed
    /// for one of the marker's version id; both with `x-amz-delete-marker:
    /// true` and the marker's `x-amz-version-id`.
    #[error("object {key:?} is a delete marker")]
    DeleteMarker { key: String, version_id: String, named: bool },
    /// The key is longer than 1024 bytes.
    #[error("key is {0} bytes long, more than the 1024 allowed")]
    KeyTooLong(usize),
    /// The bucket has no lifecycle configuration.
    #[error("bucket {0:?} has no lifecycle configuration")]
    NoSuchLifecycleConfiguration(String),
    /// The multipart upload does not exist (never created, completed or aborted).
    #[error("multipart upload {0:?} does not exist")]
    NoSuchUpload(String),
    /// A part named in CompleteMultipartUpload is missing or its ETag differs.
    #[error("invalid part: {0}")]
    InvalidPart(String),
    /// Parts in CompleteMultipartUpload are not in ascending order.
    #[error("the list of parts was not in ascending order")]
    InvalidPartOrder,
    /// A part other than the last is smaller than the minimum part size.
    #[error("part {part} is {size} bytes, smaller than the minimum of {min}")]
    EntityTooSmall { part: u32, size: u64, min: u64 },
    /// The body does not match Content-MD5 or an `x-amz-checksum-*` value.
    #[error("{0}")]
    BadDigest(String),
    /// A Content-MD5 header that is not the base64 of 16 bytes.
    #[error("invalid Content-MD5: {0}")]
    InvalidDigest(String),
    /// A body is larger than one PUT (or part) may be: 5 GiB.
    #[error("your proposed upload of {size} bytes exceeds the maximum allowed size")]
    EntityTooLarge { size: u64 },
    /// The body is shorter or longer than its declared length.
    #[error("body length {got} does not match the declared {declared}")]
    IncompleteBody { declared: u64, got: u64 },
    /// The requested range lies outside the object.
    #[error("the requested range is not satisfiable")]
    InvalidRange,
    /// A precondition (If-Match, If-Unmodified-Since, copy-source conditions) failed.
    #[error("at least one of the preconditions you specified did not hold")]
    PreconditionFailed,
    /// If-None-Match or If-Modified-Since on GET/HEAD: the client's copy is current.
    /// `etag` (unquoted) and `last_modified` (Unix seconds) are those of the
    /// current object; the 304 reply carries them, as RFC 9110 §15.4.5 asks.
    #[error("not modified")]
    NotModified { etag: String, last_modified: i64 },
    /// Refused to this requester (an SSE-C key that is not the object's).
    #[error("access denied: {0}")]
    AccessDenied(String),
    /// The request is signed with an access key id this server does not know
    /// (never created, or deleted).
    #[error("the access key id {0:?} does not exist in our records")]
    InvalidAccessKeyId(String),
    /// A request argument is malformed (bad continuation token, part number, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A request is malformed in a way S3 reports as InvalidRequest.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request body is not the XML the operation takes (also: more than
    /// 1000 keys in one DeleteObjects, as S3 answers it).
    #[error("malformed XML: {0}")]
    MalformedXml(String),
    /// The request uses a feature this server does not implement.
    #[error("not implemented: {0}")]
    NotImplemented(String),
    /// A stored block failed verification: its content no longer matches its hash.
    #[error("block {hash} is corrupt")]
    CorruptBlock { hash: String },
    /// A block referenced by metadata is missing from the block store.
    #[error("block {hash} is missing")]
    MissingBlock { hash: String },
    /// Too few replicas answered for the read or write quorum, or a node
    /// could not be reached.
    #[error("service unavailable: {0}")]
    Unavailable(String),
    /// Another node answered that its build does not know the request (a
    /// newer node's request during a rolling upgrade): the caller may fall
    /// back to an older request.
    #[error("service unavailable: a node does not support the request: {0}")]
    UnsupportedRequest(String),
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A config file cannot be read, parsed or validated (the message names it).
    #[error(transparent)]
    ConfigFile(#[from] svc_kit::config::ConfigError),
    /// The client's body stream failed.
    #[error("reading the request body failed: {0}")]
    Body(String),
    /// The body's SHA-256 is not the `x-amz-content-sha256` the request was
    /// signed with.
    #[error("the x-amz-content-sha256 you specified did not match what we received")]
    ContentSha256Mismatch,
    /// The metadata database failed.
    #[error("metadata database: {0}")]
    Db(String),
    /// An I/O error from the host.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

macro_rules! db_from {
    ($($t:ty),*) => {$(
        impl From<$t> for LightningError {
            fn from(e: $t) -> Self {
                LightningError::Db(e.to_string())
            }
        }
    )*};
}
db_from!(
    redb::Error,
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    postcard::Error
);

impl LightningError {
    /// The S3 error code (and so HTTP status) this error is answered with.
    ///
    /// This is the only mapping from crate errors to the wire.
    pub fn s3_code(&self) -> S3ErrorCode {
        use LightningError as E;
        match self {
            E::NoSuchBucket(_) => S3ErrorCode::NoSuchBucket,
            E::BucketAlreadyExists(_) => S3ErrorCode::BucketAlreadyOwnedByYou,
            E::BucketNotEmpty(_) => S3ErrorCode::BucketNotEmpty,
            E::InvalidBucketName(_) => S3ErrorCode::InvalidBucketName,
            E::NoSuchKey { .. } | E::DeleteMarker { named: false, .. } => S3ErrorCode::NoSuchKey,
            E::NoSuchVersion { .. } => S3ErrorCode::NoSuchVersion,
            E::DeleteMarker { named: true, .. } => S3ErrorCode::MethodNotAllowed,
            E::KeyTooLong(_) => S3ErrorCode::KeyTooLongError,
            E::NoSuchUpload(_) => S3ErrorCode::NoSuchUpload,
            E::NoSuchLifecycleConfiguration(_) => S3ErrorCode::NoSuchLifecycleConfiguration,
            E::InvalidPart(_) => S3ErrorCode::InvalidPart,
            E::InvalidPartOrder => S3ErrorCode::InvalidPartOrder,
            E::EntityTooSmall { .. } => S3ErrorCode::EntityTooSmall,
            E::BadDigest(_) => S3ErrorCode::BadDigest,
            E::InvalidDigest(_) => S3ErrorCode::InvalidDigest,
            E::IncompleteBody { .. } => S3ErrorCode::IncompleteBody,
            E::EntityTooLarge { .. } => S3ErrorCode::EntityTooLarge,
            E::InvalidRange => S3ErrorCode::InvalidRange,
            E::PreconditionFailed => S3ErrorCode::PreconditionFailed,
            E::NotModified { .. } => S3ErrorCode::NotModified,
            E::InvalidArgument(_) => S3ErrorCode::InvalidArgument,
            E::AccessDenied(_) => S3ErrorCode::AccessDenied,
            E::InvalidAccessKeyId(_) => S3ErrorCode::InvalidAccessKeyId,
            E::InvalidRequest(_) => S3ErrorCode::InvalidRequest,
            E::MalformedXml(_) => S3ErrorCode::MalformedXML,
            E::NotImplemented(_) => S3ErrorCode::NotImplemented,
            E::CorruptBlock { .. } | E::MissingBlock { .. } | E::Config(_) | E::ConfigFile(_) | E::Db(_) | E::Io(_) => {
                S3ErrorCode::InternalError
            }
            E::Body(_) => S3ErrorCode::IncompleteBody,
            // Not among s3s's generated codes: a custom one, answered as 400.
            E::ContentSha256Mismatch => {
                S3ErrorCode::from_bytes(b"XAmzContentSHA256Mismatch").unwrap_or(S3ErrorCode::BadDigest)
            }
            E::Unavailable(_) | E::UnsupportedRequest(_) => S3ErrorCode::ServiceUnavailable,
        }
    }

    /// Converts into the s3s error answered on the wire.
    pub fn to_s3_error(&self) -> S3Error {
        use LightningError::NotModified as E304;
        let code = self.s3_code();
        if code == S3ErrorCode::InternalError {
            tracing::error!(error = %self, "internal error");
        }
        let mut e = S3Error::with_message(code, self.to_string());
        if matches!(self, LightningError::ContentSha256Mismatch) {
            e.set_status_code(http::StatusCode::BAD_REQUEST);
        }
        if let E304 { etag, last_modified } = self {
            e.set_headers(not_modified_headers(etag, *last_modified));
        }
        if let LightningError::DeleteMarker { version_id, .. } = self {
            let mut h = http::HeaderMap::new();
            h.insert("x-amz-delete-marker", http::HeaderValue::from_static("true"));
            if let Ok(v) = http::HeaderValue::from_str(version_id) {
                h.insert("x-amz-version-id", v);
            }
            e.set_headers(h);
        }
        e
    }
}

/// A request id as S3 writes them: 16 uppercase hex digits, unique within
/// this process (a counter from a start that differs per process).
pub fn request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: std::sync::OnceLock<AtomicU64> = std::sync::OnceLock::new();
    let next = NEXT.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        AtomicU64::new(nanos ^ (u64::from(std::process::id()) << 40))
    });
    format!("{:016X}", next.fetch_add(1, Ordering::Relaxed))
}

/// Tags a reply with a fresh request id: the `x-amz-request-id` header on
/// every reply, and on an error also the `<RequestId>` of its XML body, the
/// same value, as S3 answers (s3s sets neither). The front end passes every
/// reply through here, in both modes; errors s3s answers before a handler runs (signature,
/// request parsing) go without one.
pub fn with_request_id<T>(r: S3Result<S3Response<T>>) -> S3Result<S3Response<T>> {
    let id = request_id();
    let Ok(value) = http::HeaderValue::from_str(&id) else { return r };
    match r {
        Ok(mut resp) => {
            resp.headers.insert(REQUEST_ID, value);
            Ok(resp)
        }
        Err(mut e) => {
            let mut headers = e.headers().cloned().unwrap_or_default();
            headers.insert(REQUEST_ID, value);
            e.set_headers(headers);
            e.set_request_id(id);
            Err(e)
        }
    }
}

const REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-amz-request-id");

/// The ETag and Last-Modified headers of a 304 reply.
fn not_modified_headers(etag: &str, last_modified: i64) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    if let Ok(v) = http::HeaderValue::from_str(&format!("\"{etag}\"")) {
        h.insert(http::header::ETAG, v);
    }
    let t = time::OffsetDateTime::from_unix_timestamp(last_modified).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let mut date = Vec::new();
    if s3s::dto::Timestamp::from(t).format(s3s::dto::TimestampFormat::HttpDate, &mut date).is_ok()
        && let Ok(v) = http::HeaderValue::from_bytes(&date)
    {
        h.insert(http::header::LAST_MODIFIED, v);
    }
    h
}

impl LightningError {
    /// The error of a failed request body stream. s3s checks a body against
    /// its signed `x-amz-content-sha256` as it streams and fails the stream
    /// with its (private) `UploadStreamError::Sha256Mismatch`; that is known
    /// here only by its message.
    pub fn body(e: impl std::fmt::Display) -> Self {
        let text = e.to_string();
        if text.contains("Sha256Mismatch") { LightningError::ContentSha256Mismatch } else { LightningError::Body(text) }
    }
}

impl From<LightningError> for S3Error {
    fn from(e: LightningError) -> Self {
        e.to_s3_error()
    }
}

/// The crate's result type.
pub type Result<T, E = LightningError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_map_to_their_s3_codes() {
        assert_eq!(LightningError::BucketNotEmpty("b".into()).s3_code(), S3ErrorCode::BucketNotEmpty);
        assert_eq!(LightningError::BadDigest("x".into()).s3_code(), S3ErrorCode::BadDigest);
        assert_eq!(LightningError::PreconditionFailed.s3_code(), S3ErrorCode::PreconditionFailed);
        assert_eq!(LightningError::KeyTooLong(2000).s3_code(), S3ErrorCode::KeyTooLongError);
    }

    #[test]
    fn storage_failures_are_internal_errors() {
        let e = LightningError::CorruptBlock { hash: "ab".into() };
        assert_eq!(e.s3_code(), S3ErrorCode::InternalError);
        let e = LightningError::Io(std::io::Error::other("disk"));
        assert_eq!(e.to_s3_error().code(), &S3ErrorCode::InternalError);
    }
}
