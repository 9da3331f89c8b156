//! Runs the failover row: finds the cluster and what stops its nodes, then
//! for each trial makes a volume with copies on every node (primary on the
//! next node in turn), attaches the writer, stops the primary, waits for
//! the client to resume, reads back what was flushed, finds the new
//! primary, and starts the stopped node again.
//!
//! Embedded: a [`CoronaProcs`] cluster of child processes started for this
//! row. Deployed: the nodes of `[coronafs] cluster_file`, stopped through
//! `[faults]` (the Docker lab's containers).

use super::writer::{self, Record};
use super::{Failover, Trial};
use crate::cluster::Cluster;
use crate::cluster::corona_procs::CoronaProcs;
use crate::fault::{Fault, FaultDriver, FaultKind};
use crate::storage::Section;
use coronafs::api_client::ApiClient;
use coronafs::cluster::ClusterFile;
use plasmavmc::guest::{Attachment, BLOCK, written_seq};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Size of each trial's volume (the writer spreads over all of it).
pub const VOLUME_SIZE: u64 = 64 << 20;
/// Writes before the stop: at least this long...
const BEFORE: Duration = Duration::from_secs(1);
/// ...and after the first write acknowledged by the new primary.
const AFTER: Duration = Duration::from_secs(1);
/// Lost blocks listed in the report at most.
const LOST_LISTED: usize = 5;

/// What the trials run against.
struct Setup<'a> {
    file: ClusterFile,
    driver: &'a dyn FaultDriver,
    stopped_by: String,
    path: String,
    nodes: String,
    /// Volume names start with this.
    prefix: String,
    /// The nodes' control-API token (one for the cluster), if they have one.
    token: Option<svc_kit::api_token::ApiToken>,
}

fn api_of(s: &Setup<'_>, a: std::net::SocketAddr) -> ApiClient {
    ApiClient::new(&format!("http://{a}")).with_token(s.token.clone())
}

/// The row for `cluster`, with `trials` failovers (the primary moves to the
/// next node for each), or why it is not measured.
pub async fn section(cluster: &Cluster, trials: usize) -> Section<Failover> {
    let token = crate::cluster::embedded::random_token().unwrap_or_else(|_| std::process::id().to_string());
    let prefix = format!("bench-failover-{}", &token[..8.min(token.len())]);
    if let Some(dir) = cluster.data_dir() {
        let procs = match CoronaProcs::start(&dir.join("coronafs-failover")).await {
            Ok(p) => p,
            Err(e) => return Section::na(format!("the failover cluster did not start: {e:#}")),
        };
        let setup = Setup {
            file: procs.file.clone(),
            driver: &procs,
            stopped_by: procs.describe(),
            path: "the client and the nodes on this one host, over loopback TCP (no network crossed)".into(),
            nodes: format!(
                "{} CoronaFS nodes started for this row as child processes of the bench (not the in-process nodes \
                 of the rows above), each with its own data dir on the same file system",
                procs.file.nodes.len()
            ),
            prefix,
            token: None,
        };
        let r = run(&setup, trials).await;
        procs.stop().await;
        return r;
    }
    let Some(c) = &cluster.setup.coronafs else {
        return Section::na("CoronaFS is not in the cluster file");
    };
    let Some(path) = &c.cluster_file else {
        return Section::na(
            "[coronafs] names no cluster_file, so the bench does not know the CoronaFS nodes that hold the copies \
             or where the new primary will be",
        );
    };
    let file = match ClusterFile::load(path) {
        Ok(f) => f,
        Err(e) => return Section::na(format!("coronafs.cluster_file {}: {e}", path.display())),
    };
    let token = match c.api_token.as_deref().map(svc_kit::api_token::ApiToken::new).transpose() {
        Ok(t) => t,
        Err(e) => return Section::na(format!("coronafs.api_token: {e}")),
    };
    let Some(driver) = &cluster.faults else {
        return Section::na("nothing here can stop a CoronaFS node (the cluster file has no [faults])");
    };
    let setup = Setup {
        stopped_by: format!(
            "kill:coronafs@NODE through {}: the container NODE-coronafs gets SIGKILL, and is started again after \
             the trial",
            driver.describe()
        ),
        path: "the client in the bench's container, the nodes in their containers, across the lab's network".into(),
        nodes: format!("the {} CoronaFS nodes of {}, in Docker containers", file.nodes.len(), path.display()),
        file,
        driver: driver.as_ref(),
        prefix,
        token,
    };
    run(&setup, trials).await
}

async fn run(s: &Setup<'_>, trials: usize) -> Section<Failover> {
    let f = &s.file;
    let copies = f.nodes.len().min(3);
    if f.failover_after_ms == 0 {
        return Section::na("failover is off in the CoronaFS cluster file (failover_after_ms = 0)");
    }
    if copies < 3 || f.write_quorum * 2 <= copies {
        return Section::na(format!(
            "the CoronaFS cluster has {} nodes and write quorum {}: a failover needs 3 copies and a majority quorum",
            f.nodes.len(),
            f.write_quorum
        ));
    }
    let mut done = Vec::new();
    for i in 0..trials.max(1) {
        let primary = &f.nodes[i % f.nodes.len()];
        let volume = format!("{}-{}", s.prefix, i + 1);
        let t = trial(s, &primary.name, &volume, copies).await;
        let stop = t.error.is_some() && t.notes.iter().any(|n| n.starts_with("restarting"));
        done.push(t);
        if stop {
            break;
        }
    }
    Section::Measured(Failover::new(
        copies,
        f.write_quorum,
        f.heartbeat_ms,
        f.failover_after_ms,
        s.stopped_by.clone(),
        s.path.clone(),
        s.nodes.clone(),
        done,
    ))
}

/// One failover with `primary` stopped.
async fn trial(s: &Setup<'_>, primary: &str, volume: &str, copies: usize) -> Trial {
    let mut t = Trial { volume: volume.into(), old_primary: primary.into(), epoch_before: 1, ..Trial::default() };
    let fault = match Fault::new(FaultKind::Kill, "coronafs", primary) {
        Ok(x) => x,
        Err(e) => {
            t.error = Some(e.to_string());
            return t;
        }
    };
    let mut stopped = false;
    if let Err(e) = attach_and_stop(s, &fault, volume, copies, &mut t, &mut stopped).await {
        t.error = Some(e);
    }
    if stopped {
        match s.driver.heal(&fault).await {
            Ok(()) => {
                if let Err(e) = wait_api(s, primary).await {
                    t.notes.push(format!("restarting {primary}: {e}"));
                }
            }
            Err(e) => t.notes.push(format!("restarting {primary}: {e:#}")),
        }
    }
    t
}

/// Waits (60 s at most) until `node`'s control API answers again.
async fn wait_api(s: &Setup<'_>, node: &str) -> Result<(), String> {
    let n = s.file.node(node).map_err(|e| e.to_string())?;
    let api = api_of(s, n.api);
    let t = Instant::now();
    loop {
        match api.info().await {
            Ok(_) => return Ok(()),
            Err(e) if t.elapsed() > Duration::from_secs(60) => {
                return Err(format!("no answer 60 s after the start: {e}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The trial up to the read-back and the new primary; `stopped` says
/// whether the primary was (asked to be) stopped, so it is started again.
async fn attach_and_stop(
    s: &Setup<'_>,
    fault: &Fault,
    volume: &str,
    copies: usize,
    t: &mut Trial,
    stopped: &mut bool,
) -> Result<(), String> {
    let f = &s.file;
    let p = f.node(&fault.node).map_err(|e| e.to_string())?;
    let api = api_of(s, p.api);
    let req = coronafs::dto::CreateVolume {
        name: volume.into(),
        size: Some(VOLUME_SIZE),
        from_snapshot: None,
        replicas: Some(copies),
    };
    api.create_volume(&req).await.map_err(|e| format!("creating {volume} with {copies} copies on {}: {e}", p.name))?;
    // As PlasmaVMC does when it attaches a VM's disk.
    api.fence(volume, 1).await.map_err(|e| format!("fencing {volume} at epoch 1: {e}"))?;
    let nbd: Vec<String> = f.nodes.iter().map(|n| n.nbd.to_string()).collect();
    let att = Attachment::connect(&nbd, volume, "bench", volume, 1, Default::default())
        .await
        .map_err(|e| format!("attaching {volume}: {e}"))?;
    let (stop, record) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Record::default())));
    let t0 = Instant::now();
    let blocks = VOLUME_SIZE / BLOCK;
    let w = tokio::spawn(writer::run(att.clone(), blocks, t0, stop.clone(), record.clone()));
    let rec = |f: &dyn Fn(&Record) -> bool| f(&record.lock().unwrap_or_else(|e| e.into_inner()));

    // Before: at least BEFORE, and two FLUSHes done.
    tokio::time::sleep(BEFORE).await;
    let wait = Instant::now();
    while !rec(&|r| r.flushes.len() >= 2 || r.error.is_some()) {
        if wait.elapsed() > Duration::from_secs(20) {
            stop.store(true, Ordering::Relaxed);
            return Err("the client did not flush twice in 20 s before the stop".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if let Some(e) = record.lock().unwrap_or_else(|e| e.into_inner()).error.clone() {
        return Err(format!("the client failed before the stop: {e}"));
    }

    let stop_s = t0.elapsed().as_secs_f64();
    *stopped = true;
    let r = s.driver.inject(fault).await;
    t.stop_call_s = t0.elapsed().as_secs_f64() - stop_s;
    if let Err(e) = r {
        stop.store(true, Ordering::Relaxed);
        let _ = w.await;
        return Err(format!("stopping {}: {e:#}", fault.node));
    }

    // Until the client reconnected and wrote for AFTER on the new connection.
    let limit = Duration::from_millis(f.failover_after_ms * 6).max(Duration::from_secs(30));
    let mut resumed_at = None;
    let outcome = loop {
        if t.reconnect_s.is_none() && att.report().await.reconnects > 0 {
            t.reconnect_s = Some(t0.elapsed().as_secs_f64() - stop_s);
        }
        let (first_new, error) = {
            let r = record.lock().unwrap_or_else(|e| e.into_inner());
            let c0 = super::conn_at(&r.acks, stop_s);
            (r.acks.iter().find(|a| a.conn > c0).map(|a| a.t_s), r.error.clone())
        };
        if let Some(e) = error {
            break Err(format!("the client stopped after the stop: {e}"));
        }
        if let Some(first) = first_new {
            let at = *resumed_at.get_or_insert(first);
            if t0.elapsed().as_secs_f64() >= at + AFTER.as_secs_f64() {
                break Ok(());
            }
        } else if t0.elapsed().as_secs_f64() - stop_s > limit.as_secs_f64() {
            break Err(format!("no write acknowledged within {} s of the stop", limit.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    stop.store(true, Ordering::Relaxed);
    let flushed = w.await.map_err(|e| format!("the client task: {e}"))?;
    let report = att.report().await;
    t.reconnects = report.reconnects;
    t.epoch_after = att.epoch();
    {
        let r = record.lock().unwrap_or_else(|e| e.into_inner());
        let c0 = super::conn_at(&r.acks, stop_s);
        t.writes_acked = r.acks.len() as u64;
        t.flush_eio = r.flush_eio;
        if let Some((at, e)) = &r.first_flush_eio {
            t.notes.push(format!(
                "the new primary answered FLUSH with EIO {} (retried every 50 ms), the first {:.2} s after the stop: {e}",
                crate::text::count(r.flush_eio as usize, "time"),
                at - stop_s
            ));
        }
        (t.writes_flushed_before, t.writes_flushed_after) = super::flushed_split(&r.flushes, c0);
        if let Some(p) = super::pause(&r.acks, stop_s) {
            t.io_pause_s = Some(p.io_pause_s());
            t.stop_to_first_write_s = Some(p.first_after_s - stop_s);
        }
        if outcome.is_ok()
            && let Some(e) = &r.error
        {
            t.error = Some(format!("the final FLUSH failed: {e}"));
        }
    }
    outcome?;
    read_back(&att, &flushed, t).await;
    t.new_primary = new_primary(s, volume, &fault.node, t).await;
    drop(att);
    if let Some(np) = &t.new_primary
        && let Ok(n) = s.file.node(np)
        && let Err(e) = api_of(s, n.api).delete(volume, true).await
    {
        t.notes.push(format!("deleting {volume} on {np}: {e}"));
    }
    Ok(())
}

/// Reads back every flushed block through the attachment (now on the new
/// primary): each must hold its flushed write or a later one.
async fn read_back(att: &Attachment, flushed: &plasmavmc::wire::WriteLog, t: &mut Trial) {
    for (&block, &seq) in flushed {
        match att.read(block * BLOCK, BLOCK as usize).await {
            Ok(data) => {
                t.blocks_checked += 1;
                match written_seq(&att.vm_id, block, &data) {
                    Some(got) if got >= seq => {}
                    got => {
                        t.lost_flushed_writes += 1;
                        if t.lost.len() < LOST_LISTED {
                            t.lost.push(format!(
                                "block {block} should hold write {seq} or later, but {}",
                                got.map_or("holds no write of this client".to_owned(), |g| format!("holds write {g}"))
                            ));
                        }
                    }
                }
            }
            Err(e) => {
                t.error = Some(format!("reading back block {block}: {e}"));
                return;
            }
        }
    }
}

/// The surviving node that has the volume open as its primary at a higher
/// epoch (it names the other copies), as its control API says.
async fn new_primary(s: &Setup<'_>, volume: &str, old: &str, t: &mut Trial) -> Option<String> {
    for n in s.file.nodes.iter().filter(|n| n.name != old) {
        match api_of(s, n.api).get(volume).await {
            Ok(v) if !v.replicas.is_empty() && v.epoch > t.epoch_before => return Some(n.name.clone()),
            Ok(_) => {}
            Err(e) => t.notes.push(format!("asking {} about {volume}: {e}", n.name)),
        }
    }
    None
}
