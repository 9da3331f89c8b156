//! `fresh-bench-storage`: the whole-stack report in the shape of the seed
//! report (network baseline, local disk, CoronaFS, cross-worker read,
//! LightningStor large object and batches, VM image path, assessment).
//!
//! Every figure is a [`Summary`] over iterations, interleaved so machine
//! noise falls on every side alike; a section whose service is not in this
//! build or not in the cluster file is [`Section::NotAvailable`] with the
//! reason, never a made-up number.

pub mod assess;
pub mod markdown;
pub mod measure;
pub mod vm;

use crate::cluster::Cluster;
use crate::loadgen::Opened;
use crate::progress::Progress;
use crate::stats::Summary;
use anyhow::Context;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// A report section: measured, or absent with the reason.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Section<T> {
    Measured(T),
    NotAvailable { reason: String },
}

impl<T> Section<T> {
    pub fn get(&self) -> Option<&T> {
        match self {
            Section::Measured(t) => Some(t),
            Section::NotAvailable { .. } => None,
        }
    }
    fn na(reason: impl Into<String>) -> Self {
        Section::NotAvailable { reason: reason.into() }
    }
}

/// Sizes and repetitions.
#[derive(Debug, Clone)]
pub struct Options {
    pub quick: bool,
    pub iterations: usize,
    /// Seconds per block job.
    pub block_runtime: Duration,
    /// Volume / local file size.
    pub volume_size: u64,
    pub cross_worker_size: u64,
    pub large_object: usize,
    pub batch_count: usize,
    pub batch_object: usize,
    pub parallel_jobs: usize,
    pub net_time: Duration,
    /// Run the nbdkit / qemu-nbd comparison too.
    pub peers: bool,
    /// Allocated bytes of the main (4 GiB virtual) VM image.
    pub vm_artifact: u64,
    /// Allocated bytes of the 1 GiB and 16 GiB VM images.
    pub vm_side_artifact: u64,
    /// Warm `CreateVolume` calls per virtual size.
    pub vm_warm_count: usize,
    /// Link rate (bytes/s) when emulated.
    pub link_rate: Option<u64>,
}

impl Options {
    pub fn new(quick: bool) -> Options {
        if quick {
            Options {
                quick,
                iterations: 1,
                block_runtime: Duration::from_millis(1500),
                volume_size: 64 << 20,
                cross_worker_size: 32 << 20,
                large_object: 32 << 20,
                batch_count: 32,
                batch_object: 1 << 20,
                parallel_jobs: 8,
                net_time: Duration::from_secs(1),
                peers: false,
                vm_artifact: 32 << 20,
                vm_side_artifact: 8 << 20,
                vm_warm_count: 10,
                link_rate: None,
            }
        } else {
            Options {
                quick,
                iterations: 3,
                block_runtime: Duration::from_secs(5),
                volume_size: 1 << 30,
                cross_worker_size: 256 << 20,
                large_object: 256 << 20,
                batch_count: 32,
                batch_object: 4 << 20,
                parallel_jobs: 8,
                net_time: Duration::from_secs(3),
                peers: true,
                vm_artifact: 256 << 20,
                vm_side_artifact: 32 << 20,
                vm_warm_count: 21,
                link_rate: None,
            }
        }
    }

    /// Shrinks transfer sizes so a slow emulated link still ends in time.
    pub fn fit_link(&mut self, rate: Option<u64>) {
        let Some(rate) = rate else { return };
        self.link_rate = Some(rate);
        // About 10 s of link time per transfer at most.
        let cap = (rate * 10).max(4 << 20);
        let cap_mib = |v: u64| (v.min(cap) >> 20).max(1) << 20;
        self.volume_size = cap_mib(self.volume_size);
        self.cross_worker_size = cap_mib(self.cross_worker_size);
        self.large_object = cap_mib(self.large_object as u64) as usize;
        let batch_cap = (cap / self.batch_count as u64).max(256 << 10);
        self.batch_object = self.batch_object.min(batch_cap as usize);
        self.vm_artifact = cap_mib(self.vm_artifact);
        self.vm_side_artifact = cap_mib(self.vm_side_artifact).min(self.vm_artifact);
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Network {
    pub tcp_mib_s: Summary,
    pub tcp_retransmits: Summary,
    pub method: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Block {
    pub seq_write_mib_s: Summary,
    pub seq_read_mib_s: Summary,
    pub rand_read_4k_iops: Summary,
    pub depth32_write_mib_s: Summary,
    pub depth32_read_mib_s: Summary,
    pub size_bytes: u64,
    pub runtime_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CrossWorker {
    pub read_mib_s: Summary,
    pub size_bytes: u64,
    pub verified: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Objects {
    pub count: usize,
    pub object_bytes: usize,
    pub jobs: usize,
    pub upload_mib_s: Summary,
    pub download_mib_s: Summary,
    pub put_per_s: Summary,
    pub get_per_s: Summary,
    pub nodes: usize,
}

/// The VM image path (see [`vm`]).
#[derive(Debug, Clone, Serialize)]
pub struct VmImage {
    pub format: String,
    /// Bytes of the main image's artifact (the qcow2 file).
    pub artifact_bytes: u64,
    /// Virtual size of the main image.
    pub virtual_size: u64,
    /// Allocated guest bytes in the main image.
    pub data_bytes: u64,
    pub create_image_s: Summary,
    pub create_image_mib_s: Summary,
    /// Cold: the image's first `CreateVolume`.
    pub first_create_volume_s: Summary,
    /// The image's second `CreateVolume` (warm).
    pub second_create_volume_s: Summary,
    /// Warm `CreateVolume` per virtual size.
    pub warm: Vec<WarmCreate>,
    /// Volumes were read back over NBD and matched the image.
    pub verified: bool,
    /// Where the emulated link sits on this path.
    pub link_placement: String,
    /// Issue 6's targets with this run's ratio to each.
    pub targets: Vec<Target>,
}

/// Warm `CreateVolume` latency for one virtual size.
#[derive(Debug, Clone, Serialize)]
pub struct WarmCreate {
    pub virtual_size: u64,
    pub artifact_bytes: u64,
    pub n: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub max_ms: f64,
    /// The cold `CreateVolume` that cached this image (None: the main image's, above).
    pub cold_create_volume_s: Option<f64>,
}

/// A performance target: the figure, the target, and `ratio` = how far
/// the figure is past the target (>= 1 is met, < 1 missed by that factor).
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub key: String,
    pub what: String,
    pub value: f64,
    pub target: String,
    pub ratio: f64,
    pub met: bool,
}

/// One ratio of the assessment.
#[derive(Debug, Clone, Serialize)]
pub struct Ratio {
    pub key: String,
    pub pct: f64,
    pub text: String,
}

/// Everything `results.json` holds.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub generated_unix: u64,
    pub command: String,
    pub cluster: String,
    pub link: String,
    pub quick: bool,
    pub iterations: usize,
    pub network: Section<Network>,
    pub local_disk: Section<Block>,
    pub coronafs: Section<Block>,
    pub cross_worker: Section<CrossWorker>,
    pub s3_large_object: Section<Objects>,
    pub s3_small_batch: Section<Objects>,
    pub s3_parallel_batch: Section<Objects>,
    pub vm_image: Section<VmImage>,
    pub nbd_peers: Section<crate::nbd_compare::Report>,
    pub assessment: Vec<Ratio>,
}

const VOLUME: &str = "bench-vol";
const BUCKET: &str = "bench";

fn col<T>(runs: &[T], f: impl Fn(&T) -> f64) -> Summary {
    Summary::of(&runs.iter().map(f).collect::<Vec<_>>())
}

fn block_summary(runs: &[measure::BlockRun], size: u64, runtime: Duration) -> Block {
    Block {
        seq_write_mib_s: col(runs, |r| r.seq_write_mib_s),
        seq_read_mib_s: col(runs, |r| r.seq_read_mib_s),
        rand_read_4k_iops: col(runs, |r| r.rand_read_4k_iops),
        depth32_write_mib_s: col(runs, |r| r.depth32_write_mib_s),
        depth32_read_mib_s: col(runs, |r| r.depth32_read_mib_s),
        size_bytes: size,
        runtime_s: runtime.as_secs_f64(),
    }
}

fn objects_summary(runs: &[measure::Transfer], count: usize, size: usize, jobs: usize, nodes: usize) -> Objects {
    Objects {
        count,
        object_bytes: size,
        jobs,
        upload_mib_s: col(runs, |r| r.up_mib_s),
        download_mib_s: col(runs, |r| r.down_mib_s),
        put_per_s: col(runs, |r| r.put_per_s),
        get_per_s: col(runs, |r| r.get_per_s),
        nodes,
    }
}

/// Steps the progress bar counts.
pub fn steps(opts: &Options) -> u64 {
    2 + 6 * opts.iterations as u64 + u64::from(opts.peers) + 2 + opts.iterations as u64
}

/// Runs every section against `cluster`. `scratch` holds the local-disk
/// baseline file.
pub async fn run(
    cluster: &Cluster,
    opts: &Options,
    scratch: &std::path::Path,
    command: String,
    progress: &Progress,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Report> {
    let ep = &cluster.endpoints;
    let it = opts.iterations;
    let jobs = measure::block_jobs(opts.volume_size, opts.block_runtime)?;

    // Network baseline: through the same (emulated) link as the services.
    progress.step("network baseline (TCP throughput, retransmits)");
    let (sink, sink_task) = crate::netprobe::sink().await?;
    let shaper =
        if cluster.link.is_loopback() { None } else { Some(crate::shaper::Shaper::start(sink, cluster.link).await?) };
    let probe_addr = shaper.as_ref().map_or(sink, |s| s.addr);
    let mut probes = Vec::new();
    for _ in 0..it {
        probes.push(crate::netprobe::run(probe_addr, opts.net_time, u64::MAX).await?);
    }
    if let Some(s) = shaper {
        s.shutdown().await;
    }
    sink_task.abort();
    let network = Section::Measured(Network {
        tcp_mib_s: col(&probes, |p| p.bytes_per_s / 1048576.0),
        tcp_retransmits: col(&probes, |p| f64::from(p.retransmits)),
        method: format!("bench TCP probe (bulk send, TCP_INFO retransmits), {}", cluster.link.describe()),
    });

    // Set-up: the local file and the volume, filled with data.
    progress.step("set-up: local baseline file and CoronaFS volume");
    let local_file = scratch.join("local-disk");
    let local = Opened::Files(crate::files::FileTarget::open(&local_file)?);
    let corona = match (&ep.coronafs, &cluster.setup.coronafs) {
        (Some(c), Some(setup)) => {
            crate::cluster::create_volume(&setup.api, VOLUME, opts.volume_size).await.or_else(|e| {
                // A volume left by an earlier run against a deployed cluster is fine.
                if format!("{e:#}").contains("exists") { Ok(()) } else { Err(e) }
            })?;
            measure::prefill(setup, VOLUME, opts.volume_size).await.context("filling the CoronaFS volume")?;
            Some((c.clone(), Opened::Nbd { addr: c.nbd.clone(), export: VOLUME.into() }))
        }
        _ => None,
    };
    let s3 = ep.lightningstor.clone();
    if let Some(e) = &s3 {
        measure::ensure_bucket(&measure::s3(e, 0), BUCKET).await?;
    }

    let mut local_runs = Vec::new();
    let mut corona_runs = Vec::new();
    let mut cross = Vec::new();
    let (mut large, mut batch, mut par) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..it {
        let n = format!("iteration {}/{it}", i + 1);
        progress.step(&format!("{n}: local disk (seed-000 jobs, O_DIRECT)"));
        local_runs.push(measure::block(&local, &jobs, &stop).await.context("local disk")?);
        if let Some((c, target)) = &corona {
            progress.step(&format!("{n}: CoronaFS over NBD (seed-000 jobs)"));
            corona_runs.push(measure::block(target, &jobs, &stop).await.context("CoronaFS")?);
            progress.step(&format!("{n}: cross-worker read"));
            cross.push(measure::cross_worker(c, VOLUME, opts.cross_worker_size, i as u64).await?);
        } else {
            progress.step(&format!("{n}: CoronaFS not in the cluster"));
            progress.step("");
        }
        if let Some(e) = &s3 {
            progress.step(&format!("{n}: LightningStor large object ({} MiB)", opts.large_object >> 20));
            large.push(measure::objects(e, BUCKET, "large/", 1, opts.large_object, 1).await?);
            progress.step(&format!(
                "{n}: LightningStor batch ({} x {} KiB)",
                opts.batch_count,
                opts.batch_object >> 10
            ));
            batch.push(measure::objects(e, BUCKET, "batch/", opts.batch_count, opts.batch_object, 1).await?);
            progress.step(&format!("{n}: LightningStor parallel batch ({} jobs)", opts.parallel_jobs));
            par.push(
                measure::objects(e, BUCKET, "parallel/", opts.batch_count, opts.batch_object, opts.parallel_jobs)
                    .await?,
            );
            let c = measure::s3(e, 0);
            for p in ["large/", "batch/", "parallel/"] {
                measure::delete_prefix(&c, BUCKET, p).await;
            }
        } else {
            for _ in 0..3 {
                progress.step("LightningStor not in the cluster");
            }
        }
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            anyhow::bail!("interrupted");
        }
    }
    local.cleanup();
    let _ = std::fs::remove_file(&local_file);

    let nodes = s3.as_ref().map_or(0, |e| e.endpoints.len());
    let no_corona = "CoronaFS is not in the cluster file";
    let no_s3 = "LightningStor is not in the cluster file";
    let mut report = Report {
        generated_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        command,
        cluster: cluster.origin.clone(),
        link: cluster.link.describe(),
        quick: opts.quick,
        iterations: it,
        network,
        local_disk: Section::Measured(block_summary(&local_runs, opts.volume_size, opts.block_runtime)),
        coronafs: if corona.is_some() {
            Section::Measured(block_summary(&corona_runs, opts.volume_size, opts.block_runtime))
        } else {
            Section::na(no_corona)
        },
        cross_worker: if corona.is_some() {
            Section::Measured(CrossWorker {
                read_mib_s: Summary::of(&cross),
                size_bytes: opts.cross_worker_size,
                verified: true,
            })
        } else {
            Section::na(no_corona)
        },
        s3_large_object: if s3.is_some() {
            Section::Measured(objects_summary(&large, 1, opts.large_object, 1, nodes))
        } else {
            Section::na(no_s3)
        },
        s3_small_batch: if s3.is_some() {
            Section::Measured(objects_summary(&batch, opts.batch_count, opts.batch_object, 1, nodes))
        } else {
            Section::na(no_s3)
        },
        s3_parallel_batch: if s3.is_some() {
            Section::Measured(objects_summary(&par, opts.batch_count, opts.batch_object, opts.parallel_jobs, nodes))
        } else {
            Section::na(no_s3)
        },
        vm_image: Section::na("PlasmaVMC is not in the cluster file"),
        nbd_peers: Section::na("skipped (--quick, or --no-peers); run `bench nbd-compare`"),
        assessment: Vec::new(),
    };
    if let Some(p) = &ep.plasmavmc {
        let vo = vm::VmOptions {
            artifact_data: opts.vm_artifact,
            side_data: opts.vm_side_artifact,
            warm_count: opts.vm_warm_count,
            iterations: it,
            link_rate: opts.link_rate,
        };
        let placement = cluster.vm_link_placement();
        let r = vm::measure(p, cluster.setup.coronafs.as_ref(), &vo, scratch, &placement, |m| progress.step(m)).await;
        // A failure here (a PlasmaVMC or LightningStor error) is reported in
        // the section, with the reason, instead of losing the whole run.
        report.vm_image = match r {
            Ok(v) => Section::Measured(v),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the VM image path failed");
                Section::na(format!("the measurement failed: {e:#}"))
            }
        };
    } else {
        for _ in 0..2 + it {
            progress.step("PlasmaVMC not in the cluster");
        }
    }
    if opts.peers && cluster.data_dir().is_some() {
        progress.step("NBD peers: CoronaFS vs nbdkit vs qemu-nbd (fio)");
        report.nbd_peers = peers_section(scratch).await;
    }
    report.assessment = assess::ratios(&report);
    Ok(report)
}

async fn peers_section(scratch: &std::path::Path) -> Section<crate::nbd_compare::Report> {
    use coronafs::backend::IoEngine;
    let opts = crate::nbd_compare::Options {
        size: 256 << 20,
        iterations: 1,
        runtime_s: 2,
        peers: crate::peers::default_peers(&[IoEngine::Uring]),
    };
    let dir = scratch.join("peers");
    let r = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        let r = crate::nbd_compare::run(&opts, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        r
    })
    .await;
    match r {
        Ok(Ok(r)) => Section::Measured(r),
        Ok(Err(e)) => Section::na(format!("comparison failed: {e:#}")),
        Err(e) => Section::na(format!("comparison failed: {e}")),
    }
}
