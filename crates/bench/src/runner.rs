//! `bench run`: a profile against a target, several iterations, and per job
//! the mean and standard deviation (and median, min, max) of every figure.

use crate::job::{Job, Profile};
use crate::loadgen::{JobRun, Limits, Opened, Side};
use crate::shaper::{LinkSpec, Shaper};
use crate::stats::Summary;
use crate::target::{S3Keys, TargetSpec};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// Built-in profiles: the seed documents' jobs, and `nbd-4`, the workloads
/// of `bench nbd-compare`.
pub const BUILTIN: [(&str, &str); 6] = [
    ("seed-000", include_str!("../profiles/seed-000.toml")),
    ("seed-001", include_str!("../profiles/seed-001.toml")),
    ("seed-002", include_str!("../profiles/seed-002.toml")),
    ("seed-003", include_str!("../profiles/seed-003.toml")),
    ("seed-004", include_str!("../profiles/seed-004.toml")),
    ("nbd-4", include_str!("../profiles/nbd-4.toml")),
];

/// A built-in profile by name, or a job file by path.
pub fn load_profile(name_or_path: &str) -> anyhow::Result<Profile> {
    if let Some((name, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
        return crate::job::parse_profile(name, text);
    }
    let path = std::path::Path::new(name_or_path);
    if !path.exists() {
        let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
        anyhow::bail!("{name_or_path}: no such built-in profile ({}) or job file", names.join(", "));
    }
    let text = svc_kit::config::read(path)?;
    crate::job::parse_profile(name_or_path, &text)
}

/// Settings that override every job of a profile (for short runs).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub runtime: Option<std::time::Duration>,
    pub size: Option<u64>,
    pub ramp_time: Option<std::time::Duration>,
}

impl Overrides {
    pub fn apply(&self, job: &mut Job) {
        if let Some(r) = self.runtime {
            job.runtime = Some(r);
        }
        if let Some(s) = self.size {
            job.size = s.max(job.bs);
        }
        if let Some(r) = self.ramp_time {
            job.ramp_time = r;
        }
    }
}

/// Mean/stddev/median over iterations of each figure of one direction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SideSummary {
    pub iops: Summary,
    pub bw_bytes: Summary,
    pub lat_mean_us: Summary,
    pub lat_p50_us: Summary,
    pub lat_p95_us: Summary,
    pub lat_p99_us: Summary,
}

impl SideSummary {
    pub fn of(sides: &[Side]) -> SideSummary {
        let col = |f: fn(&Side) -> f64| Summary::of(&sides.iter().map(f).collect::<Vec<_>>());
        SideSummary {
            iops: col(|s| s.iops),
            bw_bytes: col(|s| s.bw_bytes),
            lat_mean_us: col(|s| s.lat_mean_us),
            lat_p50_us: col(|s| s.lat_p50_us),
            lat_p95_us: col(|s| s.lat_p95_us),
            lat_p99_us: col(|s| s.lat_p99_us),
        }
    }
}

/// One job's result over all iterations.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSummary {
    pub name: String,
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
    pub numjobs: u32,
    pub fsync: u32,
    /// Absent when the job does no reads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read: Option<SideSummary>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write: Option<SideSummary>,
}

/// What `bench run --json` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunReport {
    pub profile: String,
    pub description: String,
    pub target: String,
    /// The emulated link in front of the target (`bench run --link-rate`),
    /// or that there was none.
    #[serde(default)]
    pub link: String,
    pub iterations: u32,
    pub jobs: Vec<JobSummary>,
}

/// Puts a shaping proxy ([`Shaper`]) in front of an NBD or S3 target, so
/// a run sees a slower link; returns the target to use instead and the
/// proxy (shut it down after the run). A path has no link to emulate.
pub async fn through_link(target: &TargetSpec, link: LinkSpec) -> anyhow::Result<(TargetSpec, Option<Shaper>)> {
    if link.is_unshaped() {
        return Ok((target.clone(), None));
    }
    if link.rate == Some(0) {
        anyhow::bail!("--link-rate must be more than 0");
    }
    match target {
        TargetSpec::Nbd { addr, export } => {
            let sh = Shaper::start(TargetSpec::nbd_addr(addr)?, link).await?;
            Ok((TargetSpec::Nbd { addr: sh.addr.to_string(), export: export.clone() }, Some(sh)))
        }
        TargetSpec::S3 { bucket, prefix, endpoint, region } => {
            // The proxy is plain TCP, so only http:// endpoints; the SDK signs
            // the Host it connects to, which the proxy passes on unchanged.
            let sh = Shaper::start(crate::cluster::url_addr(endpoint)?, link).await?;
            let endpoint = format!("http://{}", sh.addr);
            Ok((
                TargetSpec::S3 { bucket: bucket.clone(), prefix: prefix.clone(), endpoint, region: region.clone() },
                Some(sh),
            ))
        }
        TargetSpec::Path(p) => anyhow::bail!(
            "--link-rate/--link-delay emulate a network link and need an nbd:// or s3:// target, not the path {}",
            p.display()
        ),
        TargetSpec::Rbd { .. } => anyhow::bail!(
            "--link-rate/--link-delay need an nbd:// or s3:// target: librbd talks to every OSD, there is no one link to shape"
        ),
    }
}

/// Runs every job of `profile` `iterations` times (jobs interleaved within
/// an iteration), printing one line per run to stderr.
pub async fn run_profile(
    profile: &Profile,
    target: &TargetSpec,
    keys: &S3Keys,
    iterations: u32,
    ov: &Overrides,
    limits: Limits,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<RunReport> {
    let opened = Opened::open(target, keys).await?;
    let r = run_jobs(profile, target.to_string(), iterations, ov, stop.clone(), |job| {
        let (opened, stop) = (&opened, stop.clone());
        async move { opened.run(&job, limits, stop).await }
    })
    .await;
    opened.cleanup();
    r
}

/// Like [`run_profile`], with every job run by a `bench agent` on its host
/// (the target is opened there; `link` is that agent's emulated interface).
#[allow(clippy::too_many_arguments)]
pub async fn run_profile_on_agent(
    agent: &crate::agent::client::AgentClient,
    profile: &Profile,
    uri: &str,
    keys: &S3Keys,
    iterations: u32,
    ov: &Overrides,
    limits: Limits,
    link: LinkSpec,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<RunReport> {
    TargetSpec::parse(uri)?;
    let target = crate::agent::BlockTarget::Uri {
        uri: uri.to_owned(),
        access_key: keys.access_key.clone().or_else(|| std::env::var("AWS_ACCESS_KEY_ID").ok()),
        secret_key: keys.secret_key.clone().or_else(|| std::env::var("AWS_SECRET_ACCESS_KEY").ok()),
    };
    let mut r = run_jobs(profile, uri.to_owned(), iterations, ov, stop, |job| {
        let req = crate::agent::JobRequest { target: target.clone(), job, max_job_time: limits.max_job_time, link };
        async move { Ok(agent.job(&req).await?.run) }
    })
    .await?;
    r.target = format!("{uri} (from agent {} at {})", agent.name, agent.addr);
    r.link = link.describe();
    Ok(r)
}

/// Runs every job `iterations` times through `run_one` and summarises.
async fn run_jobs<F, Fut>(
    profile: &Profile,
    target: String,
    iterations: u32,
    ov: &Overrides,
    stop: Arc<AtomicBool>,
    run_one: F,
) -> anyhow::Result<RunReport>
where
    F: Fn(Job) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<JobRun>>,
{
    let jobs: Vec<Job> = profile
        .jobs
        .iter()
        .map(|j| {
            let mut j = j.clone();
            ov.apply(&mut j);
            j
        })
        .collect();
    let mut runs: Vec<Vec<JobRun>> = vec![Vec::new(); jobs.len()];
    for it in 0..iterations {
        for (i, job) in jobs.iter().enumerate() {
            let r = run_one(job.clone()).await?;
            eprintln!("bench: {}/{} {}", it + 1, iterations, line(&r));
            runs[i].push(r);
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                anyhow::bail!("stopped");
            }
        }
    }
    let jobs = jobs
        .iter()
        .zip(runs)
        .map(|(j, rs)| {
            let reads: Vec<Side> = rs.iter().map(|r| r.read).collect();
            let writes: Vec<Side> = rs.iter().map(|r| r.write).collect();
            JobSummary {
                name: j.name.clone(),
                rw: j.rw.fio_name().to_owned(),
                bs: j.bs,
                iodepth: j.iodepth,
                numjobs: j.numjobs,
                fsync: j.fsync,
                read: j.rw.reads().then(|| SideSummary::of(&reads)),
                write: j.rw.writes().then(|| SideSummary::of(&writes)),
            }
        })
        .collect();
    Ok(RunReport {
        profile: profile.name.clone(),
        description: profile.description.clone(),
        target,
        link: LinkSpec::default().describe(),
        iterations,
        jobs,
    })
}

/// One progress line for one run.
pub fn line(r: &JobRun) -> String {
    let mut s = format!("{:<24}", r.name);
    for (label, side) in [("read", &r.read), ("write", &r.write)] {
        if side.ops > 0 {
            s.push_str(&format!(
                " {label} {:>9.1} MiB/s {:>9.0} IOPS p50 {:>8.1} us p99 {:>8.1} us",
                side.bw_bytes / 1048576.0,
                side.iops,
                side.lat_p50_us,
                side.lat_p99_us
            ));
        }
    }
    s
}

/// The report as a Markdown table: mean ± standard deviation.
pub fn markdown(r: &RunReport) -> String {
    let mut s = format!(
        "## {} on {}\n\n{}\n\nLink: {}. {}; mean ± standard deviation.\n\n",
        r.profile,
        r.target,
        r.description,
        r.link,
        crate::text::count(r.iterations, "iteration")
    );
    s.push_str("| Job | Dir | MiB/s | IOPS | p50 µs | p95 µs | p99 µs |\n|---|---|---:|---:|---:|---:|---:|\n");
    for j in &r.jobs {
        for (dir, side) in [("read", &j.read), ("write", &j.write)] {
            if let Some(x) = side {
                s.push_str(&format!(
                    "| {} | {dir} | {:.1} ± {:.1} | {:.0} ± {:.0} | {:.1} | {:.1} | {:.1} |\n",
                    j.name,
                    x.bw_bytes.mean / 1048576.0,
                    x.bw_bytes.stddev / 1048576.0,
                    x.iops.mean,
                    x.iops.stddev,
                    x.lat_p50_us.mean,
                    x.lat_p95_us.mean,
                    x.lat_p99_us.mean
                ));
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_profile_parses_and_matches_its_seed() {
        for (name, _) in BUILTIN {
            let p = load_profile(name).unwrap();
            assert!(!p.jobs.is_empty(), "{name}");
        }
        let p1 = load_profile("seed-001").unwrap();
        assert_eq!(p1.iterations, 10);
        let fsyncs: Vec<u32> = p1.jobs.iter().filter(|j| j.name.starts_with("write-iops")).map(|j| j.fsync).collect();
        assert_eq!(fsyncs, [0, 1, 32, 128]);
        let p3 = load_profile("seed-003").unwrap();
        let v = &p3.jobs[0];
        assert_eq!((v.bs, v.iodepth, v.numjobs, v.direct), (64 << 10, 4, 4, true));
        let p2 = load_profile("seed-002").unwrap();
        assert_eq!(p2.jobs.iter().map(|j| j.iodepth).collect::<Vec<_>>(), [16, 16, 64, 32]);
        assert_eq!(p2.jobs[3].read_pct(), 70);
    }

    #[test]
    fn nbd_4_is_nbd_compares_workloads() {
        let p = load_profile("nbd-4").unwrap();
        assert_eq!(p.jobs.len(), crate::nbd_compare::WORKLOADS.len());
        for (j, w) in p.jobs.iter().zip(crate::nbd_compare::WORKLOADS.iter()) {
            assert_eq!(j.name, w.name);
            assert_eq!(j.rw.fio_name(), w.rw, "{}", w.name);
            assert_eq!(j.bs, coronafs::util::parse_size(w.bs).unwrap(), "{}", w.name);
            assert_eq!((j.iodepth, j.numjobs), (w.iodepth, w.numjobs), "{}", w.name);
        }
    }

    #[test]
    fn unknown_profile_names_list_the_builtins() {
        let e = load_profile("seed-999").unwrap_err().to_string();
        assert!(e.contains("seed-000") && e.contains("seed-004"), "{e}");
    }
}
