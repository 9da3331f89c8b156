//! The S3 protocol: `impl S3 for LightningS3`, one method per operation.
//!
//! Each method forwards to a handler in the submodule of its resource
//! (`bucket`, `object`, `multipart`, `list`, `lifecycle`) that works in
//! [`LightningError`](crate::error::LightningError); the conversion to the
//! S3 error on the wire happens here, once.

pub(crate) mod bucket;
pub mod convert;
pub mod lifecycle;
pub(crate) mod list;
pub(crate) mod multipart;
pub(crate) mod object;
pub(crate) mod options;

use crate::error::Result;
use crate::store::Store;
use s3s::dto::*;
use s3s::{S3, S3Request, S3Response, S3Result};
use std::sync::Arc;

/// The S3 service over a [`Store`].
#[derive(Debug, Clone)]
pub struct LightningS3 {
    store: Arc<Store>,
}

impl LightningS3 {
    /// Serves `store`.
    pub fn new(store: Arc<Store>) -> Self {
        LightningS3 { store }
    }

    /// The underlying store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    fn finish<T>(&self, r: Result<T>) -> S3Result<S3Response<T>> {
        let m = &self.store.metrics;
        m.inc(&m.requests);
        crate::error::with_request_id(match r {
            Ok(v) => Ok(S3Response::new(v)),
            Err(e) => {
                m.inc(&m.request_errors);
                if matches!(e, crate::error::LightningError::BadDigest(_)) {
                    m.inc(&m.bad_digests);
                }
                Err(e.to_s3_error())
            }
        })
    }
}

macro_rules! ops {
    ($($name:ident($input:ty) -> $output:ty => $module:ident;)*) => {
        #[async_trait::async_trait]
        impl S3 for LightningS3 {
            $(
                #[tracing::instrument(level = "debug", skip_all, fields(op = stringify!($name)))]
                async fn $name(&self, req: S3Request<$input>) -> S3Result<S3Response<$output>> {
                    let r = match options::Supported::check_supported(&req.input) {
                        Ok(()) => $module::$name(&self.store, req).await,
                        Err(e) => Err(e),
                    };
                    self.finish(r)
                }
            )*
        }
    };
}

ops! {
    create_bucket(CreateBucketInput) -> CreateBucketOutput => bucket;
    head_bucket(HeadBucketInput) -> HeadBucketOutput => bucket;
    delete_bucket(DeleteBucketInput) -> DeleteBucketOutput => bucket;
    list_buckets(ListBucketsInput) -> ListBucketsOutput => bucket;
    get_bucket_location(GetBucketLocationInput) -> GetBucketLocationOutput => bucket;
    put_object(PutObjectInput) -> PutObjectOutput => object;
    get_object(GetObjectInput) -> GetObjectOutput => object;
    head_object(HeadObjectInput) -> HeadObjectOutput => object;
    delete_object(DeleteObjectInput) -> DeleteObjectOutput => object;
    delete_objects(DeleteObjectsInput) -> DeleteObjectsOutput => object;
    copy_object(CopyObjectInput) -> CopyObjectOutput => object;
    list_objects(ListObjectsInput) -> ListObjectsOutput => list;
    list_objects_v2(ListObjectsV2Input) -> ListObjectsV2Output => list;
    create_multipart_upload(CreateMultipartUploadInput) -> CreateMultipartUploadOutput => multipart;
    upload_part(UploadPartInput) -> UploadPartOutput => multipart;
    upload_part_copy(UploadPartCopyInput) -> UploadPartCopyOutput => multipart;
    complete_multipart_upload(CompleteMultipartUploadInput) -> CompleteMultipartUploadOutput => multipart;
    abort_multipart_upload(AbortMultipartUploadInput) -> AbortMultipartUploadOutput => multipart;
    list_parts(ListPartsInput) -> ListPartsOutput => multipart;
    list_multipart_uploads(ListMultipartUploadsInput) -> ListMultipartUploadsOutput => multipart;
    put_bucket_lifecycle_configuration(PutBucketLifecycleConfigurationInput)
        -> PutBucketLifecycleConfigurationOutput => lifecycle;
    get_bucket_lifecycle_configuration(GetBucketLifecycleConfigurationInput)
        -> GetBucketLifecycleConfigurationOutput => lifecycle;
    delete_bucket_lifecycle(DeleteBucketLifecycleInput) -> DeleteBucketLifecycleOutput => lifecycle;
}
