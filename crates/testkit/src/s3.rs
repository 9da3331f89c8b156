//! A deliberately broken S3 service for self-checks: [`StaleGets`] wraps any
//! s3s implementation and answers every second GET of a key from the copy
//! it returned the time before, however many writes landed since. A checker
//! of read-your-writes that passes a history made through it is broken.

use s3s::dto::*;
use s3s::{S3, S3Error, S3ErrorCode, S3Request, S3Response, S3Result};
use std::collections::HashMap;
use std::sync::Mutex;

/// The wrapper: `inner` does the work, GETs are answered stale every
/// other time. Operations other than the few the bench's workloads use
/// are not implemented.
pub struct StaleGets<S> {
    inner: S,
    /// Per key: the body last returned fresh, and how many GETs it had.
    copies: Mutex<HashMap<String, (Vec<u8>, u64)>>,
}

impl<S> StaleGets<S> {
    pub fn new(inner: S) -> StaleGets<S> {
        StaleGets { inner, copies: Mutex::new(HashMap::new()) }
    }
}

impl<S> std::fmt::Debug for StaleGets<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StaleGets")
    }
}

#[async_trait::async_trait]
impl<S: S3> S3 for StaleGets<S> {
    async fn create_bucket(&self, req: S3Request<CreateBucketInput>) -> S3Result<S3Response<CreateBucketOutput>> {
        self.inner.create_bucket(req).await
    }

    async fn head_bucket(&self, req: S3Request<HeadBucketInput>) -> S3Result<S3Response<HeadBucketOutput>> {
        self.inner.head_bucket(req).await
    }

    async fn put_object(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        self.inner.put_object(req).await
    }

    async fn list_objects_v2(&self, req: S3Request<ListObjectsV2Input>) -> S3Result<S3Response<ListObjectsV2Output>> {
        self.inner.list_objects_v2(req).await
    }

    async fn get_object(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        let key = req.input.key.clone();
        let mut resp = self.inner.get_object(req).await?;
        let Some(blob) = resp.output.body.take() else { return Ok(resp) };
        let mut body = s3s::Body::from(blob);
        let fresh = body
            .store_all_limited(16 << 20)
            .await
            .map_err(|e| S3Error::with_message(S3ErrorCode::InternalError, format!("reading the body: {e}")))?
            .to_vec();
        let answer = {
            let mut copies = self.copies.lock().unwrap_or_else(|p| p.into_inner());
            let (copy, gets) = copies.entry(key).or_insert_with(|| (fresh.clone(), 0));
            *gets += 1;
            if gets.is_multiple_of(2) {
                copy.clone()
            } else {
                *copy = fresh.clone();
                fresh
            }
        };
        // The stale copy goes out without the fresh object's ETag and
        // checksums, as a server that kept an old copy would send it.
        let out = &mut resp.output;
        out.content_length = Some(answer.len() as i64);
        (out.e_tag, out.checksum_crc32, out.checksum_crc32c, out.checksum_sha1, out.checksum_sha256) =
            (None, None, None, None, None);
        out.checksum_crc64nvme = None;
        out.body = Some(StreamingBlob::from(s3s::Body::from(answer)));
        Ok(resp)
    }
}
