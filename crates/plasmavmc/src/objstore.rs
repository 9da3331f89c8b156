//! The LightningStor side: multipart uploads of artifacts and range GETs,
//! through aws-sdk-s3 like any other S3 client.

use crate::config::Config;
use crate::error::{PlasmaError, Result};
use aws_sdk_s3::Client;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;

/// Prefix of every artifact's object key.
pub const KEY_PREFIX: &str = "images/";

/// The object key of an image's artifact.
pub fn object_key(image_id: &str) -> String {
    format!("{KEY_PREFIX}{image_id}")
}

/// An S3 client bound to the artifact bucket.
#[derive(Debug, Clone)]
pub struct ObjectStore {
    pub client: Client,
    pub bucket: String,
}

fn s3err<E: std::error::Error + Send + Sync + 'static>(what: &str) -> impl FnOnce(E) -> PlasmaError + '_ {
    move |e| PlasmaError::ObjectStore(format!("{what}: {}", aws_sdk_s3::error::DisplayErrorContext(e)))
}

impl ObjectStore {
    pub fn new(cfg: &Config) -> Self {
        let creds = aws_credential_types::Credentials::new(
            cfg.s3_access_key.clone(),
            cfg.s3_secret_key.clone(),
            None,
            None,
            "plasmavmc",
        );
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(aws_sdk_s3::config::Region::new(cfg.s3_region.clone()))
            .credentials_provider(creds)
            .endpoint_url(cfg.s3_endpoint.clone())
            .force_path_style(true)
            .build();
        ObjectStore { client: Client::from_conf(conf), bucket: cfg.s3_bucket.clone() }
    }

    /// Creates the bucket unless it exists.
    pub async fn ensure_bucket(&self) -> Result<()> {
        if self.client.head_bucket().bucket(&self.bucket).send().await.is_ok() {
            return Ok(());
        }
        match self.client.create_bucket().bucket(&self.bucket).send().await {
            Ok(_) => Ok(()),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_bucket_already_owned_by_you()) => Ok(()),
            Err(e) => Err(s3err("create bucket")(e)),
        }
    }

    /// Size of an object.
    pub async fn size(&self, bucket: &str, key: &str) -> Result<u64> {
        let h = self.client.head_object().bucket(bucket).key(key).send().await.map_err(s3err("head object"))?;
        h.content_length()
            .and_then(|l| u64::try_from(l).ok())
            .ok_or_else(|| PlasmaError::ObjectStore("no length".into()))
    }

    /// Bytes `[start, end)` of an artifact.
    pub async fn get_range(&self, key: &str, start: u64, end: u64) -> Result<Bytes> {
        let r = self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(key)
            .range(format!("bytes={start}-{}", end - 1))
            .send()
            .await
            .map_err(s3err("range GET"))?;
        let body = r.body.collect().await.map_err(s3err("range GET body"))?.into_bytes();
        if body.len() as u64 != end - start {
            return Err(PlasmaError::ObjectStore(format!(
                "range GET {start}..{end} of {key} returned {} bytes",
                body.len()
            )));
        }
        Ok(body)
    }

    /// The whole object as a stream (for imports from S3).
    pub async fn get_stream(&self, bucket: &str, key: &str) -> Result<(ByteStream, Option<u64>)> {
        let r = self.client.get_object().bucket(bucket).key(key).send().await.map_err(s3err("GET"))?;
        let len = r.content_length().and_then(|l| u64::try_from(l).ok());
        Ok((r.body, len))
    }

    pub async fn delete(&self, key: &str) -> Result<()> {
        self.client.delete_object().bucket(&self.bucket).key(key).send().await.map_err(s3err("delete object"))?;
        Ok(())
    }

    /// Aborts every multipart upload of a key under `prefix` (all of them
    /// when `exact` is false, only of `prefix` itself when it is true):
    /// what a crash during an upload leaves behind. Returns how many.
    pub async fn abort_uploads(&self, prefix: &str, exact: bool) -> Result<usize> {
        let mut aborted = 0;
        let (mut key_marker, mut id_marker) = (None::<String>, None::<String>);
        loop {
            let page = self
                .client
                .list_multipart_uploads()
                .bucket(&self.bucket)
                .prefix(prefix)
                .set_key_marker(key_marker.take())
                .set_upload_id_marker(id_marker.take())
                .send()
                .await
                .map_err(s3err("list multipart uploads"))?;
            for u in page.uploads() {
                let (Some(key), Some(id)) = (u.key(), u.upload_id()) else { continue };
                if exact && key != prefix {
                    continue;
                }
                self.client
                    .abort_multipart_upload()
                    .bucket(&self.bucket)
                    .key(key)
                    .upload_id(id)
                    .send()
                    .await
                    .map_err(s3err("abort multipart upload"))?;
                aborted += 1;
            }
            if page.is_truncated() != Some(true) {
                return Ok(aborted);
            }
            key_marker = page.next_key_marker().map(str::to_owned);
            id_marker = page.next_upload_id_marker().map(str::to_owned);
            if key_marker.is_none() {
                return Ok(aborted);
            }
        }
    }

    /// Starts a multipart upload of `key`.
    pub async fn begin(&self, key: &str) -> Result<Multipart> {
        let r = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(key)
            .send()
            .await
            .map_err(s3err("create multipart upload"))?;
        let upload_id = r.upload_id().ok_or_else(|| PlasmaError::ObjectStore("no upload id".into()))?.to_owned();
        Ok(Multipart { store: self.clone(), key: key.to_owned(), upload_id })
    }
}

/// An open multipart upload. Parts may be sent concurrently.
#[derive(Debug, Clone)]
pub struct Multipart {
    store: ObjectStore,
    key: String,
    upload_id: String,
}

impl Multipart {
    /// Uploads part `number` (1-based) and returns its completed record.
    pub async fn part(&self, number: i32, data: Bytes) -> Result<CompletedPart> {
        let r = self
            .store
            .client
            .upload_part()
            .bucket(&self.store.bucket)
            .key(&self.key)
            .upload_id(&self.upload_id)
            .part_number(number)
            .body(ByteStream::from(data))
            .send()
            .await
            .map_err(s3err("upload part"))?;
        Ok(CompletedPart::builder().part_number(number).set_e_tag(r.e_tag().map(str::to_owned)).build())
    }

    pub async fn complete(&self, mut parts: Vec<CompletedPart>) -> Result<()> {
        parts.sort_by_key(|p| p.part_number());
        self.store
            .client
            .complete_multipart_upload()
            .bucket(&self.store.bucket)
            .key(&self.key)
            .upload_id(&self.upload_id)
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
            .send()
            .await
            .map_err(s3err("complete multipart upload"))?;
        Ok(())
    }

    /// Best effort: frees the parts of an upload that failed.
    pub async fn abort(&self) {
        let r = self
            .store
            .client
            .abort_multipart_upload()
            .bucket(&self.store.bucket)
            .key(&self.key)
            .upload_id(&self.upload_id)
            .send()
            .await;
        if let Err(e) = r {
            tracing::warn!(key = %self.key, error = %aws_sdk_s3::error::DisplayErrorContext(e), "abort multipart upload failed");
        }
    }
}
