//! SSE-C: server-side encryption with a key the client sends on every request.
//!
//! The object is stored encrypted with AES-256 in CTR mode under the
//! customer's key and a random 128-bit IV kept with the object; the key itself
//! is never stored, only its MD5 (which S3 also keeps, to tell a wrong key
//! from the right one). CTR keeps ranged reads cheap: the keystream at any
//! offset is computed directly, so a range GET decrypts only what it returns.
//!
//! A multipart object is one CTR stream per part: every UploadPart (and
//! UploadPartCopy) draws a fresh random IV for the bytes it stores, kept in
//! the part row, and the completed object lists its parts' IVs in order.
//! A part's offset in the object is unknown until completion, and the same
//! part number may be uploaded again with other bytes, so nothing derived
//! from the upload or the part number would do: only a fresh IV per stored
//! part keeps every keystream block used once under a key. Two random
//! 128-bit IVs overlap only if they fall within one part's block count
//! (at most 2^29 blocks for a 5 GiB part) of each other: about 2^-98 per pair.
//!
//! As in S3: the three `x-amz-server-side-encryption-customer-*` headers come
//! together, the algorithm is `AES256`, the key is 32 bytes and its MD5 must
//! match (else 400 InvalidArgument); a GET/HEAD of an SSE-C object without
//! the key is 400 InvalidRequest, with another key 403 AccessDenied. A part
//! of an SSE-C upload answers the same way against the upload's key.

use crate::checksum::{BodyHasher, Checksum, ChecksumAlgo};
use crate::error::{LightningError, Result};
use crate::meta::types::ObjectMeta;
pub use crate::meta::types::SseC;
use aws_lc_rs::cipher::{AES_256, EncryptingKey, EncryptionContext, UnboundCipherKey};
use aws_lc_rs::iv::FixedLength;
use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use md5::Digest as _;
use std::sync::{Arc, Mutex};

/// The only SSE-C algorithm S3 has.
pub const ALGORITHM: &str = "AES256";

/// The key MD5 of an SSE-C object as the response headers carry it (base64).
pub fn key_md5_base64(s: &SseC) -> String {
    key_md5_base64_of(&s.key_md5)
}

/// A key MD5 as the response headers carry it (base64).
pub fn key_md5_base64_of(md5: &[u8; 16]) -> String {
    base64::engine::general_purpose::STANDARD.encode(md5)
}

/// A customer key given with a request, its MD5 checked.
#[derive(Clone)]
pub struct CustomerKey {
    key: [u8; 32],
    md5: [u8; 16],
}

impl std::fmt::Debug for CustomerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomerKey").finish_non_exhaustive()
    }
}

fn invalid(msg: &str) -> LightningError {
    LightningError::InvalidArgument(msg.to_owned())
}

impl CustomerKey {
    /// The key of the SSE-C headers (algorithm, base64 key, base64 key MD5),
    /// `None` when none is given.
    pub fn from_headers(algorithm: Option<&str>, key: Option<&str>, key_md5: Option<&str>) -> Result<Option<Self>> {
        let (algorithm, key, key_md5) = match (algorithm, key, key_md5) {
            (None, None, None) => return Ok(None),
            (Some(a), Some(k), Some(m)) => (a, k, m),
            (None, ..) => {
                return Err(invalid(
                    "Requests specifying Server Side Encryption with Customer provided keys must provide a valid encryption algorithm.",
                ));
            }
            (_, None, _) => {
                return Err(invalid(
                    "Requests specifying Server Side Encryption with Customer provided keys must provide an appropriate secret key.",
                ));
            }
            (_, _, None) => {
                return Err(invalid(
                    "Requests specifying Server Side Encryption with Customer provided keys must provide the client calculated MD5 of the secret key.",
                ));
            }
        };
        if algorithm != ALGORITHM {
            return Err(invalid("The encryption algorithm specified is not valid (only AES256 is)."));
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let key: [u8; 32] =
            b64.decode(key).ok().and_then(|k| k.try_into().ok()).ok_or_else(|| {
                invalid("The secret key was invalid for the specified algorithm (it must be 32 bytes).")
            })?;
        let md5: [u8; 16] = md5::Md5::digest(key).into();
        if b64.decode(key_md5).ok().as_deref() != Some(md5.as_slice()) {
            return Err(invalid("The calculated MD5 hash of the key did not match the hash that was provided."));
        }
        Ok(Some(CustomerKey { key, md5 }))
    }

    /// The MD5 of the key.
    pub fn md5(&self) -> [u8; 16] {
        self.md5
    }

    /// Seals a new object or part: a fresh random IV, one CTR stream.
    pub fn seal(&self) -> Result<(SseC, Cipher)> {
        let mut iv = [0u8; 16];
        aws_lc_rs::rand::fill(&mut iv).map_err(|_| LightningError::Io(std::io::Error::other("no random IV")))?;
        let sse = SseC { key_md5: self.md5, iv, part_ivs: Vec::new() };
        let cipher = Cipher::new(self, &sse, &[])?;
        Ok((sse, cipher))
    }
}

/// The key of an UploadPart / UploadPartCopy / CompleteMultipartUpload of an
/// upload created with `upload_md5` (or without SSE-C): the key created with
/// it, refused as [`open`] refuses a GET's.
pub fn for_upload(upload_md5: Option<[u8; 16]>, given: Option<CustomerKey>) -> Result<Option<CustomerKey>> {
    match (upload_md5, given) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(LightningError::InvalidRequest(
            "The encryption parameters are not applicable to this upload (it was not created with SSE-C).".into(),
        )),
        (Some(_), None) => Err(LightningError::InvalidRequest(
            "The upload was created with Server Side Encryption with a customer key: every part must provide the same key.".into(),
        )),
        (Some(m), Some(k)) if !same_md5(&m, &k.md5) => Err(LightningError::AccessDenied(
            "The SSE-C key given is not the key the upload was created with.".into(),
        )),
        (Some(_), Some(k)) => Ok(Some(k)),
    }
}

/// Whether a request's key MD5 is the stored one, compared in constant
/// time (the stored MD5 is not the key, but it need not leak either).
fn same_md5(stored: &[u8; 16], given: &[u8; 16]) -> bool {
    aws_lc_rs::constant_time::verify_slices_are_equal(stored, given).is_ok()
}

/// Whether a reply about `meta` may carry its plaintext checksum: always
/// for a plain object, for an SSE-C one only to a request that gave its key
/// (a checksum of the plaintext lets whoever holds it test guesses).
pub fn may_show_checksum(meta: &ObjectMeta, given: Option<&CustomerKey>) -> bool {
    match (&meta.sse_c, given) {
        (None, _) => true,
        (Some(s), Some(k)) => same_md5(&s.key_md5, &k.md5),
        (Some(_), None) => false,
    }
}

/// The encryption of a multipart object assembled from parts of an upload
/// with key `key_md5`, each with the IV it was stored with (in order).
pub fn assembled(key_md5: [u8; 16], part_ivs: &[Option<[u8; 16]>]) -> Result<SseC> {
    let ivs: Option<Vec<[u8; 16]>> = part_ivs.iter().copied().collect();
    let ivs = ivs
        .filter(|v| !v.is_empty())
        .ok_or_else(|| LightningError::Db("a part of an SSE-C upload has no IV".into()))?;
    Ok(SseC { key_md5, iv: ivs[0], part_ivs: ivs })
}

/// Opens an object for a GET/HEAD (or a copy source): the key must come
/// with an SSE-C object and be its key; a key for a plain object is refused
/// as S3 refuses it. Returns the cipher for an SSE-C object.
pub fn open(meta: &ObjectMeta, given: Option<&CustomerKey>) -> Result<Option<Cipher>> {
    match (meta.sse_c.as_ref(), given) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(LightningError::InvalidRequest(
            "The encryption parameters are not applicable to this object (it is not SSE-C encrypted).".into(),
        )),
        (Some(_), None) => Err(LightningError::InvalidRequest(
            "The object was stored using a form of Server Side Encryption. The correct parameters must be provided to retrieve the object.".into(),
        )),
        (Some(s), Some(k)) if !same_md5(&s.key_md5, &k.md5) => Err(LightningError::AccessDenied(
            "The SSE-C key given is not the key the object was stored with.".into(),
        )),
        (Some(s), Some(k)) => Cipher::new(k, s, &meta.parts).map(Some),
    }
}

/// AES-256-CTR under one key, applied at any byte offset of an object made
/// of one stream (one IV) or of one stream per part (an IV each).
#[derive(Clone)]
pub struct Cipher {
    key: Arc<EncryptingKey>,
    /// (first byte, IV) of each stream, by first byte.
    streams: Arc<[(u64, u128)]>,
}

impl Cipher {
    /// The cipher of `s` for an object of parts of sizes `parts` (empty for
    /// a single PUT): one stream per part when `s` has the part IVs.
    fn new(k: &CustomerKey, s: &SseC, parts: &[u64]) -> Result<Self> {
        let key = UnboundCipherKey::new(&AES_256, &k.key)
            .and_then(EncryptingKey::ctr)
            .map_err(|_| LightningError::Io(std::io::Error::other("AES-256 key setup failed")))?;
        let streams: Vec<(u64, u128)> = if s.part_ivs.is_empty() {
            vec![(0, u128::from_be_bytes(s.iv))]
        } else {
            if s.part_ivs.len() != parts.len() {
                return Err(LightningError::Db(format!(
                    "an SSE-C object of {} parts has {} part IVs",
                    parts.len(),
                    s.part_ivs.len()
                )));
            }
            let mut at = 0u64;
            parts
                .iter()
                .zip(&s.part_ivs)
                .map(|(size, iv)| {
                    let start = at;
                    at = at.saturating_add(*size);
                    (start, u128::from_be_bytes(*iv))
                })
                .collect()
        };
        Ok(Cipher { key: Arc::new(key), streams: streams.into() })
    }

    /// Encrypts (or decrypts: CTR is its own inverse) `data`, which sits at
    /// byte `offset` of the object.
    pub fn apply(&self, offset: u64, data: &mut [u8]) -> Result<()> {
        let mut at = offset;
        let mut rest = data;
        while !rest.is_empty() {
            // The last stream starting at or before `at` (an empty part's
            // stream shares its start with the next and is skipped).
            let i = self.streams.partition_point(|(start, _)| *start <= at).saturating_sub(1);
            let (start, iv) = self
                .streams
                .get(i)
                .copied()
                .ok_or_else(|| LightningError::Db("an SSE-C object without a CTR stream".into()))?;
            let end = self.streams.get(i + 1).map_or(u64::MAX, |(s, _)| *s);
            let n = usize::try_from(end - at).map_or(rest.len(), |room| room.min(rest.len()));
            let (now, later) = rest.split_at_mut(n);
            self.apply_stream(iv, at - start, now)?;
            at += n as u64;
            rest = later;
        }
        Ok(())
    }

    /// CTR from initial counter `iv`, over `data` at byte `offset` of that stream.
    fn apply_stream(&self, iv: u128, offset: u64, data: &mut [u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let counter = iv.wrapping_add(u128::from(offset / 16));
        let skip = usize::try_from(offset % 16).unwrap_or(0);
        let ctx = |c: u128| EncryptionContext::Iv128(FixedLength::from(c.to_be_bytes()));
        let fail = |_| LightningError::Io(std::io::Error::other("AES-CTR failed"));
        if skip == 0 {
            self.key.less_safe_encrypt(data, ctx(counter)).map_err(fail)?;
            return Ok(());
        }
        // A start inside a 16-byte block: run the keystream from the block's
        // start over a padded copy of its first bytes.
        let head = (16 - skip).min(data.len());
        let mut block = [0u8; 16];
        block[skip..skip + head].copy_from_slice(&data[..head]);
        self.key.less_safe_encrypt(&mut block, ctx(counter)).map_err(fail)?;
        data[..head].copy_from_slice(&block[skip..skip + head]);
        if data.len() > head {
            self.key.less_safe_encrypt(&mut data[head..], ctx(counter.wrapping_add(1))).map_err(fail)?;
        }
        Ok(())
    }

    /// Applies the cipher to a stream of chunks that starts at byte `offset`.
    pub fn stream<S, E>(self, offset: u64, body: S) -> impl Stream<Item = std::result::Result<Bytes, E>> + Send
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: From<LightningError>,
    {
        let mut at = offset;
        body.map(move |chunk| {
            let chunk = chunk?;
            let mut buf = chunk.to_vec();
            self.apply(at, &mut buf)?;
            at += buf.len() as u64;
            Ok(Bytes::from(buf))
        })
    }
}

/// MD5 and checksum of a body's plaintext, taken while it is encrypted on its
/// way in (the store hashes what it stores: the ciphertext).
#[derive(Clone)]
pub struct PlainDigest(Arc<Mutex<Option<BodyHasher>>>);

impl PlainDigest {
    /// The MD5 and `algo` checksum of the plaintext, once the body is consumed.
    pub fn finish(&self) -> Result<([u8; 16], Option<Checksum>)> {
        let h = self.0.lock().ok().and_then(|mut h| h.take());
        h.map(BodyHasher::finalize).ok_or_else(|| LightningError::Db("plaintext hasher lost".into()))
    }
}

/// Encrypts an incoming body, hashing its plaintext on the way.
pub fn seal_body<S, E>(
    cipher: Cipher,
    algo: Option<ChecksumAlgo>,
    body: S,
) -> (impl Stream<Item = std::result::Result<Bytes, String>> + Send, PlainDigest)
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send,
    E: std::fmt::Display,
{
    let digest = PlainDigest(Arc::new(Mutex::new(Some(BodyHasher::new(algo)))));
    let d = digest.clone();
    let plain = body.map(move |chunk| {
        let chunk = chunk.map_err(|e| e.to_string())?;
        if let Ok(mut h) = d.0.lock()
            && let Some(h) = h.as_mut()
        {
            h.update(&chunk);
        }
        Ok::<_, String>(chunk)
    });
    let sealed = cipher.stream(0, plain.map(|r| r.map_err(StringErr))).map(|r| r.map_err(|StringErr(s)| s));
    (sealed, digest)
}

/// An incoming S3 body (or none), encrypted, with its plaintext hashed.
pub fn seal_blob(
    cipher: Cipher,
    algo: Option<ChecksumAlgo>,
    body: Option<s3s::dto::StreamingBlob>,
) -> (BoxStream<'static, std::result::Result<Bytes, String>>, PlainDigest) {
    let (sealed, digest) = match body {
        Some(b) => {
            let (s, d) = seal_body(cipher, algo, b);
            (s.boxed(), d)
        }
        None => {
            let (s, d) = seal_body(cipher, algo, futures::stream::empty::<std::result::Result<Bytes, String>>());
            (s.boxed(), d)
        }
    };
    (sealed, digest)
}

/// An object's body as read from the store, decrypted when it is SSE-C.
pub fn decrypting(
    cipher: Option<Cipher>,
    offset: u64,
    body: BoxStream<'static, Result<Bytes>>,
) -> BoxStream<'static, Result<Bytes>> {
    match cipher {
        Some(c) => c.stream(offset, body).boxed(),
        None => body,
    }
}

/// A copy's body: the source decrypted (when `source` is its cipher), then
/// encrypted for the destination (when `dest` is), both from byte 0.
pub fn recrypting(
    source: Option<Cipher>,
    offset: u64,
    dest: Option<Cipher>,
    body: BoxStream<'static, Result<Bytes>>,
) -> BoxStream<'static, Result<Bytes>> {
    let plain = decrypting(source, offset, body);
    match dest {
        Some(c) => c.stream(0, plain).boxed(),
        None => plain,
    }
}

/// Inputs that carry the SSE-C headers.
pub trait WithCustomerKey {
    /// The customer key of the request's SSE-C headers, if it gives one.
    fn customer_key(&self) -> Result<Option<CustomerKey>>;
}

macro_rules! with_customer_key {
    ($($t:ty),*) => {$(
        impl WithCustomerKey for $t {
            fn customer_key(&self) -> Result<Option<CustomerKey>> {
                CustomerKey::from_headers(
                    self.sse_customer_algorithm.as_deref(),
                    self.sse_customer_key.as_deref(),
                    self.sse_customer_key_md5.as_deref(),
                )
            }
        }
    )*};
}

with_customer_key!(
    s3s::dto::PutObjectInput,
    s3s::dto::GetObjectInput,
    s3s::dto::HeadObjectInput,
    s3s::dto::CopyObjectInput,
    s3s::dto::CreateMultipartUploadInput,
    s3s::dto::UploadPartInput,
    s3s::dto::UploadPartCopyInput,
    s3s::dto::CompleteMultipartUploadInput,
    s3s::dto::ListPartsInput
);

/// Copies, which carry the source's key in the `x-amz-copy-source-*` headers.
pub trait WithCopySourceKey {
    /// The customer key of the copy source, if the request gives one.
    fn copy_source_key(&self) -> Result<Option<CustomerKey>>;
}

macro_rules! with_copy_source_key {
    ($($t:ty),*) => {$(
        impl WithCopySourceKey for $t {
            fn copy_source_key(&self) -> Result<Option<CustomerKey>> {
                CustomerKey::from_headers(
                    self.copy_source_sse_customer_algorithm.as_deref(),
                    self.copy_source_sse_customer_key.as_deref(),
                    self.copy_source_sse_customer_key_md5.as_deref(),
                )
            }
        }
    )*};
}

with_copy_source_key!(s3s::dto::CopyObjectInput, s3s::dto::UploadPartCopyInput);

/// A body error carried as text through [`Cipher::stream`].
struct StringErr(String);

impl From<LightningError> for StringErr {
    fn from(e: LightningError) -> Self {
        StringErr(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    fn key(byte: u8) -> CustomerKey {
        let k = [byte; 32];
        CustomerKey::from_headers(Some("AES256"), Some(&b64(&k)), Some(&b64(&md5::Md5::digest(k))))
            .expect("a valid key")
            .expect("a key")
    }

    #[test]
    fn keys_need_all_three_headers_aes256_32_bytes_and_their_md5() {
        let k = [1u8; 32];
        let (kb, mb) = (b64(&k), b64(&md5::Md5::digest(k)));
        assert!(CustomerKey::from_headers(None, None, None).expect("ok").is_none());
        assert!(CustomerKey::from_headers(Some("AES256"), Some(&kb), Some(&mb)).expect("ok").is_some());
        let (short, short_md5, zeros) = (b64(&[1u8; 16]), b64(&md5::Md5::digest([1u8; 16])), b64(&[0u8; 16]));
        let bad = [
            (Some("AES256"), Some(kb.as_str()), None),
            (None, Some(kb.as_str()), Some(mb.as_str())),
            (Some("aws:kms"), Some(kb.as_str()), Some(mb.as_str())),
            (Some("AES256"), Some(kb.as_str()), Some(zeros.as_str())),
            (Some("AES256"), Some(short.as_str()), Some(short_md5.as_str())),
        ];
        for (a, k, m) in bad {
            assert!(matches!(CustomerKey::from_headers(a, k, m), Err(LightningError::InvalidArgument(_))), "{a:?}");
        }
    }

    fn object(sse_c: Option<SseC>, parts: Vec<u64>) -> ObjectMeta {
        ObjectMeta {
            version: 1,
            size: parts.iter().sum(),
            etag: String::new(),
            last_modified_ms: 0,
            headers: Default::default(),
            checksum: None,
            parts,
            data: crate::meta::types::ObjectData::Inline(Vec::new()),
            sse_c,
            versioned: None,
        }
    }

    #[test]
    fn opening_needs_the_objects_own_key() {
        let (sse, _) = key(1).seal().expect("sealed");
        let (plain, sealed) = (object(None, vec![]), object(Some(sse), vec![]));
        assert!(open(&plain, None).expect("ok").is_none());
        assert!(open(&sealed, Some(&key(1))).expect("ok").is_some());
        assert!(matches!(open(&sealed, None), Err(LightningError::InvalidRequest(_))));
        assert!(matches!(open(&sealed, Some(&key(2))), Err(LightningError::AccessDenied(_))));
        assert!(matches!(open(&plain, Some(&key(1))), Err(LightningError::InvalidRequest(_))));
    }

    #[test]
    fn a_part_needs_the_key_its_upload_was_created_with() {
        let m = key(1).md5();
        assert!(for_upload(None, None).expect("ok").is_none());
        assert_eq!(for_upload(Some(m), Some(key(1))).expect("ok").map(|k| k.md5()), Some(m));
        assert!(matches!(for_upload(Some(m), None), Err(LightningError::InvalidRequest(_))));
        assert!(matches!(for_upload(Some(m), Some(key(2))), Err(LightningError::AccessDenied(_))));
        assert!(matches!(for_upload(None, Some(key(1))), Err(LightningError::InvalidRequest(_))));
    }

    /// The counter blocks a stream from `iv` of `len` bytes uses, as
    /// (first, count): they may wrap past 2^128.
    fn counters(iv: [u8; 16], len: u64) -> (u128, u128) {
        (u128::from_be_bytes(iv), u128::from(len.div_ceil(16)))
    }

    #[test]
    fn no_two_parts_of_an_upload_share_keystream_even_when_a_part_is_uploaded_again() {
        // Every UploadPart seals its bytes afresh (a re-upload of a part
        // number too): 10 000 parts (S3's most) of 5 GiB (its largest part)
        // must use disjoint counter blocks under the one key.
        let k = key(5);
        let max_part = 5u64 << 30;
        let mut ranges: Vec<(u128, u128)> =
            (0..10_000).map(|_| counters(k.seal().expect("sealed").0.iv, max_part)).collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(w[0].0.checked_add(w[0].1).is_some_and(|end| end <= w[1].0), "parts overlap: {w:?}");
        }
        let (last, first) = (ranges[ranges.len() - 1], ranges[0]);
        assert!(last.0.checked_add(last.1).is_some() || last.0.wrapping_add(last.1) <= first.0, "wrap overlap");
    }

    #[test]
    fn a_multipart_object_decrypts_each_part_with_its_own_iv_at_any_offset() {
        let k = key(6);
        let sizes = [100u64, 0, 37, 250, 16];
        // The same bytes in every part: their ciphertexts must still differ.
        let plain: Vec<Vec<u8>> = sizes.iter().map(|&n| (0..n).map(|i| (i * 13 % 256) as u8).collect()).collect();
        let mut ivs = Vec::new();
        let mut stored = Vec::new();
        for p in &plain {
            let (sse, c) = k.seal().expect("sealed");
            let mut sealed = p.clone();
            c.apply(0, &mut sealed).expect("ok");
            ivs.push(Some(sse.iv));
            stored.push(sealed);
        }
        assert_ne!(stored[0][..37], stored[2][..37], "two parts share keystream");
        assert_ne!(stored[0][..16], stored[4][..], "two parts share keystream");
        let sse = assembled(k.md5(), &ivs).expect("ok");
        assert_eq!(sse.iv, sse.part_ivs[0]);
        let meta = object(Some(sse), sizes.to_vec());
        let c = open(&meta, Some(&k)).expect("opened").expect("a cipher");
        let (whole_plain, whole) = (plain.concat(), stored.concat());
        for cuts in [vec![0, 403], vec![0, 99, 100, 101, 136, 137, 138, 386, 387, 390, 403], vec![0, 50, 200, 403]] {
            let mut back = whole.clone();
            for w in cuts.windows(2) {
                c.apply(w[0] as u64, &mut back[w[0]..w[1]]).expect("ok");
            }
            assert_eq!(back, whole_plain, "{cuts:?}");
        }
        // One stream over the whole object would not decrypt it.
        let single = object(Some(SseC { part_ivs: vec![], ..meta.sse_c.clone().expect("sealed") }), vec![]);
        let mut wrong = whole.clone();
        open(&single, Some(&k)).expect("a valid key").expect("a key").apply(0, &mut wrong).expect("applied");
        assert_ne!(wrong, whole_plain);
        // A part without an IV, or IVs that do not match the parts: refused.
        assert!(assembled(k.md5(), &[ivs[0], None]).is_err());
        assert!(assembled(k.md5(), &[]).is_err());
        let short = object(meta.sse_c.clone(), sizes[..2].to_vec());
        assert!(open(&short, Some(&k)).is_err());
    }

    #[test]
    fn ctr_at_any_offset_matches_one_pass_and_round_trips_even_across_a_counter_carry() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let k = key(3);
        for iv in [[0u8; 16], [0xff; 16], {
            let mut iv = [0x11u8; 16];
            iv[12..].copy_from_slice(&[0xff, 0xff, 0xff, 0xfe]);
            iv
        }] {
            let c = Cipher::new(&k, &SseC { key_md5: k.md5, iv, part_ivs: vec![] }, &[]).expect("ok");
            let mut whole = data.clone();
            c.apply(0, &mut whole).expect("ok");
            assert_ne!(whole, data);
            for cuts in [vec![0, 1, 17, 32, 33, 500, 1000], vec![0, 15, 16, 100, 999, 1000], vec![0, 7, 1000]] {
                let mut pieces = data.clone();
                for w in cuts.windows(2) {
                    c.apply(w[0] as u64, &mut pieces[w[0]..w[1]]).expect("ok");
                }
                assert_eq!(pieces, whole, "{iv:?} {cuts:?}");
            }
            let mut back = whole[300..450].to_vec();
            c.apply(300, &mut back).expect("ok");
            assert_eq!(back, data[300..450]);
        }
    }
}
