//! CoronaFS against nbdkit and qemu-nbd (and, with `--peers ceph`, Ceph
//! RBD): one and the same file served by each NBD server, fio on each in the
//! same run, iterations interleaved so that machine noise falls on every
//! peer alike. Ceph serves an image of the same size filled with data.

use crate::fio::{self, FioResult, Workload};
use crate::peers::{Peer, PeerProc};
use crate::stats::Summary;
use anyhow::Context;
use serde::Serialize;
use std::io::Write;
use std::path::Path;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Size of the served file in bytes.
    pub size: u64,
    pub iterations: usize,
    /// Seconds per fio run.
    pub runtime_s: u32,
    pub peers: Vec<Peer>,
    /// The cluster of the Ceph peers (`bench peers ceph up`).
    pub ceph: Option<crate::ceph::Ceph>,
}

pub const WORKLOADS: [Workload; 4] = [
    Workload { name: "seq-read-1m-qd16", rw: "read", bs: "1m", iodepth: 16, numjobs: 1 },
    Workload { name: "seq-write-1m-qd16", rw: "write", bs: "1m", iodepth: 16, numjobs: 1 },
    Workload { name: "rand-read-4k-qd1", rw: "randread", bs: "4k", iodepth: 1, numjobs: 1 },
    Workload { name: "rand-read-4k-qd32", rw: "randread", bs: "4k", iodepth: 32, numjobs: 1 },
];

/// 4k QD1 once more with fio kept to the first CPU and the server to the
/// last one (see [`placement`]). At QD1 each request wakes the server and
/// then fio; which CPU the scheduler wakes each on can change the result
/// several-fold on a virtual machine (a wake-up on an idle vCPU is slow),
/// so unpinned QD1 measures placement luck as much as the server. With the
/// placement fixed and the same for every server, the row compares the
/// servers' own cost per request.
pub const PINNED_QD1: Workload =
    Workload { name: "rand-read-4k-qd1-pinned", rw: "randread", bs: "4k", iodepth: 1, numjobs: 1 };

/// (fio's CPU, the server's CPU) for [`PINNED_QD1`]: the first and the last
/// CPU this process may use; `None` with fewer than two.
pub fn placement() -> Option<(usize, usize)> {
    let cpus = crate::cpu::allowed();
    (cpus.len() >= 2).then(|| (cpus[0], cpus[cpus.len() - 1]))
}

/// The memory probe: QD32 on 8 connections.
pub const MEMORY_WORKLOAD: Workload =
    Workload { name: "rand-read-4k-qd32-x8", rw: "randread", bs: "4k", iodepth: 32, numjobs: 8 };

#[derive(Debug, Clone, Serialize)]
pub struct PeerFigures {
    pub peer: String,
    pub mib_s: Summary,
    pub iops: Summary,
    pub lat_p50_us: Summary,
    pub lat_p99_us: Summary,
    /// Server CPU time (user + system) per operation, in microseconds.
    pub server_cpu_us_per_op: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    pub workload: Workload,
    pub peers: Vec<PeerFigures>,
    /// Each CoronaFS engine against each other server, iteration by
    /// iteration.
    pub paired: Vec<PairedRatio>,
}

/// One CoronaFS engine's IOPS over a peer's, taken per iteration (the two
/// ran one after the other within it) and summarised over the iterations.
/// A machine whose speed drifts between iterations moves both figures of
/// an iteration alike, so the median of these ratios holds still where
/// the ratio of the two medians, which may pair a slow iteration of one
/// with a fast one of the other, does not.
#[derive(Debug, Clone, Serialize)]
pub struct PairedRatio {
    pub ours: String,
    pub peer: String,
    pub ratio: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryResult {
    pub peer: String,
    pub peak_rss_bytes: u64,
    pub iops: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Each peer: how fio reached it.
    #[serde(default)]
    pub paths: Vec<(String, String)>,
    /// (fio's CPU, the server's CPU) of the pinned QD1 row; `None`: no such row.
    #[serde(default)]
    pub pinned: Option<(usize, usize)>,
    /// The Ceph the Ceph peers ran on, described.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph: Option<String>,
    pub size_bytes: u64,
    pub iterations: usize,
    pub runtime_s: u32,
    pub workloads: Vec<WorkloadResult>,
    pub memory: Vec<MemoryResult>,
}

fn make_file(path: &Path, size: u64) -> anyhow::Result<()> {
    // Real data everywhere, so reads are not served from holes.
    let mut chunk = vec![0u8; 1 << 20];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for b in chunk.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for i in 0..size.div_ceil(1 << 20) {
        chunk[0..8].copy_from_slice(&i.to_le_bytes());
        f.write_all(&chunk)?;
    }
    f.flush()?;
    Ok(())
}

/// Runs the comparison, printing progress lines to stderr.
pub fn run(opts: &Options, workdir: &Path) -> anyhow::Result<Report> {
    let file = workdir.join("disk");
    eprintln!("bench: writing a {} MiB test file", opts.size >> 20);
    make_file(&file, opts.size)?;
    let size_arg = format!("{}", opts.size);
    let pin = placement();
    if pin.is_none() {
        eprintln!("bench: fewer than two CPUs: no pinned QD1 row");
    }
    // Each case: the workload and, for the pinned one, (fio's CPU, the server's).
    let cases: Vec<(&Workload, Option<(usize, usize)>)> =
        WORKLOADS.iter().map(|w| (w, None)).chain(pin.map(|p| (&PINNED_QD1, Some(p)))).collect();
    let mut raw: Vec<Vec<Vec<(FioResult, f64)>>> = vec![vec![Vec::new(); opts.peers.len()]; cases.len()];
    let mut memory = Vec::new();
    for (pi, &peer) in opts.peers.iter().enumerate() {
        let _ = pi;
        // Start each peer once and make sure it can be started before the long loop.
        PeerProc::start(peer, &file, opts.ceph.as_ref()).with_context(|| format!("checking {}", peer.label()))?;
    }
    for it in 0..opts.iterations {
        for (wi, &(w, pin)) in cases.iter().enumerate() {
            for (pi, &peer) in opts.peers.iter().enumerate() {
                let p = PeerProc::start(peer, &file, opts.ceph.as_ref())?;
                if let Some((_, server_cpu)) = pin {
                    p.pin_to(server_cpu)?;
                }
                let cpu0 = p.cpu_seconds();
                let r = run_fio(&p, w, &size_arg, opts.runtime_s, pin.map(|(fio_cpu, _)| fio_cpu))?;
                let ops = r.iops * f64::from(opts.runtime_s);
                let cpu_us_per_op = if ops > 0.0 { (p.cpu_seconds() - cpu0) * 1e6 / ops } else { 0.0 };
                eprintln!(
                    "bench: iteration {}/{} {:<20} {:<16} {:>9.1} MiB/s {:>9.0} IOPS p50 {:>7.1} us p99 {:>7.1} us server CPU {:>6.1} us/op",
                    it + 1,
                    opts.iterations,
                    w.name,
                    peer.label(),
                    r.bw_bytes / 1048576.0,
                    r.iops,
                    r.lat_p50_us,
                    r.lat_p99_us,
                    cpu_us_per_op
                );
                raw[wi][pi].push((r, cpu_us_per_op));
            }
        }
    }
    for &peer in &opts.peers {
        let p = PeerProc::start(peer, &file, opts.ceph.as_ref())?;
        let r = run_fio(&p, &MEMORY_WORKLOAD, &size_arg, opts.runtime_s, None)?;
        let (peak, _) = p.memory();
        eprintln!(
            "bench: memory {:<16} peak RSS {:>6.1} MiB at QD32 x 8 connections ({:.0} IOPS)",
            peer.label(),
            peak as f64 / 1048576.0,
            r.iops
        );
        memory.push(MemoryResult { peer: peer.label(), peak_rss_bytes: peak, iops: r.iops });
    }
    let workloads = cases
        .iter()
        .zip(raw)
        .map(|(&(w, _), per_peer)| WorkloadResult {
            workload: w.clone(),
            paired: paired(&opts.peers, &per_peer),
            peers: opts
                .peers
                .iter()
                .zip(per_peer)
                .map(|(p, rs)| {
                    let col = |f: fn(&FioResult) -> f64| Summary::of(&rs.iter().map(|(r, _)| f(r)).collect::<Vec<_>>());
                    PeerFigures {
                        peer: p.label(),
                        mib_s: col(|r| r.bw_bytes / 1048576.0),
                        iops: col(|r| r.iops),
                        lat_p50_us: col(|r| r.lat_p50_us),
                        lat_p99_us: col(|r| r.lat_p99_us),
                        server_cpu_us_per_op: Summary::of(&rs.iter().map(|(_, c)| *c).collect::<Vec<_>>()),
                    }
                })
                .collect(),
        })
        .collect();
    Ok(Report {
        pinned: pin,
        paths: opts.peers.iter().map(|p| (p.label(), p.path().to_owned())).collect(),
        ceph: opts.ceph.as_ref().map(crate::ceph::Ceph::describe),
        size_bytes: opts.size,
        iterations: opts.iterations,
        runtime_s: opts.runtime_s,
        workloads,
        memory,
    })
}

/// Every CoronaFS engine's per-iteration IOPS ratio to every other server.
fn paired(peers: &[Peer], runs: &[Vec<(FioResult, f64)>]) -> Vec<PairedRatio> {
    let labelled: Vec<(String, Vec<f64>)> =
        peers.iter().zip(runs).map(|(p, rs)| (p.label(), rs.iter().map(|(r, _)| r.iops).collect())).collect();
    let mut out = Vec::new();
    for (ours, o) in labelled.iter().filter(|(l, _)| l.starts_with("coronafs")) {
        for (peer, t) in labelled.iter().filter(|(l, _)| !l.starts_with("coronafs")) {
            out.push(PairedRatio { ours: ours.clone(), peer: peer.clone(), ratio: Summary::paired_ratios(o, t) });
        }
    }
    out
}

/// fio on a peer: the rbd engine for `rbd://` peers, else the nbd engine.
/// With `cpu`, fio is kept to that CPU.
fn run_fio(p: &PeerProc, w: &Workload, size: &str, runtime_s: u32, cpu: Option<usize>) -> anyhow::Result<FioResult> {
    match crate::target::TargetSpec::parse(&p.uri)? {
        crate::target::TargetSpec::Rbd { pool, image, conf } => {
            fio::run_rbd(&pool, &image, &crate::target::TargetSpec::ceph_conf(&conf), w, size, runtime_s, cpu)
        }
        _ => fio::run_nbd_on(&p.uri, w, size, runtime_s, cpu),
    }
}

/// The report as a Markdown table, with coronafs / peer ratios of medians.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let names: Vec<&str> = r.paths.iter().map(|(p, _)| p.as_str()).filter(|p| !p.starts_with("coronafs")).collect();
    s.push_str(&format!(
        "## Block: CoronaFS vs {}\n\nOne {} MiB file served by each NBD server (Ceph: an RBD image of that size, filled with data), {} of {} s each, interleaved. Median (spread = (max-min)/median).\n\n",
        if names.is_empty() { "its peers".to_owned() } else { names.join(", ") },
        r.size_bytes >> 20,
        crate::text::count(r.iterations, "iteration"),
        r.runtime_s
    ));
    for (peer, path) in &r.paths {
        s.push_str(&format!("- {peer}: {path}\n"));
    }
    if let Some((fio_cpu, server_cpu)) = r.pinned {
        s.push_str(&format!(
            "- {}: fio kept to CPU {fio_cpu} and every thread of the server to CPU {server_cpu} (Ceph's daemons are not pinned); the other rows run where the scheduler puts them. At QD1 that placement can change the result several-fold on a virtual machine, so the pinned row is the one that compares the servers' own cost per request.\n",
            PINNED_QD1.name
        ));
    }
    if let Some(c) = &r.ceph {
        s.push_str(&format!(
            "- Ceph: {c}. Server CPU for Ceph is every daemon of the cluster (and nbdkit when it exports).\n"
        ));
    }
    s.push('\n');
    s.push_str("| Workload | Server | MiB/s | IOPS | p50 µs | p99 µs | spread | server CPU µs/op |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
    for w in &r.workloads {
        for p in &w.peers {
            s.push_str(&format!(
                "| {} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0}% | {:.1} |\n",
                w.workload.name,
                p.peer,
                p.mib_s.median,
                p.iops.median,
                p.lat_p50_us.median,
                p.lat_p99_us.median,
                p.iops.spread_pct(),
                p.server_cpu_us_per_op.median
            ));
        }
    }
    s.push_str("\n### Ratios (IOPS ratio of the medians; paired: median [min..max] of the per-iteration IOPS ratios, each iteration's two runs back to back; efficiency = peer server CPU per op / coronafs server CPU per op)\n\n| Workload | Ratio | IOPS ratio | Paired | Efficiency |\n|---|---|---:|---:|---:|\n");
    for w in &r.workloads {
        for c in w.peers.iter().filter(|p| p.peer.starts_with("coronafs")) {
            for o in w.peers.iter().filter(|p| !p.peer.starts_with("coronafs")) {
                let ratio = if o.iops.median > 0.0 { c.iops.median / o.iops.median } else { 0.0 };
                let cpu = c.server_cpu_us_per_op.median;
                let eff = if cpu > 0.0 { o.server_cpu_us_per_op.median / cpu } else { 0.0 };
                let paired = w.paired.iter().find(|p| p.ours == c.peer && p.peer == o.peer).map_or_else(
                    || "-".to_owned(),
                    |p| format!("{:.2} [{:.2}..{:.2}]", p.ratio.median, p.ratio.min, p.ratio.max),
                );
                s.push_str(&format!(
                    "| {} | {} / {} | {:.2} | {} | {:.2} |\n",
                    w.workload.name, c.peer, o.peer, ratio, paired, eff
                ));
            }
        }
    }
    s.push_str("\n### Server memory at QD32 on 8 connections\n\n| Server | Peak RSS MiB | IOPS |\n|---|---:|---:|\n");
    for m in &r.memory {
        s.push_str(&format!("| {} | {:.1} | {:.0} |\n", m.peer, m.peak_rss_bytes as f64 / 1048576.0, m.iops));
    }
    s
}
