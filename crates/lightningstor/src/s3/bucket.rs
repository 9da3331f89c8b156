//! Bucket operations: create, head, delete (only when empty), list, location.

use super::convert::{check_bucket_name, timestamp};
use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::keys::restricted_key;
use crate::keys::{self, Keyring};
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
    created_by(&**store, &store.config, req.credentials.as_ref(), &name).await?;
    Ok(CreateBucketOutput { location: Some(format!("/{name}")) })
}

/// After a bucket was created: a keyring key that created it owns it.
/// Shared by the single node and the cluster.
pub(crate) async fn created_by(
    kr: &dyn Keyring,
    cfg: &Config,
    creds: Option<&s3s::auth::Credentials>,
    bucket: &str,
) -> Result<()> {
    match restricted_key(cfg, creds) {
        Some(id) => keys::grant_creator(kr, bucket, id).await,
        None => Ok(()),
    }
}

/// The buckets of `all` a request may see: all for the admin key and on an
/// anonymous server, else those its key has a grant on.
pub(crate) fn visible(
    kr: &dyn Keyring,
    cfg: &Config,
    creds: Option<&s3s::auth::Credentials>,
    all: Vec<(String, i64)>,
) -> Result<Vec<(String, i64)>> {
    let Some(id) = restricted_key(cfg, creds) else { return Ok(all) };
    let mut out = Vec::new();
    for (b, t) in all {
        if !kr.perms(&b, id)?.is_empty() {
            out.push((b, t));
        }
    }
    Ok(out)
}

pub(super) async fn head_bucket(store: &Arc<Store>, req: S3Request<HeadBucketInput>) -> Result<HeadBucketOutput> {
    let name = req.input.bucket;
    store.meta.get_bucket(&name)?.ok_or(LightningError::NoSuchBucket(name))?;
    Ok(HeadBucketOutput { bucket_region: Some(store.config.region.clone()), ..Default::default() })
}

pub(super) async fn delete_bucket(store: &Arc<Store>, req: S3Request<DeleteBucketInput>) -> Result<DeleteBucketOutput> {
    let name = req.input.bucket;
    let n = name.clone();
    let freed = store.meta.write(move |t| ops::delete_bucket(t, &n)).await?;
    store.spawn_delete(freed);
    keys::forget_bucket(&**store, &name).await?;
    Ok(DeleteBucketOutput {})
}

pub(super) async fn list_buckets(store: &Arc<Store>, req: S3Request<ListBucketsInput>) -> Result<ListBucketsOutput> {
    let all = store.meta.list_buckets()?.into_iter().map(|(name, meta)| (name, meta.created_ms)).collect();
    let all = visible(&**store, &store.config, req.credentials.as_ref(), all)?;
    bucket_page(all, req.input, &store.config.region)
}

/// One page of ListBuckets over `all` (name, creation time in Unix ms), as
/// the input asks: `prefix`, `bucket-region`, `max-buckets` (1..=10000) and
/// the `continuation-token` of the previous page (the last name it held).
/// Shared by the single node and the cluster.
pub(crate) fn bucket_page(mut all: Vec<(String, i64)>, i: ListBucketsInput, region: &str) -> Result<ListBucketsOutput> {
    let max = match i.max_buckets {
        None => usize::MAX,
        Some(n @ 1..=10_000) => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => return Err(LightningError::InvalidArgument(format!("max-buckets {n} is not in 1..=10000"))),
    };
    let after = match i.continuation_token.as_deref() {
        Some(t) => Some(
            String::from_utf8(crate::listing::decode_token(t)?)
                .map_err(|_| LightningError::InvalidArgument("the continuation token is not valid".into()))?,
        ),
        None => None,
    };
    let prefix = i.prefix.clone().unwrap_or_default();
    let other_region = i.bucket_region.as_deref().is_some_and(|r| r != region);
    all.sort();
    let mut matching = all
        .into_iter()
        .filter(|(n, _)| !other_region && n.starts_with(&prefix) && after.as_ref().is_none_or(|a| n > a));
    let page: Vec<_> = matching.by_ref().take(max).collect();
    let more = matching.next().is_some();
    let continuation_token =
        if more { page.last().map(|(n, _)| crate::listing::encode_token(n.as_bytes())) } else { None };
    let buckets = page
        .into_iter()
        .map(|(name, created)| Bucket {
            name: Some(name),
            creation_date: Some(timestamp(created)),
            bucket_region: Some(region.to_owned()),
        })
        .collect();
    Ok(ListBucketsOutput { buckets: Some(buckets), owner: Some(owner()), continuation_token, prefix: i.prefix })
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
