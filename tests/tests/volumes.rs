//! CoronaFS volumes end to end: the control API and its error cases,
//! snapshots and clones seen by real NBD clients (qemu-img compare, nbdinfo
//! --map), resize on reconnect, and kill -9 in the middle of snapshot, clone,
//! resize and delete.

use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use coronafs::volume::Volumes;
use serde_json::{Value, json};
use stack_tests::{Corona, CoronaProc, pattern, require, run};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// One call to the control API: status and JSON body (Null when empty).
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
    c.srv().shared.exports.verify().expect("files match metadata");
}

fn clone_setup(c: &Corona) {
    c.create("img", 32 * MIB);
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "img").await.expect("connect");
        // Data in the first 4 MiB and at 16 MiB; the rest stays a hole.
        n.write(0, &pattern(4 * MIB as usize, 1), false).await.expect("write");
        n.write(16 * MIB, &pattern(MIB as usize, 2), false).await.expect("write");
        n.flush().await.expect("flush");
        let e = &c.srv().shared.exports;
        e.snapshot("img", "gold").await.expect("snapshot");
        e.clone_from("vm", "img@gold", None).await.expect("clone");
    });
}

#[test]
fn qemu_img_compare_finds_a_clone_identical_to_its_snapshot_until_it_is_written() {
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
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("offset {}", 20 * MIB + 12_345)));
    // Writing the snapshot export is refused.
    let out = Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &snap]).output().expect("qemu-io");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("ermission") || text.contains("read-only") || text.contains("Read-only"), "{text}");
}

#[test]
fn nbdinfo_map_shows_the_allocation_a_clone_inherits() {
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
    let info = c.srv().shared.exports.info("vm").expect("info");
    assert!(info.allocated_bytes < MIB, "inherited data costs the clone nothing: {info:?}");
}

fn nbd_size(uri: &str) -> u64 {
    let out = run(Command::new("nbdinfo").args(["--size", uri]));
    String::from_utf8_lossy(&out.stdout).trim().parse().expect("size")
}

#[test]
fn a_resize_is_seen_by_new_connections() {
    require("nbdinfo");
    let c = Corona::start(IoEngine::Threads);
    clone_setup(&c);
    assert_eq!(nbd_size(&c.uri("vm")), 32 * MIB);
    c.rt.block_on(c.srv().shared.exports.resize("vm", 48 * MIB, false)).expect("grow");
    assert_eq!(nbd_size(&c.uri("vm")), 48 * MIB);
    c.rt.block_on(async {
        let n = NbdClient::connect(c.addr(), "vm").await.expect("connect");
        assert_eq!(n.read(40 * MIB, 4096).await.expect("read grown part"), vec![0; 4096]);
        n.write(47 * MIB, &[9; 4096], true).await.expect("write grown part");
    });
    // Shrink below the inherited data at 16 MiB, grow again: it stays gone.
    c.rt.block_on(c.srv().shared.exports.resize("vm", 8 * MIB, true)).expect("shrink");
    assert_eq!(nbd_size(&c.uri("vm")), 8 * MIB);
    c.rt.block_on(c.srv().shared.exports.resize("vm", 32 * MIB, false)).expect("grow again");
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

async fn churn(api_url: String, nbd: std::net::SocketAddr, round: u64, acks: Arc<Mutex<Acks>>) {
    for i in 0..1000u64 {
        let name = format!("c{round}-{i}");
        let (s, _) =
            api(&api_url, "POST", "/v1/volumes", Some(json!({"name": name, "from_snapshot": "img@gold"}))).await;
        if s != 201 {
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
        let snap = format!("/v1/volumes/{name}/snapshots");
        if api(&api_url, "POST", &snap, Some(json!({"name": "s"}))).await.0 != 201 {
            return;
        }
        if api(&api_url, "POST", &format!("/v1/volumes/{name}/resize"), Some(json!({"size": 40 * MIB}))).await.0 != 200
        {
            return;
        }
        if i % 2 == 1 {
            let victim = format!("c{round}-{}", i - 1);
            acks.lock().expect("acks").deleting.push(victim.clone());
            if api(&api_url, "DELETE", &format!("/v1/volumes/{victim}?force=true"), None).await.0 != 204 {
                return;
            }
        }
    }
}

#[test]
fn kill_9_during_snapshot_clone_resize_and_delete_loses_nothing_acknowledged() {
    let dir = tempfile::tempdir().expect("tmp");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let gold = pattern(4 * MIB as usize, 77);
    {
        let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
        let base = format!("http://{}", p.api);
        rt.block_on(async {
            assert_eq!(api(&base, "POST", "/v1/volumes", Some(json!({"name": "img", "size": 32 * MIB}))).await.0, 201);
            let n = NbdClient::connect(p.nbd, "img").await.expect("connect");
            n.write(MIB, &gold, true).await.expect("write");
            assert_eq!(api(&base, "POST", "/v1/volumes/img/snapshots", Some(json!({"name": "gold"}))).await.0, 201);
        });
        p.kill9();
    }
    let acks = Arc::new(Mutex::new(Acks::default()));
    for round in 0..6u64 {
        let p = CoronaProc::spawn(dir.path(), IoEngine::Threads);
        let task = rt.spawn(churn(format!("http://{}", p.api), p.nbd, round, acks.clone()));
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
