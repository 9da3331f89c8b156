//! Conditional requests: If-Match, If-None-Match, If-(Un)Modified-Since.
//!
//! Pure evaluation in the order RFC 9110 §13.2.2 prescribes (which is also
//! what S3 documents): If-Match, else If-Unmodified-Since; then
//! If-None-Match, else If-Modified-Since. Times compare at whole seconds,
//! the resolution of HTTP dates.

use crate::error::{LightningError, Result};
use s3s::dto::{ETag, ETagCondition};

/// The preconditions of one request.
#[derive(Debug, Clone, Default)]
pub struct Preconditions {
    /// If-Match (or x-amz-copy-source-if-match).
    pub if_match: Option<ETagCondition>,
    /// If-None-Match (or x-amz-copy-source-if-none-match).
    pub if_none_match: Option<ETagCondition>,
    /// If-Modified-Since, in Unix seconds.
    pub if_modified_since: Option<i64>,
    /// If-Unmodified-Since, in Unix seconds.
    pub if_unmodified_since: Option<i64>,
}

/// What a failed If-None-Match / If-Modified-Since means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// GET/HEAD: the client's copy is current (304).
    Read,
    /// Copy source: every failed condition is 412.
    Copy,
}

fn matches(cond: &ETagCondition, etag: &str) -> bool {
    match cond {
        ETagCondition::Any => true,
        ETagCondition::ETag(ETag::Strong(v) | ETag::Weak(v)) => v == etag,
    }
}

impl Preconditions {
    /// Evaluates against an existing object with `etag` (unquoted) and
    /// `last_modified` (Unix seconds).
    pub fn check(&self, etag: &str, last_modified: i64, mode: Mode) -> Result<()> {
        if let Some(c) = &self.if_match {
            if !matches(c, etag) {
                return Err(LightningError::PreconditionFailed);
            }
        } else if let Some(t) = self.if_unmodified_since
            && last_modified > t
        {
            return Err(LightningError::PreconditionFailed);
        }
        let not_modified = if let Some(c) = &self.if_none_match {
            matches(c, etag)
        } else if let Some(t) = self.if_modified_since {
            last_modified <= t
        } else {
            false
        };
        match (not_modified, mode) {
            (false, _) => Ok(()),
            (true, Mode::Read) => Err(LightningError::NotModified { etag: etag.to_owned(), last_modified }),
            (true, Mode::Copy) => Err(LightningError::PreconditionFailed),
        }
    }
}

/// Conditional PUT / CompleteMultipartUpload: `If-None-Match: *` fails when
/// the key exists; `If-Match` fails when it is missing or differs.
pub fn check_write(
    existing_etag: Option<&str>,
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
    key: &str,
) -> Result<()> {
    if let Some(c) = if_none_match {
        let hit = existing_etag.is_some_and(|e| matches(c, e));
        if hit {
            return Err(LightningError::PreconditionFailed);
        }
    }
    if let Some(c) = if_match {
        match existing_etag {
            None => {
                return Err(LightningError::NoSuchKey { key: key.to_owned() });
            }
            Some(e) if !matches(c, e) => return Err(LightningError::PreconditionFailed),
            Some(_) => {}
        }
    }
    Ok(())
}

/// The conditions of a DeleteObject (`If-Match`, `x-amz-if-match-size`,
/// `x-amz-if-match-last-modified-time`) or of one entry of DeleteObjects
/// (its `ETag`, `Size` and `LastModifiedTime` elements).
#[derive(Debug, Clone, Default)]
pub struct DeleteConditions {
    /// The ETag (or `*`) the current object must have.
    pub if_match: Option<ETagCondition>,
    /// The size in bytes it must have.
    pub size: Option<i64>,
    /// Its last-modified time, in Unix seconds.
    pub last_modified: Option<i64>,
}

impl DeleteConditions {
    /// True when the delete is unconditional.
    pub fn is_empty(&self) -> bool {
        self.if_match.is_none() && self.size.is_none() && self.last_modified.is_none()
    }

    /// Evaluates against the current object of `key`, given as
    /// `(etag unquoted, size, last-modified Unix seconds)`. As in S3: a
    /// conditional delete of a missing key is NoSuchKey, a condition that
    /// does not hold is PreconditionFailed; an unconditional one always passes.
    pub fn check(&self, current: Option<(&str, u64, i64)>, key: &str) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let Some((etag, size, last_modified)) = current else {
            return Err(LightningError::NoSuchKey { key: key.to_owned() });
        };
        let etag_ok = self.if_match.as_ref().is_none_or(|c| matches(c, etag));
        let size_ok = self.size.is_none_or(|s| u64::try_from(s).ok() == Some(size));
        let time_ok = self.last_modified.is_none_or(|t| t == last_modified);
        if etag_ok && size_ok && time_ok { Ok(()) } else { Err(LightningError::PreconditionFailed) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag(s: &str) -> ETagCondition {
        ETagCondition::ETag(ETag::Strong(s.to_owned()))
    }

    #[test]
    fn conditional_deletes_need_the_object_and_every_named_property() {
        let any = DeleteConditions::default();
        assert!(any.check(None, "k").is_ok(), "an unconditional delete of nothing succeeds");
        let c = DeleteConditions { if_match: Some(tag("e")), size: Some(3), last_modified: Some(100) };
        assert!(c.check(Some(("e", 3, 100)), "k").is_ok());
        assert!(matches!(c.check(None, "k"), Err(LightningError::NoSuchKey { .. })));
        assert!(matches!(c.check(Some(("f", 3, 100)), "k"), Err(LightningError::PreconditionFailed)));
        assert!(matches!(c.check(Some(("e", 4, 100)), "k"), Err(LightningError::PreconditionFailed)));
        assert!(matches!(c.check(Some(("e", 3, 101)), "k"), Err(LightningError::PreconditionFailed)));
        let star = DeleteConditions { if_match: Some(ETagCondition::Any), ..Default::default() };
        assert!(star.check(Some(("x", 1, 1)), "k").is_ok());
        assert!(star.check(None, "k").is_err());
    }

    #[test]
    fn if_match_with_another_etag_fails_the_precondition() {
        let p = Preconditions { if_match: Some(tag("x")), ..Default::default() };
        assert!(matches!(p.check("y", 0, Mode::Read), Err(LightningError::PreconditionFailed)));
        assert!(p.check("x", 0, Mode::Read).is_ok());
    }

    #[test]
    fn if_none_match_with_the_current_etag_is_not_modified_on_reads() {
        let p = Preconditions { if_none_match: Some(tag("x")), ..Default::default() };
        assert!(matches!(p.check("x", 0, Mode::Read), Err(LightningError::NotModified { .. })));
        assert!(matches!(p.check("x", 0, Mode::Copy), Err(LightningError::PreconditionFailed)));
    }

    #[test]
    fn dates_compare_at_whole_seconds() {
        let p = Preconditions { if_modified_since: Some(100), ..Default::default() };
        assert!(matches!(p.check("x", 100, Mode::Read), Err(LightningError::NotModified { .. })));
        assert!(p.check("x", 101, Mode::Read).is_ok());
        let p = Preconditions { if_unmodified_since: Some(100), ..Default::default() };
        assert!(p.check("x", 100, Mode::Read).is_ok());
        assert!(p.check("x", 101, Mode::Read).is_err());
    }

    #[test]
    fn a_matching_if_match_overrides_if_unmodified_since() {
        let p = Preconditions { if_match: Some(tag("x")), if_unmodified_since: Some(10), ..Default::default() };
        assert!(p.check("x", 500, Mode::Copy).is_ok());
    }

    #[test]
    fn conditional_puts_follow_s3_rules() {
        let any = ETagCondition::Any;
        assert!(check_write(None, None, Some(&any), "k").is_ok());
        assert!(matches!(check_write(Some("e"), None, Some(&any), "k"), Err(LightningError::PreconditionFailed)));
        assert!(matches!(check_write(None, Some(&tag("e")), None, "k"), Err(LightningError::NoSuchKey { .. })));
        assert!(check_write(Some("e"), Some(&tag("e")), None, "k").is_ok());
        assert!(check_write(Some("f"), Some(&tag("e")), None, "k").is_err());
    }
}
