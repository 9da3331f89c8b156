//! The dirty-region log of a replicated volume's primary (sans-IO): which
//! regions each copy may lack, and the record persisted beside the catalog
//! ([`DrlRecord`]) that survives a restart of the primary. The design and
//! why are in docs/design/replication-volumes.md ("Resync").
//!
//! The volume is cut into regions of [`region_size`] bytes. In memory each
//! region holds `mark` = 1 + the `seq` of the last write frame that touched
//! it in this stream (0: not written since the volume opened; 1: dirty from
//! before the volume opened, read from the record). A copy has acknowledged
//! a flush numbered `F` when every frame below `F` is durable on it, so the
//! regions it may lack are those with `mark > F`. The record persists the
//! union of what every tracked copy may lack, as a bitmap; it only ever
//! gains a bit before the write that dirties that region is answered.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Smallest region: 1 MiB.
pub const MIN_REGION: u64 = 1 << 20;
/// Most regions a volume is cut into (the bitmap is at most 128 KiB).
pub const MAX_REGIONS: u64 = 1 << 20;

/// The region size of a volume of `size` bytes: 1 MiB, or the power of two
/// that keeps the count at most [`MAX_REGIONS`] (1 MiB up to 1 TiB).
pub fn region_size(size: u64) -> u64 {
    let mut r = MIN_REGION;
    while size.div_ceil(r) > MAX_REGIONS {
        r *= 2;
    }
    r
}

/// The regions `[offset, offset + len)` of a volume of `size` bytes touches.
pub fn regions_of(size: u64, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
    let region = region_size(size);
    if len == 0 || size == 0 {
        #[allow(clippy::reversed_empty_ranges)]
        return 1..=0;
    }
    (offset / region)..=((offset + len - 1) / region).min((size - 1) / region)
}

/// What the primary persists of its volume's replication, in its own table
/// of the metadata store (so it never races the catalog's commits).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrlRecord {
    /// Set (durably) when the primary opens the volume, before any write is
    /// answered; cleared on a clean close. Found set at open: the last stop
    /// was unclean, so no copy can be trusted to hold every answered write.
    pub open: bool,
    /// Region size in bytes the bitmap counts in.
    pub region: u64,
    /// Regions some tracked copy may lack, one bit each (LSB first), hex.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bits: String,
    /// At a clean close: the replicas that held every write (live, and their
    /// last flush covered everything). Meaningless while `open`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub in_sync: Vec<String>,
    /// Replicas whose history the bitmap does not cover (copies that were
    /// behind when this node became primary, or records older than the
    /// log): they get a full copy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub untracked: Vec<String>,
    /// The incarnation of each replica's copy as the primary last knew it
    /// (`VolumeRec::incarnation`): a copy found to be another one gets a
    /// full copy whatever the bitmap says.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub incarnations: std::collections::BTreeMap<String, u64>,
}

impl DrlRecord {
    /// A fresh volume: every copy empty, so every copy in sync.
    pub fn fresh(size: u64, replicas: &[String]) -> Self {
        DrlRecord { region: region_size(size), in_sync: replicas.to_vec(), ..Default::default() }
    }

    /// The regions of the bitmap (empty when the region size changed).
    pub fn regions(&self, size: u64) -> BTreeSet<u64> {
        if self.region != region_size(size) {
            return BTreeSet::new();
        }
        decode_bits(&self.bits)
    }
}

/// How a primary starts its replicas when it opens a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Replicas out of the live set at the start, with what they hold.
    pub behind: Vec<(String, History)>,
    /// Regions dirty from before the open.
    pub inherited: BTreeSet<u64>,
    /// The last stop was unclean (the mark was found set).
    pub unclean: bool,
}

/// The start of a volume of `size` bytes with `replicas`, of which `stale`
/// are recorded stale, given the record `prev` found at open:
/// - no record (written before the log existed): no replica's history is
///   known, every one gets a full copy;
/// - the mark set (an unclean stop): no replica is trusted to hold every
///   answered write; each copies the regions of the bitmap (a full copy for
///   those the bitmap does not cover);
/// - a clean stop: the replicas in sync then and not stale since are live,
///   the others copy the bitmap's regions (or everything, untracked).
pub fn plan(prev: Option<&DrlRecord>, size: u64, replicas: &[String], stale: &[String]) -> Plan {
    let Some(prev) = prev else {
        let behind = replicas.iter().map(|r| (r.clone(), History::Unknown)).collect();
        return Plan { behind, inherited: BTreeSet::new(), unclean: false };
    };
    let inherited = prev.regions(size);
    // A bitmap of another region size says nothing: full copies.
    let known = prev.region == region_size(size);
    let mut behind = Vec::new();
    for r in replicas {
        let history = if !known || prev.untracked.contains(r) { History::Unknown } else { History::Acked(0) };
        let live = !prev.open && prev.in_sync.contains(r) && !stale.contains(r) && known;
        if !live {
            behind.push((r.clone(), history));
        }
    }
    Plan { behind, inherited, unclean: prev.open }
}

fn decode_bits(hex: &str) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        let byte = std::str::from_utf8(pair).ok().and_then(|s| u8::from_str_radix(s, 16).ok()).unwrap_or(0xFF);
        for b in 0..8 {
            if byte & (1 << b) != 0 {
                out.insert(i as u64 * 8 + b);
            }
        }
    }
    out
}

/// The hex bitmap of `regions`.
pub fn encode_bits(regions: impl IntoIterator<Item = u64>) -> String {
    let mut bytes: Vec<u8> = Vec::new();
    for g in regions {
        let i = (g / 8) as usize;
        if bytes.len() <= i {
            bytes.resize(i + 1, 0);
        }
        bytes[i] |= 1 << (g % 8);
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Where a copy stands with respect to the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum History {
    /// Every frame below this `seq` is durable on the copy (0: it may lack
    /// every region dirty from before the volume opened).
    Acked(u64),
    /// Unknown since when: the copy needs every region.
    Unknown,
}

/// The in-memory log: a mark per region (see the module doc).
#[derive(Debug, Clone)]
pub struct Drl {
    region: u64,
    size: u64,
    marks: Vec<u64>,
}

impl Drl {
    /// A log for a volume of `size` bytes, with `inherited` regions dirty
    /// from before it opened.
    pub fn new(size: u64, inherited: &BTreeSet<u64>) -> Self {
        let region = region_size(size);
        let mut marks = vec![0; size.div_ceil(region) as usize];
        for &g in inherited {
            if let Some(m) = marks.get_mut(g as usize) {
                *m = 1;
            }
        }
        Drl { region, size, marks }
    }

    pub fn region(&self) -> u64 {
        self.region
    }

    pub fn count(&self) -> u64 {
        self.marks.len() as u64
    }

    /// Byte range of region `g`.
    pub fn span(&self, g: u64) -> (u64, u64) {
        let start = g * self.region;
        (start, self.region.min(self.size - start))
    }

    /// The regions `[offset, offset + len)` touches.
    pub fn regions_of(&self, offset: u64, len: u64) -> std::ops::RangeInclusive<u64> {
        regions_of(self.size, offset, len)
    }

    /// The volume grew to `size` bytes. The regions past the old end read
    /// as zeroes on every copy (a copy that missed the growth grows itself
    /// before it catches up), so they start unmarked. When the region size
    /// grows with the volume (past 1 TiB), each new region takes the
    /// highest mark of the old regions it covers; gives the number of old
    /// regions per new one, to convert sets of regions kept elsewhere.
    pub fn grow(&mut self, size: u64) -> u64 {
        if size <= self.size {
            return 1;
        }
        let region = region_size(size);
        let k = region / self.region;
        let mut marks = vec![0; size.div_ceil(region) as usize];
        for (g, m) in self.marks.iter().enumerate() {
            let n = &mut marks[g / k as usize];
            *n = (*n).max(*m);
        }
        (self.region, self.size, self.marks) = (region, size, marks);
        k
    }

    /// Frame `seq` writes `[offset, offset + len)`: marks its regions.
    pub fn mark(&mut self, offset: u64, len: u64, seq: u64) {
        for g in self.regions_of(offset, len) {
            self.marks[g as usize] = seq + 1;
        }
    }

    /// The regions a copy at `h` may lack.
    pub fn dirty(&self, h: History) -> Vec<u64> {
        match h {
            History::Unknown => (0..self.count()).collect(),
            History::Acked(f) => {
                self.marks.iter().enumerate().filter(|(_, m)| **m > f).map(|(g, _)| g as u64).collect()
            }
        }
    }

    /// Bytes of `regions`.
    pub fn bytes(&self, regions: &[u64]) -> u64 {
        regions.iter().map(|&g| self.span(g).1).sum()
    }

    /// The regions the record must hold for copies at `histories` (the
    /// union of what each may lack; unknown histories are recorded apart).
    pub fn union(&self, histories: impl IntoIterator<Item = History>) -> BTreeSet<u64> {
        let low = histories
            .into_iter()
            .filter_map(|h| match h {
                History::Acked(f) => Some(f),
                History::Unknown => None,
            })
            .min();
        match low {
            Some(f) => self.dirty(History::Acked(f)).into_iter().collect(),
            None => BTreeSet::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_one_mebibyte_up_to_a_tebibyte_and_the_bitmap_stays_small() {
        assert_eq!(region_size(1), MIN_REGION);
        assert_eq!(region_size(1 << 40), MIN_REGION);
        assert_eq!(region_size((1 << 40) + 1), 2 * MIN_REGION);
        assert_eq!(region_size(1 << 50), 1 << 30);
        assert!((1u64 << 50).div_ceil(region_size(1 << 50)) <= MAX_REGIONS);
    }

    #[test]
    fn a_bitmap_reads_back_as_the_regions_written() {
        let set: BTreeSet<u64> = [0, 7, 8, 1000].into_iter().collect();
        let rec = DrlRecord { region: MIN_REGION, bits: encode_bits(set.clone()), ..Default::default() };
        assert_eq!(rec.regions(1 << 30), set);
        assert!(rec.regions(1 << 50).is_empty(), "another region size makes the bitmap meaningless");
        assert_eq!(encode_bits([]), "");
    }

    #[test]
    fn a_copy_lacks_exactly_the_regions_written_since_its_last_acknowledged_flush() {
        let mut d = Drl::new(8 << 20, &[5].into_iter().collect());
        // Frame 1 writes 1.5 MiB from 0.5 MiB: regions 0 and 1.
        assert_eq!(d.regions_of(1 << 19, 3 << 19), 0..=1);
        d.mark(1 << 19, 3 << 19, 1);
        d.mark((7 << 20) + 5, 1, 2);
        assert!(d.regions_of(5, 0).is_empty());
        // A flush numbered 3 covers frames 1 and 2; frame 4 comes after it.
        d.mark(0, 1, 4);
        assert_eq!(d.dirty(History::Acked(3)), vec![0]);
        assert_eq!(d.dirty(History::Acked(0)), vec![0, 1, 5, 7], "inherited region 5 too");
        assert_eq!(d.dirty(History::Acked(1)), vec![0, 1, 7]);
        assert_eq!(d.dirty(History::Unknown).len(), 8);
        assert_eq!(d.union([History::Acked(3), History::Unknown]), [0].into_iter().collect());
        assert_eq!(d.union([History::Acked(3), History::Acked(1)]), [0, 1, 7].into_iter().collect());
        assert_eq!(d.span(7), (7 << 20, 1 << 20));
        assert_eq!(d.bytes(&[0, 1]), 2 << 20);
    }

    #[test]
    fn after_an_unclean_stop_no_replica_starts_live() {
        let reps = ["n2".to_owned(), "n3".to_owned()];
        let clean =
            DrlRecord { region: MIN_REGION, bits: encode_bits([3]), in_sync: vec!["n2".into()], ..Default::default() };
        let p = plan(Some(&clean), 8 << 20, &reps, &[]);
        assert_eq!(p.behind, vec![("n3".to_owned(), History::Acked(0))], "n2 was in sync at the clean close");
        assert_eq!(p.inherited, [3].into_iter().collect());
        assert!(!p.unclean);
        let p = plan(Some(&clean), 8 << 20, &reps, &["n2".to_owned()]);
        assert_eq!(p.behind.len(), 2, "a replica recorded stale is not live");
        let crashed = DrlRecord { open: true, untracked: vec!["n3".into()], ..clean.clone() };
        let p = plan(Some(&crashed), 8 << 20, &reps, &[]);
        assert!(p.unclean);
        assert_eq!(
            p.behind,
            vec![("n2".to_owned(), History::Acked(0)), ("n3".to_owned(), History::Unknown)],
            "every replica catches up; the untracked one fully"
        );
        let p = plan(None, 8 << 20, &reps, &[]);
        assert!(p.behind.iter().all(|(_, h)| *h == History::Unknown), "no record: no known history");
        let fresh = DrlRecord::fresh(8 << 20, &reps);
        assert!(plan(Some(&fresh), 8 << 20, &reps, &[]).behind.is_empty(), "a new volume's copies are in sync");
    }

    #[test]
    fn a_grown_log_keeps_every_mark_and_the_new_regions_start_clean() {
        let mut d = Drl::new((3 << 20) + 100, &BTreeSet::new());
        d.mark(3 << 20, 100, 4);
        d.mark(0, 1, 2);
        assert_eq!(d.grow(8 << 20), 1);
        assert_eq!((d.count(), d.span(3)), (8, (3 << 20, 1 << 20)));
        assert_eq!(d.dirty(History::Acked(0)), vec![0, 3]);
        assert_eq!(d.dirty(History::Acked(3)), vec![3]);
        d.mark(7 << 20, 1, 6);
        assert_eq!(d.dirty(History::Acked(5)), vec![7], "a write past the old end is logged");
        // Past 1 TiB the regions double: the highest mark of the two it covers.
        let mut big = Drl::new(1 << 40, &BTreeSet::new());
        big.mark(3 << 20, 1, 9);
        big.mark(2 << 20, 1, 1);
        assert_eq!(big.grow((1 << 40) + 1), 2);
        assert_eq!(big.region(), 2 << 20);
        assert_eq!(big.dirty(History::Acked(5)), vec![1]);
        assert_eq!(big.dirty(History::Acked(0)), vec![1]);
        assert_eq!(big.grow(1), 1, "no shrinking");
    }

    #[test]
    fn the_last_region_of_an_unaligned_volume_is_short() {
        let d = Drl::new((3 << 20) + 100, &BTreeSet::new());
        assert_eq!(d.count(), 4);
        assert_eq!(d.span(3), (3 << 20, 100));
    }
}
