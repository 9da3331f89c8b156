//! Access keys and per-bucket permissions (Garage's model).
//!
//! Besides the configured admin key (full access, never stored, never
//! deleted), a server holds any number of keys: an access key id
//! (`LS` + 24 hex digits), a 40-character secret and a name. A key may use a
//! bucket only through a grant of `read` (GET, HEAD, listings), `write`
//! (PUT, DELETE, multipart) or `owner` (delete the bucket, bucket
//! configuration). A key that creates a bucket owns it with read and write.
//!
//! Keys and grants are rows with a version; a newer row replaces an older
//! one and a deleted key or a revoked grant stays as a row (a tombstone), so
//! a replica that missed a delete cannot bring the key back. A single node
//! stores them in its metadata database; a cluster replicates them to every
//! node (see `cluster::keyring`). The [`Keyring`] trait is that store; the
//! operations on it ([`create_key`], [`delete_key`], [`change_grant`], ...)
//! are written once here for both.

use crate::error::{LightningError, Result};
use serde::{Deserialize, Serialize};

/// What a key may do on a bucket: a set of [`Perms::READ`], [`Perms::WRITE`]
/// and [`Perms::OWNER`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Perms(pub u8);

impl Perms {
    /// No permission.
    pub const NONE: Perms = Perms(0);
    /// GET, HEAD and listings.
    pub const READ: Perms = Perms(1);
    /// PUT, DELETE and multipart uploads.
    pub const WRITE: Perms = Perms(2);
    /// Delete the bucket and change its configuration.
    pub const OWNER: Perms = Perms(4);
    /// What a bucket's creator gets.
    pub const ALL: Perms = Perms(7);

    /// Whether every permission of `other` is in `self`.
    pub fn contains(self, other: Perms) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets.
    pub fn union(self, other: Perms) -> Perms {
        Perms(self.0 | other.0)
    }

    /// `self` without `other`.
    pub fn without(self, other: Perms) -> Perms {
        Perms(self.0 & !other.0)
    }

    /// No permission at all.
    pub fn is_empty(self) -> bool {
        self.0 & Perms::ALL.0 == 0
    }

    /// Parses `read,write,owner` (any subset, any order; `none` or empty is none).
    pub fn parse(text: &str) -> Result<Perms> {
        let mut p = Perms::NONE;
        for word in text.split(',').map(str::trim).filter(|w| !w.is_empty()) {
            p = p.union(match word {
                "read" => Perms::READ,
                "write" => Perms::WRITE,
                "owner" => Perms::OWNER,
                "none" => Perms::NONE,
                other => {
                    return Err(LightningError::InvalidArgument(format!(
                        "unknown permission {other:?} (read, write, owner)"
                    )));
                }
            });
        }
        Ok(p)
    }
}

impl std::fmt::Display for Perms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = [(Perms::READ, "read"), (Perms::WRITE, "write"), (Perms::OWNER, "owner")]
            .into_iter()
            .filter(|(p, _)| self.contains(*p))
            .map(|(_, n)| n)
            .collect();
        if names.is_empty() { f.write_str("none") } else { f.write_str(&names.join(",")) }
    }
}

/// A live key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyMeta {
    /// The operator's name for it.
    pub name: String,
    /// The secret requests are signed with.
    pub secret: String,
    /// Unix milliseconds of its creation.
    pub created_ms: i64,
}

/// A key's row: the key, or `None` once deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRow {
    /// Row version; the newer row wins.
    pub version: u64,
    /// The key, `None` for a deleted one.
    pub key: Option<KeyMeta>,
}

/// A (bucket, key) grant's row; no permission is a revoked grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantRow {
    /// Row version; the newer row wins.
    pub version: u64,
    /// What the key may do on the bucket.
    pub perms: Perms,
}

/// One row of the keyring, as stored and replicated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AuthRow {
    /// A key, by access key id.
    Key { id: String, row: KeyRow },
    /// A grant of bucket `bucket` to key `id`.
    Grant { bucket: String, id: String, row: GrantRow },
}

/// Whether a row at `new` replaces the row stored at `old` (ties keep the
/// stored one, so applying a row twice changes nothing).
pub fn newer(new: u64, old: Option<u64>) -> bool {
    old.is_none_or(|o| new > o)
}

impl AuthRow {
    fn id_and_version(&self) -> ((&str, &str), u64) {
        match self {
            AuthRow::Key { id, row } => (("", id.as_str()), row.version),
            AuthRow::Grant { bucket, id, row } => ((bucket.as_str(), id.as_str()), row.version),
        }
    }
}

/// The rows of `rows` that would replace a row of `here` (or are new):
/// what a merge would write.
pub fn newer_rows(rows: Vec<AuthRow>, here: &[AuthRow]) -> Vec<AuthRow> {
    let mut keys = std::collections::HashMap::new();
    let mut grants = std::collections::HashMap::new();
    for r in here {
        let (k, v) = r.id_and_version();
        match r {
            AuthRow::Key { .. } => keys.insert(k, v),
            AuthRow::Grant { .. } => grants.insert(k, v),
        };
    }
    rows.into_iter()
        .filter(|r| {
            let (k, v) = r.id_and_version();
            let old = match r {
                AuthRow::Key { .. } => keys.get(&k),
                AuthRow::Grant { .. } => grants.get(&k),
            };
            newer(v, old.copied())
        })
        .collect()
}

/// The store of keys and grants: a single node's metadata, or a cluster.
/// Reads are local; [`Keyring::apply`] writes rows where they must go (in a
/// cluster: every node, acknowledged by a majority).
#[async_trait::async_trait]
pub trait Keyring: Send + Sync + 'static {
    /// The live key `id`.
    fn key(&self, id: &str) -> Result<Option<KeyMeta>>;
    /// Every live key, by id.
    fn keys(&self) -> Result<Vec<(String, KeyMeta)>>;
    /// What key `id` may do on `bucket`.
    fn perms(&self, bucket: &str, id: &str) -> Result<Perms>;
    /// Every grant with some permission: (bucket, key id, permissions).
    fn grants(&self) -> Result<Vec<(String, String, Perms)>>;
    /// A fresh row version, above every version this store handed out.
    fn next_version(&self) -> u64;
    /// Whether `bucket` exists.
    async fn bucket_exists(&self, bucket: &str) -> Result<bool>;
    /// Stores `rows` (each only if newer than the row it replaces).
    async fn apply(&self, rows: Vec<AuthRow>) -> Result<()>;
}

pub(crate) fn random(buf: &mut [u8]) -> Result<()> {
    getrandom::fill(buf).map_err(|e| LightningError::Io(std::io::Error::other(format!("no random bytes: {e}"))))
}

fn now_ms() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The keyring key a request is signed with, if its permissions apply:
/// not on an anonymous server (everyone may do everything there), not for
/// the admin key.
pub fn restricted_key<'a>(cfg: &crate::config::Config, creds: Option<&'a s3s::auth::Credentials>) -> Option<&'a str> {
    let c = creds?;
    (!cfg.anonymous && cfg.access_key.as_deref() != Some(c.access_key.as_str())).then_some(c.access_key.as_str())
}

/// A new access key id: `LS` and 24 hex digits (96 random bits).
pub fn new_key_id() -> Result<String> {
    let mut b = [0u8; 12];
    random(&mut b)?;
    Ok(format!("LS{}", hex::encode_upper(b)))
}

/// A new secret: 40 characters from 240 random bits (URL-safe base64).
pub fn new_secret() -> Result<String> {
    use base64::Engine as _;
    let mut b = [0u8; 30];
    random(&mut b)?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b))
}

/// Checks a key name: 1 to 64 characters of letters, digits, `-`, `_`, `.`,
/// not starting like an access key id (so `--key` can take either).
pub fn check_name(name: &str) -> Result<()> {
    let ok_chars = name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if name.is_empty() || name.len() > 64 || !ok_chars {
        return Err(LightningError::InvalidArgument(format!(
            "key name {name:?} must be 1 to 64 letters, digits, '-', '_' or '.'"
        )));
    }
    if looks_like_id(name) {
        return Err(LightningError::InvalidArgument(format!("key name {name:?} looks like an access key id")));
    }
    Ok(())
}

fn looks_like_id(s: &str) -> bool {
    s.len() == 26 && s.starts_with("LS") && s[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// A new key named `name` (names are unique among live keys); returns its id
/// and the key with its secret.
pub async fn create_key(kr: &dyn Keyring, name: &str) -> Result<(String, KeyMeta)> {
    check_name(name)?;
    if kr.keys()?.iter().any(|(_, k)| k.name == name) {
        return Err(LightningError::InvalidArgument(format!("a key named {name:?} exists already")));
    }
    let id = new_key_id()?;
    let key = KeyMeta { name: name.to_owned(), secret: new_secret()?, created_ms: now_ms() };
    let row = KeyRow { version: kr.next_version(), key: Some(key.clone()) };
    kr.apply(vec![AuthRow::Key { id: id.clone(), row }]).await?;
    Ok((id, key))
}

/// The id of the live key `id_or_name` names.
pub fn resolve(kr: &dyn Keyring, id_or_name: &str) -> Result<String> {
    if kr.key(id_or_name)?.is_some() {
        return Ok(id_or_name.to_owned());
    }
    let found: Vec<String> = kr.keys()?.into_iter().filter(|(_, k)| k.name == id_or_name).map(|(id, _)| id).collect();
    match found.as_slice() {
        [id] => Ok(id.clone()),
        [] => Err(LightningError::InvalidArgument(format!("no key has the id or name {id_or_name:?}"))),
        _ => Err(LightningError::InvalidArgument(format!(
            "{} keys are named {id_or_name:?}; name one by its id",
            found.len()
        ))),
    }
}

/// Deletes a key and revokes its grants; returns its id.
pub async fn delete_key(kr: &dyn Keyring, id_or_name: &str) -> Result<String> {
    let id = resolve(kr, id_or_name)?;
    let version = kr.next_version();
    let mut rows = vec![AuthRow::Key { id: id.clone(), row: KeyRow { version, key: None } }];
    rows.extend(revocations(kr, version, |_, k| k == id)?);
    kr.apply(rows).await?;
    Ok(id)
}

fn revocations(kr: &dyn Keyring, version: u64, pick: impl Fn(&str, &str) -> bool) -> Result<Vec<AuthRow>> {
    Ok(kr
        .grants()?
        .into_iter()
        .filter(|(b, k, _)| pick(b, k))
        .map(|(bucket, id, _)| AuthRow::Grant { bucket, id, row: GrantRow { version, perms: Perms::NONE } })
        .collect())
}

/// Adds `allow` to and then removes `deny` from what a key may do on an
/// existing bucket; returns the key's id and its permissions afterwards.
pub async fn change_grant(
    kr: &dyn Keyring,
    bucket: &str,
    id_or_name: &str,
    allow: Perms,
    deny: Perms,
) -> Result<(String, Perms)> {
    let id = resolve(kr, id_or_name)?;
    if !kr.bucket_exists(bucket).await? {
        return Err(LightningError::NoSuchBucket(bucket.to_owned()));
    }
    let perms = kr.perms(bucket, &id)?.union(allow).without(deny);
    let row = GrantRow { version: kr.next_version(), perms };
    kr.apply(vec![AuthRow::Grant { bucket: bucket.to_owned(), id: id.clone(), row }]).await?;
    Ok((id, perms))
}

/// Makes key `id` the owner of the bucket it just created.
pub async fn grant_creator(kr: &dyn Keyring, bucket: &str, id: &str) -> Result<()> {
    let row = GrantRow { version: kr.next_version(), perms: Perms::ALL };
    kr.apply(vec![AuthRow::Grant { bucket: bucket.to_owned(), id: id.to_owned(), row }]).await
}

/// Revokes every grant on a deleted bucket (a bucket created later under
/// the same name starts with none).
pub async fn forget_bucket(kr: &dyn Keyring, bucket: &str) -> Result<()> {
    let rows = revocations(kr, kr.next_version(), |b, _| b == bucket)?;
    if rows.is_empty() { Ok(()) } else { kr.apply(rows).await }
}

/// What an S3 operation needs, decided from its name alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Any valid key (ListBuckets: the answer is filtered; CreateBucket: the
    /// creator becomes the owner).
    AnyKey,
    /// These permissions on the request's bucket.
    Bucket(Perms),
    /// `write` on the request's bucket and `read` on the copy source's.
    Copy,
    /// Only the admin key (operations on no bucket that we do not know).
    Admin,
}

/// The permission S3 operation `op` (s3s's name) needs. Operations this
/// server does not implement need `owner`, so a key without it is denied
/// before it learns what is not implemented.
pub fn need(op: &str) -> Need {
    match op {
        "ListBuckets" | "CreateBucket" => Need::AnyKey,
        "HeadBucket"
        | "GetBucketLocation"
        | "GetObject"
        | "HeadObject"
        | "ListObjects"
        | "ListObjectsV2"
        | "ListObjectVersions"
        | "ListParts"
        | "ListMultipartUploads" => Need::Bucket(Perms::READ),
        "PutObject"
        | "DeleteObject"
        | "DeleteObjects"
        | "CreateMultipartUpload"
        | "UploadPart"
        | "CompleteMultipartUpload"
        | "AbortMultipartUpload" => Need::Bucket(Perms::WRITE),
        "CopyObject" | "UploadPartCopy" => Need::Copy,
        _ => Need::Bucket(Perms::OWNER),
    }
}

/// The bucket of an `x-amz-copy-source` header (`[/]bucket/key[?versionId=..]`,
/// percent-encoded).
pub fn copy_source_bucket(header: &str) -> Option<&str> {
    let s = header.strip_prefix('/').unwrap_or(header);
    s.split_once('/').map(|(b, _)| b).filter(|b| !b.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn permissions_parse_and_print_as_words() {
        assert_eq!(Perms::parse("read").expect("read"), Perms::READ);
        assert_eq!(Perms::parse("owner, read,write").expect("all"), Perms::ALL);
        assert_eq!(Perms::parse("").expect("empty"), Perms::NONE);
        assert!(Perms::parse("admin").is_err());
        assert_eq!(Perms::ALL.to_string(), "read,write,owner");
        assert_eq!(Perms::NONE.to_string(), "none");
        assert_eq!(Perms::ALL.without(Perms::WRITE), Perms(5));
        assert!(Perms::ALL.contains(Perms::READ.union(Perms::OWNER)));
        assert!(!Perms::READ.contains(Perms::WRITE));
    }

    #[test]
    fn operations_need_what_the_docs_say() {
        assert_eq!(need("GetObject"), Need::Bucket(Perms::READ));
        assert_eq!(need("ListObjectsV2"), Need::Bucket(Perms::READ));
        assert_eq!(need("PutObject"), Need::Bucket(Perms::WRITE));
        assert_eq!(need("CompleteMultipartUpload"), Need::Bucket(Perms::WRITE));
        assert_eq!(need("DeleteBucket"), Need::Bucket(Perms::OWNER));
        assert_eq!(need("PutBucketPolicy"), Need::Bucket(Perms::OWNER));
        // Lifecycle configuration is the owner's (it deletes objects).
        for op in ["PutBucketLifecycleConfiguration", "GetBucketLifecycleConfiguration", "DeleteBucketLifecycle"] {
            assert_eq!(need(op), Need::Bucket(Perms::OWNER), "{op}");
        }
        assert_eq!(need("UploadPartCopy"), Need::Copy);
        assert_eq!(need("ListBuckets"), Need::AnyKey);
    }

    #[test]
    fn copy_sources_name_their_bucket() {
        assert_eq!(copy_source_bucket("/src/a/b.txt"), Some("src"));
        assert_eq!(copy_source_bucket("src/k?versionId=1"), Some("src"));
        assert_eq!(copy_source_bucket("nokey"), None);
        assert_eq!(copy_source_bucket("//k"), None);
    }

    #[test]
    fn new_keys_are_random_and_well_formed() {
        let (a, b) = (new_key_id().expect("id"), new_key_id().expect("id"));
        assert_ne!(a, b);
        assert!(looks_like_id(&a), "{a}");
        let s = new_secret().expect("secret");
        assert_eq!(s.len(), 40);
        assert_ne!(s, new_secret().expect("secret"));
        assert!(check_name("backup-job_1.x").is_ok());
        assert!(check_name("").is_err() && check_name("a b").is_err() && check_name(&a).is_err());
    }

    /// What a merge of the whole keyring (anti-entropy) would write: only
    /// the rows newer than those held, or new; a key and a grant never
    /// stand for each other.
    #[test]
    fn only_newer_or_new_rows_are_merged() {
        let key = |id: &str, version| AuthRow::Key { id: id.into(), row: KeyRow { version, key: None } };
        let grant = |id: &str, version| AuthRow::Grant {
            bucket: "b".into(),
            id: id.into(),
            row: GrantRow { version, perms: Perms::READ },
        };
        let here = vec![key("a", 5), grant("a", 5)];
        let rows = vec![key("a", 5), key("a", 4), key("a", 6), key("c", 1), grant("a", 5), grant("c", 2)];
        let got = newer_rows(rows, &here);
        assert_eq!(got, vec![key("a", 6), key("c", 1), grant("c", 2)]);
        assert!(newer_rows(here.clone(), &here).is_empty(), "a keyring in sync writes nothing");
    }

    proptest! {
        #[test]
        fn a_row_replaces_only_an_older_one(new in 0u64..10, old in proptest::option::of(0u64..10)) {
            prop_assert_eq!(newer(new, old), old.is_none_or(|o| new > o));
            prop_assert!(!newer(new, Some(new)), "applying a row twice changes nothing");
        }
    }
}
