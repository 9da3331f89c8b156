//! SSE-C: server-side encryption with a key the client sends on every request.
//!
//! The object is stored encrypted with AES-256 in CTR mode under the
//! customer's key and a random 128-bit IV kept with the object; the key itself
//! is never stored, only its MD5 (which S3 also keeps, to tell a wrong key
//! from the right one). CTR keeps ranged reads cheap: the keystream at any
//! offset is computed directly, so a range GET decrypts only what it returns.
//!
//! As in S3: the three `x-amz-server-side-encryption-customer-*` headers come
//! together, the algorithm is `AES256`, the key is 32 bytes and its MD5 must
//! match (else 400 InvalidArgument); a GET/HEAD of an SSE-C object without
//! the key is 400 InvalidRequest, with another key 403 AccessDenied.

use crate::checksum::{BodyHasher, Checksum, ChecksumAlgo};
use crate::error::{LightningError, Result};
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
    base64::engine::general_purpose::STANDARD.encode(s.key_md5)
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

    /// Seals a new object: a fresh random IV.
    pub fn seal(&self) -> Result<(SseC, Cipher)> {
        let mut iv = [0u8; 16];
        aws_lc_rs::rand::fill(&mut iv).map_err(|_| LightningError::Io(std::io::Error::other("no random IV")))?;
        let sse = SseC { key_md5: self.md5, iv };
        let cipher = Cipher::new(self, &sse)?;
        Ok((sse, cipher))
    }
}

/// Opens an object for a GET/HEAD (or a copy source): the key must come
/// with an SSE-C object and be its key; a key for a plain object is refused
/// as S3 refuses it. Returns the cipher for an SSE-C object.
pub fn open(stored: Option<&SseC>, given: Option<&CustomerKey>) -> Result<Option<Cipher>> {
    match (stored, given) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(LightningError::InvalidRequest(
            "The encryption parameters are not applicable to this object (it is not SSE-C encrypted).".into(),
        )),
        (Some(_), None) => Err(LightningError::InvalidRequest(
            "The object was stored using a form of Server Side Encryption. The correct parameters must be provided to retrieve the object.".into(),
        )),
        (Some(s), Some(k)) if s.key_md5 != k.md5 => Err(LightningError::AccessDenied(
            "The SSE-C key given is not the key the object was stored with.".into(),
        )),
        (Some(s), Some(k)) => Cipher::new(k, s).map(Some),
    }
}

/// AES-256-CTR under one key and IV, applied at any byte offset.
#[derive(Clone)]
pub struct Cipher {
    key: Arc<EncryptingKey>,
    iv: u128,
}

impl Cipher {
    fn new(k: &CustomerKey, s: &SseC) -> Result<Self> {
        let key = UnboundCipherKey::new(&AES_256, &k.key)
            .and_then(EncryptingKey::ctr)
            .map_err(|_| LightningError::Io(std::io::Error::other("AES-256 key setup failed")))?;
        Ok(Cipher { key: Arc::new(key), iv: u128::from_be_bytes(s.iv) })
    }

    /// Encrypts (or decrypts: CTR is its own inverse) `data`, which sits at
    /// byte `offset` of the object.
    pub fn apply(&self, offset: u64, data: &mut [u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let counter = self.iv.wrapping_add(u128::from(offset / 16));
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

with_customer_key!(s3s::dto::PutObjectInput, s3s::dto::GetObjectInput, s3s::dto::HeadObjectInput);

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
        CustomerKey::from_headers(Some("AES256"), Some(&b64(&k)), Some(&b64(&md5::Md5::digest(k)))).unwrap().unwrap()
    }

    #[test]
    fn keys_need_all_three_headers_aes256_32_bytes_and_their_md5() {
        let k = [1u8; 32];
        let (kb, mb) = (b64(&k), b64(&md5::Md5::digest(k)));
        assert!(CustomerKey::from_headers(None, None, None).unwrap().is_none());
        assert!(CustomerKey::from_headers(Some("AES256"), Some(&kb), Some(&mb)).unwrap().is_some());
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

    #[test]
    fn opening_needs_the_objects_own_key() {
        let (sse, _) = key(1).seal().unwrap();
        assert!(open(None, None).unwrap().is_none());
        assert!(open(Some(&sse), Some(&key(1))).unwrap().is_some());
        assert!(matches!(open(Some(&sse), None), Err(LightningError::InvalidRequest(_))));
        assert!(matches!(open(Some(&sse), Some(&key(2))), Err(LightningError::AccessDenied(_))));
        assert!(matches!(open(None, Some(&key(1))), Err(LightningError::InvalidRequest(_))));
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
            let c = Cipher::new(&k, &SseC { key_md5: k.md5, iv }).unwrap();
            let mut whole = data.clone();
            c.apply(0, &mut whole).unwrap();
            assert_ne!(whole, data);
            for cuts in [vec![0, 1, 17, 32, 33, 500, 1000], vec![0, 15, 16, 100, 999, 1000], vec![0, 7, 1000]] {
                let mut pieces = data.clone();
                for w in cuts.windows(2) {
                    c.apply(w[0] as u64, &mut pieces[w[0]..w[1]]).unwrap();
                }
                assert_eq!(pieces, whole, "{iv:?} {cuts:?}");
            }
            let mut back = whole[300..450].to_vec();
            c.apply(300, &mut back).unwrap();
            assert_eq!(back, data[300..450]);
        }
    }
}
