//! `bench agent`: the load generator as a long-running service on every
//! node, driven over HTTP by the coordinator (`fresh-bench-storage`), the
//! way fio's `--server` or warp's client mode work.
//!
//! The coordinator sends a description of the work (a block job against an
//! NBD export or the agent's own scratch disk, a pattern written or checked
//! over NBD, an S3 object batch, a steady S3 load, a TCP or iperf3 probe to
//! another agent's sink) and gets back raw figures: latency histograms to
//! merge, byte counts and times, never percentiles to average.
//!
//! Every `/v1` call needs `Authorization: Bearer TOKEN` (the agent refuses
//! to start without a token), since an agent writes to volumes and buckets
//! it is pointed at. `/healthz` is open.
//!
//! With a link in the request, all of the agent's traffic for it goes
//! through one emulated interface ([`crate::shaper::Nic`]: one token bucket
//! per direction, shared by every connection), so eight parallel S3 jobs
//! share one link as they would on a real node.
//!
//! - [`server`]: the HTTP service and its handlers;
//! - [`work`]: what the handlers run (loads, probes, iperf3);
//! - [`client`]: the coordinator's typed client.

pub mod client;
pub mod server;
pub mod work;

use crate::hist::Histogram;
use crate::job::Job;
use crate::loadgen::JobRun;
use crate::shaper::LinkSpec;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

/// The agent's HTTP port unless told otherwise.
pub const DEFAULT_PORT: u16 = 7900;
/// The agent's TCP sink port (network baseline) unless told otherwise.
pub const DEFAULT_SINK_PORT: u16 = 7901;
/// Environment variable holding the agent token.
pub const TOKEN_ENV: &str = "BENCH_AGENT_TOKEN";
/// Shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest any one request may run on an agent.
pub const MAX_WORK: Duration = Duration::from_secs(600);

/// Environment variable naming the commit the bench was built from, for
/// binaries run outside their checkout (the lab image sets it).
pub const COMMIT_ENV: &str = "BENCH_COMMIT";

/// The commit this bench reports in its conditions and agent info:
/// `BENCH_COMMIT` if set, else the HEAD of the checkout it was built in
/// (`git rev-parse`, looked up once per process), else `unknown`.
///
/// Looked up when the bench runs, not stamped in at build time: a stamp
/// made the bench library, and every test binary that links it, rebuild
/// on each commit even when no source changed. A binary whose checkout
/// moved to another commit without a rebuild reports the new HEAD
/// (`cargo run` rebuilds first whenever the sources differ).
pub fn commit() -> &'static str {
    static COMMIT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    COMMIT.get_or_init(|| {
        if let Some(c) = std::env::var(COMMIT_ENV).ok().filter(|c| !c.trim().is_empty()) {
            return c.trim().to_owned();
        }
        std::process::Command::new("git")
            .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "--short=12", "HEAD"])
            .stderr(std::process::Stdio::null())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| "unknown".into())
    })
}

/// What an agent says about itself and its host.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AgentInfo {
    /// The name it was started with (`--name`, else the host name).
    pub name: String,
    pub version: String,
    pub commit: String,
    pub host: hostinfo::Host,
    /// The scratch directory (the local-disk baseline's file lives there).
    pub scratch: hostinfo::FsInfo,
    /// Whether the scratch file system takes `O_DIRECT`.
    pub o_direct: bool,
    /// `iperf3 --version`'s first line, when iperf3 is installed.
    pub iperf3: Option<String>,
    /// Port of the TCP sink (the network baseline's receiving end).
    pub sink_port: u16,
}

/// Where a block job runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockTarget {
    /// An NBD export, one connection per job.
    Nbd { addr: String, export: String },
    /// A file of this name in the agent's scratch directory (created and
    /// laid out with data as needed, removed by `POST /v1/cleanup`).
    Scratch { file: String },
    /// Any `bench run` target, opened on the agent: `nbd://`, a path on the
    /// agent's host, or `s3://bucket?endpoint=...` with these keys.
    Uri { uri: String, access_key: Option<String>, secret_key: Option<String> },
}

/// S3 endpoints (one or more nodes of one cluster) and their keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct S3Spec {
    pub endpoints: Vec<String>,
    pub bucket: String,
    pub region: String,
    pub access_key: String,
    pub secret_key: String,
}

/// One block job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRequest {
    pub target: BlockTarget,
    pub job: Job,
    pub max_job_time: Duration,
    pub link: LinkSpec,
}

/// A block job's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobReply {
    pub run: JobRun,
    /// For a scratch file with `direct = true`: whether `O_DIRECT` was
    /// really used (false: the file system refused it and the job ran
    /// buffered).
    pub direct_used: Option<bool>,
}

/// Writes (then flushes) or reads back and checks a pseudo-random pattern
/// over NBD, 1 MiB at a time, one request in flight.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PatternRequest {
    pub addr: String,
    pub export: String,
    pub offset: u64,
    pub size: u64,
    pub seed: u64,
    /// true: write and flush; false: read and compare.
    pub write: bool,
    pub link: LinkSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PatternReply {
    pub bytes: u64,
    pub secs: f64,
}

/// `count` objects of `size` bytes uploaded, then downloaded and checked,
/// by `jobs` concurrent clients spread over the endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjectsRequest {
    pub s3: S3Spec,
    pub prefix: String,
    pub count: usize,
    pub size: usize,
    pub jobs: usize,
    pub link: LinkSpec,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ObjectsReply {
    pub upload_s: f64,
    pub download_s: f64,
    pub put_hist: Histogram,
    pub get_hist: Histogram,
    /// Requests moved to another endpoint after one failed.
    pub failovers: u64,
    pub events: Vec<Event>,
}

/// A steady S3 load for `duration`: each of `jobs` clients PUTs a fresh
/// object and GETs (and checks) one acknowledged earlier, over and over.
/// Figures per `tick`; at the end every acknowledged object is read back.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SteadyRequest {
    pub s3: S3Spec,
    pub prefix: String,
    pub size: usize,
    pub jobs: usize,
    pub duration: Duration,
    pub tick: Duration,
    pub link: LinkSpec,
}

/// Completions in one tick of a steady load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    /// Seconds from the start of the load to the end of this tick.
    pub t_s: f64,
    pub puts: u64,
    pub gets: u64,
    /// Bytes moved by those PUTs and GETs.
    pub bytes: u64,
    /// Requests that failed on every endpoint.
    pub errors: u64,
    pub failovers: u64,
}

/// Something that happened during a load (an endpoint failing, a failover).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Seconds from the start of the load.
    pub t_s: f64,
    pub what: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SteadyReply {
    pub ticks: Vec<Tick>,
    pub events: Vec<Event>,
    pub put_hist: Histogram,
    pub get_hist: Histogram,
    /// Objects whose PUT was acknowledged.
    pub acked: u64,
    /// Acknowledged objects read back intact at the end.
    pub verified: u64,
    /// Acknowledged objects that did not read back intact (key and why).
    pub lost: Vec<String>,
}

/// A bulk TCP send to another agent's sink.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeRequest {
    pub to: SocketAddr,
    pub duration: Duration,
    pub link: LinkSpec,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ProbeReply {
    pub bytes_per_s: f64,
    pub retransmits: u32,
}

/// Starts a one-off `iperf3 -s` on the agent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Iperf3ServerRequest {
    /// 0: the agent picks a free port.
    pub port: u16,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Iperf3ServerReply {
    pub port: u16,
}

/// Runs `iperf3 -c` against a server another agent started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Iperf3ClientRequest {
    pub to: SocketAddr,
    pub duration: Duration,
    pub link: LinkSpec,
}

/// iperf3's own figures: what the receiver got, the sender's retransmits.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Iperf3Reply {
    pub bytes_per_s: f64,
    pub retransmits: u64,
}

/// Removes the scratch files an agent made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CleanupRequest {}

/// Error body of every failed call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}
