//! Accuracy: our load generator against fio on the same target in the same
//! run. Each job runs with both, the two interleaved (alternating which goes
//! first, and every job of every target once per iteration) so drift falls
//! on both alike; the median of the per-iteration ours/fio IOPS ratios is
//! judged against a tolerance.
//!
//! Two targets can take part in one run: a block target (an NBD export,
//! by default one started in this process, or a file) for `profiles`, and a
//! directory for `dir_profiles`, where every job gets one file per numjobs
//! (ours: `bench.JOB.N` through its file engine; fio: the same files, libaio,
//! via `--filename_format`).

use crate::files::FileTarget;
use crate::fio::{FioRun, FioTarget};
use crate::job::Job;
use crate::loadgen::{Limits, Opened};
use crate::stats::Summary;
use crate::target::{S3Keys, TargetSpec};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// The default `profiles`: the four workloads of [`crate::nbd_compare::WORKLOADS`].
pub const DEFAULT_PROFILES: &str = "nbd-4";
/// The default `dir_profiles`.
pub const DEFAULT_DIR_PROFILES: &str = "seed-003";

/// What to compare.
#[derive(Debug, Clone)]
pub struct Options {
    /// NBD URI or file for `profiles`; `None` starts a CoronaFS export in
    /// this process.
    pub target: Option<String>,
    pub profiles: Vec<String>,
    /// Directory for `dir_profiles`; `None` makes a temporary one.
    pub dir: Option<PathBuf>,
    pub dir_profiles: Vec<String>,
    pub runtime: Duration,
    pub size: u64,
    pub tolerance_pct: f64,
    pub iterations: usize,
    /// Only jobs whose name contains one of these (all when empty).
    pub only: Vec<String>,
    /// Emulated link in front of an NBD target, so the target (not either
    /// load generator's CPU) is what limits the figures.
    pub link: crate::shaper::LinkSpec,
}

/// One compared figure.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// `nbd`, `file` or `dir`.
    pub target: &'static str,
    pub profile: String,
    pub job: String,
    pub side: &'static str,
    pub ours_iops: Vec<f64>,
    pub fio_iops: Vec<f64>,
    /// ours/fio per iteration.
    pub ratios: Vec<f64>,
    /// The median of `ratios`: what is judged.
    pub ratio: f64,
    /// Client CPU (user + system) per operation of the job, both
    /// directions, per iteration: where a client-bound figure's time went.
    pub ours_cpu_us_per_op: Vec<f64>,
    pub fio_cpu_us_per_op: Vec<f64>,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// Each target taking part, described.
    pub targets: Vec<String>,
    pub fio_version: String,
    pub runtime_s: f64,
    pub iterations: usize,
    /// How our file engine issued requests (see [`crate::loadgen::ENGINE_AIO`]).
    pub engines: Vec<String>,
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

/// One target both generators drive.
struct Side {
    label: &'static str,
    opened: Opened,
    fio: FioTarget,
}

/// What a run started and must stop, whatever happens in between.
#[derive(Default)]
struct Resources {
    export: Option<(tempfile::TempDir, coronafs::server::RunningServer, BgRuntime)>,
    shaper: Option<crate::shaper::Shaper>,
    sides: Vec<Side>,
    scratch: Option<tempfile::TempDir>,
}

impl Resources {
    async fn close(self) {
        for s in &self.sides {
            s.opened.cleanup();
        }
        if let Some(sh) = self.shaper {
            sh.shutdown().await;
        }
        if let Some((dir, srv, srt)) = self.export {
            let _ = srt.handle().spawn(srv.shutdown()).await;
            drop(srt);
            drop(dir);
        }
        drop(self.scratch);
    }
}

/// Starts a CoronaFS export of `size` bytes, filled with data, on a
/// runtime of its own (so it shares no worker threads with our load
/// generator; fio is a process of its own too).
async fn own_export(res: &mut Resources, size: u64) -> anyhow::Result<TargetSpec> {
    let dir = tempfile::tempdir()?;
    let srt = BgRuntime(Some(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?));
    let cfg = coronafs::server::ServerConfig::ephemeral(dir.path(), coronafs::backend::IoEngine::Uring);
    let srv = srt.handle().spawn(coronafs::server::start(cfg)).await??;
    srv.shared.exports.create("accuracy", size).await?;
    let ep = crate::cluster::CoronaEndpoint { nbd: srv.nbd_addr.to_string(), api: srv.api_url() };
    crate::storage::measure::prefill(&ep, "accuracy", size).await?;
    let spec = TargetSpec::Nbd { addr: srv.nbd_addr.to_string(), export: "accuracy".into() };
    res.export = Some((dir, srv, srt));
    Ok(spec)
}

/// Whether files under `dir` can be opened with `O_DIRECT` (tmpfs refuses).
fn direct_works(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let probe = dir.join(".bench-direct-probe");
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

fn jobs_of(opts: &Options, profile: &str, direct: bool) -> anyhow::Result<Vec<Job>> {
    let mut out = Vec::new();
    for mut j in crate::runner::load_profile(profile)?.jobs {
        if !opts.only.is_empty() && !opts.only.iter().any(|o| j.name.contains(o.as_str())) {
            continue;
        }
        j.runtime = Some(opts.runtime);
        j.size = opts.size.max(j.bs);
        j.ramp_time = Duration::ZERO;
        j.direct &= direct;
        out.push(j);
    }
    Ok(out)
}

/// Sets up the targets; returns (side index, profile, job) for every job.
async fn set_up(opts: &Options, res: &mut Resources) -> anyhow::Result<Vec<(usize, String, Job)>> {
    let mut jobs = Vec::new();
    if !opts.profiles.is_empty() {
        let spec = match &opts.target {
            Some(t) => TargetSpec::parse(t)?,
            None => own_export(res, opts.size).await?,
        };
        let (spec, shaper) = match &spec {
            TargetSpec::Nbd { .. } => crate::runner::through_link(&spec, opts.link).await?,
            TargetSpec::Path(p) if p.is_dir() => {
                anyhow::bail!("--target is for an NBD export or a file; give a directory with --dir")
            }
            TargetSpec::Path(_) if !opts.link.is_unshaped() => {
                anyhow::bail!("--link-rate/--link-delay need an NBD target, not a file")
            }
            TargetSpec::Path(_) => (spec.clone(), None),
            TargetSpec::S3 { .. } => anyhow::bail!("fio cannot drive S3 here; accuracy compares block targets"),
        };
        res.shaper = shaper;
        let (label, fio) = match &spec {
            TargetSpec::Nbd { addr, export } => ("nbd", FioTarget::Nbd(format!("nbd://{addr}/{export}"))),
            TargetSpec::Path(p) => ("file", FioTarget::File(p.clone())),
            TargetSpec::S3 { .. } => unreachable!("refused above"),
        };
        let opened = Opened::open(&spec, &S3Keys::default()).await?;
        eprintln!("bench: accuracy target {label}: {spec} ({})", opts.link.describe());
        let side = res.sides.len();
        res.sides.push(Side { label, opened, fio });
        for p in &opts.profiles {
            jobs.extend(jobs_of(opts, p, true)?.into_iter().map(|j| (side, p.clone(), j)));
        }
    }
    if !opts.dir_profiles.is_empty() {
        let dir = match &opts.dir {
            Some(d) => {
                anyhow::ensure!(d.is_dir(), "--dir {}: not a directory", d.display());
                d.clone()
            }
            None => {
                let t = tempfile::Builder::new().prefix("bench-accuracy-").tempdir()?;
                let p = t.path().to_owned();
                res.scratch = Some(t);
                p
            }
        };
        let direct = direct_works(&dir);
        if !direct {
            eprintln!("bench: {} refuses O_DIRECT; both generators run buffered there", dir.display());
        }
        let files = FileTarget::open(&dir)?;
        let side = res.sides.len();
        let mut dir_jobs = Vec::new();
        for p in &opts.dir_profiles {
            for j in jobs_of(opts, p, direct)? {
                // Lay the files out once, before either generator runs, so
                // both find the same data in the same places.
                files.prepare(&j)?;
                dir_jobs.push((side, p.clone(), j));
            }
        }
        eprintln!("bench: accuracy target dir: {} (O_DIRECT {})", dir.display(), if direct { "on" } else { "off" });
        res.sides.push(Side { label: "dir", opened: Opened::Files(files), fio: FioTarget::Dir(dir) });
        jobs.extend(dir_jobs);
    }
    anyhow::ensure!(!jobs.is_empty(), "no job to compare (check --profiles, --dir-profiles and --only)");
    Ok(jobs)
}

/// Runs the comparison.
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    let mut res = Resources::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut raw: Vec<Raw> = Vec::new();
    let result = async {
        let jobs = set_up(opts, &mut res).await?;
        raw = vec![Raw::default(); jobs.len()];
        for it in 0..opts.iterations {
            for (i, (side, _, job)) in jobs.iter().enumerate() {
                let side = &res.sides[*side];
                let ours_first = (it + i) % 2 == 0;
                let mut fio_r = FioRun::default();
                if !ours_first {
                    fio_r = fio_job(&side.fio, job).await?;
                }
                let ours = side.opened.run(job, Limits::default(), stop.clone()).await?;
                if ours_first {
                    fio_r = fio_job(&side.fio, job).await?;
                }
                let ours_ops = (ours.read.ops + ours.write.ops) as f64;
                let fio_ops = (fio_r.read.iops + fio_r.write.iops) * opts.runtime.as_secs_f64();
                let per_op = |cpu: f64, ops: f64| if ops > 0.0 { cpu * 1e6 / ops } else { 0.0 };
                let (ours_cpu, fio_cpu) = (per_op(ours.client_cpu_s, ours_ops), per_op(fio_r.cpu_s, fio_ops));
                eprintln!(
                    "bench: accuracy {}/{} {:<4} {:<20} read {:>9.0} vs fio {:>9.0} IOPS, write {:>9.0} vs fio {:>9.0} IOPS, \
                     CPU {:.1} vs fio {:.1} us/op",
                    it + 1,
                    opts.iterations,
                    side.label,
                    job.name,
                    ours.read.iops,
                    fio_r.read.iops,
                    ours.write.iops,
                    fio_r.write.iops,
                    ours_cpu,
                    fio_cpu,
                );
                raw[i].reads.push((ours.read.iops, fio_r.read.iops));
                raw[i].writes.push((ours.write.iops, fio_r.write.iops));
                raw[i].cpu.push((ours_cpu, fio_cpu));
                if raw[i].engine.is_empty() {
                    raw[i].engine = ours.engine.clone();
                }
            }
        }
        anyhow::Ok(jobs)
    }
    .await;
    let labels: Vec<&'static str> = res.sides.iter().map(|s| s.label).collect();
    let targets = res.sides.iter().map(|s| format!("{}: {}", s.label, s.fio)).collect();
    res.close().await;
    let jobs = result?;
    let mut report = Report {
        targets,
        fio_version: crate::fio::version(),
        runtime_s: opts.runtime.as_secs_f64(),
        iterations: opts.iterations,
        engines: Vec::new(),
        rows: Vec::new(),
    };
    for ((side, profile, job), r) in jobs.iter().zip(raw) {
        if !r.engine.is_empty() && !report.engines.contains(&r.engine) {
            report.engines.push(r.engine.clone());
        }
        for (dir, pairs, used) in [("read", &r.reads, job.rw.reads()), ("write", &r.writes, job.rw.writes())] {
            if !used {
                continue;
            }
            let ratios: Vec<f64> = pairs.iter().map(|(o, f)| if *f > 0.0 { o / f } else { 0.0 }).collect();
            report.rows.push(Row {
                target: labels[*side],
                profile: profile.clone(),
                job: job.name.clone(),
                side: dir,
                ours_iops: pairs.iter().map(|p| p.0).collect(),
                fio_iops: pairs.iter().map(|p| p.1).collect(),
                ratio: Summary::of(&ratios).median,
                ratios,
                ours_cpu_us_per_op: r.cpu.iter().map(|c| c.0).collect(),
                fio_cpu_us_per_op: r.cpu.iter().map(|c| c.1).collect(),
            });
        }
    }
    Ok(report)
}

/// What one job measured over the iterations: (ours, fio) pairs.
#[derive(Debug, Clone, Default)]
struct Raw {
    reads: Vec<(f64, f64)>,
    writes: Vec<(f64, f64)>,
    /// Client CPU microseconds per operation.
    cpu: Vec<(f64, f64)>,
    engine: String,
}

async fn fio_job(t: &FioTarget, job: &Job) -> anyhow::Result<FioRun> {
    let (t, job) = (t.clone(), job.clone());
    tokio::task::spawn_blocking(move || crate::fio::run_job(&t, &job)).await?
}

fn range(v: &[f64], prec: usize) -> String {
    let s = Summary::of(v);
    format!("{:.*} [{:.*}..{:.*}]", prec, s.median, prec, s.min, prec, s.max)
}

/// The comparison as a table: medians with [min..max] over the iterations.
pub fn table(r: &Report, tol: f64) -> String {
    let mut s = format!(
        "## Accuracy: bench vs fio ({}), {} iterations of {} s, interleaved\n\n",
        r.fio_version, r.iterations, r.runtime_s
    );
    for t in &r.targets {
        s.push_str(&format!("- {t}\n"));
    }
    for e in &r.engines {
        s.push_str(&format!("- our file engine: {e}\n"));
    }
    s.push_str(
        "- fio runs its jobs as threads of one process (`--thread`), as ours are; client CPU per operation is \
         user + system time of the generator (ours: its job threads; fio: the whole process) over the operations \
         of the job, both directions\n",
    );
    s.push_str(&format!(
        "\n| Target | Profile | Job | Dir | ours IOPS median [min..max] | fio IOPS median [min..max] | ours/fio median [min..max] | within {tol}% | client CPU µs/op ours / fio |\n|---|---|---|---|---:|---:|---:|---|---:|\n"
    ));
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} / {:.1} |\n",
            row.target,
            row.profile,
            row.job,
            row.side,
            range(&row.ours_iops, 0),
            range(&row.fio_iops, 0),
            range(&row.ratios, 3),
            if within(row.ratio, tol) { "yes" } else { "NO" },
            Summary::of(&row.ours_cpu_us_per_op).median,
            Summary::of(&row.fio_cpu_us_per_op).median,
        ));
    }
    s.push_str(&format!("\n{} of {} figures outside ±{tol}%.\n", r.failures(tol), r.rows.len()));
    s
}
