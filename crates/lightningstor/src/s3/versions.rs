//! Bucket versioning: Put/GetBucketVersioning and ListObjectVersions (the
//! versioned reads, writes and deletes are in `object` and `multipart`).

use super::bucket::owner;
use super::convert::{etag, timestamp};
use super::list::{enc, max_keys, text, url_mode};
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::listing::ListQuery;
use crate::meta::types::Versioning;
use crate::versioning::{VersionItem, VersionQuery, VersionRef};
use s3s::S3Request;
use s3s::dto::*;

pub(crate) async fn put_bucket_versioning<E: Engine>(
    e: &E,
    req: S3Request<PutBucketVersioningInput>,
) -> Result<PutBucketVersioningOutput> {
    let i = req.input;
    let state = match i.versioning_configuration.status.as_ref().map(BucketVersioningStatus::as_str) {
        Some(BucketVersioningStatus::ENABLED) => Versioning::Enabled,
        Some(BucketVersioningStatus::SUSPENDED) => Versioning::Suspended,
        Some(other) => return Err(LightningError::MalformedXml(format!("unknown versioning status {other:?}"))),
        None => return Err(LightningError::MalformedXml("the versioning configuration has no Status".into())),
    };
    e.set_versioning(&i.bucket, state).await?;
    Ok(PutBucketVersioningOutput {})
}

pub(crate) async fn get_bucket_versioning<E: Engine>(
    e: &E,
    req: S3Request<GetBucketVersioningInput>,
) -> Result<GetBucketVersioningOutput> {
    let status = e.versioning(&req.input.bucket).await?.map(|s| {
        BucketVersioningStatus::from_static(match s {
            Versioning::Enabled => BucketVersioningStatus::ENABLED,
            Versioning::Suspended => BucketVersioningStatus::SUSPENDED,
        })
    });
    Ok(GetBucketVersioningOutput { status, mfa_delete: None })
}

pub(crate) async fn list_object_versions<E: Engine>(
    e: &E,
    req: S3Request<ListObjectVersionsInput>,
) -> Result<ListObjectVersionsOutput> {
    let i = req.input;
    let url = url_mode(i.encoding_type.as_ref())?;
    let max = max_keys(i.max_keys)?;
    let q = VersionQuery {
        list: ListQuery {
            prefix: i.prefix.clone().unwrap_or_default().into_bytes(),
            delimiter: i.delimiter.clone().filter(|d| !d.is_empty()).map(String::into_bytes),
            start_after: None,
            max_keys: max,
        },
        key_marker: i.key_marker.clone().filter(|m| !m.is_empty()).map(String::into_bytes),
        version_marker: i.version_id_marker.as_deref().filter(|m| !m.is_empty()).map(VersionRef::parse).transpose()?,
    };
    let page = e.list_versions(&i.bucket, q).await?;
    let (mut versions, mut markers, mut prefixes) = (Vec::new(), Vec::new(), Vec::new());
    for item in &page.items {
        match item {
            VersionItem::Version { key, summary: s, is_latest } if s.marker => markers.push(DeleteMarkerEntry {
                is_latest: Some(*is_latest),
                key: Some(text(key, url)?),
                last_modified: Some(timestamp(s.last_modified_ms)),
                owner: Some(owner()),
                version_id: Some(s.id()),
            }),
            VersionItem::Version { key, summary: s, is_latest } => versions.push(ObjectVersion {
                e_tag: Some(etag(&s.etag)),
                is_latest: Some(*is_latest),
                key: Some(text(key, url)?),
                last_modified: Some(timestamp(s.last_modified_ms)),
                owner: Some(owner()),
                size: i64::try_from(s.size).ok(),
                storage_class: Some(ObjectVersionStorageClass::from_static(ObjectVersionStorageClass::STANDARD)),
                version_id: Some(s.id()),
                ..Default::default()
            }),
            VersionItem::Prefix(cp) => prefixes.push(CommonPrefix { prefix: Some(text(cp, url)?) }),
        }
    }
    let next_key_marker = match &page.next_key_marker {
        Some(k) => Some(text(k, url)?),
        None => None,
    };
    Ok(ListObjectVersionsOutput {
        name: Some(i.bucket),
        prefix: Some(enc(i.prefix, url).unwrap_or_default()),
        delimiter: enc(i.delimiter, url),
        key_marker: Some(enc(i.key_marker, url).unwrap_or_default()),
        version_id_marker: Some(i.version_id_marker.unwrap_or_default()),
        max_keys: i32::try_from(max).ok(),
        is_truncated: Some(page.is_truncated),
        next_key_marker,
        next_version_id_marker: page.next_version_marker,
        versions: Some(versions),
        delete_markers: Some(markers),
        common_prefixes: Some(prefixes),
        encoding_type: i.encoding_type,
        ..Default::default()
    })
}
