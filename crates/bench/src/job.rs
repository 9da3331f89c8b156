//! Job files: what a load run does, in fio's vocabulary (rw, bs, iodepth,
//! numjobs, size, runtime, direct, fsync, rwmixread), written as TOML.
//!
//! A profile is a `[global]` table of defaults and a list of `[[job]]`s:
//!
//! ```toml
//! description = "1M sequential read at depth 16"
//! iterations = 3
//! [global]
//! size = "1G"
//! runtime = "10s"
//! [[job]]
//! name = "seq-read"
//! rw = "read"
//! bs = "1M"
//! iodepth = 16
//! ```
//!
//! Parsing is pure (no I/O); unknown keys and out-of-range values are refused
//! with a message naming the job and the field.

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Largest block size accepted (the NBD request limit of common servers).
pub const MAX_BS: u64 = 32 << 20;
/// Longest runtime accepted for one job.
pub const MAX_RUNTIME: Duration = Duration::from_secs(3600);

/// The I/O pattern, with fio's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    Read,
    Write,
    Randread,
    Randwrite,
    /// Sequential mixed reads and writes (fio's `rw`/`readwrite`).
    #[serde(alias = "readwrite")]
    Rw,
    Randrw,
}

impl Rw {
    pub fn random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }
    pub fn reads(self) -> bool {
        !matches!(self, Rw::Write | Rw::Randwrite)
    }
    pub fn writes(self) -> bool {
        !matches!(self, Rw::Read | Rw::Randread)
    }
    /// Percentage of operations that are reads.
    pub fn read_pct(self, rwmixread: u32) -> u32 {
        match self {
            Rw::Read | Rw::Randread => 100,
            Rw::Write | Rw::Randwrite => 0,
            Rw::Rw | Rw::Randrw => rwmixread,
        }
    }
    pub fn fio_name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Rw => "rw",
            Rw::Randrw => "randrw",
        }
    }
}

/// A size written as `"4k"`, `"1M"`, `"1G"` or a plain number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SizeSpec(pub u64);

impl SizeSpec {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl<'de> Deserialize<'de> for SizeSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = SizeSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size such as \"4k\", \"1M\", \"1G\" or a number of bytes")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<SizeSpec, E> {
                u64::try_from(v).map(SizeSpec).map_err(|_| E::custom(format!("size {v} is negative")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<SizeSpec, E> {
                Ok(SizeSpec(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<SizeSpec, E> {
                coronafs::util::parse_size(v).map(SizeSpec).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written as `"10s"`, `"500ms"`, `"2m"` or a plain number of seconds.
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().with_context(|| format!("{s:?} is not a duration (try \"10s\", \"500ms\", \"2m\")"))?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" | "min" => n * 60.0,
        _ => bail!("{s:?}: unknown unit {unit:?} (use ms, s or m)"),
    };
    if !secs.is_finite() || !(0.0..=1e7).contains(&secs) {
        bail!("{s:?} is out of range");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// A duration field: `"10s"`, `"500ms"` or a number of seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DurationSpec(pub Duration);

impl DurationSpec {
    fn get(self) -> anyhow::Result<Duration> {
        Ok(self.0)
    }
}

impl<'de> Deserialize<'de> for DurationSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DurationSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration such as \"10s\", \"500ms\", \"2m\" or a number of seconds")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<DurationSpec, E> {
                self.visit_f64(v as f64)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<DurationSpec, E> {
                self.visit_f64(v as f64)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<DurationSpec, E> {
                if v.is_finite() && (0.0..1e7).contains(&v) {
                    Ok(DurationSpec(Duration::from_secs_f64(v)))
                } else {
                    Err(E::custom(format!("{v} seconds is out of range")))
                }
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DurationSpec, E> {
                parse_duration(v).map(DurationSpec).map_err(|e| E::custom(format!("{e:#}")))
            }
        }
        d.deserialize_any(V)
    }
}

/// One job as written in the file: every field optional, so `[global]` can
/// supply defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Name shown in reports and JSON (required for `[[job]]`).
    pub name: Option<String>,
    /// I/O pattern: read, write, randread, randwrite, rw, randrw.
    pub rw: Option<Rw>,
    /// Block size of each operation (default 4k).
    pub bs: Option<SizeSpec>,
    /// Operations in flight per job (default 1).
    pub iodepth: Option<u32>,
    /// Parallel jobs, each with its own connection or file (default 1).
    pub numjobs: Option<u32>,
    /// Bytes each job works over (default 1G, capped at the target's size).
    pub size: Option<SizeSpec>,
    /// Time to measure; without it the job ends after `size` bytes.
    pub runtime: Option<DurationSpec>,
    /// Time run before measuring starts (default 0).
    pub ramp_time: Option<DurationSpec>,
    /// Bypass the page cache for file targets (default true).
    pub direct: Option<bool>,
    /// Flush after every N writes (0 = never, the default).
    pub fsync: Option<u32>,
    /// Percentage of reads in rw/randrw jobs (default 50).
    pub rwmixread: Option<u32>,
}

/// A profile as written in the file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileFile {
    /// What the profile reproduces.
    #[serde(default)]
    pub description: String,
    /// Iterations when `--iterations` is not given (default 3).
    pub iterations: Option<u32>,
    /// Defaults for every job.
    #[serde(default)]
    pub global: JobSpec,
    /// The jobs, run one after the other.
    #[serde(default, rename = "job")]
    pub jobs: Vec<JobSpec>,
}

/// A job with every field settled and checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub name: String,
    pub rw: Rw,
    pub bs: u64,
    pub iodepth: u32,
    pub numjobs: u32,
    pub size: u64,
    /// `None`: run until `size` bytes per job are done.
    pub runtime: Option<Duration>,
    pub ramp_time: Duration,
    pub direct: bool,
    pub fsync: u32,
    pub rwmixread: u32,
}

impl Job {
    /// Percentage of operations that are reads.
    pub fn read_pct(&self) -> u32 {
        self.rw.read_pct(self.rwmixread)
    }
}

/// A checked profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    pub name: String,
    pub description: String,
    pub iterations: u32,
    pub jobs: Vec<Job>,
}

fn merge(job: &JobSpec, global: &JobSpec) -> JobSpec {
    macro_rules! pick {
        ($($f:ident),*) => { JobSpec { $($f: job.$f.clone().or_else(|| global.$f.clone())),* } };
    }
    pick!(name, rw, bs, iodepth, numjobs, size, runtime, ramp_time, direct, fsync, rwmixread)
}

impl JobSpec {
    /// Settles defaults and checks every value.
    pub fn resolve(&self) -> anyhow::Result<Job> {
        let name = self.name.clone().context("every [[job]] needs a name")?;
        let ctx = |m: String| anyhow::anyhow!("job {name:?}: {m}");
        if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(ctx("name must be 1-64 of [A-Za-z0-9._-]".into()));
        }
        let rw = self.rw.ok_or_else(|| ctx("rw is missing (read, write, randread, randwrite, rw, randrw)".into()))?;
        let bs = self.bs.map_or(4096, SizeSpec::bytes);
        if bs == 0 || bs > MAX_BS {
            return Err(ctx(format!("bs {bs} must be between 1 byte and 32 MiB")));
        }
        let direct = self.direct.unwrap_or(true);
        if direct && !bs.is_multiple_of(512) {
            return Err(ctx(format!("bs {bs} must be a multiple of 512 with direct = true")));
        }
        let iodepth = self.iodepth.unwrap_or(1);
        if !(1..=1024).contains(&iodepth) {
            return Err(ctx(format!("iodepth {iodepth} must be between 1 and 1024")));
        }
        let numjobs = self.numjobs.unwrap_or(1);
        if !(1..=64).contains(&numjobs) {
            return Err(ctx(format!("numjobs {numjobs} must be between 1 and 64")));
        }
        let size = self.size.map_or(1 << 30, SizeSpec::bytes);
        if size < bs {
            return Err(ctx(format!("size {size} is smaller than bs {bs}")));
        }
        let runtime = self.runtime.map(DurationSpec::get).transpose().map_err(|e| ctx(format!("runtime: {e}")))?;
        if runtime.is_some_and(|r| r.is_zero() || r > MAX_RUNTIME) {
            return Err(ctx("runtime must be more than 0 and at most 1 hour".into()));
        }
        let ramp_time = self
            .ramp_time
            .map(DurationSpec::get)
            .transpose()
            .map_err(|e| ctx(format!("ramp_time: {e}")))?
            .unwrap_or_default();
        if ramp_time > MAX_RUNTIME {
            return Err(ctx("ramp_time must be at most 1 hour".into()));
        }
        let fsync = self.fsync.unwrap_or(0);
        if fsync > 0 && !rw.writes() {
            return Err(ctx(format!("fsync = {fsync} needs a job that writes (rw = {})", rw.fio_name())));
        }
        let rwmixread = self.rwmixread.unwrap_or(50);
        if rwmixread > 100 {
            return Err(ctx(format!("rwmixread {rwmixread} must be a percentage (0-100)")));
        }
        if self.rwmixread.is_some() && !matches!(rw, Rw::Rw | Rw::Randrw) {
            return Err(ctx("rwmixread only applies to rw = \"rw\" or \"randrw\"".into()));
        }
        Ok(Job { name, rw, bs, iodepth, numjobs, size, runtime, ramp_time, direct, fsync, rwmixread })
    }
}

/// Parses and checks a profile. `name` labels it in reports.
pub fn parse_profile(name: &str, text: &str) -> anyhow::Result<Profile> {
    let file: ProfileFile = svc_kit::config::parse_named(name, text)?;
    if file.global.name.is_some() {
        bail!("{name}: [global] cannot set a name");
    }
    if file.jobs.is_empty() {
        bail!("{name}: no [[job]] tables");
    }
    let iterations = file.iterations.unwrap_or(3);
    if !(1..=1000).contains(&iterations) {
        bail!("{name}: iterations {iterations} must be between 1 and 1000");
    }
    let mut jobs = Vec::new();
    for (i, j) in file.jobs.iter().enumerate() {
        let job = merge(j, &file.global).resolve().with_context(|| format!("{name}: job #{}", i + 1))?;
        if jobs.iter().any(|o: &Job| o.name == job.name) {
            bail!("{name}: two jobs named {:?}", job.name);
        }
        jobs.push(job);
    }
    Ok(Profile { name: name.to_owned(), description: file.description, iterations, jobs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        format!("{:#}", parse_profile("t", text).expect_err("should be refused"))
    }

    #[test]
    fn a_full_job_file_parses_with_global_defaults() {
        let p = parse_profile(
            "t",
            r#"
            description = "d"
            iterations = 2
            [global]
            size = "64M"
            runtime = "2s"
            bs = "1M"
            [[job]]
            name = "a"
            rw = "read"
            iodepth = 16
            [[job]]
            name = "b"
            rw = "randrw"
            bs = 4096
            rwmixread = 70
            numjobs = 4
            fsync = 32
            direct = false
            runtime = 1.5
            "#,
        )
        .unwrap();
        assert_eq!(p.iterations, 2);
        let a = &p.jobs[0];
        assert_eq!((a.bs, a.iodepth, a.size, a.runtime), (1 << 20, 16, 64 << 20, Some(Duration::from_secs(2))));
        let b = &p.jobs[1];
        assert_eq!((b.bs, b.numjobs, b.fsync, b.direct, b.read_pct()), (4096, 4, 32, false, 70));
        assert_eq!(b.runtime, Some(Duration::from_millis(1500)));
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        assert!(err("[[job]]\nname = \"a\"\nrw = \"read\"\nblocksize = \"4k\"").contains("blocksize"));
        assert!(err("iterationz = 3").contains("iterationz"));
    }

    #[test]
    fn bad_values_are_refused_with_the_job_and_field() {
        let job = |extra: &str| err(&format!("[[job]]\nname = \"j\"\nrw = \"randwrite\"\n{extra}"));
        assert!(job("bs = \"1x\"").contains("unknown unit"));
        assert!(job("bs = 0").contains("bs 0"));
        assert!(job("bs = \"64M\"").contains("32 MiB"));
        assert!(job("bs = 1000").contains("multiple of 512"));
        assert!(job("iodepth = 0").contains("iodepth"));
        assert!(job("numjobs = 1000").contains("numjobs"));
        assert!(job("size = \"1k\"").contains("smaller than bs"));
        assert!(job("runtime = \"0s\"").contains("runtime"));
        assert!(job("runtime = \"3h\"").contains("unknown unit"));
        assert!(job("rwmixread = 70").contains("rwmixread only applies"));
        assert!(err("[[job]]\nname = \"j\"\nrw = \"sideways\"").contains("sideways"));
        assert!(err("[[job]]\nname = \"j\"\nrw = \"read\"\nfsync = 1").contains("needs a job that writes"));
        assert!(err("[[job]]\nname = \"j\"\nrw = \"randrw\"\nrwmixread = 101").contains("percentage"));
        assert!(err("[[job]]\nname = \"j\"").contains("rw is missing"));
        assert!(err("[[job]]\nrw = \"read\"").contains("needs a name"));
        assert!(err("[[job]]\nname = \"a b\"\nrw = \"read\"").contains("name must be"));
        assert!(
            err("[[job]]\nname = \"a\"\nrw = \"read\"\n[[job]]\nname = \"a\"\nrw = \"write\"").contains("two jobs")
        );
        assert!(err("").contains("no [[job]]"));
        assert!(err("[global]\nname = \"x\"\n[[job]]\nname = \"a\"\nrw = \"read\"").contains("[global]"));
        assert!(err("not toml at all = = =").contains("t:"));
    }

    #[test]
    fn durations_parse_in_every_unit() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("1h").is_err());
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics_the_parser(s in "\\PC{0,200}") {
            let _ = parse_profile("p", &s);
        }
    }
}
