//! ListObjects (v1) and ListObjectsV2 on top of [`crate::listing`].

use super::bucket::owner;
use super::convert::{etag, timestamp};
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::listing::{self, Entry, ListPage, ListQuery, url_encode};
use crate::meta::types::ObjectSummary;
use s3s::S3Request;
use s3s::dto::*;

pub(crate) fn max_keys(v: Option<i32>) -> Result<usize> {
    match v {
        None => Ok(1000),
        Some(n) if n < 0 => Err(LightningError::InvalidArgument("max-keys must not be negative".into())),
        Some(n) => Ok(usize::try_from(n).unwrap_or(0).min(1000)),
    }
}

pub(crate) fn url_mode(e: Option<&EncodingType>) -> Result<bool> {
    match e {
        None => Ok(false),
        Some(e) if e.as_str().eq_ignore_ascii_case(EncodingType::URL) => Ok(true),
        Some(e) => Err(LightningError::InvalidArgument(format!("invalid encoding type {:?}", e.as_str()))),
    }
}

pub(crate) fn text(b: &[u8], url: bool) -> Result<String> {
    let s = std::str::from_utf8(b).map_err(|_| LightningError::Db("a stored key is not UTF-8".into()))?;
    Ok(if url { url_encode(s) } else { s.to_owned() })
}

pub(crate) fn enc(s: Option<String>, url: bool) -> Option<String> {
    s.map(|s| if url { url_encode(&s) } else { s })
}

type Split = (Vec<Object>, Vec<CommonPrefix>);

fn split(p: &ListPage<ObjectSummary>, url: bool, with_owner: bool) -> Result<Split> {
    let mut objects = Vec::new();
    let mut prefixes = Vec::new();
    for e in &p.entries {
        match e {
            Entry::Object(k, s) => objects.push(Object {
                key: Some(text(k, url)?),
                size: i64::try_from(s.size).ok(),
                e_tag: Some(etag(&s.etag)),
                last_modified: Some(timestamp(s.last_modified_ms)),
                storage_class: Some(ObjectStorageClass::from_static(ObjectStorageClass::STANDARD)),
                owner: with_owner.then(owner),
                ..Default::default()
            }),
            Entry::Prefix(cp) => prefixes.push(CommonPrefix { prefix: Some(text(cp, url)?) }),
        }
    }
    Ok((objects, prefixes))
}

pub(crate) async fn list_objects<E: Engine>(e: &E, req: S3Request<ListObjectsInput>) -> Result<ListObjectsOutput> {
    let i = req.input;
    let (q, url, max) = v1_query(&i)?;
    let p = e.list(&i.bucket, q).await?;
    v1_output(i, &p, url, max)
}

/// The listing query of a ListObjects (v1) request, whether keys are
/// URL-encoded, and max-keys.
fn v1_query(i: &ListObjectsInput) -> Result<(ListQuery, bool, usize)> {
    let url = url_mode(i.encoding_type.as_ref())?;
    let max = max_keys(i.max_keys)?;
    let q = ListQuery {
        prefix: i.prefix.clone().unwrap_or_default().into_bytes(),
        delimiter: i.delimiter.clone().filter(|d| !d.is_empty()).map(String::into_bytes),
        start_after: i.marker.clone().filter(|m| !m.is_empty()).map(String::into_bytes),
        max_keys: max,
    };
    Ok((q, url, max))
}

/// The ListObjects (v1) answer for a page.
fn v1_output(i: ListObjectsInput, p: &ListPage<ObjectSummary>, url: bool, max: usize) -> Result<ListObjectsOutput> {
    let (objects, prefixes) = split(p, url, true)?;
    let next_marker = match &p.next_marker {
        Some(m) => Some(text(m, url)?),
        None => None,
    };
    Ok(ListObjectsOutput {
        name: Some(i.bucket),
        prefix: Some(enc(i.prefix, url).unwrap_or_default()),
        marker: Some(enc(i.marker, url).unwrap_or_default()),
        delimiter: enc(i.delimiter, url),
        max_keys: i32::try_from(max).ok(),
        is_truncated: Some(p.is_truncated),
        next_marker,
        contents: Some(objects),
        common_prefixes: Some(prefixes),
        encoding_type: i.encoding_type,
        ..Default::default()
    })
}

pub(crate) async fn list_objects_v2<E: Engine>(
    e: &E,
    req: S3Request<ListObjectsV2Input>,
) -> Result<ListObjectsV2Output> {
    let i = req.input;
    let (q, url, max) = v2_query(&i)?;
    let p = e.list(&i.bucket, q).await?;
    v2_output(i, &p, url, max)
}

/// The listing query of a ListObjectsV2 request, URL mode, and max-keys.
fn v2_query(i: &ListObjectsV2Input) -> Result<(ListQuery, bool, usize)> {
    let url = url_mode(i.encoding_type.as_ref())?;
    let max = max_keys(i.max_keys)?;
    let start = match &i.continuation_token {
        Some(t) => Some(listing::decode_token(t)?),
        None => i.start_after.clone().filter(|s| !s.is_empty()).map(String::into_bytes),
    };
    let q = ListQuery {
        prefix: i.prefix.clone().unwrap_or_default().into_bytes(),
        delimiter: i.delimiter.clone().filter(|d| !d.is_empty()).map(String::into_bytes),
        start_after: start,
        max_keys: max,
    };
    Ok((q, url, max))
}

/// The ListObjectsV2 answer for a page.
fn v2_output(i: ListObjectsV2Input, p: &ListPage<ObjectSummary>, url: bool, max: usize) -> Result<ListObjectsV2Output> {
    let (objects, prefixes) = split(p, url, i.fetch_owner.unwrap_or(false))?;
    let count = objects.len() + prefixes.len();
    Ok(ListObjectsV2Output {
        name: Some(i.bucket),
        prefix: Some(enc(i.prefix, url).unwrap_or_default()),
        delimiter: enc(i.delimiter, url),
        max_keys: i32::try_from(max).ok(),
        key_count: i32::try_from(count).ok(),
        continuation_token: i.continuation_token,
        next_continuation_token: p.next_marker.as_deref().map(listing::encode_token),
        is_truncated: Some(p.is_truncated),
        start_after: enc(i.start_after, url),
        contents: Some(objects),
        common_prefixes: Some(prefixes),
        encoding_type: i.encoding_type,
        ..Default::default()
    })
}
