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
use plasmavmc::client::Client;
use plasmavmc::model::{CreateImage, CreateVolume, Status, Volume};
use plasmavmc::probe::DiskFormat;
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

/// One timed `CreateVolume`: request to `available` (polling every `every`).
async fn timed_volume(api: &Client, image_id: &str, every: Duration) -> anyhow::Result<(f64, Volume)> {
    let t = Instant::now();
    let req = CreateVolume { image_id: image_id.to_owned(), size: None };
    let id = api.create_volume(&req).await?.id;
    let v = api.wait_volume(&id, every, Duration::from_secs(900)).await?;
    if v.status != Status::Available {
        bail!("volume {id} ended {:?}: {}", v.status, v.error_reason.unwrap_or_default());
    }
    Ok((t.elapsed().as_secs_f64(), v))
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
async fn create_image(api: &Client, img: &TestImage, name: &str, timeout: Duration) -> anyhow::Result<(String, f64)> {
    let t = Instant::now();
    let id = api.create_image(&CreateImage { name: name.into(), ..Default::default() }).await?.id;
    let v = api.upload_file(&id, &img.path, Some(timeout)).await?;
    let secs = t.elapsed().as_secs_f64();
    if v.status != Status::Active {
        bail!("image {id} is {:?} after its upload: {}", v.status, v.error_reason.unwrap_or_default());
    }
    if v.size != Some(img.written.file_size) || v.virtual_size != Some(img.spec.virtual_size) {
        bail!(
            "image {id}: PlasmaVMC reports size {:?} and virtual size {:?}, the file has {} and {}",
            v.size,
            v.virtual_size,
            img.written.file_size,
            img.spec.virtual_size
        );
    }
    if v.disk_format != Some(DiskFormat::Qcow2) {
        bail!("image {id} was detected as {:?}, not qcow2", v.disk_format);
    }
    Ok((id, secs))
}

/// Reads an allocated extent and a hole of the volume back over NBD and
/// compares them with what the image holds.
async fn verify(c: &CoronaEndpoint, volume: &Volume, img: &TestImage) -> anyhow::Result<()> {
    let export = volume.coronafs_volume.as_str();
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
    let api = plasma.client()?;
    let dir = scratch.join("vm-images");
    std::fs::create_dir_all(&dir)?;
    let r = run(&api, verify_on, opts, &dir, placement, &mut step).await;
    let _ = std::fs::remove_dir_all(&dir);
    r
}

async fn run(
    api: &Client,
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
            let (cold, v) = timed_volume(api, &id, Duration::from_millis(10)).await?;
            if v.cache_hit {
                bail!("the first CreateVolume of image {id} was a cache hit");
            }
            volumes.push(v.id.clone());
            if i == 0
                && let Some(c) = verify_on
            {
                verify(c, &v, main).await?;
            }
            cold_s.push(cold);
            let (second, v) = timed_volume(api, &id, Duration::from_millis(2)).await?;
            if !v.cache_hit {
                bail!("the second CreateVolume of image {id} missed the cache");
            }
            volumes.push(v.id.clone());
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
            let (cold, v) = timed_volume(api, &id, Duration::from_millis(10)).await?;
            volumes.push(v.id.clone());
            warm_images.push((id, img, Some(cold)));
        }
        let mut times = vec![Vec::new(); WARM_SIZES.len()];
        for _ in 0..opts.warm_count {
            for (k, (id, _, _)) in warm_images.iter().enumerate() {
                let (s, v) = timed_volume(api, id, Duration::from_millis(2)).await?;
                if !v.cache_hit {
                    bail!("a warm CreateVolume of image {id} missed the cache");
                }
                times[k].push(s * 1000.0);
                api.delete_volume(&v.id).await?;
            }
        }
        if let Some(c) = verify_on {
            // A clone of the 16 GiB image reads the image's bytes too.
            let (id, img, _) = &warm_images[2];
            let (_, v) = timed_volume(api, id, Duration::from_millis(2)).await?;
            volumes.push(v.id.clone());
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
