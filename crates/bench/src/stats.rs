//! Summary statistics over iterations.

use serde::{Deserialize, Serialize};

/// Median and spread of one figure over several iterations. In JSON the
/// standard deviation is `null` when there is only one iteration (no
/// spread is known).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(into = "Wire", from = "Wire")]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub stddev: f64,
    pub n: usize,
}

/// The JSON form of a [`Summary`].
#[derive(Clone, Copy, Serialize, Deserialize)]
struct Wire {
    median: f64,
    min: f64,
    max: f64,
    mean: f64,
    stddev: Option<f64>,
    n: usize,
}

impl From<Summary> for Wire {
    fn from(s: Summary) -> Wire {
        Wire { median: s.median, min: s.min, max: s.max, mean: s.mean, stddev: (s.n > 1).then_some(s.stddev), n: s.n }
    }
}

impl From<Wire> for Summary {
    fn from(w: Wire) -> Summary {
        Summary { median: w.median, min: w.min, max: w.max, mean: w.mean, stddev: w.stddev.unwrap_or(0.0), n: w.n }
    }
}

impl Summary {
    pub fn of(values: &[f64]) -> Summary {
        let n = values.len();
        if n == 0 {
            return Summary { median: 0.0, min: 0.0, max: 0.0, mean: 0.0, stddev: 0.0, n };
        }
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = if n > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64 } else { 0.0 };
        Summary { median, min: v[0], max: v[n - 1], mean, stddev: var.sqrt(), n }
    }

    /// The per-iteration ratios `ours[i] / theirs[i]` of two series whose
    /// i-th runs ran back to back, summarised (iterations where the peer
    /// measured nothing are left out).
    pub fn paired_ratios(ours: &[f64], theirs: &[f64]) -> Summary {
        let r: Vec<f64> = ours.iter().zip(theirs).filter(|(_, t)| **t > 0.0).map(|(o, t)| o / t).collect();
        Summary::of(&r)
    }

    /// Spread as a percentage of the median ((max - min) / median).
    pub fn spread_pct(&self) -> f64 {
        if self.median == 0.0 { 0.0 } else { 100.0 * (self.max - self.min) / self.median }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_spread_of_odd_and_even_samples() {
        let s = Summary::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.mean), (2.0, 1.0, 3.0, 2.0));
        assert!((s.stddev - 1.0).abs() < 1e-9);
        assert_eq!(Summary::of(&[4.0, 1.0, 2.0, 3.0]).median, 2.5);
        assert!((Summary::of(&[90.0, 100.0, 110.0]).spread_pct() - 20.0).abs() < 1e-9);
        assert_eq!(Summary::of(&[]).n, 0);
    }

    #[test]
    fn one_iteration_has_no_spread_in_json() {
        let one = serde_json::to_value(Summary::of(&[5.0])).unwrap();
        assert!(one["stddev"].is_null(), "{one}");
        assert_eq!(one["n"], 1);
        let three = serde_json::to_value(Summary::of(&[1.0, 2.0, 3.0])).unwrap();
        assert_eq!(three["stddev"], 1.0);
        let back: Summary = serde_json::from_value(three).unwrap();
        assert_eq!(back, Summary::of(&[1.0, 2.0, 3.0]));
    }

    #[test]
    fn paired_ratios_follow_each_iteration_not_the_two_medians() {
        // A pinned 4k QD1 row of 2026-11-29 on a VM whose speed fell in
        // the second and third iterations: the medians (2007 / 4167) make
        // 0.48x, while the iterations' own ratios are 1.01, 0.82 and 0.48.
        let ours = [6085.0, 1659.0, 2007.0];
        let theirs = [6051.0, 2015.0, 4167.0];
        let s = Summary::paired_ratios(&ours, &theirs);
        assert_eq!(s.n, 3);
        assert!((s.median - 1659.0 / 2015.0).abs() < 1e-9, "{s:?}");
        assert!((s.min - 2007.0 / 4167.0).abs() < 1e-9, "{s:?}");
        assert!((s.max - 6085.0 / 6051.0).abs() < 1e-9, "{s:?}");
        // An iteration where the peer measured nothing is left out.
        let s = Summary::paired_ratios(&[10.0, 20.0], &[0.0, 10.0]);
        assert_eq!((s.n, s.median), (1, 2.0));
    }
}
