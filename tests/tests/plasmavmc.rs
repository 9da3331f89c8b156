//! PlasmaVMC against a real LightningStor and a real CoronaFS: images made by
//! qemu-img, every volume compared byte for byte with `qemu-img convert`, the
//! cache, refused images, imports, VM migration with fencing, bad input, and
//! the API against its OpenAPI description.

mod plasmavmc_common;

use plasmavmc_common::*;
use serde_json::{Value, json};
use std::path::Path;

fn s(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn images_are_probed_hashed_and_stored_in_lightningstor() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 1);
    let mut all = vec![("raw", raw.clone())];
    all.extend(make_qcow2_family(&dir, &raw));
    for (label, path) in all {
        let bytes = std::fs::read(&path).expect("read");
        let img = st.upload_ok(label, &path);
        assert_eq!(img["sha256"], sha256_hex(&bytes), "{label}");
        assert_eq!(img["size"], bytes.len() as u64, "{label}");
        assert_eq!(img["bytes_done"], bytes.len() as u64, "{label}");
        assert_eq!(img["virtual_size"], virtual_size(&path), "{label}");
        let fmt = if label == "raw" { "raw" } else { "qcow2" };
        assert_eq!(img["disk_format"], fmt, "{label}");
        // The artifact in LightningStor is exactly what was uploaded.
        let key = format!("images/{}", img["id"].as_str().expect("id"));
        let stored = st.rt.block_on(async {
            let o = st.s3.get_object().bucket("images").key(&key).send().await.expect("get object");
            o.body.collect().await.expect("body").into_bytes().to_vec()
        });
        assert!(stored == bytes, "{label}: stored object differs from the upload");
    }
    // An announced checksum that matches is accepted.
    let bytes = std::fs::read(&raw).expect("read");
    let (code, img) = st.upload("with-sha", &raw, json!({ "sha256": sha256_hex(&bytes), "disk_format": "raw" }));
    assert_eq!((code, img["status"].as_str()), (200, Some("active")), "{img}");
}

#[test]
fn every_volume_reads_back_exactly_like_qemu_img_convert() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 2);
    let mut all = vec![("raw", raw.clone())];
    all.extend(make_qcow2_family(&dir, &raw));
    for (label, path) in all {
        let fmt = if label == "raw" { "raw" } else { "qcow2" };
        let want = qemu_convert(&path, fmt);
        let img = st.upload_ok(label, &path);
        let id = img["id"].as_str().expect("id");
        // Cold: fetched, converted, written, snapshotted.
        let cold = st.create_volume(id, None);
        assert_eq!(cold["status"], "available", "{label}: {cold}");
        assert_eq!(cold["cache_hit"], false, "{label}");
        assert!(cold["nbd_uri"].as_str().is_some_and(|u| u.starts_with("nbd://")), "{cold}");
        assert_eq!(cold["bytes_done"], cold["bytes_total"], "{label}: {cold}");
        let got = st.read_export(cold["coronafs_volume"].as_str().expect("name"));
        assert_eq!(got.len(), want.len(), "{label}: size");
        assert!(got == want, "{label}: cold volume differs from qemu-img convert");
        // Warm, and larger than the image: a clone, same bytes, zero tail.
        let warm = st.create_volume(id, Some(want.len() as u64 + (1 << 20)));
        assert_eq!((warm["status"].as_str(), warm["cache_hit"].as_bool()), (Some("available"), Some(true)), "{warm}");
        let got = st.read_export(warm["coronafs_volume"].as_str().expect("name"));
        assert!(got[..want.len()] == want[..], "{label}: warm volume differs");
        assert!(got[want.len()..].iter().all(|b| *b == 0), "{label}: grown tail not zero");
    }
    assert_eq!(st.metric("plasmavmc_cache_misses_total"), 5);
    assert_eq!(st.metric("plasmavmc_cache_hits_total"), 5);
}

#[test]
fn concurrent_creates_fetch_an_image_once_and_clones_are_independent() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 3);
    let q = dir.join("c.qcow2");
    qemu_img(&["convert", "-c", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&q)]);
    let size = std::fs::metadata(&q).expect("stat").len();
    let img = st.upload_ok("c", &q);
    let id = img["id"].as_str().expect("id");
    let ids: Vec<String> = (0..4)
        .map(|_| {
            let (code, v) = st.call("POST", "/v1/volumes", Some(json!({ "image_id": id })));
            assert_eq!(code, 202, "{v}");
            v["id"].as_str().expect("id").to_owned()
        })
        .collect();
    let vols: Vec<Value> = ids.iter().map(|i| st.wait_volume(i)).collect();
    assert!(vols.iter().all(|v| v["status"] == "available"), "{vols:?}");
    assert_eq!(st.metric("plasmavmc_cache_misses_total"), 1, "one fill for four requests");
    assert_eq!(st.metric("plasmavmc_fill_bytes_fetched_total"), size, "the artifact was fetched once");
    // Writes to one clone never show in another or in the base.
    let want = qemu_convert(&q, "qcow2");
    let addr = st.nbd_addr();
    let first = vols[0]["coronafs_volume"].as_str().expect("name").to_owned();
    st.rt.block_on(async {
        let c = coronafs::client::NbdClient::connect(addr, &first).await.expect("connect");
        c.write(0, &[0xee; 65536], true).await.expect("write");
        c.disconnect().await.ok();
    });
    assert!(st.read_export(&first)[..65536].iter().all(|b| *b == 0xee));
    for v in &vols[1..] {
        assert!(
            st.read_export(v["coronafs_volume"].as_str().expect("name")) == want,
            "clone changed by a sibling's write"
        );
    }
    let (code, cache) = st.call("GET", "/v1/cache", None);
    assert_eq!(code, 200);
    assert_eq!(cache["bases"].as_array().map(Vec::len), Some(1), "{cache}");
}

#[test]
fn the_cache_is_bounded_and_evicts_bases_without_clones_first() {
    let st = Stack::start_with(|c| c.cache_max_bases = 2);
    let dir = st.work();
    let mut imgs = Vec::new();
    for i in 0..3u64 {
        let p = make_raw(&dir, &format!("d{i}.raw"), 10 + i);
        imgs.push((st.upload_ok(&format!("d{i}"), &p)["id"].as_str().expect("id").to_owned(), p));
    }
    // Image 0 is used first but keeps a clone; image 1's only volume is deleted.
    let keep = st.create_volume(&imgs[0].0, None);
    let gone = st.create_volume(&imgs[1].0, None);
    let (code, _) = st.call("DELETE", &format!("/v1/volumes/{}", gone["id"].as_str().expect("id")), None);
    assert_eq!(code, 204);
    st.create_volume(&imgs[2].0, None);
    let (_, cache) = st.call("GET", "/v1/cache", None);
    let cached: Vec<&str> =
        cache["bases"].as_array().expect("bases").iter().filter_map(|b| b["image_id"].as_str()).collect();
    assert_eq!(cache["evictions"], 1, "{cache}");
    assert!(
        cached.contains(&imgs[0].0.as_str()) && cached.contains(&imgs[2].0.as_str()),
        "base with a clone kept, clone-less base evicted: {cache}"
    );
    // The evicted image misses again; bases with clones go once none are free,
    // and their clones keep their data.
    let v1 = st.create_volume(&imgs[1].0, None);
    assert_eq!(v1["cache_hit"], false);
    let (_, cache) = st.call("GET", "/v1/cache", None);
    assert_eq!(cache["bases"].as_array().map(Vec::len), Some(2), "{cache}");
    assert_eq!(cache["evictions"], 2);
    let want = std::fs::read(&imgs[0].1).expect("read");
    assert!(
        st.read_export(keep["coronafs_volume"].as_str().expect("name")) == want,
        "a clone lost data when its base was evicted"
    );
    assert_eq!(st.metric("plasmavmc_cache_evictions_total"), 2);
}

/// With the cache full, first-time creates of different images that finish
/// together used to wait on each other's fill lock during eviction (a base
/// just filled has no clones yet, so it ranks first as a victim) and stay
/// `downloading` forever; the same run evicted one base twice and left the
/// cache over its limit.
#[test]
fn concurrent_first_fills_of_many_images_with_a_small_cache_all_finish_and_respect_the_limit() {
    const IMAGES: usize = 8;
    const LIMIT: usize = 2;
    let st = Stack::start_with(|c| c.cache_max_bases = LIMIT);
    let dir = st.work();
    let imgs: Vec<(String, std::path::PathBuf)> = (0..IMAGES as u64)
        .map(|i| {
            let p = make_raw(&dir, &format!("m{i}.raw"), 40 + i);
            (st.upload_ok(&format!("m{i}"), &p)["id"].as_str().expect("id").to_owned(), p)
        })
        .collect();
    for round in 0..2 {
        // Every image at once, twice each, so fills finish together and evict each other.
        let ids: Vec<(usize, String)> = (0..2 * IMAGES)
            .map(|k| {
                let i = k % IMAGES;
                let (code, v) = st.call("POST", "/v1/volumes", Some(json!({ "image_id": imgs[i].0 })));
                assert_eq!(code, 202, "{v}");
                (i, v["id"].as_str().expect("id").to_owned())
            })
            .collect();
        let t0 = std::time::Instant::now();
        for (i, id) in &ids {
            let v = loop {
                let (_, v) = st.call("GET", &format!("/v1/volumes/{id}"), None);
                if !matches!(v["status"].as_str(), Some("creating" | "downloading")) {
                    break v;
                }
                assert!(
                    t0.elapsed() < std::time::Duration::from_secs(60),
                    "round {round}: volume stuck (deadlock?): {v}"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            };
            assert_eq!(v["status"], "available", "round {round}: {v}");
            let want = std::fs::read(&imgs[*i].1).expect("read");
            assert!(
                st.read_export(v["coronafs_volume"].as_str().expect("name")) == want,
                "round {round}: a clone of image {i} does not hold the image"
            );
        }
        let (_, cache) = st.call("GET", "/v1/cache", None);
        let bases = cache["bases"].as_array().map(Vec::len).unwrap_or(usize::MAX);
        assert!(bases <= LIMIT, "round {round}: cache over its limit: {cache}");
        let misses = st.metric("plasmavmc_cache_misses_total");
        let evictions = st.metric("plasmavmc_cache_evictions_total");
        assert_eq!(misses - evictions, bases as u64, "round {round}: every eviction removed a distinct base: {cache}");
        // CoronaFS holds exactly the cached bases.
        let corona = st.corona.as_ref().expect("running").volumes.list().expect("list");
        let base_vols = corona.iter().filter(|v| v.name.starts_with("base-")).count();
        assert_eq!(base_vols, bases, "round {round}: bases in CoronaFS vs the cache: {cache}");
    }
}

fn refused(st: &Stack, label: &str, path: &Path, extra: Value, needle: &str) {
    let (code, body) = st.upload(label, path, extra);
    assert_eq!(code, 400, "{label}: {body}");
    let msg = body["error"].as_str().unwrap_or_default();
    assert!(msg.contains(needle), "{label}: {msg:?} lacks {needle:?}");
    let (_, list) = st.call("GET", "/v1/images", None);
    let img = list.as_array().expect("list").iter().find(|i| i["name"] == label).cloned().expect("record");
    assert_eq!(img["status"], "error", "{label}: {img}");
    assert!(img["error_reason"].as_str().is_some_and(|r| r.contains(needle)), "{img}");
}

fn patch(src: &Path, dst: &Path, at: usize, bytes: &[u8]) {
    let mut b = std::fs::read(src).expect("read");
    b[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(dst, b).expect("write");
}

#[test]
fn refused_images_end_in_error_with_a_clear_reason() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 4);
    let good = dir.join("good.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&good)]);
    let backed = dir.join("backed.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-b", &s(&good), "-F", "qcow2", &s(&backed)]);
    refused(&st, "backing", &backed, Value::Null, "backing file");
    let datafile = dir.join("datafile.qcow2");
    qemu_img(&["create", "-f", "qcow2", "-o", &format!("data_file={}", s(&dir.join("ext.raw"))), &s(&datafile), "16M"]);
    refused(&st, "external-data", &datafile, Value::Null, "external data file");
    let vmdk = dir.join("disk.vmdk");
    qemu_img(&["convert", "-f", "raw", "-O", "vmdk", &s(&raw), &s(&vmdk)]);
    refused(&st, "vmdk", &vmdk, Value::Null, "VMDK");
    let cases: [(&str, usize, &[u8], &str); 5] = [
        ("bad-version", 4, &7u32.to_be_bytes(), "version 7"),
        ("bad-cluster-bits", 20, &30u32.to_be_bytes(), "cluster_bits"),
        ("absurd-size", 24, &(1u64 << 62).to_be_bytes(), "larger than the allowed"),
        ("l1-past-end", 40, &(1u64 << 40).to_be_bytes(), "past the end"),
        ("encrypted", 32, &1u32.to_be_bytes(), "encrypted"),
    ];
    for (label, at, bytes, needle) in cases {
        let p = dir.join(format!("{label}.qcow2"));
        patch(&good, &p, at, bytes);
        refused(&st, label, &p, Value::Null, needle);
    }
    let trunc = dir.join("truncated.qcow2");
    std::fs::write(&trunc, &std::fs::read(&good).expect("read")[..90]).expect("write");
    refused(&st, "truncated", &trunc, Value::Null, "truncated");
    refused(&st, "declared-raw", &good, json!({ "disk_format": "raw" }), "declared raw");
    refused(&st, "checksum", &raw, json!({ "sha256": "00".repeat(32) }), "sha256 mismatch");
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").expect("write");
    refused(&st, "empty", &empty, Value::Null, "empty");
    // Refused uploads leave no multipart uploads behind.
    let open = st.rt.block_on(async { st.s3.list_multipart_uploads().bucket("images").send().await.expect("list") });
    assert!(open.uploads().is_empty(), "aborted uploads left parts: {:?}", open.uploads());
    // And the server still serves.
    st.upload_ok("after", &good);
}

#[test]
fn an_l2_table_past_the_end_fails_the_volume_not_the_server() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 5);
    let good = dir.join("good.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&good)]);
    let bytes = std::fs::read(&good).expect("read");
    let l1 = u64::from_be_bytes(bytes[40..48].try_into().expect("8")) as usize;
    let bad = dir.join("l2-past-end.qcow2");
    patch(&good, &bad, l1, &(0x8000_0000_0000_0000u64 | (1u64 << 36)).to_be_bytes());
    let img = st.upload_ok("l2", &bad); // the header is fine; the table is not
    let v = st.create_volume(img["id"].as_str().expect("id"), None);
    assert_eq!(v["status"], "error", "{v}");
    assert!(v["error_reason"].as_str().is_some_and(|r| r.contains("L2 table")), "{v}");
    // A data cluster past the end of the file: found while converting.
    let l2 = (u64::from_be_bytes(bytes[l1..l1 + 8].try_into().expect("8")) & 0x00ff_ffff_ffff_fe00) as usize;
    let bad = dir.join("data-past-end.qcow2");
    patch(&good, &bad, l2, &(0x8000_0000_0000_0000u64 | (1u64 << 36)).to_be_bytes());
    let img = st.upload_ok("data", &bad);
    let v = st.create_volume(img["id"].as_str().expect("id"), None);
    assert_eq!(v["status"], "error", "{v}");
    assert!(v["error_reason"].as_str().is_some_and(|r| r.contains("past the end")), "{v}");
    let img = st.upload_ok("good", &good);
    let v = st.create_volume(img["id"].as_str().expect("id"), None);
    assert_eq!(v["status"], "available", "{v}");
}

/// A qcow2 cut short inside its last data run: the run starts inside the
/// file but ends past it. That used to be accepted, the missing bytes
/// becoming zeros in the volume.
#[test]
fn a_qcow2_truncated_inside_its_last_data_run_fails_the_volume() {
    let st = Stack::start();
    let dir = st.work();
    let raw = make_raw(&dir, "disk.raw", 6);
    let good = dir.join("good.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&good)]);
    let bytes = std::fs::read(&good).expect("read");
    // The disk ends with 64 KiB of data, so the file ends with a data cluster.
    let map = qemu_img(&["map", "--output=json", "-f", "qcow2", &s(&good)]);
    let last_data: Value = serde_json::from_str::<Value>(&map)
        .expect("map json")
        .as_array()
        .expect("array")
        .iter()
        .rfind(|e| e["data"] == true)
        .cloned()
        .expect("a data run");
    let host_end = last_data["offset"].as_u64().expect("offset") + last_data["length"].as_u64().expect("length");
    assert_eq!(host_end as usize, bytes.len(), "the last data run ends the file: {last_data}");
    let cut = dir.join("cut.qcow2");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).expect("write");
    let img = st.upload_ok("cut", &cut); // headers and tables are all inside the file
    let v = st.create_volume(img["id"].as_str().expect("id"), None);
    assert_eq!(v["status"], "error", "{v}");
    assert!(v["error_reason"].as_str().is_some_and(|r| r.contains("past the end")), "{v}");
    let img = st.upload_ok("good", &good);
    assert_eq!(st.create_volume(img["id"].as_str().expect("id"), None)["status"], "available");
}

/// Serves one file over plain HTTP/1.0 on loopback, for `n` requests.
fn serve_file(bytes: Vec<u8>, n: usize) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for _ in 0..n {
            let Ok((mut c, _)) = l.accept() else { return };
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf);
            let _ = write!(c, "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n", bytes.len());
            let _ = c.write_all(&bytes);
        }
    });
    addr
}

fn wait_image(st: &Stack, id: &str) -> Value {
    let t0 = std::time::Instant::now();
    loop {
        let (_, v) = st.call("GET", &format!("/v1/images/{id}"), None);
        if v["status"] != "importing" {
            return v;
        }
        assert!(t0.elapsed().as_secs() < 60, "import stuck: {v}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn imports_come_from_s3_objects_and_filtered_urls() {
    let dir = tempfile::tempdir().expect("tmp");
    let raw = make_raw(dir.path(), "disk.raw", 6);
    let q = dir.path().join("i.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&q)]);
    let bytes = std::fs::read(&q).expect("read");
    // Default config: loopback URLs are refused, S3 imports work.
    let st = Stack::start();
    st.rt.block_on(async {
        st.s3.create_bucket().bucket("incoming").send().await.expect("bucket");
        st.s3.put_object().bucket("incoming").key("i.qcow2").body(bytes.clone().into()).send().await.expect("put");
    });
    let (code, img) = st.call(
        "POST",
        "/v1/images",
        Some(json!({ "name": "s3", "import_s3": { "bucket": "incoming", "key": "i.qcow2" } })),
    );
    assert_eq!(code, 202, "{img}");
    let img = wait_image(&st, img["id"].as_str().expect("id"));
    assert_eq!(img["status"], "active", "{img}");
    assert_eq!(img["sha256"], sha256_hex(&bytes));
    let v = st.create_volume(img["id"].as_str().expect("id"), None);
    assert!(st.read_export(v["coronafs_volume"].as_str().expect("name")) == qemu_convert(&q, "qcow2"));
    let addr = serve_file(bytes.clone(), 1);
    let (code, img) =
        st.call("POST", "/v1/images", Some(json!({ "name": "lo", "import_url": format!("http://{addr}/i.qcow2") })));
    assert_eq!(code, 202, "{img}");
    let img = wait_image(&st, img["id"].as_str().expect("id"));
    assert_eq!(img["status"], "error");
    assert!(img["error_reason"].as_str().is_some_and(|r| r.contains("loopback")), "{img}");
    for bad in ["file:///etc/passwd", "ftp://example.com/x", "http://user:pw@example.com/x"] {
        let (code, body) = st.call("POST", "/v1/images", Some(json!({ "name": "bad", "import_url": bad })));
        assert_eq!(code, 400, "{bad}: {body}");
    }
    drop(st);
    // Allowed by config: the import streams and the checksum is checked.
    let st = Stack::start_with(|c| c.allow_private_urls = true);
    let addr = serve_file(bytes.clone(), 2);
    let (_, img) = st.call(
        "POST",
        "/v1/images",
        Some(json!({ "name": "ok", "import_url": format!("http://{addr}/i.qcow2"), "sha256": sha256_hex(&bytes) })),
    );
    let img = wait_image(&st, img["id"].as_str().expect("id"));
    assert_eq!((img["status"].as_str(), img["disk_format"].as_str()), (Some("active"), Some("qcow2")), "{img}");
    let (_, img) = st.call(
        "POST",
        "/v1/images",
        Some(json!({ "name": "wrong", "import_url": format!("http://{addr}/i.qcow2"), "sha256": "ab".repeat(32) })),
    );
    let img = wait_image(&st, img["id"].as_str().expect("id"));
    assert_eq!(img["status"], "error");
    assert!(img["error_reason"].as_str().is_some_and(|r| r.contains("sha256 mismatch")), "{img}");
}

#[test]
fn a_client_vanishing_mid_upload_leaves_an_error_and_the_server_serving() {
    let st = Stack::start();
    let (_, img) = st.call("POST", "/v1/images", Some(json!({ "name": "cut" })));
    let id = img["id"].as_str().expect("id").to_owned();
    let addr = st.url.trim_start_matches("http://").to_owned();
    // Announce 64 MiB, send 12 MiB, hang up.
    {
        use std::io::Write;
        let mut c = std::net::TcpStream::connect(&addr).expect("connect");
        write!(c, "PUT /v1/images/{id}/file HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", 64u64 << 20)
            .expect("head");
        c.write_all(&stack_tests::pattern(12 << 20, 9)).expect("body");
    }
    let t0 = std::time::Instant::now();
    let img = loop {
        let (_, v) = st.call("GET", &format!("/v1/images/{id}"), None);
        if v["status"] == "error" {
            break v;
        }
        assert!(t0.elapsed().as_secs() < 30, "upload never failed: {v}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(img["bytes_done"].as_u64().is_some_and(|d| d > 0 && d < 64 << 20), "{img}");
    let open = st.rt.block_on(async { st.s3.list_multipart_uploads().bucket("images").send().await.expect("list") });
    assert!(open.uploads().is_empty(), "the multipart upload was not aborted");
    let dir = st.work();
    st.upload_ok("next", &make_raw(&dir, "n.raw", 7));
}

/// A client that stops sending but keeps its connection open used to leave
/// the image `uploading` forever (and DELETE answered 409).
#[test]
fn a_stalled_upload_times_out_and_the_image_can_be_deleted() {
    let st = Stack::start_with(|c| c.upload_idle_timeout_secs = 2);
    let (_, img) = st.call("POST", "/v1/images", Some(json!({ "name": "stalled" })));
    let id = img["id"].as_str().expect("id").to_owned();
    let addr = st.url.trim_start_matches("http://").to_owned();
    use std::io::Write;
    let mut c = std::net::TcpStream::connect(&addr).expect("connect");
    write!(c, "PUT /v1/images/{id}/file HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", 64u64 << 20).expect("head");
    c.write_all(&stack_tests::pattern(7 << 20, 9)).expect("body");
    // ... and then nothing, with the connection held open.
    let t0 = std::time::Instant::now();
    let img = loop {
        let (_, v) = st.call("GET", &format!("/v1/images/{id}"), None);
        if v["status"] != "uploading" {
            break v;
        }
        assert!(t0.elapsed().as_secs() < 20, "a stalled upload stays uploading: {v}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert_eq!(img["status"], "error", "{img}");
    assert!(img["error_reason"].as_str().is_some_and(|r| r.contains("nothing for 2 s")), "{img}");
    let open = st.rt.block_on(async { st.s3.list_multipart_uploads().bucket("images").send().await.expect("list") });
    assert!(open.uploads().is_empty(), "the multipart upload was not aborted");
    let (code, body) = st.call("DELETE", &format!("/v1/images/{id}"), None);
    assert_eq!(code, 204, "{body}");
    drop(c);
}

/// What a crash can leave of an image (a multipart upload of its key, a
/// conversion scratch file) goes when the image is deleted.
#[test]
fn deleting_an_image_removes_its_multipart_uploads_and_scratch_file() {
    let st = Stack::start();
    let (_, img) = st.call("POST", "/v1/images", Some(json!({ "name": "left" })));
    let id = img["id"].as_str().expect("id").to_owned();
    // The leftovers of a crashed upload and a crashed fill of image `id`.
    st.rt.block_on(async {
        let key = format!("images/{id}");
        let mp = st.s3.create_multipart_upload().bucket("images").key(&key).send().await.expect("create");
        let upload_id = mp.upload_id().expect("upload id");
        st.s3
            .upload_part()
            .bucket("images")
            .key(&key)
            .upload_id(upload_id)
            .part_number(1)
            .body(vec![7u8; 5 << 20].into())
            .send()
            .await
            .expect("part");
    });
    let scratch = st.dir.path().join("vmc").join("scratch");
    std::fs::create_dir_all(&scratch).expect("mkdir");
    std::fs::write(scratch.join(format!("{id}.qcow2")), b"half a fill").expect("write");
    let (code, body) = st.call("DELETE", &format!("/v1/images/{id}"), None);
    assert_eq!(code, 204, "{body}");
    let open = st.rt.block_on(async { st.s3.list_multipart_uploads().bucket("images").send().await.expect("list") });
    assert!(open.uploads().is_empty(), "the image's multipart upload stayed: {:?}", open.uploads());
    assert!(!scratch.join(format!("{id}.qcow2")).exists(), "the image's scratch file stayed");
}

#[test]
fn bad_requests_get_clear_errors() {
    let st = Stack::start();
    let cases: Vec<(&str, &str, Value, u16, &str)> = vec![
        ("POST", "/v1/images", json!({ "name": "" }), 400, "name"),
        ("POST", "/v1/images", json!({ "name": "x", "bogus": 1 }), 400, "bogus"),
        ("POST", "/v1/images", json!({ "name": "x", "sha256": "xyz" }), 400, "64 hex"),
        ("POST", "/v1/images", json!({ "name": "x", "disk_format": "vhd" }), 400, "disk_format"),
        ("POST", "/v1/images", json!({ "name": "x", "import_url": "gopher://a/b" }), 400, "scheme"),
        ("POST", "/v1/volumes", json!({ "image_id": "img-nope" }), 404, "not found"),
        ("POST", "/v1/volumes", json!({ "size": 5 }), 400, "image_id"),
        ("POST", "/v1/vms", json!({ "volume_id": "vol-nope", "worker": "w1" }), 404, "not found"),
        ("POST", "/v1/vms", json!({ "volume_id": "v", "worker": "bad worker!" }), 400, "worker"),
        ("GET", "/v1/nothing", Value::Null, 404, "not found"),
    ];
    for (m, p, b, code, needle) in cases {
        let (got, body) = st.call(m, p, if b.is_null() { None } else { Some(b.clone()) });
        assert_eq!(got, code, "{m} {p} {b}: {body}");
        assert!(body["error"].as_str().is_some_and(|e| e.contains(needle)), "{m} {p}: {body} lacks {needle:?}");
    }
    let (code, body) = st.raw_call("POST", "/v1/images", b"{not json".to_vec(), "application/json");
    assert_eq!(code, 400, "{body}");
    // State rules: a second upload, a volume smaller than the image, an
    // image delete while a volume uses it.
    let dir = st.work();
    let img = st.upload_ok("x", &make_raw(&dir, "x.raw", 8));
    let id = img["id"].as_str().expect("id");
    let (code, body) = st.raw_call("PUT", &format!("/v1/images/{id}/file"), vec![1, 2, 3], "application/octet-stream");
    assert_eq!(code, 409, "{body}");
    let (code, body) = st.call("POST", "/v1/volumes", Some(json!({ "image_id": id, "size": 4096 })));
    assert_eq!(code, 400, "{body}");
    let v = st.create_volume(id, None);
    let (code, body) = st.call("DELETE", &format!("/v1/images/{id}"), None);
    assert_eq!(code, 409, "{body}");
    let (code, _) = st.call("DELETE", &format!("/v1/volumes/{}", v["id"].as_str().expect("id")), None);
    assert_eq!(code, 204);
    let (code, body) = st.call("DELETE", &format!("/v1/images/{id}"), None);
    assert_eq!(code, 204, "{body}");
    let (code, _) = st.call("GET", &format!("/v1/images/{id}"), None);
    assert_eq!(code, 404);
    let (code, _) = st.call("GET", "/healthz", None);
    assert_eq!(code, 200);
}

#[test]
fn a_migrated_vm_keeps_every_acknowledged_write_and_its_old_source_cannot_write() {
    let st = Stack::start();
    let dir = st.work();
    let img = st.upload_ok("vm", &make_raw(&dir, "vm.raw", 11));
    let vol = st.create_volume(img["id"].as_str().expect("id"), None);
    let name = vol["coronafs_volume"].as_str().expect("name").to_owned();
    let (code, vm) =
        st.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "w1", "io_ops": 20000 })));
    assert_eq!(code, 201, "{vm}");
    let id = vm["id"].as_str().expect("id").to_owned();
    let app = st.app().clone();
    let source = st.rt.block_on(app.workers.attachment("w1", &id)).expect("attached");
    assert_eq!((source.worker.as_str(), source.epoch), ("w1", 1));
    // Migrate while the guest is writing.
    while st.call("GET", &format!("/v1/vms/{id}"), None).1["writes_acked"].as_u64().unwrap_or(0) < 50 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let (code, moved) = st.call("POST", &format!("/v1/vms/{id}/migrate"), Some(json!({ "worker": "w2" })));
    assert_eq!(code, 200, "{moved}");
    assert_eq!((moved["worker"].as_str(), moved["epoch"].as_u64()), (Some("w2"), Some(2)), "{moved}");
    let log_at_switch = moved["verified_blocks"].as_u64().expect("verified");
    assert!(log_at_switch > 0, "{moved}");
    assert!(moved["notice"].is_null(), "{moved}");
    // CoronaFS itself holds the fence: the stale source's write is refused
    // there (EPERM), reads still work, and the volume is at epoch 2.
    let before = st.rt.block_on(source.read(0, 65536)).expect("read");
    let e = st.rt.block_on(source.write(0, &[0x5a; 65536])).unwrap_err();
    assert!(matches!(&e, plasmavmc::PlasmaError::Fenced { held: 1, .. }), "{e}");
    assert!(e.to_string().contains("fenced at epoch 2"), "{e}");
    assert_eq!(st.rt.block_on(source.read(0, 65536)).expect("read"), before);
    assert!(st.metric("plasmavmc_fenced_writes_total") >= 1);
    let info = st.rt.block_on(app.corona.get(&name)).expect("volume info");
    assert_eq!(info.epoch, 2);
    // Independently of the server's own check: every block the guest had
    // acknowledged holds its last write, read on a fresh connection.
    let target = st.rt.block_on(app.workers.attachment("w2", &id)).expect("attached");
    st.rt.block_on(target.wait_idle());
    let log = target.log();
    assert!(log.len() as u64 >= log_at_switch);
    let disk = st.read_export(&name);
    for (block, seq) in &log {
        let at = (*block * plasmavmc::vms::BLOCK) as usize;
        assert_eq!(
            plasmavmc::vms::written_seq(&id, *block, &disk[at..at + 65536]),
            Some(*seq),
            "block {block} lost write {seq}"
        );
    }
    assert_eq!((target.worker.as_str(), target.epoch), ("w2", 2));
    st.rt.block_on(target.write(0, &[1; 65536])).expect("target writes");
    // Same worker again is refused; the volume cannot be deleted while attached.
    let (code, _) = st.call("POST", &format!("/v1/vms/{id}/migrate"), Some(json!({ "worker": "w2" })));
    assert_eq!(code, 400);
    let (code, _) = st.call("DELETE", &format!("/v1/volumes/{}", vol["id"].as_str().expect("id")), None);
    assert_eq!(code, 409);
    let (code, _) = st.call("DELETE", &format!("/v1/vms/{id}"), None);
    assert_eq!(code, 204);
    let e = st.rt.block_on(target.write(0, &[2; 65536])).unwrap_err();
    assert!(matches!(e, plasmavmc::PlasmaError::Fenced { held: 2, .. }), "a deleted VM's attachment still wrote: {e}");
}

/// `writes_acked` counts the writes of every attachment the VM had; it used
/// to restart from the target's count after each migration.
#[test]
fn writes_acked_counts_every_attachment_across_migrations() {
    let st = Stack::start();
    let dir = st.work();
    let img = st.upload_ok("acked", &make_raw(&dir, "acked.raw", 12));
    let vol = st.create_volume(img["id"].as_str().expect("id"), None);
    let (code, vm) =
        st.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "w1", "io_ops": 2000 })));
    assert_eq!(code, 201, "{vm}");
    let id = vm["id"].as_str().expect("id").to_owned();
    let acked = || st.call("GET", &format!("/v1/vms/{id}"), None).1["writes_acked"].as_u64().unwrap_or(0);
    let wait_above = |floor: u64, what: &str| {
        let t0 = std::time::Instant::now();
        loop {
            let n = acked();
            assert!(n >= floor, "{what}: writes_acked went back from {floor} to {n}");
            if n > floor {
                return n;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(30), "{what}: no write acknowledged");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    let t0 = std::time::Instant::now();
    while acked() < 100 {
        assert!(t0.elapsed() < std::time::Duration::from_secs(30), "the guest on w1 made no progress");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut floor = acked();
    for to in ["w2", "w1", "w2"] {
        let (code, moved) = st.call("POST", &format!("/v1/vms/{id}/migrate"), Some(json!({ "worker": to })));
        assert_eq!(code, 200, "{moved}");
        let at_switch = moved["writes_acked"].as_u64().expect("writes_acked");
        assert!(at_switch >= floor, "migrating to {to}: {at_switch} < {floor} acknowledged before");
        floor = wait_above(at_switch, &format!("after migrating to {to}"));
    }
}

#[test]
fn the_api_matches_its_openapi_description() {
    let st = Stack::start();
    let (code, doc) = st.call("GET", "/openapi.json", None);
    assert_eq!(code, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    // Every route the router serves is documented, and vice versa.
    let mut documented = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("item").keys() {
            assert!(
                plasmavmc::api::ROUTES.contains(&(method.as_str(), path.as_str())),
                "{method} {path} documented but not routed"
            );
            documented += 1;
        }
    }
    assert_eq!(documented, plasmavmc::api::ROUTES.len());
    for (method, path) in plasmavmc::api::ROUTES {
        assert!(doc["paths"][path][method].is_object(), "{method} {path} not documented");
        // Routed: a bogus id gets the resource's 404, not the fallback's.
        if path.contains("{id}") && *method != "put" && *method != "post" {
            let (code, body) = st.call(&method.to_uppercase(), &path.replace("{id}", "nope"), None);
            assert_eq!(code, 404, "{method} {path}");
            assert!(
                !body["error"].as_str().unwrap_or_default().contains("route"),
                "{method} {path} hit the fallback: {body}"
            );
        }
    }
    // Real responses validate against the documented schemas.
    let schema = |p: &str, m: &str, code: &str| {
        doc["paths"][p][m]["responses"][code]["content"]["application/json"]["schema"].clone()
    };
    let dir = st.work();
    let img = st.upload_ok("api", &make_raw(&dir, "a.raw", 12));
    validate(&doc, &schema("/v1/images/{id}/file", "put", "200"), &img, "upload").expect("image schema");
    let (_, created) = st.call("POST", "/v1/images", Some(json!({ "name": "q" })));
    validate(&doc, &schema("/v1/images", "post", "201"), &created, "create image").expect("schema");
    let (_, list) = st.call("GET", "/v1/images", None);
    validate(&doc, &schema("/v1/images", "get", "200"), &list, "images").expect("schema");
    let (code, vol) = st.call("POST", "/v1/volumes", Some(json!({ "image_id": img["id"] })));
    assert_eq!(code, 202);
    validate(&doc, &schema("/v1/volumes", "post", "202"), &vol, "create volume").expect("schema");
    let vol = st.wait_volume(vol["id"].as_str().expect("id"));
    validate(&doc, &schema("/v1/volumes/{id}", "get", "200"), &vol, "volume").expect("schema");
    let (_, vols) = st.call("GET", "/v1/volumes", None);
    validate(&doc, &schema("/v1/volumes", "get", "200"), &vols, "volumes").expect("schema");
    let (_, vm) = st.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "a" })));
    validate(&doc, &schema("/v1/vms", "post", "201"), &vm, "vm").expect("schema");
    let (_, vm) =
        st.call("POST", &format!("/v1/vms/{}/migrate", vm["id"].as_str().expect("id")), Some(json!({ "worker": "b" })));
    validate(&doc, &schema("/v1/vms/{id}/migrate", "post", "200"), &vm, "migrated").expect("schema");
    let (_, vms) = st.call("GET", "/v1/vms", None);
    validate(&doc, &schema("/v1/vms", "get", "200"), &vms, "vms").expect("schema");
    let (_, cache) = st.call("GET", "/v1/cache", None);
    validate(&doc, &schema("/v1/cache", "get", "200"), &cache, "cache").expect("schema");
    let (code, err) = st.call("GET", "/v1/volumes/nope", None);
    assert_eq!(code, 404);
    let err_schema =
        doc["paths"]["/v1/volumes/{id}"]["get"]["responses"]["default"]["content"]["application/json"]["schema"]
            .clone();
    validate(&doc, &err_schema, &err, "error").expect("error schema");
    // The validator itself rejects what it should.
    assert!(validate(&doc, &schema("/v1/volumes/{id}", "get", "200"), &json!({ "id": 1 }), "bad").is_err());
}

fn median_spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Figures for the report, not a pass/fail test: `cargo test --release -p
/// stack-tests --test plasmavmc -- --ignored --nocapture measure`.
#[test]
#[ignore = "measurement; run by hand"]
fn measure_create_image_and_volume_times() {
    let st = Stack::start();
    let dir = st.work();
    // CreateImage throughput: 256 MiB artifact, 3 runs.
    let big = dir.join("big.raw");
    std::fs::write(&big, stack_tests::pattern(256 << 20, 77)).expect("write");
    let mut rates = Vec::new();
    for i in 0..3 {
        let t0 = std::time::Instant::now();
        st.upload_ok(&format!("big{i}"), &big);
        rates.push(256.0 / t0.elapsed().as_secs_f64());
    }
    let (m, lo, hi) = median_spread(rates);
    println!("CreateImage 256 MiB: median {m:.0} MiB/s (min {lo:.0}, max {hi:.0})");
    // Cold CreateVolume vs artifact size (qcow2 with data).
    for mib in [32u64, 128, 256] {
        let raw = dir.join(format!("c{mib}.raw"));
        std::fs::write(&raw, stack_tests::pattern((mib << 20) as usize, mib)).expect("write");
        let q = dir.join(format!("c{mib}.qcow2"));
        qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(&raw), &s(&q)]);
        let size = std::fs::metadata(&q).expect("stat").len();
        let mut times = Vec::new();
        for i in 0..3 {
            let img = st.upload_ok(&format!("c{mib}-{i}"), &q);
            let t0 = std::time::Instant::now();
            let v = st.create_volume(img["id"].as_str().expect("id"), None);
            assert_eq!(v["cache_hit"], false);
            times.push(t0.elapsed().as_secs_f64());
        }
        let (m, lo, hi) = median_spread(times);
        println!(
            "cold CreateVolume qcow2 artifact {:.0} MiB: median {m:.3} s (min {lo:.3}, max {hi:.3}) = {:.0} MiB/s",
            size as f64 / 1048576.0,
            size as f64 / 1048576.0 / m
        );
    }
    // Warm CreateVolume p50 by virtual size.
    for gib in [1u64, 4, 16] {
        let q = dir.join(format!("w{gib}.qcow2"));
        qemu_img(&["create", "-f", "qcow2", &s(&q), &format!("{gib}G")]);
        qemu_io(&[
            "-f",
            "qcow2",
            "-c",
            "write -P 0x11 0 16M",
            "-c",
            &format!("write -P 0x22 {}M 16M", gib * 1024 - 16),
            &s(&q),
        ]);
        let img = st.upload_ok(&format!("w{gib}"), &q);
        let id = img["id"].as_str().expect("id");
        let t0 = std::time::Instant::now();
        st.create_volume(id, None);
        let cold = t0.elapsed().as_secs_f64();
        let mut times = Vec::new();
        for _ in 0..21 {
            let t0 = std::time::Instant::now();
            let v = st.create_volume(id, None);
            assert_eq!(v["cache_hit"], true);
            times.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
        let (m, lo, hi) = median_spread(times);
        println!("warm CreateVolume {gib} GiB virtual: p50 {m:.1} ms (min {lo:.1}, max {hi:.1}); cold was {cold:.2} s");
    }
}
