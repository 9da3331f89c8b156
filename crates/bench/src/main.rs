//! The `bench` command.

use anyhow::Context;
use bench::job::parse_duration;
use bench::nbd_compare::{self, Options};
use bench::peers;
use clap::{Parser, Subcommand};
use coronafs::backend::IoEngine;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Measures the storage stack side by side with reference peers run in the
/// same run, and reports medians and spreads.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The main job: stand up a fresh cluster (or use --cluster), measure
    /// the network, local disk, CoronaFS, LightningStor and the VM image
    /// path through their real interfaces, and write storage-benchmarks.md,
    /// results.json and SVG charts to --out-dir.
    FreshBenchStorage(StorageArgs),
    /// Run a profile (built-in seed-000..seed-004, or a TOML job file) against
    /// any target with our own load generator, and report IOPS, bandwidth and
    /// latency percentiles per job: mean and standard deviation over the
    /// iterations.
    ///
    /// Targets: nbd://host:port/export, a file, block device or directory
    /// (O_DIRECT when the job says direct = true), or
    /// s3://bucket?endpoint=http://host:port (keys from --access-key/--secret-key
    /// or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY).
    Run(RunArgs),
    /// Compare two result files (bench run --json, or results.json) figure by
    /// figure, and exit 1 on a regression.
    ///
    /// A figure regresses when its median got worse by more than
    /// --max-regression AND the two runs' min..max ranges do not overlap
    /// (the new run's best iteration is worse than the old run's worst).
    /// Latencies, durations, retransmits, errors and CPU per operation are
    /// better lower; bandwidth, IOPS and rates higher. A figure with fewer
    /// than 3 iterations on either side has no range to judge: it is shown
    /// as "not judged" with a warning (use 5 iterations for a gate: bench run
    /// --iterations 5). Exit status: 0 no regression, 1 regression, 2 error
    /// (unreadable or non-JSON file, no figure in common, nothing with
    /// enough iterations to judge, bad --max-regression).
    Compare {
        old: PathBuf,
        new: PathBuf,
        /// How much worse a median may get before the ranges are looked at, in percent.
        #[arg(long, default_value = "10%")]
        max_regression: String,
    },
    /// Run each job with our load generator and with fio on the same target,
    /// interleaved, and print ours/fio IOPS ratios; exit 1 when a median
    /// ratio is outside --tolerance. By default the four nbd-compare
    /// workloads (nbd-4) on a CoronaFS export started in this process, and
    /// seed-003 on files in a temporary directory.
    Accuracy(AccuracyArgs),
    /// Serve one file through CoronaFS, nbdkit and qemu-nbd and run the same
    /// fio workloads (nbd engine) on each; print MiB/s, IOPS, p50/p99 and ratios.
    NbdCompare {
        /// Size of the test file (K/M/G suffixes).
        #[arg(long, default_value = "1G")]
        size: String,
        /// Iterations per workload and server.
        #[arg(long, default_value_t = 3)]
        iterations: usize,
        /// Seconds per fio run.
        #[arg(long, default_value_t = 5)]
        runtime: u32,
        /// CoronaFS engines to include (comma-separated: uring, threads).
        #[arg(long, value_delimiter = ',', default_value = "uring,threads")]
        engines: Vec<IoEngine>,
        /// Also write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Reference peers beside CoronaFS (comma-separated): nbdkit,
        /// qemu-nbd, and ceph (RBD at 3 copies and at 1, through librbd and
        /// through an NBD export; needs `bench peers ceph up`).
        #[arg(long, value_delimiter = ',', default_value = "nbdkit,qemu-nbd", value_parser = ["nbdkit", "qemu-nbd", "ceph"])]
        peers: Vec<String>,
        /// Where `bench peers ceph up` put the Ceph [default: $TMPDIR/bench-ceph].
        #[arg(long)]
        ceph_dir: Option<PathBuf>,
    },
    /// Check a service's promises under faults: clients run a workload
    /// while a nemesis kills and pauses nodes, every operation is recorded
    /// (invoke and complete times on one clock, endpoint, outcome) to
    /// OUT/history.jsonl with the faults, and checkers run over the history.
    ///
    /// Workloads: s3-register (clients PUT unique values to --keys keys and
    /// GET them, each request through a random endpoint; checked for
    /// linearizability per key and read-your-acknowledged-writes) and s3-set
    /// (clients PUT unique keys; after healing every endpoint lists them;
    /// checked that no acknowledged key is lost and nothing never written
    /// appears) and nbd-blocks (clients write self-describing blocks, each
    /// naming its block, writer and sequence with a checksum, and FLUSH every
    /// 8 writes, through PlasmaVMC's reconnecting attachment to a volume with
    /// a copy on each of 3 embedded CoronaFS nodes; after healing every block
    /// is read back; checked that none is older than its last flushed write
    /// and none is torn or foreign).
    ///
    /// An operation is ok, failed (connection refused or a 4xx: it did not
    /// happen) or indeterminate (a 5xx, a timeout, the connection lost: it
    /// may have happened, at any time after it was sent).
    ///
    /// The fault schedule is a function of --seed, --nemesis and --duration:
    /// the same command replays the same faults on the same nodes at the
    /// same times, and each client makes the same choices (the interleaving
    /// of clients and the cluster's timing are not replayed).
    /// OUT/check.md and OUT/check.json hold op counts, faults, each
    /// checker's verdict and every anomaly with the operations that show it.
    ///
    /// Exit status: 0 every check holds; 1 a check found a violation; 2 the
    /// run could not be made, or a check could not decide (e.g. the
    /// linearizability search ran out of effort) and none found a violation.
    #[command(
        after_help = "Examples:\n  bench check s3-register --nemesis kill,pause --duration 60s --seed 7 --out check-out\n  \
                            bench check s3-set --target 's3://bucket?endpoint=http://10.0.0.5:9000' --nemesis none \\\n      \
                            --access-key AK --secret-key SK --duration 30s --out check-out"
    )]
    Check(CheckArgs),
    /// Run a load agent: a long-running service (one per node) that runs
    /// the load the coordinator (`fresh-bench-storage --cluster FILE`) sends
    /// it, against NBD exports, its own scratch disk and S3 endpoints, and
    /// returns raw figures and latency histograms. Also a TCP sink for the
    /// network baseline, and iperf3 (when installed) to check that baseline.
    ///
    /// Every request needs the token (BENCH_AGENT_TOKEN or --token-file):
    /// an agent writes to whatever volume or bucket it is pointed at.
    /// Prints `listening on ADDR` once it serves. See docs/bench.md, "Agents".
    Agent(AgentArgs),
    /// Reference peers that run beside the stack on this machine.
    #[command(subcommand)]
    Peers(PeersCmd),
    /// Check that services answer; exit 0 when every target does, 1 when one
    /// does not (saying which and why). The lab's Compose healthchecks run
    /// it (the image has no shell or curl); with --wait it retries until all
    /// answer, for scripts that have just started a service.
    ///
    /// Targets: http://HOST:PORT/PATH (a GET answered 2xx), nbd://HOST:PORT
    /// (NBD handshake and export list), nbd://HOST:PORT/EXPORT (handshake
    /// opening that export), tcp://HOST:PORT (a connection accepted).
    #[command(
        after_help = "Example:\n  bench healthcheck --wait 30s http://127.0.0.1:7070/healthz nbd://127.0.0.1:10809"
    )]
    Healthcheck {
        /// What to check (one or more).
        #[arg(required = true, value_name = "TARGET")]
        targets: Vec<bench::healthcheck::Target>,
        /// Keep trying until every target answers or this much time has passed (e.g. 30s).
        #[arg(long, value_name = "DURATION")]
        wait: Option<String>,
        /// Time one attempt at one target may take.
        #[arg(long, value_name = "DURATION", default_value = "5s")]
        timeout: String,
        /// Print nothing when healthy.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Internal: run a CoronaFS server for the comparison.
    #[command(name = "__serve-coronafs", hide = true)]
    ServeCoronafs { dir: PathBuf, addr: SocketAddr, engine: IoEngine },
    /// Internal: run one LightningStor cluster node (the embedded cluster's
    /// nodes are child processes, so faults can kill or freeze them).
    #[command(name = "__serve-lightningstor", hide = true)]
    ServeLightningstor {
        #[arg(long)]
        config: PathBuf,
        #[arg(long)]
        node: String,
        /// Exit when standard input closes (the parent went away).
        #[arg(long)]
        exit_with_stdin: bool,
    },
    /// Internal: run one node of a CoronaFS cluster file (the failover
    /// row's nodes are child processes, so the primary can be SIGKILLed).
    #[command(name = "__serve-coronafs-node", hide = true)]
    ServeCoronafsNode {
        /// The cluster file (`coronafs serve`'s `cluster`).
        #[arg(long)]
        cluster: PathBuf,
        /// This node's name in it.
        #[arg(long)]
        node: String,
        /// The node's data dir.
        #[arg(long)]
        data_dir: PathBuf,
        /// Exit when standard input closes (the parent went away).
        #[arg(long)]
        exit_with_stdin: bool,
    },
}

#[derive(clap::Subcommand, Debug)]
enum PeersCmd {
    /// A one-host Ceph (the seeds' own system): `up` stands it up from the
    /// installed Debian packages (ceph-mon ceph-osd ceph-mgr radosgw
    /// ceph-common; nothing is installed for you), `down` stops exactly the
    /// daemons `up` started and removes their data, `status` shows health.
    ///
    /// `up` makes one monitor and one manager on 127.0.0.1, OSDs on sparse
    /// files (BlueStore), the pools `rbd` (3 copies) and `rbd1` (1 copy),
    /// a radosgw with an S3 user, and waits for HEALTH_OK. Then measure it
    /// with `fresh-bench-storage --peers ceph`, `nbd-compare --peers ceph`
    /// or `run --target rbd://rbd/IMAGE?conf=DIR/ceph.conf`.
    Ceph {
        #[command(subcommand)]
        action: CephAction,
    },
}

#[derive(clap::Subcommand, Debug)]
enum CephAction {
    /// Stand a cluster up under --dir and wait until it is healthy.
    Up {
        /// Directory of everything the cluster keeps (must be empty or absent).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Number of OSDs (1..=8; 3 gives the `rbd` pool three copies).
        #[arg(long, default_value_t = 3)]
        osds: u32,
        /// Size of each OSD's block file (sparse; K/M/G).
        #[arg(long, default_value = "4G")]
        osd_size: String,
        /// How long to wait for HEALTH_OK.
        #[arg(long, default_value = "300s")]
        timeout: String,
    },
    /// Stop the daemons `up` started in --dir and remove the directory.
    Down {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Health, daemons, the conf file and the S3 user of the cluster in --dir.
    Status {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

#[derive(clap::Args, Debug)]
struct AgentArgs {
    /// HTTP address the coordinator calls.
    #[arg(long, default_value = "0.0.0.0:7900")]
    listen: SocketAddr,
    /// Address of the TCP sink other agents measure the network baseline to.
    #[arg(long, default_value = "0.0.0.0:7901")]
    sink: SocketAddr,
    /// Directory for the local-disk baseline's files (put it on the disk you
    /// want measured, not on tmpfs or an overlay) [default: $TMPDIR/bench-agent].
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// Name reported to the coordinator [default: the host name].
    #[arg(long)]
    name: Option<String>,
    /// File holding the token (else the BENCH_AGENT_TOKEN variable).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Exit when standard input closes (for agents started by a parent process).
    #[arg(long, hide = true)]
    exit_with_stdin: bool,
}

#[derive(clap::Args, Debug)]
struct StorageArgs {
    /// The short run: every section, one iteration (no spread), small sizes
    /// and 1.5 s block jobs; no reference peers (nbdkit, qemu-nbd). See
    /// README.md for what it covers and how long it takes.
    #[arg(long)]
    quick: bool,
    /// Where the report, results.json and charts go.
    #[arg(long, default_value = "bench-out")]
    out_dir: PathBuf,
    /// Emulated link rate per direction between the bench and the services
    /// (e.g. 20MiB); transfer sizes shrink so the run stays bounded. In the
    /// embedded cluster PlasmaVMC's own interface is emulated too: client
    /// uploads into it and its S3 traffic to LightningStor share one rate per
    /// direction (its CoronaFS writes are host-local), as on the seed lab's
    /// node01. The VM image targets (CreateImage >= 85 % of the rate, cold
    /// CreateVolume <= 1.2 x artifact / rate) are evaluated only with it.
    #[arg(long)]
    link_rate: Option<String>,
    /// Emulated one-way delay added by the link (e.g. 1ms).
    #[arg(long)]
    link_delay: Option<String>,
    /// A deployed cluster instead of a fresh embedded one. TOML, every table
    /// optional (a missing service's sections say "not available"):
    /// [coronafs] nbd = "host:port", api = "http://host:port";
    /// [lightningstor] endpoints = ["http://host:port", ...], access_key,
    /// secret_key, region (default us-east-1); [plasmavmc] url =
    /// "http://host:port". The failover row needs [coronafs] cluster_file
    /// and [faults]. See docs/bench.md.
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Iterations (default 3, or 1 with --quick).
    #[arg(long)]
    iterations: Option<usize>,
    /// Skip the nbdkit / qemu-nbd comparison of a full run.
    #[arg(long)]
    no_peers: bool,
    /// More reference peers: `ceph` measures the Ceph made by `bench peers
    /// ceph up` (in --ceph-dir) beside the stack: the block jobs on RBD at 3
    /// copies and at 1, the S3 sections on radosgw, interleaved with ours in
    /// every iteration, and RBD in the block peers table (librbd and NBD).
    #[arg(long, value_delimiter = ',', value_parser = ["ceph"])]
    peers: Vec<String>,
    /// Where `bench peers ceph up` put the Ceph [default: $TMPDIR/bench-ceph].
    #[arg(long)]
    ceph_dir: Option<PathBuf>,
    /// A fault applied part-way through a steady LightningStor load, and
    /// healed later: `kill:lightningstor@NODE` (SIGKILL, then a restart),
    /// `pause:lightningstor@NODE` (frozen, then thawed), or in the Docker lab
    /// `partition:NODE` (cut off the network, then reconnected). The report
    /// gains a "degraded cluster" section: throughput before, during and
    /// after, failed requests, acknowledged objects read back, and the time
    /// until the cluster is back at full redundancy. Embedded nodes are n1,
    /// n2, n3; the lab's are node02..node05.
    #[arg(long)]
    fault: Option<String>,
    /// Failovers of the "CoronaFS failover" row: a volume with 3 copies,
    /// a client writing and FLUSHing through PlasmaVMC's reconnecting
    /// attachment, its primary stopped abruptly (embedded: a child-process
    /// node SIGKILLed; Docker lab: the primary's container killed, then
    /// started again); the I/O pause and lost flushed writes (none allowed).
    /// Default 3, or 1 with --quick; 0 leaves the row out.
    #[arg(long)]
    failovers: Option<usize>,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Built-in profile name (seed-000 .. seed-004) or path to a TOML job file.
    #[arg(long)]
    profile: String,
    /// nbd://host:port/export, a path, or s3://bucket?endpoint=URL.
    #[arg(long)]
    target: String,
    /// Iterations (default: the profile's own).
    #[arg(long)]
    iterations: Option<u32>,
    /// Override every job's runtime (e.g. 2s) for a short run.
    #[arg(long)]
    runtime: Option<String>,
    /// Override every job's size (e.g. 256M).
    #[arg(long)]
    size: Option<String>,
    /// Override every job's ramp-up time (e.g. 1s).
    #[arg(long)]
    ramp_time: Option<String>,
    /// Hard cap on one job's wall time.
    #[arg(long, default_value = "300s")]
    max_job_time: String,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// S3 access key (else AWS_ACCESS_KEY_ID).
    #[arg(long)]
    access_key: Option<String>,
    /// S3 secret key (else AWS_SECRET_ACCESS_KEY).
    #[arg(long)]
    secret_key: Option<String>,
    /// Emulated link rate per direction in front of an nbd:// or s3://
    /// target (e.g. 40MiB): a token-bucket proxy on this host, so a run sees
    /// a slower network. The report and the JSON say the link.
    #[arg(long)]
    link_rate: Option<String>,
    /// Emulated one-way delay added by that proxy (e.g. 1ms).
    #[arg(long)]
    link_delay: Option<String>,
    /// Run the jobs on a `bench agent` (host:port) instead of in this
    /// process: the target is opened on the agent's host (a path is a path
    /// there), and --link-rate/--link-delay shape that agent's interface.
    /// The token comes from BENCH_AGENT_TOKEN.
    #[arg(long)]
    agent: Option<String>,
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The workload.
    #[arg(value_parser = ["s3-register", "s3-set", "nbd-blocks"])]
    workload: String,
    /// `embedded` (a LightningStor cluster of 3 nodes started here, or for
    /// nbd-blocks 3 CoronaFS nodes, as child processes on loopback, which the
    /// nemesis can fault) or s3://bucket[/prefix]?endpoint=URL (any S3
    /// endpoint; --nemesis none).
    #[arg(long, default_value = "embedded")]
    target: String,
    /// S3 access key for --target s3:// (else AWS_ACCESS_KEY_ID).
    #[arg(long)]
    access_key: Option<String>,
    /// S3 secret key for --target s3:// (else AWS_SECRET_ACCESS_KEY).
    #[arg(long)]
    secret_key: Option<String>,
    /// Faults, comma-separated: kill (SIGKILL a node, then restart it),
    /// pause (SIGSTOP, then SIGCONT), or none. One at a time, on a random
    /// node, for 1-4 s, with 1-3 s quiet between.
    #[arg(long, value_delimiter = ',', default_value = "kill,pause")]
    nemesis: Vec<String>,
    /// How long the clients run (e.g. 60s); faults heal before it ends.
    #[arg(long, default_value = "60s")]
    duration: String,
    /// Seed of the fault schedule and of the clients' choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Directory for history.jsonl, check.json and check.md (created).
    #[arg(long)]
    out: PathBuf,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Register keys (s3-register).
    #[arg(long, default_value_t = 3)]
    keys: usize,
    /// Blocks of 4 KiB the writers spread over (nbd-blocks).
    #[arg(long, default_value_t = 256)]
    blocks: usize,
    /// Longest one request may take; past it the request is indeterminate.
    #[arg(long, default_value = "2s")]
    op_timeout: String,
    /// Pause of each client between two requests (keeps the history small
    /// enough for the linearizability search).
    #[arg(long, default_value = "10ms")]
    think: String,
}

#[derive(clap::Args, Debug)]
struct AccuracyArgs {
    /// nbd://host:port/export or a file path for --profiles; without it a
    /// CoronaFS export is started in this process.
    #[arg(long)]
    target: Option<String>,
    /// Profiles run on --target (comma-separated; built-in nbd-4 is the four
    /// nbd-compare workloads; empty for none).
    #[arg(long, value_delimiter = ',', default_value = bench::accuracy::DEFAULT_PROFILES)]
    profiles: Vec<String>,
    /// Directory for --dir-profiles (one file per job and numjobs, removed
    /// afterwards; O_DIRECT where the filesystem allows); default: a new
    /// temporary directory.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Profiles run on files in --dir, fio with libaio on the same files
    /// (comma-separated; empty for none).
    #[arg(long, value_delimiter = ',', default_value = bench::accuracy::DEFAULT_DIR_PROFILES)]
    dir_profiles: Vec<String>,
    /// Seconds per run.
    #[arg(long, default_value = "5s")]
    runtime: String,
    /// Bytes each job works over.
    #[arg(long, default_value = "256M")]
    size: String,
    /// Allowed difference from fio, in percent.
    #[arg(long, default_value = "10%")]
    tolerance: String,
    /// Iterations (the median ratio is judged).
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// Only jobs whose name contains one of these (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Emulated link rate in front of an NBD target (e.g. 64MiB), so the
    /// target rather than either generator's CPU sets the pace.
    #[arg(long)]
    link_rate: Option<String>,
    /// Emulated one-way delay in front of an NBD target (e.g. 2ms).
    #[arg(long)]
    link_delay: Option<String>,
    /// Pin both generators (our job threads, fio's --cpus_allowed) to the
    /// last CPU and the in-process export to the others, so both meet the
    /// same scheduling; `off` leaves every thread to the scheduler.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pin: String,
}

fn cmd_ceph(action: CephAction) -> anyhow::Result<i32> {
    use bench::ceph;
    let dir = |d: Option<PathBuf>| d.unwrap_or_else(ceph::default_dir);
    match action {
        CephAction::Up { dir: d, osds, osd_size, timeout } => {
            let opts = ceph::UpOptions {
                dir: dir(d),
                osds,
                osd_size: coronafs::util::parse_size(&osd_size)?,
                timeout: parse_duration(&timeout)?,
            };
            // Ctrl-C: `up` stops between steps and removes what it made.
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let _ = ctrlc_flag(s);
            let c = ceph::up(&opts, &stop, &|what| eprintln!("bench: ceph: {what}"))?;
            println!("{}", c.describe());
            println!("conf: {}", c.conf.display());
            println!("S3: {} (access key {}, secret key {})", c.rgw, c.access_key, c.secret_key);
            Ok(0)
        }
        CephAction::Down { dir: d } => {
            let d = dir(d);
            ceph::down(&d)?;
            println!("stopped the Ceph in {} and removed the directory", d.display());
            Ok(0)
        }
        CephAction::Status { dir: d } => {
            println!("{}", ceph::status(&dir(d))?);
            Ok(0)
        }
    }
}

/// Sets `stop` on SIGINT or SIGTERM, from a thread of its own (for
/// commands that run without a tokio runtime).
fn ctrlc_flag(stop: Arc<AtomicBool>) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        rt.block_on(async {
            if wait_for_signal().await.is_ok() {
                eprintln!("bench: interrupted; stopping what was started");
                stop.store(true, Ordering::Relaxed);
            }
        })
    })?;
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// Sets `stop` on the first Ctrl-C.
fn stop_on_ctrl_c(stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("bench: interrupted; stopping and cleaning up");
            stop.store(true, Ordering::Relaxed);
        }
    });
}

fn link_spec(rate: Option<&str>, delay: Option<&str>) -> anyhow::Result<bench::shaper::LinkSpec> {
    let link = bench::shaper::LinkSpec {
        rate: rate.map(coronafs::util::parse_size).transpose()?,
        delay: delay.map(parse_duration).transpose()?.unwrap_or_default(),
    };
    if link.rate == Some(0) {
        anyhow::bail!("--link-rate must be more than 0");
    }
    Ok(link)
}

fn cmd_run(a: RunArgs) -> anyhow::Result<()> {
    let profile = bench::runner::load_profile(&a.profile)?;
    let target = bench::target::TargetSpec::parse(&a.target)?;
    let link = link_spec(a.link_rate.as_deref(), a.link_delay.as_deref())?;
    let ov = bench::runner::Overrides {
        runtime: a.runtime.as_deref().map(parse_duration).transpose()?,
        size: a.size.as_deref().map(coronafs::util::parse_size).transpose()?,
        ramp_time: a.ramp_time.as_deref().map(parse_duration).transpose()?,
    };
    let limits = bench::loadgen::Limits { max_job_time: parse_duration(&a.max_job_time)?, ..Default::default() };
    let keys = bench::target::S3Keys { access_key: a.access_key, secret_key: a.secret_key };
    let iterations = a.iterations.unwrap_or(profile.iterations).max(1);
    let stop = Arc::new(AtomicBool::new(false));
    if let Some(addr) = &a.agent {
        let token = std::env::var(bench::agent::TOKEN_ENV)
            .map_err(|_| anyhow::anyhow!("--agent needs the agent's token in {}", bench::agent::TOKEN_ENV))?;
        let addr = bench::cluster::host_port(addr).with_context(|| format!("--agent {addr}"))?;
        let report = runtime()?.block_on(async {
            stop_on_ctrl_c(stop.clone());
            let agent = bench::agent::client::AgentClient::new("agent", addr, &token);
            bench::runner::run_profile_on_agent(
                &agent,
                &profile,
                &a.target,
                &keys,
                iterations,
                &ov,
                limits,
                link,
                stop.clone(),
            )
            .await
        })?;
        println!("{}", bench::runner::markdown(&report));
        if let Some(path) = a.json {
            std::fs::write(&path, serde_json::to_vec_pretty(&report)?).with_context(|| path.display().to_string())?;
        }
        return Ok(());
    }
    let report = runtime()?.block_on(async {
        stop_on_ctrl_c(stop.clone());
        let (shaped, shaper) = bench::runner::through_link(&target, link).await?;
        let r = bench::runner::run_profile(&profile, &shaped, &keys, iterations, &ov, limits, stop.clone()).await;
        if let Some(sh) = shaper {
            sh.shutdown().await;
        }
        let mut r = r?;
        r.target = target.to_string();
        r.link = link.describe();
        anyhow::Ok(r)
    })?;
    println!("{}", bench::runner::markdown(&report));
    if let Some(path) = a.json {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?).with_context(|| path.display().to_string())?;
    }
    Ok(())
}

/// `bench check`: 0 holds, 1 violation, 2 could not run or decide.
fn cmd_check(a: CheckArgs) -> i32 {
    match check_options(&a) {
        Ok(opts) => match runtime().and_then(|rt| rt.block_on(bench::checkrun::run(&opts))) {
            Ok(report) => {
                print!("{}", bench::checkrun::report::markdown(&report));
                println!("written: {}", opts.out.display());
                report.exit_code()
            }
            Err(e) => {
                eprintln!("bench check: the run could not be made: {e:#}");
                2
            }
        },
        Err(e) => {
            eprintln!("bench check: {e:#}");
            2
        }
    }
}

fn check_options(a: &CheckArgs) -> anyhow::Result<bench::checkrun::Options> {
    use bench::checkrun::{Options, Target};
    use bench::fault::FaultKind;
    let target = if a.target == "embedded" {
        Target::Embedded
    } else {
        match bench::target::TargetSpec::parse(&a.target)? {
            bench::target::TargetSpec::S3 { bucket, prefix, endpoint, region } => {
                let keys = bench::target::S3Keys { access_key: a.access_key.clone(), secret_key: a.secret_key.clone() }
                    .resolve()?;
                let prefix = if prefix.is_empty() || prefix.ends_with('/') { prefix } else { format!("{prefix}/") };
                Target::S3 { uri: a.target.clone(), bucket, prefix, endpoint, region, keys }
            }
            _ => anyhow::bail!("--target {}: bench check takes embedded or s3://bucket?endpoint=URL", a.target),
        }
    };
    let mut nemesis = Vec::new();
    for n in a.nemesis.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        match n {
            "none" => {}
            "kill" => nemesis.push(FaultKind::Kill),
            "pause" => nemesis.push(FaultKind::Pause),
            other => anyhow::bail!("--nemesis {other}: unknown (kill, pause or none)"),
        }
    }
    nemesis.dedup();
    let nemesis_text = if nemesis.is_empty() {
        "none".to_owned()
    } else {
        nemesis.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(",")
    };
    let target_arg = if a.target == "embedded" { String::new() } else { format!(" --target '{}'", a.target) };
    let replay = format!(
        "bench check {}{target_arg} --nemesis {nemesis_text} --duration {} --seed {} --clients {} --keys {} \
         --blocks {} --op-timeout {} --think {} --out {}",
        a.workload,
        a.duration,
        a.seed,
        a.clients,
        a.keys,
        a.blocks,
        a.op_timeout,
        a.think,
        a.out.display()
    );
    Ok(Options {
        workload: a.workload.parse()?,
        target,
        nemesis,
        duration: parse_duration(&a.duration).context("--duration")?,
        seed: a.seed,
        out: a.out.clone(),
        clients: a.clients,
        keys: a.keys,
        blocks: a.blocks,
        op_timeout: parse_duration(&a.op_timeout).context("--op-timeout")?,
        think: parse_duration(&a.think).context("--think")?,
        replay,
    })
}

/// `bench compare`: 0 no regression, 1 regression; errors are the
/// caller's exit 2.
fn cmd_compare(old: PathBuf, new: PathBuf, bound: &str) -> anyhow::Result<i32> {
    let bound = bench::compare::parse_pct(bound).context("--max-regression")?;
    let read = |p: &PathBuf| -> anyhow::Result<serde_json::Value> {
        let text = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", p.display()))
    };
    let (a, b) = (read(&old)?, read(&new)?);
    let c = bench::compare::compare(&a, &b, bound);
    if c.rows.is_empty() {
        anyhow::bail!("no figure appears in both files (are they bench results?)");
    }
    print!("{}", bench::compare::table(&c));
    if c.not_judged() > 0 {
        eprintln!(
            "bench compare: warning: {} of {} not judged (fewer than {} iterations); use --iterations {} for a gate",
            c.not_judged(),
            bench::text::count(c.rows.len(), "figure"),
            bench::compare::MIN_ITERATIONS,
            bench::compare::RECOMMENDED_ITERATIONS
        );
    }
    if c.judged() == 0 {
        // A gate that judged nothing must not pass as "no regression".
        anyhow::bail!(
            "nothing to judge: every figure in common has fewer than {} iterations on one side",
            bench::compare::MIN_ITERATIONS
        );
    }
    Ok(if c.regressions() > 0 { 1 } else { 0 })
}

fn cmd_storage(a: StorageArgs) -> anyhow::Result<i32> {
    let link = link_spec(a.link_rate.as_deref(), a.link_delay.as_deref())?;
    let mut opts = bench::storage::Options::new(a.quick);
    opts.fit_link(link.rate);
    if let Some(i) = a.iterations {
        opts.iterations = i.max(1);
    }
    if a.no_peers {
        opts.peers = false;
    }
    if a.peers.iter().any(|p| p == "ceph") {
        let dir = a.ceph_dir.clone().unwrap_or_else(bench::ceph::default_dir);
        opts.ceph = Some(bench::ceph::load(&dir).context("--peers ceph: run `bench peers ceph up` first")?);
    }
    if let Some(n) = a.failovers {
        opts.failover_trials = n;
    }
    opts.fault = a.fault.as_deref().map(str::parse::<bench::fault::Fault>).transpose()?;
    let endpoints = a.cluster.as_deref().map(bench::cluster::Endpoints::from_file).transpose()?;
    std::fs::create_dir_all(&a.out_dir).with_context(|| a.out_dir.display().to_string())?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let stop = Arc::new(AtomicBool::new(false));
    let rt = runtime()?;
    let result = rt.block_on(async {
        let cluster = match (&endpoints, &a.cluster) {
            (Some(e), Some(p)) => bench::cluster::Cluster::external(e.clone(), &p.display().to_string(), link).await?,
            _ => bench::cluster::Cluster::embedded(link).await?,
        };
        let scratch = tempfile::Builder::new().prefix("bench-scratch-").tempdir()?;
        let progress = bench::progress::Progress::new(bench::storage::steps(&opts));
        let run = bench::storage::run(&cluster, &opts, scratch.path(), command, &progress, stop.clone());
        let interrupted = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        let r = tokio::select! {
            r = run => r,
            () = interrupted => {
                stop.store(true, Ordering::Relaxed);
                Err(anyhow::anyhow!("interrupted"))
            }
        };
        progress.finish();
        // Whatever happened, the temporary cluster and its data go.
        cluster.shutdown().await;
        drop(scratch);
        r
    });
    let report = match result {
        Ok(r) => r,
        Err(e) if stop.load(Ordering::Relaxed) => {
            eprintln!("bench: {e:#}; the temporary cluster was removed");
            return Ok(130);
        }
        Err(e) => return Err(e),
    };
    let charts = bench::charts::for_report(&report, &a.out_dir);
    let md = bench::storage::markdown::render(&report, &charts);
    std::fs::write(a.out_dir.join("storage-benchmarks.md"), &md)?;
    std::fs::write(a.out_dir.join("results.json"), serde_json::to_vec_pretty(&report)?)?;
    println!("{md}");
    eprintln!("bench: wrote {}/storage-benchmarks.md, results.json and charts", a.out_dir.display());
    Ok(0)
}

/// Exits the process when standard input reaches EOF (the parent is gone).
fn exit_with_stdin() {
    std::thread::spawn(|| {
        let mut buf = [0u8; 64];
        loop {
            match std::io::Read::read(&mut std::io::stdin(), &mut buf) {
                Ok(0) | Err(_) => std::process::exit(0),
                Ok(_) => {}
            }
        }
    });
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

fn cmd_agent(a: AgentArgs) -> anyhow::Result<()> {
    use bench::agent::server::{AgentConfig, start};
    let token = match &a.token_file {
        Some(f) => {
            std::fs::read_to_string(f).with_context(|| format!("--token-file {}", f.display()))?.trim().to_owned()
        }
        None => std::env::var(bench::agent::TOKEN_ENV).map_err(|_| {
            anyhow::anyhow!(
                "the agent needs a token: set {} or pass --token-file (the coordinator sends the same token)",
                bench::agent::TOKEN_ENV
            )
        })?,
    };
    if a.exit_with_stdin {
        exit_with_stdin();
    }
    let name = a.name.unwrap_or_else(|| hostinfo::host().hostname);
    let scratch = a.scratch.unwrap_or_else(|| std::env::temp_dir().join("bench-agent"));
    runtime()?.block_on(async {
        let cfg = AgentConfig { name: name.clone(), listen: a.listen, sink: a.sink, scratch, token };
        let running = start(cfg).await?;
        println!("listening on {} (agent {name}, sink {})", running.addr, running.sink);
        use std::io::Write;
        let _ = std::io::stdout().flush();
        wait_for_signal().await?;
        running.shutdown().await;
        anyhow::Ok(())
    })
}

fn cmd_serve_lightningstor(config: PathBuf, node: String, exit_with: bool) -> anyhow::Result<()> {
    if exit_with {
        exit_with_stdin();
    }
    let c = lightningstor::cluster::ClusterConfig::from_file(&config).context("cluster file")?;
    runtime()?.block_on(async {
        let running = lightningstor::cluster::start(c, &node).await.with_context(|| format!("starting node {node}"))?;
        println!("listening on {}", running.s3.addr);
        use std::io::Write;
        let _ = std::io::stdout().flush();
        wait_for_signal().await?;
        running.shutdown().await;
        anyhow::Ok(())
    })
}

fn cmd_serve_coronafs_node(cluster: PathBuf, node: String, data_dir: PathBuf, exit_with: bool) -> anyhow::Result<()> {
    if exit_with {
        exit_with_stdin();
    }
    let file = coronafs::cluster::ClusterFile::load(&cluster).context("cluster file")?;
    let me = file.node(&node).with_context(|| format!("node {node}"))?.clone();
    let mut cfg = coronafs::config::ServerConfig::ephemeral(data_dir, IoEngine::Uring);
    (cfg.nbd, cfg.api, cfg.cluster) = (me.nbd, me.api, Some((file, node.clone())));
    runtime()?.block_on(async {
        let running = coronafs::service::start(cfg).await.with_context(|| format!("starting CoronaFS node {node}"))?;
        println!("listening on {}", running.nbd_addr);
        use std::io::Write;
        let _ = std::io::stdout().flush();
        wait_for_signal().await?;
        running.shutdown().await;
        anyhow::Ok(())
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let code = match Cli::parse().cmd {
        Cmd::Run(a) => cmd_run(a).map(|()| 0)?,
        Cmd::Compare { old, new, max_regression } => cmd_compare(old, new, &max_regression).unwrap_or_else(|e| {
            eprintln!("bench compare: error: {e:#}");
            2
        }),
        Cmd::FreshBenchStorage(a) => cmd_storage(a)?,
        Cmd::Accuracy(a) => {
            let names = |v: Vec<String>| v.into_iter().filter(|p| !p.trim().is_empty()).collect::<Vec<_>>();
            let opts = bench::accuracy::Options {
                target: a.target,
                profiles: names(a.profiles),
                dir: a.dir,
                dir_profiles: names(a.dir_profiles),
                runtime: parse_duration(&a.runtime)?,
                size: coronafs::util::parse_size(&a.size)?,
                tolerance_pct: bench::compare::parse_pct(&a.tolerance)?,
                iterations: a.iterations.max(1),
                only: a.only,
                link: link_spec(a.link_rate.as_deref(), a.link_delay.as_deref())?,
                pin: a.pin == "on",
            };
            let report = runtime()?.block_on(bench::accuracy::run(&opts))?;
            print!("{}", bench::accuracy::table(&report, opts.tolerance_pct));
            if report.failures(opts.tolerance_pct) > 0 { 1 } else { 0 }
        }
        Cmd::Agent(a) => cmd_agent(a).map(|()| 0)?,
        Cmd::Check(a) => cmd_check(a),
        Cmd::Healthcheck { targets, wait, timeout, quiet } => {
            let wait = wait.as_deref().map(parse_duration).transpose()?;
            let timeout = parse_duration(&timeout)?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            match rt.block_on(bench::healthcheck::run(&targets, wait, timeout)) {
                Ok(lines) => {
                    if !quiet {
                        lines.iter().for_each(|l| println!("{l}"));
                    }
                    0
                }
                Err(e) => {
                    eprintln!("bench healthcheck: {e:#}");
                    1
                }
            }
        }
        Cmd::Peers(PeersCmd::Ceph { action }) => cmd_ceph(action)?,
        Cmd::ServeLightningstor { config, node, exit_with_stdin } => {
            cmd_serve_lightningstor(config, node, exit_with_stdin).map(|()| 0)?
        }
        Cmd::ServeCoronafsNode { cluster, node, data_dir, exit_with_stdin } => {
            cmd_serve_coronafs_node(cluster, node, data_dir, exit_with_stdin).map(|()| 0)?
        }
        Cmd::ServeCoronafs { dir, addr, engine } => peers::serve_coronafs(&dir, addr, engine).map(|()| 0)?,
        Cmd::NbdCompare { size, iterations, runtime, engines, json, peers: names, ceph_dir } => {
            let size = coronafs::util::parse_size(&size)?;
            let mut peers: Vec<peers::Peer> = engines.iter().map(|&e| peers::Peer::Coronafs(e)).collect();
            let mut ceph = None;
            for n in &names {
                match n.as_str() {
                    "nbdkit" => peers.push(peers::Peer::Nbdkit),
                    "qemu-nbd" => peers.push(peers::Peer::QemuNbd),
                    _ => {
                        let dir = ceph_dir.clone().unwrap_or_else(bench::ceph::default_dir);
                        ceph = Some(bench::ceph::load(&dir).context("--peers ceph: run `bench peers ceph up` first")?);
                        peers.extend(peers::ceph_peers());
                    }
                }
            }
            let opts = Options { size, iterations: iterations.max(1), runtime_s: runtime.max(1), peers, ceph };
            let work = tempfile::tempdir()?;
            let report = nbd_compare::run(&opts, work.path())?;
            println!("{}", nbd_compare::markdown(&report));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| path.display().to_string())?;
            }
            0
        }
    };
    std::process::exit(code);
}
