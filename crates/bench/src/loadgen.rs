//! The load generator: runs one [`Job`] against a target and measures it the
//! way fio does (IOPS, bandwidth, completion latency percentiles per
//! direction), without fio.
//!
//! Each of `numjobs` jobs gets its own connection (NBD), file (directory
//! targets) or prefix (S3) and keeps `iodepth` operations in flight. For NBD
//! and S3 each job is one OS thread driving a current-thread tokio runtime:
//! its connection, the connection's reply reader and its `iodepth` tasks all
//! run on that thread, as fio runs each job on one thread, so a job cannot
//! spread over more CPUs than fio's would (on a machine where the client's
//! CPU is the limit, that is what decides the figures). Files use OS threads
//! doing `pread`/`pwrite` on an `O_DIRECT` descriptor. The jobs start
//! together once every one is connected. Every job stops at its runtime, or
//! after `size` bytes, and never later than a hard time cap.

use crate::files::{self, AlignedBuf, FileTarget};
use crate::hist::Histogram;
use crate::job::{Job, Rw};
use crate::target::{S3_MAX_KEYS, TargetSpec};
use anyhow::{Context, bail};
use coronafs::client::NbdClient;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Figures for one direction of one job run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct Side {
    pub ops: u64,
    pub bytes: u64,
    pub iops: f64,
    pub bw_bytes: f64,
    pub lat_mean_us: f64,
    pub lat_p50_us: f64,
    pub lat_p95_us: f64,
    pub lat_p99_us: f64,
}

/// One run of one job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRun {
    pub name: String,
    /// Measured seconds (after ramp-up).
    pub elapsed_s: f64,
    pub read: Side,
    pub write: Side,
    /// Flushes issued (fsync = N).
    pub flushes: u64,
    /// Every measured read's latency: runs are combined by merging these,
    /// never by averaging percentiles.
    #[serde(default)]
    pub read_hist: Histogram,
    /// Every measured write's latency.
    #[serde(default)]
    pub write_hist: Histogram,
    /// How the requests were issued (file targets: [`ENGINE_AIO`] or
    /// [`ENGINE_THREADS`]); empty for NBD and S3, which have one engine.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub engine: String,
    /// CPU seconds (user + system) the generator's job threads used while
    /// the load ran (ramp included): the client's cost, beside fio's in
    /// `bench accuracy`.
    #[serde(default)]
    pub client_cpu_s: f64,
}

/// Limits a run never exceeds, and where its threads run.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Hard cap on one job's wall time (size-based jobs included).
    pub max_job_time: Duration,
    /// CPUs (a bit per CPU, 0..64) the job threads are pinned to; 0 leaves
    /// them where the scheduler puts them.
    pub pin_mask: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_job_time: Duration::from_secs(300), pin_mask: 0 }
    }
}

impl Limits {
    /// Pins the job threads to `cpus` (those below 64).
    pub fn pinned_to(mut self, cpus: &[usize]) -> Limits {
        self.pin_mask = cpus.iter().filter(|&&c| c < 64).fold(0, |m, &c| m | 1 << c);
        self
    }

    /// Pins the calling thread as asked (nothing when not asked).
    fn pin(&self) -> anyhow::Result<()> {
        if self.pin_mask == 0 {
            return Ok(());
        }
        let cpus: Vec<usize> = (0..64).filter(|c| self.pin_mask & 1 << c != 0).collect();
        crate::cpu::pin_current_thread(&cpus).with_context(|| format!("pinning a job thread to CPUs {cpus:?}"))
    }
}

/// Per-slot measurements, merged at the end.
#[derive(Debug, Default)]
struct Recorder {
    read: Histogram,
    write: Histogram,
    read_bytes: u64,
    write_bytes: u64,
    last: Option<Instant>,
    flushes: u64,
    /// CPU time (user + system) of the threads that issued the requests,
    /// from the start of the load to its end.
    cpu_ns: u64,
}

/// CPU time the calling thread has used (user + system), in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

impl Recorder {
    fn record(&mut self, plan: &Plan, op: Op, started: Instant, bytes: u64) {
        let now = Instant::now();
        if now < plan.ramp_end {
            return;
        }
        let ns = now.duration_since(started).as_nanos() as u64;
        match op {
            Op::Read => {
                self.read.record(ns);
                self.read_bytes += bytes;
            }
            Op::Write => {
                self.write.record(ns);
                self.write_bytes += bytes;
            }
        }
        self.last = Some(now);
    }

    fn merge(&mut self, o: &Recorder) {
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.read_bytes += o.read_bytes;
        self.write_bytes += o.write_bytes;
        self.flushes += o.flushes;
        self.cpu_ns += o.cpu_ns;
        self.last = self.last.max(o.last);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

/// What every slot of one job shares: where the next offset comes from and
/// when to stop.
#[derive(Debug)]
struct Plan {
    rw: Rw,
    read_pct: u32,
    bs: u64,
    blocks: u64,
    fsync: u32,
    ramp_end: Instant,
    deadline: Instant,
    ops_limit: Option<u64>,
    issued: AtomicU64,
    seq: AtomicU64,
    writes: AtomicU64,
    stop: Arc<AtomicBool>,
    /// Set when another job of the same run failed: stop early too.
    abort: Option<Arc<AtomicBool>>,
}

/// The generator's pseudo-random step (xorshift64).
pub fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

impl Plan {
    fn new(job: &Job, size: u64, limits: Limits, stop: Arc<AtomicBool>) -> Plan {
        let start = Instant::now();
        let blocks = (size / job.bs).max(1);
        let (ramp_end, deadline, ops_limit) = match job.runtime {
            Some(rt) => (start + job.ramp_time, start + (job.ramp_time + rt).min(limits.max_job_time), None),
            None => (start, start + limits.max_job_time, Some(blocks)),
        };
        Plan {
            rw: job.rw,
            read_pct: job.read_pct(),
            bs: job.bs,
            blocks,
            fsync: job.fsync,
            ramp_end,
            deadline,
            ops_limit,
            issued: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            stop,
            abort: None,
        }
    }

    /// Also stops when `flag` is set.
    fn aborted_by(mut self, flag: Arc<AtomicBool>) -> Plan {
        self.abort = Some(flag);
        self
    }

    /// The next operation, or `None` when the job is over.
    fn next(&self, rng: &mut u64) -> Option<(Op, u64)> {
        if self.stop.load(Ordering::Relaxed)
            || self.abort.as_ref().is_some_and(|a| a.load(Ordering::Relaxed))
            || Instant::now() >= self.deadline
        {
            return None;
        }
        if let Some(limit) = self.ops_limit
            && self.issued.fetch_add(1, Ordering::Relaxed) >= limit
        {
            return None;
        }
        let op = match self.read_pct {
            100 => Op::Read,
            0 => Op::Write,
            p => {
                if xorshift(rng) % 100 < u64::from(p) {
                    Op::Read
                } else {
                    Op::Write
                }
            }
        };
        let block = if self.rw.random() {
            xorshift(rng) % self.blocks
        } else {
            self.seq.fetch_add(1, Ordering::Relaxed) % self.blocks
        };
        Some((op, block * self.bs))
    }

    /// Whether a flush is due after this write.
    fn flush_due(&self) -> bool {
        self.fsync > 0 && (self.writes.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(u64::from(self.fsync))
    }
}

fn side(h: &Histogram, bytes: u64, secs: f64) -> Side {
    let us = |ns: u64| ns as f64 / 1000.0;
    Side {
        ops: h.count(),
        bytes,
        iops: h.count() as f64 / secs,
        bw_bytes: bytes as f64 / secs,
        lat_mean_us: h.mean() / 1000.0,
        lat_p50_us: us(h.percentile(50.0)),
        lat_p95_us: us(h.percentile(95.0)),
        lat_p99_us: us(h.percentile(99.0)),
    }
}

fn finish(name: &str, plan_ramp_end: Instant, total: &Recorder) -> JobRun {
    let end = total.last.unwrap_or(plan_ramp_end);
    let secs = end.saturating_duration_since(plan_ramp_end).as_secs_f64().max(1e-6);
    JobRun {
        name: name.to_owned(),
        elapsed_s: secs,
        read: side(&total.read, total.read_bytes, secs),
        write: side(&total.write, total.write_bytes, secs),
        flushes: total.flushes,
        read_hist: total.read.clone(),
        write_hist: total.write.clone(),
        engine: String::new(),
        client_cpu_s: total.cpu_ns as f64 / 1e9,
    }
}

/// Makes a write buffer unique to this write, the way fio's
/// `scramble_buffers` does: stamps `offset` and a per-slot counter into the
/// first 16 bytes of every 512-byte sector. Without it every write of a slot
/// carries the same bytes, which a deduplicating or compressing layer (a
/// content-addressed block store, a thin-provisioning host) absorbs for free.
pub fn scramble(buf: &mut [u8], offset: u64, counter: u64) {
    for (i, sector) in buf.chunks_mut(512).enumerate() {
        let stamp = offset.wrapping_add(i as u64 * 512);
        let n = sector.len().min(8);
        sector[..n].copy_from_slice(&stamp.to_le_bytes()[..n]);
        if sector.len() >= 16 {
            sector[8..16].copy_from_slice(&counter.to_le_bytes());
        }
    }
}

/// A pattern of incompressible bytes, so no layer can shortcut zeroes.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        let v = xorshift(&mut x).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// A target opened for a run: connections and files are made per job.
#[derive(Debug)]
pub enum Opened {
    Nbd {
        addr: String,
        export: String,
    },
    Files(FileTarget),
    S3 {
        client: aws_sdk_s3::Client,
        bucket: String,
        prefix: String,
    },
    /// An RBD image, driven by fio's rbd engine (we have no librbd client).
    Rbd {
        pool: String,
        image: String,
        conf: std::path::PathBuf,
    },
}

impl Opened {
    /// Checks the target is reachable (and creates the S3 bucket if missing).
    pub async fn open(spec: &TargetSpec, keys: &crate::target::S3Keys) -> anyhow::Result<Opened> {
        match spec {
            TargetSpec::Nbd { addr, export } => {
                let c = NbdClient::connect(addr.as_str(), export)
                    .await
                    .with_context(|| format!("connecting to nbd://{addr}/{export}"))?;
                let _ = c.disconnect().await;
                Ok(Opened::Nbd { addr: addr.clone(), export: export.clone() })
            }
            TargetSpec::Path(p) => Ok(Opened::Files(FileTarget::open(p)?)),
            TargetSpec::Rbd { pool, image, conf } => {
                let conf = TargetSpec::ceph_conf(conf);
                anyhow::ensure!(
                    conf.is_file(),
                    "{}: no such Ceph configuration (give rbd://POOL/IMAGE?conf=FILE or CEPH_CONF; \
                     `bench peers ceph up` makes one)",
                    conf.display()
                );
                Ok(Opened::Rbd { pool: pool.clone(), image: image.clone(), conf })
            }
            TargetSpec::S3 { bucket, prefix, endpoint, region } => {
                let (ak, sk) = keys.resolve()?;
                let client = crate::target::s3_client(endpoint, region, &ak, &sk);
                if client.head_bucket().bucket(bucket).send().await.is_err() {
                    client
                        .create_bucket()
                        .bucket(bucket)
                        .send()
                        .await
                        .with_context(|| format!("creating bucket {bucket} at {endpoint}"))?;
                }
                Ok(Opened::S3 { client, bucket: bucket.clone(), prefix: prefix.clone() })
            }
        }
    }

    /// Removes what the run created (job files in a directory).
    pub fn cleanup(&self) {
        if let Opened::Files(f) = self {
            f.cleanup();
        }
    }

    /// Runs `job` once.
    pub async fn run(&self, job: &Job, limits: Limits, stop: Arc<AtomicBool>) -> anyhow::Result<JobRun> {
        match self {
            Opened::Nbd { addr, export } => run_nbd(addr, export, job, limits, stop).await,
            Opened::Files(f) => {
                let f = f.clone();
                let job = job.clone();
                tokio::task::spawn_blocking(move || run_files(&f, &job, limits, stop)).await?
            }
            Opened::S3 { client, bucket, prefix } => run_s3(client, bucket, prefix, job, limits, stop).await,
            Opened::Rbd { pool, image, conf } => {
                let target =
                    crate::fio::FioTarget::Rbd { pool: pool.clone(), image: image.clone(), conf: conf.clone() };
                let job = job.clone();
                tokio::task::spawn_blocking(move || run_fio(&target, &job)).await?
            }
        }
    }
}

/// How `rbd://` targets run.
pub const ENGINE_FIO_RBD: &str = "fio --ioengine=rbd (librbd): fio's figures; no latency histogram";

/// Runs `job` with fio (for targets only fio can drive) and reports its
/// figures as ours. Percentiles are fio's; there is no histogram to merge.
fn run_fio(target: &crate::fio::FioTarget, job: &Job) -> anyhow::Result<JobRun> {
    if let crate::fio::FioTarget::Rbd { pool, image, conf } = target {
        crate::ceph::ensure_image(conf, pool, image, job.size)?;
    }
    if job.runtime.is_none() {
        bail!("job {}: fio-driven targets need a time-based job (runtime)", job.name);
    }
    let r = crate::fio::run_job(target, job, None)?;
    let side = |f: &crate::fio::FioResult| Side {
        ops: f.ops,
        bytes: f.bytes,
        iops: f.iops,
        bw_bytes: f.bw_bytes,
        lat_mean_us: f.lat_mean_us,
        lat_p50_us: f.lat_p50_us,
        lat_p95_us: f.lat_p95_us,
        lat_p99_us: f.lat_p99_us,
    };
    Ok(JobRun {
        name: job.name.clone(),
        elapsed_s: r.read.runtime_s.max(r.write.runtime_s),
        read: side(&r.read),
        write: side(&r.write),
        flushes: 0,
        read_hist: Histogram::default(),
        write_hist: Histogram::default(),
        engine: ENGINE_FIO_RBD.into(),
        client_cpu_s: r.cpu_s,
    })
}

/// Lets the job threads of one run start together (fio also sets every job
/// up before any starts) and stop together when one of them fails.
#[derive(Debug, Clone)]
struct Gate {
    waiting: Arc<(std::sync::Mutex<u32>, std::sync::Condvar)>,
    failed: Arc<AtomicBool>,
}

impl Gate {
    fn new(jobs: u32) -> Gate {
        Gate { waiting: Arc::new((std::sync::Mutex::new(jobs), std::sync::Condvar::new())), failed: Arc::default() }
    }

    /// Blocks until every job is ready; false when one failed instead.
    fn ready(&self) -> bool {
        let (m, cv) = &*self.waiting;
        let Ok(mut left) = m.lock() else { return false };
        *left = left.saturating_sub(1);
        cv.notify_all();
        while *left > 0 && !self.failed.load(Ordering::Acquire) {
            left = match cv.wait(left) {
                Ok(l) => l,
                Err(_) => return false,
            };
        }
        !self.failed.load(Ordering::Acquire)
    }

    fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        let (m, cv) = &*self.waiting;
        let _guard = m.lock();
        cv.notify_all();
    }
}

/// What one job thread hands back: its measurements and when it started
/// measuring, or `None` when it stood down because another job failed.
type JobOutcome = anyhow::Result<Option<(Recorder, Instant)>>;

/// Runs `body(j, gate)` for every job `j` of `job`, each on its own OS
/// thread with a current-thread runtime, and merges what they measured.
/// `body` connects, calls `gate.ready()` (standing down with `Ok(None)`
/// when it says false), then runs its `iodepth` tasks.
async fn on_job_threads<F, Fut>(job: &Job, limits: Limits, body: F) -> anyhow::Result<JobRun>
where
    F: Fn(u32, Gate) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = JobOutcome>,
{
    let gate = Gate::new(job.numjobs);
    let body = Arc::new(body);
    let mut threads = Vec::new();
    for j in 0..job.numjobs {
        let (body, g) = (body.clone(), gate.clone());
        let spawned = std::thread::Builder::new().name(format!("bench-job-{j}")).spawn(move || -> JobOutcome {
            let r = limits
                .pin()
                .and_then(|()| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .context("starting a job's runtime")
                })
                .and_then(|rt| rt.block_on(body(j, g.clone())));
            if r.is_err() {
                g.fail();
            }
            r
        });
        match spawned {
            Ok(t) => threads.push(t),
            Err(e) => {
                gate.fail();
                threads.push(std::thread::spawn(move || Err(anyhow::Error::from(e).context("starting a job thread"))));
            }
        }
    }
    let outcomes = tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a job thread panicked"))))
            .collect::<Vec<JobOutcome>>()
    })
    .await?;
    let mut total = Recorder::default();
    let mut start: Option<Instant> = None;
    for o in outcomes {
        if let Some((rec, ramp_end)) = o? {
            total.merge(&rec);
            start = Some(start.map_or(ramp_end, |s| s.min(ramp_end)));
        }
    }
    let start = start.context("no job ran")?;
    Ok(finish(&job.name, start, &total))
}

async fn run_nbd(addr: &str, export: &str, job: &Job, limits: Limits, stop: Arc<AtomicBool>) -> anyhow::Result<JobRun> {
    let (addr, export, shared_job) = (addr.to_owned(), export.to_owned(), Arc::new(job.clone()));
    on_job_threads(job, limits, move |j, gate| {
        let (addr, export, job, stop) = (addr.clone(), export.clone(), shared_job.clone(), stop.clone());
        async move {
            let conn = NbdClient::connect(addr.as_str(), &export)
                .await
                .with_context(|| format!("connecting to {addr}/{export}"))?;
            if job.rw.writes() && conn.info().read_only() {
                bail!("nbd://{addr}/{export} is read-only; job {} writes", job.name);
            }
            let size = job.size.min(conn.size()) / job.bs * job.bs;
            if size == 0 {
                bail!("nbd://{addr}/{export} ({} bytes) is smaller than bs {}", conn.size(), job.bs);
            }
            let conn = Arc::new(conn);
            if !gate.ready() {
                return Ok(None);
            }
            // Every task of this job runs on this thread (a current-thread
            // runtime), so its CPU clock is the job's client cost.
            let cpu0 = thread_cpu_ns();
            let plan = Arc::new(Plan::new(&job, size, limits, stop).aborted_by(gate.failed.clone()));
            let mut tasks = tokio::task::JoinSet::new();
            for slot in 0..job.iodepth {
                let (conn, plan) = (conn.clone(), plan.clone());
                let mut rng =
                    0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(j) << 32 | u64::from(slot)).wrapping_mul(0x2545_F491);
                let bs = job.bs as usize;
                tasks.spawn(async move {
                    let mut rec = Recorder::default();
                    let mut data = vec![0u8; bs];
                    fill(&mut data, rng);
                    let mut buf = vec![0u8; bs];
                    let mut writes = 0u64;
                    while let Some((op, off)) = plan.next(&mut rng) {
                        if op == Op::Write {
                            writes += 1;
                            scramble(&mut data, off, writes);
                        }
                        let t = Instant::now();
                        match op {
                            Op::Read => buf = conn.read_into(buf, off).await?,
                            Op::Write => conn.write(off, &data, false).await?,
                        }
                        rec.record(&plan, op, t, bs as u64);
                        if op == Op::Write && plan.flush_due() {
                            conn.flush().await?;
                            rec.flushes += 1;
                        }
                    }
                    anyhow::Ok(rec)
                });
            }
            let mut rec = join_all(tasks).await?;
            rec.cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
            if let Ok(c) = Arc::try_unwrap(conn) {
                let _ = c.disconnect().await;
            }
            Ok(Some((rec, plan.ramp_end)))
        }
    })
    .await
}

async fn join_all(mut tasks: tokio::task::JoinSet<anyhow::Result<Recorder>>) -> anyhow::Result<Recorder> {
    let mut total = Recorder::default();
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(rec)) => total.merge(&rec),
            // The tasks aborted after the first error end as cancelled:
            // report that error, not their cancellation.
            Err(e) if e.is_cancelled() && first_err.is_some() => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
                tasks.abort_all();
            }
            Err(e) => {
                first_err.get_or_insert(e.into());
                tasks.abort_all();
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(total),
    }
}

/// How the file engine ran a job: what fio would call its ioengine.
pub const ENGINE_AIO: &str = "aio: one thread per job, Linux AIO with iodepth in flight (as fio's libaio)";
/// The fallback where the kernel refuses AIO.
pub const ENGINE_THREADS: &str = "threads: one thread per request slot with pread/pwrite (Linux AIO unavailable here)";

fn run_files(f: &FileTarget, job: &Job, limits: Limits, stop: Arc<AtomicBool>) -> anyhow::Result<JobRun> {
    let handles = f.prepare(job)?;
    let size = job.size.min(handles[0].size) / job.bs * job.bs;
    if size == 0 {
        bail!("{} ({} bytes) is smaller than bs {}", f.path().display(), handles[0].size, job.bs);
    }
    let plans: Vec<Arc<Plan>> = handles.iter().map(|_| Arc::new(Plan::new(job, size, limits, stop.clone()))).collect();
    // One thread per job keeping iodepth requests in flight, as a fio job
    // does; one thread per slot only where the kernel refuses AIO (ENOSYS,
    // or a seccomp profile).
    let aio = crate::aio::Context::new(job.iodepth).is_ok();
    let results: Vec<anyhow::Result<Recorder>> = std::thread::scope(|s| {
        let mut threads = Vec::new();
        for (j, (h, plan)) in handles.iter().zip(&plans).enumerate() {
            let seed =
                |slot: u32| 0x9E37_79B9_7F4A_7C15u64 ^ ((j as u64) << 32 | u64::from(slot)).wrapping_mul(0x2545_F491);
            if aio {
                let seeds: Vec<u64> = (0..job.iodepth).map(seed).collect();
                threads.push(s.spawn(move || {
                    limits.pin()?;
                    aio_job(h, plan, job.bs as usize, seeds)
                }));
                continue;
            }
            for slot in 0..job.iodepth {
                let mut rng = seed(slot);
                let bs = job.bs as usize;
                threads.push(s.spawn(move || {
                    limits.pin()?;
                    let cpu0 = thread_cpu_ns();
                    let mut rec = Recorder::default();
                    let mut data = AlignedBuf::new(bs)?;
                    fill(data.as_mut(), rng);
                    let mut buf = AlignedBuf::new(bs)?;
                    let mut writes = 0u64;
                    while let Some((op, off)) = plan.next(&mut rng) {
                        if op == Op::Write {
                            writes += 1;
                            scramble(data.as_mut(), off, writes);
                        }
                        let t = Instant::now();
                        match op {
                            Op::Read => files::pread_full(&h.file, buf.as_mut(), off)?,
                            Op::Write => files::pwrite_full(&h.file, data.as_ref(), off)?,
                        }
                        rec.record(plan, op, t, bs as u64);
                        if op == Op::Write && plan.flush_due() {
                            h.file.sync_all().context("fsync")?;
                            rec.flushes += 1;
                        }
                    }
                    rec.cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
                    anyhow::Ok(rec)
                }));
            }
        }
        threads.into_iter().map(|t| t.join().unwrap_or_else(|_| Err(anyhow::anyhow!("I/O thread panicked")))).collect()
    });
    let mut total = Recorder::default();
    for r in results {
        total.merge(&r?);
    }
    let mut run = finish(&job.name, plans[0].ramp_end, &total);
    run.engine = (if aio { ENGINE_AIO } else { ENGINE_THREADS }).to_owned();
    Ok(run)
}

/// One request slot of an AIO job: its buffers and what it has in flight.
struct AioSlot {
    data: AlignedBuf,
    buf: AlignedBuf,
    rng: u64,
    writes: u64,
    op: Op,
    started: Instant,
}

impl AioSlot {
    /// Prepares this slot's next request in `cb`; false when the job is over.
    fn prepare(&mut self, i: usize, cb: &mut crate::aio::Iocb, plan: &Plan, fd: u32) -> bool {
        let Some((op, off)) = plan.next(&mut self.rng) else { return false };
        let (opcode, ptr) = match op {
            Op::Write => {
                self.writes += 1;
                scramble(self.data.as_mut(), off, self.writes);
                (crate::aio::CMD_PWRITE, self.data.as_mut().as_mut_ptr())
            }
            Op::Read => (crate::aio::CMD_PREAD, self.buf.as_mut().as_mut_ptr()),
        };
        let nbytes = self.buf.as_ref().len() as u64;
        *cb = crate::aio::Iocb {
            data: i as u64,
            opcode,
            fildes: fd,
            buf: ptr as u64,
            nbytes,
            offset: off as i64,
            ..crate::aio::Iocb::default()
        };
        self.op = op;
        self.started = Instant::now();
        true
    }
}

/// One file job on one thread: `seeds.len()` request slots kept in flight
/// through a Linux AIO context, each resubmitted as soon as it completes.
fn aio_job(h: &files::Handle, plan: &Plan, bs: usize, seeds: Vec<u64>) -> anyhow::Result<Recorder> {
    use crate::aio::{Context, IoEvent, Iocb};
    use std::os::fd::AsRawFd;
    let depth = seeds.len();
    // The slots (and their buffers) first: locals drop in reverse order, so
    // the context, whose drop waits for requests in flight, goes before the
    // memory those requests use.
    let mut slots = Vec::with_capacity(depth);
    for seed in seeds {
        let mut data = AlignedBuf::new(bs)?;
        fill(data.as_mut(), seed);
        let buf = AlignedBuf::new(bs)?;
        slots.push(AioSlot { data, buf, rng: seed, writes: 0, op: Op::Read, started: Instant::now() });
    }
    let mut cbs = vec![Iocb::default(); depth];
    let cpu0 = thread_cpu_ns();
    let ctx = Context::new(depth as u32).context("io_setup")?;
    let fd = h.file.as_raw_fd() as u32;
    let mut rec = Recorder::default();
    let mut queue: Vec<usize> = Vec::with_capacity(depth);
    let mut inflight = 0usize;
    let mut failed: Option<anyhow::Error> = None;
    let mut events = vec![IoEvent::default(); depth];
    for (i, slot) in slots.iter_mut().enumerate() {
        if slot.prepare(i, &mut cbs[i], plan, fd) {
            queue.push(i);
        }
    }
    let give_up = plan.deadline + Duration::from_secs(60);
    while inflight > 0 || (!queue.is_empty() && failed.is_none()) {
        if failed.is_none() && !queue.is_empty() {
            let mut ptrs: Vec<*mut Iocb> = queue.iter().map(|&i| &raw mut cbs[i]).collect();
            // SAFETY: every iocb names a buffer of `slots`, which is neither
            // touched nor freed until the request is reaped or the context
            // (dropped first) has waited for it.
            match unsafe { ctx.submit(&mut ptrs) } {
                Ok(n) => {
                    queue.drain(..n);
                    inflight += n;
                }
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && inflight > 0 => {}
                Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => std::thread::sleep(Duration::from_millis(1)),
                Err(e) => failed = Some(anyhow::Error::from(e).context("io_submit")),
            }
        }
        if inflight == 0 {
            if Instant::now() > give_up {
                bail!("the kernel did not take the job's requests for 60 s past its end");
            }
            continue;
        }
        let n = ctx.reap(1, &mut events, Duration::from_secs(1)).context("io_getevents")?;
        if n == 0 && Instant::now() > give_up {
            bail!("{inflight} requests still in flight 60 s past the job's end");
        }
        for e in &events[..n] {
            let i = e.data as usize;
            inflight -= 1;
            let (op, started) = (slots[i].op, slots[i].started);
            if e.res != bs as i64 {
                let what = if op == Op::Read { "read" } else { "write" };
                let why = if e.res < 0 {
                    std::io::Error::from_raw_os_error(-e.res as i32).to_string()
                } else {
                    format!("{} of {bs} bytes", e.res)
                };
                failed.get_or_insert_with(|| anyhow::anyhow!("{what} at {}: {why}", cbs[i].offset));
                continue;
            }
            rec.record(plan, op, started, bs as u64);
            if op == Op::Write && plan.flush_due() {
                // As fio does for fsync=N: a synchronous flush on the job's thread.
                if let Err(e) = h.file.sync_all() {
                    failed.get_or_insert(anyhow::Error::from(e).context("fsync"));
                }
                rec.flushes += 1;
            }
            if failed.is_none() && slots[i].prepare(i, &mut cbs[i], plan, fd) {
                queue.push(i);
            }
        }
    }
    drop(ctx);
    rec.cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
    match failed {
        Some(e) => Err(e),
        None => Ok(rec),
    }
}

/// Distinct keys an S3 job cycles over: `size / bs`, capped by count and
/// so that prefilling stays under 256 MiB.
pub fn s3_keys(job: &Job) -> u64 {
    (job.size / job.bs).min(S3_MAX_KEYS).min(((256u64 << 20) / job.bs).max(1)).max(1)
}

async fn run_s3(
    client: &aws_sdk_s3::Client,
    bucket: &str,
    prefix: &str,
    job: &Job,
    limits: Limits,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<JobRun> {
    let keys = s3_keys(job);
    let conf = client.config().clone();
    let (bucket, prefix, shared_job) = (bucket.to_owned(), prefix.to_owned(), Arc::new(job.clone()));
    on_job_threads(job, limits, move |j, gate| {
        let (conf, bucket, prefix, job, stop) =
            (conf.clone(), bucket.clone(), prefix.clone(), shared_job.clone(), stop.clone());
        async move {
            // A client of its own: its connection pool lives on this job's
            // runtime and goes with it.
            let client = aws_sdk_s3::Client::from_conf(conf);
            let (name, kbs) = (job.name.clone(), job.bs);
            let key = move |off: u64| format!("{prefix}bench-{name}-{j}/{:06}", off / kbs);
            let mut data = vec![0u8; job.bs as usize];
            fill(&mut data, 7);
            let body = bytes::Bytes::from(data);
            if job.rw.reads() {
                // Objects must exist before they are read; not timed.
                let mut puts = tokio::task::JoinSet::new();
                for i in 0..keys {
                    let (c, b, k, body) = (client.clone(), bucket.clone(), key(i * job.bs), body.clone());
                    puts.spawn(async move { c.put_object().bucket(b).key(k).body(body.into()).send().await });
                    if puts.len() >= 16
                        && let Some(r) = puts.join_next().await
                    {
                        r?.context("prefilling S3 objects")?;
                    }
                }
                while let Some(r) = puts.join_next().await {
                    r?.context("prefilling S3 objects")?;
                }
            }
            if !gate.ready() {
                return Ok(None);
            }
            let cpu0 = thread_cpu_ns();
            let plan = Arc::new(Plan::new(&job, keys * job.bs, limits, stop).aborted_by(gate.failed.clone()));
            let mut tasks = tokio::task::JoinSet::new();
            for slot in 0..job.iodepth {
                let (c, b, plan, body) = (client.clone(), bucket.clone(), plan.clone(), body.clone());
                let mut rng =
                    0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(j) << 32 | u64::from(slot)).wrapping_mul(0x2545_F491);
                let key = key.clone();
                let bs = job.bs;
                tasks.spawn(async move {
                    let mut rec = Recorder::default();
                    let mut data = body.to_vec();
                    let mut writes = 0u64;
                    while let Some((op, off)) = plan.next(&mut rng) {
                        // A distinct body per PUT, built before the clock starts:
                        // LightningStor stores blocks by content hash, so a
                        // repeated body would be deduplicated, not stored.
                        let body = if op == Op::Write {
                            writes += 1;
                            scramble(&mut data, off ^ (u64::from(j) << 48 | u64::from(slot) << 40), writes);
                            bytes::Bytes::copy_from_slice(&data)
                        } else {
                            bytes::Bytes::new()
                        };
                        let t = Instant::now();
                        let k = key(off);
                        let n = match op {
                            Op::Read => {
                                let r = c
                                    .get_object()
                                    .bucket(&b)
                                    .key(&k)
                                    .send()
                                    .await
                                    .with_context(|| format!("GET {k}"))?;
                                r.body.collect().await.with_context(|| format!("GET {k} body"))?.into_bytes().len()
                                    as u64
                            }
                            Op::Write => {
                                c.put_object()
                                    .bucket(&b)
                                    .key(&k)
                                    .body(body.into())
                                    .send()
                                    .await
                                    .with_context(|| format!("PUT {k}"))?;
                                bs
                            }
                        };
                        rec.record(&plan, op, t, n);
                    }
                    anyhow::Ok(rec)
                });
            }
            let mut rec = join_all(tasks).await?;
            rec.cpu_ns = thread_cpu_ns().saturating_sub(cpu0);
            Ok(Some((rec, plan.ramp_end)))
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::{fill, scramble};

    #[test]
    fn scrambled_writes_differ_in_every_sector() {
        let mut a = vec![0u8; 64 << 10];
        fill(&mut a, 7);
        let mut b = a.clone();
        scramble(&mut a, 0, 1);
        scramble(&mut b, 0, 2);
        assert!(a.chunks(512).zip(b.chunks(512)).all(|(x, y)| x != y), "same offset, next write");
        let mut c = a.clone();
        scramble(&mut c, 1 << 20, 1);
        assert!(a.chunks(512).zip(c.chunks(512)).all(|(x, y)| x != y), "other offset, same count");
        // Sectors within one buffer differ too, so no 512-byte dedup inside a write.
        let mut sectors: Vec<&[u8]> = a.chunks(512).collect();
        sectors.sort();
        sectors.dedup();
        assert_eq!(sectors.len(), a.len() / 512);
    }

    #[test]
    fn scramble_handles_short_and_odd_buffers() {
        for len in [0usize, 1, 7, 8, 15, 16, 511, 513] {
            let mut v = vec![0xAAu8; len];
            scramble(&mut v, u64::MAX, u64::MAX);
            assert_eq!(v.len(), len);
        }
    }
}
