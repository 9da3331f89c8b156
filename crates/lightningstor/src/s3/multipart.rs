//! Multipart uploads: create, upload-part, upload-part-copy, complete, abort,
//! list-parts, list-multipart-uploads.

use super::bucket::owner;
use super::convert::{
    check_key, checksum_fields, checksum_headers, etag, etag_value, object_headers, timestamp, trailer_value,
};
use super::object::{copy_source, load_version};
use crate::checksum::{Checksum, ChecksumAlgo, ChecksumPlan};
use crate::conditions::Mode;
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::listing::common_prefix;
use crate::meta::now_ms;
use crate::meta::ops::{self, CompletedPart as Wanted, WriteConditions};
use crate::meta::types::{PartMeta, UploadMeta};
use crate::sse::{WithCopySourceKey as _, WithCustomerKey as _};
use s3s::S3Request;
use s3s::dto::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// A new upload id: unique in this process (a sequence number) and across
/// nodes and restarts (the engine's next version, 8 random bytes).
fn new_upload_id<E: Engine>(e: &E, bucket: &str, key: &str) -> Result<String> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut random = [0u8; 8];
    crate::keys::random(&mut random)?;
    let mut h = blake3::Hasher::new();
    h.update(&e.keyring().next_version().to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(&random);
    h.update(bucket.as_bytes());
    h.update(key.as_bytes());
    Ok(hex::encode(&h.finalize().as_bytes()[..16]))
}

pub(crate) fn part_number(n: i32) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|n| (1..=10_000).contains(n))
        .ok_or_else(|| LightningError::InvalidArgument("part number must be an integer between 1 and 10000".into()))
}

pub(super) async fn create_multipart_upload<E: Engine>(
    e: &E,
    req: S3Request<CreateMultipartUploadInput>,
) -> Result<CreateMultipartUploadOutput> {
    let i = req.input;
    check_key(&i.key)?;
    let (algo, full_object) = upload_checksum(&i)?;
    let sse_c_key_md5 = i.customer_key()?.map(|k| k.md5());
    let id = new_upload_id(e, &i.bucket, &i.key)?;
    let meta = UploadMeta {
        bucket: i.bucket.clone(),
        key: i.key.clone(),
        initiated_ms: now_ms(),
        headers: object_headers(
            i.content_type,
            i.content_encoding,
            i.content_disposition,
            i.content_language,
            i.cache_control,
            i.expires.as_ref(),
            i.metadata,
        ),
        checksum_algo: algo,
        full_object,
        sse_c_key_md5,
    };
    e.create_upload(&id, meta).await?;
    Ok(CreateMultipartUploadOutput {
        bucket: Some(i.bucket),
        key: Some(i.key),
        upload_id: Some(id),
        checksum_algorithm: i.checksum_algorithm,
        checksum_type: checksum_type(algo, full_object),
        sse_customer_algorithm: sse_c_key_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: sse_c_key_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

/// The checksum algorithm of a new upload and whether its object gets a
/// FULL_OBJECT checksum, from `x-amz-checksum-algorithm` and
/// `x-amz-checksum-type`, as S3 has them: CRC64NVME is FULL_OBJECT only,
/// the others COMPOSITE unless FULL_OBJECT is asked for, and FULL_OBJECT
/// needs a CRC (SHA digests cannot be combined).
fn upload_checksum(i: &CreateMultipartUploadInput) -> Result<(Option<ChecksumAlgo>, bool)> {
    let algo =
        match &i.checksum_algorithm {
            None => None,
            Some(a) => Some(ChecksumAlgo::from_name(a.as_str()).ok_or_else(|| {
                LightningError::InvalidRequest(format!("unknown checksum algorithm {:?}", a.as_str()))
            })?),
        };
    let asked = checksum_type_of(i.checksum_type.as_ref())?;
    match (algo, asked) {
        (None, None) => Ok((None, false)),
        (None, Some(_)) => {
            Err(LightningError::InvalidRequest("x-amz-checksum-type needs an x-amz-checksum-algorithm".into()))
        }
        (Some(ChecksumAlgo::Crc64Nvme), Some(false)) => {
            Err(LightningError::InvalidRequest("CRC64NVME checksums are FULL_OBJECT only, not COMPOSITE".into()))
        }
        (Some(a), Some(true)) if a.crc().is_none() => Err(LightningError::InvalidRequest(format!(
            "a FULL_OBJECT checksum is a CRC; {} digests of parts cannot be combined",
            a.name()
        ))),
        (Some(a), asked) => Ok((Some(a), asked.unwrap_or(a == ChecksumAlgo::Crc64Nvme))),
    }
}

/// `x-amz-checksum-type`: `Some(true)` for FULL_OBJECT, `Some(false)` for COMPOSITE.
fn checksum_type_of(t: Option<&ChecksumType>) -> Result<Option<bool>> {
    match t.map(ChecksumType::as_str) {
        None => Ok(None),
        Some(t) if t.eq_ignore_ascii_case(ChecksumType::FULL_OBJECT) => Ok(Some(true)),
        Some(t) if t.eq_ignore_ascii_case(ChecksumType::COMPOSITE) => Ok(Some(false)),
        Some(t) => Err(LightningError::InvalidRequest(format!("unknown checksum type {t:?}"))),
    }
}

/// The `x-amz-checksum-type` of an upload's answers.
fn checksum_type(algo: Option<ChecksumAlgo>, full_object: bool) -> Option<ChecksumType> {
    algo.map(|_| {
        ChecksumType::from_static(if full_object { ChecksumType::FULL_OBJECT } else { ChecksumType::COMPOSITE })
    })
}

pub(super) async fn upload_part<E: Engine>(e: &E, req: S3Request<UploadPartInput>) -> Result<UploadPartOutput> {
    let S3Request { input: i, headers, trailing_headers, .. } = req;
    let number = part_number(i.part_number)?;
    let given = i.customer_key()?;
    let upload = e.upload(&i.bucket, &i.key, &i.upload_id).await?;
    let sealing = crate::sse::for_upload(upload.sse_c_key_md5, given)?.map(|k| k.seal()).transpose()?;
    let plan = ChecksumPlan::from_headers(&checksum_headers(
        &headers,
        i.content_md5.as_deref(),
        i.checksum_algorithm.as_ref(),
        i.checksum_crc32.as_deref(),
        i.checksum_crc32c.as_deref(),
        i.checksum_crc64nvme.as_deref(),
        i.checksum_sha1.as_deref(),
        i.checksum_sha256.as_deref(),
    ))?;
    let algo = plan.algo.or(upload.checksum_algo);
    let (ing, plain) = match &sealing {
        None => {
            let ing = match i.body {
                Some(body) => e.stage(&i.bucket, &i.key, body, algo, false).await?,
                None => {
                    let empty = futures::stream::empty::<std::result::Result<bytes::Bytes, String>>();
                    e.stage(&i.bucket, &i.key, empty, algo, false).await?
                }
            };
            (ing, None)
        }
        Some((_, cipher)) => {
            let (body, digest) = crate::sse::seal_blob(cipher.clone(), algo, i.body);
            (e.stage(&i.bucket, &i.key, body, None, false).await?, Some(digest))
        }
    };
    if let Some(declared) = i.content_length
        && u64::try_from(declared).ok() != Some(ing.size)
    {
        return Err(LightningError::IncompleteBody { declared: u64::try_from(declared).unwrap_or(0), got: ing.size });
    }
    let trailer = trailer_value(trailing_headers.as_ref(), plan.algo);
    // As for a PUT: the client's digests are of the plaintext, the ETag is
    // the MD5 of what is stored.
    let (plain_md5, checksum) = match &plain {
        Some(d) => d.finish()?,
        None => (ing.md5, ing.checksum.clone()),
    };
    plan.verify(&plain_md5, checksum.as_ref(), trailer.as_deref())?;
    let part = PartMeta {
        size: ing.size,
        md5: ing.md5,
        checksum,
        last_modified_ms: now_ms(),
        blocks: ing.data.blocks().to_vec(),
        sse_iv: sealing.as_ref().map(|(s, _)| s.iv),
    };
    let tag = part.etag();
    let c = checksum_fields(part.checksum.as_ref());
    e.put_part(&i.upload_id, &upload, number, part, ing.hold).await?;
    Ok(UploadPartOutput {
        e_tag: Some(etag(&tag)),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        sse_customer_algorithm: upload.sse_c_key_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: upload.sse_c_key_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

pub(super) async fn upload_part_copy<E: Engine>(
    e: &E,
    req: S3Request<UploadPartCopyInput>,
) -> Result<UploadPartCopyOutput> {
    let i = req.input;
    let number = part_number(i.part_number)?;
    let (given, source_key) = (i.customer_key()?, i.copy_source_key()?);
    let upload = e.upload(&i.bucket, &i.key, &i.upload_id).await?;
    let dest_key = crate::sse::for_upload(upload.sse_c_key_md5, given)?;
    let (sb, sk, sv) = copy_source(&i.copy_source)?;
    let (src, from) = load_version(e, &sb, &sk, sv).await?;
    let source = crate::sse::open(&src, source_key.as_ref())?;
    crate::conditions::Preconditions {
        if_match: i.copy_source_if_match,
        if_none_match: i.copy_source_if_none_match,
        if_modified_since: i.copy_source_if_modified_since.as_ref().map(super::convert::unix_secs),
        if_unmodified_since: i.copy_source_if_unmodified_since.as_ref().map(super::convert::unix_secs),
    }
    .check(&src.etag, src.last_modified_secs(), Mode::Copy)?;
    let range = match &i.copy_source_range {
        None => 0..src.size,
        Some(r) => crate::s3::convert::copy_source_range(r, src.size)?,
    };
    // Re-chunk the source range through the normal upload path (decrypted,
    // then encrypted for the upload under SSE-C); identical blocks
    // deduplicate in the block store. (In a cluster the upload's replicas
    // may differ from the source's.)
    let body = crate::sse::decrypting(source, range.start, e.read(&src, from, range));
    let sealing = dest_key.map(|k| k.seal()).transpose()?;
    let (ing, checksum) = match &sealing {
        None => {
            let ing = e.stage(&i.bucket, &i.key, body, upload.checksum_algo, false).await?;
            let checksum = ing.checksum.clone();
            (ing, checksum)
        }
        Some((_, cipher)) => {
            let (body, digest) = crate::sse::seal_body(cipher.clone(), upload.checksum_algo, body);
            let ing = e.stage(&i.bucket, &i.key, body, None, false).await?;
            (ing, digest.finish()?.1)
        }
    };
    let part = PartMeta {
        size: ing.size,
        md5: ing.md5,
        checksum,
        last_modified_ms: now_ms(),
        blocks: ing.data.blocks().to_vec(),
        sse_iv: sealing.as_ref().map(|(s, _)| s.iv),
    };
    let tag = part.etag();
    let modified = part.last_modified_ms;
    e.put_part(&i.upload_id, &upload, number, part, ing.hold).await?;
    Ok(UploadPartCopyOutput {
        copy_part_result: Some(CopyPartResult {
            e_tag: Some(etag(&tag)),
            last_modified: Some(timestamp(modified)),
            ..Default::default()
        }),
        sse_customer_algorithm: upload.sse_c_key_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: upload.sse_c_key_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

fn wanted_checksum(p: &CompletedPart) -> Result<Option<Checksum>> {
    let given = [
        (ChecksumAlgo::Crc32, &p.checksum_crc32),
        (ChecksumAlgo::Crc32c, &p.checksum_crc32c),
        (ChecksumAlgo::Crc64Nvme, &p.checksum_crc64nvme),
        (ChecksumAlgo::Sha1, &p.checksum_sha1),
        (ChecksumAlgo::Sha256, &p.checksum_sha256),
    ];
    for (algo, v) in given {
        if let Some(v) = v {
            return Checksum::from_base64(algo, v).map(Some);
        }
    }
    Ok(None)
}

/// The whole-object checksums a CompleteMultipartUpload claims (a value
/// may end in `-N`, the part count of a composite checksum) and its checksum type.
fn claimed_checksums(i: &CompleteMultipartUploadInput) -> Result<ops::Claimed> {
    let given = [
        (ChecksumAlgo::Crc32, &i.checksum_crc32),
        (ChecksumAlgo::Crc32c, &i.checksum_crc32c),
        (ChecksumAlgo::Crc64Nvme, &i.checksum_crc64nvme),
        (ChecksumAlgo::Sha1, &i.checksum_sha1),
        (ChecksumAlgo::Sha256, &i.checksum_sha256),
    ];
    let mut out = Vec::new();
    for (algo, v) in given {
        let Some(v) = v else { continue };
        let (b64, parts) = match v.rsplit_once('-') {
            Some((b, n)) if !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) => {
                let n = n.parse::<u32>().map_err(|_| {
                    LightningError::InvalidRequest(format!("bad part count in {} value {v:?}", algo.header()))
                })?;
                (b, Some(n))
            }
            _ => (v.as_str(), None),
        };
        out.push(Checksum { parts, ..Checksum::from_base64(algo, b64)? });
    }
    Ok(ops::Claimed { checksums: out, full_object: checksum_type_of(i.checksum_type.as_ref())? })
}

pub(super) async fn complete_multipart_upload<E: Engine>(
    e: &E,
    req: S3Request<CompleteMultipartUploadInput>,
) -> Result<CompleteMultipartUploadOutput> {
    let i = req.input;
    let claimed = claimed_checksums(&i)?;
    let given_key = i.customer_key()?;
    let parts = i.multipart_upload.and_then(|m| m.parts).unwrap_or_default();
    let mut wanted = Vec::with_capacity(parts.len());
    for p in &parts {
        let number = part_number(p.part_number.unwrap_or(0))?;
        let etag = p.e_tag.as_ref().map(etag_value).unwrap_or_default().to_owned();
        wanted.push(Wanted { number, etag, checksum: wanted_checksum(p)? });
    }
    let cond = WriteConditions { if_match: i.if_match, if_none_match: i.if_none_match };
    let retry_etag = ops::completed_etag(&wanted);
    // SSE-C headers are optional on completion; given, they must be the upload's.
    let accept = |u: &UploadMeta| match given_key.clone() {
        Some(k) => crate::sse::for_upload(u.sse_c_key_md5, Some(k)).map(|_| ()),
        None => Ok(()),
    };
    let meta = match e.complete_upload(&i.bucket, &i.key, &i.upload_id, wanted, claimed, cond, accept).await {
        Ok(meta) => meta,
        // A retry of a completion that happened (its reply was lost): the same answer again.
        Err(err @ LightningError::NoSuchUpload(_)) => match e.get(&i.bucket, &i.key).await? {
            Some((m, _)) if retry_etag.as_deref() == Some(m.etag.as_str()) => m,
            _ => {
                // The bucket deleted while the upload was in progress took the upload with it.
                e.require_bucket(&i.bucket).await?;
                return Err(err);
            }
        },
        Err(err) => return Err(err),
    };
    let show = crate::sse::may_show_checksum(&meta, given_key.as_ref());
    let c = checksum_fields(meta.checksum.as_ref().filter(|_| show));
    Ok(CompleteMultipartUploadOutput {
        bucket: Some(i.bucket.clone()),
        key: Some(i.key.clone()),
        location: Some(format!("/{}/{}", i.bucket, i.key)),
        e_tag: Some(etag(&meta.etag)),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        checksum_type: c.kind,
        version_id: meta.version_id(),
        ..Default::default()
    })
}

pub(super) async fn abort_multipart_upload<E: Engine>(
    e: &E,
    req: S3Request<AbortMultipartUploadInput>,
) -> Result<AbortMultipartUploadOutput> {
    let i = req.input;
    e.abort_upload(&i.bucket, &i.key, &i.upload_id).await?;
    Ok(AbortMultipartUploadOutput::default())
}

fn limit(v: Option<i32>, what: &str) -> Result<usize> {
    match v {
        None => Ok(1000),
        Some(n) if n < 0 => Err(LightningError::InvalidArgument(format!("{what} must not be negative"))),
        Some(n) => Ok(usize::try_from(n).unwrap_or(0).min(1000)),
    }
}

pub(super) async fn list_parts<E: Engine>(e: &E, req: S3Request<ListPartsInput>) -> Result<ListPartsOutput> {
    let i = req.input;
    let max = limit(i.max_parts, "max-parts")?;
    let marker = u32::try_from(i.part_number_marker.unwrap_or(0)).unwrap_or(0);
    let (upload, rows) = e.parts(&i.bucket, &i.key, &i.upload_id, marker, max + 1).await?;
    list_parts_output(i, &upload, rows, max)
}

/// The ListParts answer for `rows` (part number order, up to `max + 1` of
/// them, the last only telling that the list goes on).
///
/// The parts' checksums are of their plaintext, so for an SSE-C upload
/// they are given only to a request that carries the upload's key (a
/// caller who may list parts but lacks the key could otherwise test
/// guesses of a part's content against them); another key is refused as
/// UploadPart refuses it.
fn list_parts_output(
    i: ListPartsInput,
    upload: &UploadMeta,
    mut rows: Vec<(u32, PartMeta)>,
    max: usize,
) -> Result<ListPartsOutput> {
    use crate::sse::WithCustomerKey as _;
    let show_checksums = match upload.sse_c_key_md5 {
        None => true,
        Some(md5) => match i.customer_key()? {
            Some(k) => crate::sse::for_upload(Some(md5), Some(k)).map(|_| true)?,
            None => false,
        },
    };
    let truncated = rows.len() > max;
    rows.truncate(max);
    let next = rows.last().map(|(n, _)| *n);
    let parts = rows
        .into_iter()
        .map(|(n, p)| {
            let c = checksum_fields(p.checksum.as_ref().filter(|_| show_checksums));
            Part {
                part_number: i32::try_from(n).ok(),
                size: i64::try_from(p.size).ok(),
                e_tag: Some(etag(&p.etag())),
                last_modified: Some(timestamp(p.last_modified_ms)),
                checksum_crc32: c.crc32,
                checksum_crc32c: c.crc32c,
                checksum_crc64nvme: c.crc64nvme,
                checksum_sha1: c.sha1,
                checksum_sha256: c.sha256,
            }
        })
        .collect();
    Ok(ListPartsOutput {
        bucket: Some(i.bucket),
        key: Some(i.key),
        upload_id: Some(i.upload_id),
        parts: Some(parts),
        is_truncated: Some(truncated),
        max_parts: i32::try_from(max).ok(),
        part_number_marker: i.part_number_marker,
        next_part_number_marker: if truncated { next.and_then(|n| i32::try_from(n).ok()) } else { None },
        checksum_algorithm: upload.checksum_algo.map(|a| ChecksumAlgorithm::from(a.name().to_owned())),
        checksum_type: checksum_type(upload.checksum_algo, upload.full_object),
        owner: Some(owner()),
        initiator: Some(Initiator { display_name: Some("lightningstor".into()), id: Some("lightningstor".into()) }),
        ..Default::default()
    })
}

pub(super) async fn list_multipart_uploads<E: Engine>(
    e: &E,
    req: S3Request<ListMultipartUploadsInput>,
) -> Result<ListMultipartUploadsOutput> {
    let i = req.input;
    let max = limit(i.max_uploads, "max-uploads")?;
    let prefix = i.prefix.clone().unwrap_or_default();
    let rows = e.uploads(&i.bucket, &prefix, i.key_marker.as_deref(), i.upload_id_marker.as_deref()).await?;
    Ok(list_uploads_output(i, max, rows))
}

/// The ListMultipartUploads answer for `rows` ((key, upload id, upload) in
/// key then id order, already past the markers): at most `max` uploads and
/// common prefixes.
fn list_uploads_output(
    i: ListMultipartUploadsInput,
    max: usize,
    rows: impl IntoIterator<Item = (String, String, UploadMeta)>,
) -> ListMultipartUploadsOutput {
    let q = crate::listing::ListQuery {
        prefix: i.prefix.clone().unwrap_or_default().into_bytes(),
        delimiter: i.delimiter.as_ref().map(|d| d.as_bytes().to_vec()),
        start_after: None,
        max_keys: max,
    };
    let mut uploads = Vec::new();
    let mut prefixes: Vec<String> = Vec::new();
    let mut truncated = false;
    let mut last: Option<(String, String)> = None;
    for (key, id, u) in rows {
        if uploads.len() + prefixes.len() >= max {
            truncated = true;
            break;
        }
        if let Some(cp) = common_prefix(&q, key.as_bytes()) {
            let cp = String::from_utf8_lossy(cp).into_owned();
            if !prefixes.contains(&cp) {
                prefixes.push(cp);
            }
            continue;
        }
        last = Some((key.clone(), id.clone()));
        uploads.push(MultipartUpload {
            key: Some(key),
            upload_id: Some(id),
            initiated: Some(timestamp(u.initiated_ms)),
            checksum_algorithm: u.checksum_algo.map(|a| ChecksumAlgorithm::from(a.name().to_owned())),
            checksum_type: checksum_type(u.checksum_algo, u.full_object),
            owner: Some(owner()),
            initiator: Some(Initiator { display_name: Some("lightningstor".into()), id: Some("lightningstor".into()) }),
            ..Default::default()
        });
    }
    ListMultipartUploadsOutput {
        bucket: Some(i.bucket),
        prefix: i.prefix,
        delimiter: i.delimiter,
        key_marker: i.key_marker,
        upload_id_marker: i.upload_id_marker,
        max_uploads: i32::try_from(max).ok(),
        is_truncated: Some(truncated),
        next_key_marker: truncated.then(|| last.as_ref().map(|l| l.0.clone())).flatten(),
        next_upload_id_marker: truncated.then(|| last.as_ref().map(|l| l.1.clone())).flatten(),
        uploads: Some(uploads),
        common_prefixes: (!prefixes.is_empty())
            .then(|| prefixes.into_iter().map(|p| CommonPrefix { prefix: Some(p) }).collect()),
        ..Default::default()
    }
}
