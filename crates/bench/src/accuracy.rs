//! Accuracy: our load generator against fio on the same target in the same
//! run. Each job of the block profiles runs with both, the two interleaved
//! (alternating which goes first) so drift falls on both alike; the median
//! of the per-iteration ours/fio IOPS ratios is judged against a tolerance.

use crate::fio::{FioResult, FioTarget};
use crate::job::Job;
use crate::loadgen::{Limits, Opened};
use crate::target::{S3Keys, TargetSpec};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// What to compare.
#[derive(Debug, Clone)]
pub struct Options {
    /// NBD URI or file; `None` starts a CoronaFS export in this process.
    pub target: Option<String>,
    pub profiles: Vec<String>,
    pub runtime: Duration,
    pub size: u64,
    pub tolerance_pct: f64,
    pub iterations: usize,
    /// Only jobs whose name contains one of these (all when empty).
    pub only: Vec<String>,
    /// Emulated link in front of the target, so the target (not either
    /// load generator's CPU) is what limits the figures.
    pub link: crate::shaper::LinkSpec,
}

/// One compared figure.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub profile: String,
    pub job: String,
    pub side: &'static str,
    pub ours_iops: Vec<f64>,
    pub fio_iops: Vec<f64>,
    pub ratio: f64,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    pub target: String,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn failures(&self, tol: f64) -> usize {
        self.rows.iter().filter(|r| !within(r.ratio, tol)).count()
    }
}

fn within(ratio: f64, tol: f64) -> bool {
    (ratio - 1.0).abs() * 100.0 <= tol
}

fn median(v: &[f64]) -> f64 {
    crate::stats::Summary::of(v).median
}

/// A runtime that may be dropped from async code (shuts down in the background).
struct BgRuntime(Option<tokio::runtime::Runtime>);

impl BgRuntime {
    fn handle(&self) -> tokio::runtime::Handle {
        match &self.0 {
            Some(rt) => rt.handle().clone(),
            None => tokio::runtime::Handle::current(),
        }
    }
}

impl Drop for BgRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Runs the comparison.
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    let mut own = None;
    let spec = match &opts.target {
        Some(t) => TargetSpec::parse(t)?,
        None => {
            // The export runs on its own runtime so it does not share worker
            // threads with our load generator (fio gets its own process too).
            let dir = tempfile::tempdir()?;
            let srt =
                BgRuntime(Some(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?));
            let cfg = coronafs::server::ServerConfig::ephemeral(dir.path(), coronafs::backend::IoEngine::Uring);
            let srv = srt.handle().spawn(coronafs::server::start(cfg)).await??;
            srv.shared.exports.create("accuracy", opts.size).await?;
            let ep = crate::cluster::CoronaEndpoint { nbd: srv.nbd_addr.to_string(), api: srv.api_url() };
            crate::storage::measure::prefill(&ep, "accuracy", opts.size).await?;
            let spec = TargetSpec::Nbd { addr: srv.nbd_addr.to_string(), export: "accuracy".into() };
            own = Some((dir, srv, srt));
            spec
        }
    };
    let mut shaper = None;
    let spec = match spec {
        TargetSpec::Nbd { addr, export } if !opts.link.is_loopback() => {
            let sh = crate::shaper::Shaper::start(TargetSpec::nbd_addr(&addr)?, opts.link).await?;
            let addr = sh.addr.to_string();
            shaper = Some(sh);
            TargetSpec::Nbd { addr, export }
        }
        other => other,
    };
    let fio_target = match &spec {
        TargetSpec::Nbd { addr, export } => FioTarget::Nbd(format!("nbd://{addr}/{export}")),
        TargetSpec::Path(p) if p.is_dir() => anyhow::bail!("accuracy needs a file or device, not a directory"),
        TargetSpec::Path(p) => FioTarget::File(p.clone()),
        TargetSpec::S3 { .. } => anyhow::bail!("fio cannot drive S3 here; accuracy compares block targets"),
    };
    let opened = Opened::open(&spec, &S3Keys::default()).await?;
    let mut jobs: Vec<(String, Job)> = Vec::new();
    for p in &opts.profiles {
        for mut j in crate::runner::load_profile(p)?.jobs {
            if !opts.only.is_empty() && !opts.only.iter().any(|o| j.name.contains(o.as_str())) {
                continue;
            }
            j.runtime = Some(opts.runtime);
            j.size = opts.size.max(j.bs);
            j.ramp_time = Duration::ZERO;
            jobs.push((p.clone(), j));
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut raw: Vec<(Vec<(f64, f64)>, Vec<(f64, f64)>)> = vec![(Vec::new(), Vec::new()); jobs.len()];
    let result = async {
        for it in 0..opts.iterations {
            for (i, (_, job)) in jobs.iter().enumerate() {
                let ours_first = (it + i) % 2 == 0;
                let mut fio_r = (FioResult::default(), FioResult::default());
                if !ours_first {
                    fio_r = fio_job(&fio_target, job).await?;
                }
                let ours = opened.run(job, Limits::default(), stop.clone()).await?;
                if ours_first {
                    fio_r = fio_job(&fio_target, job).await?;
                }
                eprintln!(
                    "bench: accuracy {}/{} {:<24} read {:>9.0} vs fio {:>9.0} IOPS, write {:>9.0} vs fio {:>9.0} IOPS",
                    it + 1,
                    opts.iterations,
                    job.name,
                    ours.read.iops,
                    fio_r.0.iops,
                    ours.write.iops,
                    fio_r.1.iops
                );
                raw[i].0.push((ours.read.iops, fio_r.0.iops));
                raw[i].1.push((ours.write.iops, fio_r.1.iops));
            }
        }
        anyhow::Ok(())
    }
    .await;
    if let Some(sh) = shaper {
        sh.shutdown().await;
    }
    if let Some((dir, srv, srt)) = own {
        let _ = srt.handle().spawn(srv.shutdown()).await;
        drop(srt);
        drop(dir);
    }
    result?;
    let mut report = Report { target: format!("{spec} ({})", opts.link.describe()), rows: Vec::new() };
    for ((profile, job), (reads, writes)) in jobs.iter().zip(raw) {
        for (side, pairs, used) in [("read", reads, job.rw.reads()), ("write", writes, job.rw.writes())] {
            if !used {
                continue;
            }
            let ratios: Vec<f64> = pairs.iter().map(|(o, f)| if *f > 0.0 { o / f } else { 0.0 }).collect();
            report.rows.push(Row {
                profile: profile.clone(),
                job: job.name.clone(),
                side,
                ours_iops: pairs.iter().map(|p| p.0).collect(),
                fio_iops: pairs.iter().map(|p| p.1).collect(),
                ratio: median(&ratios),
            });
        }
    }
    Ok(report)
}

async fn fio_job(t: &FioTarget, job: &Job) -> anyhow::Result<(FioResult, FioResult)> {
    let (t, job) = (t.clone(), job.clone());
    tokio::task::spawn_blocking(move || crate::fio::run_job(&t, &job)).await?
}

/// The comparison as a table.
pub fn table(r: &Report, tol: f64) -> String {
    let mut s = format!(
        "## Accuracy: bench vs fio on {}\n\n| Profile | Job | Dir | ours IOPS (median) | fio IOPS (median) | ours/fio | within {tol}% |\n|---|---|---|---:|---:|---:|---|\n",
        r.target
    );
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.3} | {} |\n",
            row.profile,
            row.job,
            row.side,
            median(&row.ours_iops),
            median(&row.fio_iops),
            row.ratio,
            if within(row.ratio, tol) { "yes" } else { "NO" }
        ));
    }
    s.push_str(&format!("\n{} of {} figures outside ±{tol}%.\n", r.failures(tol), r.rows.len()));
    s
}
