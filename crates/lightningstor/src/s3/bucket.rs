//! Bucket operations: create, head, delete (only when empty), list, location.

use super::convert::{check_bucket_name, timestamp};
use crate::config::Config;
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::keys::restricted_key;
use crate::keys::{self, Keyring};
use s3s::S3Request;
use s3s::dto::*;

pub(crate) async fn create_bucket<E: Engine>(e: &E, req: S3Request<CreateBucketInput>) -> Result<CreateBucketOutput> {
    let name = req.input.bucket;
    check_bucket_name(&name)?;
    e.create_bucket(&name).await?;
    created_by(e.keyring(), e.config(), req.credentials.as_ref(), &name).await?;
    Ok(CreateBucketOutput { location: Some(format!("/{name}")) })
}

/// After a bucket was created: a keyring key that created it owns it.
async fn created_by(
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
fn visible(
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

pub(crate) async fn head_bucket<E: Engine>(e: &E, req: S3Request<HeadBucketInput>) -> Result<HeadBucketOutput> {
    e.require_bucket(&req.input.bucket).await?;
    Ok(HeadBucketOutput { bucket_region: Some(e.config().region.clone()), ..Default::default() })
}

pub(crate) async fn delete_bucket<E: Engine>(e: &E, req: S3Request<DeleteBucketInput>) -> Result<DeleteBucketOutput> {
    let name = req.input.bucket;
    e.delete_bucket(&name).await?;
    keys::forget_bucket(e.keyring(), &name).await?;
    Ok(DeleteBucketOutput {})
}

pub(crate) async fn list_buckets<E: Engine>(e: &E, req: S3Request<ListBucketsInput>) -> Result<ListBucketsOutput> {
    let all = e.list_buckets().await?;
    let all = visible(e.keyring(), e.config(), req.credentials.as_ref(), all)?;
    bucket_page(all, req.input, &e.config().region)
}

/// One page of ListBuckets over `all` (name, creation time in Unix ms), as
/// the input asks: `prefix`, `bucket-region`, `max-buckets` (1..=10000) and
/// the `continuation-token` of the previous page (the last name it held).
fn bucket_page(mut all: Vec<(String, i64)>, i: ListBucketsInput, region: &str) -> Result<ListBucketsOutput> {
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

pub(crate) async fn get_bucket_location<E: Engine>(
    e: &E,
    req: S3Request<GetBucketLocationInput>,
) -> Result<GetBucketLocationOutput> {
    e.require_bucket(&req.input.bucket).await?;
    let region = &e.config().region;
    Ok(GetBucketLocationOutput {
        location_constraint: (region != "us-east-1").then(|| BucketLocationConstraint::from(region.clone())),
    })
}

/// The single owner of everything on this node.
pub(crate) fn owner() -> Owner {
    Owner { display_name: Some("lightningstor".into()), id: Some("lightningstor".into()) }
}
