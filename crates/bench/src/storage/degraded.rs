//! The degraded-cluster section (`--fault`): a steady S3 load from the S3
//! agent, the fault applied a third of the way through and healed at two
//! thirds, throughput before, during and after, and the time from the heal
//! until the cluster is back at full redundancy (every node answering and
//! no resync backlog, as `lightningstor cluster status` reports).

use crate::agent::client::AgentClient;
use crate::agent::{Event, SteadyRequest, Tick};
use crate::cluster::{Cluster, S3Endpoint};
use crate::fault::{Fault, FaultDriver};
use crate::shaper::LinkSpec;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Throughput over one part of the load.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Phase {
    pub from_s: f64,
    pub to_s: f64,
    /// PUTs plus GETs completed per second.
    pub ops_per_s: f64,
    pub mib_s: f64,
    /// Requests that failed on every endpoint.
    pub errors: u64,
    /// Requests that succeeded on another endpoint after one failed.
    pub failovers: u64,
}

/// The section.
#[derive(Debug, Clone, Serialize)]
pub struct Degraded {
    pub fault: String,
    pub driver: String,
    pub measured_by: String,
    pub object_bytes: usize,
    pub jobs: usize,
    pub duration_s: f64,
    /// The target was down before the run: the fault was not applied, the
    /// whole load ran degraded, and nothing was healed.
    pub already_down: bool,
    pub injected_at_s: Option<f64>,
    pub healed_at_s: Option<f64>,
    pub before: Option<Phase>,
    pub during: Phase,
    pub after: Option<Phase>,
    pub acked: u64,
    pub verified: u64,
    pub lost: Vec<String>,
    pub put_p50_ms: f64,
    pub put_p99_ms: f64,
    pub get_p50_ms: f64,
    pub get_p99_ms: f64,
    /// From the heal to every node up with no resync backlog.
    pub time_to_full_redundancy_s: Option<f64>,
    /// How that was measured, or why it was not.
    pub redundancy: String,
    /// Failures applying or healing the fault.
    pub driver_errors: Vec<String>,
    pub events: Vec<Event>,
    pub ticks: Vec<Tick>,
}

/// Sums the ticks that end inside `[from, to)`.
pub fn phase(ticks: &[Tick], from: f64, to: f64) -> Phase {
    let (mut ops, mut bytes, mut errors, mut failovers) = (0u64, 0u64, 0u64, 0u64);
    for t in ticks.iter().filter(|t| t.t_s > from && t.t_s <= to + 1e-9) {
        ops += t.puts + t.gets;
        bytes += t.bytes;
        errors += t.errors;
        failovers += t.failovers;
    }
    let secs = (to - from).max(1e-9);
    Phase {
        from_s: from,
        to_s: to,
        ops_per_s: ops as f64 / secs,
        mib_s: bytes as f64 / 1048576.0 / secs,
        errors,
        failovers,
    }
}

/// Polls `cluster status` until every node answers and no resync is queued,
/// for at most `limit`. The time it took, or why it did not get there.
pub async fn wait_full_redundancy(
    c: &lightningstor::cluster::ClusterConfig,
    since: Instant,
    limit: Duration,
) -> Result<f64, String> {
    let mut last = String::new();
    while since.elapsed() < limit {
        match lightningstor::cluster::admin::status(c, Duration::from_secs(3)).await {
            Ok(nodes) => {
                let down: Vec<&str> = nodes.iter().filter(|(_, r)| r.is_err()).map(|(n, _)| n.name.as_str()).collect();
                let backlog: u64 = nodes.iter().filter_map(|(_, r)| r.as_ref().ok()).map(|s| s.resync_queue).sum();
                if down.is_empty() && backlog == 0 {
                    return Ok(since.elapsed().as_secs_f64());
                }
                last = format!("down: [{}], resync backlog {backlog}", down.join(", "));
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Err(format!("not back at full redundancy {} s after the heal ({last})", limit.as_secs()))
}

fn ms(h: &crate::hist::Histogram, p: f64) -> f64 {
    h.percentile(p) as f64 / 1e6
}

/// Runs the section.
#[allow(clippy::too_many_arguments)]
pub async fn measure(
    cluster: &Cluster,
    agent: &AgentClient,
    driver: Arc<dyn FaultDriver>,
    fault: &Fault,
    s3: &S3Endpoint,
    bucket: &str,
    duration: Duration,
    link: LinkSpec,
) -> anyhow::Result<Degraded> {
    let (size, jobs) = (1usize << 20, 4usize);
    let mut driver_errors = Vec::new();
    let already_down = match driver.is_down(fault).await {
        Ok(d) => d,
        Err(e) => {
            driver_errors.push(format!("checking {fault} before the load: {e:#}"));
            false
        }
    };
    let req = SteadyRequest {
        s3: super::measure::s3_spec(s3, bucket),
        prefix: "degraded/".into(),
        size,
        jobs,
        duration,
        tick: Duration::from_millis(500),
        link,
    };
    let t0 = Instant::now();
    let load = {
        let (agent, req) = (agent.clone(), req.clone());
        tokio::spawn(async move { agent.steady(&req).await })
    };
    let (mut injected_at, mut healed_at, mut healed) = (None, None, None);
    let mut redundancy_task = None;
    if !already_down {
        tokio::time::sleep_until((t0 + duration / 3).into()).await;
        match driver.inject(fault).await {
            Ok(()) => injected_at = Some(t0.elapsed().as_secs_f64()),
            Err(e) => driver_errors.push(format!("applying {fault}: {e:#}")),
        }
        tokio::time::sleep_until((t0 + duration * 2 / 3).into()).await;
        if injected_at.is_some() {
            match driver.heal(fault).await {
                Ok(()) => {
                    let at = Instant::now();
                    healed_at = Some(t0.elapsed().as_secs_f64());
                    healed = Some(at);
                    if let Some(c) = cluster.s3_config.clone() {
                        redundancy_task =
                            Some(tokio::spawn(
                                async move { wait_full_redundancy(&c, at, Duration::from_secs(180)).await },
                            ));
                    }
                }
                Err(e) => driver_errors.push(format!("healing {fault}: {e:#}")),
            }
        }
    }
    let reply = load.await.map_err(|e| anyhow::anyhow!("the load task failed: {e}"))??;
    let end = reply.ticks.last().map_or(duration.as_secs_f64(), |t| t.t_s);
    let (time_to_full_redundancy_s, redundancy) = match (redundancy_task, healed) {
        (Some(t), Some(_)) => match t.await {
            Ok(Ok(s)) => {
                (Some(s), "polled `cluster status` every 0.5 s from the heal: every node up, resync backlog 0".into())
            }
            Ok(Err(why)) => (None, why),
            Err(e) => (None, format!("the status poll failed: {e}")),
        },
        (None, Some(_)) => (None, "unknown: no LightningStor cluster file to read `cluster status` from".into()),
        _ if already_down => {
            (None, "not measured: the node was down before the run and the bench did not start it".into())
        }
        _ => (None, "not measured: the fault was not applied or not healed (see driver errors)".into()),
    };
    let (before, during, after) = match (injected_at, healed_at) {
        (Some(i), Some(h)) => {
            (Some(phase(&reply.ticks, 0.0, i)), phase(&reply.ticks, i, h), Some(phase(&reply.ticks, h, end)))
        }
        (Some(i), None) => (Some(phase(&reply.ticks, 0.0, i)), phase(&reply.ticks, i, end), None),
        _ => (None, phase(&reply.ticks, 0.0, end), None),
    };
    Ok(Degraded {
        fault: fault.to_string(),
        driver: driver.describe(),
        measured_by: agent.name.clone(),
        object_bytes: size,
        jobs,
        duration_s: duration.as_secs_f64(),
        already_down,
        injected_at_s: injected_at,
        healed_at_s: healed_at,
        before,
        during,
        after,
        acked: reply.acked,
        verified: reply.verified,
        lost: reply.lost,
        put_p50_ms: ms(&reply.put_hist, 50.0),
        put_p99_ms: ms(&reply.put_hist, 99.0),
        get_p50_ms: ms(&reply.get_hist, 50.0),
        get_p99_ms: ms(&reply.get_hist, 99.0),
        time_to_full_redundancy_s,
        redundancy,
        driver_errors,
        events: reply.events,
        ticks: reply.ticks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_sum_the_ticks_that_end_inside_them() {
        let t = |t_s, puts, errors| Tick { t_s, puts, gets: puts, bytes: puts * 2 << 20, errors, failovers: 0 };
        let ticks = [t(1.0, 10, 0), t(2.0, 10, 0), t(3.0, 2, 5), t(4.0, 8, 0)];
        let p = phase(&ticks, 0.0, 2.0);
        assert_eq!((p.ops_per_s, p.mib_s, p.errors), (20.0, 20.0, 0));
        let p = phase(&ticks, 2.0, 3.0);
        assert_eq!((p.ops_per_s, p.errors), (4.0, 5));
        assert_eq!(phase(&ticks, 3.0, 4.0).ops_per_s, 16.0);
    }
}
