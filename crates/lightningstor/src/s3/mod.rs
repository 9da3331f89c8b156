//! The S3 protocol: `impl S3 for LightningS3`, one method per operation,
//! over any [`Engine`]: the local store (a single node) or the cluster
//! coordinator (a cluster node). Both modes run this one front end.
//!
//! Each method forwards to a handler in the submodule of its resource
//! (`bucket`, `object`, `multipart`, `list`, `lifecycle`, `versions`) that works in
//! [`LightningError`](crate::error::LightningError); the conversion to the
//! S3 error on the wire happens here, once.

pub(crate) mod bucket;
pub mod convert;
pub mod lifecycle;
pub(crate) mod list;
pub(crate) mod multipart;
pub(crate) mod object;
pub(crate) mod options;
pub(crate) mod versions;

use crate::engine::Engine;
use crate::error::Result;
use s3s::dto::*;
use s3s::{S3, S3Request, S3Response, S3Result};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The S3 service over an [`Engine`]: `LightningS3<Arc<Store>>` serves a
/// single node, `LightningS3<Arc<Coordinator>>` (`cluster::s3::ClusterS3`) a
/// cluster node.
#[derive(Debug, Clone)]
pub struct LightningS3<E> {
    engines: Arc<[E]>,
    next: Arc<AtomicUsize>,
}

impl<E: Engine> LightningS3<E> {
    /// Serves S3 over `engine`.
    pub fn new(engine: E) -> Self {
        LightningS3 { engines: Arc::from([engine]), next: Arc::default() }
    }

    /// Sends each request to the next of `engines` in turn (tests: every
    /// operation of a sequence lands on a different cluster coordinator).
    ///
    /// # Panics
    ///
    /// When `engines` is empty.
    pub fn rotating(engines: Vec<E>) -> Self {
        assert!(!engines.is_empty(), "a rotating service needs engines");
        LightningS3 { engines: engines.into(), next: Arc::default() }
    }

    /// The engine that serves the next request.
    fn engine(&self) -> &E {
        match &*self.engines {
            [one] => one,
            all => &all[self.next.fetch_add(1, Ordering::Relaxed) % all.len()],
        }
    }

    /// Counts the request on the engine that served it and turns an error
    /// into the S3 error on the wire.
    fn finish<T>(e: &E, r: Result<T>) -> S3Result<S3Response<T>> {
        let m = e.metrics();
        m.inc(&m.requests);
        crate::error::with_request_id(match r {
            Ok(v) => Ok(S3Response::new(v)),
            Err(err) => {
                m.inc(&m.request_errors);
                if matches!(err, crate::error::LightningError::BadDigest(_)) {
                    m.inc(&m.bad_digests);
                }
                Err(err.to_s3_error())
            }
        })
    }
}

macro_rules! ops {
    ($($name:ident($input:ty) -> $output:ty => $module:ident;)*) => {
        #[async_trait::async_trait]
        impl<E: Engine> S3 for LightningS3<E> {
            $(
                #[tracing::instrument(level = "debug", skip_all, fields(op = stringify!($name)))]
                async fn $name(&self, req: S3Request<$input>) -> S3Result<S3Response<$output>> {
                    let e = self.engine();
                    let r = match options::Supported::check_supported(&req.input) {
                        Ok(()) => $module::$name(e, req).await,
                        Err(err) => Err(err),
                    };
                    Self::finish(e, r)
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
    put_bucket_versioning(PutBucketVersioningInput) -> PutBucketVersioningOutput => versions;
    get_bucket_versioning(GetBucketVersioningInput) -> GetBucketVersioningOutput => versions;
    list_object_versions(ListObjectVersionsInput) -> ListObjectVersionsOutput => versions;
}
