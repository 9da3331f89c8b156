//! Ceph beside the stack (`fresh-bench-storage --peers ceph`): the block
//! section's jobs on RBD images at 3 copies and at 1 (from the same agent as
//! CoronaFS, through fio's rbd engine), and the S3 sections against radosgw
//! on a pool of 3 copies (from the same agent and client as LightningStor),
//! each interleaved with ours in every iteration. The comparisons pair what
//! is alike: CoronaFS (one copy) with RBD size 1, LightningStor (RF=3) with
//! radosgw (size 3); RBD size 3 is shown beside them for what three copies
//! cost Ceph.

use super::{Block, Objects};
use serde::Serialize;

/// What was measured on Ceph, and how it compares.
#[derive(Debug, Clone, Serialize)]
pub struct CephPeer {
    /// The cluster: version, daemons, pools, settings.
    pub ceph: String,
    pub rbd_3x: Block,
    pub rbd_1x: Block,
    pub rgw_large_object: Objects,
    pub rgw_small_batch: Objects,
    pub rgw_parallel_batch: Objects,
    pub comparisons: Vec<Comparison>,
    /// How the figures were taken.
    pub method: String,
}

/// Ours against Ceph for one figure (higher is better for every figure here).
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub figure: String,
    pub ours: String,
    pub theirs: String,
    pub ours_value: f64,
    pub theirs_value: f64,
    /// ours / theirs (medians).
    pub ratio: f64,
}

impl Comparison {
    fn new(figure: &str, ours: &str, theirs: &str, a: f64, b: f64) -> Comparison {
        Comparison {
            figure: figure.into(),
            ours: ours.into(),
            theirs: theirs.into(),
            ours_value: a,
            theirs_value: b,
            ratio: if b > 0.0 { a / b } else { 0.0 },
        }
    }
}

/// The block figures of a [`Block`], named.
fn block_figures(b: &Block) -> [(&'static str, f64); 5] {
    [
        ("1M sequential write MiB/s", b.seq_write_mib_s.median),
        ("1M sequential read MiB/s", b.seq_read_mib_s.median),
        ("4k random read IOPS", b.rand_read_4k_iops.median),
        ("QD32 write MiB/s", b.depth32_write_mib_s.median),
        ("QD32 read MiB/s", b.depth32_read_mib_s.median),
    ]
}

fn object_figures(label: &str, o: &Objects) -> Vec<(String, f64)> {
    vec![
        (format!("{label} upload MiB/s"), o.upload_mib_s.median),
        (format!("{label} download MiB/s"), o.download_mib_s.median),
    ]
}

/// CoronaFS against RBD at 1 and at 3 copies, LightningStor against radosgw.
pub fn compare(
    coronafs: Option<&Block>,
    rbd_1x: &Block,
    rbd_3x: &Block,
    ours_s3: [Option<&Objects>; 3],
    rgw: [&Objects; 3],
) -> Vec<Comparison> {
    let mut v = Vec::new();
    if let Some(c) = coronafs {
        for (theirs, rbd) in [("Ceph RBD, size 1", rbd_1x), ("Ceph RBD, size 3", rbd_3x)] {
            for ((f, a), (_, b)) in block_figures(c).into_iter().zip(block_figures(rbd)) {
                v.push(Comparison::new(f, "CoronaFS (1 copy)", theirs, a, b));
            }
        }
    }
    let labels = ["large object", "small-object batch", "parallel batch"];
    for ((label, ours), theirs) in labels.iter().zip(ours_s3).zip(rgw) {
        let Some(ours) = ours else { continue };
        for ((f, a), (_, b)) in object_figures(label, ours).into_iter().zip(object_figures(label, theirs)) {
            v.push(Comparison::new(&f, "LightningStor (RF=3)", "radosgw (size 3)", a, b));
        }
    }
    v
}

/// The figures where Ceph came out ahead (ratio below 1), said plainly.
pub fn ceph_ahead(c: &[Comparison]) -> Vec<String> {
    c.iter()
        .filter(|x| x.ratio > 0.0 && x.ratio < 1.0)
        .map(|x| {
            format!(
                "{} is ahead of {} on {}: {:.1} vs {:.1} ({:.2}x)",
                x.theirs, x.ours, x.figure, x.theirs_value, x.ours_value, x.ratio
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;

    fn block(x: f64) -> Block {
        let s = Summary::of(&[x]);
        Block {
            seq_write_mib_s: s.clone(),
            seq_read_mib_s: s.clone(),
            rand_read_4k_iops: s.clone(),
            depth32_write_mib_s: s.clone(),
            depth32_read_mib_s: s,
            size_bytes: 1,
            runtime_s: 1.0,
            measured_by: String::new(),
            o_direct: None,
            latency: Vec::new(),
        }
    }

    #[test]
    fn like_is_compared_with_like_and_a_lead_of_ceph_is_named() {
        let c = compare(
            Some(&block(100.0)),
            &block(50.0),
            &block(200.0),
            [None, None, None],
            [&objects(), &objects(), &objects()],
        );
        // Five block figures against each of the two pools; no S3 figure without ours.
        assert_eq!(c.len(), 10);
        assert!(c.iter().filter(|x| x.theirs == "Ceph RBD, size 1").all(|x| (x.ratio - 2.0).abs() < 1e-9));
        let ahead = ceph_ahead(&c);
        assert_eq!(ahead.len(), 5, "RBD size 3 at 200 is ahead of 100: {ahead:?}");
        assert!(ahead[0].contains("Ceph RBD, size 3 is ahead of CoronaFS"));
    }

    fn objects() -> Objects {
        let s = Summary::of(&[1.0]);
        Objects {
            count: 1,
            object_bytes: 1,
            jobs: 1,
            upload_mib_s: s.clone(),
            download_mib_s: s.clone(),
            put_per_s: s.clone(),
            get_per_s: s,
            nodes: 1,
            measured_by: String::new(),
            put_p50_ms: 0.0,
            put_p99_ms: 0.0,
            get_p50_ms: 0.0,
            get_p99_ms: 0.0,
            failovers: 0,
        }
    }
}
