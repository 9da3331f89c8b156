//! `impl S3 for ClusterS3`: the S3 surface of a cluster node. Every node
//! accepts every request and coordinates it (see [`super::coord`]); the
//! request parsing and response building are shared with the single-node
//! service. Multipart uploads are in [`super::multipart`].

use super::node::Node;
use crate::checksum::ChecksumPlan;
use crate::conditions::{DeleteConditions, Mode};
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use crate::meta::types::{ObjectMeta, Row};
use crate::s3::convert::{
    check_key, checksum_fields, checksum_headers, delete_conditions, entry_conditions, etag,
    object_headers, trailer_value,
};
use crate::s3::object::{
    check_copy_to_itself, copied_headers, copy_output, copy_source, get_output, head_output, preconditions, recrypted,
    select_meta,
};
use crate::s3::options::Supported;
use crate::sse::{WithCopySourceKey as _, WithCustomerKey as _};
use bytes::Bytes;
use s3s::dto::*;
use s3s::{S3, S3Request, S3Response, S3Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The S3 service of one cluster node (or, for tests, of several nodes
/// taking requests in turn).
#[derive(Debug, Clone)]
pub struct ClusterS3 {
    nodes: Vec<Arc<Node>>,
    next: Arc<AtomicUsize>,
}

impl ClusterS3 {
    /// Serves S3 through `node`.
    pub fn new(node: Arc<Node>) -> Self {
        ClusterS3 { nodes: vec![node], next: Arc::default() }
    }

    /// Sends each request to the next of `nodes` in turn (tests: every
    /// operation of a sequence lands on a different coordinator).
    pub fn rotating(nodes: Vec<Arc<Node>>) -> Self {
        assert!(!nodes.is_empty(), "a rotating service needs nodes");
        ClusterS3 { nodes, next: Arc::default() }
    }

    fn node(&self) -> &Arc<Node> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.nodes.len();
        &self.nodes[i]
    }

    fn finish<T>(&self, r: Result<T>) -> S3Result<S3Response<T>> {
        let m = &self.nodes[0].store.metrics;
        m.inc(&m.requests);
        crate::error::with_request_id(match r {
            Ok(v) => Ok(S3Response::new(v)),
            Err(e) => {
                m.inc(&m.request_errors);
                if matches!(e, LightningError::BadDigest(_)) {
                    m.inc(&m.bad_digests);
                }
                Err(e.to_s3_error())
            }
        })
    }
}

/// The current object of a key, or NoSuchKey / NoSuchBucket.
pub(super) async fn load(node: &Arc<Node>, bucket: &str, key: &str) -> Result<(ObjectMeta, Vec<super::NodeId>)> {
    let r = node.read_row(bucket, key.as_bytes()).await?;
    match r.row {
        Some(Row::Object(m)) => Ok((m, r.holders)),
        _ => {
            node.require_bucket(bucket).await?;
            Err(LightningError::NoSuchKey { key: key.to_owned() })
        }
    }
}

/// If-Match / If-None-Match of a write, checked against a quorum read;
/// callers hold the key's lease ([`super::locks`]) from this check to the commit.
pub(super) async fn check_write_conditions(
    node: &Arc<Node>,
    bucket: &str,
    key: &str,
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
) -> Result<()> {
    let cur = node.read_row(bucket, key.as_bytes()).await?;
    let etag = match &cur.row {
        Some(Row::Object(m)) => Some(m.etag.as_str()),
        _ => None,
    };
    crate::conditions::check_write(etag, if_match, if_none_match, key)
}

async fn put_object(node: &Arc<Node>, req: S3Request<PutObjectInput>) -> Result<PutObjectOutput> {
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
    node.require_bucket(&input.bucket).await?;
    let (if_match, if_none_match) = (input.if_match.clone(), input.if_none_match.clone());
    let conditional = if_match.is_some() || if_none_match.is_some();
    if conditional {
        // Fail fast before the body moves; checked again under the lease.
        check_write_conditions(node, &input.bucket, &input.key, if_match.as_ref(), if_none_match.as_ref()).await?;
    }
    let (bucket, key) = (input.bucket.clone(), input.key.clone());
    let (staged, plain) = match &sealing {
        None => {
            let staged = match input.body {
                Some(body) => node.stage(&bucket, key.as_bytes(), body, plan.algo, true).await?,
                None => {
                    let empty = futures::stream::empty::<std::result::Result<Bytes, String>>();
                    node.stage(&bucket, key.as_bytes(), empty, plan.algo, true).await?
                }
            };
            (staged, None)
        }
        Some((_, cipher)) => {
            let (body, digest) = crate::sse::seal_blob(cipher.clone(), plan.algo, input.body);
            (node.stage(&bucket, key.as_bytes(), body, None, true).await?, Some(digest))
        }
    };
    if let Some(declared) = input.content_length
        && u64::try_from(declared).ok() != Some(staged.size)
    {
        return Err(LightningError::IncompleteBody {
            declared: u64::try_from(declared).unwrap_or(0),
            got: staged.size,
        });
    }
    let trailer = trailer_value(trailing_headers.as_ref(), plan.algo);
    // Under SSE-C the store hashed the ciphertext: the client's digests are
    // of the plaintext, and the ETag is the ciphertext's MD5 (as in S3, the
    // ETag of an SSE-C object is no MD5 of its data).
    let (md5, checksum) = match &plain {
        Some(d) => d.finish()?,
        None => (staged.md5, staged.checksum.clone()),
    };
    plan.verify(&md5, checksum.as_ref(), trailer.as_deref())?;
    let meta = ObjectMeta {
        version: node.hlc.now(),
        size: staged.size,
        etag: hex::encode(staged.md5),
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
        data: staged.data.clone(),
        sse_c: sealing.map(|(s, _)| s),
    };
    let meta = if conditional {
        node.with_key_lease(&bucket, key.as_bytes(), async {
            check_write_conditions(node, &bucket, &key, if_match.as_ref(), if_none_match.as_ref()).await?;
            // A version above the row the check saw (the read advanced the clock).
            let meta = ObjectMeta { version: node.hlc.now(), ..meta };
            node.commit_row(&bucket, key.as_bytes(), Row::Object(meta.clone()), staged.session, &staged.complete)
                .await?;
            Ok(meta)
        })
        .await?
    } else {
        node.commit_row(&bucket, key.as_bytes(), Row::Object(meta.clone()), staged.session, &staged.complete).await?;
        meta
    };
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
        ..Default::default()
    })
}

async fn get_object(node: &Arc<Node>, req: S3Request<GetObjectInput>) -> Result<GetObjectOutput> {
    let i = req.input;
    let (meta, holders) = load(node, &i.bucket, &i.key).await?;
    let pre = preconditions(
        i.if_match.clone(),
        i.if_none_match.clone(),
        i.if_modified_since.as_ref(),
        i.if_unmodified_since.as_ref(),
    );
    let cipher = crate::sse::open(&meta, i.customer_key()?.as_ref())?;
    let s = select_meta(meta, &pre, i.range.as_ref(), i.part_number)?;
    let body = crate::sse::decrypting(cipher, s.range.start, node.read_body(&s.meta, s.range.clone(), holders));
    Ok(get_output(i, &s, body))
}

async fn head_object(node: &Arc<Node>, req: S3Request<HeadObjectInput>) -> Result<HeadObjectOutput> {
    let i = req.input;
    let (meta, _) = load(node, &i.bucket, &i.key).await?;
    let pre = preconditions(
        i.if_match.clone(),
        i.if_none_match.clone(),
        i.if_modified_since.as_ref(),
        i.if_unmodified_since.as_ref(),
    );
    crate::sse::open(&meta, i.customer_key()?.as_ref())?;
    let s = select_meta(meta, &pre, i.range.as_ref(), i.part_number)?;
    Ok(head_output(i, &s))
}

async fn delete_object(node: &Arc<Node>, req: S3Request<DeleteObjectInput>) -> Result<DeleteObjectOutput> {
    let cond = delete_conditions(&req.input);
    let (bucket, key) = (req.input.bucket, req.input.key);
    check_key(&key)?;
    node.require_bucket(&bucket).await?;
    delete_row(node, &bucket, &key, &cond).await?;
    Ok(DeleteObjectOutput::default())
}

/// Writes the tombstone of `key`; a conditional delete checks `cond` against
/// a quorum read under the key's lease, as a conditional PUT does.
pub(super) async fn delete_row(node: &Arc<Node>, bucket: &str, key: &str, cond: &DeleteConditions) -> Result<()> {
    if cond.is_empty() {
        return node.write_row(bucket, key.as_bytes(), Row::Tombstone(node.hlc.now())).await;
    }
    node.with_key_lease(bucket, key.as_bytes(), async {
        let cur = node.read_row(bucket, key.as_bytes()).await?;
        let current = match &cur.row {
            Some(Row::Object(m)) => Some((m.etag.as_str(), m.size, m.last_modified_ms.div_euclid(1000))),
            _ => None,
        };
        cond.check(current, key)?;
        // A version above the row the check saw (the read advanced the clock).
        node.write_row(bucket, key.as_bytes(), Row::Tombstone(node.hlc.now())).await
    })
    .await
}

async fn delete_objects(node: &Arc<Node>, req: S3Request<DeleteObjectsInput>) -> Result<DeleteObjectsOutput> {
    let bucket = req.input.bucket;
    let quiet = req.input.delete.quiet.unwrap_or(false);
    let keys: Vec<(String, DeleteConditions)> = req
        .input
        .delete
        .objects
        .into_iter()
        .map(|o| {
            let cond = entry_conditions(&o);
            (o.key, cond)
        })
        .collect();
    if keys.len() > 1000 {
        return Err(LightningError::MalformedXml("at most 1000 keys may be deleted at once".into()));
    }
    node.require_bucket(&bucket).await?;
    let calls = keys.into_iter().map(|(key, cond)| {
        let node = node.clone();
        let bucket = bucket.clone();
        async move {
            let r = match check_key(&key) {
                Ok(()) => delete_row(&node, &bucket, &key, &cond).await,
                Err(e) => Err(e),
            };
            (key, r)
        }
    });
    let mut deleted = Vec::new();
    let mut errors = Vec::new();
    for (key, r) in futures::future::join_all(calls).await {
        match r {
            Ok(()) if !quiet => deleted.push(DeletedObject { key: Some(key), ..Default::default() }),
            Ok(()) => {}
            Err(e) => errors.push(Error {
                code: Some(e.s3_code().as_str().to_owned()),
                key: Some(key),
                message: Some(e.to_string()),
                version_id: None,
            }),
        }
    }
    Ok(DeleteObjectsOutput {
        deleted: Some(deleted),
        errors: (!errors.is_empty()).then_some(errors),
        ..Default::default()
    })
}

async fn copy_object(node: &Arc<Node>, req: S3Request<CopyObjectInput>) -> Result<CopyObjectOutput> {
    let i = req.input;
    check_key(&i.key)?;
    let (sb, sk) = copy_source(&i.copy_source)?;
    let (dest_key, source_key) = (i.customer_key()?, i.copy_source_key()?);
    let (src, holders) = load(node, &sb, &sk).await?;
    let source = crate::sse::open(&src, source_key.as_ref())?;
    preconditions(
        i.copy_source_if_match.clone(),
        i.copy_source_if_none_match.clone(),
        i.copy_source_if_modified_since.as_ref(),
        i.copy_source_if_unmodified_since.as_ref(),
    )
    .check(&src.etag, src.last_modified_secs(), Mode::Copy)?;
    check_copy_to_itself(&i, &sb, &sk, &src, dest_key.as_ref())?;
    node.require_bucket(&i.bucket).await?;
    let headers = copied_headers(&i, &src);
    // The destination may live on other replicas: stream the bytes through
    // the normal write path (blocks deduplicate where they already exist).
    // With SSE-C on either side they are decrypted and (for an SSE-C
    // destination) encrypted under its key with a fresh IV on the way.
    let inline = matches!(src.data, crate::meta::types::ObjectData::Inline(_));
    let meta = if source.is_none() && dest_key.is_none() {
        let body = node.read_body(&src, 0..src.size, holders);
        let staged = node.stage(&i.bucket, i.key.as_bytes(), body, None, inline).await?;
        let meta = ObjectMeta {
            version: node.hlc.now(),
            last_modified_ms: now_ms(),
            headers,
            data: staged.data.clone(),
            ..src
        };
        node.commit_row(&i.bucket, i.key.as_bytes(), Row::Object(meta.clone()), staged.session, &staged.complete)
            .await?;
        meta
    } else {
        let sealing = dest_key.map(|k| k.seal()).transpose()?;
        let body = crate::sse::recrypting(
            source,
            0,
            sealing.as_ref().map(|(_, c)| c.clone()),
            node.read_body(&src, 0..src.size, holders),
        );
        let staged = node.stage(&i.bucket, i.key.as_bytes(), body, None, true).await?;
        let meta = recrypted(src, &staged.data, staged.size, staged.md5, headers, sealing.map(|(s, _)| s))?;
        let meta = ObjectMeta { version: node.hlc.now(), ..meta };
        node.commit_row(&i.bucket, i.key.as_bytes(), Row::Object(meta.clone()), staged.session, &staged.complete)
            .await?;
        meta
    };
    Ok(copy_output(&meta))
}

#[async_trait::async_trait]
impl S3 for ClusterS3 {
    async fn create_bucket(&self, req: S3Request<CreateBucketInput>) -> S3Result<S3Response<CreateBucketOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::bucket::create_bucket(self.node(), req).await;
        self.finish(r)
    }

    async fn head_bucket(&self, req: S3Request<HeadBucketInput>) -> S3Result<S3Response<HeadBucketOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::bucket::head_bucket(self.node(), req).await;
        self.finish(r)
    }

    async fn delete_bucket(&self, req: S3Request<DeleteBucketInput>) -> S3Result<S3Response<DeleteBucketOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::bucket::delete_bucket(self.node(), req).await;
        self.finish(r)
    }

    async fn list_buckets(&self, req: S3Request<ListBucketsInput>) -> S3Result<S3Response<ListBucketsOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::bucket::list_buckets(self.node(), req).await;
        self.finish(r)
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::bucket::get_bucket_location(self.node(), req).await;
        self.finish(r)
    }

    async fn put_object(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = put_object(node, req).await;
        self.finish(r)
    }

    async fn get_object(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = get_object(node, req).await;
        self.finish(r)
    }

    async fn head_object(&self, req: S3Request<HeadObjectInput>) -> S3Result<S3Response<HeadObjectOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = head_object(node, req).await;
        self.finish(r)
    }

    async fn delete_object(&self, req: S3Request<DeleteObjectInput>) -> S3Result<S3Response<DeleteObjectOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = delete_object(node, req).await;
        self.finish(r)
    }

    async fn delete_objects(&self, req: S3Request<DeleteObjectsInput>) -> S3Result<S3Response<DeleteObjectsOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = delete_objects(node, req).await;
        self.finish(r)
    }

    async fn copy_object(&self, req: S3Request<CopyObjectInput>) -> S3Result<S3Response<CopyObjectOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = copy_object(node, req).await;
        self.finish(r)
    }

    async fn list_objects(&self, req: S3Request<ListObjectsInput>) -> S3Result<S3Response<ListObjectsOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::list::list_objects(self.node(), req).await;
        self.finish(r)
    }

    async fn list_objects_v2(&self, req: S3Request<ListObjectsV2Input>) -> S3Result<S3Response<ListObjectsV2Output>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::list::list_objects_v2(self.node(), req).await;
        self.finish(r)
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::create_multipart_upload(node, req).await;
        self.finish(r)
    }

    async fn upload_part(&self, req: S3Request<UploadPartInput>) -> S3Result<S3Response<UploadPartOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::upload_part(node, req).await;
        self.finish(r)
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::upload_part_copy(node, req).await;
        self.finish(r)
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::complete_multipart_upload(node, req).await;
        self.finish(r)
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::abort_multipart_upload(node, req).await;
        self.finish(r)
    }

    async fn list_parts(&self, req: S3Request<ListPartsInput>) -> S3Result<S3Response<ListPartsOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::list_parts(node, req).await;
        self.finish(r)
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let node = self.node();
        let r = super::multipart::list_multipart_uploads(node, req).await;
        self.finish(r)
    }

    async fn put_bucket_lifecycle_configuration(
        &self,
        req: S3Request<PutBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<PutBucketLifecycleConfigurationOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::lifecycle::put_bucket_lifecycle_configuration(self.node(), req).await;
        self.finish(r)
    }

    async fn get_bucket_lifecycle_configuration(
        &self,
        req: S3Request<GetBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<GetBucketLifecycleConfigurationOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::lifecycle::get_bucket_lifecycle_configuration(self.node(), req).await;
        self.finish(r)
    }

    async fn delete_bucket_lifecycle(
        &self,
        req: S3Request<DeleteBucketLifecycleInput>,
    ) -> S3Result<S3Response<DeleteBucketLifecycleOutput>> {
        if let Err(e) = req.input.check_supported() {
            return self.finish(Err(e));
        }
        let r = crate::s3::lifecycle::delete_bucket_lifecycle(self.node(), req).await;
        self.finish(r)
    }
}
