//! Object operations: put, get, head, delete, delete-objects, copy.

use super::convert::{
    check_key, checksum_fields, checksum_headers, delete_conditions, entry_conditions, etag, metadata, object_headers,
    part_range, timestamp, trailer_value, unix_secs,
};
use crate::checksum::ChecksumPlan;
use crate::conditions::{DeleteConditions, Mode, Preconditions};
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use crate::meta::ops::WriteConditions;
use crate::meta::types::ObjectMeta;
use crate::sse::{WithCopySourceKey as _, WithCustomerKey as _};
use crate::versioning::VersionRef;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use s3s::S3Request;
use s3s::dto::*;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll};

/// Makes a `Send` stream `Sync`, as s3s bodies must be. The mutex is never
/// contended: only the poller touches it, through `&mut`.
pub(crate) struct SyncBody(Mutex<BoxStream<'static, Result<Bytes>>>);

impl SyncBody {
    pub(crate) fn blob(s: BoxStream<'static, Result<Bytes>>) -> StreamingBlob {
        StreamingBlob::wrap(SyncBody(Mutex::new(s)))
    }
}

impl Stream for SyncBody {
    type Item = Result<Bytes>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let inner = match self.get_mut().0.get_mut() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        inner.poll_next_unpin(cx)
    }
}

/// The current object of a key and where its bytes are, or NoSuchKey /
/// NoSuchBucket (DeleteMarker when the key's latest version is one).
pub(super) async fn load<E: Engine>(e: &E, bucket: &str, key: &str) -> Result<(ObjectMeta, E::Source)> {
    match e.get(bucket, key).await? {
        Some(found) => Ok(found),
        None => {
            e.require_bucket(bucket).await?;
            match e.latest_marker(bucket, key).await? {
                Some(version_id) => Err(LightningError::DeleteMarker { key: key.to_owned(), version_id, named: false }),
                None => Err(LightningError::NoSuchKey { key: key.to_owned() }),
            }
        }
    }
}

/// [`load`], or version `v` of the key when one is named.
pub(super) async fn load_version<E: Engine>(
    e: &E,
    bucket: &str,
    key: &str,
    v: Option<VersionRef>,
) -> Result<(ObjectMeta, E::Source)> {
    match v {
        None => load(e, bucket, key).await,
        Some(v) => e.get_version(bucket, key, v).await,
    }
}

/// The `versionId` of a request, parsed.
fn version_ref(v: Option<&str>) -> Result<Option<VersionRef>> {
    v.map(VersionRef::parse).transpose()
}

pub(super) async fn put_object<E: Engine>(e: &E, req: S3Request<PutObjectInput>) -> Result<PutObjectOutput> {
    let S3Request { input, headers, trailing_headers, .. } = req;
    check_key(&input.key)?;
    let sealing = input.customer_key()?.map(|k| k.seal()).transpose()?;
    let plan = ChecksumPlan::from_headers(&checksum_headers(
        &headers,
        input.content_md5.as_deref(),
        input.checksum_algorithm.as_ref(),
        input.checksum_crc32.as_deref(),
        input.checksum_crc32c.as_deref(),
        input.checksum_crc64nvme.as_deref(),
        input.checksum_sha1.as_deref(),
        input.checksum_sha256.as_deref(),
    ))?;
    e.require_bucket(&input.bucket).await?;
    let cond = WriteConditions { if_match: input.if_match.clone(), if_none_match: input.if_none_match.clone() };
    if cond.if_match.is_some() || cond.if_none_match.is_some() {
        // Fail fast before reading the body; checked again atomically at commit.
        let cur = e.get(&input.bucket, &input.key).await?;
        crate::conditions::check_write(
            cur.as_ref().map(|(o, _)| o.etag.as_str()),
            cond.if_match.as_ref(),
            cond.if_none_match.as_ref(),
            &input.key,
        )?;
    }
    let (bucket, key) = (input.bucket, input.key);
    let (ing, plain) = match &sealing {
        None => {
            let ing = match input.body {
                Some(body) => e.stage(&bucket, &key, body, plan.algo, true).await?,
                None => {
                    let empty = futures::stream::empty::<std::result::Result<Bytes, String>>();
                    e.stage(&bucket, &key, empty, plan.algo, true).await?
                }
            };
            (ing, None)
        }
        Some((_, cipher)) => {
            let (body, digest) = crate::sse::seal_blob(cipher.clone(), plan.algo, input.body);
            (e.stage(&bucket, &key, body, None, true).await?, Some(digest))
        }
    };
    if let Some(declared) = input.content_length
        && u64::try_from(declared).ok() != Some(ing.size)
    {
        return Err(LightningError::IncompleteBody { declared: u64::try_from(declared).unwrap_or(0), got: ing.size });
    }
    let trailer = trailer_value(trailing_headers.as_ref(), plan.algo);
    // Under SSE-C the store hashed the ciphertext: the client's digests are
    // of the plaintext, and the ETag is the ciphertext's MD5 (as in S3, the
    // ETag of an SSE-C object is no MD5 of its data).
    let (md5, checksum) = match &plain {
        Some(d) => d.finish()?,
        None => (ing.md5, ing.checksum.clone()),
    };
    plan.verify(&md5, checksum.as_ref(), trailer.as_deref())?;

    let meta = ObjectMeta {
        version: 0,
        size: ing.size,
        etag: hex::encode(ing.md5),
        last_modified_ms: now_ms(),
        headers: object_headers(
            input.content_type,
            input.content_encoding,
            input.content_disposition,
            input.content_language,
            input.cache_control,
            input.expires.as_ref(),
            input.metadata,
        ),
        checksum,
        parts: Vec::new(),
        data: ing.data,
        sse_c: sealing.map(|(s, _)| s),
        versioned: None,
    };
    let meta = e.commit(&bucket, &key, meta, ing.hold, &cond).await?;
    let c = checksum_fields(meta.checksum.as_ref());
    Ok(PutObjectOutput {
        e_tag: Some(etag(&meta.etag)),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        checksum_type: c.kind,
        size: i64::try_from(meta.size).ok(),
        sse_customer_algorithm: meta.sse_c.as_ref().map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: meta.sse_c.as_ref().map(crate::sse::key_md5_base64),
        version_id: meta.version_id(),
        ..Default::default()
    })
}

/// What GET and HEAD share: the row, the preconditions, and the range.
struct Selected {
    meta: ObjectMeta,
    range: std::ops::Range<u64>,
    partial: bool,
}

/// Checks read preconditions on `meta` and resolves the range asked for.
fn select_meta(
    meta: ObjectMeta,
    pre: &Preconditions,
    range: Option<&Range>,
    part_number: Option<i32>,
) -> Result<Selected> {
    pre.check(&meta.etag, meta.last_modified_secs(), Mode::Read)?;
    let (range, partial) = match (range, part_number) {
        (Some(_), Some(_)) => {
            return Err(LightningError::InvalidRequest("cannot specify both Range and partNumber".into()));
        }
        (Some(r), None) => (r.check(meta.size).map_err(|_| LightningError::InvalidRange)?, true),
        (None, Some(n)) => (part_range(&meta, n)?, !meta.parts.is_empty()),
        (None, None) => (0..meta.size, false),
    };
    Ok(Selected { meta, range, partial })
}

fn content_range(s: &Selected) -> Option<String> {
    s.partial.then(|| format!("bytes {}-{}/{}", s.range.start, s.range.end.saturating_sub(1), s.meta.size))
}

pub(super) fn preconditions(
    if_match: Option<ETagCondition>,
    if_none_match: Option<ETagCondition>,
    if_modified_since: Option<&Timestamp>,
    if_unmodified_since: Option<&Timestamp>,
) -> Preconditions {
    Preconditions {
        if_match,
        if_none_match,
        if_modified_since: if_modified_since.map(unix_secs),
        if_unmodified_since: if_unmodified_since.map(unix_secs),
    }
}

fn want_checksum(mode: Option<&ChecksumMode>, s: &Selected) -> bool {
    mode.is_some_and(|m| m.as_str().eq_ignore_ascii_case(ChecksumMode::ENABLED))
        && (!s.partial || s.meta.parts.is_empty() && s.range == (0..s.meta.size))
}

pub(super) async fn get_object<E: Engine>(e: &E, req: S3Request<GetObjectInput>) -> Result<GetObjectOutput> {
    let i = req.input;
    let pre = preconditions(
        i.if_match.clone(),
        i.if_none_match.clone(),
        i.if_modified_since.as_ref(),
        i.if_unmodified_since.as_ref(),
    );
    let v = version_ref(i.version_id.as_deref())?;
    let (meta, from) = load_version(e, &i.bucket, &i.key, v).await?;
    let cipher = crate::sse::open(&meta, i.customer_key()?.as_ref())?;
    let s = select_meta(meta, &pre, i.range.as_ref(), i.part_number)?;
    let body = crate::sse::decrypting(cipher, s.range.start, e.read(&s.meta, from, s.range.clone()));
    Ok(get_output(i, &s, body))
}

/// The standard headers a GET or HEAD answers with: first the request's
/// `response-*` overrides, then [`Shown::over`] fills the rest from the
/// object's stored headers.
struct Shown {
    content_type: Option<String>,
    content_encoding: Option<String>,
    content_disposition: Option<String>,
    content_language: Option<String>,
    cache_control: Option<String>,
    expires: Option<Timestamp>,
}

impl Shown {
    /// Each header not overridden by the request, as stored in `h`.
    fn over(self, h: &crate::meta::types::ObjectHeaders) -> Shown {
        Shown {
            content_type: self.content_type.or_else(|| h.content_type.clone()),
            content_encoding: self.content_encoding.or_else(|| h.content_encoding.clone()),
            content_disposition: self.content_disposition.or_else(|| h.content_disposition.clone()),
            content_language: self.content_language.or_else(|| h.content_language.clone()),
            cache_control: self.cache_control.or_else(|| h.cache_control.clone()),
            expires: self.expires.or_else(|| h.expires.map(|e| timestamp(e.saturating_mul(1000)))),
        }
    }
}

/// The GetObject answer for a selected object and its body stream.
fn get_output(i: GetObjectInput, s: &Selected, body: BoxStream<'static, Result<Bytes>>) -> GetObjectOutput {
    let h = &s.meta.headers;
    let shown = Shown {
        content_type: i.response_content_type,
        content_encoding: i.response_content_encoding,
        content_disposition: i.response_content_disposition,
        content_language: i.response_content_language,
        cache_control: i.response_cache_control,
        expires: i.response_expires,
    }
    .over(h);
    let c = if want_checksum(i.checksum_mode.as_ref(), s) {
        checksum_fields(s.meta.checksum.as_ref())
    } else {
        Default::default()
    };
    GetObjectOutput {
        body: Some(SyncBody::blob(body)),
        content_length: i64::try_from(s.range.end - s.range.start).ok(),
        content_range: content_range(s),
        accept_ranges: Some("bytes".into()),
        e_tag: Some(etag(&s.meta.etag)),
        last_modified: Some(timestamp(s.meta.last_modified_ms)),
        metadata: metadata(h),
        content_type: shown.content_type,
        content_encoding: shown.content_encoding,
        content_disposition: shown.content_disposition,
        content_language: shown.content_language,
        cache_control: shown.cache_control,
        expires: shown.expires,
        parts_count: i.part_number.and_then(|_| i32::try_from(s.meta.parts.len()).ok()).filter(|n| *n > 0),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        checksum_type: c.kind,
        sse_customer_algorithm: s.meta.sse_c.as_ref().map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: s.meta.sse_c.as_ref().map(crate::sse::key_md5_base64),
        version_id: s.meta.version_id(),
        ..Default::default()
    }
}

pub(super) async fn head_object<E: Engine>(e: &E, req: S3Request<HeadObjectInput>) -> Result<HeadObjectOutput> {
    let i = req.input;
    let pre = preconditions(
        i.if_match.clone(),
        i.if_none_match.clone(),
        i.if_modified_since.as_ref(),
        i.if_unmodified_since.as_ref(),
    );
    let v = version_ref(i.version_id.as_deref())?;
    let (meta, _) = load_version(e, &i.bucket, &i.key, v).await?;
    crate::sse::open(&meta, i.customer_key()?.as_ref())?;
    let s = select_meta(meta, &pre, i.range.as_ref(), i.part_number)?;
    Ok(head_output(i, &s))
}

/// The HeadObject answer for a selected object.
fn head_output(i: HeadObjectInput, s: &Selected) -> HeadObjectOutput {
    let h = &s.meta.headers;
    let shown = Shown {
        content_type: i.response_content_type,
        content_encoding: i.response_content_encoding,
        content_disposition: i.response_content_disposition,
        content_language: i.response_content_language,
        cache_control: i.response_cache_control,
        expires: i.response_expires,
    }
    .over(h);
    let c = if want_checksum(i.checksum_mode.as_ref(), s) {
        checksum_fields(s.meta.checksum.as_ref())
    } else {
        Default::default()
    };
    HeadObjectOutput {
        content_length: i64::try_from(s.range.end - s.range.start).ok(),
        content_range: content_range(s),
        accept_ranges: Some("bytes".into()),
        e_tag: Some(etag(&s.meta.etag)),
        last_modified: Some(timestamp(s.meta.last_modified_ms)),
        metadata: metadata(h),
        content_type: shown.content_type,
        content_encoding: shown.content_encoding,
        content_disposition: shown.content_disposition,
        content_language: shown.content_language,
        cache_control: shown.cache_control,
        expires: shown.expires,
        parts_count: i.part_number.and_then(|_| i32::try_from(s.meta.parts.len()).ok()).filter(|n| *n > 0),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        checksum_type: c.kind,
        sse_customer_algorithm: s.meta.sse_c.as_ref().map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: s.meta.sse_c.as_ref().map(crate::sse::key_md5_base64),
        version_id: s.meta.version_id(),
        ..Default::default()
    }
}

pub(super) async fn delete_object<E: Engine>(e: &E, req: S3Request<DeleteObjectInput>) -> Result<DeleteObjectOutput> {
    let cond = delete_conditions(&req.input);
    check_key(&req.input.key)?;
    let v = version_ref(req.input.version_id.as_deref())?;
    let r = e.delete(&req.input.bucket, &req.input.key, v, &cond).await?;
    Ok(DeleteObjectOutput {
        delete_marker: r.delete_marker.then_some(true),
        version_id: r.version_id,
        ..Default::default()
    })
}

pub(super) async fn delete_objects<E: Engine>(
    e: &E,
    req: S3Request<DeleteObjectsInput>,
) -> Result<DeleteObjectsOutput> {
    let bucket = req.input.bucket;
    let quiet = req.input.delete.quiet.unwrap_or(false);
    let keys: Vec<(String, Option<String>, DeleteConditions)> = req
        .input
        .delete
        .objects
        .into_iter()
        .map(|o| {
            let cond = entry_conditions(&o);
            (o.key, o.version_id, cond)
        })
        .collect();
    if keys.len() > 1000 {
        return Err(LightningError::MalformedXml("at most 1000 keys may be deleted at once".into()));
    }
    e.require_bucket(&bucket).await?;
    // A key that is no valid key (or a version id that is none) gets its
    // error here; the engine deletes the others.
    let checked: Vec<Result<Option<VersionRef>>> =
        keys.iter().map(|(k, v, _)| check_key(k).and_then(|()| version_ref(v.as_deref()))).collect();
    let valid = keys
        .iter()
        .zip(&checked)
        .filter_map(|((k, _, c), v)| v.as_ref().ok().map(|v| (k.clone(), *v, c.clone())))
        .collect();
    let mut done = e.delete_many(&bucket, valid).await?.into_iter();
    let results = keys.into_iter().zip(checked).map(|((key, v, _), check)| {
        let r = match check {
            Ok(_) => done.next().unwrap_or_else(|| Err(LightningError::Db("a delete went unanswered".into()))),
            Err(e) => Err(e),
        };
        (key, v, r)
    });
    let mut deleted = Vec::new();
    let mut errors = Vec::new();
    for (key, v, r) in results {
        match r {
            Ok(r) if !quiet => deleted.push(DeletedObject {
                key: Some(key),
                delete_marker: r.delete_marker.then_some(true),
                delete_marker_version_id: r.version_id.clone().filter(|_| r.delete_marker),
                version_id: r.version_id.filter(|_| v.is_some()),
            }),
            Ok(_) => {}
            Err(e) => errors.push(Error {
                code: Some(e.s3_code().as_str().to_owned()),
                key: Some(key),
                message: Some(e.to_string()),
                version_id: v,
            }),
        }
    }
    Ok(DeleteObjectsOutput {
        deleted: Some(deleted),
        errors: (!errors.is_empty()).then_some(errors),
        ..Default::default()
    })
}

/// Resolves `x-amz-copy-source` to (bucket, key, version).
pub(crate) fn copy_source(src: &CopySource) -> Result<(String, String, Option<VersionRef>)> {
    match src {
        CopySource::Bucket { bucket, key, version_id } => {
            Ok((bucket.to_string(), key.to_string(), version_ref(version_id.as_deref())?))
        }
        _ => Err(LightningError::NotImplemented("access point copy sources".into())),
    }
}

pub(super) async fn copy_object<E: Engine>(e: &E, req: S3Request<CopyObjectInput>) -> Result<CopyObjectOutput> {
    let i = req.input;
    check_key(&i.key)?;
    let (sb, sk, sv) = copy_source(&i.copy_source)?;
    let (dest_key, source_key) = (i.customer_key()?, i.copy_source_key()?);
    let (src, from) = load_version(e, &sb, &sk, sv).await?;
    let source_version = src.version_id();
    let source = crate::sse::open(&src, source_key.as_ref())?;
    preconditions(
        i.copy_source_if_match.clone(),
        i.copy_source_if_none_match.clone(),
        i.copy_source_if_modified_since.as_ref(),
        i.copy_source_if_unmodified_since.as_ref(),
    )
    .check(&src.etag, src.last_modified_secs(), Mode::Copy)?;
    check_copy_to_itself(&i, &sb, &sk, &src, dest_key.as_ref())?;
    // `x-amz-checksum-algorithm`: the copy gets that checksum of its bytes
    // (the source's, when it has a whole-object one of that algorithm).
    let algo = copy_checksum_algo(i.checksum_algorithm.as_ref(), &src)?;
    e.require_bucket(&i.bucket).await?;
    let headers = copied_headers(&i, &src);
    let (row, hold) = if source.is_none() && dest_key.is_none() && algo.is_none() {
        // Plain to plain: the bytes do not change; the engine makes them
        // the destination's (shared blocks, or copies on its replicas).
        let (data, hold) = e.copy_data(&i.bucket, &i.key, &src, from).await?;
        (ObjectMeta { last_modified_ms: now_ms(), headers, data, ..src }, hold)
    } else {
        // SSE-C on either side, or a checksum to compute: the bytes go
        // through the write path, decrypted, hashed (the checksum is of the
        // plaintext) and, for an SSE-C destination, encrypted under the
        // destination's key with a fresh IV.
        let sealing = dest_key.map(|k| k.seal()).transpose()?;
        let plain = crate::sse::recrypting(source, 0, None, e.read(&src, from, 0..src.size));
        let hasher = std::sync::Arc::new(Mutex::new(algo.map(crate::checksum::Hasher::new)));
        let tap = hasher.clone();
        let plain = plain
            .inspect(move |r| {
                if let (Ok(b), Ok(mut guard)) = (r, tap.lock())
                    && let Some(h) = guard.as_mut()
                {
                    h.update(b);
                }
            })
            .boxed();
        let body = crate::sse::recrypting(None, 0, sealing.as_ref().map(|(_, c)| c.clone()), plain);
        let staged = e.stage(&i.bucket, &i.key, body, None, true).await?;
        let mut row = recrypted(src, &staged.data, staged.size, staged.md5, headers, sealing.map(|(s, _)| s))?;
        let computed = hasher.lock().ok().and_then(|mut h| h.take());
        if let (Some(algo), Some(h)) = (algo, computed) {
            row.checksum = Some(crate::checksum::Checksum { algo, raw: h.finalize(), parts: None });
        }
        (row, staged.hold)
    };
    let meta = e.commit(&i.bucket, &i.key, row, hold, &WriteConditions::default()).await?;
    Ok(CopyObjectOutput { copy_source_version_id: source_version, ..copy_output(&meta) })
}

/// The checksum algorithm a copy must compute: the one `x-amz-checksum-algorithm`
/// names, unless the source already has a whole-object checksum of it.
fn copy_checksum_algo(
    asked: Option<&ChecksumAlgorithm>,
    src: &ObjectMeta,
) -> Result<Option<crate::checksum::ChecksumAlgo>> {
    let Some(a) = asked else { return Ok(None) };
    let algo = crate::checksum::ChecksumAlgo::from_name(a.as_str())
        .ok_or_else(|| LightningError::InvalidRequest(format!("unknown checksum algorithm {:?}", a.as_str())))?;
    let kept = src.checksum.as_ref().is_some_and(|c| c.algo == algo && c.parts.is_none());
    Ok((!kept).then_some(algo))
}

/// A copy onto itself must change something: the metadata (REPLACE) or the
/// encryption (an SSE-C source or destination, e.g. a key rotation).
fn check_copy_to_itself(
    i: &CopyObjectInput,
    sb: &str,
    sk: &str,
    src: &ObjectMeta,
    dest_key: Option<&crate::sse::CustomerKey>,
) -> Result<()> {
    if sb == i.bucket && sk == i.key && !replaces_metadata(i) && src.sse_c.is_none() && dest_key.is_none() {
        return Err(LightningError::InvalidRequest(
            "this copy request is illegal because it is trying to copy an object to itself \
             without changing the object's metadata or encryption attributes"
                .into(),
        ));
    }
    Ok(())
}

fn replaces_metadata(i: &CopyObjectInput) -> bool {
    i.metadata_directive.as_ref().is_some_and(|d| d.as_str().eq_ignore_ascii_case(MetadataDirective::REPLACE))
}

/// The headers of a copy: the request's under REPLACE, else the source's.
fn copied_headers(i: &CopyObjectInput, src: &ObjectMeta) -> crate::meta::types::ObjectHeaders {
    if replaces_metadata(i) {
        object_headers(
            i.content_type.clone(),
            i.content_encoding.clone(),
            i.content_disposition.clone(),
            i.content_language.clone(),
            i.cache_control.clone(),
            i.expires.as_ref(),
            i.metadata.clone(),
        )
    } else {
        src.headers.clone()
    }
}

/// The row of a copy whose bytes were rewritten (decrypted and/or
/// encrypted): stored as `data` (`size` bytes, MD5 `md5`), with the
/// source's parts and plaintext checksum; the ETag is the MD5 of the stored
/// bytes, as for a PUT. The caller sets the version.
fn recrypted(
    src: ObjectMeta,
    data: &crate::meta::types::ObjectData,
    size: u64,
    md5: [u8; 16],
    headers: crate::meta::types::ObjectHeaders,
    sse_c: Option<crate::sse::SseC>,
) -> Result<ObjectMeta> {
    if size != src.size {
        return Err(LightningError::Io(std::io::Error::other(format!(
            "copy source read {size} bytes of {}",
            src.size
        ))));
    }
    Ok(ObjectMeta {
        version: 0,
        size,
        etag: hex::encode(md5),
        last_modified_ms: now_ms(),
        headers,
        checksum: src.checksum,
        parts: src.parts,
        data: data.clone(),
        sse_c,
        versioned: None,
    })
}

/// The CopyObject answer for the row written.
fn copy_output(meta: &ObjectMeta) -> CopyObjectOutput {
    let c = checksum_fields(meta.checksum.as_ref());
    CopyObjectOutput {
        copy_object_result: Some(CopyObjectResult {
            e_tag: Some(etag(&meta.etag)),
            last_modified: Some(timestamp(meta.last_modified_ms)),
            checksum_crc32: c.crc32,
            checksum_crc32c: c.crc32c,
            checksum_crc64nvme: c.crc64nvme,
            checksum_sha1: c.sha1,
            checksum_sha256: c.sha256,
            checksum_type: c.kind,
        }),
        sse_customer_algorithm: meta.sse_c.as_ref().map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: meta.sse_c.as_ref().map(crate::sse::key_md5_base64),
        version_id: meta.version_id(),
        ..Default::default()
    }
}
