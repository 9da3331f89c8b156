//! The ownership map of a copy-on-write layer: one bit per granule, set when
//! the layer's own data file holds that granule (written, copied in from the
//! parent, or zeroed/trimmed in this layer). A clear bit means "read through
//! to the parent".
//!
//! Bits are only ever set while a layer is writable, so the on-disk map only
//! grows. It is written at FLUSH time, after the data file's `fdatasync`:
//! a bit on disk therefore always names granule data that is on disk too.
//!
//! On-disk format (see docs/design/volumes.md):
//!
//! ```text
//! 0      16        24           32          40                4096
//! +------+---------+------------+-----------+--- zero ---------+
//! |magic | granule | granules   | layer id  |                  |
//! +------+---------+------------+-----------+------------------+
//! 4096: bitmap, little-endian u64 words, bit g%64 of word g/64 = granule g
//! ```

use crate::backend::traits::BlockBackend;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Copy-on-write granularity (see docs/design/volumes.md for why 64 KiB).
pub const GRANULE: u64 = 64 << 10;
/// Bytes before the bitmap in a map file.
pub const HEADER: u64 = 4096;
/// Bitmap bytes written per dirty page.
const PAGE: usize = 4096;
const WORDS_PER_PAGE: usize = PAGE / 8;
const MAGIC: &[u8; 16] = b"CORONAFS-MAP-v1\0";

/// The granules covering `[offset, offset + len)` (len > 0), inclusive.
pub fn granules(offset: u64, len: u64) -> (u64, u64) {
    (offset / GRANULE, (offset + len - 1) / GRANULE)
}

/// Granules needed for a layer of `size` bytes.
pub fn count(size: u64) -> u64 {
    size.div_ceil(GRANULE)
}

/// Length in bytes of a map file for `granules` granules.
pub fn file_len(granules: u64) -> u64 {
    HEADER + (granules.div_ceil(64) * 8).div_ceil(PAGE as u64) * PAGE as u64
}

/// The header of a new, empty map file.
pub fn header(layer: u64, granules: u64) -> Vec<u8> {
    let mut h = vec![0u8; HEADER as usize];
    h[..16].copy_from_slice(MAGIC);
    h[16..24].copy_from_slice(&GRANULE.to_le_bytes());
    h[24..32].copy_from_slice(&granules.to_le_bytes());
    h[32..40].copy_from_slice(&layer.to_le_bytes());
    h
}

/// Checks a map file header; returns the granule count it was made for.
fn on_disk(h: &[u8]) -> io::Result<u64> {
    if h.len() < HEADER as usize || &h[..16] != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a CoronaFS map file (bad magic)"));
    }
    let granule = u64::from_le_bytes(h[16..24].try_into().unwrap_or_default());
    if granule != GRANULE {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("map granule {granule} is not {GRANULE}")));
    }
    Ok(u64::from_le_bytes(h[24..32].try_into().unwrap_or_default()))
}

/// An in-memory ownership bitmap with its durable shadow.
#[derive(Debug)]
pub struct GranuleMap {
    live: Vec<AtomicU64>,
    /// Bits known to be in the map file (after its fdatasync).
    durable: Vec<AtomicU64>,
    /// Pages of `live` with bits not yet written to the file.
    dirty: Vec<AtomicBool>,
    granules: u64,
}

/// Bitmap pages captured for writing: (file offset, bytes, words).
pub type Captured = Vec<(u64, Vec<u8>, Vec<u64>)>;

impl GranuleMap {
    /// A map where no granule is owned.
    pub fn empty(granules: u64) -> Self {
        let words = granules.div_ceil(64) as usize;
        GranuleMap {
            live: (0..words).map(|_| AtomicU64::new(0)).collect(),
            durable: (0..words).map(|_| AtomicU64::new(0)).collect(),
            dirty: (0..words.div_ceil(WORDS_PER_PAGE)).map(|_| AtomicBool::new(false)).collect(),
            granules,
        }
    }

    /// Reads a map file; a map file for fewer granules (the layer grew) reads
    /// the missing bits as clear.
    pub async fn load<B: BlockBackend>(file: &B, granules: u64) -> io::Result<Self> {
        let (r, h) = file.read_at(vec![0; HEADER as usize], 0).await;
        r?;
        on_disk(&h)?;
        let bytes = (granules.div_ceil(64) * 8) as usize;
        let (r, bits) = file.read_at(vec![0; bytes], HEADER).await;
        r?;
        let mut all = h;
        all.extend_from_slice(&bits);
        Self::from_bytes(&all, granules)
    }

    /// Parses a whole map file (header and bitmap; a short bitmap reads as clear).
    pub fn from_bytes(file: &[u8], granules: u64) -> io::Result<Self> {
        // The header's count is what the file was made for; a layer that grew
        // since has more bits, which read as clear until written.
        on_disk(file)?;
        let n = granules;
        let map = GranuleMap::empty(granules);
        let bits = file.get(HEADER as usize..).unwrap_or_default();
        for (i, w) in bits.chunks_exact(8).enumerate().take(n.div_ceil(64) as usize) {
            let mut v = u64::from_le_bytes(w.try_into().unwrap_or_default());
            if i as u64 == n / 64 && !n.is_multiple_of(64) {
                v &= (1u64 << (n % 64)) - 1;
            }
            map.live[i].store(v, Ordering::Relaxed);
            map.durable[i].store(v, Ordering::Relaxed);
        }
        Ok(map)
    }

    pub fn granules(&self) -> u64 {
        self.granules
    }

    pub fn owned(&self, g: u64) -> bool {
        g < self.granules && self.live[(g / 64) as usize].load(Ordering::Acquire) & (1 << (g % 64)) != 0
    }

    fn all_in(words: &[AtomicU64], g0: u64, g1: u64) -> bool {
        let mut g = g0;
        while g <= g1 {
            let w = words[(g / 64) as usize].load(Ordering::Acquire);
            let lo = g % 64;
            let hi = (g1 - (g - lo)).min(63);
            let mask = if hi - lo == 63 { u64::MAX } else { ((1u64 << (hi - lo + 1)) - 1) << lo };
            if w & mask != mask {
                return false;
            }
            g = g - lo + 64;
        }
        true
    }

    /// Whether every granule in `g0..=g1` is owned.
    pub fn all_owned(&self, g0: u64, g1: u64) -> bool {
        g1 < self.granules && Self::all_in(&self.live, g0, g1)
    }

    /// Whether every granule in `g0..=g1` is owned on disk too.
    pub fn all_durable(&self, g0: u64, g1: u64) -> bool {
        g1 < self.granules && Self::all_in(&self.durable, g0, g1)
    }

    /// Marks granule `g` owned. Call only once its data is in the data file.
    pub fn set(&self, g: u64) {
        if g >= self.granules {
            return;
        }
        let w = (g / 64) as usize;
        self.live[w].fetch_or(1 << (g % 64), Ordering::AcqRel);
        self.dirty[w / WORDS_PER_PAGE].store(true, Ordering::Release);
    }

    /// Number of owned granules.
    pub fn owned_count(&self) -> u64 {
        self.live.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }

    /// Takes the dirty pages, as they are now. Bits set later stay dirty for
    /// the next flush.
    pub fn capture(&self) -> Captured {
        let mut out = Vec::new();
        for (p, d) in self.dirty.iter().enumerate() {
            if !d.swap(false, Ordering::AcqRel) {
                continue;
            }
            let lo = p * WORDS_PER_PAGE;
            let hi = (lo + WORDS_PER_PAGE).min(self.live.len());
            let words: Vec<u64> = self.live[lo..hi].iter().map(|w| w.load(Ordering::Acquire)).collect();
            let bytes = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            out.push((HEADER + (lo * 8) as u64, bytes, words));
        }
        out
    }

    /// The captured pages are in the file: remember them as durable.
    pub fn mark_durable(&self, pages: &Captured) {
        for (off, _, words) in pages {
            let lo = ((off - HEADER) / 8) as usize;
            for (i, w) in words.iter().enumerate() {
                self.durable[lo + i].fetch_or(*w, Ordering::AcqRel);
            }
        }
    }

    /// Writing the captured pages failed: they are dirty again.
    pub fn redirty(&self, pages: &Captured) {
        for (off, _, _) in pages {
            let lo = ((off - HEADER) / 8) as usize;
            self.dirty[lo / WORDS_PER_PAGE].store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemBackend;

    #[test]
    fn ranges_of_bits_are_checked_across_words() {
        let m = GranuleMap::empty(200);
        for g in 60..=130 {
            m.set(g);
        }
        assert!(m.all_owned(60, 130));
        assert!(m.all_owned(64, 127));
        assert!(!m.all_owned(59, 130));
        assert!(!m.all_owned(60, 131));
        assert!(!m.all_owned(0, 0));
        assert!(!m.all_owned(199, 200), "past the end is never owned");
        assert_eq!(m.owned_count(), 71);
        assert!(!m.all_durable(60, 60));
    }

    #[tokio::test]
    async fn captured_pages_round_trip_through_a_file() {
        let granules = 70_000; // more than one bitmap page
        let file = MemBackend::new(file_len(granules));
        let (r, _) = file.write_at(header(7, granules), 0, false).await;
        r.expect("header");
        let m = GranuleMap::empty(granules);
        for g in [0, 63, 64, 40_000, 69_999] {
            m.set(g);
        }
        let pages = m.capture();
        assert_eq!(pages.len(), 3, "three dirty pages");
        for (off, bytes, _) in &pages {
            let (r, _) = file.write_at(bytes.clone(), *off, false).await;
            r.expect("page");
        }
        m.mark_durable(&pages);
        assert!(m.all_durable(63, 64));
        assert!(m.capture().is_empty(), "nothing dirty after a capture");
        let back = GranuleMap::load(&file, granules).await.expect("load");
        for g in [0, 63, 64, 40_000, 69_999] {
            assert!(back.owned(g), "granule {g}");
        }
        assert_eq!(back.owned_count(), 5);
        // A grown layer sees the old bits and clear new ones.
        let grown = GranuleMap::load(&file, granules + 100).await.expect("load grown");
        assert_eq!(grown.owned_count(), 5);
        let mut bad = header(7, granules);
        bad[0] = b'X';
        let (r, _) = file.write_at(bad, 0, false).await;
        r.expect("write");
        assert!(GranuleMap::load(&file, granules).await.is_err(), "bad magic is refused");
    }
}
