//! `bench check`: run a workload against a target while a nemesis applies
//! faults, record every operation into `history.jsonl`, run the checkers
//! of [`crate::check`] over it and write `check.md` and `check.json`.
//!
//! - [`record`]: the history's clock and what an S3 error means;
//! - [`nemesis`]: the fault schedule from the seed, and its application;
//! - [`s3`]: the `s3-register` and `s3-set` clients;
//! - [`nbd`]: the `nbd-blocks` writers and read-back;
//! - [`report`]: `check.json` and `check.md`.

pub mod nbd;
pub mod nemesis;
pub mod record;
pub mod report;
pub mod s3;

use crate::check::{self, History, Validity};
use crate::cluster::EmbeddedS3;
use crate::cluster::corona_procs::CoronaProcs;
use crate::fault::{FaultDriver, FaultKind};
use anyhow::Context;
use record::Recorder;
use report::{Report, WorkloadReport};
use s3::{Pace, S3Api};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// PUT unique values / GET on a few keys: linearizability and
    /// read-your-writes per key.
    S3Register,
    /// PUT unique keys, list after healing: no acknowledged key lost.
    S3Set,
    /// Self-describing blocks written and FLUSHed through the reconnecting
    /// attachment of a 3-copy CoronaFS volume, read back after healing.
    NbdBlocks,
}

impl Workload {
    pub fn as_str(self) -> &'static str {
        match self {
            Workload::S3Register => "s3-register",
            Workload::S3Set => "s3-set",
            Workload::NbdBlocks => "nbd-blocks",
        }
    }
}

impl std::str::FromStr for Workload {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Workload> {
        match s {
            "s3-register" => Ok(Workload::S3Register),
            "s3-set" => Ok(Workload::S3Set),
            "nbd-blocks" => Ok(Workload::NbdBlocks),
            _ => anyhow::bail!("unknown workload {s:?} (s3-register, s3-set, nbd-blocks)"),
        }
    }
}

/// What is checked.
#[derive(Debug, Clone)]
pub enum Target {
    /// A LightningStor cluster started here ([`EmbeddedS3`]), which the
    /// nemesis can kill and pause.
    Embedded,
    /// A user's S3 endpoint (`s3://bucket[/prefix]?endpoint=URL`); no faults.
    S3 { uri: String, bucket: String, prefix: String, endpoint: String, region: String, keys: (String, String) },
    /// Clients the caller built (in-process services in tests); no faults.
    Clients { label: String, api: S3Api },
}

/// Everything a run needs.
#[derive(Debug, Clone)]
pub struct Options {
    pub workload: Workload,
    pub target: Target,
    /// Fault kinds the nemesis applies (empty: none).
    pub nemesis: Vec<FaultKind>,
    pub duration: Duration,
    pub seed: u64,
    pub out: PathBuf,
    pub clients: usize,
    /// Register keys (s3-register).
    pub keys: usize,
    /// Blocks the writers spread over (nbd-blocks).
    pub blocks: usize,
    /// Longest one request may take before it is indeterminate.
    pub op_timeout: Duration,
    /// Pause of each client between requests.
    pub think: Duration,
    /// The command line that replays the run, for the report.
    pub replay: String,
}

/// Most clients and keys accepted.
pub const MAX_CLIENTS: usize = 64;
pub const MAX_KEYS: usize = 1_000;
pub const MAX_BLOCKS: usize = 65_536;
/// Longest run accepted.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

impl Options {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!((1..=MAX_CLIENTS).contains(&self.clients), "--clients must be 1..={MAX_CLIENTS}");
        anyhow::ensure!((1..=MAX_KEYS).contains(&self.keys), "--keys must be 1..={MAX_KEYS}");
        anyhow::ensure!((1..=MAX_BLOCKS).contains(&self.blocks), "--blocks must be 1..={MAX_BLOCKS}");
        if self.workload == Workload::NbdBlocks && !matches!(self.target, Target::Embedded) {
            anyhow::bail!("nbd-blocks runs on the embedded CoronaFS cluster only (--target embedded)");
        }
        anyhow::ensure!(
            self.duration >= Duration::from_secs(1) && self.duration <= MAX_DURATION,
            "--duration must be between 1 s and 24 h"
        );
        anyhow::ensure!(self.op_timeout >= Duration::from_millis(100), "--op-timeout must be at least 100 ms");
        if !self.nemesis.is_empty() && !matches!(self.target, Target::Embedded) {
            anyhow::bail!(
                "--nemesis {}: faults can be applied only to the embedded cluster; use --nemesis none with --target",
                self.nemesis.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(",")
            );
        }
        if self.nemesis.contains(&FaultKind::Partition) {
            anyhow::bail!("--nemesis partition: the embedded cluster shares one host and cannot be partitioned yet");
        }
        Ok(())
    }
}

/// What the clients talk to.
enum Backend {
    S3(S3Api),
    Nbd(nbd::NbdVolume),
}

/// What was started for the run, stopped after it.
struct Started {
    backend: Backend,
    label: String,
    /// The service the nemesis faults, and its nodes.
    service: &'static str,
    nodes: Vec<String>,
    driver: Option<Arc<dyn FaultDriver>>,
    cluster: Option<EmbeddedS3>,
    corona: Option<(tempfile::TempDir, Arc<CoronaProcs>)>,
}

impl Started {
    fn s3(api: S3Api, label: String) -> Started {
        Started {
            backend: Backend::S3(api),
            label,
            service: "lightningstor",
            nodes: Vec::new(),
            driver: None,
            cluster: None,
            corona: None,
        }
    }

    async fn stop(self) {
        if let Some(c) = self.cluster {
            c.shutdown().await;
        }
        drop(self.driver);
        drop(self.backend);
        if let Some((dir, procs)) = self.corona {
            match Arc::try_unwrap(procs) {
                Ok(p) => p.stop().await,
                // Still shared: the nodes are killed when the last holder drops them.
                Err(p) => drop(p),
            }
            let path = dir.path().to_owned();
            if let Err(err) = dir.close() {
                tracing::warn!(error = %err, path = %path.display(), "could not remove the cluster's data");
            }
        }
    }
}

fn clients_for(
    endpoints: &[String],
    region: &str,
    keys: &(String, String),
    timeout: Duration,
) -> Vec<(String, aws_sdk_s3::Client)> {
    let timeouts = aws_sdk_s3::config::timeout::TimeoutConfig::builder()
        .connect_timeout(timeout.min(Duration::from_secs(1)))
        .operation_timeout(timeout)
        .build();
    endpoints
        .iter()
        .map(|url| {
            let label = url.trim_start_matches("http://").trim_start_matches("https://").to_owned();
            (label, crate::target::s3_client_no_retries(url, region, &keys.0, &keys.1, timeouts.clone()))
        })
        .collect()
}

/// Starts the CoronaFS nodes, makes a volume with a copy on each and
/// attaches to it as PlasmaVMC attaches a VM's disk (fenced at epoch 1).
async fn start_corona(opts: &Options, run_id: &str) -> anyhow::Result<Started> {
    let dir = tempfile::Builder::new().prefix("bench-check-").tempdir()?;
    let procs = CoronaProcs::start(dir.path()).await.context("starting the CoronaFS nodes")?;
    let copies = procs.file.nodes.len().min(3);
    let size = (opts.blocks * nbd::BLOCK_SIZE).next_multiple_of(1 << 20) as u64;
    let volume = format!("bench-check-{run_id}");
    let attached = async {
        let first = &procs.file.nodes[0];
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", first.api));
        let req = coronafs::dto::CreateVolume {
            name: volume.clone(),
            size: Some(size),
            from_snapshot: None,
            replicas: Some(copies),
        };
        api.create_volume(&req).await.with_context(|| format!("creating {volume} with {copies} copies"))?;
        api.fence(&volume, 1).await.with_context(|| format!("fencing {volume} at epoch 1"))?;
        let nbd: Vec<String> = procs.file.nodes.iter().map(|n| n.nbd.to_string()).collect();
        plasmavmc::guest::Attachment::connect(&nbd, "bench-check", "bench", &volume, 1, Default::default())
            .await
            .with_context(|| format!("attaching {volume}"))
    }
    .await;
    let att = match attached {
        Ok(a) => a,
        Err(e) => {
            procs.stop().await;
            return Err(e);
        }
    };
    let nodes: Vec<String> = procs.file.nodes.iter().map(|n| n.name.clone()).collect();
    let label = format!(
        "embedded CoronaFS: {} nodes (child processes on loopback), a volume with {copies} copies (write quorum {}), \
         {} blocks of {} bytes written through PlasmaVMC's reconnecting attachment",
        nodes.len(),
        procs.file.write_quorum,
        opts.blocks,
        nbd::BLOCK_SIZE
    );
    let procs = Arc::new(procs);
    let driver: Arc<dyn FaultDriver> = procs.clone();
    let vol = nbd::NbdVolume { att, blocks: opts.blocks as u64, op_timeout: opts.op_timeout };
    Ok(Started {
        backend: Backend::Nbd(vol),
        label,
        service: "coronafs",
        nodes,
        driver: Some(driver),
        cluster: None,
        corona: Some((dir, procs)),
    })
}

async fn start(opts: &Options, prefix: String, run_id: &str) -> anyhow::Result<Started> {
    if opts.workload == Workload::NbdBlocks {
        return start_corona(opts, run_id).await;
    }
    match &opts.target {
        Target::Embedded => {
            let c = EmbeddedS3::start().await.context("starting the embedded LightningStor cluster")?;
            let e = c.endpoint();
            let keys = (e.access_key.clone(), e.secret_key.clone());
            let endpoints = clients_for(&e.endpoints, &e.region, &keys, opts.op_timeout);
            let label = format!(
                "embedded LightningStor: {} nodes (child processes on loopback), {} copies of every object",
                e.endpoints.len(),
                c.config.replication_factor
            );
            let driver: Arc<dyn FaultDriver> = Arc::new(c.faults.clone());
            let api = S3Api { endpoints, bucket: "bench-check".into(), prefix };
            let nodes = c.node_names();
            Ok(Started { nodes, driver: Some(driver), cluster: Some(c), ..Started::s3(api, label) })
        }
        Target::S3 { uri, bucket, prefix: p, endpoint, region, keys } => {
            let endpoints = clients_for(std::slice::from_ref(endpoint), region, keys, opts.op_timeout);
            let api = S3Api { endpoints, bucket: bucket.clone(), prefix: format!("{p}{prefix}") };
            Ok(Started::s3(api, uri.clone()))
        }
        Target::Clients { label, api } => {
            let api = S3Api { prefix: format!("{}{prefix}", api.prefix), ..api.clone() };
            Ok(Started::s3(api, label.clone()))
        }
    }
}

/// Runs the check and writes `history.jsonl`, `check.json` and `check.md`
/// to `opts.out`. An error means the run could not be made (exit 2).
pub async fn run(opts: &Options) -> anyhow::Result<Report> {
    opts.validate()?;
    std::fs::create_dir_all(&opts.out).with_context(|| format!("creating {}", opts.out.display()))?;
    let run_id = crate::cluster::embedded::random_token()?;
    let prefix = format!("bench-check/{}-{}/", opts.seed, &run_id[..8]);
    let started = start(opts, prefix, &run_id[..8]).await?;
    let result = run_on(opts, &started).await;
    started.stop().await;
    let (history, mut report) = result?;
    let path = opts.out.join("history.jsonl");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| path.display().to_string())?);
    history.write_jsonl(&mut f).with_context(|| path.display().to_string())?;
    std::io::Write::flush(&mut f)?;
    report.workloads[0].notes.push(format!("history: {}", path.display()));
    let json = serde_json::to_vec_pretty(&report)?;
    std::fs::write(opts.out.join("check.json"), json).context("writing check.json")?;
    std::fs::write(opts.out.join("check.md"), report::markdown(&report)).context("writing check.md")?;
    Ok(report)
}

async fn run_on(opts: &Options, s: &Started) -> anyhow::Result<(History, Report)> {
    if let Backend::S3(api) = &s.backend {
        api.ensure_bucket().await?;
    }
    let rec = Arc::new(Recorder::new());
    let plan = nemesis::plan(opts.seed, &opts.nemesis, s.service, &s.nodes, opts.duration);
    let t0 = rec.start;
    let deadline = t0 + opts.duration;
    let pace = Pace { think: opts.think, max_ops: 1_000_000 };
    let nemesis_task = {
        let (rec, driver, plan) = (rec.clone(), s.driver.clone(), plan.clone());
        tokio::spawn(async move {
            match driver {
                Some(d) => nemesis::apply(&plan, d.as_ref(), &rec, t0).await,
                None => 0,
            }
        })
    };
    let mut tasks = Vec::new();
    for p in 0..opts.clients as u32 {
        let (rec, workload, seed, keys) = (rec.clone(), opts.workload, opts.seed, opts.keys);
        tasks.push(match &s.backend {
            Backend::S3(api) => {
                let api = api.clone();
                tokio::spawn(async move {
                    match workload {
                        Workload::S3Set => api.set_client(&rec, p, seed, pace, deadline).await,
                        _ => api.register_client(&rec, p, seed, keys, pace, deadline).await,
                    }
                })
            }
            Backend::Nbd(vol) => {
                let vol = vol.clone();
                tokio::spawn(async move { vol.writer(&rec, p, seed, pace, deadline).await })
            }
        });
    }
    // Clients stop at the deadline; a request may take op_timeout past it.
    for t in tasks {
        t.await.context("a client task")?;
    }
    let applied = nemesis_task.await.context("the nemesis task")?;
    let mut notes = Vec::new();
    let reader = opts.clients as u32;
    match &s.backend {
        Backend::S3(api) => {
            let down = api.wait_ready(Duration::from_secs(30)).await;
            if !down.is_empty() {
                notes.push(format!("after healing, these endpoints did not answer within 30 s: {}", down.join(", ")));
            }
            match opts.workload {
                Workload::S3Set => api.final_set_reads(&rec, reader).await,
                _ => api.final_register_reads(&rec, reader, opts.keys).await,
            }
        }
        Backend::Nbd(vol) => {
            if !vol.wait_ready(Duration::from_secs(30)).await {
                notes.push("after healing, the volume did not answer a read within 30 s".into());
            }
            vol.final_reads(&rec, reader).await;
        }
    }
    let history = rec.history();
    if history.entries.len() >= record::MAX_ENTRIES {
        notes.push(format!("the history reached its cap of {} entries; clients stopped early", record::MAX_ENTRIES));
    }
    let verdicts = match opts.workload {
        Workload::S3Register => check::register(&history, check::linear::Limits::default()),
        Workload::S3Set => vec![check::set::check(&history)],
        Workload::NbdBlocks => vec![check::blocks::check(&history)],
    };
    // Availability while the clients ran (the final reads write nothing).
    let end = opts.duration.as_nanos() as u64;
    let during: History = history.ops().filter(|o| o.invoke < end).cloned().map(check::Entry::Op).collect();
    let validity = verdicts.iter().fold(Validity::Holds, |v, x| v.worst(x.validity));
    let w = WorkloadReport {
        workload: opts.workload.as_str().into(),
        target: s.label.clone(),
        seed: opts.seed,
        duration_s: opts.duration.as_secs_f64(),
        clients: opts.clients,
        keys: if opts.workload == Workload::S3Register { opts.keys } else { 0 },
        nemesis: opts.nemesis.iter().map(|k| k.as_str().to_owned()).collect(),
        ops: report::counts(&history),
        faults_applied: applied,
        faults: report::faults(&history),
        verdicts,
        availability: check::availability::measure(&during, 1_000_000_000),
        validity,
        replay: opts.replay.clone(),
        notes,
    };
    Ok((history, Report { workloads: vec![w] }))
}
