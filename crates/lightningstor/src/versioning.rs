//! Object versions as clients name and list them (pure).
//!
//! A version's id is its row version (unique and increasing per node) in
//! 16 hex digits, or `null` for the null version. ListObjectVersions pages
//! over the versions in (key ascending, version newest first) order through
//! a [`VersionCursor`], with the same prefix / delimiter rules as
//! [`crate::listing`], `key-marker` / `version-id-marker` and max-keys
//! counting versions, delete markers and common prefixes alike.

use crate::error::{LightningError, Result};
use crate::listing::{ListQuery, common_prefix, prefix_successor};

/// The id of version `version` (`null` for the null version).
pub fn version_id(version: u64, null: bool) -> String {
    if null { "null".to_owned() } else { format!("{version:016x}") }
}

/// A version named by a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionRef {
    /// The `null` version.
    Null,
    /// The version with this row version.
    Id(u64),
}

impl VersionRef {
    /// Parses a `versionId`: `null` or 16 hex digits; anything else is
    /// InvalidArgument, as S3 answers an id it never gave.
    pub fn parse(s: &str) -> Result<VersionRef> {
        if s == "null" {
            return Ok(VersionRef::Null);
        }
        if s.len() == 16
            && s.bytes().all(|b| b.is_ascii_hexdigit())
            && let Ok(v) = u64::from_str_radix(s, 16)
        {
            return Ok(VersionRef::Id(v));
        }
        Err(LightningError::InvalidArgument(format!("invalid version id specified: {s:?}")))
    }

    /// Whether a version (row version, null flag) is the one named.
    pub fn names(&self, version: u64, null: bool) -> bool {
        match self {
            VersionRef::Null => null,
            VersionRef::Id(v) => !null && *v == version,
        }
    }
}

/// What a version listing shows of a version.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VersionSummary {
    /// Row version.
    pub version: u64,
    /// The null version.
    pub null: bool,
    /// A delete marker (size and ETag are then empty).
    pub marker: bool,
    /// Size in bytes.
    pub size: u64,
    /// ETag without quotes.
    pub etag: String,
    /// Last modification, Unix milliseconds.
    pub last_modified_ms: i64,
}

impl VersionSummary {
    /// The id answered to clients.
    pub fn id(&self) -> String {
        version_id(self.version, self.null)
    }
}

/// An ordered source of versions: (key, summary) by key, then newest first.
pub trait VersionCursor {
    /// Positions the cursor at the first version of the first key `>= from`.
    fn seek(&mut self, from: &[u8]) -> Result<()>;
    /// The next version, or `None` at the end.
    fn next(&mut self) -> Result<Option<(Vec<u8>, VersionSummary)>>;
}

/// One ListObjectVersions request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionQuery {
    /// Prefix, delimiter and max-keys as for ListObjects (`start_after` unused).
    pub list: ListQuery,
    /// Start after this key (all its versions, unless `version_marker`).
    pub key_marker: Option<Vec<u8>>,
    /// With `key_marker`: start after this version of that key.
    pub version_marker: Option<VersionRef>,
}

/// One entry of a version page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VersionItem {
    /// A version or delete marker, and whether it is its key's latest.
    Version { key: Vec<u8>, summary: VersionSummary, is_latest: bool },
    /// A common prefix.
    Prefix(Vec<u8>),
}

/// One page of ListObjectVersions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionPage {
    /// Versions, markers and common prefixes, in order.
    pub items: Vec<VersionItem>,
    /// Whether more follow.
    pub is_truncated: bool,
    /// Where the next page starts (NextKeyMarker), when truncated.
    pub next_key_marker: Option<Vec<u8>>,
    /// NextVersionIdMarker, when the page ends on a version.
    pub next_version_marker: Option<String>,
}

/// Produces one page for `q` from `cur`.
pub fn page<C: VersionCursor>(cur: &mut C, q: &VersionQuery) -> Result<VersionPage> {
    if q.version_marker.is_some() && q.key_marker.is_none() {
        return Err(LightningError::InvalidArgument("a version-id-marker needs a key-marker".into()));
    }
    let max = q.list.max_keys;
    if max == 0 {
        return Ok(VersionPage::default());
    }
    let prefix = q.list.prefix.as_slice();
    let marker = q.key_marker.as_deref();
    match marker {
        Some(m) if m > prefix => cur.seek(m)?,
        _ => cur.seek(prefix)?,
    }
    let mut out = VersionPage::default();
    let mut prev: Option<Vec<u8>> = None;
    // Within the marker key, versions up to the version marker are skipped.
    let mut passed_marker = false;
    while let Some((key, s)) = cur.next()? {
        if !key.starts_with(prefix) {
            break;
        }
        let is_latest = prev.as_deref() != Some(key.as_slice());
        prev = Some(key.clone());
        if let Some(m) = marker {
            if key.as_slice() < m {
                continue;
            }
            if key.as_slice() == m {
                match q.version_marker {
                    // Newest first: the versions after `v` are the older ones.
                    Some(VersionRef::Id(v)) if s.version >= v => continue,
                    Some(VersionRef::Null) if !passed_marker => {
                        passed_marker = s.null;
                        continue;
                    }
                    Some(_) => {}
                    None => continue,
                }
            }
        }
        if let Some(cp) = common_prefix(&q.list, &key) {
            let cp = cp.to_vec();
            if marker.is_none_or(|m| cp.as_slice() > m) {
                if out.items.len() >= max {
                    out.is_truncated = true;
                    break;
                }
                out.items.push(VersionItem::Prefix(cp.clone()));
            }
            prev = None;
            match prefix_successor(&cp) {
                Some(next) => cur.seek(&next)?,
                None => break,
            }
            continue;
        }
        if out.items.len() >= max {
            out.is_truncated = true;
            break;
        }
        out.items.push(VersionItem::Version { key, summary: s, is_latest });
    }
    if out.is_truncated {
        match out.items.last() {
            Some(VersionItem::Version { key, summary, .. }) => {
                out.next_key_marker = Some(key.clone());
                out.next_version_marker = Some(summary.id());
            }
            Some(VersionItem::Prefix(cp)) => out.next_key_marker = Some(cp.clone()),
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Versions in a map keyed (key, !version): the store's order.
    struct Model {
        rows: BTreeMap<(Vec<u8>, u64), VersionSummary>,
        pos: Option<(Vec<u8>, u64)>,
    }

    impl VersionCursor for Model {
        fn seek(&mut self, from: &[u8]) -> Result<()> {
            self.pos = Some((from.to_vec(), 0));
            Ok(())
        }
        fn next(&mut self) -> Result<Option<(Vec<u8>, VersionSummary)>> {
            let Some(pos) = self.pos.clone() else { return Ok(None) };
            match self.rows.range(pos..).next() {
                Some(((k, rev), s)) => {
                    self.pos = Some((k.clone(), rev + 1));
                    Ok(Some((k.clone(), s.clone())))
                }
                None => Ok(None),
            }
        }
    }

    fn model(rows: &[(&str, u64, bool)]) -> Model {
        let mut m = BTreeMap::new();
        for &(k, v, null) in rows {
            let s = VersionSummary { version: v, null, marker: false, size: 1, etag: "e".into(), last_modified_ms: 0 };
            m.insert((k.as_bytes().to_vec(), !v), s);
        }
        Model { rows: m, pos: None }
    }

    fn names(p: &VersionPage) -> Vec<String> {
        p.items
            .iter()
            .map(|i| match i {
                VersionItem::Version { key, summary, is_latest } => {
                    format!("{}@{}{}", String::from_utf8_lossy(key), summary.version, if *is_latest { "*" } else { "" })
                }
                VersionItem::Prefix(p) => format!("{}/", String::from_utf8_lossy(p).trim_end_matches('/')),
            })
            .collect()
    }

    fn q(max: usize, key: Option<&str>, version: Option<VersionRef>) -> VersionQuery {
        VersionQuery {
            list: ListQuery { max_keys: max, ..Default::default() },
            key_marker: key.map(|k| k.as_bytes().to_vec()),
            version_marker: version,
        }
    }

    #[test]
    fn version_ids_round_trip_and_garbage_is_refused() {
        assert_eq!(VersionRef::parse(&version_id(0x1234, false)).unwrap(), VersionRef::Id(0x1234));
        assert_eq!(VersionRef::parse("null").unwrap(), VersionRef::Null);
        for bad in ["", "xyz", "12345", "0000000000000000a", "000000000000000g"] {
            assert!(matches!(VersionRef::parse(bad), Err(LightningError::InvalidArgument(_))), "{bad}");
        }
    }

    #[test]
    fn pages_walk_every_version_once_newest_first_with_the_latest_marked() {
        let rows =
            [("a", 3, false), ("a", 2, false), ("a", 1, true), ("b", 5, false), ("c", 4, false), ("c", 1, false)];
        let all = page(&mut model(&rows), &q(100, None, None)).unwrap();
        assert_eq!(names(&all), ["a@3*", "a@2", "a@1", "b@5*", "c@4*", "c@1"]);
        assert!(!all.is_truncated);
        // Pages of 2 give the same sequence, resuming within a key.
        let mut seen = Vec::new();
        let (mut key, mut ver) = (None, None);
        for _ in 0..10 {
            let p = page(&mut model(&rows), &q(2, key.as_deref(), ver)).unwrap();
            seen.extend(names(&p).into_iter().map(|n| n.trim_end_matches('*').to_owned()));
            if !p.is_truncated {
                break;
            }
            key = p.next_key_marker.map(|k| String::from_utf8(k).unwrap());
            ver = p.next_version_marker.map(|v| VersionRef::parse(&v).unwrap());
        }
        assert_eq!(seen, ["a@3", "a@2", "a@1", "b@5", "c@4", "c@1"]);
        // A key marker alone skips every version of that key.
        assert_eq!(names(&page(&mut model(&rows), &q(100, Some("a"), None)).unwrap()), ["b@5*", "c@4*", "c@1"]);
        // The null version as a marker.
        assert_eq!(
            names(&page(&mut model(&rows), &q(100, Some("a"), Some(VersionRef::Null))).unwrap()),
            ["b@5*", "c@4*", "c@1"]
        );
        assert!(page(&mut model(&rows), &q(1, None, Some(VersionRef::Null))).is_err());
        assert!(page(&mut model(&rows), &q(0, None, None)).unwrap().items.is_empty());
    }

    #[test]
    fn delimiters_roll_keys_up_once() {
        let rows = [("d/x", 2, false), ("d/x", 1, false), ("d/y", 3, false), ("e", 1, false)];
        let mut query = q(100, None, None);
        query.list.delimiter = Some(b"/".to_vec());
        assert_eq!(names(&page(&mut model(&rows), &query).unwrap()), ["d/", "e@1*"]);
        query.list.max_keys = 1;
        let p = page(&mut model(&rows), &query).unwrap();
        assert_eq!((names(&p), p.next_key_marker.clone()), (vec!["d/".to_owned()], Some(b"d/".to_vec())));
        query.key_marker = p.next_key_marker;
        assert_eq!(names(&page(&mut model(&rows), &query).unwrap()), ["e@1*"]);
    }
}
