//! A latency histogram with bounded relative error: exact below 128 ns, then
//! 64 linear sub-buckets per power of two (under 1.6 % error), so millions of
//! operations cost a fixed 30 KiB and merging two is an element-wise sum.

/// Sub-buckets per power of two.
const SUB: u64 = 64;
/// Buckets needed to cover every `u64`.
const BUCKETS: usize = (SUB as usize) * 59;

/// Counts of latencies in nanoseconds. Serialised sparsely (only non-empty
/// buckets), so an agent can send its raw counts for the coordinator to merge.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "Sparse", try_from = "Sparse")]
pub struct Histogram {
    counts: Box<[u64]>,
    count: u64,
    sum: u128,
    max: u64,
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Histogram").field("count", &self.count).field("max", &self.max).finish()
    }
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: vec![0; BUCKETS].into_boxed_slice(), count: 0, sum: 0, max: 0 }
    }
}

fn index(v: u64) -> usize {
    if v < 2 * SUB {
        return v as usize;
    }
    let shift = 63 - v.leading_zeros() as u64 - 6;
    (SUB * shift + (v >> shift)) as usize
}

/// The middle of the values that land in bucket `i`.
fn value(i: usize) -> u64 {
    let i = i as u64;
    if i < 2 * SUB {
        return i;
    }
    let shift = i / SUB - 1;
    let low = (i - SUB * shift) << shift;
    low + (1u64 << shift) / 2
}

/// The wire form: `[bucket, count]` pairs of the non-empty buckets.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct Sparse {
    buckets: Vec<(u32, u64)>,
    sum_ns: u64,
    max_ns: u64,
}

impl From<Histogram> for Sparse {
    fn from(h: Histogram) -> Sparse {
        let buckets = h.counts.iter().enumerate().filter(|(_, c)| **c > 0).map(|(i, c)| (i as u32, *c)).collect();
        Sparse { buckets, sum_ns: u64::try_from(h.sum).unwrap_or(u64::MAX), max_ns: h.max }
    }
}

impl TryFrom<Sparse> for Histogram {
    type Error = String;
    fn try_from(s: Sparse) -> Result<Histogram, String> {
        let mut h = Histogram::default();
        for (i, c) in s.buckets {
            let slot = h.counts.get_mut(i as usize).ok_or_else(|| format!("histogram bucket {i} out of range"))?;
            *slot = slot.checked_add(c).ok_or("histogram count overflows")?;
            h.count = h.count.checked_add(c).ok_or("histogram count overflows")?;
        }
        h.sum = u128::from(s.sum_ns);
        h.max = s.max_ns;
        Ok(h)
    }
}

impl Histogram {
    pub fn record(&mut self, ns: u64) {
        self.counts[index(ns)] += 1;
        self.count += 1;
        self.sum += u128::from(ns);
        self.max = self.max.max(ns);
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.sum as f64 / self.count as f64 }
    }

    /// The value at percentile `p` (0-100), in nanoseconds; 0 when empty.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let rank = ((p / 100.0) * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return value(i).min(self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn percentiles_of_a_uniform_spread() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let near = |got: u64, want: u64| (got as f64 - want as f64).abs() / want as f64 <= 0.02;
        assert!(near(h.percentile(50.0), 5_000_000), "{}", h.percentile(50.0));
        assert!(near(h.percentile(99.0), 9_900_000), "{}", h.percentile(99.0));
        assert!((h.mean() - 5_000_500.0).abs() < 1.0);
        assert_eq!(h.count(), 10_000);
        assert_eq!(Histogram::default().percentile(50.0), 0);
    }

    #[test]
    fn merging_adds_counts() {
        let (mut a, mut b) = (Histogram::default(), Histogram::default());
        a.record(100);
        b.record(1_000_000);
        a.merge(&b);
        assert_eq!(a.count(), 2);
        assert_eq!(a.percentile(100.0), 1_000_000);
        assert_eq!(a.percentile(50.0), 100);
    }

    #[test]
    fn a_histogram_survives_json_and_refuses_bad_buckets() {
        let mut h = Histogram::default();
        for v in [5u64, 5, 900, 1_000_000, 7_000_000_000] {
            h.record(v);
        }
        let text = serde_json::to_string(&h).unwrap();
        let back: Histogram = serde_json::from_str(&text).unwrap();
        assert!(back == h);
        assert_eq!(back.percentile(99.0), h.percentile(99.0));
        let bad = r#"{"buckets":[[999999,1]],"sum_ns":1,"max_ns":1}"#;
        assert!(serde_json::from_str::<Histogram>(bad).is_err());
    }

    proptest! {
        #[test]
        fn every_value_lands_in_a_bucket_within_two_percent(v in any::<u64>()) {
            let i = index(v);
            prop_assert!(i < BUCKETS);
            let m = value(i);
            prop_assert!((m as f64 - v as f64).abs() <= v as f64 * 0.016 + 1.0, "{v} -> {m}");
        }

        #[test]
        fn buckets_are_ordered(a in any::<u64>(), b in any::<u64>()) {
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(index(lo) <= index(hi));
        }
    }
}
