//! Sans-IO image probing: decides raw vs qcow2 from the first bytes of an
//! artifact, reads the virtual size, and refuses what we will not run.
//!
//! The prober never trusts a file name or a declared format: it looks at the
//! header bytes only. It is fed the artifact's first [`PROBE_LEN`] bytes while
//! the upload streams (see [`Prober`]) and is told the final length at the
//! end, so table bounds can be checked without a second pass. Nothing here
//! allocates in proportion to a value read from the file.

use serde::{Deserialize, Serialize};

/// How many leading bytes the prober looks at. qcow2 keeps its header and
/// header extensions in the first cluster; images from qemu-img put them in
/// the first 4 KiB, so 64 KiB leaves room without buffering a 2 MiB cluster.
pub const PROBE_LEN: usize = 64 * 1024;

const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_EXTERNAL_DATA_FILE: u32 = 0x4441_5441;
const EXT_FULL_DISK_ENCRYPTION: u32 = 0x0537_be77;
/// Incompatible feature bits (qcow2 v3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
/// The most L1 entries we accept (8 bytes each: a 32 MiB L1 table maps
/// 256 TiB with 64 KiB clusters).
const MAX_L1_ENTRIES: u64 = 4 * 1024 * 1024;

/// A disk format as stored and as asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    /// Bytes as the guest sees them.
    Raw,
    /// QEMU copy-on-write v2 or v3, without backing file or external data file.
    Qcow2,
}

impl std::fmt::Display for DiskFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DiskFormat::Raw => "raw",
            DiskFormat::Qcow2 => "qcow2",
        })
    }
}

/// What the probe found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeResult {
    pub format: DiskFormat,
    /// Size of the disk the guest sees, in bytes.
    pub virtual_size: u64,
    /// qcow2 cluster size (0 for raw).
    pub cluster_size: u64,
}

/// Why an artifact was refused. Each message names the problem plainly; the
/// API returns it as the image's `error_reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The artifact ends inside its own header.
    #[error("truncated image: the header needs {need} bytes but the file has {have}")]
    Truncated { need: u64, have: u64 },
    #[error("qcow2 version {0} is not supported (only 2 and 3)")]
    Version(u32),
    #[error("the image refers to a backing file{0}; images with backing files are refused")]
    BackingFile(String),
    #[error("the image uses an external data file; such images are refused")]
    ExternalDataFile,
    #[error("encrypted images are refused")]
    Encrypted,
    #[error("the image is marked corrupt by qemu")]
    MarkedCorrupt,
    #[error("unsupported qcow2 feature: {0}")]
    Unsupported(&'static str),
    #[error("invalid cluster_bits {0} (must be 9..=21)")]
    ClusterBits(u32),
    #[error("virtual size {size} is larger than the allowed {max} bytes")]
    TooLarge { size: u64, max: u64 },
    #[error("invalid qcow2 header: {0}")]
    BadHeader(String),
    #[error("{what} at offset {offset} (+{len}) points past the end of the {file_len}-byte file")]
    PastEnd { what: &'static str, offset: u64, len: u64, file_len: u64 },
    #[error("{0} images are not supported (only raw and qcow2)")]
    OtherFormat(&'static str),
    #[error("the image was declared {declared} but its header says {found}")]
    FormatMismatch { declared: DiskFormat, found: DiskFormat },
    #[error("the image is empty")]
    Empty,
}

/// Limits the caller imposes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest accepted virtual size.
    pub max_virtual_size: u64,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(x)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// Other formats we recognise only to refuse them by name (a VMDK uploaded
/// as "raw" would otherwise boot as garbage).
fn other_format(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(b"KDMV") || head.starts_with(b"# Disk DescriptorFile") {
        return Some("VMDK");
    }
    if head.starts_with(b"vhdxfile") {
        return Some("VHDX");
    }
    if head.starts_with(b"conectix") {
        return Some("VHD");
    }
    if head.starts_with(b"LUKS\xba\xbe") {
        return Some("LUKS");
    }
    if head.len() >= 0x44 && be32(head, 0x40) == 0x7f10_dabe {
        return Some("VDI");
    }
    if head.starts_with(QCOW2_MAGIC) && head.len() >= 8 && be32(head, 4) == 1 {
        return Some("qcow (version 1)");
    }
    None
}

/// Parsed qcow2 header fields that matter for bounds checks at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Qcow2Header {
    size: u64,
    cluster_bits: u32,
    l1_size: u64,
    l1_table_offset: u64,
    refcount_table_offset: u64,
    refcount_table_clusters: u64,
    header_length: u64,
}

fn parse_qcow2(head: &[u8], limits: Limits) -> Result<Qcow2Header, ProbeError> {
    let have = head.len() as u64;
    if head.len() < 72 {
        return Err(ProbeError::Truncated { need: 72, have });
    }
    let version = be32(head, 4);
    if version != 2 && version != 3 {
        return Err(ProbeError::Version(version));
    }
    let backing_off = be64(head, 8);
    let backing_len = be32(head, 16) as u64;
    if backing_off != 0 || backing_len != 0 {
        let name = usize::try_from(backing_off)
            .ok()
            .and_then(|o| head.get(o..o.checked_add(backing_len.min(1023) as usize)?))
            .map(|b| format!(" {:?}", String::from_utf8_lossy(b)))
            .unwrap_or_default();
        return Err(ProbeError::BackingFile(name));
    }
    let cluster_bits = be32(head, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(ProbeError::ClusterBits(cluster_bits));
    }
    let cluster_size = 1u64 << cluster_bits;
    let size = be64(head, 24);
    if size > limits.max_virtual_size {
        return Err(ProbeError::TooLarge { size, max: limits.max_virtual_size });
    }
    if be32(head, 32) != 0 {
        return Err(ProbeError::Encrypted);
    }
    let l1_size = be32(head, 36) as u64;
    let l1_table_offset = be64(head, 40);
    let refcount_table_offset = be64(head, 48);
    let refcount_table_clusters = be32(head, 56) as u64;
    // One L2 table maps cluster_size/8 clusters.
    let per_l1 = cluster_size * (cluster_size / 8);
    let need_l1 = size.div_ceil(per_l1);
    if l1_size < need_l1 {
        return Err(ProbeError::BadHeader(format!("L1 table has {l1_size} entries but {need_l1} are needed")));
    }
    if l1_size > MAX_L1_ENTRIES {
        return Err(ProbeError::BadHeader(format!("L1 table of {l1_size} entries is absurdly large")));
    }
    for (what, off) in [("L1 table", l1_table_offset), ("refcount table", refcount_table_offset)] {
        if off % cluster_size != 0 {
            return Err(ProbeError::BadHeader(format!("{what} offset {off} is not cluster aligned")));
        }
        if off == 0 && (what == "refcount table" || l1_size > 0) {
            return Err(ProbeError::BadHeader(format!("{what} offset is 0 (overlaps the header)")));
        }
    }
    let mut header_length = 72u64;
    if version == 3 {
        if head.len() < 104 {
            return Err(ProbeError::Truncated { need: 104, have });
        }
        let incompat = be64(head, 72);
        let autoclear = be64(head, 88);
        let refcount_order = be32(head, 96);
        header_length = be32(head, 100) as u64;
        if header_length < 104
            || header_length > cluster_size
            || !header_length.is_multiple_of(8) && header_length != 104
        {
            return Err(ProbeError::BadHeader(format!("header length {header_length} is invalid")));
        }
        if incompat & INCOMPAT_CORRUPT != 0 {
            return Err(ProbeError::MarkedCorrupt);
        }
        if incompat & INCOMPAT_DATA_FILE != 0 || autoclear & 0b10 != 0 {
            return Err(ProbeError::ExternalDataFile);
        }
        if incompat & INCOMPAT_EXTENDED_L2 != 0 {
            return Err(ProbeError::Unsupported("extended L2 entries (subclusters)"));
        }
        if incompat & INCOMPAT_COMPRESSION_TYPE != 0 {
            let ct = if header_length > 104 && head.len() > 104 { head[104] } else { 0 };
            if ct != 0 {
                return Err(ProbeError::Unsupported("zstd compression"));
            }
        }
        let known =
            INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION_TYPE | INCOMPAT_EXTENDED_L2;
        if incompat & !known != 0 {
            return Err(ProbeError::Unsupported("unknown incompatible feature bits"));
        }
        if refcount_order > 6 {
            return Err(ProbeError::BadHeader(format!("refcount_order {refcount_order} is above 6")));
        }
    }
    walk_extensions(head, header_length as usize, cluster_size)?;
    Ok(Qcow2Header {
        size,
        cluster_bits,
        l1_size,
        l1_table_offset,
        refcount_table_offset,
        refcount_table_clusters,
        header_length,
    })
}

/// Walks the header extensions (type, length, data padded to 8) up to the end
/// marker, refusing the ones that pull in other files.
fn walk_extensions(head: &[u8], mut at: usize, cluster_size: u64) -> Result<(), ProbeError> {
    let limit = (cluster_size as usize).min(PROBE_LEN);
    // Each extension takes at least 8 bytes, so this loop is bounded by limit / 8.
    loop {
        if at + 8 > limit {
            return Err(ProbeError::BadHeader("header extensions run past the first cluster".into()));
        }
        if at + 8 > head.len() {
            return Err(ProbeError::Truncated { need: at as u64 + 8, have: head.len() as u64 });
        }
        let kind = be32(head, at);
        let len = be32(head, at + 4) as usize;
        match kind {
            EXT_END => return Ok(()),
            EXT_EXTERNAL_DATA_FILE => return Err(ProbeError::ExternalDataFile),
            EXT_FULL_DISK_ENCRYPTION => return Err(ProbeError::Encrypted),
            EXT_BACKING_FORMAT => return Err(ProbeError::BackingFile(" (backing format extension)".into())),
            _ => {}
        }
        let next = (at + 8).checked_add(len.div_ceil(8) * 8).filter(|n| *n <= limit);
        at =
            next.ok_or_else(|| ProbeError::BadHeader(format!("header extension {kind:#x} of {len} bytes overruns")))?;
    }
}

/// Probes an artifact from its leading bytes and total length. `head` holds
/// the first `min(PROBE_LEN, total_len)` bytes.
pub fn probe(
    head: &[u8],
    total_len: u64,
    declared: Option<DiskFormat>,
    limits: Limits,
) -> Result<ProbeResult, ProbeError> {
    if total_len == 0 {
        return Err(ProbeError::Empty);
    }
    if let Some(name) = other_format(head) {
        return Err(ProbeError::OtherFormat(name));
    }
    let found = if head.starts_with(QCOW2_MAGIC) { DiskFormat::Qcow2 } else { DiskFormat::Raw };
    if let Some(d) = declared
        && d != found
    {
        return Err(ProbeError::FormatMismatch { declared: d, found });
    }
    match found {
        DiskFormat::Raw => {
            if total_len > limits.max_virtual_size {
                return Err(ProbeError::TooLarge { size: total_len, max: limits.max_virtual_size });
            }
            Ok(ProbeResult { format: DiskFormat::Raw, virtual_size: total_len, cluster_size: 0 })
        }
        DiskFormat::Qcow2 => {
            let h = parse_qcow2(head, limits)?;
            let cluster_size = 1u64 << h.cluster_bits;
            let past = |what, offset: u64, len: u64| {
                if offset.checked_add(len).is_none_or(|end| end > total_len) {
                    Err(ProbeError::PastEnd { what, offset, len, file_len: total_len })
                } else {
                    Ok(())
                }
            };
            past("header", 0, h.header_length)?;
            past("L1 table", h.l1_table_offset, h.l1_size * 8)?;
            past("refcount table", h.refcount_table_offset, h.refcount_table_clusters.saturating_mul(cluster_size))?;
            Ok(ProbeResult { format: DiskFormat::Qcow2, virtual_size: h.size, cluster_size })
        }
    }
}

/// Where the L1 table is, for [`check_l1_entries`].
pub fn l1_location(head: &[u8]) -> Option<(u64, u64)> {
    (head.len() >= 48 && head.starts_with(QCOW2_MAGIC)).then(|| (be64(head, 40), be32(head, 36) as u64))
}

/// L1 entry bits that hold the L2 table offset.
const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Checks a run of L1 entries (big-endian u64s): every L2 table they point to
/// must be cluster aligned and lie inside the file. `first` is the index of
/// the first entry in `entries`, for the message.
pub fn check_l1_entries(entries: &[u8], first: u64, cluster_size: u64, file_len: u64) -> Result<(), ProbeError> {
    for (i, e) in entries.chunks_exact(8).enumerate() {
        let off = be64(e, 0) & L1_OFFSET_MASK;
        if off == 0 {
            continue;
        }
        if !off.is_multiple_of(cluster_size) {
            return Err(ProbeError::BadHeader(format!(
                "L1 entry {} points to unaligned offset {off}",
                first + i as u64
            )));
        }
        if off.checked_add(cluster_size).is_none_or(|end| end > file_len) {
            return Err(ProbeError::PastEnd { what: "L2 table", offset: off, len: cluster_size, file_len });
        }
    }
    Ok(())
}

/// Collects the leading bytes of a stream for [`probe`].
#[derive(Debug, Default)]
pub struct Prober {
    head: Vec<u8>,
    total: u64,
}

impl Prober {
    /// Feeds the next chunk of the artifact.
    pub fn feed(&mut self, chunk: &[u8]) {
        let want = PROBE_LEN.saturating_sub(self.head.len()).min(chunk.len());
        self.head.extend_from_slice(&chunk[..want]);
        self.total += chunk.len() as u64;
    }

    /// Checks what the header alone can tell (format, backing files,
    /// features, virtual size) before the rest arrives, so a refused image
    /// fails fast. Needs no total length.
    pub fn early(&self, declared: Option<DiskFormat>, limits: Limits) -> Result<(), ProbeError> {
        if let Some(name) = other_format(&self.head) {
            return Err(ProbeError::OtherFormat(name));
        }
        let qcow2 = self.head.starts_with(QCOW2_MAGIC);
        match (declared, qcow2) {
            (Some(DiskFormat::Raw), true) => {
                Err(ProbeError::FormatMismatch { declared: DiskFormat::Raw, found: DiskFormat::Qcow2 })
            }
            (Some(DiskFormat::Qcow2), false) if self.head.len() >= 4 => {
                Err(ProbeError::FormatMismatch { declared: DiskFormat::Qcow2, found: DiskFormat::Raw })
            }
            (_, true) if self.head.len() >= PROBE_LEN => parse_qcow2(&self.head, limits).map(|_| ()),
            _ => Ok(()),
        }
    }

    /// Whether the probe window is full (the early check can run).
    pub fn head_full(&self) -> bool {
        self.head.len() >= PROBE_LEN
    }

    /// Bytes seen so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The probe once the stream has ended.
    pub fn finish(&self, declared: Option<DiskFormat>, limits: Limits) -> Result<ProbeResult, ProbeError> {
        probe(&self.head, self.total, declared, limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIM: Limits = Limits { max_virtual_size: 1 << 44 };

    /// A minimal valid v3 header: 64 KiB clusters, L1 at 3 clusters, refcount table at 1.
    fn header(size: u64) -> Vec<u8> {
        let mut h = vec![0u8; 4 * 65536];
        h[0..4].copy_from_slice(QCOW2_MAGIC);
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&size.to_be_bytes());
        let l1 = size.div_ceil(65536 * 8192) as u32;
        h[36..40].copy_from_slice(&l1.to_be_bytes());
        h[40..48].copy_from_slice(&(3 * 65536u64).to_be_bytes());
        h[48..56].copy_from_slice(&65536u64.to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&104u32.to_be_bytes());
        h
    }

    fn run(h: &[u8]) -> Result<ProbeResult, ProbeError> {
        let head = &h[..h.len().min(PROBE_LEN)];
        probe(head, h.len() as u64, None, LIM)
    }

    #[test]
    fn a_valid_header_gives_format_and_virtual_size() {
        let r = run(&header(10 << 30)).expect("valid");
        assert_eq!(r, ProbeResult { format: DiskFormat::Qcow2, virtual_size: 10 << 30, cluster_size: 65536 });
    }

    #[test]
    fn a_backing_file_is_refused_with_its_name() {
        let mut h = header(1 << 20);
        h[8..16].copy_from_slice(&512u64.to_be_bytes());
        h[16..20].copy_from_slice(&9u32.to_be_bytes());
        h[512..521].copy_from_slice(b"/etc/pass");
        let e = run(&h).unwrap_err();
        assert!(matches!(&e, ProbeError::BackingFile(n) if n.contains("/etc/pass")), "{e}");
    }

    #[test]
    fn external_data_files_are_refused_by_bit_and_by_extension() {
        let mut h = header(1 << 20);
        h[72..80].copy_from_slice(&INCOMPAT_DATA_FILE.to_be_bytes());
        assert_eq!(run(&h), Err(ProbeError::ExternalDataFile));
        let mut h = header(1 << 20);
        h[104..108].copy_from_slice(&EXT_EXTERNAL_DATA_FILE.to_be_bytes());
        h[108..112].copy_from_slice(&4u32.to_be_bytes());
        assert_eq!(run(&h), Err(ProbeError::ExternalDataFile));
    }

    #[test]
    fn absurd_sizes_and_tables_past_the_end_are_refused() {
        assert!(matches!(run(&header(1 << 50)), Err(ProbeError::TooLarge { .. })));
        let mut h = header(1 << 30);
        h[40..48].copy_from_slice(&(1u64 << 40).to_be_bytes());
        assert!(matches!(run(&h), Err(ProbeError::PastEnd { what: "L1 table", .. })));
        let h = header(1 << 30);
        assert!(matches!(run(&h[..100]), Err(ProbeError::Truncated { .. })));
    }

    #[test]
    fn declared_format_must_match_the_header() {
        let h = header(1 << 20);
        let e = probe(&h[..PROBE_LEN], h.len() as u64, Some(DiskFormat::Raw), LIM).unwrap_err();
        assert!(matches!(e, ProbeError::FormatMismatch { .. }));
        let r = probe(b"plain bytes", 11, Some(DiskFormat::Raw), LIM).expect("raw");
        assert_eq!(r.virtual_size, 11);
    }

    #[test]
    fn other_formats_are_named() {
        assert_eq!(run(b"KDMV\x01\0\0\0rest"), Err(ProbeError::OtherFormat("VMDK")));
        assert_eq!(probe(b"", 0, None, LIM), Err(ProbeError::Empty));
    }

    #[test]
    fn l2_tables_past_the_end_are_caught() {
        let mut l1 = vec![0u8; 24];
        l1[8..16].copy_from_slice(&(0x8000_0000_0000_0000u64 | 5 * 65536).to_be_bytes());
        assert!(check_l1_entries(&l1, 0, 65536, 6 * 65536).is_ok());
        assert!(matches!(check_l1_entries(&l1, 0, 65536, 5 * 65536), Err(ProbeError::PastEnd { .. })));
        l1[16..24].copy_from_slice(&12345u64.to_be_bytes());
        assert!(matches!(check_l1_entries(&l1, 0, 65536, 1 << 30), Err(ProbeError::BadHeader(_))));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), total in 0u64..u64::MAX) {
            let _ = probe(&bytes, total.max(bytes.len() as u64), None, LIM);
        }

        #[test]
        fn arbitrary_qcow2_headers_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..4096), v3 in any::<bool>()) {
            if bytes.len() >= 8 {
                bytes[..4].copy_from_slice(QCOW2_MAGIC);
                bytes[4..8].copy_from_slice(&(if v3 { 3u32 } else { 2 }).to_be_bytes());
            }
            let _ = probe(&bytes, bytes.len() as u64, None, LIM);
        }

        #[test]
        fn any_single_byte_flip_in_a_valid_header_is_accepted_or_refused_cleanly(at in 0usize..512, val in any::<u8>()) {
            let mut h = header(1 << 30);
            h[at] = val;
            if let Ok(r) = run(&h) {
                // Whatever was accepted is self-consistent.
                prop_assert!(r.virtual_size <= LIM.max_virtual_size);
                if r.format == DiskFormat::Qcow2 { prop_assert!(r.cluster_size >= 512); }
            }
        }

        #[test]
        fn mutated_and_truncated_headers_are_accepted_within_limits_or_refused_with_a_message(
            muts in proptest::collection::vec((0usize..4 * 65536, any::<u8>()), 1..32),
            size in 1u64..(1 << 44),
            keep in 1usize..=4 * 65536,
        ) {
            let mut h = header(size);
            for (at, v) in muts {
                h[at] = v;
            }
            h.truncate(keep);
            let head = &h[..h.len().min(PROBE_LEN)];
            let r = probe(head, h.len() as u64, None, LIM);
            match &r {
                Ok(r) => {
                    prop_assert!(r.virtual_size <= LIM.max_virtual_size);
                    if r.format == DiskFormat::Qcow2 {
                        prop_assert!(r.cluster_size.is_power_of_two() && (512..=2 << 20).contains(&r.cluster_size));
                    }
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            if let (Ok(ok), Some((off, n))) = (&r, l1_location(head)) {
                let start = (off as usize).min(h.len());
                let len = (n.saturating_mul(8) as usize).min(h.len() - start);
                let _ = check_l1_entries(&h[start..start + len - len % 8], 0, ok.cluster_size.max(512), h.len() as u64);
            }
            let mut p = Prober::default();
            p.feed(&h);
            prop_assert_eq!(p.finish(None, LIM), r);
        }

        #[test]
        fn the_streaming_prober_agrees_with_one_shot_probing(split in proptest::collection::vec(1usize..70_000, 1..8)) {
            let h = header(3 << 30);
            let mut p = Prober::default();
            let mut at = 0;
            for s in split { let end = (at + s).min(h.len()); p.feed(&h[at..end]); at = end; }
            p.feed(&h[at..]);
            prop_assert_eq!(p.finish(None, LIM), run(&h));
        }
    }
}
