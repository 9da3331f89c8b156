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
    /// Pin both generators to the last CPU and the in-process export to the
    /// others (see [`crate::cpu::split`]).
    pub pin: bool,
}

/// A generator whose threads were busy this share of their wall time or
/// more was limited by its own CPU: its figure measures the client.
pub const CLIENT_BOUND: f64 = 0.85;

/// How one figure compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Verdict {
    /// Within the tolerance.
    Within,
    /// Ours is higher and fio was limited by its own CPU there: fio cannot
    /// serve as the reference for this figure (our generator needed less
    /// CPU per operation). Not counted as a failure; the table says so.
    FioClientBound,
    /// Outside the tolerance with no such excuse.
    Outside,
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
    /// Share of the generator's job threads' wall time they spent on CPU.
    pub ours_busy: Vec<f64>,
    pub fio_busy: Vec<f64>,
}

impl Row {
    pub fn verdict(&self, tol: f64) -> Verdict {
        if within(self.ratio, tol) {
            Verdict::Within
        } else if self.ratio > 1.0 && Summary::of(&self.fio_busy).median >= CLIENT_BOUND {
            Verdict::FioClientBound
        } else {
            Verdict::Outside
        }
    }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// Each target taking part, described.
    pub targets: Vec<String>,
    /// Where the generators and the target ran.
    pub placement: String,
    pub fio_version: String,
    pub runtime_s: f64,
    pub iterations: usize,
    /// How our file engine issued requests (see [`crate::loadgen::ENGINE_AIO`]).
    pub engines: Vec<String>,
    pub rows: Vec<Row>,
}

impl Report {
    /// Figures outside the tolerance that no [`Verdict::FioClientBound`] excuses.
    pub fn failures(&self, tol: f64) -> usize {
        self.rows.iter().filter(|r| r.verdict(tol) == Verdict::Outside).count()
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
    export: Option<(tempfile::TempDir, coronafs::service::RunningServer, BgRuntime)>,
    shaper: Option<crate::shaper::Shaper>,
    sides: Vec<Side>,
    scratch: Option<tempfile::TempDir>,
    /// (the in-process export's CPUs, the generators' CPUs) when pinned.
    placement: Option<(Vec<usize>, Vec<usize>)>,
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
async fn own_export(res: &mut Resources, size: u64, cpus: Option<Vec<usize>>) -> anyhow::Result<TargetSpec> {
    let dir = tempfile::tempdir()?;
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(2).enable_all();
    if let Some(cpus) = cpus {
        // Every thread of the export's runtime (workers and blocking pool).
        b.on_thread_start(move || {
            if let Err(e) = crate::cpu::pin_current_thread(&cpus) {
                tracing::warn!(error = %e, "cannot pin the export's thread");
            }
        });
    }
    let srt = BgRuntime(Some(b.build()?));
    // The engine `coronafs serve` uses by default.
    let cfg = coronafs::config::ServerConfig::ephemeral(dir.path(), coronafs::backend::IoEngine::Threads);
    let srv = srt.handle().spawn(coronafs::service::start(cfg)).await??;
    srv.volumes.create("accuracy", size).await?;
    let ep = crate::cluster::CoronaEndpoint {
        nbd: srv.nbd_addr.to_string(),
        api: srv.api_url(),
        api_token: srv.api_token.as_ref().map(|t| t.expose().to_owned()),
        cluster_file: None,
    };
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
            None => own_export(res, opts.size, res.placement.as_ref().map(|p| p.0.clone())).await?,
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
            TargetSpec::Rbd { .. } => {
                anyhow::bail!("rbd:// targets are driven by fio itself; there is no second generator to compare")
            }
        };
        res.shaper = shaper;
        let (label, fio) = match &spec {
            TargetSpec::Nbd { addr, export } => ("nbd", FioTarget::Nbd(format!("nbd://{addr}/{export}"))),
            TargetSpec::Path(p) => ("file", FioTarget::File(p.clone())),
            TargetSpec::S3 { .. } | TargetSpec::Rbd { .. } => unreachable!("refused above"),
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
    let mut res = Resources { placement: if opts.pin { crate::cpu::split() } else { None }, ..Resources::default() };
    let gen_cpus = res.placement.as_ref().map(|p| p.1.clone());
    let limits = match &gen_cpus {
        Some(c) => Limits::default().pinned_to(c),
        None => Limits::default(),
    };
    let placement = match (&res.placement, &opts.target) {
        (Some((t, g)), None) => format!(
            "both generators on CPU {} (fio --cpus_allowed, our job threads pinned), the in-process export on CPU {}",
            crate::cpu::list(g),
            crate::cpu::list(t)
        ),
        (Some((_, g)), Some(_)) => format!("both generators on CPU {}; the target where it runs", crate::cpu::list(g)),
        (None, _) if opts.pin => "not pinned: fewer than two CPUs".into(),
        (None, _) => "not pinned (--pin off): wherever the scheduler puts them".into(),
    };
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
                    fio_r = fio_job(&side.fio, job, gen_cpus.clone()).await?;
                }
                let ours = side.opened.run(job, limits, stop.clone()).await?;
                if ours_first {
                    fio_r = fio_job(&side.fio, job, gen_cpus.clone()).await?;
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
                let threads = f64::from(job.numjobs);
                raw[i].busy.push((
                    ours.client_cpu_s / (ours.elapsed_s * threads).max(1e-9),
                    fio_r.cpu_s / (opts.runtime.as_secs_f64() * threads).max(1e-9),
                ));
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
        placement,
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
                ours_busy: r.busy.iter().map(|c| c.0).collect(),
                fio_busy: r.busy.iter().map(|c| c.1).collect(),
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
    /// Share of the job threads' time on CPU.
    busy: Vec<(f64, f64)>,
    engine: String,
}

async fn fio_job(t: &FioTarget, job: &Job, cpus: Option<Vec<usize>>) -> anyhow::Result<FioRun> {
    let (t, job) = (t.clone(), job.clone());
    tokio::task::spawn_blocking(move || crate::fio::run_job(&t, &job, cpus.as_deref())).await?
}

fn range(v: &[f64], prec: usize) -> String {
    let s = Summary::of(v);
    format!("{:.*} [{:.*}..{:.*}]", prec, s.median, prec, s.min, prec, s.max)
}

/// The comparison as a table: medians with [min..max] over the iterations.
pub fn table(r: &Report, tol: f64) -> String {
    let mut s = format!(
        "## Accuracy: bench vs fio ({}), {} of {} s, interleaved\n\n",
        r.fio_version,
        crate::text::count(r.iterations, "iteration"),
        r.runtime_s
    );
    for t in &r.targets {
        s.push_str(&format!("- {t}\n"));
    }
    for e in &r.engines {
        s.push_str(&format!("- our file engine: {e}\n"));
    }
    s.push_str(&format!("- placement: {}\n", r.placement));
    s.push_str(&format!(
        "- fio runs its jobs as threads of one process (`--thread`), as ours are. Client CPU per operation is \
         user + system time of the generator (ours: its job threads; fio: the whole process) over the \
         operations of the job, both directions; busy is that CPU time over the job threads' wall time \
         (>= {:.0} %: the generator was limited by its own CPU, so its figure measures the client)\n",
        CLIENT_BOUND * 100.0
    ));
    s.push_str(&format!(
        "\n| Target | Profile | Job | Dir | ours IOPS median [min..max] | fio IOPS median [min..max] | ours/fio median [min..max] | within {tol}% | client CPU µs/op ours / fio | busy ours / fio |\n|---|---|---|---|---:|---:|---:|---|---:|---:|\n"
    ));
    let pct = |v: &[f64]| Summary::of(v).median * 100.0;
    for row in &r.rows {
        let verdict = match row.verdict(tol) {
            Verdict::Within => "yes".to_owned(),
            Verdict::FioClientBound => format!("no: fio CPU-bound ({:.0} % busy)", pct(&row.fio_busy)),
            Verdict::Outside => "NO".to_owned(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.1} / {:.1} | {:.0} % / {:.0} % |\n",
            row.target,
            row.profile,
            row.job,
            row.side,
            range(&row.ours_iops, 0),
            range(&row.fio_iops, 0),
            range(&row.ratios, 3),
            verdict,
            Summary::of(&row.ours_cpu_us_per_op).median,
            Summary::of(&row.fio_cpu_us_per_op).median,
            pct(&row.ours_busy),
            pct(&row.fio_busy),
        ));
    }
    let excused = r.rows.iter().filter(|x| x.verdict(tol) == Verdict::FioClientBound).count();
    s.push_str(&format!(
        "\n{} of {} outside ±{tol}%{}.\n",
        r.failures(tol),
        crate::text::count(r.rows.len(), "figure"),
        if excused > 0 {
            format!(
                "; {excused} more where fio was limited by its own CPU and ours, needing less CPU per operation, \
                 went further (not counted: there fio measures itself, not the target)"
            )
        } else {
            String::new()
        }
    ));
    s
}
