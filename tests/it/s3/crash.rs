//! Durability and memory tests against the spawned `lightningstor` binary:
//! kill -9 in the middle of an upload, then restart; and a 1 GiB multipart
//! upload whose server RSS stays bounded.

use super::common as s3_common;

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;
use hyper::body::Frame;
use md5::Digest as _;
use s3_common::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

type R = anyhow::Result<()>;

type FrameResult = Result<Frame<Bytes>, std::io::Error>;

/// A body the test feeds by hand, so the upload can be cut at any point.
fn channel_body(capacity: usize) -> (tokio::sync::mpsc::Sender<FrameResult>, ByteStream) {
    let (tx, rx) = tokio::sync::mpsc::channel::<FrameResult>(capacity);
    let stream = Box::pin(futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) }));
    let body = http_body_util::StreamBody::new(sync_stream(stream));
    (tx, ByteStream::from_body_1_x(body))
}

/// Boxes a stream behind a mutex so it is `Sync`, as the SDK wants.
fn sync_stream<S: futures::Stream + Send + Unpin + 'static>(s: S) -> SyncStream<S> {
    SyncStream(std::sync::Mutex::new(s))
}

struct SyncStream<S>(std::sync::Mutex<S>);

impl<S: futures::Stream + Unpin> futures::Stream for SyncStream<S> {
    type Item = S::Item;
    fn poll_next(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<S::Item>> {
        let inner = match self.get_mut().0.get_mut() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        std::pin::Pin::new(inner).poll_next(cx)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_mid_upload_leaves_no_half_object_and_orphans_are_collected() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let server = Spawned::start(dir.path(), &[]);
    let c = server.client();
    c.create_bucket().bucket("crash").send().await?;
    let committed = pseudo_random(3 * 1024 * 1024, 1);
    c.put_object().bucket("crash").key("committed").body(ByteStream::from(committed.clone())).send().await?;
    let part = pseudo_random(2 * 1024 * 1024, 2);
    let up = c.create_multipart_upload().bucket("crash").key("mpu").send().await?;
    let upload_id = up.upload_id().expect("id").to_owned();
    let part_etag = c
        .upload_part()
        .bucket("crash")
        .key("mpu")
        .upload_id(&upload_id)
        .part_number(1)
        .body(ByteStream::from(part.clone()))
        .send()
        .await?
        .e_tag
        .expect("etag");
    let durable_blocks = block_files(dir.path()).len();
    assert_eq!(durable_blocks, 5, "3 blocks of the object, 2 of the part");

    // Start a 64 MiB upload and feed it 40 MiB.
    let total = 64 * 1024 * 1024;
    let (tx, body) = channel_body(4);
    let c2 = c.clone();
    let upload = tokio::spawn(async move {
        c2.put_object().bucket("crash").key("half").content_length(total).body(body).send().await
    });
    let chunk = Bytes::from(pseudo_random(1024 * 1024, 3));
    for i in 0..40u8 {
        let mut piece = chunk.to_vec();
        piece[0] = i; // distinct blocks
        if tx.send(Ok(Frame::data(Bytes::from(piece)))).await.is_err() {
            break;
        }
    }
    // Wait until the server has written blocks of the half upload.
    let deadline = Instant::now() + Duration::from_secs(60);
    while block_files(dir.path()).len() < durable_blocks + 20 {
        assert!(Instant::now() < deadline, "the upload never reached the disk");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let before_kill = block_files(dir.path()).len();
    server.kill9();
    drop(tx);
    assert!(upload.await?.is_err(), "the upload cannot have succeeded");

    let server = Spawned::start(dir.path(), &[]);
    let c = server.client();
    let e = c.head_object().bucket("crash").key("half").send().await.expect_err("half object");
    assert_eq!(status(&e), 404);
    let listed = c.list_objects_v2().bucket("crash").send().await?;
    let keys: Vec<_> = listed.contents().iter().filter_map(|o| o.key()).collect();
    assert_eq!(keys, ["committed"]);
    // The orphaned blocks were collected at startup; the durable ones were not.
    let after = block_files(dir.path()).len();
    assert!(before_kill > after, "{before_kill} -> {after}");
    assert_eq!(after, durable_blocks);
    // What is left in tmp/ is emptied files kept for reuse, holding no data.
    for f in std::fs::read_dir(dir.path().join("blocks/tmp"))? {
        assert_eq!(f?.metadata()?.len(), 0);
    }

    let out = c.get_object().bucket("crash").key("committed").send().await?;
    assert_eq!(out.body.collect().await?.into_bytes().as_ref(), committed.as_slice());
    // The multipart upload survived with its part and can be completed.
    let uploads = c.list_multipart_uploads().bucket("crash").send().await?;
    assert_eq!(uploads.uploads().len(), 1);
    c.complete_multipart_upload()
        .bucket("crash")
        .key("mpu")
        .upload_id(&upload_id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .parts(CompletedPart::builder().part_number(1).e_tag(&part_etag).build())
                .build(),
        )
        .send()
        .await?;
    let out = c.get_object().bucket("crash").key("mpu").send().await?;
    assert_eq!(out.body.collect().await?.into_bytes().as_ref(), part.as_slice());
    let metrics = reqwest::get(format!("{}/metrics", server.endpoint())).await?.text().await?;
    let gc_line = metrics.lines().find(|l| l.starts_with("lightningstor_gc_blocks_deleted_total ")).expect("gc metric");
    assert_ne!(gc_line, "lightningstor_gc_blocks_deleted_total 0");
    server.stop();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_gib_multipart_upload_streams_with_bounded_server_memory() -> R {
    let _gate = crate::gate::shared();
    const PART: usize = 64 * 1024 * 1024;
    const PARTS: i32 = 16;
    /// Measured peak is ~35 MiB (debug build); a buffering server would need over 1 GiB.
    const RSS_LIMIT: u64 = 128 * 1024 * 1024;

    let dir = tempfile::tempdir()?;
    let server = Spawned::start(dir.path(), &[]);
    let c = server.client();
    c.create_bucket().bucket("big").send().await?;

    let peak = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done, pid) = (peak.clone(), done.clone(), server.pid());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let rss = rss_of(pid);
                peak.fetch_max(rss, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    let up = c.create_multipart_upload().bucket("big").key("gib").send().await?;
    let id = up.upload_id().expect("id").to_owned();
    let mut whole = md5::Md5::new();
    let mut part_md5s = Vec::new();
    let mut completed = CompletedMultipartUpload::builder();
    for n in 1..=PARTS {
        let data = pseudo_random(PART, 1000 + n as u64);
        whole.update(&data);
        part_md5s.extend(md5::Md5::digest(&data));
        let etag = c
            .upload_part()
            .bucket("big")
            .key("gib")
            .upload_id(&id)
            .part_number(n)
            .body(ByteStream::from(data))
            .send()
            .await?
            .e_tag
            .expect("etag");
        completed = completed.parts(CompletedPart::builder().part_number(n).e_tag(etag).build());
    }
    let done_up = c
        .complete_multipart_upload()
        .bucket("big")
        .key("gib")
        .upload_id(&id)
        .multipart_upload(completed.build())
        .send()
        .await?;
    let want_etag = format!("\"{}-{PARTS}\"", hex::encode(md5::Md5::digest(&part_md5s)));
    assert_eq!(done_up.e_tag(), Some(want_etag.as_str()));

    // Stream it back without holding it, checking every byte by MD5.
    let out = c.get_object().bucket("big").key("gib").send().await?;
    assert_eq!(out.content_length(), Some(PART as i64 * i64::from(PARTS)));
    let mut body = out.body;
    let mut got = md5::Md5::new();
    let mut len = 0usize;
    while let Some(chunk) = body.try_next().await? {
        len += chunk.len();
        got.update(&chunk);
    }
    assert_eq!(len, PART * PARTS as usize);
    assert_eq!(got.finalize(), whole.finalize());

    done.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let peak = peak.load(Ordering::Relaxed);
    eprintln!("peak server RSS during 1 GiB upload+download: {} MiB", peak >> 20);
    assert!(peak > 0, "RSS was never sampled");
    assert!(peak < RSS_LIMIT, "server RSS peaked at {} MiB", peak >> 20);
    server.stop();
    Ok(())
}

fn rss_of(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
