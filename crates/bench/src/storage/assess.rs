//! The Assessment: every ratio the seed report states, computed from this
//! run's medians (and a few more that the same figures allow), plus the VM
//! image path's targets as a percentage of each target (>= 100 % is met). A ratio whose
//! inputs were not measured is left out, not guessed.

use super::{Ratio, Report};

fn ratio(out: &mut Vec<Ratio>, key: &str, num: Option<f64>, den: Option<f64>, text: impl Fn(f64) -> String) {
    if let (Some(n), Some(d)) = (num, den)
        && d > 0.0
        && n.is_finite()
    {
        let pct = 100.0 * n / d;
        out.push(Ratio { key: key.into(), pct, text: text(pct) });
    }
}

/// The assessment ratios of a report.
pub fn ratios(r: &Report) -> Vec<Ratio> {
    let mut v = Vec::new();
    let local = r.local_disk.get();
    let cor = r.coronafs.get();
    let tcp = r.network.get().map(|n| n.tcp_mib_s.median);
    let large = r.s3_large_object.get();
    ratio(
        &mut v,
        "coronafs_seq_read_vs_local",
        cor.map(|c| c.seq_read_mib_s.median),
        local.map(|l| l.seq_read_mib_s.median),
        |p| format!("CoronaFS shared-volume sequential reads are {p:.1}% of the local-disk baseline."),
    );
    ratio(
        &mut v,
        "coronafs_rand_read_4k_vs_local",
        cor.map(|c| c.rand_read_4k_iops.median),
        local.map(|l| l.rand_read_4k_iops.median),
        |p| format!("CoronaFS 4k random reads are {p:.1}% of the local-disk baseline."),
    );
    ratio(
        &mut v,
        "cross_worker_read_vs_local_seq_read",
        r.cross_worker.get().map(|c| c.read_mib_s.median),
        local.map(|l| l.seq_read_mib_s.median),
        |p| {
            format!(
                "CoronaFS cross-worker reads are {p:.1}% of the local-disk sequential-read baseline (the signal for VM restart and migration paths)."
            )
        },
    );
    ratio(&mut v, "coronafs_seq_read_vs_tcp", cor.map(|c| c.seq_read_mib_s.median), tcp, |p| {
        format!(
            "CoronaFS sequential reads are {p:.1}% of the TCP baseline, which separates NBD/export overhead from the network's own limit."
        )
    });
    ratio(
        &mut v,
        "coronafs_depth32_read_vs_local",
        cor.map(|c| c.depth32_read_mib_s.median),
        local.map(|l| l.depth32_read_mib_s.median),
        |p| {
            format!(
                "CoronaFS depth-32 reads are {p:.1}% of the local depth-32 baseline (a proxy for queued guest I/O)."
            )
        },
    );
    ratio(
        &mut v,
        "coronafs_seq_write_vs_local",
        cor.map(|c| c.seq_write_mib_s.median),
        local.map(|l| l.seq_write_mib_s.median),
        |p| format!("CoronaFS sequential writes are {p:.1}% of the local-disk baseline."),
    );
    ratio(
        &mut v,
        "coronafs_depth32_write_vs_local",
        cor.map(|c| c.depth32_write_mib_s.median),
        local.map(|l| l.depth32_write_mib_s.median),
        |p| format!("CoronaFS depth-32 writes are {p:.1}% of the local depth-32 baseline."),
    );
    ratio(&mut v, "s3_large_download_vs_tcp", large.map(|l| l.download_mib_s.median), tcp, |p| {
        format!(
            "LightningStor large-object downloads are {p:.1}% of the TCP baseline: the headroom lost above the raw network path."
        )
    });
    ratio(&mut v, "s3_large_upload_vs_tcp", large.map(|l| l.upload_mib_s.median), tcp, |p| {
        format!("LightningStor large-object uploads are {p:.1}% of the TCP baseline.")
    });
    ratio(
        &mut v,
        "s3_parallel_vs_serial_put_rate",
        r.s3_parallel_batch.get().map(|p| p.put_per_s.median),
        r.s3_small_batch.get().map(|b| b.put_per_s.median),
        |p| {
            format!(
                "{} reach {p:.0}% of the single-client PUT rate.",
                crate::text::count(r.s3_parallel_batch.get().map_or(0, |x| x.jobs), "parallel job")
            )
        },
    );
    ratio(
        &mut v,
        "s3_parallel_vs_serial_get_rate",
        r.s3_parallel_batch.get().map(|p| p.get_per_s.median),
        r.s3_small_batch.get().map(|b| b.get_per_s.median),
        |p| {
            format!(
                "{} reach {p:.0}% of the single-client GET rate.",
                crate::text::count(r.s3_parallel_batch.get().map_or(0, |x| x.jobs), "parallel job")
            )
        },
    );
    if let Some(vm) = r.vm_image.get() {
        for t in &vm.targets {
            v.push(Ratio {
                key: format!("vm_{}", t.key),
                pct: 100.0 * t.ratio,
                text: format!(
                    "{} (target {}): {:.1}% of the target, {}.",
                    t.what,
                    t.target,
                    100.0 * t.ratio,
                    if t.met { "met" } else { "missed" }
                ),
            });
        }
    }
    v
}
