//! Bucket operations: create, head, delete (only when empty), list, location.

use super::convert::{check_bucket_name, timestamp};
use crate::error::{LightningError, Result};
use crate::meta::{now_ms, ops};
use crate::store::Store;
use s3s::S3Request;
use s3s::dto::*;
use std::sync::Arc;

pub(super) async fn create_bucket(store: &Arc<Store>, req: S3Request<CreateBucketInput>) -> Result<CreateBucketOutput> {
    let name = req.input.bucket;
    check_bucket_name(&name)?;
    let n = name.clone();
    store.meta.write(move |t| ops::create_bucket(t, &n, now_ms())).await?;
    Ok(CreateBucketOutput { location: Some(format!("/{name}")) })
}

pub(super) async fn head_bucket(store: &Arc<Store>, req: S3Request<HeadBucketInput>) -> Result<HeadBucketOutput> {
    let name = req.input.bucket;
    store.meta.get_bucket(&name)?.ok_or(LightningError::NoSuchBucket(name))?;
    Ok(HeadBucketOutput { bucket_region: Some(store.config.region.clone()), ..Default::default() })
}

pub(super) async fn delete_bucket(store: &Arc<Store>, req: S3Request<DeleteBucketInput>) -> Result<DeleteBucketOutput> {
    let name = req.input.bucket;
    store.meta.write(move |t| ops::delete_bucket(t, &name)).await?;
    Ok(DeleteBucketOutput {})
}

pub(super) async fn list_buckets(store: &Arc<Store>, req: S3Request<ListBucketsInput>) -> Result<ListBucketsOutput> {
    let prefix = req.input.prefix.unwrap_or_default();
    let buckets = store
        .meta
        .list_buckets()?
        .into_iter()
        .filter(|(n, _)| n.starts_with(&prefix))
        .map(|(name, meta)| Bucket {
            name: Some(name),
            creation_date: Some(timestamp(meta.created_ms)),
            bucket_region: Some(store.config.region.clone()),
        })
        .collect();
    Ok(ListBucketsOutput { buckets: Some(buckets), owner: Some(owner()), ..Default::default() })
}

pub(super) async fn get_bucket_location(
    store: &Arc<Store>,
    req: S3Request<GetBucketLocationInput>,
) -> Result<GetBucketLocationOutput> {
    let name = req.input.bucket;
    store.meta.get_bucket(&name)?.ok_or(LightningError::NoSuchBucket(name))?;
    let region = &store.config.region;
    Ok(GetBucketLocationOutput {
        location_constraint: (region != "us-east-1").then(|| BucketLocationConstraint::from(region.clone())),
    })
}

/// The single owner of everything on this node.
pub(crate) fn owner() -> Owner {
    Owner { display_name: Some("lightningstor".into()), id: Some("lightningstor".into()) }
}
