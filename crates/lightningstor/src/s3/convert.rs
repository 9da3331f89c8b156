//! Conversions between s3s DTOs and the crate's types, and request validation.

use crate::checksum::{Checksum, ChecksumAlgo, ChecksumHeaders};
use crate::error::{LightningError, Result};
use crate::meta::types::{ObjectHeaders, ObjectMeta};
use s3s::dto::{self, Timestamp};

/// S3's limit on key length, in bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// Rejects keys S3 does not accept. Keys never become paths, so any UTF-8 is fine.
pub fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(LightningError::InvalidArgument("the key must not be empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(LightningError::KeyTooLong(key.len()));
    }
    Ok(())
}

/// The S3 bucket naming rules (3-63 chars of a-z, 0-9, '.', '-'; starts and
/// ends with a letter or digit; no "..", not an IP address).
pub fn check_bucket_name(name: &str) -> Result<()> {
    let bad = || Err(LightningError::InvalidBucketName(name.to_owned()));
    let b = name.as_bytes();
    if !(3..=63).contains(&b.len()) {
        return bad();
    }
    if !b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'.' || *c == b'-') {
        return bad();
    }
    // Every dot-separated label starts and ends with a letter or digit
    // (so no "..", "-.", ".-", and no leading or trailing '-' or '.').
    let edge = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !name.split('.').all(|l| l.as_bytes().first().is_some_and(edge) && l.as_bytes().last().is_some_and(edge)) {
        return bad();
    }
    // Prefixes and suffixes AWS reserves for other kinds of names.
    const PREFIXES: [&str; 3] = ["xn--", "sthree-", "amzn-s3-demo-"];
    const SUFFIXES: [&str; 5] = ["-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3"];
    if PREFIXES.iter().any(|p| name.starts_with(p)) || SUFFIXES.iter().any(|s| name.ends_with(s)) {
        return bad();
    }
    if name.parse::<std::net::Ipv4Addr>().is_ok() {
        return bad();
    }
    Ok(())
}

/// Unix milliseconds to an S3 timestamp.
pub fn timestamp(ms: i64) -> Timestamp {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    Timestamp::from(t)
}

/// An S3 timestamp to Unix seconds.
pub fn unix_secs(t: &Timestamp) -> i64 {
    time::OffsetDateTime::from(t.clone()).unix_timestamp()
}

/// A quoted-or-not ETag DTO for an unquoted stored ETag.
pub fn etag(v: &str) -> dto::ETag {
    dto::ETag::Strong(v.to_owned())
}

/// The unquoted value of an ETag DTO.
pub fn etag_value(e: &dto::ETag) -> &str {
    match e {
        dto::ETag::Strong(v) | dto::ETag::Weak(v) => v,
    }
}

/// The standard headers and user metadata of a write request.
#[allow(clippy::too_many_arguments)]
pub fn object_headers(
    content_type: Option<String>,
    content_encoding: Option<String>,
    content_disposition: Option<String>,
    content_language: Option<String>,
    cache_control: Option<String>,
    expires: Option<&Timestamp>,
    metadata: Option<dto::Metadata>,
) -> ObjectHeaders {
    let mut user: Vec<(String, String)> = metadata.unwrap_or_default().into_iter().collect();
    user.sort();
    ObjectHeaders {
        content_type,
        content_encoding: content_encoding.and_then(|e| stored_encoding(&e)),
        content_disposition,
        content_language,
        cache_control,
        expires: expires.map(unix_secs),
        user,
    }
}

/// The Content-Encoding to keep for an object: without `aws-chunked`, which
/// names the framing of the upload, not the object (S3 drops it), and none
/// at all when nothing else is left.
fn stored_encoding(e: &str) -> Option<String> {
    let kept: Vec<&str> =
        e.split(',').map(str::trim).filter(|t| !t.is_empty() && !t.eq_ignore_ascii_case("aws-chunked")).collect();
    if kept.is_empty() { None } else { Some(kept.join(", ")) }
}

/// User metadata as the DTO map.
pub fn metadata(h: &ObjectHeaders) -> Option<dto::Metadata> {
    if h.user.is_empty() { None } else { Some(h.user.iter().cloned().collect()) }
}

/// Builds checksum headers from the typed fields s3s parsed plus raw headers.
#[allow(clippy::too_many_arguments)]
pub fn checksum_headers<'a>(
    headers: &'a http::HeaderMap,
    content_md5: Option<&'a str>,
    algorithm: Option<&'a dto::ChecksumAlgorithm>,
    crc32: Option<&'a str>,
    crc32c: Option<&'a str>,
    crc64nvme: Option<&'a str>,
    sha1: Option<&'a str>,
    sha256: Option<&'a str>,
) -> ChecksumHeaders<'a> {
    ChecksumHeaders {
        content_md5,
        algorithm: algorithm.map(dto::ChecksumAlgorithm::as_str),
        crc32,
        crc32c,
        crc64nvme,
        sha1,
        sha256,
        trailer: headers
            .get("x-amz-trailer")
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.trim().to_ascii_lowercase().starts_with("x-amz-checksum-")),
    }
}

/// The value of the announced checksum trailer, once the body has been read.
pub fn trailer_value(trailers: Option<&s3s::TrailingHeaders>, algo: Option<ChecksumAlgo>) -> Option<String> {
    let (t, algo) = (trailers?, algo?);
    t.read(|h| h.get(algo.header()).and_then(|v| v.to_str().ok()).map(str::to_owned)).flatten()
}

/// The five checksum response fields, one of them set.
#[derive(Debug, Default)]
pub struct ChecksumFields {
    /// CRC32.
    pub crc32: Option<String>,
    /// CRC32C.
    pub crc32c: Option<String>,
    /// CRC64NVME.
    pub crc64nvme: Option<String>,
    /// SHA1.
    pub sha1: Option<String>,
    /// SHA256.
    pub sha256: Option<String>,
    /// FULL_OBJECT or COMPOSITE.
    pub kind: Option<dto::ChecksumType>,
}

/// Spreads a checksum over the response fields.
pub fn checksum_fields(c: Option<&Checksum>) -> ChecksumFields {
    let mut f = ChecksumFields::default();
    let Some(c) = c else { return f };
    let v = Some(c.to_base64());
    match c.algo {
        ChecksumAlgo::Crc32 => f.crc32 = v,
        ChecksumAlgo::Crc32c => f.crc32c = v,
        ChecksumAlgo::Crc64Nvme => f.crc64nvme = v,
        ChecksumAlgo::Sha1 => f.sha1 = v,
        ChecksumAlgo::Sha256 => f.sha256 = v,
    }
    f.kind = Some(dto::ChecksumType::from_static(if c.parts.is_some() {
        dto::ChecksumType::COMPOSITE
    } else {
        dto::ChecksumType::FULL_OBJECT
    }));
    f
}

/// The byte range of part `n` (1-based) of an object.
pub fn part_range(meta: &ObjectMeta, n: i32) -> Result<std::ops::Range<u64>> {
    if n < 1 {
        return Err(LightningError::InvalidArgument(format!("part number {n} is not a positive integer")));
    }
    let bad = || LightningError::InvalidPart(format!("part number {n} does not exist"));
    let idx = usize::try_from(n).ok().and_then(|n| n.checked_sub(1)).ok_or_else(bad)?;
    if meta.parts.is_empty() {
        return if idx == 0 { Ok(0..meta.size) } else { Err(bad()) };
    }
    let start: u64 = meta.parts.iter().take(idx).sum();
    let len = *meta.parts.get(idx).ok_or_else(bad)?;
    Ok(start..start + len)
}

/// `x-amz-copy-source-range` of UploadPartCopy: `bytes=first-last`, both
/// inside a source of `size` bytes (unlike a GET range, it is not clamped).
/// A well-formed range reaching past the source's end is InvalidRange, as S3
/// and the compatibility suite have it; any other form is InvalidArgument.
pub fn copy_source_range(r: &str, size: u64) -> Result<std::ops::Range<u64>> {
    let bad = || {
        LightningError::InvalidArgument(format!(
            "x-amz-copy-source-range {r:?} is not bytes=first-last inside the source's {size} bytes"
        ))
    };
    match dto::Range::parse(r).map_err(|_| bad())? {
        dto::Range::Int { first, last: Some(last) } if first <= last && last < size => Ok(first..last + 1),
        dto::Range::Int { first, last: Some(last) } if first <= last => Err(LightningError::InvalidRange),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_source_ranges_must_lie_inside_the_source() {
        assert_eq!(copy_source_range("bytes=0-9", 10).ok(), Some(0..10));
        assert_eq!(copy_source_range("bytes=5-5", 10).ok(), Some(5..6));
        for past in ["bytes=0-10", "bytes=10-10"] {
            assert!(matches!(copy_source_range(past, 10), Err(LightningError::InvalidRange)), "{past}");
        }
        for bad in ["bytes=5-", "bytes=-3", "bytes=6-5", "0-3"] {
            assert!(matches!(copy_source_range(bad, 10), Err(LightningError::InvalidArgument(_))), "{bad}");
        }
    }

    #[test]
    fn aws_chunked_is_not_an_encoding_of_the_object() {
        assert_eq!(stored_encoding("gzip, aws-chunked").as_deref(), Some("gzip"));
        assert_eq!(stored_encoding("aws-chunked,gzip").as_deref(), Some("gzip"));
        assert_eq!(stored_encoding("aws-chunked"), None);
        assert_eq!(stored_encoding("br").as_deref(), Some("br"));
    }

    #[test]
    fn bucket_names_follow_the_s3_rules() {
        for ok in ["abc", "my-bucket.v2", "a1b"] {
            assert!(check_bucket_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "ab",
            "Abc",
            "a..b",
            "-abc",
            "abc-",
            "foo-.bar",
            "foo.-bar",
            "foo.bar.",
            "name-s3alias",
            "name--ol-s3",
            "xn--abc",
            "sthree-abc",
            "192.168.1.1",
            "a_b",
            &"x".repeat(64),
        ] {
            assert!(check_bucket_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn keys_are_limited_to_1024_bytes_and_may_look_like_paths() {
        assert!(check_key("../../etc/passwd").is_ok());
        assert!(check_key(&"é".repeat(512)).is_ok());
        assert!(matches!(check_key(&"é".repeat(513)), Err(LightningError::KeyTooLong(1026))));
    }

    #[test]
    fn timestamps_round_trip_at_second_resolution() {
        assert_eq!(unix_secs(&timestamp(1_700_000_000_999)), 1_700_000_000);
    }
}

/// The conditions of a DeleteObject request.
pub fn delete_conditions(i: &dto::DeleteObjectInput) -> crate::conditions::DeleteConditions {
    crate::conditions::DeleteConditions {
        if_match: i.if_match.clone(),
        size: i.if_match_size,
        last_modified: i.if_match_last_modified_time.as_ref().map(unix_secs),
    }
}

/// The conditions of one entry of a DeleteObjects request.
pub fn entry_conditions(o: &dto::ObjectIdentifier) -> crate::conditions::DeleteConditions {
    crate::conditions::DeleteConditions {
        if_match: o.e_tag.clone().map(dto::ETagCondition::ETag),
        size: o.size,
        last_modified: o.last_modified_time.as_ref().map(unix_secs),
    }
}
