//! The "CoronaFS, N copies" row: the CoronaFS block jobs against a volume
//! made with several copies, run in every iteration right after the
//! single-copy row, and each job's ratio to it.
//!
//! The ratio of a job is the median over iterations of that iteration's
//! replicated figure over the same iteration's single-copy figure: the two
//! runs are back to back, so drift of the host's load between iterations
//! falls on both sides of each ratio.

use super::Block;
use super::measure::BlockRun;
use crate::stats::Summary;
use serde::Serialize;

/// One job's figure with one copy and with several, and their ratio.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CopyRatio {
    /// The figure's key in [`Block`] (e.g. `depth32_write_mib_s`).
    pub figure: String,
    /// Median of the single-copy CoronaFS row.
    pub one_copy: f64,
    /// Median of the replicated row.
    pub copies: f64,
    /// Median over iterations of replicated / single copy.
    pub ratio: f64,
}

/// The replicated CoronaFS row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Replicated {
    /// Copies of the volume, the primary's included.
    pub copies: usize,
    /// Copies that must be live for writes and flushes.
    pub write_quorum: usize,
    /// Where the copies are and what links them.
    pub placement: String,
    pub block: Block,
    /// Per job, against the single-copy CoronaFS row of the same run.
    pub ratios: Vec<CopyRatio>,
}

/// Reads one figure of a [`BlockRun`].
pub type Figure = fn(&BlockRun) -> f64;

/// The five figures of a [`BlockRun`], by their key in [`Block`].
pub const FIGURES: [(&str, Figure); 5] = [
    ("seq_write_mib_s", |r| r.seq_write_mib_s),
    ("seq_read_mib_s", |r| r.seq_read_mib_s),
    ("rand_read_4k_iops", |r| r.rand_read_4k_iops),
    ("depth32_write_mib_s", |r| r.depth32_write_mib_s),
    ("depth32_read_mib_s", |r| r.depth32_read_mib_s),
];

/// Each figure's ratio, iteration by iteration (`one[i]` and `many[i]` ran
/// back to back). Iterations missing on either side are left out.
pub fn ratios(one: &[BlockRun], many: &[BlockRun]) -> Vec<CopyRatio> {
    FIGURES
        .iter()
        .map(|(key, f)| {
            let pairs: Vec<f64> = one.iter().zip(many).map(|(a, b)| f(b) / f(a).max(1e-9)).collect();
            let median = |v: Vec<f64>| Summary::of(&v).median;
            CopyRatio {
                figure: (*key).into(),
                one_copy: median(one.iter().map(f).collect()),
                copies: median(many.iter().map(f).collect()),
                ratio: median(pairs),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(x: f64) -> BlockRun {
        BlockRun {
            seq_write_mib_s: x,
            seq_read_mib_s: 2.0 * x,
            rand_read_4k_iops: 100.0 * x,
            depth32_write_mib_s: x / 2.0,
            depth32_read_mib_s: 3.0 * x,
        }
    }

    #[test]
    fn one_iteration_gives_each_figure_the_plain_ratio_of_its_two_runs() {
        let r = ratios(&[run(100.0)], &[run(60.0)]);
        assert_eq!(r.len(), 5);
        for c in &r {
            assert!((c.ratio - 0.6).abs() < 1e-12, "{c:?}");
            assert!((c.copies / c.one_copy - c.ratio).abs() < 1e-12, "{c:?}");
        }
        assert_eq!(r[3].figure, "depth32_write_mib_s");
        assert_eq!((r[3].one_copy, r[3].copies), (50.0, 30.0));
    }

    #[test]
    fn ratios_pair_runs_of_the_same_iteration_so_load_drift_cancels() {
        // The host slows down by half in iteration 2; both sides see it.
        let r = ratios(&[run(100.0), run(50.0), run(100.0)], &[run(70.0), run(35.0), run(70.0)]);
        for c in &r {
            assert!((c.ratio - 0.7).abs() < 1e-12, "{c:?}");
        }
    }

    #[test]
    fn a_zero_single_copy_figure_gives_no_infinite_ratio() {
        let r = ratios(&[BlockRun::default()], &[run(1.0)]);
        assert!(r.iter().all(|c| c.ratio.is_finite()), "{r:?}");
    }
}
