//! PlasmaVMC as processes: `coronafs serve`, `lightningstor serve`,
//! `plasmavmc serve` with two `plasmavmc agent` workers, all spawned from
//! their binaries. A VM is created on agent A from a qemu-img image,
//! migrated to B and verified; then agent A is killed with SIGKILL during a
//! migration, and nothing acknowledged and flushed is lost. Also the
//! `serve` and `agent` commands themselves: --help, TOML configs, bad
//! configs, SIGTERM.

mod plasmavmc_common;

use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use plasmavmc::vms::{BLOCK, WriteLog, written_seq};
use plasmavmc_common::{AK, SK, make_raw, qemu_img};
use serde_json::{Value, json};
use stack_tests::{CoronaProc, bin, free_port, wait_for_port};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child process killed on drop.
struct Proc(Child);

impl Proc {
    fn signal(&mut self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe {
            libc::kill(self.0.id() as i32, sig);
        }
    }

    /// Waits up to `t` for the exit status.
    fn wait_exit(&mut self, t: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + t;
        while Instant::now() < deadline {
            if let Ok(Some(s)) = self.0.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().expect("addr")
}

fn plasmavmc() -> PathBuf {
    bin("plasmavmc", "plasmavmc")
}

fn spawn(cmd: &mut Command) -> Proc {
    Proc(cmd.stdout(Stdio::null()).stderr(Stdio::inherit()).spawn().expect("spawn"))
}

fn spawn_agent(name: &str, listen: SocketAddr, nbd: SocketAddr) -> Proc {
    let p = spawn(Command::new(plasmavmc()).args([
        "agent",
        "--listen",
        &listen.to_string(),
        "--name",
        name,
        "--coronafs-nbd",
        &nbd.to_string(),
    ]));
    wait_for_port(listen, Duration::from_secs(20));
    p
}

/// JSON over HTTP from a test thread.
struct Http {
    rt: tokio::runtime::Runtime,
    c: reqwest::Client,
}

impl Http {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        Http { rt, c: reqwest::Client::new() }
    }

    fn call(&self, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
        self.rt.block_on(async {
            let mut req = self.c.request(reqwest::Method::from_bytes(method.as_bytes()).expect("method"), url);
            if let Some(b) = body {
                req = req.json(&b);
            }
            let resp = req.send().await.expect("send");
            let status = resp.status().as_u16();
            let text = resp.text().await.expect("body");
            (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }

    fn put(&self, url: &str, bytes: Vec<u8>) -> (u16, Value) {
        self.rt.block_on(async {
            let resp = self.c.put(url).body(bytes).send().await.expect("send");
            let status = resp.status().as_u16();
            let text = resp.text().await.expect("body");
            (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }
}

/// The whole stack as processes.
struct Lab {
    dir: tempfile::TempDir,
    http: Http,
    corona: CoronaProc,
    _ls: Proc,
    vmc: Proc,
    api: String,
    agents: Vec<(Option<Proc>, String)>,
}

impl Lab {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tmp");
        let corona = CoronaProc::spawn(&dir.path().join("corona"), IoEngine::Threads);
        let ls_addr = addr();
        let ls = spawn(
            Command::new(bin("lightningstor", "lightningstor"))
                .args(["serve", "--listen", &ls_addr.to_string(), "--data-dir"])
                .arg(dir.path().join("ls"))
                .env("LIGHTNINGSTOR_ACCESS_KEY", AK)
                .env("LIGHTNINGSTOR_SECRET_KEY", SK)
                .env("RUST_LOG", "warn"),
        );
        wait_for_port(ls_addr, Duration::from_secs(30));
        let (a_addr, b_addr) = (addr(), addr());
        let a = spawn_agent("a", a_addr, corona.nbd);
        // Agent B reads its settings from a TOML file.
        let b_cfg = dir.path().join("agent-b.toml");
        std::fs::write(&b_cfg, format!("listen = \"{b_addr}\"\nname = \"b\"\ncoronafs_nbd = \"{}\"\n", corona.nbd))
            .expect("write agent config");
        let b = spawn(Command::new(plasmavmc()).args(["agent", "--config"]).arg(&b_cfg));
        wait_for_port(b_addr, Duration::from_secs(20));
        let vmc_addr = addr();
        let cfg = dir.path().join("plasmavmc.toml");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"{vmc_addr}\"\ndata_dir = \"{}\"\ns3_endpoint = \"http://{ls_addr}\"\ns3_bucket = \"images\"\n\
                 s3_access_key = \"{AK}\"\ns3_secret_key = \"{SK}\"\ncoronafs_api = \"http://{}\"\ncoronafs_nbd = \"{}\"\n\
                 part_size = 5242880\nfetch_chunk = 1048576\n\n\
                 [[workers]]\nname = \"a\"\nurl = \"http://{a_addr}\"\n\n[[workers]]\nname = \"b\"\nurl = \"http://{b_addr}\"\n",
                dir.path().join("vmc").display(),
                corona.api,
                corona.nbd
            ),
        )
        .expect("write config");
        let vmc = spawn(Command::new(plasmavmc()).args(["serve", "--config"]).arg(&cfg));
        wait_for_port(vmc_addr, Duration::from_secs(30));
        Lab {
            dir,
            http: Http::new(),
            corona,
            _ls: ls,
            vmc,
            api: format!("http://{vmc_addr}"),
            agents: vec![(Some(a), format!("http://{a_addr}")), (Some(b), format!("http://{b_addr}"))],
        }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.http.call(method, &format!("{}{path}", self.api), body)
    }

    fn agent(&self, i: usize, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.http.call(method, &format!("{}{path}", self.agents[i].1), body)
    }

    /// A qcow2 image made by qemu-img, uploaded; a volume from it, available.
    fn volume(&self, seed: u64) -> Value {
        let work = self.dir.path().join("work");
        std::fs::create_dir_all(&work).expect("mkdir");
        let raw = make_raw(&work, &format!("d{seed}.raw"), seed);
        let q = work.join(format!("d{seed}.qcow2"));
        qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &raw.display().to_string(), &q.display().to_string()]);
        let (c, img) = self.call("POST", "/v1/images", Some(json!({ "name": format!("img{seed}") })));
        assert_eq!(c, 201, "{img}");
        let id = img["id"].as_str().expect("id");
        let (c, img) = self.http.put(&format!("{}/v1/images/{id}/file", self.api), std::fs::read(&q).expect("read"));
        assert_eq!((c, img["status"].as_str()), (200, Some("active")), "{img}");
        let (c, mut v) = self.call("POST", "/v1/volumes", Some(json!({ "image_id": id })));
        assert_eq!(c, 202, "{v}");
        let vid = v["id"].as_str().expect("id").to_owned();
        let t0 = Instant::now();
        while matches!(v["status"].as_str(), Some("creating" | "downloading")) {
            assert!(t0.elapsed() < Duration::from_secs(120), "volume stuck: {v}");
            std::thread::sleep(Duration::from_millis(50));
            v = self.call("GET", &format!("/v1/volumes/{vid}"), None).1;
        }
        assert_eq!(v["status"], "available", "{v}");
        v
    }

    fn wait_acked(&self, vm: &str, n: u64) {
        let t0 = Instant::now();
        loop {
            let (c, v) = self.call("GET", &format!("/v1/vms/{vm}"), None);
            assert_eq!(c, 200, "{v}");
            if v["writes_acked"].as_u64().unwrap_or(0) >= n {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "guest made no progress: {v}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every logged block holds its logged write or a later one, read on a
    /// fresh connection (no epoch: read-only once the volume is fenced).
    fn check_log(&self, vm: &str, volume: &str, log: &WriteLog) {
        assert!(!log.is_empty(), "an empty log checks nothing");
        self.http.rt.block_on(async {
            let c = NbdClient::connect(self.corona.nbd, volume).await.expect("connect");
            for (&block, &seq) in log {
                let data = c.read(block * BLOCK, BLOCK as usize).await.expect("read");
                let got = written_seq(vm, block, &data);
                assert!(got.is_some_and(|s| s >= seq), "block {block}: acknowledged write {seq} lost (holds {got:?})");
            }
        });
    }
}

fn log_of(report: &Value) -> WriteLog {
    serde_json::from_value(report["log"].clone()).expect("log")
}

#[test]
#[ignore = "written in session 3 and not yet run to completion on the loaded build machine; un-ignore once verified (see the session note)"]
fn a_vm_migrates_between_agent_processes_and_a_killed_source_loses_nothing_acknowledged() {
    let mut lab = Lab::start();
    let vol = lab.volume(21);
    let name = vol["coronafs_volume"].as_str().expect("name").to_owned();
    // Unknown workers are refused with the configured list.
    let (c, e) = lab.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "zz" })));
    assert_eq!(c, 400, "{e}");
    assert!(e["error"].as_str().unwrap_or("").contains("configured workers"), "{e}");
    // VM on A, migrated to B while its guest writes.
    let (c, vm) = lab.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "a", "io_ops": 4000 })));
    assert_eq!(c, 201, "{vm}");
    let id = vm["id"].as_str().expect("id").to_owned();
    assert_eq!(vm["epoch"], 1);
    lab.wait_acked(&id, 50);
    let (c, moved) = lab.call("POST", &format!("/v1/vms/{id}/migrate"), Some(json!({ "worker": "b" })));
    assert_eq!(c, 200, "{moved}");
    assert_eq!((moved["worker"].as_str(), moved["epoch"].as_u64()), (Some("b"), Some(2)), "{moved}");
    assert!(moved["verified_blocks"].as_u64().unwrap_or(0) > 0, "{moved}");
    assert!(moved["notice"].is_null(), "{moved}");
    // A let go of it; B holds it, and its flushed log reads back.
    let (c, _) = lab.agent(0, "GET", &format!("/v1/attachments/{id}"), None);
    assert_eq!(c, 404);
    let (c, rep) = lab.agent(1, "POST", &format!("/v1/attachments/{id}/flush"), Some(json!({})));
    assert_eq!(c, 200, "{rep}");
    assert_eq!(rep["epoch"], 2);
    lab.check_log(&id, &name, &log_of(&rep));
    // An open that declares the old epoch is refused by CoronaFS.
    let stale = lab.http.rt.block_on(NbdClient::connect(lab.corona.nbd, &format!("{name};epoch=1")));
    assert!(stale.is_err(), "an epoch-1 open of a volume at epoch 2 was accepted");

    // A second VM on A: its acknowledged, flushed log is taken, then A is
    // killed while the VM migrates to B.
    let vol2 = lab.volume(22);
    let name2 = vol2["coronafs_volume"].as_str().expect("name").to_owned();
    let (c, vm2) =
        lab.call("POST", "/v1/vms", Some(json!({ "volume_id": vol2["id"], "worker": "a", "io_ops": 100000 })));
    assert_eq!(c, 201, "{vm2}");
    let id2 = vm2["id"].as_str().expect("id").to_owned();
    lab.wait_acked(&id2, 100);
    let (c, flushed) = lab.agent(0, "POST", &format!("/v1/attachments/{id2}/flush"), Some(json!({})));
    assert_eq!(c, 200, "{flushed}");
    let acked = log_of(&flushed);
    lab.wait_acked(&id2, flushed["writes_acked"].as_u64().unwrap_or(0) + 20);
    let api = lab.api.clone();
    let migrating = std::thread::spawn(move || {
        Http::new().call("POST", &format!("{api}/v1/vms/{id2}/migrate"), Some(json!({ "worker": "b" })))
    });
    std::thread::sleep(Duration::from_millis(3));
    let mut a = lab.agents[0].0.take().expect("agent a");
    a.signal(libc::SIGKILL);
    let _ = a.wait_exit(Duration::from_secs(10));
    let (c, after) = migrating.join().expect("migrate thread");
    let id2 = vm2["id"].as_str().expect("id").to_owned();
    let (_, now) = lab.call("GET", &format!("/v1/vms/{id2}"), None);
    if c == 200 {
        // Completed: running on B at a new epoch (with a notice if A's flush was lost).
        assert_eq!((now["worker"].as_str(), now["status"].as_str()), (Some("b"), Some("running")), "{now}");
        assert_eq!(now["epoch"], 2, "{now}");
    } else {
        // Or a clear error, never a VM silently half-moved.
        assert!(after["error"].as_str().is_some_and(|e| !e.is_empty()), "{c}: {after}");
        assert!(
            now["status"] == "error" && now["error_reason"].as_str().is_some()
                || now["status"] == "running" && now["worker"] == "a",
            "{now}"
        );
    }
    lab.check_log(&id2, &name2, &acked);
    // With A gone, migrating onto it fails cleanly and leaves the first VM on B.
    let (c, e) = lab.call("POST", &format!("/v1/vms/{id}/migrate"), Some(json!({ "worker": "a" })));
    assert_eq!(c, 502, "{e}");
    assert!(e["error"].as_str().unwrap_or("").contains("worker a"), "{e}");
    let (_, vm) = lab.call("GET", &format!("/v1/vms/{id}"), None);
    assert_eq!((vm["worker"].as_str(), vm["status"].as_str()), (Some("b"), Some("running")), "{vm}");
    // The control plane stops cleanly on SIGTERM.
    lab.vmc.signal(libc::SIGTERM);
    let st = lab.vmc.wait_exit(Duration::from_secs(20)).expect("plasmavmc serve did not stop on SIGTERM");
    assert!(st.success(), "{st}");
}

#[test]
#[ignore = "written in session 3 and not yet run to completion on the loaded build machine; un-ignore once verified (see the session note)"]
fn serve_and_agent_explain_themselves_refuse_bad_configs_and_stop_on_sigterm() {
    let exe = plasmavmc();
    for args in [&["serve", "--help"][..], &["agent", "--help"][..]] {
        let out = Command::new(&exe).args(args).output().expect("run");
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("--config") && text.contains("--coronafs-nbd"), "{text}");
    }
    let dir = tempfile::tempdir().expect("tmp");
    let bad = |name: &str, sub: &str, body: &str, needle: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).expect("write");
        let out = Command::new(&exe).args([sub, "--config"]).arg(&p).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(err.contains(needle), "{name}: {err}");
    };
    bad("unknown.toml", "serve", "listen = \"127.0.0.1:0\"\nbogus = 1\n", "bogus");
    bad("addr.toml", "serve", "listen = \"127.0.0.1\"\n", "listen");
    bad("worker.toml", "serve", "[[workers]]\nname = \"a\"\nurl = \"nope\"\n", "not an http");
    bad("agent.toml", "agent", "name = \"a\"\nport = 3\n", "port");
    bad("agent-nbd.toml", "agent", "name = \"a\"\ncoronafs_nbd = \"nohost\"\n", "host:port");
    let out = Command::new(&exe).args(["agent", "--listen", "127.0.0.1:99999", "--name", "a"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:99999"));
    // A served agent stops on SIGTERM with status 0.
    let listen = addr();
    let mut agent = spawn_agent("t", listen, "127.0.0.1:1".parse().expect("addr"));
    let http = Http::new();
    let (c, body) = http.call("GET", &format!("http://{listen}/healthz"), None);
    assert_eq!(c, 200);
    assert!(body.as_str().unwrap_or("").contains("ok t"), "{body}");
    agent.signal(libc::SIGTERM);
    let st = agent.wait_exit(Duration::from_secs(20)).expect("agent did not stop on SIGTERM");
    assert!(st.success(), "{st}");
}
