//! What the agent's handlers run. Each function is bounded in time
//! ([`super::MAX_WORK`] at most) and takes the link it must go through.

use super::{
    Event, Iperf3Reply, JobReply, JobRequest, ObjectsReply, ObjectsRequest, PatternReply, PatternRequest, ProbeReply,
    S3Spec, SteadyReply, SteadyRequest, Tick,
};
use crate::hist::Histogram;
use crate::loadgen::{Limits, Opened, fill};
use crate::shaper::{LinkSpec, Nic, Shaper};
use anyhow::{Context, bail};
use coronafs::client::NbdClient;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The agent's emulated interface: one per link setting, shared by every
/// request that asks for the same link.
#[derive(Debug, Default)]
pub struct Links {
    current: Mutex<Option<(LinkSpec, Nic)>>,
}

/// Proxies one request opened through the agent's interface; closed when
/// dropped via [`Route::close`].
#[derive(Debug, Default)]
pub struct Route {
    shapers: Vec<Shaper>,
}

impl Route {
    pub async fn close(self) {
        for s in self.shapers {
            s.shutdown().await;
        }
    }
}

impl Links {
    fn nic(&self, spec: LinkSpec) -> Option<Nic> {
        if spec.is_unshaped() {
            return None;
        }
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match &*cur {
            Some((s, n)) if *s == spec => Some(n.clone()),
            _ => {
                let n = Nic::new(spec);
                *cur = Some((spec, n.clone()));
                Some(n)
            }
        }
    }

    /// The address to use for `remote` (a proxy through the interface when
    /// the link is emulated).
    pub async fn via(&self, spec: LinkSpec, remote: SocketAddr, route: &mut Route) -> anyhow::Result<SocketAddr> {
        match self.nic(spec) {
            None => Ok(remote),
            Some(n) => {
                let sh = n.outbound(remote).await?;
                let a = sh.addr;
                route.shapers.push(sh);
                Ok(a)
            }
        }
    }

    /// `http://host:port` endpoints rewritten through the interface.
    pub async fn via_urls(&self, spec: LinkSpec, urls: &[String], route: &mut Route) -> anyhow::Result<Vec<String>> {
        let mut out = Vec::new();
        for u in urls {
            if spec.is_unshaped() {
                out.push(u.clone());
            } else {
                let a = self.via(spec, crate::cluster::url_addr(u)?, route).await?;
                out.push(format!("http://{a}"));
            }
        }
        Ok(out)
    }
}

/// A scratch file name: letters, digits, `.`, `-`, `_` only (no paths).
fn scratch_path(scratch: &Path, file: &str) -> anyhow::Result<PathBuf> {
    if file.is_empty()
        || file.len() > 64
        || file.starts_with('.')
        || !file.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        bail!("scratch file name {file:?} must be 1-64 of [A-Za-z0-9._-], not starting with a dot");
    }
    Ok(scratch.join(file))
}

/// Runs one block job.
pub async fn job(links: &Links, scratch: &Path, r: JobRequest, stop: Arc<AtomicBool>) -> anyhow::Result<JobReply> {
    let limits = Limits { max_job_time: r.max_job_time.min(super::MAX_WORK), ..Limits::default() };
    let mut route = Route::default();
    let result = async {
        match &r.target {
            super::BlockTarget::Nbd { addr, export } => {
                let remote = crate::cluster::host_port(addr)?;
                let a = links.via(r.link, remote, &mut route).await?;
                let t = Opened::Nbd { addr: a.to_string(), export: export.clone() };
                Ok(JobReply { run: t.run(&r.job, limits, stop).await?, direct_used: None })
            }
            super::BlockTarget::Uri { uri, access_key, secret_key } => {
                let spec = match crate::target::TargetSpec::parse(uri)? {
                    crate::target::TargetSpec::Nbd { addr, export } => {
                        let a = links.via(r.link, crate::cluster::host_port(&addr)?, &mut route).await?;
                        crate::target::TargetSpec::Nbd { addr: a.to_string(), export }
                    }
                    crate::target::TargetSpec::S3 { bucket, prefix, endpoint, region } => {
                        let endpoint = links.via_urls(r.link, &[endpoint], &mut route).await?.remove(0);
                        crate::target::TargetSpec::S3 { bucket, prefix, endpoint, region }
                    }
                    p @ (crate::target::TargetSpec::Path(_) | crate::target::TargetSpec::Rbd { .. }) => p,
                };
                let keys = crate::target::S3Keys { access_key: access_key.clone(), secret_key: secret_key.clone() };
                let t = Opened::open(&spec, &keys).await?;
                let run = t.run(&r.job, limits, stop).await;
                let direct_used = match &t {
                    Opened::Files(f) if r.job.direct => Some(!f.direct_refused()),
                    _ => None,
                };
                t.cleanup();
                Ok(JobReply { run: run?, direct_used })
            }
            super::BlockTarget::Scratch { file } => {
                let path = scratch_path(scratch, file)?;
                let f = crate::files::FileTarget::open(&path)?;
                let t = Opened::Files(f.clone());
                let run = t.run(&r.job, limits, stop).await?;
                let direct_used = r.job.direct.then(|| !f.direct_refused());
                Ok(JobReply { run, direct_used })
            }
        }
    }
    .await;
    route.close().await;
    result
}

/// Writes or checks a pattern over NBD (1 MiB requests, one in flight).
pub async fn pattern(links: &Links, r: PatternRequest) -> anyhow::Result<PatternReply> {
    const MIB: u64 = 1 << 20;
    let mut route = Route::default();
    let result = async {
        let a = links.via(r.link, crate::cluster::host_port(&r.addr)?, &mut route).await?;
        let c = NbdClient::connect(a.to_string(), &r.export)
            .await
            .with_context(|| format!("connecting to nbd://{}/{}", r.addr, r.export))?;
        if !r.offset.is_multiple_of(MIB) || !r.size.is_multiple_of(MIB) || r.size == 0 {
            bail!("offset and size must be whole MiB, size > 0");
        }
        if r.offset + r.size > c.size() {
            bail!("range {}+{} is past the export's end ({} bytes)", r.offset, r.size, c.size());
        }
        let deadline = Instant::now() + super::MAX_WORK;
        let mut want = vec![0u8; MIB as usize];
        let mut buf = vec![0u8; MIB as usize];
        let t = Instant::now();
        for i in 0..r.size / MIB {
            if Instant::now() > deadline {
                bail!("pattern did not finish within {:?}", super::MAX_WORK);
            }
            let off = r.offset + i * MIB;
            fill(&mut want, r.seed ^ (off / MIB));
            if r.write {
                c.write(off, &want, false).await?;
            } else {
                buf = c.read_into(buf, off).await?;
                if buf != want {
                    bail!("read different data at MiB {} than was written", off / MIB);
                }
            }
        }
        if r.write {
            c.flush().await?;
        }
        let secs = t.elapsed().as_secs_f64();
        let _ = c.disconnect().await;
        Ok(PatternReply { bytes: r.size, secs })
    }
    .await;
    route.close().await;
    result
}

/// S3 clients for every endpoint; a request that fails on one endpoint is
/// tried on the next, so a dead node costs a failover, not the run.
struct Failover {
    clients: Vec<(String, aws_sdk_s3::Client)>,
    bucket: String,
    failovers: AtomicU64,
    events: Mutex<Vec<Event>>,
    /// Endpoints that failed at least once (reported once each).
    failed: Mutex<Vec<usize>>,
    t0: Instant,
}

impl Failover {
    fn new(s3: &S3Spec, urls: &[String], t0: Instant) -> anyhow::Result<Failover> {
        if urls.is_empty() {
            bail!("no S3 endpoints");
        }
        let clients = s3
            .endpoints
            .iter()
            .zip(urls)
            .map(|(name, u)| {
                (name.clone(), crate::target::s3_client_failfast(u, &s3.region, &s3.access_key, &s3.secret_key))
            })
            .collect();
        Ok(Failover {
            clients,
            bucket: s3.bucket.clone(),
            failovers: AtomicU64::new(0),
            events: Mutex::default(),
            failed: Mutex::default(),
            t0,
        })
    }

    fn event(&self, what: String) {
        let t_s = self.t0.elapsed().as_secs_f64();
        self.events.lock().unwrap_or_else(|e| e.into_inner()).push(Event { t_s, what });
    }

    /// Runs `op` on endpoint `start`, then on each other one until one
    /// answers. Returns the endpoint that answered, for the caller to stay on.
    async fn call<T, F, Fut>(&self, start: usize, what: &str, op: F) -> anyhow::Result<(T, usize)>
    where
        F: Fn(aws_sdk_s3::Client) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<T>>,
    {
        let n = self.clients.len();
        let mut last = None;
        for k in 0..n {
            let i = (start + k) % n;
            match op(self.clients[i].1.clone()).await {
                Ok(v) => {
                    if k > 0 {
                        self.failovers.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok((v, i));
                }
                Err(e) => {
                    let first = {
                        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
                        let first = !f.contains(&i);
                        if first {
                            f.push(i);
                        }
                        first
                    };
                    if first {
                        self.event(format!("{what} via {} failed: {e:#}", self.clients[i].0));
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("no endpoints")))
    }

    fn events(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

async fn put(c: aws_sdk_s3::Client, bucket: String, key: String, body: bytes::Bytes) -> anyhow::Result<()> {
    c.put_object().bucket(bucket).key(&key).body(body.into()).send().await.with_context(|| format!("PUT {key}"))?;
    Ok(())
}

async fn get(c: aws_sdk_s3::Client, bucket: String, key: String) -> anyhow::Result<bytes::Bytes> {
    let r = c.get_object().bucket(bucket).key(&key).send().await.with_context(|| format!("GET {key}"))?;
    Ok(r.body.collect().await.with_context(|| format!("GET {key} body"))?.into_bytes())
}

fn body(size: usize, seed: u64) -> bytes::Bytes {
    let mut v = vec![0u8; size];
    fill(&mut v, seed);
    bytes::Bytes::from(v)
}

/// An object batch: upload phase, then download phase (checked).
pub async fn objects(links: &Links, r: ObjectsRequest) -> anyhow::Result<ObjectsReply> {
    if r.count == 0 || r.size == 0 || r.jobs == 0 || r.jobs > 256 || r.count > 100_000 {
        bail!("count, size and jobs must be > 0 (jobs <= 256, count <= 100000)");
    }
    if (r.count as u128) * (r.size as u128) > 8 << 30 {
        bail!("a batch holds at most 8 GiB");
    }
    let mut route = Route::default();
    let result = async {
        let urls = links.via_urls(r.link, &r.s3.endpoints, &mut route).await?;
        let f = Arc::new(Failover::new(&r.s3, &urls, Instant::now())?);
        let seeds: Arc<Vec<u64>> = Arc::new((0..r.count as u64).map(|i| 0xB0D1 ^ i).collect());
        let deadline = Instant::now() + super::MAX_WORK;
        let mut hists = Vec::new();
        let mut secs = Vec::new();
        for upload in [true, false] {
            let next = Arc::new(AtomicUsize::new(0));
            let mut tasks = tokio::task::JoinSet::new();
            let t = Instant::now();
            for j in 0..r.jobs {
                let (f, next, seeds, prefix, size) = (f.clone(), next.clone(), seeds.clone(), r.prefix.clone(), r.size);
                tasks.spawn(async move {
                    let mut h = Histogram::default();
                    let mut at = j % f.clients.len();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= seeds.len() {
                            return anyhow::Ok(h);
                        }
                        if Instant::now() > deadline {
                            bail!("object batch did not finish within {:?}", super::MAX_WORK);
                        }
                        let key = format!("{prefix}{i:05}");
                        let want = body(size, seeds[i]);
                        let t = Instant::now();
                        if upload {
                            let b = f.bucket.clone();
                            let (_, used) = f
                                .call(at, "PUT", |c| put(c, b.clone(), key.clone(), want.clone()))
                                .await
                                .with_context(|| format!("PUT {key} failed on every endpoint"))?;
                            at = used;
                        } else {
                            let b = f.bucket.clone();
                            let (got, used) = f
                                .call(at, "GET", |c| get(c, b.clone(), key.clone()))
                                .await
                                .with_context(|| format!("GET {key} failed on every endpoint"))?;
                            at = used;
                            if got != want {
                                bail!("GET {key} returned different bytes than were PUT");
                            }
                        }
                        h.record(t.elapsed().as_nanos() as u64);
                    }
                });
            }
            let mut h = Histogram::default();
            while let Some(x) = tasks.join_next().await {
                match x {
                    Ok(Ok(part)) => h.merge(&part),
                    Ok(Err(e)) => {
                        tasks.abort_all();
                        return Err(e);
                    }
                    Err(e) if e.is_cancelled() => {}
                    Err(e) => return Err(e.into()),
                }
            }
            secs.push(t.elapsed().as_secs_f64());
            hists.push(h);
        }
        let get_hist = hists.pop().unwrap_or_default();
        let put_hist = hists.pop().unwrap_or_default();
        Ok(ObjectsReply {
            upload_s: secs[0],
            download_s: secs[1],
            put_hist,
            get_hist,
            failovers: f.failovers.load(Ordering::Relaxed),
            events: f.events(),
        })
    }
    .await;
    route.close().await;
    result
}

/// Per-tick counters of a steady load.
#[derive(Debug, Default)]
struct Counters {
    puts: AtomicU64,
    gets: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    failovers: AtomicU64,
}

impl Counters {
    fn take(&self, t_s: f64) -> Tick {
        Tick {
            t_s,
            puts: self.puts.swap(0, Ordering::Relaxed),
            gets: self.gets.swap(0, Ordering::Relaxed),
            bytes: self.bytes.swap(0, Ordering::Relaxed),
            errors: self.errors.swap(0, Ordering::Relaxed),
            failovers: self.failovers.swap(0, Ordering::Relaxed),
        }
    }
}

/// A steady S3 load with per-tick figures (see [`SteadyRequest`]).
pub async fn steady(links: &Links, r: SteadyRequest) -> anyhow::Result<SteadyReply> {
    if r.size == 0 || r.size > 64 << 20 || r.jobs == 0 || r.jobs > 64 {
        bail!("size must be 1 byte..64 MiB and jobs 1..64");
    }
    if r.duration > super::MAX_WORK / 2 || r.tick < Duration::from_millis(100) {
        bail!("duration at most {:?}, tick at least 100 ms", super::MAX_WORK / 2);
    }
    let mut route = Route::default();
    let result = async {
        let urls = links.via_urls(r.link, &r.s3.endpoints, &mut route).await?;
        let t0 = Instant::now();
        let f = Arc::new(Failover::new(&r.s3, &urls, t0)?);
        let counters = Arc::new(Counters::default());
        let acked: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
        let end = t0 + r.duration;
        let mut tasks = tokio::task::JoinSet::new();
        for j in 0..r.jobs {
            let (f, counters, acked, prefix, size) =
                (f.clone(), counters.clone(), acked.clone(), r.prefix.clone(), r.size);
            tasks.spawn(async move {
                let (mut ph, mut gh) = (Histogram::default(), Histogram::default());
                let mut at = j % f.clients.len();
                let mut rng = 0x5EED_0000u64 ^ j as u64;
                let mut n = 0u64;
                // Each operation is bounded by the clients' timeouts; the
                // loop by the deadline.
                while Instant::now() < end {
                    n += 1;
                    let seed = (j as u64) << 40 | n;
                    let key = format!("{prefix}{j:02}-{n:07}");
                    let want = body(size, seed);
                    let b = f.bucket.clone();
                    let t = Instant::now();
                    let before = f.failovers.load(Ordering::Relaxed);
                    match f.call(at, "PUT", |c| put(c, b.clone(), key.clone(), want.clone())).await {
                        Ok(((), used)) => {
                            at = used;
                            ph.record(t.elapsed().as_nanos() as u64);
                            counters.puts.fetch_add(1, Ordering::Relaxed);
                            counters.bytes.fetch_add(size as u64, Ordering::Relaxed);
                            acked.lock().unwrap_or_else(|e| e.into_inner()).push((key, seed));
                        }
                        Err(_) => {
                            counters.errors.fetch_add(1, Ordering::Relaxed);
                            at = (at + 1) % f.clients.len();
                        }
                    }
                    // A GET of an object acknowledged earlier (by any client).
                    let pick = {
                        let a = acked.lock().unwrap_or_else(|e| e.into_inner());
                        (!a.is_empty())
                            .then(|| a[(crate::loadgen::xorshift(&mut rng) % a.len() as u64) as usize].clone())
                    };
                    if let Some((key, seed)) = pick {
                        let t = Instant::now();
                        match f.call(at, "GET", |c| get(c, b.clone(), key.clone())).await {
                            Ok((got, used)) => {
                                at = used;
                                if got == body(size, seed) {
                                    gh.record(t.elapsed().as_nanos() as u64);
                                    counters.gets.fetch_add(1, Ordering::Relaxed);
                                    counters.bytes.fetch_add(size as u64, Ordering::Relaxed);
                                } else {
                                    f.event(format!("GET {key} returned different bytes than were PUT"));
                                    counters.errors.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            Err(_) => {
                                counters.errors.fetch_add(1, Ordering::Relaxed);
                                at = (at + 1) % f.clients.len();
                            }
                        }
                    }
                    let moved = f.failovers.load(Ordering::Relaxed).saturating_sub(before);
                    counters.failovers.fetch_add(moved, Ordering::Relaxed);
                }
                (ph, gh)
            });
        }
        // Ticks until the workers stop.
        let mut ticks = Vec::new();
        let mut next = t0 + r.tick;
        let (mut put_hist, mut get_hist) = (Histogram::default(), Histogram::default());
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next.into()) => {
                    ticks.push(counters.take(next.duration_since(t0).as_secs_f64()));
                    next += r.tick;
                }
                j = tasks.join_next() => match j {
                    Some(Ok((p, g))) => { put_hist.merge(&p); get_hist.merge(&g); }
                    Some(Err(e)) => return Err(anyhow::anyhow!("a load task failed: {e}")),
                    None => break,
                }
            }
        }
        ticks.push(counters.take(t0.elapsed().as_secs_f64()));
        // Every acknowledged object must read back intact.
        let all = std::mem::take(&mut *acked.lock().unwrap_or_else(|e| e.into_inner()));
        let mut lost = Vec::new();
        let check_deadline = Instant::now() + super::MAX_WORK / 2;
        for (i, (key, seed)) in all.iter().enumerate() {
            if Instant::now() > check_deadline {
                lost.push(format!(
                    "{} not checked: the read-back ran out of time",
                    crate::text::count(all.len() - i, "object")
                ));
                break;
            }
            let b = f.bucket.clone();
            match f.call(i % f.clients.len(), "GET (read-back)", |c| get(c, b.clone(), key.clone())).await {
                Ok((got, _)) if got == body(r.size, *seed) => {}
                Ok(_) => lost.push(format!("{key}: different bytes")),
                Err(e) => lost.push(format!("{key}: {e:#}")),
            }
        }
        Ok(SteadyReply {
            ticks,
            events: f.events(),
            put_hist,
            get_hist,
            acked: all.len() as u64,
            verified: (all.len() - lost.len().min(all.len())) as u64,
            lost,
        })
    }
    .await;
    route.close().await;
    result
}

/// Bulk TCP to another agent's sink.
pub async fn probe(links: &Links, to: SocketAddr, duration: Duration, link: LinkSpec) -> anyhow::Result<ProbeReply> {
    let mut route = Route::default();
    let result = async {
        let a = links.via(link, to, &mut route).await?;
        let p = crate::netprobe::run(a, duration.min(Duration::from_secs(60)), u64::MAX).await?;
        Ok(ProbeReply { bytes_per_s: p.bytes_per_s, retransmits: p.retransmits })
    }
    .await;
    route.close().await;
    result
}

/// `iperf3 --version`'s first line, if iperf3 runs here.
pub fn iperf3_version() -> Option<String> {
    let o = std::process::Command::new("iperf3").arg("--version").output().ok()?;
    String::from_utf8_lossy(&o.stdout).lines().next().map(|l| l.trim().to_owned()).filter(|l| !l.is_empty())
}

/// Starts `iperf3 -s -1` (one test, then it exits) on `port` (0: a free
/// one) and returns once it listens; it is killed after `MAX_WORK/10` if no
/// client came.
pub async fn iperf3_server(port: u16) -> anyhow::Result<u16> {
    use tokio::io::AsyncBufReadExt;
    let port = if port == 0 { std::net::TcpListener::bind(("0.0.0.0", 0))?.local_addr()?.port() } else { port };
    let mut child = tokio::process::Command::new("iperf3")
        .args(["-s", "-1", "--forceflush", "-p", &port.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting iperf3 -s (is iperf3 installed on this agent?)")?;
    let out = child.stdout.take().context("iperf3 stdout")?;
    let mut lines = tokio::io::BufReader::new(out).lines();
    let ready = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(l) = lines.next_line().await? {
            if l.contains("Server listening") {
                return anyhow::Ok(());
            }
        }
        bail!("iperf3 -s exited before listening")
    })
    .await;
    match ready {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => bail!("iperf3 -s did not listen within 10 s"),
    }
    tokio::spawn(async move {
        let _ = tokio::time::timeout(super::MAX_WORK / 10, async {
            while let Ok(Some(_)) = lines.next_line().await {}
            let _ = child.wait().await;
        })
        .await;
        // Dropping `child` kills it if it is still running.
    });
    Ok(port)
}

/// iperf3's end-of-test JSON: received bytes/s and sender retransmits.
pub fn parse_iperf3(json: &[u8]) -> anyhow::Result<Iperf3Reply> {
    let v: serde_json::Value = serde_json::from_slice(json).context("iperf3 did not print JSON")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("iperf3: {e}");
    }
    let end = v.get("end").context("iperf3 JSON has no `end`")?;
    let bps = end
        .pointer("/sum_received/bits_per_second")
        .and_then(serde_json::Value::as_f64)
        .context("iperf3 JSON has no end.sum_received.bits_per_second")?;
    let retransmits = end.pointer("/sum_sent/retransmits").and_then(serde_json::Value::as_u64).unwrap_or(0);
    Ok(Iperf3Reply { bytes_per_s: bps / 8.0, retransmits })
}

/// `iperf3 -c` to a server (through the agent's link when emulated).
pub async fn iperf3_client(
    links: &Links,
    to: SocketAddr,
    duration: Duration,
    link: LinkSpec,
) -> anyhow::Result<Iperf3Reply> {
    let mut route = Route::default();
    let result = async {
        let a = links.via(link, to, &mut route).await?;
        let secs = duration.as_secs().clamp(1, 60);
        let out = tokio::time::timeout(
            Duration::from_secs(secs + 20),
            tokio::process::Command::new("iperf3")
                .args(["-c", &a.ip().to_string(), "-p", &a.port().to_string(), "-t", &secs.to_string(), "-J"])
                .kill_on_drop(true)
                .output(),
        )
        .await
        .context("iperf3 -c did not finish in time")?
        .context("running iperf3 -c (is iperf3 installed on this agent?)")?;
        parse_iperf3(&out.stdout)
    }
    .await;
    route.close().await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_names_cannot_leave_the_scratch_dir() {
        let s = Path::new("/scratch");
        assert_eq!(scratch_path(s, "local-disk").unwrap(), Path::new("/scratch/local-disk"));
        for bad in ["", "../etc/passwd", "a/b", ".hidden", "x y", &"a".repeat(65)] {
            assert!(scratch_path(s, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn iperf3_json_is_read_and_its_errors_reported() {
        let ok = br#"{"start":{},"end":{"sum_sent":{"bits_per_second":8.5e8,"retransmits":3},
            "sum_received":{"bits_per_second":8.0e8}}}"#;
        let r = parse_iperf3(ok).unwrap();
        assert_eq!((r.bytes_per_s, r.retransmits), (1.0e8, 3));
        let err = br#"{"start":{},"end":{},"error":"unable to connect to server"}"#;
        assert!(format!("{:#}", parse_iperf3(err).unwrap_err()).contains("unable to connect"));
        assert!(parse_iperf3(b"not json").is_err());
    }
}
