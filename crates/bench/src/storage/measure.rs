//! The measurements behind each section of the storage report. Each takes
//! an agent (who measures), endpoints and sizes and returns one iteration's
//! raw figures; the caller interleaves iterations and summarises. The
//! coordinator itself only sets up (creates and fills volumes, buckets).

use crate::agent::client::AgentClient;
use crate::agent::{
    BlockTarget, Iperf3ClientRequest, JobRequest, ObjectsReply, ObjectsRequest, PatternRequest, ProbeRequest, S3Spec,
};
use crate::cluster::{CoronaEndpoint, S3Endpoint};
use crate::hist::Histogram;
use crate::job::Job;
use crate::loadgen::fill;
use crate::shaper::LinkSpec;
use anyhow::{Context, bail};
use coronafs::client::NbdClient;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The five block figures of the seed's CoronaFS table, one iteration.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockRun {
    pub seq_write_mib_s: f64,
    pub seq_read_mib_s: f64,
    pub rand_read_4k_iops: f64,
    pub depth32_write_mib_s: f64,
    pub depth32_read_mib_s: f64,
}

/// Latency histograms per job name, merged over iterations.
#[derive(Debug, Default)]
pub struct Latencies {
    pub read: BTreeMap<String, Histogram>,
    pub write: BTreeMap<String, Histogram>,
}

impl Latencies {
    pub fn add(&mut self, job: &str, r: &crate::loadgen::JobRun) {
        self.read.entry(job.to_owned()).or_default().merge(&r.read_hist);
        self.write.entry(job.to_owned()).or_default().merge(&r.write_hist);
    }
}

/// The seed-000 jobs, resized to `size` bytes and `runtime` each.
pub fn block_jobs(size: u64, runtime: Duration) -> anyhow::Result<Vec<Job>> {
    let p = crate::runner::load_profile("seed-000")?;
    let ov = crate::runner::Overrides { runtime: Some(runtime), size: Some(size), ramp_time: None };
    Ok(p.jobs
        .into_iter()
        .map(|mut j| {
            ov.apply(&mut j);
            j
        })
        .collect())
}

/// Runs the seed-000 jobs once on `agent` against `target`. Returns the
/// figures and, for a scratch file asked to use `O_DIRECT`, whether it did.
pub async fn block(
    agent: &AgentClient,
    target: &BlockTarget,
    jobs: &[Job],
    link: LinkSpec,
    lat: &mut Latencies,
) -> anyhow::Result<(BlockRun, Option<bool>)> {
    let mut r = BlockRun::default();
    let mut direct_used = None;
    for job in jobs {
        let req = JobRequest { target: target.clone(), job: job.clone(), max_job_time: Duration::from_secs(300), link };
        let reply = agent.job(&req).await.with_context(|| format!("job {} on agent {}", job.name, agent.name))?;
        let run = reply.run;
        if reply.direct_used == Some(false) || direct_used.is_none() {
            direct_used = reply.direct_used.or(direct_used);
        }
        lat.add(&job.name, &run);
        let mib = |b: f64| b / 1048576.0;
        match job.name.as_str() {
            "seq-write" => r.seq_write_mib_s = mib(run.write.bw_bytes),
            "seq-read" => r.seq_read_mib_s = mib(run.read.bw_bytes),
            "rand-read-4k" => r.rand_read_4k_iops = run.read.iops,
            "depth32-write" => r.depth32_write_mib_s = mib(run.write.bw_bytes),
            "depth32-read" => r.depth32_read_mib_s = mib(run.read.bw_bytes),
            other => bail!("seed-000 has an unexpected job {other}"),
        }
    }
    Ok((r, direct_used))
}

/// Fills a volume with data (untimed set-up) so reads are not of holes.
pub async fn prefill(c: &CoronaEndpoint, export: &str, size: u64) -> anyhow::Result<()> {
    let client = Arc::new(NbdClient::connect(c.nbd.as_str(), export).await?);
    let mut chunk = vec![0u8; 1 << 20];
    fill(&mut chunk, 0xF111);
    let chunk = Arc::new(chunk);
    let mut tasks = tokio::task::JoinSet::new();
    let mut off = 0;
    while off < size {
        let n = (size - off).min(1 << 20) as usize;
        let (cl, ch) = (client.clone(), chunk.clone());
        tasks.spawn(async move { cl.write(off, &ch[..n], false).await });
        off += n as u64;
        if tasks.len() >= 16
            && let Some(r) = tasks.join_next().await
        {
            r??;
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    client.flush().await?;
    Ok(())
}

/// What the CoronaFS server said about evicting a volume from its page cache
/// (`POST /v1/volumes/{name}/evict`).
pub async fn evict(c: &crate::cluster::CoronaEndpoint, volume: &str) -> anyhow::Result<serde_json::Value> {
    let r = c
        .client()?
        .evict(volume)
        .await
        .with_context(|| format!("evicting {volume} from the CoronaFS server's page cache"))?;
    Ok(serde_json::to_value(r)?)
}

/// One cross-worker iteration's figures.
#[derive(Debug, Clone)]
pub struct Cross {
    pub write_mib_s: f64,
    pub read_mib_s: f64,
    /// The server's answer to the eviction, or why it could not evict.
    pub evicted: Result<serde_json::Value, String>,
}

/// Cross-worker read: `writer` writes `size` bytes and flushes, the
/// CoronaFS server drops the volume from its page cache, then `reader` (on
/// another node) reads them back sequentially (1 MiB, depth 1) and checks
/// every byte.
#[allow(clippy::too_many_arguments)]
pub async fn cross_worker(
    writer: &AgentClient,
    reader: &AgentClient,
    c: &CoronaEndpoint,
    export: &str,
    size: u64,
    seed: u64,
    link: LinkSpec,
) -> anyhow::Result<Cross> {
    let size = size / (1 << 20) * (1 << 20);
    if size == 0 {
        bail!("volume too small for the cross-worker read");
    }
    let req = |write| PatternRequest { addr: c.nbd.clone(), export: export.into(), offset: 0, size, seed, write, link };
    let w = writer.pattern(&req(true)).await.with_context(|| format!("worker {} writing", writer.name))?;
    let evicted = evict(c, export).await.map_err(|e| format!("{e:#}"));
    let r = reader.pattern(&req(false)).await.with_context(|| format!("worker {} reading back", reader.name))?;
    let mib = |b: u64, s: f64| b as f64 / 1048576.0 / s.max(1e-9);
    Ok(Cross { write_mib_s: mib(w.bytes, w.secs), read_mib_s: mib(r.bytes, r.secs), evicted })
}

/// The S3 spec an agent gets: every live endpoint, keys, bucket.
pub fn s3_spec(e: &S3Endpoint, bucket: &str) -> S3Spec {
    S3Spec {
        endpoints: e.endpoints.clone(),
        bucket: bucket.into(),
        region: e.region.clone(),
        access_key: e.access_key.clone(),
        secret_key: e.secret_key.clone(),
    }
}

/// Creates `bucket` unless it exists, through the first endpoint that answers.
pub async fn ensure_bucket(e: &S3Endpoint, bucket: &str) -> anyhow::Result<()> {
    let mut last = None;
    for url in &e.endpoints {
        let c = crate::target::s3_client_failfast(url, &e.region, &e.access_key, &e.secret_key);
        if c.head_bucket().bucket(bucket).send().await.is_ok() {
            return Ok(());
        }
        match c.create_bucket().bucket(bucket).send().await {
            Ok(_) => return Ok(()),
            Err(err) => last = Some(anyhow::Error::new(err).context(format!("creating bucket {bucket} via {url}"))),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no S3 endpoints")))
}

/// An object batch on `agent`.
#[allow(clippy::too_many_arguments)]
pub async fn objects(
    agent: &AgentClient,
    e: &S3Endpoint,
    bucket: &str,
    prefix: &str,
    count: usize,
    size: usize,
    jobs: usize,
    link: LinkSpec,
) -> anyhow::Result<ObjectsReply> {
    let req = ObjectsRequest { s3: s3_spec(e, bucket), prefix: prefix.into(), count, size, jobs, link };
    agent.objects(&req).await.with_context(|| format!("S3 batch {prefix} on agent {}", agent.name))
}

/// Deletes the objects under `prefix` (best effort; keeps the store small
/// between iterations).
pub async fn delete_prefix(e: &S3Endpoint, bucket: &str, prefix: &str) {
    for url in &e.endpoints {
        let c = crate::target::s3_client_failfast(url, &e.region, &e.access_key, &e.secret_key);
        let Ok(list) = c.list_objects_v2().bucket(bucket).prefix(prefix).send().await else { continue };
        for o in list.contents() {
            if let Some(k) = o.key() {
                let _ = c.delete_object().bucket(bucket).key(k).send().await;
            }
        }
        return;
    }
}

/// One network-baseline iteration: our bulk TCP probe from `from` to
/// `to`'s sink, and iperf3 between the same two agents when both have it.
pub struct NetRun {
    pub probe_mib_s: f64,
    pub probe_retransmits: f64,
    /// iperf3's MiB/s and retransmits, or why it could not run.
    pub iperf3: Option<Result<(f64, f64), String>>,
}

pub async fn network(
    from: &AgentClient,
    sink: SocketAddr,
    to: &AgentClient,
    iperf3: bool,
    duration: Duration,
    link: LinkSpec,
) -> anyhow::Result<NetRun> {
    let p = from
        .probe(&ProbeRequest { to: sink, duration, link })
        .await
        .with_context(|| format!("TCP probe {} -> {}", from.name, to.name))?;
    let iperf3 = if iperf3 {
        let r = async {
            let port = to.iperf3_server().await.with_context(|| format!("iperf3 -s on {}", to.name))?;
            let r = from
                .iperf3_client(&Iperf3ClientRequest { to: SocketAddr::new(to.addr.ip(), port), duration, link })
                .await
                .with_context(|| format!("iperf3 {} -> {}", from.name, to.name))?;
            anyhow::Ok((r.bytes_per_s / 1048576.0, r.retransmits as f64))
        }
        .await;
        Some(r.map_err(|e| format!("{e:#}")))
    } else {
        None
    };
    Ok(NetRun { probe_mib_s: p.bytes_per_s / 1048576.0, probe_retransmits: f64::from(p.retransmits), iperf3 })
}

/// Which S3 endpoints accept a TCP connection within 2 s, and why the others do not.
pub async fn live_endpoints(e: &S3Endpoint) -> (Vec<String>, Vec<String>) {
    let mut live = Vec::new();
    let mut dead = Vec::new();
    for u in &e.endpoints {
        let ok = match crate::cluster::url_addr(u) {
            Ok(a) => match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(a)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err("no answer within 2 s".into()),
            },
            Err(err) => Err(format!("{err:#}")),
        };
        match ok {
            Ok(()) => live.push(u.clone()),
            Err(why) => dead.push(format!("{u}: {why}")),
        }
    }
    (live, dead)
}
