//! Body integrity: MD5 (ETag, Content-MD5) and the `x-amz-checksum-*` family.
//!
//! s3s parses checksum headers and aws-chunked trailers but verifies none of
//! them; everything is checked here. The functions are pure: the upload path
//! feeds bytes to a [`BodyHasher`] and compares the result with the
//! [`ChecksumPlan`] built from the request headers (and, for aws-chunked
//! uploads, the trailer that arrives after the body).

use crate::error::{LightningError, Result};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use md5::Digest as _;

/// A checksum algorithm S3 clients may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ChecksumAlgo {
    /// CRC-32 (ISO-HDLC), 4 bytes.
    Crc32,
    /// CRC-32C (Castagnoli), 4 bytes.
    Crc32c,
    /// CRC-64/NVME, 8 bytes.
    Crc64Nvme,
    /// SHA-1, 20 bytes.
    Sha1,
    /// SHA-256, 32 bytes.
    Sha256,
}

impl ChecksumAlgo {
    /// Every algorithm.
    pub const ALL: [ChecksumAlgo; 5] =
        [ChecksumAlgo::Crc32, ChecksumAlgo::Crc32c, ChecksumAlgo::Crc64Nvme, ChecksumAlgo::Sha1, ChecksumAlgo::Sha256];

    /// The algorithm's name in `x-amz-checksum-algorithm` (`CRC32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ChecksumAlgo::Crc32 => "CRC32",
            ChecksumAlgo::Crc32c => "CRC32C",
            ChecksumAlgo::Crc64Nvme => "CRC64NVME",
            ChecksumAlgo::Sha1 => "SHA1",
            ChecksumAlgo::Sha256 => "SHA256",
        }
    }

    /// The header (or trailer) carrying a value of this algorithm.
    pub fn header(self) -> &'static str {
        match self {
            ChecksumAlgo::Crc32 => "x-amz-checksum-crc32",
            ChecksumAlgo::Crc32c => "x-amz-checksum-crc32c",
            ChecksumAlgo::Crc64Nvme => "x-amz-checksum-crc64nvme",
            ChecksumAlgo::Sha1 => "x-amz-checksum-sha1",
            ChecksumAlgo::Sha256 => "x-amz-checksum-sha256",
        }
    }

    /// Parses an algorithm name, case-insensitively.
    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name().eq_ignore_ascii_case(s))
    }

    /// Parses a checksum header name (`x-amz-checksum-crc32`), case-insensitively.
    pub fn from_header(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.header().eq_ignore_ascii_case(s.trim()))
    }

    /// Length of a raw digest.
    pub fn digest_len(self) -> usize {
        match self {
            ChecksumAlgo::Crc32 | ChecksumAlgo::Crc32c => 4,
            ChecksumAlgo::Crc64Nvme => 8,
            ChecksumAlgo::Sha1 => 20,
            ChecksumAlgo::Sha256 => 32,
        }
    }

    /// The CRC behind a CRC algorithm (those a FULL_OBJECT multipart
    /// checksum can combine); `None` for SHA-1 and SHA-256.
    pub fn crc(self) -> Option<crc_fast::CrcAlgorithm> {
        use crc_fast::CrcAlgorithm as C;
        match self {
            ChecksumAlgo::Crc32 => Some(C::Crc32IsoHdlc),
            ChecksumAlgo::Crc32c => Some(C::Crc32Iscsi),
            ChecksumAlgo::Crc64Nvme => Some(C::Crc64Nvme),
            ChecksumAlgo::Sha1 | ChecksumAlgo::Sha256 => None,
        }
    }

    /// The digest of `data` in one call.
    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        let mut h = Hasher::new(self);
        h.update(data);
        h.finalize()
    }
}

/// A running digest of one algorithm.
pub enum Hasher {
    /// A CRC computed by `crc-fast`.
    Crc(ChecksumAlgo, crc_fast::Digest),
    /// SHA-1.
    Sha1(sha1::Sha1),
    /// SHA-256.
    Sha256(sha2::Sha256),
}

impl Hasher {
    /// A fresh digest.
    pub fn new(algo: ChecksumAlgo) -> Self {
        match (algo, algo.crc()) {
            (_, Some(crc)) => Hasher::Crc(algo, crc_fast::Digest::new(crc)),
            (ChecksumAlgo::Sha1, None) => Hasher::Sha1(sha1::Sha1::new()),
            (_, None) => Hasher::Sha256(sha2::Sha256::new()),
        }
    }

    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Crc(_, d) => d.update(data),
            Hasher::Sha1(h) => h.update(data),
            Hasher::Sha256(h) => h.update(data),
        }
    }

    /// The raw big-endian digest.
    pub fn finalize(self) -> Vec<u8> {
        match self {
            Hasher::Crc(ChecksumAlgo::Crc64Nvme, d) => d.finalize().to_be_bytes().to_vec(),
            Hasher::Crc(_, d) => {
                let v = u32::try_from(d.finalize() & 0xffff_ffff).unwrap_or_default();
                v.to_be_bytes().to_vec()
            }
            Hasher::Sha1(h) => h.finalize().to_vec(),
            Hasher::Sha256(h) => h.finalize().to_vec(),
        }
    }
}

/// A checksum value of a known algorithm.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Checksum {
    /// The algorithm.
    pub algo: ChecksumAlgo,
    /// The raw digest (for a composite checksum: the digest of the part digests).
    pub raw: Vec<u8>,
    /// For a composite (multipart) checksum, the number of parts.
    pub parts: Option<u32>,
}

impl Checksum {
    /// Parses the base64 value of a checksum header; a malformed value is InvalidRequest.
    pub fn from_base64(algo: ChecksumAlgo, value: &str) -> Result<Self> {
        let raw = B64
            .decode(value.trim())
            .ok()
            .filter(|r| r.len() == algo.digest_len())
            .ok_or_else(|| LightningError::InvalidRequest(format!("value for {} is invalid", algo.header())))?;
        Ok(Checksum { algo, raw, parts: None })
    }

    /// The wire form: base64, with `-N` for a composite checksum.
    pub fn to_base64(&self) -> String {
        match self.parts {
            Some(n) => format!("{}-{n}", B64.encode(&self.raw)),
            None => B64.encode(&self.raw),
        }
    }

    /// The composite checksum of a multipart object from its parts' digests.
    pub fn composite(algo: ChecksumAlgo, part_digests: &[&[u8]]) -> Self {
        let mut h = Hasher::new(algo);
        for d in part_digests {
            h.update(d);
        }
        Checksum { algo, raw: h.finalize(), parts: u32::try_from(part_digests.len()).ok() }
    }

    /// The FULL_OBJECT checksum of a multipart object: the CRC of the whole
    /// object, combined from each part's CRC and length (`(digest, len)` in
    /// part order) without reading a byte again. `None` for SHA-1/SHA-256,
    /// which cannot be combined, or a digest of the wrong length.
    pub fn full_object(algo: ChecksumAlgo, parts: &[(&[u8], u64)]) -> Option<Self> {
        let crc = algo.crc()?;
        let value = |d: &[u8]| -> Option<u64> {
            (d.len() == algo.digest_len()).then(|| d.iter().fold(0u64, |v, b| (v << 8) | u64::from(*b)))
        };
        let mut whole = value(&algo.digest(b""))?;
        for (d, len) in parts {
            whole = crc_fast::checksum_combine(crc, whole, value(d)?, *len);
        }
        let raw = whole.to_be_bytes()[8 - algo.digest_len()..].to_vec();
        Some(Checksum { algo, raw, parts: None })
    }
}

/// What the client told us to check the body against.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChecksumPlan {
    /// Expected MD5 from Content-MD5.
    pub md5: Option<[u8; 16]>,
    /// The algorithm to compute (and store) besides MD5.
    pub algo: Option<ChecksumAlgo>,
    /// The value given in a header, known before the body.
    pub expected: Option<Checksum>,
    /// The value arrives in this trailer after the body (aws-chunked).
    pub trailer: bool,
}

/// The checksum-related request fields, as s3s parsed them.
#[derive(Debug, Default, Clone, Copy)]
pub struct ChecksumHeaders<'a> {
    /// Content-MD5.
    pub content_md5: Option<&'a str>,
    /// x-amz-sdk-checksum-algorithm / x-amz-checksum-algorithm.
    pub algorithm: Option<&'a str>,
    /// x-amz-checksum-crc32.
    pub crc32: Option<&'a str>,
    /// x-amz-checksum-crc32c.
    pub crc32c: Option<&'a str>,
    /// x-amz-checksum-crc64nvme.
    pub crc64nvme: Option<&'a str>,
    /// x-amz-checksum-sha1.
    pub sha1: Option<&'a str>,
    /// x-amz-checksum-sha256.
    pub sha256: Option<&'a str>,
    /// x-amz-trailer.
    pub trailer: Option<&'a str>,
}

impl ChecksumPlan {
    /// Builds the plan from request headers, rejecting contradictory or malformed ones.
    pub fn from_headers(h: &ChecksumHeaders<'_>) -> Result<Self> {
        let md5 = match h.content_md5 {
            None => None,
            Some(v) => {
                let raw = B64
                    .decode(v.trim())
                    .map_err(|_| LightningError::InvalidDigest("Content-MD5 is not base64".into()))?;
                Some(
                    <[u8; 16]>::try_from(raw.as_slice())
                        .map_err(|_| LightningError::InvalidDigest("Content-MD5 is not 16 bytes".into()))?,
                )
            }
        };
        let given = [
            (ChecksumAlgo::Crc32, h.crc32),
            (ChecksumAlgo::Crc32c, h.crc32c),
            (ChecksumAlgo::Crc64Nvme, h.crc64nvme),
            (ChecksumAlgo::Sha1, h.sha1),
            (ChecksumAlgo::Sha256, h.sha256),
        ];
        let mut expected = None;
        for (algo, v) in given {
            if let Some(v) = v {
                if expected.is_some() {
                    return Err(LightningError::InvalidRequest("expecting a single x-amz-checksum- header".into()));
                }
                expected = Some(Checksum::from_base64(algo, v)?);
            }
        }
        let declared = match h.algorithm {
            None => None,
            Some(a) => Some(
                ChecksumAlgo::from_name(a)
                    .ok_or_else(|| LightningError::InvalidRequest(format!("unknown checksum algorithm {a:?}")))?,
            ),
        };
        let trailer_algo = match h.trailer {
            None => None,
            Some(t) => Some(
                ChecksumAlgo::from_header(t)
                    .ok_or_else(|| LightningError::InvalidRequest(format!("unsupported trailer {t:?}")))?,
            ),
        };
        if expected.is_some() && trailer_algo.is_some() {
            return Err(LightningError::InvalidRequest(
                "a checksum header and a checksum trailer were both given".into(),
            ));
        }
        let algo = expected.as_ref().map(|c| c.algo).or(trailer_algo).or(declared);
        if let (Some(d), Some(a)) = (declared, algo)
            && d != a
        {
            return Err(LightningError::BadDigest(format!(
                "checksum algorithm {} does not match the {} value given",
                d.name(),
                a.name()
            )));
        }
        Ok(ChecksumPlan { md5, algo, expected, trailer: trailer_algo.is_some() })
    }

    /// Checks the computed digests against the plan; `trailer_value` is the
    /// trailer's value once the body has been read.
    pub fn verify(&self, md5: &[u8; 16], computed: Option<&Checksum>, trailer_value: Option<&str>) -> Result<()> {
        if let Some(want) = &self.md5
            && want != md5
        {
            return Err(LightningError::BadDigest(
                "the Content-MD5 you specified did not match what we received".into(),
            ));
        }
        let expected = match (&self.expected, self.trailer, self.algo) {
            (Some(e), _, _) => Some(e.clone()),
            (None, true, Some(algo)) => {
                let v = trailer_value.ok_or_else(|| {
                    LightningError::InvalidRequest(format!("the {} trailer was announced but not sent", algo.header()))
                })?;
                Some(Checksum::from_base64(algo, v)?)
            }
            _ => None,
        };
        if let Some(e) = expected
            && computed.map(|c| &c.raw) != Some(&e.raw)
        {
            return Err(LightningError::BadDigest(format!(
                "the {} you specified did not match the calculated checksum",
                e.algo.name()
            )));
        }
        Ok(())
    }
}

/// MD5 by aws-lc's assembly implementation: about 25 % faster than the
/// portable one, and MD5 (the ETag) is the costliest per-byte work of an
/// upload.
pub struct Md5(aws_lc_sys::MD5_CTX);

impl Md5 {
    /// A fresh digest.
    pub fn new() -> Self {
        let mut ctx = std::mem::MaybeUninit::<aws_lc_sys::MD5_CTX>::zeroed();
        // SAFETY: MD5_Init initialises the (zeroed, properly aligned) context
        // it is given and cannot fail.
        unsafe {
            aws_lc_sys::MD5_Init(ctx.as_mut_ptr());
            Md5(ctx.assume_init())
        }
    }

    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        // SAFETY: the context is initialised; the pointer and length describe
        // a live slice.
        unsafe {
            aws_lc_sys::MD5_Update(&mut self.0, data.as_ptr().cast(), data.len());
        }
    }

    /// The 16-byte digest.
    pub fn finalize(mut self) -> [u8; 16] {
        let mut out = [0u8; 16];
        // SAFETY: the context is initialised and `out` has the 16 bytes
        // MD5_Final writes.
        unsafe {
            aws_lc_sys::MD5_Final(out.as_mut_ptr(), &mut self.0);
        }
        out
    }
}

impl Default for Md5 {
    fn default() -> Self {
        Self::new()
    }
}

/// Computes MD5 and at most one `x-amz-checksum` algorithm over a body.
pub struct BodyHasher {
    md5: Md5,
    extra: Option<(ChecksumAlgo, Hasher)>,
    len: u64,
}

impl BodyHasher {
    /// A hasher for MD5 plus `algo`.
    pub fn new(algo: Option<ChecksumAlgo>) -> Self {
        BodyHasher { md5: Md5::new(), extra: algo.map(|a| (a, Hasher::new(a))), len: 0 }
    }

    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.md5.update(data);
        if let Some((_, h)) = &mut self.extra {
            h.update(data);
        }
        self.len += data.len() as u64;
    }

    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether no byte was fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The MD5 and the extra checksum.
    pub fn finalize(self) -> ([u8; 16], Option<Checksum>) {
        let md5 = self.md5.finalize();
        let extra = self.extra.map(|(algo, h)| Checksum { algo, raw: h.finalize(), parts: None });
        (md5, extra)
    }
}

/// Base64 of raw bytes (Content-MD5 style).
pub fn base64(raw: &[u8]) -> String {
    B64.encode(raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_vectors_match_the_published_check_values() {
        // The standard "123456789" check values of each CRC.
        let d = b"123456789";
        assert_eq!(ChecksumAlgo::Crc32.digest(d), 0xCBF4_3926u32.to_be_bytes());
        assert_eq!(ChecksumAlgo::Crc32c.digest(d), 0xE306_9283u32.to_be_bytes());
        assert_eq!(ChecksumAlgo::Crc64Nvme.digest(d), 0xAE8B_1486_0A79_9888u64.to_be_bytes());
        assert_eq!(hex::encode(ChecksumAlgo::Sha1.digest(b"abc")), "a9993e364706816aba3e25717850c26c9cd0d89d");
        assert_eq!(
            hex::encode(ChecksumAlgo::Sha256.digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_wrong_content_md5_is_a_bad_digest() {
        let md5 = base64(&md5::Md5::digest(b"hello"));
        let plan = ChecksumPlan::from_headers(&ChecksumHeaders { content_md5: Some(&md5), ..Default::default() })
            .expect("plan");
        let mut h = BodyHasher::new(None);
        h.update(b"hellO");
        let (got, _) = h.finalize();
        assert!(matches!(plan.verify(&got, None, None), Err(LightningError::BadDigest(_))));
    }

    #[test]
    fn a_malformed_content_md5_is_an_invalid_digest() {
        let r = ChecksumPlan::from_headers(&ChecksumHeaders { content_md5: Some("not base64!"), ..Default::default() });
        assert!(matches!(r, Err(LightningError::InvalidDigest(_))));
    }

    #[test]
    fn trailing_checksums_are_checked_after_the_body() {
        let plan = ChecksumPlan::from_headers(&ChecksumHeaders {
            trailer: Some("x-amz-checksum-crc32c"),
            ..Default::default()
        })
        .expect("plan");
        assert_eq!(plan.algo, Some(ChecksumAlgo::Crc32c));
        let mut h = BodyHasher::new(plan.algo);
        h.update(b"data");
        let (md5, c) = h.finalize();
        let good = base64(&ChecksumAlgo::Crc32c.digest(b"data"));
        assert!(plan.verify(&md5, c.as_ref(), Some(&good)).is_ok());
        let bad = base64(&ChecksumAlgo::Crc32c.digest(b"dat4"));
        assert!(matches!(plan.verify(&md5, c.as_ref(), Some(&bad)), Err(LightningError::BadDigest(_))));
        assert!(plan.verify(&md5, c.as_ref(), None).is_err());
    }

    #[test]
    fn a_checksum_of_the_wrong_length_is_an_invalid_request() {
        let r = ChecksumPlan::from_headers(&ChecksumHeaders { crc32: Some("AAAAAAAA"), ..Default::default() });
        assert!(matches!(r, Err(LightningError::InvalidRequest(_))));
    }

    #[test]
    fn sha_checksums_do_not_combine_into_a_full_object_checksum() {
        let d = ChecksumAlgo::Sha256.digest(b"a");
        assert_eq!(Checksum::full_object(ChecksumAlgo::Sha256, &[(&d, 1)]), None);
        // The published check value, from two parts.
        let (a, b) = (ChecksumAlgo::Crc32.digest(b"1234"), ChecksumAlgo::Crc32.digest(b"56789"));
        let whole = Checksum::full_object(ChecksumAlgo::Crc32, &[(&a, 4), (&b, 5)]).expect("crc32");
        assert_eq!(whole.raw, 0xCBF4_3926u32.to_be_bytes());
    }

    #[test]
    fn composite_checksums_carry_the_part_count() {
        let a = ChecksumAlgo::Crc32.digest(b"a");
        let b = ChecksumAlgo::Crc32.digest(b"b");
        let c = Checksum::composite(ChecksumAlgo::Crc32, &[&a, &b]);
        assert!(c.to_base64().ends_with("-2"));
    }

    proptest! {
        #[test]
        fn hashing_in_pieces_equals_hashing_at_once(data in proptest::collection::vec(any::<u8>(), 0..2000), cut in 0usize..2000, algo in 0usize..5) {
            let algo = ChecksumAlgo::ALL[algo];
            let cut = cut.min(data.len());
            let mut h = BodyHasher::new(Some(algo));
            h.update(&data[..cut]);
            h.update(&data[cut..]);
            let (md5, c) = h.finalize();
            prop_assert_eq!(md5.to_vec(), md5::Md5::digest(&data).to_vec());
            prop_assert_eq!(c.map(|c| c.raw), Some(algo.digest(&data)));
        }

        #[test]
        fn aws_lc_md5_matches_the_portable_md5(data in proptest::collection::vec(any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(data.len());
            let mut h = Md5::new();
            h.update(&data[..cut]);
            h.update(&data[cut..]);
            prop_assert_eq!(h.finalize().to_vec(), md5::Md5::digest(&data).to_vec());
        }

        #[test]
        fn arbitrary_header_values_never_panic(
            md5 in proptest::option::of(".{0,30}"),
            algo in proptest::option::of("[A-Za-z0-9]{0,10}"),
            crc in proptest::option::of(".{0,20}"),
            trailer in proptest::option::of(".{0,30}"),
            value in proptest::option::of(".{0,20}"),
        ) {
            let h = ChecksumHeaders {
                content_md5: md5.as_deref(),
                algorithm: algo.as_deref(),
                crc32: crc.as_deref(),
                trailer: trailer.as_deref(),
                ..Default::default()
            };
            if let Ok(plan) = ChecksumPlan::from_headers(&h) {
                let mut b = BodyHasher::new(plan.algo);
                b.update(b"body");
                let (m, c) = b.finalize();
                let _ = plan.verify(&m, c.as_ref(), value.as_deref());
            }
        }

        #[test]
        fn a_full_object_crc_combined_from_parts_is_the_crc_of_their_concatenation(
            parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..3000), 0..6),
            algo in 0usize..3,
        ) {
            let algo = [ChecksumAlgo::Crc32, ChecksumAlgo::Crc32c, ChecksumAlgo::Crc64Nvme][algo];
            let digests: Vec<Vec<u8>> = parts.iter().map(|p| algo.digest(p)).collect();
            let pairs: Vec<(&[u8], u64)> = digests.iter().zip(&parts).map(|(d, p)| (d.as_slice(), p.len() as u64)).collect();
            let whole = Checksum::full_object(algo, &pairs).expect("a CRC combines");
            prop_assert_eq!(whole.raw, algo.digest(&parts.concat()));
            prop_assert_eq!(whole.parts, None);
        }

        #[test]
        fn base64_checksums_round_trip(raw in proptest::collection::vec(any::<u8>(), 4)) {
            let c = Checksum { algo: ChecksumAlgo::Crc32, raw, parts: None };
            prop_assert_eq!(Checksum::from_base64(ChecksumAlgo::Crc32, &c.to_base64()).ok(), Some(c));
        }
    }
}
