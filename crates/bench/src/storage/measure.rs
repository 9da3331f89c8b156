//! The measurements behind each section of the storage report. Each takes
//! endpoints and sizes and returns one iteration's raw figures; the caller
//! interleaves iterations and summarises.

use crate::cluster::{CoronaEndpoint, S3Endpoint};
use crate::job::Job;
use crate::loadgen::{JobRun, Limits, Opened, fill};
use anyhow::{Context, bail};
use coronafs::client::NbdClient;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

/// The five block figures of the seed's CoronaFS table, one iteration.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockRun {
    pub seq_write_mib_s: f64,
    pub seq_read_mib_s: f64,
    pub rand_read_4k_iops: f64,
    pub depth32_write_mib_s: f64,
    pub depth32_read_mib_s: f64,
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

/// Runs the seed-000 jobs on `target` once.
pub async fn block(target: &Opened, jobs: &[Job], stop: &Arc<AtomicBool>) -> anyhow::Result<BlockRun> {
    let mut r = BlockRun::default();
    for job in jobs {
        let run: JobRun = target.run(job, Limits::default(), stop.clone()).await?;
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
    Ok(r)
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
        if tasks.len() >= 16 {
            if let Some(r) = tasks.join_next().await {
                r??;
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    client.flush().await?;
    Ok(())
}

/// Cross-worker read: worker A writes `size` bytes and flushes on its own
/// connection; worker B, on another connection, reads them back
/// sequentially (1 MiB, depth 1) and checks every byte. Returns B's MiB/s.
pub async fn cross_worker(c: &CoronaEndpoint, export: &str, size: u64, seed: u64) -> anyhow::Result<f64> {
    let a = NbdClient::connect(c.nbd.as_str(), export).await.context("worker A")?;
    let b = NbdClient::connect(c.nbd.as_str(), export).await.context("worker B")?;
    let size = size.min(a.size()) / (1 << 20) * (1 << 20);
    if size == 0 {
        bail!("volume too small for the cross-worker read");
    }
    let mut chunk = vec![0u8; 1 << 20];
    for i in 0..size >> 20 {
        fill(&mut chunk, seed ^ i);
        a.write(i << 20, &chunk, false).await?;
    }
    a.flush().await?;
    let t = Instant::now();
    let mut buf = vec![0u8; 1 << 20];
    for i in 0..size >> 20 {
        buf = b.read_into(buf, i << 20).await?;
        fill(&mut chunk, seed ^ i);
        if buf != chunk {
            bail!("worker B read different data at MiB {i} than worker A wrote");
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let _ = a.disconnect().await;
    let _ = b.disconnect().await;
    Ok(size as f64 / 1048576.0 / secs)
}

/// An S3 client for node `i` of the endpoint set.
pub fn s3(e: &S3Endpoint, i: usize) -> aws_sdk_s3::Client {
    let url = &e.endpoints[i % e.endpoints.len()];
    crate::target::s3_client(url, &e.region, &e.access_key, &e.secret_key)
}

/// Creates `bucket` unless it exists.
pub async fn ensure_bucket(c: &aws_sdk_s3::Client, bucket: &str) -> anyhow::Result<()> {
    if c.head_bucket().bucket(bucket).send().await.is_err() {
        c.create_bucket().bucket(bucket).send().await.with_context(|| format!("creating bucket {bucket}"))?;
    }
    Ok(())
}

/// Upload and download throughput of one object, in MiB/s.
#[derive(Debug, Clone, Copy, Default)]
pub struct Transfer {
    pub up_mib_s: f64,
    pub down_mib_s: f64,
    pub put_per_s: f64,
    pub get_per_s: f64,
}

async fn put(c: &aws_sdk_s3::Client, bucket: &str, key: &str, body: bytes::Bytes) -> anyhow::Result<()> {
    c.put_object().bucket(bucket).key(key).body(body.into()).send().await.with_context(|| format!("PUT {key}"))?;
    Ok(())
}

async fn get(c: &aws_sdk_s3::Client, bucket: &str, key: &str) -> anyhow::Result<bytes::Bytes> {
    let r = c.get_object().bucket(bucket).key(key).send().await.with_context(|| format!("GET {key}"))?;
    Ok(r.body.collect().await.with_context(|| format!("GET {key} body"))?.into_bytes())
}

/// `count` objects of `size` bytes, uploaded then downloaded by `jobs`
/// concurrent clients; every download is checked against its upload.
pub async fn objects(
    e: &S3Endpoint,
    bucket: &str,
    prefix: &str,
    count: usize,
    size: usize,
    jobs: usize,
) -> anyhow::Result<Transfer> {
    let bodies: Vec<bytes::Bytes> = (0..count)
        .map(|i| {
            let mut v = vec![0u8; size];
            fill(&mut v, 0xB0D1 ^ i as u64);
            bytes::Bytes::from(v)
        })
        .collect();
    let bodies = Arc::new(bodies);
    let total_mib = (count * size) as f64 / 1048576.0;
    let phase = |upload: bool| {
        let bodies = bodies.clone();
        async move {
            let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let mut tasks = tokio::task::JoinSet::new();
            let t = Instant::now();
            for j in 0..jobs.max(1) {
                let (c, b, p, next, bodies) =
                    (s3(e, j), bucket.to_owned(), prefix.to_owned(), next.clone(), bodies.clone());
                tasks.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= bodies.len() {
                            return anyhow::Ok(());
                        }
                        let key = format!("{p}{i:04}");
                        if upload {
                            put(&c, &b, &key, bodies[i].clone()).await?;
                        } else if get(&c, &b, &key).await? != bodies[i] {
                            bail!("GET {key} returned different bytes than were PUT");
                        }
                    }
                });
            }
            while let Some(r) = tasks.join_next().await {
                r??;
            }
            anyhow::Ok(t.elapsed().as_secs_f64())
        }
    };
    let up = phase(true).await?;
    let down = phase(false).await?;
    Ok(Transfer {
        up_mib_s: total_mib / up,
        down_mib_s: total_mib / down,
        put_per_s: count as f64 / up,
        get_per_s: count as f64 / down,
    })
}

/// Deletes the objects under `prefix` (best effort; keeps the store small
/// between iterations).
pub async fn delete_prefix(c: &aws_sdk_s3::Client, bucket: &str, prefix: &str) {
    if let Ok(list) = c.list_objects_v2().bucket(bucket).prefix(prefix).send().await {
        for o in list.contents() {
            if let Some(k) = o.key() {
                let _ = c.delete_object().bucket(bucket).key(k).send().await;
            }
        }
    }
}
