//! Listing semantics: prefix, delimiter, markers, max-keys, continuation tokens.
//!
//! Pure logic over a [`Cursor`], an ordered key source that can seek. The
//! metadata layer implements the cursor over a redb range, so a listing page
//! touches only the keys it returns plus one seek per common prefix: a bucket
//! is never loaded whole. Property tests hold [`list`] to a model built from
//! a `BTreeMap` the naive way.

use crate::error::{LightningError, Result};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// What [`Cursor::next`] yields: a key and its value, or the end.
pub type Item<V, E> = Result<Option<(Vec<u8>, V)>, E>;

/// An ordered source of `(key, value)` pairs, keys compared as bytes.
pub trait Cursor {
    /// What is stored under each key.
    type Value;
    /// The source's error.
    type Error;
    /// Positions the cursor so that `next` yields keys `>= from`, in order.
    fn seek(&mut self, from: &[u8]) -> Result<(), Self::Error>;
    /// The next pair, or `None` at the end.
    fn next(&mut self) -> Item<Self::Value, Self::Error>;
}

/// One listing request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    /// Only keys starting with this.
    pub prefix: Vec<u8>,
    /// Roll keys up to the first occurrence of this after the prefix.
    pub delimiter: Option<Vec<u8>>,
    /// Only entries (keys or common prefixes) strictly greater than this.
    pub start_after: Option<Vec<u8>>,
    /// At most this many entries (keys plus common prefixes).
    pub max_keys: usize,
}

/// One entry of a page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry<V> {
    /// A key and its value.
    Object(Vec<u8>, V),
    /// A common prefix (ends with the delimiter).
    Prefix(Vec<u8>),
}

impl<V> Entry<V> {
    /// The key or prefix.
    pub fn name(&self) -> &[u8] {
        match self {
            Entry::Object(k, _) | Entry::Prefix(k) => k,
        }
    }
}

/// One page of results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage<V> {
    /// Keys and common prefixes, in order.
    pub entries: Vec<Entry<V>>,
    /// Whether more entries follow.
    pub is_truncated: bool,
    /// Where the next page starts (`start_after` for it), when truncated.
    pub next_marker: Option<Vec<u8>>,
}

/// The smallest byte string greater than every string that starts with `p`,
/// or `None` when there is none.
pub fn prefix_successor(p: &[u8]) -> Option<Vec<u8>> {
    let mut s = p.to_vec();
    while let Some(last) = s.pop() {
        if last < 0xff {
            s.push(last + 1);
            return Some(s);
        }
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || needle.len() > hay.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The common prefix `key` rolls up to under `q`, if any.
pub fn common_prefix<'k>(q: &ListQuery, key: &'k [u8]) -> Option<&'k [u8]> {
    let d = q.delimiter.as_deref().filter(|d| !d.is_empty())?;
    let rest = key.get(q.prefix.len()..)?;
    find(rest, d).map(|pos| &key[..q.prefix.len() + pos + d.len()])
}

/// Produces one page for `q` from `cur`.
pub fn list<C: Cursor>(cur: &mut C, q: &ListQuery) -> Result<ListPage<C::Value>, C::Error> {
    if q.max_keys == 0 {
        // S3 answers max-keys=0 with an empty page that is not truncated.
        return Ok(ListPage { entries: Vec::new(), is_truncated: false, next_marker: None });
    }
    let marker = q.start_after.as_deref();
    match marker {
        Some(m) if m > q.prefix.as_slice() => cur.seek(m)?,
        _ => cur.seek(&q.prefix)?,
    }
    let mut entries = Vec::new();
    let mut is_truncated = false;
    while let Some((key, value)) = cur.next()? {
        if !key.starts_with(&q.prefix) {
            break;
        }
        if marker.is_some_and(|m| key.as_slice() <= m) {
            continue;
        }
        if let Some(cp) = common_prefix(q, &key) {
            let cp = cp.to_vec();
            let seen = marker.is_some_and(|m| cp.as_slice() <= m);
            if !seen {
                if entries.len() >= q.max_keys {
                    is_truncated = true;
                    break;
                }
                entries.push(Entry::Prefix(cp.clone()));
            }
            match prefix_successor(&cp) {
                Some(next) => cur.seek(&next)?,
                None => break,
            }
            continue;
        }
        if entries.len() >= q.max_keys {
            is_truncated = true;
            break;
        }
        entries.push(Entry::Object(key, value));
    }
    let next_marker = if is_truncated { entries.last().map(|e| e.name().to_vec()) } else { None };
    Ok(ListPage { entries, is_truncated, next_marker })
}

/// Encodes a resume position as an opaque continuation token.
pub fn encode_token(marker: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(marker)
}

/// Decodes a continuation token from a client.
pub fn decode_token(token: &str) -> Result<Vec<u8>> {
    URL_SAFE_NO_PAD
        .decode(token)
        .map_err(|_| LightningError::InvalidArgument("the continuation token is not valid".into()))
}

/// Percent-encodes a key for `encoding-type=url` responses (everything but
/// unreserved characters and `/`).
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A [`Cursor`] over a sorted in-memory map (the model, and handy in tests).
#[derive(Debug)]
pub struct MapCursor<'a, V> {
    map: &'a std::collections::BTreeMap<Vec<u8>, V>,
    range: Option<std::collections::btree_map::Range<'a, Vec<u8>, V>>,
}

impl<'a, V> MapCursor<'a, V> {
    /// A cursor over `map`.
    pub fn new(map: &'a std::collections::BTreeMap<Vec<u8>, V>) -> Self {
        MapCursor { map, range: None }
    }
}

impl<V: Clone> Cursor for MapCursor<'_, V> {
    type Value = V;
    type Error = std::convert::Infallible;
    fn seek(&mut self, from: &[u8]) -> Result<(), Self::Error> {
        self.range = Some(self.map.range(from.to_vec()..));
        Ok(())
    }
    fn next(&mut self) -> Item<V, Self::Error> {
        Ok(self.range.as_mut().and_then(|r| r.next()).map(|(k, v)| (k.clone(), v.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn run(map: &BTreeMap<Vec<u8>, u32>, q: &ListQuery) -> ListPage<u32> {
        match list(&mut MapCursor::new(map), q) {
            Ok(p) => p,
            Err(e) => match e {},
        }
    }

    /// The obvious, whole-bucket definition of a listing.
    fn model(map: &BTreeMap<Vec<u8>, u32>, q: &ListQuery) -> (Vec<Vec<u8>>, bool) {
        let items: BTreeSet<Vec<u8>> = map
            .keys()
            .filter(|k| k.starts_with(&q.prefix))
            .map(|k| common_prefix(q, k).unwrap_or(k).to_vec())
            .filter(|item| q.start_after.as_ref().is_none_or(|m| item > m))
            .collect();
        let truncated = q.max_keys > 0 && items.len() > q.max_keys;
        (items.into_iter().take(q.max_keys).collect(), truncated)
    }

    fn names(p: &ListPage<u32>) -> Vec<Vec<u8>> {
        p.entries.iter().map(|e| e.name().to_vec()).collect()
    }

    fn keys_from(list: &[&str]) -> BTreeMap<Vec<u8>, u32> {
        list.iter().enumerate().map(|(i, k)| (k.as_bytes().to_vec(), i as u32)).collect()
    }

    #[test]
    fn delimiters_roll_keys_up_into_common_prefixes() {
        let map = keys_from(&["a/1", "a/2", "b", "c/x/y", "c/z"]);
        let q = ListQuery { delimiter: Some(b"/".to_vec()), max_keys: 1000, ..Default::default() };
        let p = run(&map, &q);
        assert_eq!(names(&p), vec![b"a/".to_vec(), b"b".to_vec(), b"c/".to_vec()]);
        assert!(!p.is_truncated);
    }

    #[test]
    fn paging_by_next_marker_never_repeats_a_common_prefix() {
        let map = keys_from(&["a/1", "a/2", "a/3", "b/1", "c"]);
        let mut q = ListQuery { delimiter: Some(b"/".to_vec()), max_keys: 1, ..Default::default() };
        let mut all = Vec::new();
        loop {
            let p = run(&map, &q);
            all.extend(names(&p));
            if !p.is_truncated {
                break;
            }
            q.start_after = p.next_marker;
        }
        assert_eq!(all, vec![b"a/".to_vec(), b"b/".to_vec(), b"c".to_vec()]);
    }

    #[test]
    fn prefix_successor_skips_every_extension() {
        assert_eq!(prefix_successor(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_successor(&[b'a', 0xff]), Some(b"b".to_vec()));
        assert_eq!(prefix_successor(&[0xff, 0xff]), None);
    }

    #[test]
    fn url_encoding_keeps_slashes_and_escapes_the_rest() {
        assert_eq!(url_encode("a b/ü+"), "a%20b/%C3%BC%2B");
    }

    #[test]
    fn bad_continuation_tokens_are_invalid_arguments() {
        assert!(decode_token("!!!").is_err());
        assert_eq!(decode_token(&encode_token(b"k/\x00")).ok(), Some(b"k/\x00".to_vec()));
    }

    fn arb_key() -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(prop_oneof![Just(b'a'), Just(b'b'), Just(b'/'), Just(b'-'), Just(0xffu8)], 0..6)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn one_page_matches_the_btreemap_model(
            keys in proptest::collection::btree_set(arb_key(), 0..30),
            prefix in arb_key(),
            delimiter in proptest::option::of(prop_oneof![Just(b"/".to_vec()), Just(b"-".to_vec()), Just(b"a/".to_vec())]),
            start_after in proptest::option::of(arb_key()),
            max_keys in 0usize..8,
        ) {
            let map: BTreeMap<Vec<u8>, u32> = keys.into_iter().enumerate().map(|(i, k)| (k, i as u32)).collect();
            let q = ListQuery { prefix: prefix[..prefix.len().min(2)].to_vec(), delimiter, start_after, max_keys };
            let page = run(&map, &q);
            let (want, truncated) = model(&map, &q);
            prop_assert_eq!(names(&page), want);
            prop_assert_eq!(page.is_truncated, truncated);
            for e in &page.entries {
                if let Entry::Object(k, v) = e {
                    prop_assert_eq!(map.get(k), Some(v));
                }
            }
        }

        #[test]
        fn following_markers_visits_every_entry_exactly_once(
            keys in proptest::collection::btree_set(arb_key(), 0..30),
            delimiter in proptest::option::of(Just(b"/".to_vec())),
            max_keys in 1usize..5,
        ) {
            let map: BTreeMap<Vec<u8>, u32> = keys.into_iter().enumerate().map(|(i, k)| (k, i as u32)).collect();
            let mut q = ListQuery { prefix: Vec::new(), delimiter, start_after: None, max_keys };
            let mut all = Vec::new();
            for _ in 0..100 {
                let p = run(&map, &q);
                all.extend(names(&p));
                if !p.is_truncated { break; }
                q.start_after = p.next_marker.clone();
            }
            let (want, _) = model(&map, &ListQuery { max_keys: usize::MAX, start_after: None, ..q });
            prop_assert_eq!(all, want);
        }
    }
}
