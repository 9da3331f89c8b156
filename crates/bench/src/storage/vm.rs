//! The VM image path, through PlasmaVMC's REST API only: `CreateImage`
//! (`POST /v1/images` then `PUT /v1/images/{id}/file` until the image is
//! `active`), the first `CreateVolume` of an image (cold: PlasmaVMC fetches
//! the artifact from LightningStor and converts it into CoronaFS) and the
//! following ones (warm: a clone of the cached base), each timed from the
//! request to the volume being `available`.
//!
//! Test images are qcow2 files written by [`crate::qcow2`]: 64 KiB clusters
//! of pseudo-random data in 1 MiB extents spread over the virtual disk, with
//! holes between them.

use super::{Summary, Target, VmImage, WarmCreate};
use crate::cluster::{CoronaEndpoint, PlasmaEndpoint};
use crate::qcow2;
use anyhow::{Context, bail};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// Virtual size of the main image (the seed's 4096 MiB).
pub const MAIN_VIRTUAL: u64 = 4 << 30;
/// Virtual sizes of the warm `CreateVolume` check.
pub const WARM_SIZES: [u64; 3] = [1 << 30, 4 << 30, 16 << 30];
/// Warm `CreateVolume` p50 must stay under this (issue 6).
pub const WARM_P50_TARGET_MS: f64 = 100.0;
/// `CreateImage` must reach this share of the link rate.
pub const CREATE_IMAGE_TARGET: f64 = 0.85;
/// Cold `CreateVolume` may take at most this many times artifact / link rate.
pub const COLD_TARGET: f64 = 1.2;

/// Sizes and counts of the section.
#[derive(Debug, Clone, Copy)]
pub struct VmOptions {
    /// Allocated bytes of the main (4 GiB virtual) image.
    pub artifact_data: u64,
    /// Allocated bytes of the 1 GiB and 16 GiB images.
    pub side_data: u64,
    /// Warm `CreateVolume` calls per virtual size.
    pub warm_count: usize,
    /// Main images uploaded (each gives one `CreateImage` and one cold and
    /// one second `CreateVolume`).
    pub iterations: usize,
    /// Link rate in bytes/s, when emulated (the targets need it).
    pub link_rate: Option<u64>,
}

/// A PlasmaVMC REST client.
pub struct Api {
    url: String,
    http: reqwest::Client,
}

fn check(v: Value, what: &str) -> anyhow::Result<Value> {
    if v["status"] == "error" {
        bail!("{what} ended in error: {}", v["error_reason"]);
    }
    Ok(v)
}

impl Api {
    pub fn new(p: &PlasmaEndpoint) -> anyhow::Result<Api> {
        let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(10)).build()?;
        Ok(Api { url: p.url.trim_end_matches('/').to_owned(), http })
    }

    async fn json(&self, r: reqwest::RequestBuilder, what: &str) -> anyhow::Result<Value> {
        let resp = r.send().await.with_context(|| format!("{what}: no answer from PlasmaVMC at {}", self.url))?;
        let status = resp.status();
        let body = resp.bytes().await.with_context(|| format!("{what}: reading the answer"))?;
        if !status.is_success() {
            bail!("{what}: {status} {}", String::from_utf8_lossy(&body));
        }
        serde_json::from_slice(&body).with_context(|| format!("{what}: the answer is not JSON"))
    }

    /// `POST /v1/images`; returns the image id.
    pub async fn create_image(&self, name: &str) -> anyhow::Result<String> {
        let v = self
            .json(
                self.http.post(format!("{}/v1/images", self.url)).json(&serde_json::json!({"name": name})),
                "POST /v1/images",
            )
            .await?;
        v["id"].as_str().map(str::to_owned).context("POST /v1/images: no id in the answer")
    }

    /// `PUT /v1/images/{id}/file` from a file, streamed; returns the image.
    pub async fn upload(&self, id: &str, path: &Path, timeout: Duration) -> anyhow::Result<Value> {
        let len = std::fs::metadata(path)?.len();
        let file = tokio::fs::File::open(path).await.with_context(|| path.display().to_string())?;
        let stream = futures::stream::try_unfold(file, |mut f| async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; 1 << 20];
            let n = f.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            buf.truncate(n);
            Ok(Some((bytes::Bytes::from(buf), f)))
        });
        let r = self
            .http
            .put(format!("{}/v1/images/{id}/file", self.url))
            .header(reqwest::header::CONTENT_LENGTH, len)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .timeout(timeout)
            .body(reqwest::Body::wrap_stream(stream));
        check(self.json(r, "PUT /v1/images/{id}/file").await?, "the upload")
    }

    /// `POST /v1/volumes`; returns the volume id.
    pub async fn create_volume(&self, image_id: &str) -> anyhow::Result<String> {
        let v = self
            .json(
                self.http.post(format!("{}/v1/volumes", self.url)).json(&serde_json::json!({"image_id": image_id})),
                "POST /v1/volumes",
            )
            .await?;
        v["id"].as_str().map(str::to_owned).context("POST /v1/volumes: no id in the answer")
    }

    /// Polls `GET /v1/volumes/{id}` every `every` until it is available.
    pub async fn wait_volume(&self, id: &str, every: Duration, timeout: Duration) -> anyhow::Result<Value> {
        let t = Instant::now();
        loop {
            let v = check(
                self.json(self.http.get(format!("{}/v1/volumes/{id}", self.url)), "GET /v1/volumes/{id}").await?,
                &format!("volume {id}"),
            )?;
            if v["status"] == "available" {
                return Ok(v);
            }
            if t.elapsed() > timeout {
                bail!("volume {id} not available after {timeout:?} (status {})", v["status"]);
            }
            tokio::time::sleep(every).await;
        }
    }

    /// One timed `CreateVolume`: request to `available`.
    pub async fn timed_volume(&self, image_id: &str, every: Duration) -> anyhow::Result<(f64, Value)> {
        let t = Instant::now();
        let id = self.create_volume(image_id).await?;
        let v = self.wait_volume(&id, every, Duration::from_secs(900)).await?;
        Ok((t.elapsed().as_secs_f64(), v))
    }

    async fn delete(&self, what: &str, id: &str) -> anyhow::Result<()> {
        let resp = self.http.delete(format!("{}/v1/{what}/{id}", self.url)).send().await?;
        if !resp.status().is_success() {
            bail!("DELETE /v1/{what}/{id}: {} {}", resp.status(), resp.text().await.unwrap_or_default());
        }
        Ok(())
    }

    pub async fn delete_volume(&self, id: &str) -> anyhow::Result<()> {
        self.delete("volumes", id).await
    }

    pub async fn delete_image(&self, id: &str) -> anyhow::Result<()> {
        self.delete("images", id).await
    }
}

/// A test image on disk.
struct TestImage {
    spec: qcow2::Spec,
    written: qcow2::Written,
    path: std::path::PathBuf,
}

fn make_image(dir: &Path, virtual_size: u64, data: u64, seed: u64) -> anyhow::Result<TestImage> {
    let spec = qcow2::Spec { virtual_size, data_bytes: data, seed };
    let path = dir.join(format!("image-{}g-{seed}.qcow2", virtual_size >> 30));
    let written = qcow2::write(&spec, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(TestImage { spec, written, path })
}

/// Uploads `img` as a new image; returns (id, seconds).
async fn create_image(api: &Api, img: &TestImage, name: &str, timeout: Duration) -> anyhow::Result<(String, f64)> {
    let t = Instant::now();
    let id = api.create_image(name).await?;
    let v = api.upload(&id, &img.path, timeout).await?;
    let secs = t.elapsed().as_secs_f64();
    if v["status"] != "active" {
        bail!("image {id} is {} after its upload", v["status"]);
    }
    if v["size"].as_u64() != Some(img.written.file_size) || v["virtual_size"].as_u64() != Some(img.spec.virtual_size) {
        bail!(
            "image {id}: PlasmaVMC reports size {} and virtual size {}, the file has {} and {}",
            v["size"],
            v["virtual_size"],
            img.written.file_size,
            img.spec.virtual_size
        );
    }
    if v["disk_format"] != "qcow2" {
        bail!("image {id} was detected as {}, not qcow2", v["disk_format"]);
    }
    Ok((id, secs))
}

/// Reads an allocated extent and a hole of the volume back over NBD and
/// compares them with what the image holds.
async fn verify(c: &CoronaEndpoint, volume: &Value, img: &TestImage) -> anyhow::Result<()> {
    let export = volume["coronafs_volume"].as_str().context("volume has no coronafs_volume")?;
    let nbd = coronafs::client::NbdClient::connect(c.nbd.as_str(), export).await.context("NBD connect")?;
    let mut want = vec![0u8; qcow2::CLUSTER as usize];
    let last = *img.written.extents.last().context("no extents")?;
    for e in [img.written.extents[0], last] {
        let got = nbd.read(e, qcow2::EXTENT as usize).await?;
        for (i, c) in got.chunks(qcow2::CLUSTER as usize).enumerate() {
            img.spec.cluster_data(e + i as u64 * qcow2::CLUSTER, &mut want);
            if c != want.as_slice() {
                bail!("volume {export}: guest bytes at {} differ from the image", e + i as u64 * qcow2::CLUSTER);
            }
        }
    }
    let hole = img.written.extents[0] + qcow2::EXTENT;
    if !img.written.extents.contains(&hole) && hole + qcow2::EXTENT <= img.spec.virtual_size {
        let got = nbd.read(hole, qcow2::EXTENT as usize).await?;
        if got.iter().any(|b| *b != 0) {
            bail!("volume {export}: the hole at {hole} does not read as zeros");
        }
    }
    let _ = nbd.disconnect().await;
    Ok(())
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Runs the section. `scratch` holds the test images while it runs;
/// `verify_on` (unshaped CoronaFS) is used to read volumes back, when known.
pub async fn measure(
    plasma: &PlasmaEndpoint,
    verify_on: Option<&CoronaEndpoint>,
    opts: &VmOptions,
    scratch: &Path,
    placement: &str,
    mut step: impl FnMut(&str),
) -> anyhow::Result<VmImage> {
    let api = Api::new(plasma)?;
    let dir = scratch.join("vm-images");
    std::fs::create_dir_all(&dir)?;
    let r = run(&api, verify_on, opts, &dir, placement, &mut step).await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn run(
    api: &Api,
    verify_on: Option<&CoronaEndpoint>,
    opts: &VmOptions,
    dir: &Path,
    placement: &str,
    step: &mut impl FnMut(&str),
) -> anyhow::Result<VmImage> {
    step("VM image path: writing the qcow2 test images");
    let (d1, d2) = (dir.to_owned(), *opts);
    let images = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<TestImage>> {
        Ok(vec![
            make_image(&d1, MAIN_VIRTUAL, d2.artifact_data, 0x1417)?,
            make_image(&d1, WARM_SIZES[0], d2.side_data, 0x1418)?,
            make_image(&d1, WARM_SIZES[2], d2.side_data, 0x1419)?,
        ])
    })
    .await??;
    let main = &images[0];
    let artifact = main.written.file_size;
    // Generous bounds: a stuck upload fails the section instead of hanging.
    let upload_timeout = |bytes: u64| {
        let secs = opts.link_rate.map_or(60.0, |r| 60.0 + 4.0 * bytes as f64 / r as f64);
        Duration::from_secs_f64(secs.max(120.0))
    };
    let (mut up_s, mut cold_s, mut second_s) = (Vec::new(), Vec::new(), Vec::new());
    let mut made_images = Vec::new();
    let mut volumes = Vec::new();
    let mut verified = verify_on.is_some();
    let result = async {
        for i in 0..opts.iterations.max(1) {
            step(&format!(
                "VM image path {}/{}: CreateImage ({} MiB qcow2) and CreateVolume (cold, then warm)",
                i + 1,
                opts.iterations.max(1),
                artifact >> 20
            ));
            let (id, secs) = create_image(api, main, &format!("bench-main-{i}"), upload_timeout(artifact)).await?;
            made_images.push(id.clone());
            up_s.push(secs);
            let (cold, v) = api.timed_volume(&id, Duration::from_millis(10)).await?;
            if v["cache_hit"] != false {
                bail!("the first CreateVolume of image {id} was a cache hit");
            }
            volumes.push(v["id"].as_str().unwrap_or_default().to_owned());
            if i == 0
                && let Some(c) = verify_on
            {
                verify(c, &v, main).await?;
            }
            cold_s.push(cold);
            let (second, v) = api.timed_volume(&id, Duration::from_millis(2)).await?;
            if v["cache_hit"] != true {
                bail!("the second CreateVolume of image {id} missed the cache");
            }
            volumes.push(v["id"].as_str().unwrap_or_default().to_owned());
            second_s.push(second);
        }
        // Warm CreateVolume for 1, 4 and 16 GiB virtual images, interleaved.
        step("VM image path: warm CreateVolume for 1, 4 and 16 GiB virtual images");
        let mut warm_images = Vec::new();
        for (k, vsize) in WARM_SIZES.iter().enumerate() {
            let img = match k {
                0 => &images[1],
                1 => main,
                _ => &images[2],
            };
            if *vsize == MAIN_VIRTUAL {
                warm_images.push((made_images[0].clone(), img, None));
                continue;
            }
            let (id, _) =
                create_image(api, img, &format!("bench-warm-{k}"), upload_timeout(img.written.file_size)).await?;
            made_images.push(id.clone());
            let (cold, v) = api.timed_volume(&id, Duration::from_millis(10)).await?;
            volumes.push(v["id"].as_str().unwrap_or_default().to_owned());
            warm_images.push((id, img, Some(cold)));
        }
        let mut times = vec![Vec::new(); WARM_SIZES.len()];
        for _ in 0..opts.warm_count {
            for (k, (id, _, _)) in warm_images.iter().enumerate() {
                let (s, v) = api.timed_volume(id, Duration::from_millis(2)).await?;
                if v["cache_hit"] != true {
                    bail!("a warm CreateVolume of image {id} missed the cache");
                }
                times[k].push(s * 1000.0);
                if let Some(vid) = v["id"].as_str() {
                    api.delete_volume(vid).await?;
                }
            }
        }
        if let Some(c) = verify_on {
            // A clone of the 16 GiB image reads the image's bytes too.
            let (id, img, _) = &warm_images[2];
            let (_, v) = api.timed_volume(id, Duration::from_millis(2)).await?;
            volumes.push(v["id"].as_str().unwrap_or_default().to_owned());
            verify(c, &v, img).await?;
        } else {
            verified = false;
        }
        let warm: Vec<WarmCreate> = warm_images
            .iter()
            .zip(times.iter_mut())
            .map(|((_, img, cold), t)| {
                t.sort_by(f64::total_cmp);
                WarmCreate {
                    virtual_size: img.spec.virtual_size,
                    artifact_bytes: img.written.file_size,
                    n: t.len(),
                    p50_ms: pct(t, 0.5),
                    p90_ms: pct(t, 0.9),
                    max_ms: t.last().copied().unwrap_or(0.0),
                    cold_create_volume_s: *cold,
                }
            })
            .collect();
        anyhow::Ok(warm)
    }
    .await;
    // Leave nothing behind (a deployed cluster keeps running).
    for v in &volumes {
        let _ = api.delete_volume(v).await;
    }
    for i in &made_images {
        let _ = api.delete_image(i).await;
    }
    let warm = result?;
    let create_image_mib_s: Vec<f64> = up_s.iter().map(|s| artifact as f64 / 1048576.0 / s).collect();
    let mut vm = VmImage {
        format: "qcow2".into(),
        artifact_bytes: artifact,
        virtual_size: MAIN_VIRTUAL,
        data_bytes: main.written.data_bytes,
        create_image_s: Summary::of(&up_s),
        create_image_mib_s: Summary::of(&create_image_mib_s),
        first_create_volume_s: Summary::of(&cold_s),
        second_create_volume_s: Summary::of(&second_s),
        warm,
        verified,
        link_placement: placement.into(),
        targets: Vec::new(),
    };
    vm.targets = targets(&vm, opts.link_rate);
    Ok(vm)
}

/// Issue 6's performance targets, each with its ratio to the target.
pub fn targets(vm: &VmImage, link_rate: Option<u64>) -> Vec<Target> {
    let mut t = Vec::new();
    if let Some(rate) = link_rate {
        let link_mib = rate as f64 / 1048576.0;
        let share = vm.create_image_mib_s.median / link_mib;
        t.push(Target {
            key: "create_image_vs_link".into(),
            what: format!(
                "CreateImage throughput {:.2} MiB/s is {:.1}% of the {link_mib:.1} MiB/s link",
                vm.create_image_mib_s.median,
                share * 100.0
            ),
            value: share,
            target: format!(">= {CREATE_IMAGE_TARGET:.2} of the link rate"),
            ratio: share / CREATE_IMAGE_TARGET,
            met: share >= CREATE_IMAGE_TARGET,
        });
        let link_time = vm.artifact_bytes as f64 / rate as f64;
        let x = vm.first_create_volume_s.median / link_time;
        t.push(Target {
            key: "cold_create_volume_vs_link_time".into(),
            what: format!(
                "cold CreateVolume {:.2} s is {x:.2} x the artifact's link time ({link_time:.2} s)",
                vm.first_create_volume_s.median
            ),
            value: x,
            target: format!("<= {COLD_TARGET:.1} x artifact bytes / link rate"),
            ratio: COLD_TARGET / x,
            met: x <= COLD_TARGET,
        });
    }
    for w in &vm.warm {
        t.push(Target {
            key: format!("warm_create_volume_p50_{}g", w.virtual_size >> 30),
            what: format!(
                "warm CreateVolume p50 {:.1} ms for a {} GiB virtual image ({})",
                w.p50_ms,
                w.virtual_size >> 30,
                crate::text::count(w.n, "call")
            ),
            value: w.p50_ms,
            target: format!("< {WARM_P50_TARGET_MS:.0} ms"),
            ratio: WARM_P50_TARGET_MS / w.p50_ms.max(1e-3),
            met: w.p50_ms < WARM_P50_TARGET_MS,
        });
    }
    t
}
