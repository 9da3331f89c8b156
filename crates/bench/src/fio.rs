//! Running fio and reading its JSON output.

use anyhow::{Context, bail};
use serde::Serialize;
use std::process::Command;

/// One fio workload.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub name: &'static str,
    pub rw: &'static str,
    pub bs: &'static str,
    pub iodepth: u32,
    pub numjobs: u32,
}

/// The figures of one fio run (summed over jobs for one direction).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct FioResult {
    pub bw_bytes: f64,
    pub iops: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    pub lat_p95_us: f64,
    /// Mean of fio's `lat` (submission to completion).
    pub lat_mean_us: f64,
    /// Operations and bytes completed in the measured window.
    pub ops: u64,
    pub bytes: u64,
    /// The measured window, seconds.
    pub runtime_s: f64,
}

/// Runs `w` with the nbd engine against `uri` for `runtime_s` seconds.
pub fn run_nbd(uri: &str, w: &Workload, size: &str, runtime_s: u32) -> anyhow::Result<FioResult> {
    run_nbd_on(uri, w, size, runtime_s, None)
}

/// [`run_nbd`] with fio's threads kept to CPU `cpu` (`--cpus_allowed`), if given.
pub fn run_nbd_on(
    uri: &str,
    w: &Workload,
    size: &str,
    runtime_s: u32,
    cpu: Option<usize>,
) -> anyhow::Result<FioResult> {
    let mut engine = vec!["--ioengine=nbd".to_owned(), format!("--uri={uri}")];
    engine.extend(cpu.map(|c| format!("--cpus_allowed={c}")));
    run_workload(&engine, None, w, size, runtime_s).with_context(|| format!("fio on {uri}"))
}

/// Runs `w` with the rbd engine (librbd) on `pool/image` of the cluster in `conf`.
/// With `cpu`, fio's threads are kept to that CPU (`--cpus_allowed`).
pub fn run_rbd(
    pool: &str,
    image: &str,
    conf: &std::path::Path,
    w: &Workload,
    size: &str,
    runtime_s: u32,
    cpu: Option<usize>,
) -> anyhow::Result<FioResult> {
    let mut engine = vec![
        "--ioengine=rbd".into(),
        "--clientname=admin".into(),
        format!("--pool={pool}"),
        format!("--rbdname={image}"),
    ];
    engine.extend(cpu.map(|c| format!("--cpus_allowed={c}")));
    run_workload(&engine, Some(conf), w, size, runtime_s).with_context(|| format!("fio on RBD {pool}/{image}"))
}

fn run_workload(
    engine: &[String],
    ceph_conf: Option<&std::path::Path>,
    w: &Workload,
    size: &str,
    runtime_s: u32,
) -> anyhow::Result<FioResult> {
    let mut cmd = Command::new("fio");
    cmd.arg("--name=bench").args(engine).args([
        &format!("--rw={}", w.rw),
        &format!("--bs={}", w.bs),
        &format!("--iodepth={}", w.iodepth),
        &format!("--numjobs={}", w.numjobs),
        &format!("--size={size}"),
        &format!("--runtime={runtime_s}"),
        "--time_based",
        "--ramp_time=1",
        "--group_reporting",
        "--randrepeat=0",
        "--output-format=json",
    ]);
    if let Some(c) = ceph_conf {
        cmd.env("CEPH_CONF", c);
    }
    let out = cmd.output().context("running fio (is it installed? apt-get install fio)")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    parse(&out.stdout, w.rw.contains("write") && !w.rw.contains("read"))
}

/// Where fio sends a [`crate::job::Job`]'s I/O.
#[derive(Debug, Clone)]
pub enum FioTarget {
    /// fio's nbd engine on `nbd://host:port/export`.
    Nbd(String),
    /// libaio on a file or block device.
    File(std::path::PathBuf),
    /// libaio on one file per job in a directory, named as our file engine
    /// names them (`bench.JOB.N`), so both use the same files.
    Dir(std::path::PathBuf),
    /// fio's rbd engine (librbd) on `pool/image` of the cluster in `conf`.
    Rbd { pool: String, image: String, conf: std::path::PathBuf },
}

impl std::fmt::Display for FioTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FioTarget::Nbd(uri) => write!(f, "{uri} (fio --ioengine=nbd)"),
            FioTarget::File(p) => write!(f, "{} (fio --ioengine=libaio)", p.display()),
            FioTarget::Dir(p) => write!(f, "files in {} (fio --ioengine=libaio)", p.display()),
            FioTarget::Rbd { pool, image, conf } => {
                write!(f, "RBD image {pool}/{image} of {} (fio --ioengine=rbd)", conf.display())
            }
        }
    }
}

/// `fio --version`, or `fio (version unknown)`.
pub fn version() -> String {
    Command::new("fio")
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "fio (version unknown)".into())
}

/// One fio run of one of our jobs.
#[derive(Debug, Clone, Copy, Default)]
pub struct FioRun {
    pub read: FioResult,
    pub write: FioResult,
    /// CPU seconds (user + system) fio used, start-up included.
    pub cpu_s: f64,
}

/// CPU seconds used by this process's waited-for children so far.
fn children_cpu_s() -> f64 {
    // SAFETY: rusage is plain old data; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to one rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &raw mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Runs one of our jobs with fio, time-based. Its jobs are threads of one
/// process (`--thread`), as ours are; the CPU fio used is measured from the
/// children's resource usage, so fio runs must not overlap other children.
/// With `cpus`, fio's threads run only there (`--cpus_allowed`, shared).
pub fn run_job(target: &FioTarget, job: &crate::job::Job, cpus: Option<&[usize]>) -> anyhow::Result<FioRun> {
    let mut cmd = Command::new("fio");
    cmd.arg(format!("--name={}", job.name));
    cmd.arg("--thread");
    if let Some(c) = cpus {
        cmd.arg(format!("--cpus_allowed={}", crate::cpu::list(c))).arg("--cpus_allowed_policy=shared");
    }
    match target {
        FioTarget::Nbd(uri) => {
            cmd.args(["--ioengine=nbd", &format!("--uri={uri}")]);
        }
        FioTarget::File(p) => {
            cmd.arg("--ioengine=libaio").arg(format!("--filename={}", p.display()));
            cmd.arg(format!("--direct={}", u8::from(job.direct)));
        }
        FioTarget::Dir(d) => {
            cmd.arg("--ioengine=libaio").arg(format!("--directory={}", d.display()));
            // fio expands $jobname and $jobnum itself (no shell here).
            cmd.arg("--filename_format=bench.$jobname.$jobnum");
            cmd.arg(format!("--direct={}", u8::from(job.direct)));
        }
        FioTarget::Rbd { pool, image, conf } => {
            cmd.args([
                "--ioengine=rbd",
                "--clientname=admin",
                &format!("--pool={pool}"),
                &format!("--rbdname={image}"),
            ]);
            cmd.env("CEPH_CONF", conf);
        }
    }
    let runtime = job.runtime.map_or(10.0, |d| d.as_secs_f64());
    cmd.args([
        &format!("--rw={}", job.rw.fio_name()),
        &format!("--bs={}", job.bs),
        &format!("--iodepth={}", job.iodepth),
        &format!("--numjobs={}", job.numjobs),
        &format!("--size={}", job.size),
        &format!("--runtime={}ms", (runtime * 1000.0) as u64),
        "--time_based",
        "--group_reporting",
        "--randrepeat=0",
        "--output-format=json",
    ]);
    if job.fsync > 0 {
        cmd.arg(format!("--fsync={}", job.fsync));
    }
    if matches!(job.rw, crate::job::Rw::Rw | crate::job::Rw::Randrw) {
        cmd.arg(format!("--rwmixread={}", job.rwmixread));
    }
    if !job.ramp_time.is_zero() {
        cmd.arg(format!("--ramp_time={}ms", job.ramp_time.as_millis()));
    }
    let cpu0 = children_cpu_s();
    let out = cmd.output().context("running fio (is it installed? apt-get install fio)")?;
    let cpu_s = children_cpu_s() - cpu0;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(FioRun { read: parse(&out.stdout, false)?, write: parse(&out.stdout, true)?, cpu_s })
}

/// Extracts read (or write) figures from fio's JSON.
pub fn parse(json: &[u8], write: bool) -> anyhow::Result<FioResult> {
    // fio may print notices before the JSON object.
    let start = json.iter().position(|&b| b == b'{').context("no JSON in fio output")?;
    let v: serde_json::Value = serde_json::from_slice(&json[start..]).context("parsing fio JSON")?;
    let job = &v["jobs"][0][if write { "write" } else { "read" }];
    let f = |p: &str| job.pointer(p).and_then(|x| x.as_f64());
    let pct = |k: &str| f(&format!("/clat_ns/percentile/{k}")).unwrap_or(0.0) / 1000.0;
    Ok(FioResult {
        bw_bytes: f("/bw_bytes").context("fio JSON lacks bw_bytes")?,
        iops: f("/iops").context("fio JSON lacks iops")?,
        lat_p50_us: pct("50.000000"),
        lat_p99_us: pct("99.000000"),
        lat_p95_us: pct("95.000000"),
        lat_mean_us: f("/lat_ns/mean").unwrap_or(0.0) / 1000.0,
        ops: f("/total_ios").unwrap_or(0.0) as u64,
        bytes: f("/io_bytes").unwrap_or(0.0) as u64,
        runtime_s: f("/runtime").unwrap_or(0.0) / 1000.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_read_side_of_fio_json() {
        let json = br#"note: something
{"jobs":[{"read":{"bw_bytes":1048576,"iops":256.5,"clat_ns":{"percentile":{"50.000000":2000,"99.000000":9000}}},
"write":{"bw_bytes":0,"iops":0}}]}"#;
        let r = parse(json, false).unwrap();
        assert_eq!((r.bw_bytes, r.iops, r.lat_p50_us, r.lat_p99_us), (1048576.0, 256.5, 2.0, 9.0));
        assert!(parse(b"garbage", false).is_err());
        assert!(parse(br#"{"jobs":[{"read":{}}]}"#, false).is_err());
    }
}
