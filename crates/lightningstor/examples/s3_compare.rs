//! Runs the same S3 workloads against `lightningstor` and `s3s-fs` in one run
//! and prints medians, spreads and ratios.
//!
//! ```text
//! cargo build --release -p lightningstor --bin lightningstor --example s3_compare
//! cargo install s3s-fs --version 0.14.1 --features binary --locked
//! target/release/examples/s3_compare --iterations 5
//! ```
//!
//! With `--vs-cluster` the peer is a single lightningstor node and the
//! subject a 3-node RF=3 cluster of spawned processes (W=2, R=2), so the
//! ratios are the cost of replication on loopback.
//!
//! Workloads (each server alone on the machine, 127.0.0.1 only):
//! - one 256 MiB PUT and one 256 MiB GET (MiB/s);
//! - 4 KiB PUT and GET from 16 concurrent clients (ops/s, p50/p99 latency);
//! - peak server RSS while 32 clients each upload 256 MiB at once.
//!
//! Both servers get identical requests from aws-sdk-s3 with its default
//! checksum behaviour. lightningstor fsyncs before acknowledging; s3s-fs
//! does not.

use anyhow::{Context, bail};
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use clap::Parser;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const AK: &str = "bench-access-key";
const SK: &str = "bench-secret-key";
const MIB: usize = 1024 * 1024;

#[derive(Parser, Debug)]
struct Args {
    /// Timed iterations per workload (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// Size of the large object, MiB.
    #[arg(long, default_value_t = 256)]
    large_mib: usize,
    /// Small-object operations per iteration (spread over the clients).
    #[arg(long, default_value_t = 4000)]
    small_ops: usize,
    /// Concurrent clients for small objects.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// Concurrent uploads in the memory test (0 skips it).
    #[arg(long, default_value_t = 32)]
    rss_uploads: usize,
    /// lightningstor binary [default: next to this example, ../lightningstor].
    #[arg(long)]
    lightningstor: Option<PathBuf>,
    /// s3s-fs binary [default: ~/.cargo/bin/s3s-fs].
    #[arg(long)]
    s3s_fs: Option<PathBuf>,
    /// Scratch directory for data [default: a temp dir].
    #[arg(long)]
    scratch: Option<PathBuf>,
    /// Extra arguments for `lightningstor serve` (e.g. `--config tuning.toml`).
    #[arg(long, allow_hyphen_values = true)]
    ls_arg: Vec<String>,
    /// Run only lightningstor (for profiling it alone).
    #[arg(long)]
    only_lightningstor: bool,
    /// Compare a 3-node RF=3 lightningstor cluster (spawned processes on
    /// 127.0.0.1, client talking to node 1) against a single node, instead
    /// of lightningstor against s3s-fs.
    #[arg(long, conflicts_with = "only_lightningstor")]
    vs_cluster: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Server {
    name: &'static str,
    child: Child,
    /// The other nodes of a cluster (CPU is summed over all of them).
    others: Vec<Child>,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        for c in std::iter::once(&mut self.child).chain(self.others.iter_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Server {
    fn rss(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    fn client(&self) -> Client {
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .credentials_provider(aws_credential_types::Credentials::new(AK, SK, None, None, "bench"))
            .endpoint_url(&self.endpoint)
            .force_path_style(true)
            .build();
        Client::from_conf(conf)
    }
}

fn start_lightningstor(bin: &PathBuf, scratch: &std::path::Path, extra: &[String]) -> anyhow::Result<Server> {
    let dir = tempfile::tempdir_in(scratch)?;
    let mut child = Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .args(extra)
        .env("LIGHTNINGSTOR_ACCESS_KEY", AK)
        .env("LIGHTNINGSTOR_SECRET_KEY", SK)
        .env("RUST_LOG", "warn,s3s=off")
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line.trim().strip_prefix("listening on ").context("no listen line")?.to_owned();
    Ok(Server { name: "lightningstor", child, others: Vec::new(), endpoint: format!("http://{addr}"), _dir: dir })
}

/// Three `lightningstor serve --config FILE --node nI` processes (RF=3,
/// W=2, R=2) from `lightningstor cluster init`.
fn start_cluster(bin: &PathBuf, scratch: &std::path::Path) -> anyhow::Result<Server> {
    let dir = tempfile::tempdir_in(scratch)?;
    let base = (20_000..60_000u16)
        .step_by(157)
        .find(|p| {
            (0..3).all(|i| {
                std::net::TcpListener::bind(("127.0.0.1", p + i)).is_ok()
                    && std::net::TcpListener::bind(("127.0.0.1", p + 100 + i)).is_ok()
            })
        })
        .context("no free ports")?;
    let out = Command::new(bin)
        .args(["cluster", "init", "--nodes", "3", "--base-port", &base.to_string(), "--base-dir"])
        .arg(dir.path())
        .output()?;
    anyhow::ensure!(out.status.success(), "cluster init failed");
    let cfg = dir.path().join("cluster.toml");
    std::fs::write(&cfg, &out.stdout)?;
    let mut children = Vec::new();
    let mut endpoint = String::new();
    for n in ["n1", "n2", "n3"] {
        let mut child = Command::new(bin)
            .args(["serve", "--config"])
            .arg(&cfg)
            .args(["--node", n])
            .env("LIGHTNINGSTOR_ACCESS_KEY", AK)
            .env("LIGHTNINGSTOR_SECRET_KEY", SK)
            .env("RUST_LOG", "warn,s3s=off")
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line.trim().strip_prefix("listening on ").context("no listen line")?.to_owned();
        if endpoint.is_empty() {
            endpoint = format!("http://{addr}");
        }
        children.push(child);
    }
    let child = children.remove(0);
    Ok(Server { name: "cluster RF=3", child, others: children, endpoint, _dir: dir })
}

fn start_s3s_fs(bin: &PathBuf, scratch: &std::path::Path) -> anyhow::Result<Server> {
    let dir = tempfile::tempdir_in(scratch)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let child = Command::new(bin)
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", AK, "--secret-key", SK])
        .arg(dir.path())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("s3s-fs did not listen");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Server { name: "s3s-fs", child, others: Vec::new(), endpoint: format!("http://127.0.0.1:{port}"), _dir: dir })
}

fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

#[derive(Debug, Default, Clone, serde::Serialize)]
struct Samples {
    /// One value per iteration.
    values: Vec<f64>,
}

impl Samples {
    fn median(&self) -> f64 {
        let mut v = self.values.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() { 0.0 } else { v[v.len() / 2] }
    }
    fn min(&self) -> f64 {
        self.values.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn max(&self) -> f64 {
        self.values.iter().copied().fold(0.0, f64::max)
    }
}

#[derive(Debug, Default, serde::Serialize)]
struct Results {
    put_large_mibs: Samples,
    get_large_mibs: Samples,
    put_large_server_cpu: Samples,
    get_large_server_cpu: Samples,
    put_small_ops: Samples,
    put_small_p50_ms: Samples,
    put_small_p99_ms: Samples,
    get_small_ops: Samples,
    get_small_p50_ms: Samples,
    get_small_p99_ms: Samples,
    rss_peak_mib: f64,
    rss_uploads_mibs: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// CPU seconds (user + system) a process has used, from /proc.
fn cpu_secs(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = s.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name.
    (ticks(11) + ticks(12)) / 100.0
}

async fn large(c: &Client, pids: &[u32], size: usize, seed: u64, r: &mut Results, record: bool) -> anyhow::Result<()> {
    // Server CPU summed over every process of the server (all nodes of a cluster).
    let server_cpu = || pids.iter().map(|p| cpu_secs(*p)).sum::<f64>();
    let data = Bytes::from(pseudo_random(size, seed));
    let key = format!("large-{seed}");
    let (t, cpu) = (Instant::now(), server_cpu());
    c.put_object().bucket("bench").key(&key).body(ByteStream::from(data)).send().await?;
    let secs = t.elapsed().as_secs_f64();
    let put = size as f64 / MIB as f64 / secs;
    if record {
        r.put_large_server_cpu.values.push(server_cpu() - cpu);
    }
    let (t, cpu) = (Instant::now(), server_cpu());
    let mut body = c.get_object().bucket("bench").key(&key).send().await?.body;
    let mut n = 0;
    while let Some(chunk) = body.try_next().await? {
        n += chunk.len();
    }
    let get = size as f64 / MIB as f64 / t.elapsed().as_secs_f64();
    if record {
        r.get_large_server_cpu.values.push(server_cpu() - cpu);
    }
    if n != size {
        bail!("GET returned {n} bytes, not {size}");
    }
    c.delete_object().bucket("bench").key(&key).send().await?;
    if record {
        r.put_large_mibs.values.push(put);
        r.get_large_mibs.values.push(get);
    }
    Ok(())
}

async fn small(c: &Client, ops: usize, clients: usize, iter: u64, r: &mut Results, record: bool) -> anyhow::Result<()> {
    let per = ops / clients;
    for phase in ["put", "get"] {
        let t = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..clients {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let mut lat = Vec::with_capacity(per);
                let mut data = pseudo_random(4096, iter * 1000 + w as u64);
                for i in 0..per {
                    let key = format!("small/{iter}/{w}/{i}");
                    let t = Instant::now();
                    if phase == "put" {
                        data[..8].copy_from_slice(&(i as u64).to_le_bytes());
                        c.put_object().bucket("bench").key(&key).body(ByteStream::from(data.clone())).send().await?;
                    } else {
                        let out = c.get_object().bucket("bench").key(&key).send().await?;
                        let b = out.body.collect().await?.into_bytes();
                        anyhow::ensure!(b.len() == 4096, "short small GET");
                    }
                    lat.push(t.elapsed().as_secs_f64() * 1000.0);
                }
                anyhow::Ok(lat)
            }));
        }
        let mut lat = Vec::new();
        for t in tasks {
            lat.extend(t.await??);
        }
        let ops_s = lat.len() as f64 / t.elapsed().as_secs_f64();
        lat.sort_by(f64::total_cmp);
        if record {
            let (o, p50, p99) = if phase == "put" {
                (&mut r.put_small_ops, &mut r.put_small_p50_ms, &mut r.put_small_p99_ms)
            } else {
                (&mut r.get_small_ops, &mut r.get_small_p50_ms, &mut r.get_small_p99_ms)
            };
            o.values.push(ops_s);
            p50.values.push(percentile(&lat, 0.5));
            p99.values.push(percentile(&lat, 0.99));
        }
    }
    Ok(())
}

/// A 256 MiB body generated on the fly, so 32 uploads need no client memory.
fn generated_body(size: usize, seed: u64) -> ByteStream {
    let chunk = Bytes::from(pseudo_random(MIB, seed));
    let chunks = size / MIB;
    let stream = futures::stream::iter((0..chunks).map(move |i| {
        let mut c = chunk.to_vec();
        c[..8].copy_from_slice(&(i as u64).to_le_bytes());
        Ok::<_, std::io::Error>(hyper::body::Frame::data(Bytes::from(c)))
    }));
    ByteStream::from_body_1_x(http_body_util::StreamBody::new(stream))
}

async fn rss(server: &Server, c: &Client, uploads: usize, size: usize, r: &mut Results) -> anyhow::Result<()> {
    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let pid = server.child.id();
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                let rss = s
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                    .map_or(0, |kb| kb * 1024);
                peak.fetch_max(rss, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let t = Instant::now();
    let mut tasks = Vec::new();
    for u in 0..uploads {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.put_object()
                .bucket("bench")
                .key(format!("rss/{u}"))
                .content_length(size as i64)
                .body(generated_body(size, 7000 + u as u64))
                .send()
                .await
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = t.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    r.rss_peak_mib = peak.load(Ordering::Relaxed) as f64 / MIB as f64;
    r.rss_uploads_mibs = (uploads * size) as f64 / MIB as f64 / secs;
    Ok(())
}

/// Runs every iteration on both servers in turn (lightningstor, then s3s-fs),
/// so drift in the machine's load hits both alike.
async fn run_both(servers: &[Server], a: &Args) -> anyhow::Result<Vec<Results>> {
    let clients: Vec<Client> = servers.iter().map(Server::client).collect();
    let mut results: Vec<Results> = servers.iter().map(|_| Results::default()).collect();
    for (s, c) in servers.iter().zip(&clients) {
        c.create_bucket().bucket("bench").send().await?;
        eprintln!("[{}] idle RSS {} MiB", s.name, s.rss() / MIB as u64);
    }
    for i in 0..=a.iterations {
        let record = i > 0;
        for ((s, c), r) in servers.iter().zip(&clients).zip(results.iter_mut()) {
            let pids: Vec<u32> = std::iter::once(s.child.id()).chain(s.others.iter().map(Child::id)).collect();
            large(c, &pids, a.large_mib * MIB, i as u64 + 1, r, record).await?;
            small(c, a.small_ops, a.clients, i as u64, r, record).await?;
        }
        eprintln!("iteration {i}{} done", if record { "" } else { " (warm-up)" });
    }
    if a.rss_uploads > 0 {
        for ((s, c), r) in servers.iter().zip(&clients).zip(results.iter_mut()) {
            rss(s, c, a.rss_uploads, a.large_mib * MIB, r).await?;
            eprintln!("[{}] memory test done", s.name);
        }
    }
    Ok(results)
}

fn line(name: &str, unit: &str, ls: &Samples, fs: &Samples, higher_is_better: bool) {
    let ratio = if higher_is_better { ls.median() / fs.median() } else { fs.median() / ls.median() };
    println!(
        "{name:<22} {:>10.1} [{:>8.1}..{:>8.1}] {:>10.1} [{:>8.1}..{:>8.1}] {unit:<6} {ratio:>6.2}x",
        ls.median(),
        ls.min(),
        ls.max(),
        fs.median(),
        fs.min(),
        fs.max(),
    );
}

/// The read path's counters of the node at `endpoint` (its plain `GET
/// /metrics`): rows fetched in full, versions asked, the messages that
/// carried them, hedged reads.
fn replication_counters(endpoint: &str) -> String {
    use std::io::{Read, Write};
    let Some(addr) = endpoint.strip_prefix("http://") else { return String::new() };
    let mut text = String::new();
    let fetched = std::net::TcpStream::connect(addr).and_then(|mut s| {
        s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
        s.read_to_string(&mut text)
    });
    if let Err(e) = fetched {
        return format!("(no /metrics: {e})");
    }
    const SHOWN: [&str; 4] = ["read_rows_fetched", "read_versions_asked", "version_batches", "hedged_reads"];
    text.lines()
        .filter(|l| !l.starts_with('#') && SHOWN.iter().any(|n| l.starts_with(&format!("lightningstor_{n}_total"))))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let exe = std::env::current_exe()?;
    let ls_bin = a
        .lightningstor
        .clone()
        .unwrap_or_else(|| exe.parent().and_then(|p| p.parent()).map(|p| p.join("lightningstor")).unwrap_or_default());
    let fs_bin = a
        .s3s_fs
        .clone()
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cargo/bin/s3s-fs"));
    let scratch_tmp = tempfile::tempdir()?;
    let scratch = a.scratch.clone().unwrap_or_else(|| scratch_tmp.path().to_owned());

    let mut servers = Vec::new();
    if a.vs_cluster {
        servers.push(start_cluster(&ls_bin, &scratch)?);
    }
    servers.push(start_lightningstor(&ls_bin, &scratch, &a.ls_arg)?);
    if !a.only_lightningstor && !a.vs_cluster {
        servers.push(start_s3s_fs(&fs_bin, &scratch)?);
    }
    let names: Vec<&str> = servers.iter().map(|s| s.name).collect();
    let (first, second) = (names[0].to_owned(), names.get(1).copied().unwrap_or("-").to_owned());
    let mut results = run_both(&servers, &a).await?;
    let counters = if a.vs_cluster { replication_counters(&servers[0].endpoint) } else { String::new() };
    drop(servers);
    let fs = if a.only_lightningstor { Results::default() } else { results.pop().context("second results")? };
    let ls = results.pop().context("first results")?;

    println!(
        "\n{} iterations (median [min..max]); ratio = {first} vs {second}, >1 means {first} is better\n",
        a.iterations
    );
    println!("{:<22} {:>31} {:>31}", "workload", first, second);
    line(&format!("PUT {} MiB", a.large_mib), "MiB/s", &ls.put_large_mibs, &fs.put_large_mibs, true);
    line("  server CPU", "s", &ls.put_large_server_cpu, &fs.put_large_server_cpu, false);
    line(&format!("GET {} MiB", a.large_mib), "MiB/s", &ls.get_large_mibs, &fs.get_large_mibs, true);
    line("  server CPU", "s", &ls.get_large_server_cpu, &fs.get_large_server_cpu, false);
    line(&format!("PUT 4 KiB x{}", a.clients), "ops/s", &ls.put_small_ops, &fs.put_small_ops, true);
    line("  p50", "ms", &ls.put_small_p50_ms, &fs.put_small_p50_ms, false);
    line("  p99", "ms", &ls.put_small_p99_ms, &fs.put_small_p99_ms, false);
    line(&format!("GET 4 KiB x{}", a.clients), "ops/s", &ls.get_small_ops, &fs.get_small_ops, true);
    line("  p50", "ms", &ls.get_small_p50_ms, &fs.get_small_p50_ms, false);
    line("  p99", "ms", &ls.get_small_p99_ms, &fs.get_small_p99_ms, false);
    if a.rss_uploads > 0 {
        println!(
            "\n{} concurrent {} MiB uploads: peak RSS {first} {:.0} MiB (node 1), {second} {:.0} MiB; throughput {:.0} vs {:.0} MiB/s",
            a.rss_uploads, a.large_mib, ls.rss_peak_mib, fs.rss_peak_mib, ls.rss_uploads_mibs, fs.rss_uploads_mibs
        );
    }
    if !counters.is_empty() {
        println!("\nnode 1 (the coordinator of every request), over the whole run:\n{counters}");
    }
    if let Some(path) = &a.json {
        let j = if a.vs_cluster {
            serde_json::json!({ "cluster_rf3": ls, "single_node": fs, "iterations": a.iterations })
        } else {
            serde_json::json!({ "lightningstor": ls, "s3s_fs": fs, "iterations": a.iterations })
        };
        std::fs::write(path, serde_json::to_string_pretty(&j)?)?;
    }
    Ok(())
}
