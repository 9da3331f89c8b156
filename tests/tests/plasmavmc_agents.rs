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
use plasmavmc_common::{AK, Http, SK, make_raw, qemu_img};
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
        self.http.image_volume(&self.api, &format!("img{seed}"), std::fs::read(&q).expect("read"))
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

/// CoronaFS killed (SIGKILL) and restarted on the same addresses under a
/// running VM: the agent's guest reconnects to the same export and epoch and
/// goes on writing; everything it had flushed before the kill, and after a
/// final flush everything it acknowledged, reads back.
#[test]
fn a_vm_reconnects_when_coronafs_restarts_under_it_and_loses_nothing_flushed() {
    let mut lab = Lab::start();
    let vol = lab.volume(31);
    let name = vol["coronafs_volume"].as_str().expect("name").to_owned();
    let (c, vm) = lab.call("POST", "/v1/vms", Some(json!({ "volume_id": vol["id"], "worker": "a", "io_ops": 100000 })));
    assert_eq!(c, 201, "{vm}");
    let id = vm["id"].as_str().expect("id").to_owned();
    lab.wait_acked(&id, 100);
    let (c, flushed) = lab.agent(0, "POST", &format!("/v1/attachments/{id}/flush"), Some(json!({})));
    assert_eq!(c, 200, "{flushed}");
    let before = flushed["writes_acked"].as_u64().expect("writes_acked");

    let (nbd, api) = (lab.corona.nbd, lab.corona.api);
    let _ = lab.corona.child.kill(); // SIGKILL
    let _ = lab.corona.child.wait();
    std::thread::sleep(Duration::from_millis(500));
    lab.corona = CoronaProc::spawn_at(&lab.dir.path().join("corona"), IoEngine::Threads, nbd, api);

    // The guest goes on: more writes acknowledged after the restart, on a
    // connection it opened again.
    let t0 = Instant::now();
    let report = loop {
        let (c, r) = lab.agent(0, "GET", &format!("/v1/attachments/{id}"), None);
        assert_eq!(c, 200, "{r}");
        if r["reconnects"].as_u64().unwrap_or(0) >= 1 && r["writes_acked"].as_u64().unwrap_or(0) > before + 200 {
            break r;
        }
        assert!(r["stopped_by"].is_null(), "the guest stopped instead of reconnecting: {r}");
        assert!(t0.elapsed() < Duration::from_secs(60), "the guest did not resume after the restart: {r}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(report["epoch"], 1, "{report}");
    // Paused before reading back: a block read while the guest rewrites it
    // could come back torn. The final log holds: on reconnecting the guest
    // dropped what it had not flushed (NBD promises only what a FLUSH
    // covered; CoronaFS drops copy-ups its map never recorded), and its
    // entries from before the kill are a subset of the flushed log's.
    let (c, last) = lab.agent(0, "POST", &format!("/v1/attachments/{id}/flush"), Some(json!({ "pause": true })));
    assert_eq!(c, 200, "{last}");
    lab.check_log(&id, &name, &log_of(&flushed));
    let last = log_of(&last);
    lab.check_log(&id, &name, &last);
    // Writes newer than every entry of the flushed log came after that
    // FLUSH (the guest writes one at a time). (The report's next_seq is
    // read before the log is taken, so it can be older than the log.)
    let flushed = log_of(&flushed);
    let before = flushed.values().max().map_or(0, |s| s + 1);
    for (block, seq) in &last {
        assert!(
            *seq >= before || flushed.get(block) == Some(seq),
            "block {block}: write {seq} from before the kill was never flushed but is still in the log"
        );
    }
    // The reconnect cut the log back to what a FLUSH covered, so an entry
    // newer than the flushed log was written after the reconnect (more than
    // 200 were) or covered by the guest's own FLUSH before the kill. (Not
    // "newer than the report": the guest may write nothing between the
    // report and the pause, e.g. while a FLUSH is in flight; a CI run failed
    // that way.)
    assert!(last.values().any(|&s| s >= before), "no write after the reconnect in the log");
}
