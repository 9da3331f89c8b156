//! CoronaFS volumes end to end: the control API and its error cases,
//! snapshots and clones seen by real NBD clients (qemu-img compare, nbdinfo
//! --map), resize on reconnect, and kill -9 in the middle of snapshot, clone,
//! resize and delete.

use coronafs::api_client::ApiClient;
use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use coronafs::volume::Volumes;
use serde_json::{Value, json};
use stack_tests::{Corona, CoronaProc, pattern, require, run};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// One raw call to the control API: status and JSON body (Null when empty).
/// For the contract itself (field names, bodies and queries the typed
/// client cannot send); everything else goes through `ApiClient`.
async fn api(base: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let http = reqwest::Client::new();
    let url = format!("{base}{path}");
    let req = match method {
        "GET" => http.get(url),
        "POST" => http.post(url),
        "DELETE" => http.delete(url),
        _ => unreachable!("method {method}"),
    };
    let req = match body {
        Some(b) => req.json(&b),
        None => req,
    };
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("body");
    let v = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("JSON body") };
    (status, v)
}

#[test]
fn the_api_follows_the_contract_and_answers_every_error_case() {
    let _gate = crate::gate::shared();
    let c = Corona::start(IoEngine::Threads);
    let base = c.srv().api_url();
    c.rt.block_on(async {
        let (s, v) = api(&base, "POST", "/v1/volumes", Some(json!({"name": "img", "size": 8 * MIB}))).await;
        assert_eq!(s, 201, "{v}");
        for key in ["name", "size", "allocated_bytes", "parent", "snapshots", "connections", "read_only", "nbd_export"] {
            assert!(v.get(key).is_some(), "VolumeInfo lacks {key}: {v}");
        }
        assert_eq!(v["parent"], Value::Null);
        let (s, snap) = api(&base, "POST", "/v1/volumes/img/snapshots", Some(json!({"name": "gold"}))).await;
        assert_eq!(s, 201, "{snap}");
        assert_eq!(snap, json!({"volume": "img", "name": "gold", "size": 8 * MIB, "allocated_bytes": 0, "clones": [], "nbd_export": "img@gold"}));
        let (s, vm) = api(&base, "POST", "/v1/volumes", Some(json!({"name": "vm", "from_snapshot": "img@gold"}))).await;
        assert_eq!((s, vm["parent"].as_str(), vm["size"].as_u64()), (201, Some("img@gold"), Some(8 * MIB)));
        let (_, list) = api(&base, "GET", "/v1/volumes/img/snapshots", None).await;
        assert_eq!(list[0]["clones"], json!(["vm"]));
        let (_, img) = api(&base, "GET", "/v1/volumes/img", None).await;
        assert_eq!(img["snapshots"], json!(["gold"]));
        let cases: Vec<(&str, &str, Option<Value>, u16, &str)> = vec![
            ("POST", "/v1/volumes", Some(json!({"name": "img", "size": 4096})), 409, "already exists"),
            ("POST", "/v1/volumes", Some(json!({"name": "../etc", "size": 4096})), 400, "invalid volume name"),
            ("POST", "/v1/volumes", Some(json!({"name": &"x".repeat(129), "size": 4096})), 400, "longer than 128"),
            ("POST", "/v1/volumes", Some(json!({"name": "a", "size": 0})), 400, "invalid size"),
            ("POST", "/v1/volumes", Some(json!({"name": "a"})), 400, "size is required"),
            ("POST", "/v1/volumes", Some(json!({"name": "a", "size": 1, "colour": "red"})), 400, "unknown field"),
            ("POST", "/v1/volumes", Some(json!({"name": "a", "from_snapshot": "img@nope"})), 404, "not found"),
            ("POST", "/v1/volumes", Some(json!({"name": "a", "from_snapshot": "img"})), 400, "VOLUME@SNAPSHOT"),
            ("POST", "/v1/volumes", Some(json!({"name": "a", "from_snapshot": "img@gold", "size": 4096})), 400, "smaller"),
            ("GET", "/v1/volumes/nope", None, 404, "not found"),
            ("GET", "/v1/volumes/a@b", None, 400, "invalid volume name"),
            ("DELETE", "/v1/volumes/img", None, 409, "has clones (vm)"),
            ("DELETE", "/v1/volumes/img?force=maybe", None, 400, "bad query"),
            ("DELETE", "/v1/volumes/nope", None, 404, "not found"),
            ("DELETE", "/v1/volumes/img/snapshots/gold", None, 409, "has clones"),
            ("DELETE", "/v1/volumes/img/snapshots/nope", None, 404, "not found"),
            ("POST", "/v1/volumes/img/snapshots", Some(json!({"name": "gold"})), 409, "already exists"),
            ("POST", "/v1/volumes/img/snapshots", Some(json!({"name": "a/b"})), 400, "invalid volume name"),
            ("POST", "/v1/volumes/nope/snapshots", Some(json!({"name": "s"})), 404, "not found"),
            ("GET", "/v1/volumes/nope/snapshots", None, 404, "not found"),
            ("POST", "/v1/volumes/img/resize", Some(json!({"size": 4096})), 400, "allow_shrink"),
            ("POST", "/v1/volumes/img/resize", Some(json!({"size": 0})), 400, "invalid size"),
            ("POST", "/v1/volumes/nope/resize", Some(json!({"size": 4096})), 404, "not found"),
            ("POST", "/v1/volumes/nope/flatten", None, 404, "not found"),
        ];
        for (method, path, body, status, needle) in cases {
            let (s, v) = api(&base, method, path, body.clone()).await;
            let msg = v["error"].as_str().unwrap_or_default();
            assert!(s == status && msg.contains(needle), "{method} {path} {body:?}: got {s} {v}, want {status} containing {needle:?}");
        }
        // In use: an open NBD connection blocks a plain delete.
        let nbd = NbdClient::connect(c.addr(), "vm").await.expect("connect");
        let (s, v) = api(&base, "DELETE", "/v1/volumes/vm", None).await;
        assert!(s == 409 && v["error"].as_str().unwrap_or_default().contains("in use"), "{v}");
        let (_, vm) = api(&base, "GET", "/v1/volumes/vm", None).await;
        assert_eq!(vm["connections"], 1);
        // Flatten detaches; then the snapshot and its volume can go.
        nbd.write(0, &[3; 4096], true).await.expect("write");
        let (s, vm) = api(&base, "POST", "/v1/volumes/vm/flatten", None).await;
        assert_eq!((s, &vm["parent"]), (200, &Value::Null));
        assert_eq!(api(&base, "DELETE", "/v1/volumes/img/snapshots/gold", None).await.0, 204);
        assert_eq!(api(&base, "DELETE", "/v1/volumes/img", None).await.0, 204);
        assert_eq!(nbd.read(0, 4096).await.expect("read after flatten"), vec![3; 4096]);
        assert_eq!(api(&base, "DELETE", "/v1/volumes/vm?force=true", None).await.0, 204);
        assert!(nbd.read(0, 4096).await.is_err(), "the connection of a deleted volume gets errors");
        let (s, list) = api(&base, "GET", "/v1/volumes", None).await;
        assert_eq!((s, list), (200, json!([])));
        let (s, doc) = api(&base, "GET", "/openapi.json", None).await;
        assert_eq!(s, 200);
        assert_eq!(doc["openapi"], "3.0.3");
        assert!(doc["paths"]["/v1/volumes/{name}/snapshots/{snap}"]["delete"].is_object());
    });
    c.srv().volumes.verify().expect("files match metadata");
}

#[test]
fn info_names_the_engine_and_file_system_and_evict_empties_the_page_cache_of_a_clone_and_its_parents() {
    let _gate = crate::gate::shared();
    let c = Corona::start(IoEngine::Threads);
    let base = c.srv().api_url();
    let client = ApiClient::new(&base);
    let fs_type = c.rt.block_on(async {
        let (s, v) = api(&base, "GET", "/v1/info", None).await;
        assert_eq!(s, 200, "{v}");
        for key in ["version", "engine", "data_dir", "fs", "o_direct", "note", "host"] {
            assert!(v.get(key).is_some(), "info lacks {key}: {v}");
        }
        let info = client.info().await.expect("typed info");
        assert_eq!(info.engine, IoEngine::Threads);
        assert_eq!(v["engine"], "threads");
        assert_ne!(info.fs.fs_type, "unknown", "{v}");
        assert!(c.dir.path().starts_with(&info.fs.mount_point), "{v}");
        assert!(!info.o_direct && info.note.contains("buffered"), "{v}");
        assert!(info.host.cpus >= 1 && info.host.kernel.starts_with("Linux"), "{v}");
        info.fs.fs_type
    });
    // tmpfs pages are the files themselves: there is nothing to drop.
    let droppable = fs_type != "tmpfs";
    let little = 256 << 10;
    c.create("img", 32 * MIB);
    let img_file = c.path("img");
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "img").await.expect("connect");
        n.write(0, &pattern(8 * MIB as usize, 5), false).await.expect("write");
        n.flush().await.expect("flush");
        let r = client.evict("img").await.expect("evict img");
        assert_eq!((r.volume.as_str(), r.files.len(), r.bytes), ("img", 1, 32 * MIB), "{r:?}");
        assert!(r.resident_before >= 8 * MIB, "written and flushed data is cached: {r:?}");
        if droppable {
            assert!(r.resident_after <= little, "{fs_type}: {r:?}");
        }
        // Dirty pages too: written, not flushed, then evicted.
        n.write(8 * MIB, &pattern(4 * MIB as usize, 6), false).await.expect("write");
        let r = client.evict("img").await.expect("evict dirty");
        assert!(r.resident_before >= 4 * MIB, "{r:?}");
        if droppable {
            assert!(r.resident_after <= little, "dirty pages are synced, then dropped ({fs_type}): {r:?}");
        }
        assert_eq!(
            n.read(0, 12 * MIB as usize).await.expect("read back"),
            [pattern(8 * MIB as usize, 5), pattern(4 * MIB as usize, 6)].concat()
        );
        n.disconnect().await.expect("disconnect");

        let e = &c.srv().volumes;
        e.snapshot("img", "gold").await.expect("snapshot");
        e.clone_snapshot("vm", "img@gold", None).await.expect("clone");
        let vm = NbdClient::connect(c.addr(), "vm").await.expect("connect vm");
        vm.write(0, &pattern(MIB as usize, 7), false).await.expect("write vm");
        // Reading the rest through the clone caches its parent's pages.
        assert_eq!(
            vm.read(MIB, 7 * MIB as usize).await.expect("read vm")[..],
            pattern(8 * MIB as usize, 5)[MIB as usize..]
        );
        vm.flush().await.expect("flush vm");
        let r = client.evict("vm").await.expect("evict vm");
        assert_eq!(r.files.len(), 3, "the clone's data and map, and its parent's data: {r:?}");
        assert!(r.files.contains(&img_file.display().to_string()), "the snapshot's layer is evicted too: {r:?}");
        assert!(r.files.iter().any(|f| f.ends_with(".map")), "{r:?}");
        assert!(r.resident_before >= 8 * MIB, "{r:?}");
        if droppable {
            assert!(r.resident_after <= little, "{fs_type}: {r:?}");
        }
        assert_eq!(vm.read(0, MIB as usize).await.expect("read after evict"), pattern(MIB as usize, 7));

        let (s, v) = api(&base, "POST", "/v1/volumes/nope/evict", None).await;
        assert!(s == 404 && v["error"].as_str().unwrap_or_default().contains("not found"), "{s} {v}");
        let (s, v) = api(&base, "POST", "/v1/volumes/img@gold/evict", None).await;
        assert!(s == 400 && v["error"].as_str().unwrap_or_default().contains("invalid volume name"), "{s} {v}");
        match client.evict("nope").await {
            Err(coronafs::CoronaError::Api { status: Some(404), message, .. }) => {
                assert!(message.contains("not found"))
            }
            other => panic!("evict of an unknown volume: {other:?}"),
        }
    });
}

fn clone_setup(c: &Corona) {
    c.create("img", 32 * MIB);
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "img").await.expect("connect");
        // Data in the first 4 MiB and at 16 MiB; the rest stays a hole.
        n.write(0, &pattern(4 * MIB as usize, 1), false).await.expect("write");
        n.write(16 * MIB, &pattern(MIB as usize, 2), false).await.expect("write");
        n.flush().await.expect("flush");
        let e = &c.srv().volumes;
        e.snapshot("img", "gold").await.expect("snapshot");
        e.clone_snapshot("vm", "img@gold", None).await.expect("clone");
    });
}

#[test]
fn qemu_img_compare_finds_a_clone_identical_to_its_snapshot_until_it_is_written() {
    let _gate = crate::gate::shared();
    require("qemu-img");
    let c = Corona::start(IoEngine::Uring);
    clone_setup(&c);
    let (clone, snap) = (c.uri("vm"), c.uri("img@gold"));
    let out = run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", &clone, &snap]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Images are identical"));
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "vm").await.expect("connect");
        n.write(20 * MIB + 12_345, b"changed", true).await.expect("write");
    });
    let out =
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", &clone, &snap]).output().expect("qemu-img");
    assert_eq!(out.status.code(), Some(1), "images must differ: {}", String::from_utf8_lossy(&out.stdout));
    // "Content mismatch at offset N!", N rounded down to qemu's sector.
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let at: u64 = text
        .split("offset ")
        .nth(1)
        .and_then(|t| t.trim_end().trim_end_matches('!').parse().ok())
        .unwrap_or_else(|| panic!("no offset in {text:?}"));
    assert!((20 * MIB + 12_345 - 4096..=20 * MIB + 12_345).contains(&at), "mismatch reported at {at}");
    // Writing the snapshot export is refused.
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &snap]).output().expect("qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("ermission") || text.contains("read-only") || text.contains("Read-only"), "{text}");
}

#[test]
fn nbdinfo_map_shows_the_allocation_a_clone_inherits() {
    let _gate = crate::gate::shared();
    require("nbdinfo");
    let c = Corona::start(IoEngine::Threads);
    clone_setup(&c);
    let out = run(Command::new("nbdinfo").args(["--map", &c.uri("vm")]));
    let map = String::from_utf8_lossy(&out.stdout).into_owned();
    // Lines: offset length type description.
    let rows: Vec<(u64, u64, u32)> = map
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?))
        })
        .collect();
    assert!(rows.contains(&(0, 4 * MIB, 0)), "inherited data at 0..4M:\n{map}");
    assert!(rows.contains(&(16 * MIB, MIB, 0)), "inherited data at 16M:\n{map}");
    assert!(rows.iter().any(|r| r.0 == 4 * MIB && r.2 == 3), "a hole after it:\n{map}");
    assert_eq!(rows.iter().map(|r| r.1).sum::<u64>(), 32 * MIB);
    let info = c.srv().volumes.info("vm").expect("info");
    assert!(info.allocated_bytes < MIB, "inherited data costs the clone nothing: {info:?}");
}

fn nbd_size(uri: &str) -> u64 {
    let out = run(Command::new("nbdinfo").args(["--size", uri]));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("size")
}

#[test]
fn a_resize_is_seen_by_new_connections() {
    let _gate = crate::gate::shared();
    require("nbdinfo");
    let c = Corona::start(IoEngine::Threads);
    clone_setup(&c);
    assert_eq!(nbd_size(&c.uri("vm")), 32 * MIB);
    c.rt.block_on(c.srv().volumes.resize("vm", 48 * MIB, false)).expect("grow");
    assert_eq!(nbd_size(&c.uri("vm")), 48 * MIB);
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "vm").await.expect("connect");
        assert_eq!(n.read(40 * MIB, 4096).await.expect("read grown part"), vec![0; 4096]);
        n.write(47 * MIB, &[9; 4096], true).await.expect("write grown part");
    });
    // Shrink below the inherited data at 16 MiB, grow again: it stays gone.
    c.rt.block_on(c.srv().volumes.resize("vm", 8 * MIB, true)).expect("shrink");
    assert_eq!(nbd_size(&c.uri("vm")), 8 * MIB);
    c.rt.block_on(c.srv().volumes.resize("vm", 32 * MIB, false)).expect("grow again");
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "vm").await.expect("connect");
        assert_eq!(n.read(16 * MIB, 4096).await.expect("read"), vec![0; 4096], "the parent shows through no more");
        assert_eq!(n.read(0, 4096).await.expect("read"), pattern(4 * MIB as usize, 1)[..4096]);
    });
    assert_eq!(nbd_size(&c.uri("img@gold")), 32 * MIB, "the snapshot keeps its size");
}

/// What the control-plane task got acknowledged before the kill.
#[derive(Debug, Default)]
struct Acks {
    /// Clones whose creation was answered, with the data flushed to them.
    clones: Vec<(String, Vec<(u64, Vec<u8>)>)>,
    /// Clones a delete was sent for (answered or not).
    deleting: Vec<String>,
}

async fn churn(api: ApiClient, nbd: std::net::SocketAddr, round: u64, acks: Arc<Mutex<Acks>>) {
    for i in 0..1000u64 {
        let name = format!("c{round}-{i}");
        if api.clone_snapshot(&name, "img@gold", None).await.is_err() {
            return;
        }
        acks.lock().expect("acks").clones.push((name.clone(), Vec::new()));
        let Ok(n) = NbdClient::connect(nbd, &name).await else { return };
        let off = (i * 7 + round) % 30 * MIB + 4096 * i % MIB;
        let data = pattern(100_000, round * 10_000 + i);
        if n.write(off, &data, false).await.is_err() || n.flush().await.is_err() {
            return;
        }
        if let Some(c) = acks.lock().expect("acks").clones.iter_mut().find(|c| c.0 == name) {
            c.1.push((off, data));
        }
        drop(n);
        if api.snapshot(&name, "s").await.is_err() || api.resize(&name, 40 * MIB, false).await.is_err() {
            return;
        }
        if i % 2 == 1 {
            let victim = format!("c{round}-{}", i - 1);
            acks.lock().expect("acks").deleting.push(victim.clone());
            if api.delete(&victim, true).await.is_err() {
                return;
            }
        }
    }
}

#[test]
fn kill_9_during_snapshot_clone_resize_and_delete_loses_nothing_acknowledged() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let gold = pattern(4 * MIB as usize, 77);
    {
        let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
        let api = p.client();
        rt.block_on(async {
            api.create("img", 32 * MIB).await.expect("create");
            let n = NbdClient::connect(p.nbd, "img").await.expect("connect");
            n.write(MIB, &gold, true).await.expect("write");
            api.snapshot("img", "gold").await.expect("snapshot");
        });
        p.kill9();
    }
    let acks = Arc::new(Mutex::new(Acks::default()));
    for round in 0..6u64 {
        let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
        let task = rt.spawn(churn(p.client(), p.nbd, round, acks.clone()));
        std::thread::sleep(Duration::from_millis(150 + round * 97 % 300));
        p.kill9();
        let _ = rt.block_on(task);
    }
    // Every volume the metadata names opens, files and metadata agree, and
    // everything acknowledged is there.
    let v = Volumes::load(dir.path().to_path_buf(), coronafs::backend::Opener::Threads, false).expect("load");
    v.verify().expect("metadata and files agree after the kills");
    let acks = acks.lock().expect("acks");
    assert!(acks.clones.len() >= 6, "the churn did some work: {}", acks.clones.len());
    rt.block_on(async {
        use coronafs::backend::BlockBackend;
        let read = |name: String, off: u64, len: usize| {
            let e = v.open(&name).expect("open");
            async move {
                let (r, b) = e.backend.read_at(vec![0; len], off).await;
                r.expect("read");
                b
            }
        };
        assert_eq!(read("img@gold".into(), MIB, gold.len()).await, gold, "the snapshot is intact");
        for info in v.list().expect("list") {
            let e = v.open(&info.name).expect("every listed volume opens");
            assert_eq!(e.backend.size(), info.size);
            if info.parent.is_some() {
                // Clones read their parent's data where they did not write.
                let got = read(info.name.clone(), MIB + 31 * MIB - MIB, 4096).await;
                assert_eq!(got.len(), 4096);
            }
        }
        for (name, writes) in &acks.clones {
            if acks.deleting.contains(name) {
                continue;
            }
            v.info(name).unwrap_or_else(|e| panic!("acknowledged clone {name} lost: {e}"));
            for (off, data) in writes {
                assert!(read(name.clone(), *off, data.len()).await == *data, "{name}: flushed data lost");
            }
            let untouched =
                if writes.iter().any(|(o, d)| *o < 2 * MIB && o + d.len() as u64 > MIB) { None } else { Some(()) };
            if untouched.is_some() {
                assert_eq!(read(name.clone(), MIB, 4096).await, gold[..4096], "{name}: inherited data wrong");
            }
        }
    });
}

fn cli(p: &CoronaProc, args: &[&str]) -> (bool, String) {
    let out = Command::new(stack_tests::bin("coronafs", "coronafs"))
        .args(args)
        .args(["--api", &format!("http://{}", p.api)])
        .arg("--token-file")
        .arg(p.token_file.path())
        .env_remove("CORONAFS_API_TOKEN")
        .output()
        .expect("run coronafs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn the_cli_drives_snapshots_clones_resize_flatten_and_delete() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
    let ok = |args: &[&str], needle: &str| {
        let (success, text) = cli(&p, args);
        assert!(success && text.contains(needle), "{args:?}: {text}");
    };
    let fails = |args: &[&str], needle: &str| {
        let (success, text) = cli(&p, args);
        assert!(!success && text.contains(needle), "{args:?} should fail with {needle:?}: {text}");
    };
    ok(&["volume", "create", "img", "--size", "64M"], "created img");
    ok(&["snapshot", "create", "img@gold"], "read-only export");
    ok(&["volume", "create", "vm", "--from-snapshot", "img@gold"], "as a clone of img@gold");
    ok(&["snapshot", "list", "img"], "img@gold");
    ok(&["volume", "list"], "img@gold");
    fails(&["volume", "create", "x"], "--size is required");
    fails(&["snapshot", "create", "img"], "VOLUME@SNAPSHOT");
    fails(&["volume", "delete", "img"], "has clones (vm)");
    fails(&["volume", "resize", "vm", "--size", "1M"], "allow_shrink");
    ok(&["volume", "resize", "vm", "--size", "128M"], "134217728 bytes");
    ok(&["volume", "evict", "vm"], "evicted vm: 3 files");
    fails(&["volume", "evict", "nope"], "not found");
    ok(&["volume", "flatten", "vm"], "no parent");
    ok(&["volume", "show", "vm"], "\"parent\": null");
    ok(&["snapshot", "delete", "img@gold"], "deleted img@gold");
    ok(&["volume", "delete", "img"], "deleted img");
    ok(&["volume", "delete", "vm", "--force"], "deleted vm");
    fails(&["volume", "show", "vm"], "not found");
}

/// `nbdsh` holding one connection opened as `export` across a fence: writes
/// once, waits for a line on stdin, then tries to write again and reads.
const NBDSH_STALE: &str = r#"
import sys
h2 = nbd.NBD()
h2.set_export_name("EXPORT")
h2.connect_tcp("127.0.0.1", "PORT")
h2.pwrite(b"\x11" * 4096, 0)
print("written", flush=True)
sys.stdin.readline()
try:
    h2.pwrite(b"\x22" * 4096, 0)
    print("wrote after the fence", flush=True)
except nbd.Error as e:
    print("refused errno=%s %s" % (e.errno, e), flush=True)
print("read %s" % h2.pread(4096, 0)[:1].hex(), flush=True)
"#;

#[test]
fn a_fence_stops_stale_writers_of_our_client_and_of_nbdsh_while_reads_go_on() {
    let _gate = crate::gate::shared();
    use std::io::{BufRead, Write};
    require("nbdsh");
    let c = Corona::start(IoEngine::Threads);
    c.create("f", 4 * MIB);
    let base = c.srv().api_url();
    let port = c.addr().port().to_string();
    // Debian's python3 is the one that can import `nbd`: put /usr/bin first.
    let path = std::env::var("PATH").unwrap_or_default();
    let mut sh = Command::new("/usr/bin/nbdsh")
        .env("PATH", format!("/usr/bin:/bin:{path}"))
        .args(["-c", &NBDSH_STALE.replace("EXPORT", "f;epoch=1").replace("PORT", &port)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn nbdsh");
    let mut lines = std::io::BufReader::new(sh.stdout.take().expect("stdout")).lines();
    assert_eq!(lines.next().and_then(|l| l.ok()).as_deref(), Some("written"));
    c.rt.block_on(async {
        // Declaring an epoch ahead of the volume's is allowed (a migration
        // target attaches before the fence).
        let old = NbdClient::connect(c.addr(), "f;epoch=1").await.expect("epoch 1");
        old.write(4096, &[0x33; 4096], false).await.expect("epoch 1 writes at epoch 0");
        let v = ApiClient::new(&base).fence("f", 2).await.expect("fence");
        assert_eq!(v.epoch, 2, "{v:?}");
        for e in
            [old.write(4096, &[0x44; 4096], false).await, old.write_zeroes(0, 4096, 0).await, old.trim(0, 4096).await]
        {
            match e {
                Err(coronafs::CoronaError::Nbd { errno, message }) => {
                    assert_eq!(errno, coronafs::proto::NbdErrno::Perm);
                    assert!(message.contains("fenced at epoch 2"), "{message}");
                }
                other => panic!("a stale write was not refused: {other:?}"),
            }
        }
        assert_eq!(old.read(4096, 4096).await.expect("stale reads work"), vec![0x33; 4096]);
        old.flush().await.expect("a flush is not a write");
        // The current epoch writes; an older one cannot even open; no epoch
        // opens read-only.
        let new = NbdClient::connect(c.addr(), "f;epoch=2").await.expect("epoch 2");
        new.write(8192, &[0x55; 4096], true).await.expect("epoch 2 writes");
        assert!(NbdClient::connect(c.addr(), "f;epoch=1").await.is_err(), "a stale open was accepted");
        let plain = NbdClient::connect(c.addr(), "f").await.expect("no epoch");
        assert!(plain.info().read_only());
        assert!(plain.write(0, &[1; 512], false).await.is_err());
        assert_eq!(plain.read(8192, 4096).await.expect("read"), vec![0x55; 4096]);
        // Never back; bad bodies and unknown volumes are clear errors.
        let (s, v) = api(&base, "POST", "/v1/volumes/f/fence", Some(json!({ "epoch": 1 }))).await;
        assert_eq!(s, 409, "{v}");
        let (s, _) = api(&base, "POST", "/v1/volumes/f/fence", Some(json!({ "epoch": -1 }))).await;
        assert_eq!(s, 400);
        let (s, _) = api(&base, "POST", "/v1/volumes/f/fence", Some(json!({ "epoch": 3, "x": 1 }))).await;
        assert_eq!(s, 400);
        let (s, _) = api(&base, "POST", "/v1/volumes/nope/fence", Some(json!({ "epoch": 3 }))).await;
        assert_eq!(s, 404);
    });
    // nbdsh's connection, opened at epoch 1, is refused too and still reads.
    writeln!(sh.stdin.as_mut().expect("stdin")).expect("go");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(sh.wait().expect("nbdsh").success(), "{rest:?}");
    // libnbd names the errno (EPERM) in some versions, numbers it (1) in others.
    assert!(rest[0].starts_with("refused errno=EPERM") || rest[0].starts_with("refused errno=1"), "{rest:?}");
    assert_eq!(rest[1], "read 11", "{rest:?}");
    let metrics = c.rt.block_on(reqwest::get(format!("{base}/metrics"))).expect("metrics");
    let text = c.rt.block_on(metrics.text()).expect("text");
    let fenced = text.lines().find_map(|l| l.strip_prefix("coronafs_nbd_fenced_requests_total ")).expect("metric");
    assert!(fenced.parse::<u64>().expect("count") >= 4, "{fenced}");
}

#[test]
fn a_fence_returns_only_after_stale_writes_drain_and_survives_a_restart() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
    let api = p.client();
    rt.block_on(async {
        api.create("d", 16 * MIB).await.expect("create");
        let old = Arc::new(NbdClient::connect(p.nbd, "d;epoch=1").await.expect("connect"));
        // Many writes in flight from the old epoch while the fence is raised.
        let mut writers = Vec::new();
        for t in 0..8u64 {
            let old = old.clone();
            writers.push(tokio::spawn(async move {
                let mut landed = 0u64;
                for i in 0..2000u64 {
                    let off = ((t * 2000 + i) % 256) * 65536;
                    match old.write(off, &pattern(65536, t * 1000 + i), false).await {
                        Ok(()) => landed += 1,
                        Err(_) => return landed,
                    }
                }
                landed
            }));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        api.fence("d", 2).await.expect("fence");
        // Whatever the volume holds now is final: no stale write lands after.
        let reader = NbdClient::connect(p.nbd, "d;epoch=2").await.expect("connect");
        let at_fence = reader.read(0, (16 * MIB) as usize).await.expect("read");
        let mut landed = 0;
        for w in writers {
            landed += w.await.expect("join");
        }
        assert!(landed > 0, "no write landed before the fence; the test proves nothing");
        assert!(landed < 16000, "every stale write landed before the fence; the test proves nothing");
        assert_eq!(reader.read(0, (16 * MIB) as usize).await.expect("read"), at_fence, "a stale write landed");
    });
    p.kill9();
    let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
    let api = p.client();
    rt.block_on(async {
        let v = api.get("d").await.expect("get");
        assert_eq!(v.epoch, 2, "{v:?}");
        assert!(NbdClient::connect(p.nbd, "d;epoch=1").await.is_err(), "epoch 1 opened after a restart");
        let c = NbdClient::connect(p.nbd, "d;epoch=2").await.expect("epoch 2 after a restart");
        c.write(0, &[9; 4096], true).await.expect("write");
    });
}

/// ext4 holds files of at most 16 TiB. A 17 TiB create used to answer 500
/// "File too large" and leave an empty layer file behind, after which every
/// create, snapshot and clone answered 500 "File exists" until a restart.
#[test]
fn a_volume_larger_than_the_file_system_allows_is_507_and_blocks_no_later_change() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    // Only meaningful where the file system has such a limit (ext4 here).
    let ext4 = {
        let path = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()).expect("path");
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is a live statfs to fill.
        let rc = unsafe { libc::statfs(path.as_ptr(), &mut st) };
        rc == 0 && st.f_type == libc::EXT4_SUPER_MAGIC
    };
    let c = Corona::start_in(dir, IoEngine::Threads, false);
    let api = ApiClient::new(&c.srv().api_url());
    c.rt.block_on(async {
        let r = api.create("big", 17u64 << 40).await;
        let status = match &r {
            Ok(_) => 201,
            Err(coronafs::CoronaError::Api { status: Some(s), .. }) => *s,
            Err(e) => panic!("{e}"),
        };
        if ext4 {
            assert_eq!(status, 507, "{r:?}");
            assert!(format!("{r:?}").contains("file system"), "the message says why: {r:?}");
        } else {
            assert!(status == 201 || status == 507, "{r:?}");
        }
        let layers = std::fs::read_dir(c.dir.path().join("layers")).expect("layers").count();
        assert_eq!(layers, if status == 201 { 1 } else { 0 }, "a refused create leaves no file");
        api.create("small", MIB).await.expect("a later create");
        api.snapshot("small", "s").await.expect("a later snapshot");
        api.clone_snapshot("c", "small@s", None).await.expect("a later clone");
    });
    if let Err(e) = c.srv().volumes.verify() {
        panic!("{e}");
    }
}

/// One raw call with an optional `Authorization` header: the status, the
/// `WWW-Authenticate` header and the body (JSON, else its text).
async fn call_as(
    base: &str,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<Value>,
) -> (u16, String, Value) {
    let http = reqwest::Client::new();
    let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
    let mut req = http.request(m, format!("{base}{path}"));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.expect("send");
    let status = resp.status().as_u16();
    let www = resp.headers().get("www-authenticate").map(|v| v.to_str().expect("ascii").to_owned()).unwrap_or_default();
    let text = resp.text().await.expect("body");
    (status, www, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

#[test]
fn without_the_api_token_every_call_but_health_and_metrics_is_401_and_changes_nothing() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
    let base = format!("http://{}", p.api);
    let good = format!("Bearer {}", stack_tests::CORONA_TOKEN);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let create = json!({"name": "v", "size": MIB});
        let refused = [
            None,
            Some("Bearer not-the-token-0123456789".to_owned()),
            Some(format!("Basic {}", stack_tests::CORONA_TOKEN)),
            Some(stack_tests::CORONA_TOKEN.to_owned()),
        ];
        for auth in &refused {
            for (method, path, body) in [
                ("POST", "/v1/volumes", Some(create.clone())),
                ("GET", "/v1/volumes", None),
                ("POST", "/v1/volumes/v/snapshots", Some(json!({"name": "s"}))),
                ("DELETE", "/v1/volumes/v?force=true", None),
                ("GET", "/openapi.json", None),
            ] {
                let (status, www, b) = call_as(&base, method, path, auth.as_deref(), body).await;
                assert_eq!(status, 401, "{method} {path} with {auth:?}: {b}");
                assert!(www.starts_with("Bearer"), "{www:?}");
                assert!(b["error"].as_str().is_some_and(|e| e.starts_with("unauthorized: ")), "{b}");
            }
        }
        // Monitoring stays open.
        let (status, _, b) = call_as(&base, "GET", "/healthz", None, None).await;
        assert_eq!((status, b), (200, Value::String("ok\n".into())));
        let (status, _, b) = call_as(&base, "GET", "/metrics", None, None).await;
        assert!(status == 200 && b.as_str().is_some_and(|m| m.contains("coronafs_")), "{status} {b}");
        // Nothing was made by the refused calls.
        let (status, _, list) = call_as(&base, "GET", "/v1/volumes", Some(&good), None).await;
        assert_eq!((status, list), (200, json!([])));
        assert!(std::fs::read_dir(dir.path()).expect("data dir").all(|e| !e.expect("entry").path().ends_with("v")));
        // With the token, the same call works; the typed client sends it.
        let (status, _, v) = call_as(&base, "POST", "/v1/volumes", Some(&good), Some(create.clone())).await;
        assert_eq!(status, 201, "{v}");
        let e = ApiClient::new(&base).list().await.expect_err("no token");
        assert!(matches!(e, coronafs::CoronaError::Api { status: Some(401), .. }), "{e}");
        let listed = p.client().list().await.expect("list with the token");
        assert_eq!(listed.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["v"]);
    });
    // The CLI: refused without a token, working with --token or the variable.
    let coronafs = |args: &[&str], env: Option<&str>| {
        let mut cmd = Command::new(stack_tests::bin("coronafs", "coronafs"));
        cmd.args(args).args(["--api", &base]).env_remove("CORONAFS_API_TOKEN");
        if let Some(t) = env {
            cmd.env("CORONAFS_API_TOKEN", t);
        }
        let out = cmd.output().expect("run coronafs");
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, text) = coronafs(&["volume", "create", "w", "--size", "1M"], None);
    assert!(!ok && text.contains("401") && text.contains("unauthorized"), "{text}");
    let (ok, text) = coronafs(&["volume", "create", "w", "--size", "1M", "--token", "wrong-token-0123456789"], None);
    assert!(!ok && text.contains("wrong API token"), "{text}");
    let (ok, text) = coronafs(&["volume", "create", "w", "--size", "1M", "--token", "short"], None);
    assert!(!ok && text.contains("at least 16"), "a short token is refused before any call: {text}");
    let (ok, text) = coronafs(&["volume", "list"], None);
    assert!(!ok && text.contains("401"), "{text}");
    let (ok, text) = coronafs(&["volume", "create", "w", "--size", "1M", "--token", stack_tests::CORONA_TOKEN], None);
    assert!(ok && text.contains("created w"), "{text}");
    let (ok, text) = coronafs(&["volume", "list"], Some(stack_tests::CORONA_TOKEN));
    assert!(ok && text.contains("w ") && text.contains("v "), "{text}");
}

#[test]
fn a_server_off_loopback_without_a_token_refuses_to_start_unless_told_it_is_unsafe() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let serve = |extra: &[&str]| {
        let [nbd, api] = stack_tests::free_ports::<2>();
        let (nbd, api) = (format!("127.0.0.1:{nbd}"), format!("0.0.0.0:{api}"));
        let mut child = Command::new(stack_tests::bin("coronafs", "coronafs"))
            .args(["serve", "--data-dir"])
            .arg(dir.path())
            .args(["--nbd", &nbd, "--api", &api])
            .args(extra)
            .env_remove("CORONAFS_API_TOKEN")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        std::thread::sleep(Duration::from_millis(1500));
        let exited = child.try_wait().expect("wait");
        let _ = child.kill();
        let out = child.wait_with_output().expect("output");
        (exited, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (exited, log) = serve(&[]);
    assert!(exited.is_some_and(|s| !s.success()), "it must refuse: {log}");
    assert!(log.contains("no API token is set") && log.contains("--no-api-token"), "{log}");
    let (exited, log) = serve(&["--no-api-token"]);
    assert!(exited.is_none(), "--no-api-token lets it run: {log}");
    assert!(log.contains("without a token (--no-api-token)"), "and it warns: {log}");
}
