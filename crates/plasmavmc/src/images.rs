//! Images: one streaming pass from the client (or an import source) into a
//! LightningStor multipart upload, hashing and probing on the way.

use crate::app::App;
use crate::error::{PlasmaError, Result};
use crate::meta;
use crate::metrics::Metrics;
use crate::model::{CreateImage, Image, S3Source, Status, Volume, new_id, now_secs};
use crate::objstore::object_key;
use crate::probe::{DiskFormat, Limits, Prober};
use crate::{urlfilter, wire};
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use sha2::Digest;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::task::JoinSet;

/// Parts uploaded at once (memory: this many parts of `part_size`).
const PARTS_IN_FLIGHT: usize = 4;

fn parse_format(s: Option<&str>) -> Result<Option<DiskFormat>> {
    match s {
        None | Some("auto") => Ok(None),
        Some("raw") => Ok(Some(DiskFormat::Raw)),
        Some("qcow2") => Ok(Some(DiskFormat::Qcow2)),
        Some(other) => Err(PlasmaError::Invalid(format!("disk_format {other:?} is not raw, qcow2 or auto"))),
    }
}

fn check_sha(s: &str) -> Result<String> {
    if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(s.to_ascii_lowercase())
    } else {
        Err(PlasmaError::Invalid(format!("sha256 {s:?} is not 64 hex digits")))
    }
}

/// `POST /v1/images`: records the image; starts an import if one is asked for.
pub async fn create(app: &Arc<App>, req: CreateImage) -> Result<Image> {
    wire::check_image_name(&req.name)?;
    let declared = parse_format(req.disk_format.as_deref())?;
    let expected = req.sha256.as_deref().map(check_sha).transpose()?;
    if req.import_url.is_some() && req.import_s3.is_some() {
        return Err(PlasmaError::Invalid("give import_url or import_s3, not both".into()));
    }
    if let Some(u) = &req.import_url {
        urlfilter::check_url(u).map_err(|e| PlasmaError::UrlRefused(e.to_string()))?;
    }
    let importing = req.import_url.is_some() || req.import_s3.is_some();
    let img = Image {
        id: new_id("img"),
        name: req.name,
        status: if importing { Status::Importing } else { Status::Queued },
        disk_format: None,
        declared_format: declared,
        virtual_size: None,
        size: None,
        sha256: None,
        expected_sha256: expected,
        bytes_done: 0,
        bytes_total: None,
        error_reason: None,
        created_at: now_secs(),
    };
    app.meta.put(meta::IMAGES, &img.id, &img)?;
    if importing {
        let app2 = app.clone();
        let id = img.id.clone();
        let (url, s3) = (req.import_url, req.import_s3);
        tokio::spawn(async move {
            let r = match (url, s3) {
                (Some(u), _) => import_url(&app2, &id, &u).await,
                (_, Some(s)) => import_s3(&app2, &id, &s).await,
                _ => Ok(()),
            };
            if let Err(e) = r {
                fail(&app2, &id, &e);
            }
        });
    }
    Ok(img)
}

/// Fills in live progress.
pub fn get(app: &App, id: &str) -> Result<Image> {
    let mut img: Image = app.meta.get(meta::IMAGES, id)?.ok_or_else(|| PlasmaError::not_found("image", id))?;
    if let Some(p) = app.peek_progress(id) {
        let (done, total) = p.get();
        img.bytes_done = done;
        if total > 0 {
            img.bytes_total = Some(total);
        }
    }
    Ok(img)
}

pub fn list(app: &App) -> Result<Vec<Image>> {
    app.meta.list::<Image>(meta::IMAGES)?.into_iter().map(|i| get(app, &i.id)).collect()
}

fn fail(app: &App, id: &str, e: &PlasmaError) {
    tracing::warn!(image = id, error = %e, "image failed");
    Metrics::inc(&app.metrics.images_failed);
    let done = app.peek_progress(id).map(|p| p.get().0).unwrap_or(0);
    let _ = app.meta.update(meta::IMAGES, "image", id, |i: &mut Image| {
        i.status = Status::Error;
        i.error_reason = Some(e.to_string());
        i.bytes_done = done;
    });
    app.drop_progress(id);
}

/// Moves a queued image into `to` (uploading/importing), refusing any other state.
fn claim(app: &App, id: &str, from: Status, to: Status) -> Result<Image> {
    let mut ok = true;
    let img = app.meta.update(meta::IMAGES, "image", id, |i: &mut Image| {
        if i.status == from {
            i.status = to;
        } else {
            ok = false;
        }
    })?;
    if !ok {
        return Err(PlasmaError::Conflict(
            format!("image {id} is {:?}; only a queued image takes an upload", img.status).to_lowercase(),
        ));
    }
    Ok(img)
}

/// `PUT /v1/images/{id}/file`: the whole upload, answered when it is stored.
pub async fn upload<S, E>(app: &Arc<App>, id: &str, body: S, len: Option<u64>) -> Result<Image>
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let img = claim(app, id, Status::Queued, Status::Uploading)?;
    // Its own task: if the client vanishes, the server drops the handler but
    // the upload still sees the broken body, aborts and records the error.
    let (app, id) = (app.clone(), id.to_owned());
    let task = tokio::spawn(async move {
        let mut body = body;
        match ingest(&app, &img, &mut body, len).await {
            Ok(img) => Ok(img),
            Err(e) => {
                fail(&app, &id, &e);
                drain(&mut body).await;
                Err(e)
            }
        }
    });
    task.await?
}

/// Bytes of a refused upload read and dropped before the answer, at most.
const DRAIN_MAX: u64 = 64 << 20;

/// Reads what is left of a refused upload's body (up to [`DRAIN_MAX`]
/// bytes and 10 s) before the refusal is answered. A server that answers
/// while the client is still sending and then closes with unread bytes in
/// its socket makes the kernel reset the connection, and the client sees
/// the reset instead of the answer (a refusal found in the image's header,
/// seen in a test run as "error sending request").
async fn drain<S, E>(body: &mut S)
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + Unpin,
{
    let read = async {
        let mut n = 0u64;
        while n < DRAIN_MAX {
            match body.next().await {
                Some(Ok(chunk)) => n += chunk.len() as u64,
                Some(Err(_)) | None => break,
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), read).await;
}

async fn import_url(app: &Arc<App>, id: &str, raw: &str) -> Result<()> {
    let refused = |e: urlfilter::UrlError| PlasmaError::UrlRefused(e.to_string());
    let u = urlfilter::check_url(raw).map_err(refused)?;
    let host = u.host_str().ok_or_else(|| refused(urlfilter::UrlError::NoHost))?.to_owned();
    let port = u.port_or_known_default().unwrap_or(80);
    let bare = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let addrs: Vec<_> = tokio::net::lookup_host((bare.as_str(), port))
        .await
        .map_err(|e| PlasmaError::Download(format!("cannot resolve {host}: {e}")))?
        .collect();
    let Some(first) = addrs.first().copied() else {
        return Err(PlasmaError::Download(format!("{host} has no addresses")));
    };
    for a in &addrs {
        urlfilter::check_ip(a.ip(), app.cfg.allow_private_urls).map_err(refused)?;
    }
    // Connect to exactly the address we checked; never follow redirects
    // (they could point anywhere).
    let client = reqwest::Client::builder()
        .resolve(&bare, first)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| PlasmaError::Download(e.to_string()))?;
    let resp = client.get(u).send().await.map_err(|e| PlasmaError::Download(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(PlasmaError::Download(format!("{raw} answered {}", resp.status())));
    }
    let len = resp.content_length();
    let img = app.meta.get::<Image>(meta::IMAGES, id)?.ok_or_else(|| PlasmaError::not_found("image", id))?;
    ingest(app, &img, resp.bytes_stream(), len).await.map(|_| ())
}

async fn import_s3(app: &Arc<App>, id: &str, src: &S3Source) -> Result<()> {
    let (body, len) = app.s3.get_stream(&src.bucket, &src.key).await?;
    let stream = futures::stream::unfold(body, |mut b| async move {
        match b.next().await {
            Some(Ok(chunk)) => Some((Ok(chunk), b)),
            Some(Err(e)) => Some((Err(e.to_string()), b)),
            None => None,
        }
    });
    let img = app.meta.get::<Image>(meta::IMAGES, id)?.ok_or_else(|| PlasmaError::not_found("image", id))?;
    ingest(app, &img, Box::pin(stream), len).await.map(|_| ())
}

/// The streaming pass: multipart upload, sha256 and probe together. Aborts
/// the multipart upload on any failure.
async fn ingest<S, E>(app: &Arc<App>, img: &Image, body: S, len: Option<u64>) -> Result<Image>
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    if let Some(l) = len
        && l > app.cfg.max_artifact_size
    {
        return Err(PlasmaError::Invalid(format!(
            "artifact of {l} bytes exceeds the {} limit",
            app.cfg.max_artifact_size
        )));
    }
    let progress = app.progress(&img.id);
    progress.total.store(len.unwrap_or(0), Ordering::Relaxed);
    let key = object_key(&img.id);
    let mp = app.s3.begin(&key).await?;
    let r = stream_parts(app, img, body, &mp, &progress).await;
    let (sha, found, size) = match r {
        Ok(x) => x,
        Err(e) => {
            mp.abort().await;
            return Err(e);
        }
    };
    let img = app.meta.update(meta::IMAGES, "image", &img.id, |i: &mut Image| {
        i.status = Status::Active;
        i.sha256 = Some(sha.clone());
        i.disk_format = Some(found.format);
        i.virtual_size = Some(found.virtual_size);
        i.size = Some(size);
        i.bytes_done = size;
        i.bytes_total = Some(size);
    })?;
    app.drop_progress(&img.id);
    Metrics::inc(&app.metrics.images_created);
    app.metrics.image_bytes.fetch_add(size, Ordering::Relaxed);
    tracing::info!(image = %img.id, size, virtual_size = found.virtual_size, format = %found.format, "image active");
    Ok(img)
}

async fn stream_parts<S, E>(
    app: &Arc<App>,
    img: &Image,
    mut body: S,
    mp: &crate::objstore::Multipart,
    progress: &crate::app::Progress,
) -> Result<(String, crate::probe::ProbeResult, u64)>
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + Unpin,
    E: std::fmt::Display,
{
    let limits = Limits { max_virtual_size: app.cfg.max_virtual_size };
    let part_size = app.cfg.part_size as usize;
    let mut hasher = sha2::Sha256::new();
    let mut prober = Prober::default();
    let mut early_done = false;
    let mut buf = BytesMut::with_capacity(part_size);
    let mut parts = JoinSet::new();
    let mut done_parts = Vec::new();
    let mut number = 0i32;
    let mut send_part = async |data: Bytes, parts: &mut JoinSet<Result<_>>, done: &mut Vec<_>| -> Result<()> {
        while parts.len() >= PARTS_IN_FLIGHT {
            if let Some(r) = parts.join_next().await {
                done.push(r??);
            }
        }
        number += 1;
        let mp = mp.clone();
        let n = number;
        parts.spawn(async move { mp.part(n, data).await });
        Ok(())
    };
    let idle = std::time::Duration::from_secs(app.cfg.upload_idle_timeout_secs);
    loop {
        let Ok(next) = tokio::time::timeout(idle, body.next()).await else {
            return Err(PlasmaError::Download(format!(
                "the client sent nothing for {} s; upload abandoned",
                idle.as_secs()
            )));
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| PlasmaError::Download(format!("the upload stream broke: {e}")))?;
        hasher.update(&chunk);
        prober.feed(&chunk);
        progress.done.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        if prober.total() > app.cfg.max_artifact_size {
            return Err(PlasmaError::Invalid(format!("artifact exceeds the {} byte limit", app.cfg.max_artifact_size)));
        }
        if !early_done && prober.head_full() {
            prober.early(img.declared_format, limits)?;
            early_done = true;
        }
        buf.extend_from_slice(&chunk);
        while buf.len() >= part_size {
            let part = buf.split_to(part_size).freeze();
            send_part(part, &mut parts, &mut done_parts).await?;
        }
    }
    let total = prober.total();
    if let Some(l) = Some(progress.total.load(Ordering::Relaxed)).filter(|l| *l > 0)
        && l != total
    {
        return Err(PlasmaError::Download(format!("expected {l} bytes, got {total}")));
    }
    let found = prober.finish(img.declared_format, limits)?;
    let sha = hex::encode(hasher.finalize());
    if let Some(exp) = &img.expected_sha256
        && *exp != sha
    {
        return Err(PlasmaError::Checksum { expected: exp.clone(), actual: sha });
    }
    if !buf.is_empty() {
        send_part(buf.freeze(), &mut parts, &mut done_parts).await?;
    }
    while let Some(r) = parts.join_next().await {
        done_parts.push(r??);
    }
    mp.complete(done_parts).await?;
    Ok((sha, found, total))
}

/// `DELETE /v1/images/{id}`: refused while volumes use it.
pub async fn delete(app: &Arc<App>, id: &str) -> Result<()> {
    let img = get(app, id)?;
    if matches!(img.status, Status::Uploading | Status::Importing) {
        return Err(PlasmaError::Conflict(format!("image {id} is still arriving")));
    }
    let users: Vec<String> =
        app.meta.list::<Volume>(meta::VOLUMES)?.into_iter().filter(|v| v.image_id == id).map(|v| v.id).collect();
    if !users.is_empty() {
        return Err(PlasmaError::Conflict(format!("image {id} is used by volumes {users:?}")));
    }
    let lock = app.fill_lock(id);
    let _g = lock.lock().await;
    crate::cache::drop_base(app, id).await?;
    // What a crash may have left of the image: an upload never completed
    // or aborted, a conversion scratch file.
    app.s3.abort_uploads(&object_key(id), true).await?;
    match std::fs::remove_file(app.scratch_path(id)) {
        Ok(()) => tracing::info!(image = id, "removed a scratch file a crashed fill left"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    if img.status == Status::Active {
        app.s3.delete(&object_key(id)).await?;
    }
    app.meta.delete(meta::IMAGES, id)?;
    Ok(())
}
