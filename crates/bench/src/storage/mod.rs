//! `fresh-bench-storage`: the whole-stack report in the shape of the seed
//! report (network baseline, local disk, CoronaFS, cross-worker read,
//! LightningStor large object and batches, VM image path, assessment).
//!
//! Every figure is a [`Summary`] over iterations, interleaved so machine
//! noise falls on every side alike; a section whose service is not in this
//! build or not in the cluster file is [`Section::NotAvailable`] with the
//! reason, never a made-up number.

pub mod assess;
pub mod ceph;
pub mod conditions;
pub mod degraded;
pub mod failover;
pub mod markdown;
pub mod measure;
pub mod replicated;
pub mod vm;

use crate::agent::{BlockTarget, Event};
use crate::cluster::Cluster;
use crate::hist::Histogram;
use crate::progress::Progress;
use crate::stats::Summary;
use anyhow::Context;
use serde::Serialize;
use std::net::SocketAddr;
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
    /// Measure this Ceph (`bench peers ceph up`) beside the stack.
    pub ceph: Option<crate::ceph::Ceph>,
    /// Allocated bytes of the main (4 GiB virtual) VM image.
    pub vm_artifact: u64,
    /// Allocated bytes of the 1 GiB and 16 GiB VM images.
    pub vm_side_artifact: u64,
    /// Warm `CreateVolume` calls per virtual size.
    pub vm_warm_count: usize,
    /// Link rate (bytes/s) when emulated.
    pub link_rate: Option<u64>,
    /// Applied during a steady LightningStor load (the degraded section).
    pub fault: Option<crate::fault::Fault>,
    /// Length of that load.
    pub degraded_time: Duration,
    /// Failovers of the failover row (the primary stopped under a writing
    /// client); 0 leaves the row out.
    pub failover_trials: usize,
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
                // Long enough for iperf3 and our probe to agree on a real link.
                net_time: Duration::from_secs(2),
                peers: false,
                ceph: None,
                vm_artifact: 32 << 20,
                vm_side_artifact: 8 << 20,
                vm_warm_count: 10,
                link_rate: None,
                fault: None,
                degraded_time: Duration::from_secs(15),
                failover_trials: 1,
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
                ceph: None,
                vm_artifact: 256 << 20,
                vm_side_artifact: 32 << 20,
                vm_warm_count: 21,
                link_rate: None,
                fault: None,
                degraded_time: Duration::from_secs(30),
                failover_trials: 3,
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

/// A TCP baseline between two agents.
#[derive(Debug, Clone, Serialize)]
pub struct Network {
    /// The sending agent.
    pub from: String,
    /// The agent whose sink received (on the services' node).
    pub to: String,
    /// Our bulk TCP probe (bytes the sink confirmed).
    pub tcp_mib_s: Summary,
    pub tcp_retransmits: Summary,
    /// iperf3 between the same two agents, when both have it.
    pub iperf3_mib_s: Option<Summary>,
    pub iperf3_retransmits: Option<Summary>,
    /// Median probe / median iperf3.
    pub probe_vs_iperf3: Option<f64>,
    pub method: String,
}

/// p50 and p99 completion latency of one job, over all its iterations.
#[derive(Debug, Clone, Serialize)]
pub struct JobLatency {
    pub job: String,
    pub side: String,
    pub ops: u64,
    pub p50_us: f64,
    pub p99_us: f64,
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
    /// The agent that ran the jobs, and against what.
    pub measured_by: String,
    /// For a local file asked to bypass the page cache: whether `O_DIRECT`
    /// was really used (None: not asked, or not a file).
    pub o_direct: Option<bool>,
    pub latency: Vec<JobLatency>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CrossWorker {
    pub writer: String,
    pub reader: String,
    pub write_mib_s: Summary,
    pub read_mib_s: Summary,
    pub size_bytes: u64,
    pub verified: bool,
    /// What was dropped from the CoronaFS server's page cache before each
    /// read (the server's answers), or why it could not be.
    pub eviction: Vec<Result<serde_json::Value, String>>,
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
    pub measured_by: String,
    pub put_p50_ms: f64,
    pub put_p99_ms: f64,
    pub get_p50_ms: f64,
    pub get_p99_ms: f64,
    /// Requests moved to another node after one failed.
    pub failovers: u64,
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
    /// When the run finished (RFC 3339, UTC).
    pub generated_at: String,
    pub command: String,
    pub cluster: String,
    pub link: String,
    pub quick: bool,
    pub iterations: usize,
    pub conditions: conditions::Conditions,
    /// Things that happened (dead endpoints left out, failovers).
    pub events: Vec<String>,
    /// From the block agent to the agent on CoronaFS's node.
    pub network: Section<Network>,
    /// From the S3 agent to the agent on an S3 node.
    pub s3_network: Section<Network>,
    /// The block agent's disk with `O_DIRECT`.
    pub local_disk: Section<Block>,
    /// The same file through the page cache (like for like with CoronaFS,
    /// whose server reads recent data from its page cache).
    pub local_disk_buffered: Section<Block>,
    pub coronafs: Section<Block>,
    /// The same jobs on a CoronaFS volume with several copies, with each
    /// job's ratio to `coronafs`.
    pub coronafs_replicated: Section<replicated::Replicated>,
    /// A replicated volume's primary stopped under a writing client.
    pub coronafs_failover: Section<failover::Failover>,
    pub cross_worker: Section<CrossWorker>,
    pub s3_large_object: Section<Objects>,
    pub s3_small_batch: Section<Objects>,
    pub s3_parallel_batch: Section<Objects>,
    pub s3_degraded: Section<degraded::Degraded>,
    pub vm_image: Section<VmImage>,
    pub nbd_peers: Section<crate::nbd_compare::Report>,
    /// Ceph RBD and radosgw beside CoronaFS and LightningStor (`--peers ceph`).
    pub ceph: Section<ceph::CephPeer>,
    pub assessment: Vec<Ratio>,
}

const VOLUME: &str = "bench-vol";
/// The replicated volume (its copies on the other CoronaFS nodes).
const REPLICATED_VOLUME: &str = "bench-vol-copies";
const BUCKET: &str = "bench";

fn col<T>(runs: &[T], f: impl Fn(&T) -> f64) -> Summary {
    Summary::of(&runs.iter().map(f).collect::<Vec<_>>())
}

fn latencies(l: &measure::Latencies) -> Vec<JobLatency> {
    let mut v = Vec::new();
    for (side, map) in [("read", &l.read), ("write", &l.write)] {
        for (job, h) in map {
            if h.count() > 0 {
                v.push(JobLatency {
                    job: job.clone(),
                    side: side.into(),
                    ops: h.count(),
                    p50_us: h.percentile(50.0) as f64 / 1000.0,
                    p99_us: h.percentile(99.0) as f64 / 1000.0,
                });
            }
        }
    }
    v
}

/// One block section from its iterations.
struct BlockRuns {
    runs: Vec<measure::BlockRun>,
    lat: measure::Latencies,
    o_direct: Option<bool>,
}

impl BlockRuns {
    fn new() -> Self {
        BlockRuns { runs: Vec::new(), lat: measure::Latencies::default(), o_direct: None }
    }

    fn push(&mut self, (run, direct): (measure::BlockRun, Option<bool>)) {
        self.runs.push(run);
        // Once refused, the section says so.
        self.o_direct = match (self.o_direct, direct) {
            (Some(false), _) | (_, Some(false)) => Some(false),
            (a, b) => b.or(a),
        };
    }

    fn summary(&self, size: u64, runtime: Duration, measured_by: String) -> Block {
        let runs = &self.runs;
        Block {
            seq_write_mib_s: col(runs, |r| r.seq_write_mib_s),
            seq_read_mib_s: col(runs, |r| r.seq_read_mib_s),
            rand_read_4k_iops: col(runs, |r| r.rand_read_4k_iops),
            depth32_write_mib_s: col(runs, |r| r.depth32_write_mib_s),
            depth32_read_mib_s: col(runs, |r| r.depth32_read_mib_s),
            size_bytes: size,
            runtime_s: runtime.as_secs_f64(),
            measured_by,
            o_direct: self.o_direct,
            latency: latencies(&self.lat),
        }
    }
}

/// One S3 batch section from its iterations.
#[derive(Default)]
struct ObjectRuns {
    up: Vec<f64>,
    down: Vec<f64>,
    put: Histogram,
    get: Histogram,
    failovers: u64,
    events: Vec<Event>,
}

impl ObjectRuns {
    fn push(&mut self, r: crate::agent::ObjectsReply) {
        self.up.push(r.upload_s);
        self.down.push(r.download_s);
        self.put.merge(&r.put_hist);
        self.get.merge(&r.get_hist);
        self.failovers += r.failovers;
        self.events.extend(r.events);
    }

    fn summary(&self, count: usize, size: usize, jobs: usize, nodes: usize, by: &str) -> Objects {
        let mib = (count * size) as f64 / 1048576.0;
        let per = |v: &[f64], f: &dyn Fn(f64) -> f64| Summary::of(&v.iter().map(|s| f(*s)).collect::<Vec<_>>());
        let ms = |h: &Histogram, p: f64| h.percentile(p) as f64 / 1e6;
        Objects {
            count,
            object_bytes: size,
            jobs,
            upload_mib_s: per(&self.up, &|s| mib / s.max(1e-9)),
            download_mib_s: per(&self.down, &|s| mib / s.max(1e-9)),
            put_per_s: per(&self.up, &|s| count as f64 / s.max(1e-9)),
            get_per_s: per(&self.down, &|s| count as f64 / s.max(1e-9)),
            nodes,
            measured_by: by.into(),
            put_p50_ms: ms(&self.put, 50.0),
            put_p99_ms: ms(&self.put, 99.0),
            get_p50_ms: ms(&self.get, 50.0),
            get_p99_ms: ms(&self.get, 99.0),
            failovers: self.failovers,
        }
    }
}

/// Steps the progress bar counts.
pub fn steps(opts: &Options) -> u64 {
    3 + 8 * opts.iterations as u64
        + u64::from(opts.peers || opts.ceph.is_some())
        + if opts.ceph.is_some() { 5 * opts.iterations as u64 + 1 } else { 0 }
        + 2
        + opts.iterations as u64
        + u64::from(opts.fault.is_some())
        + u64::from(opts.failover_trials > 0)
}

/// A named agent of the cluster, or an error naming the role.
fn role<'a>(cluster: &'a Cluster, role: &str, name: &str) -> Option<&'a crate::agent::client::AgentClient> {
    if name.is_empty() {
        return None;
    }
    let a = cluster.agent(name);
    if a.is_none() {
        tracing::warn!(role, agent = name, "no such agent");
    }
    a
}

/// The TCP baseline between two agents (probe and, where both have it,
/// iperf3), iterations interleaved.
async fn network_section(
    cluster: &Cluster,
    from: &str,
    to: &str,
    what: &str,
    opts: &Options,
    infos: &conditions::Conditions,
) -> Section<Network> {
    let (Some(f), Some(t)) = (role(cluster, "from", from), role(cluster, "to", to)) else {
        return Section::na(format!(
            "no agent runs on the {what} node (add [agents] and [roles] with `{}` to the cluster file)",
            if what == "CoronaFS" { "coronafs_host" } else { "s3_host" }
        ));
    };
    let info = |n: &str| infos.agents.iter().find(|a| a.name == n).and_then(|a| a.info.clone());
    let (Some(fi), Some(ti)) = (info(from), info(to)) else {
        return Section::na(format!("agent {from} or {to} did not answer"));
    };
    let iperf3 = fi.iperf3.is_some() && ti.iperf3.is_some();
    let sink = t.sink(&ti);
    let mut runs = Vec::new();
    // At least five probe/iperf3 pairs, even in a quick run: one pair of
    // CPU-bound transfers on a busy host differs by several percent, and
    // with three the Docker lab's 24 containers on 2 CPUs once gave two
    // pairs 13 % apart in the same direction (medians 1005 against 996
    // MiB/s, the pairs' median ratio 0.87).
    for _ in 0..opts.iterations.max(5) {
        match measure::network(f, sink, t, iperf3, opts.net_time, cluster.link).await {
            Ok(r) => runs.push(r),
            Err(e) => return Section::na(format!("the baseline failed: {e:#}")),
        }
    }
    let tcp = col(&runs, |r| r.probe_mib_s);
    let ip: Vec<(f64, f64)> = runs.iter().filter_map(|r| r.iperf3.clone()?.ok()).collect();
    let iperf3_error = runs.iter().find_map(|r| r.iperf3.clone()?.err());
    let iperf3_mib_s = (!ip.is_empty()).then(|| Summary::of(&ip.iter().map(|x| x.0).collect::<Vec<_>>()));
    let iperf3_retransmits = (!ip.is_empty()).then(|| Summary::of(&ip.iter().map(|x| x.1).collect::<Vec<_>>()));
    Section::Measured(Network {
        from: from.into(),
        to: to.into(),
        // The median of each interleaved pair's ratio: a pair runs back to
        // back, so drift of the host's load between pairs cancels out.
        probe_vs_iperf3: (!ip.is_empty()).then(|| {
            let ratios: Vec<f64> =
                runs.iter().filter_map(|r| Some(r.probe_mib_s / r.iperf3.clone()?.ok()?.0.max(1e-9))).collect();
            Summary::of(&ratios).median
        }),
        tcp_mib_s: tcp,
        tcp_retransmits: col(&runs, |r| r.probe_retransmits),
        iperf3_mib_s,
        iperf3_retransmits,
        method: format!(
            "bench TCP probe (one connection, bulk send for {:.0} s, bytes the sink confirmed, retransmits from \
             TCP_INFO) from agent {from} to the sink of agent {to}{}; {}",
            opts.net_time.as_secs_f64(),
            match (iperf3, &iperf3_error) {
                (true, None) => ", and iperf3 -c/-s between the same two agents, interleaved".to_owned(),
                (true, Some(e)) => format!("; iperf3 failed ({e})"),
                (false, _) => "; iperf3 is not installed on both, so no cross-check".to_owned(),
            },
            path_of(sink, cluster.link)
        ),
    })
}

/// What a baseline to `sink` crosses: loopback when the sink is on this
/// host's loopback address, otherwise the network to that address, and
/// the emulated link if there is one.
fn path_of(sink: SocketAddr, link: crate::shaper::LinkSpec) -> String {
    let path = if sink.ip().is_loopback() {
        format!("both ends on one host: loopback to {sink}, no network crossed")
    } else {
        format!("across the network to {}", sink.ip())
    };
    format!("{path}; {}", link.describe())
}

/// Runs every section against `cluster`. `scratch` holds the coordinator's
/// own files (VM test images).
pub async fn run(
    cluster: &Cluster,
    opts: &Options,
    scratch: &std::path::Path,
    command: String,
    progress: &Progress,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Report> {
    let started_at = hostinfo::now_iso8601();
    let ep = &cluster.endpoints;
    let roles = &cluster.roles;
    let it = opts.iterations;
    let link = cluster.link;
    let jobs = measure::block_jobs(opts.volume_size, opts.block_runtime)?;
    let mut events = Vec::new();

    progress.step("conditions: agents, hosts, file systems, services");
    let conds = conditions::read(cluster, started_at, scratch).await;
    for a in &conds.agents {
        if let Some(e) = &a.error {
            events.push(format!("agent {} ({}) did not answer: {e}", a.name, a.addr));
        }
    }
    let alive = |name: &str| conds.agents.iter().any(|a| a.name == name && a.info.is_some());

    progress.step("network baselines (TCP probe and iperf3 between agents)");
    let network = network_section(cluster, &roles.block, &roles.coronafs_host, "CoronaFS", opts, &conds).await;
    let s3_network = if ep.lightningstor.is_some() {
        network_section(cluster, &roles.s3, &roles.s3_host, "LightningStor", opts, &conds).await
    } else {
        Section::na("LightningStor is not in the cluster file")
    };

    // Set-up: the volume, filled with data; the live S3 endpoints; the bucket.
    progress.step("set-up: CoronaFS volume, S3 endpoints and bucket");
    let block_agent = role(cluster, "block", &roles.block).filter(|a| alive(&a.name));
    let corona = match (&ep.coronafs, &cluster.setup.coronafs) {
        (Some(c), Some(setup)) => {
            crate::cluster::create_volume(setup, VOLUME, opts.volume_size).await.or_else(|e| {
                // A volume left by an earlier run against a deployed cluster is fine.
                if format!("{e:#}").contains("exists") { Ok(()) } else { Err(e) }
            })?;
            measure::prefill(setup, VOLUME, opts.volume_size).await.context("filling the CoronaFS volume")?;
            Some(c.clone())
        }
        _ => None,
    };
    // The replicated volume on the same primary, filled the same way.
    let copies = match (&corona, &cluster.setup.coronafs, &cluster.coronafs_replicated) {
        (Some(_), Some(setup), Ok(rc)) => {
            crate::cluster::create_replicated_volume(setup, REPLICATED_VOLUME, opts.volume_size, rc.copies)
                .await
                .or_else(|e| if format!("{e:#}").contains("exists") { Ok(()) } else { Err(e) })?;
            measure::prefill(setup, REPLICATED_VOLUME, opts.volume_size)
                .await
                .context("filling the replicated CoronaFS volume")?;
            Some(rc.clone())
        }
        _ => None,
    };
    let s3 = match &ep.lightningstor {
        Some(e) => {
            let (live, dead) = measure::live_endpoints(e).await;
            for d in &dead {
                events.push(format!("S3 endpoint left out, it did not answer at the start: {d}"));
            }
            if live.is_empty() {
                events.push("no S3 endpoint answered: the LightningStor sections are not measured".into());
                None
            } else {
                let e = crate::cluster::S3Endpoint { endpoints: live, ..e.clone() };
                measure::ensure_bucket(&e, BUCKET).await?;
                Some(e)
            }
        }
        None => None,
    };
    let s3_agent = role(cluster, "s3", &roles.s3).filter(|a| alive(&a.name));
    let rgw = match &opts.ceph {
        Some(c) => {
            progress.step(&format!("set-up: Ceph ({}): radosgw bucket", c.dir.display()));
            let e = crate::cluster::S3Endpoint {
                endpoints: vec![c.rgw.clone()],
                access_key: c.access_key.clone(),
                secret_key: c.secret_key.clone(),
                region: "us-east-1".into(),
                cluster_file: None,
            };
            measure::ensure_bucket(&e, BUCKET).await.context("radosgw")?;
            Some(e)
        }
        None => None,
    };
    let (writer, reader) = (
        role(cluster, "cross_write", &roles.cross_write).filter(|a| alive(&a.name)),
        role(cluster, "cross_read", &roles.cross_read).filter(|a| alive(&a.name)),
    );

    let mut local = BlockRuns::new();
    let mut local_buf = BlockRuns::new();
    let mut cor = BlockRuns::new();
    let mut cor_copies = BlockRuns::new();
    let (mut rbd3, mut rbd1) = (BlockRuns::new(), BlockRuns::new());
    let (mut rgw_large, mut rgw_batch, mut rgw_par) =
        (ObjectRuns::default(), ObjectRuns::default(), ObjectRuns::default());
    let (mut cross, mut cross_w, mut evictions) = (Vec::new(), Vec::new(), Vec::new());
    let (mut large, mut batch, mut par) = (ObjectRuns::default(), ObjectRuns::default(), ObjectRuns::default());
    let buffered: Vec<crate::job::Job> = jobs
        .iter()
        .cloned()
        .map(|mut j| {
            j.direct = false;
            j
        })
        .collect();
    let local_target = BlockTarget::Scratch { file: "local-disk".into() };
    for i in 0..it {
        let n = format!("iteration {}/{it}", i + 1);
        if let Some(a) = block_agent {
            progress.step(&format!("{n}: local disk on {} (seed-000 jobs, O_DIRECT)", a.name));
            let r = measure::block(a, &local_target, &jobs, link, &mut local.lat).await.context("local disk")?;
            local.push(r);
            progress.step(&format!("{n}: local disk on {} (buffered)", a.name));
            let r = measure::block(a, &local_target, &buffered, link, &mut local_buf.lat)
                .await
                .context("local disk, buffered")?;
            local_buf.push(r);
        } else {
            progress.step("no block agent");
            progress.step("");
        }
        if let (Some(c), Some(a)) = (&corona, block_agent) {
            progress.step(&format!("{n}: CoronaFS over NBD from {} (seed-000 jobs)", a.name));
            let target = BlockTarget::Nbd { addr: c.nbd.clone(), export: VOLUME.into() };
            let r = measure::block(a, &target, &jobs, link, &mut cor.lat).await.context("CoronaFS")?;
            cor.push(r);
        } else {
            progress.step("CoronaFS not measured");
        }
        if let (Some(c), Some(rc), Some(a)) = (&corona, &copies, block_agent) {
            progress.step(&format!("{n}: CoronaFS, {} copies, over NBD from {} (seed-000 jobs)", rc.copies, a.name));
            let target = BlockTarget::Nbd { addr: c.nbd.clone(), export: REPLICATED_VOLUME.into() };
            let r = measure::block(a, &target, &jobs, link, &mut cor_copies.lat).await.context("CoronaFS, copies")?;
            cor_copies.push(r);
        } else {
            progress.step("replicated CoronaFS volume not measured");
        }
        if let (Some(c), Some(a)) = (&opts.ceph, block_agent) {
            for (pool, runs) in [(crate::ceph::POOL_REPLICATED, &mut rbd3), (crate::ceph::POOL_SINGLE, &mut rbd1)] {
                progress.step(&format!("{n}: Ceph RBD pool {pool} from {} (seed-000 jobs, fio's rbd engine)", a.name));
                let uri = format!("rbd://{pool}/{VOLUME}?conf={}", c.conf.display());
                let target = BlockTarget::Uri { uri, access_key: None, secret_key: None };
                let r = measure::block(a, &target, &jobs, link, &mut runs.lat).await.context("Ceph RBD")?;
                runs.push(r);
            }
        }
        if let (Some(c), Some(w), Some(r)) = (&corona, writer, reader) {
            progress.step(&format!("{n}: cross-worker: {} writes, {} reads", w.name, r.name));
            let x = measure::cross_worker(w, r, c, VOLUME, opts.cross_worker_size, i as u64, link).await?;
            cross.push(x.read_mib_s);
            cross_w.push(x.write_mib_s);
            evictions.push(x.evicted);
        } else {
            progress.step("cross-worker read not measured");
        }
        if let (Some(e), Some(a)) = (&s3, s3_agent) {
            progress.step(&format!(
                "{n}: LightningStor large object ({} MiB) from {}",
                opts.large_object >> 20,
                a.name
            ));
            large.push(measure::objects(a, e, BUCKET, "large/", 1, opts.large_object, 1, link).await?);
            progress.step(&format!(
                "{n}: LightningStor batch ({} x {} KiB)",
                opts.batch_count,
                opts.batch_object >> 10
            ));
            batch.push(measure::objects(a, e, BUCKET, "batch/", opts.batch_count, opts.batch_object, 1, link).await?);
            progress.step(&format!(
                "{n}: LightningStor parallel batch ({})",
                crate::text::count(opts.parallel_jobs, "job")
            ));
            par.push(
                measure::objects(
                    a,
                    e,
                    BUCKET,
                    "parallel/",
                    opts.batch_count,
                    opts.batch_object,
                    opts.parallel_jobs,
                    link,
                )
                .await?,
            );
            for p in ["large/", "batch/", "parallel/"] {
                measure::delete_prefix(e, BUCKET, p).await;
            }
        } else {
            for _ in 0..3 {
                progress.step("LightningStor not measured");
            }
        }
        if let (Some(e), Some(a)) = (&rgw, s3_agent) {
            progress.step(&format!("{n}: radosgw large object, batch and parallel batch from {}", a.name));
            rgw_large.push(measure::objects(a, e, BUCKET, "large/", 1, opts.large_object, 1, link).await?);
            rgw_batch
                .push(measure::objects(a, e, BUCKET, "batch/", opts.batch_count, opts.batch_object, 1, link).await?);
            let j = opts.parallel_jobs;
            rgw_par
                .push(measure::objects(a, e, BUCKET, "parallel/", opts.batch_count, opts.batch_object, j, link).await?);
            for p in ["large/", "batch/", "parallel/"] {
                measure::delete_prefix(e, BUCKET, p).await;
            }
            progress.step("");
            progress.step("");
        }
        if stop.load(std::sync::atomic::Ordering::Relaxed) {
            anyhow::bail!("interrupted");
        }
    }
    for a in cluster.agents.values() {
        if alive(&a.name) {
            let _ = a.cleanup().await;
        }
    }

    let nodes = s3.as_ref().map_or(0, |e| e.endpoints.len());
    let why_block = |what: &str| match (&corona, block_agent) {
        (_, None) => format!("no live agent plays the block role ({})", roles.block),
        (None, _) => format!("CoronaFS is not in the cluster file ({what})"),
        _ => String::new(),
    };
    let block_by = |target: &str| format!("agent {} ({target})", roles.block);
    let local_fs = conds
        .agents
        .iter()
        .find(|a| a.name == roles.block)
        .and_then(|a| a.info.as_ref())
        .map_or("?".to_owned(), |i| format!("{} on {} ({})", i.scratch.path, i.scratch.device, i.scratch.fs_type));
    let s3_by = s3_agent.map_or(String::new(), |a| a.name.clone());
    let no_s3 = if ep.lightningstor.is_none() {
        "LightningStor is not in the cluster file".to_owned()
    } else if s3.is_none() {
        "no S3 endpoint answered".to_owned()
    } else {
        format!("no live agent plays the s3 role ({})", roles.s3)
    };
    for o in [&large, &batch, &par] {
        events.extend(o.events.iter().map(|e| format!("S3 agent {s3_by} at {:.1} s: {}", e.t_s, e.what)));
    }
    let measured_s3 = s3.is_some() && s3_agent.is_some();
    let mut report = Report {
        generated_at: String::new(),
        command,
        cluster: cluster.origin.clone(),
        link: link.describe(),
        quick: opts.quick,
        iterations: it,
        conditions: conds.clone(),
        events: Vec::new(),
        network,
        s3_network,
        local_disk: if block_agent.is_some() {
            Section::Measured(local.summary(
                opts.volume_size,
                opts.block_runtime,
                block_by(&format!("file local-disk in {local_fs}, O_DIRECT asked")),
            ))
        } else {
            Section::na(why_block("local disk"))
        },
        local_disk_buffered: if block_agent.is_some() {
            Section::Measured(local_buf.summary(
                opts.volume_size,
                opts.block_runtime,
                block_by("the same file, buffered (page cache)"),
            ))
        } else {
            Section::na(why_block("local disk"))
        },
        coronafs: if corona.is_some() && block_agent.is_some() {
            Section::Measured(cor.summary(
                opts.volume_size,
                opts.block_runtime,
                block_by(&format!("NBD to {}", ep.coronafs.as_ref().map_or("", |c| c.nbd.as_str()))),
            ))
        } else {
            Section::na(why_block("CoronaFS"))
        },
        coronafs_replicated: match (&copies, &cluster.coronafs_replicated) {
            (Some(rc), _) if block_agent.is_some() && !cor.runs.is_empty() => {
                let block = cor_copies.summary(
                    opts.volume_size,
                    opts.block_runtime,
                    block_by(&format!(
                        "NBD to {}, volume {REPLICATED_VOLUME} with {} copies",
                        ep.coronafs.as_ref().map_or("", |c| c.nbd.as_str()),
                        rc.copies
                    )),
                );
                Section::Measured(replicated::Replicated {
                    copies: rc.copies,
                    write_quorum: rc.write_quorum,
                    placement: rc.placement.clone(),
                    ratios: replicated::ratios(&cor.runs, &cor_copies.runs),
                    block,
                })
            }
            (_, Err(why)) => Section::na(why.clone()),
            _ => Section::na(why_block("CoronaFS")),
        },
        coronafs_failover: Section::na("not asked for (0 failovers)"),
        cross_worker: if !cross.is_empty() {
            Section::Measured(CrossWorker {
                writer: roles.cross_write.clone(),
                reader: roles.cross_read.clone(),
                write_mib_s: Summary::of(&cross_w),
                read_mib_s: Summary::of(&cross),
                size_bytes: opts.cross_worker_size,
                verified: true,
                eviction: evictions,
            })
        } else if corona.is_none() {
            Section::na("CoronaFS is not in the cluster file")
        } else {
            Section::na(format!(
                "the writer ({}) or the reader ({}) agent is not live",
                roles.cross_write, roles.cross_read
            ))
        },
        s3_large_object: if measured_s3 {
            Section::Measured(large.summary(1, opts.large_object, 1, nodes, &s3_by))
        } else {
            Section::na(no_s3.clone())
        },
        s3_small_batch: if measured_s3 {
            Section::Measured(batch.summary(opts.batch_count, opts.batch_object, 1, nodes, &s3_by))
        } else {
            Section::na(no_s3.clone())
        },
        s3_parallel_batch: if measured_s3 {
            Section::Measured(par.summary(opts.batch_count, opts.batch_object, opts.parallel_jobs, nodes, &s3_by))
        } else {
            Section::na(no_s3.clone())
        },
        s3_degraded: Section::na("no --fault given"),
        vm_image: Section::na("PlasmaVMC is not in the cluster file"),
        nbd_peers: Section::na("skipped (--quick, or --no-peers, or a deployed cluster); run `bench nbd-compare`"),
        ceph: Section::na("not asked for (--peers ceph after `bench peers ceph up`)"),
        assessment: Vec::new(),
    };
    if let Some(c) = &opts.ceph {
        report.ceph = match (block_agent, &rgw, s3_agent) {
            (Some(_), Some(_), Some(a)) => {
                let rbd_by = |pool: &str| block_by(&format!("RBD image {pool}/{VOLUME}, fio --ioengine=rbd (librbd)"));
                let rbd_3x = rbd3.summary(opts.volume_size, opts.block_runtime, rbd_by(crate::ceph::POOL_REPLICATED));
                let rbd_1x = rbd1.summary(opts.volume_size, opts.block_runtime, rbd_by(crate::ceph::POOL_SINGLE));
                let rgw_l = rgw_large.summary(1, opts.large_object, 1, 1, &a.name);
                let rgw_b = rgw_batch.summary(opts.batch_count, opts.batch_object, 1, 1, &a.name);
                let rgw_p = rgw_par.summary(opts.batch_count, opts.batch_object, opts.parallel_jobs, 1, &a.name);
                let comparisons = ceph::compare(
                    report.coronafs.get(),
                    &rbd_1x,
                    &rbd_3x,
                    [report.s3_large_object.get(), report.s3_small_batch.get(), report.s3_parallel_batch.get()],
                    [&rgw_l, &rgw_b, &rgw_p],
                );
                Section::Measured(ceph::CephPeer {
                    ceph: c.describe(),
                    rbd_3x,
                    rbd_1x,
                    rgw_large_object: rgw_l,
                    rgw_small_batch: rgw_b,
                    rgw_parallel_batch: rgw_p,
                    comparisons,
                    method: format!(
                        "in every iteration right after ours: the block jobs from agent {} on RBD images of {} MiB \
                         (filled with data first) through fio's rbd engine, unshaped (librbd talks to every OSD; \
                         no link is emulated for it); the S3 batches from agent {} against radosgw with the same \
                         client code as LightningStor's. CoronaFS reads recent data from its server's page cache; \
                         BlueStore reads its files with O_DIRECT behind a 128 MiB cache",
                        roles.block,
                        opts.volume_size >> 20,
                        a.name
                    ),
                })
            }
            _ => Section::na("the block or the s3 agent is not live, so Ceph was not measured"),
        };
    }
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
    if let Some(fault) = &opts.fault {
        progress.step(&format!("degraded cluster: steady S3 load with {fault}"));
        report.s3_degraded = match (&cluster.faults, &s3, s3_agent) {
            (None, _, _) => {
                Section::na(format!("{fault}: nothing here can apply faults (the cluster file has no [faults])"))
            }
            (_, None, _) | (_, _, None) => Section::na(no_s3.clone()),
            (Some(d), Some(e), Some(a)) => {
                match degraded::measure(cluster, a, d.clone(), fault, e, BUCKET, opts.degraded_time, link).await {
                    Ok(x) => {
                        events.extend(x.events.iter().map(|e| format!("degraded load at {:.1} s: {}", e.t_s, e.what)));
                        Section::Measured(x)
                    }
                    Err(err) => Section::na(format!("the degraded-cluster load failed: {err:#}")),
                }
            }
        };
        if let Some(e) = &s3 {
            measure::delete_prefix(e, BUCKET, "degraded/").await;
        }
    }
    if opts.failover_trials > 0 {
        progress.step(&format!(
            "CoronaFS failover: {}, the primary stopped under a writing client",
            crate::text::count(opts.failover_trials, "failover")
        ));
        report.coronafs_failover = failover::measure::section(cluster, opts.failover_trials).await;
        if let Some(f) = report.coronafs_failover.get()
            && !f.passed
        {
            events.push(format!("CoronaFS failover: {}", f.verdict()));
        }
    }
    if (opts.peers && cluster.data_dir().is_some()) || opts.ceph.is_some() {
        let mut peers = vec![crate::peers::Peer::Coronafs(coronafs::backend::IoEngine::Threads)];
        if opts.peers && cluster.data_dir().is_some() {
            peers.extend([crate::peers::Peer::Nbdkit, crate::peers::Peer::QemuNbd]);
        }
        if opts.ceph.is_some() {
            peers.extend(crate::peers::ceph_peers());
        }
        let names: Vec<String> = peers.iter().map(|p| p.label()).collect();
        progress.step(&format!("block peers on the coordinator's host, unshaped: {}", names.join(", ")));
        report.nbd_peers = peers_section(scratch, peers, opts.ceph.clone(), opts.quick).await;
    }
    report.events = events;
    report.generated_at = hostinfo::now_iso8601();
    report.assessment = assess::ratios(&report);
    Ok(report)
}

async fn peers_section(
    scratch: &std::path::Path,
    peers: Vec<crate::peers::Peer>,
    ceph: Option<crate::ceph::Ceph>,
    quick: bool,
) -> Section<crate::nbd_compare::Report> {
    let opts = crate::nbd_compare::Options {
        size: if quick { 128 << 20 } else { 256 << 20 },
        iterations: 1,
        runtime_s: 2,
        peers,
        ceph,
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
