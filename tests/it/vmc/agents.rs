//! PlasmaVMC as processes: `coronafs serve`, `lightningstor serve`,
//! `plasmavmc serve` with two `plasmavmc agent` workers, all spawned from
//! their binaries. A VM is created on agent A from a qemu-img image,
//! migrated to B and verified; then agent A is killed with SIGKILL during a
//! migration, and nothing acknowledged and flushed is lost. Also the
//! `serve` and `agent` commands themselves: --help, TOML configs, bad
//! configs, SIGTERM.

use crate::vmc::common as plasmavmc_common;

use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use plasmavmc::PlasmaError;
use plasmavmc::client::Client;
use plasmavmc::guest::{BLOCK, written_seq};
use plasmavmc::model::{CreateImage, CreateVm, Image, MigrateVm, Status, Vm, VmStatus, Volume};
use plasmavmc::wire::{FlushReq, Report, WriteLog};
use plasmavmc::worker::Worker;
use plasmavmc::worker::remote::{RemoteWorker, http_client};
use plasmavmc_common::{AK, Http, SK, make_raw, qemu_img};
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

/// The agents' API token (agent A takes it from the environment, B from
/// its config file; the control plane's agent_token).
const AGENT_TOKEN: &str = "stack-tests-agent-api-token-0123";
/// The control plane's REST API token (from its api_token_file).
const VMC_TOKEN: &str = "stack-tests-plasmavmc-api-token-01";

fn token(t: &str) -> Option<svc_kit::api_token::ApiToken> {
    Some(svc_kit::api_token::ApiToken::new(t).expect("a valid token"))
}

fn spawn_agent(name: &str, listen: SocketAddr, nbd: SocketAddr) -> Proc {
    let p = spawn(Command::new(plasmavmc()).env("PLASMAVMC_AGENT_TOKEN", AGENT_TOKEN).args([
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
    vmc_cfg: PathBuf,
    ls_addr: SocketAddr,
    api: Client,
    agents: Vec<(Option<Proc>, RemoteWorker)>,
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
        let [a_addr, b_addr] = stack_tests::free_ports::<2>().map(|p| SocketAddr::from(([127, 0, 0, 1], p)));
        let a = spawn_agent("a", a_addr, corona.nbd);
        // Agent B reads its settings from a TOML file.
        let b_cfg = dir.path().join("agent-b.toml");
        std::fs::write(
            &b_cfg,
            format!(
                "listen = \"{b_addr}\"\nname = \"b\"\ncoronafs_nbd = \"{}\"\napi_token = \"{AGENT_TOKEN}\"\n",
                corona.nbd
            ),
        )
        .expect("write agent config");
        let b = spawn(Command::new(plasmavmc()).args(["agent", "--config"]).arg(&b_cfg));
        wait_for_port(b_addr, Duration::from_secs(20));
        let vmc_addr = addr();
        let cfg = dir.path().join("plasmavmc.toml");
        let token_file = dir.path().join("plasmavmc.token");
        std::fs::write(&token_file, format!("{VMC_TOKEN}\n")).expect("write token file");
        std::fs::write(
            &cfg,
            format!(
                "listen = \"{vmc_addr}\"\ndata_dir = \"{}\"\ns3_endpoint = \"http://{ls_addr}\"\ns3_bucket = \"images\"\n\
                 s3_access_key = \"{AK}\"\ns3_secret_key = \"{SK}\"\ncoronafs_api = \"http://{}\"\ncoronafs_nbd = \"{}\"\n\
                 part_size = 5242880\nfetch_chunk = 1048576\napi_token_file = \"{}\"\n\
                 coronafs_api_token = \"{}\"\nagent_token = \"{AGENT_TOKEN}\"\n\n\
                 [[workers]]\nname = \"a\"\nurl = \"http://{a_addr}\"\n\n[[workers]]\nname = \"b\"\nurl = \"http://{b_addr}\"\n",
                dir.path().join("vmc").display(),
                corona.api,
                corona.nbd,
                token_file.display(),
                stack_tests::CORONA_TOKEN,
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
            vmc_cfg: cfg,
            ls_addr,
            api: Client::new(&format!("http://{vmc_addr}")).with_token(token(VMC_TOKEN)),
            agents: vec![
                (
                    Some(a),
                    RemoteWorker::new("a", &format!("http://{a_addr}"), http_client()).with_token(token(AGENT_TOKEN)),
                ),
                (
                    Some(b),
                    RemoteWorker::new("b", &format!("http://{b_addr}"), http_client()).with_token(token(AGENT_TOKEN)),
                ),
            ],
        }
    }

    /// Runs `f` on the lab's runtime.
    fn run<F: std::future::Future>(&self, f: F) -> F::Output {
        self.http.rt.block_on(f)
    }

    /// A VM on `worker`, running `io_ops` guest writes.
    fn create_vm(&self, volume: &Volume, worker: &str, io_ops: u64) -> plasmavmc::Result<Vm> {
        let req = CreateVm { volume_id: volume.id.clone(), worker: worker.into(), io_ops: Some(io_ops) };
        self.run(self.api.create_vm(&req))
    }

    fn vm(&self, id: &str) -> Vm {
        self.run(self.api.vm(id)).expect("get vm")
    }

    fn migrate(&self, id: &str, to: &str) -> plasmavmc::Result<Vm> {
        self.run(self.api.migrate_vm(id, &MigrateVm { worker: to.into() }))
    }

    /// Agent `i`'s flush report of `vm`.
    fn flush(&self, i: usize, vm: &str, pause: bool) -> Report {
        self.run(self.agents[i].1.flush(vm, FlushReq { pause })).expect("flush")
    }

    /// `plasmavmc serve` killed with SIGKILL and started again on its config.
    fn kill9_and_restart_vmc(&mut self) {
        self.vmc.signal(libc::SIGKILL);
        assert!(self.vmc.wait_exit(Duration::from_secs(10)).is_some(), "plasmavmc did not die");
        self.vmc = spawn(Command::new(plasmavmc()).args(["serve", "--config"]).arg(&self.vmc_cfg));
        let addr: SocketAddr = self.api.base().trim_start_matches("http://").parse().expect("addr");
        wait_for_port(addr, Duration::from_secs(30));
    }

    /// Multipart uploads open in the artifact bucket, with their part counts.
    fn open_uploads(&self) -> Vec<(String, usize)> {
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .credentials_provider(aws_credential_types::Credentials::new(AK, SK, None, None, "test"))
            .endpoint_url(format!("http://{}", self.ls_addr))
            .force_path_style(true)
            .build();
        let s3 = aws_sdk_s3::Client::from_conf(conf);
        self.http.rt.block_on(async {
            let list = s3.list_multipart_uploads().bucket("images").send().await.expect("list uploads");
            let mut out = Vec::new();
            for u in list.uploads() {
                let (key, id) = (u.key().unwrap_or_default(), u.upload_id().unwrap_or_default());
                let parts = s3.list_parts().bucket("images").key(key).upload_id(id).send().await.expect("list parts");
                out.push((key.to_owned(), parts.parts().len()));
            }
            out
        })
    }

    /// A qcow2 image made by qemu-img, uploaded; a volume from it, available.
    fn volume(&self, seed: u64) -> Volume {
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
            let v = self.vm(vm);
            if v.writes_acked >= n {
                return;
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "guest made no progress: {v:?}");
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

#[test]
fn a_vm_migrates_between_agent_processes_and_a_killed_source_loses_nothing_acknowledged() {
    let _gate = crate::gate::shared();
    let mut lab = Lab::start();
    let vol = lab.volume(21);
    let name = vol.coronafs_volume.clone();
    // Unknown workers are refused with the configured list.
    let e = lab.create_vm(&vol, "zz", 0).expect_err("refused");
    assert_eq!(e.api_status(), Some(400), "{e}");
    assert!(e.to_string().contains("configured workers"), "{e}");
    // VM on A, migrated to B while its guest writes.
    let vm = lab.create_vm(&vol, "a", 4000).expect("create vm");
    let id = vm.id.clone();
    assert_eq!((vm.epoch, vm.status), (1, VmStatus::Running), "{vm:?}");
    lab.wait_acked(&id, 50);
    let moved = lab.migrate(&id, "b").expect("migrate");
    assert_eq!((moved.worker.as_str(), moved.epoch), ("b", 2), "{moved:?}");
    assert!(moved.verified_blocks > 0, "{moved:?}");
    assert!(moved.notice.is_none(), "{moved:?}");
    // A let go of it; B holds it, and its flushed log reads back.
    let e = lab.run(lab.agents[0].1.report(&id)).expect_err("refused");
    assert!(matches!(&e, PlasmaError::Worker { message, .. } if message.contains("404")), "{e}");
    let rep = lab.flush(1, &id, false);
    assert_eq!(rep.epoch, 2);
    lab.check_log(&id, &name, &rep.log);
    // An open that declares the old epoch is refused by CoronaFS.
    let stale = lab.http.rt.block_on(NbdClient::connect(lab.corona.nbd, &format!("{name};epoch=1")));
    assert!(stale.is_err(), "an epoch-1 open of a volume at epoch 2 was accepted");

    // A second VM on A: its acknowledged, flushed log is taken, then A is
    // killed while the VM migrates to B.
    let vol2 = lab.volume(22);
    let name2 = vol2.coronafs_volume.clone();
    let id2 = lab.create_vm(&vol2, "a", 100000).expect("create vm").id;
    lab.wait_acked(&id2, 100);
    let flushed = lab.flush(0, &id2, false);
    let acked = flushed.log.clone();
    lab.wait_acked(&id2, flushed.writes_acked + 20);
    let (api, id_) = (lab.api.clone(), id2.clone());
    let migrating =
        std::thread::spawn(move || Http::new().rt.block_on(api.migrate_vm(&id_, &MigrateVm { worker: "b".into() })));
    std::thread::sleep(Duration::from_millis(3));
    let mut a = lab.agents[0].0.take().expect("agent a");
    a.signal(libc::SIGKILL);
    let _ = a.wait_exit(Duration::from_secs(10));
    let after = migrating.join().expect("migrate thread");
    let now = lab.vm(&id2);
    match after {
        // Completed: running on B at a new epoch (with a notice if A's flush was lost).
        Ok(_) => assert_eq!((now.worker.as_str(), now.status, now.epoch), ("b", VmStatus::Running, 2), "{now:?}"),
        // Or a clear error, never a VM silently half-moved.
        Err(e) => {
            assert!(e.api_status().is_some() && !e.to_string().is_empty(), "{e}");
            assert!(
                now.status == VmStatus::Error && now.error_reason.is_some()
                    || now.status == VmStatus::Running && now.worker == "a",
                "{now:?}"
            );
        }
    }
    lab.check_log(&id2, &name2, &acked);
    // With A gone, migrating onto it fails cleanly and leaves the first VM on B.
    let e = lab.migrate(&id, "a").expect_err("refused");
    assert_eq!(e.api_status(), Some(502), "{e}");
    assert!(e.to_string().contains("worker a"), "{e}");
    let vm = lab.vm(&id);
    assert_eq!((vm.worker.as_str(), vm.status), ("b", VmStatus::Running), "{vm:?}");
    // The control plane stops cleanly on SIGTERM.
    lab.vmc.signal(libc::SIGTERM);
    let st = lab.vmc.wait_exit(Duration::from_secs(20)).expect("plasmavmc serve did not stop on SIGTERM");
    assert!(st.success(), "{st}");
}

#[test]
fn serve_and_agent_explain_themselves_refuse_bad_configs_and_stop_on_sigterm() {
    let _gate = crate::gate::shared();
    let exe = plasmavmc();
    for args in [&["serve", "--help"][..], &["agent", "--help"][..]] {
        let out = Command::new(&exe).args(args).output().expect("run");
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("--config") && text.contains("--coronafs-nbd"), "{text}");
        assert!(text.contains("--api-token-file") && text.contains("--no-api-token"), "{text}");
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
    // Errors from reading and parsing name the file, and the line and column.
    let at = |name: &str, line_col: &str| format!("{}:{line_col}", dir.path().join(name).display());
    bad(
        "unknown.toml",
        "serve",
        "listen = \"127.0.0.1:0\"\nbogus = 1\n",
        &at("unknown.toml", "2:1: unknown field `bogus`"),
    );
    bad("agent.toml", "agent", "name = \"a\"\nport = 3\n", &at("agent.toml", "2:1: unknown field `port`"));
    bad("syntax.toml", "serve", "s3_bucket = \"b\"\n\n[[workers]\n", &at("syntax.toml", "3:"));
    bad("syntax.toml", "agent", "name = \"a\"\n\n[[workers]\n", &at("syntax.toml", "3:"));
    for sub in ["serve", "agent"] {
        let missing = dir.path().join("missing.toml");
        let out = Command::new(&exe).args([sub, "--config"]).arg(&missing).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sub}: {err}");
        assert!(err.contains(&format!("cannot read {}", missing.display())), "{sub}: {err}");
    }
    let out = Command::new(&exe).args(["agent", "--listen", "127.0.0.1:99999", "--name", "a"]).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("127.0.0.1:99999"));
    // A served agent stops on SIGTERM with status 0.
    let listen = addr();
    let mut agent = spawn_agent("t", listen, "127.0.0.1:1".parse().expect("addr"));
    let http = Http::new();
    let (c, body) = http.call("GET", &format!("http://{listen}/healthz"), None);
    assert_eq!(c, 200, "health is open without the token");
    assert!(body.as_str().unwrap_or("").contains("ok t"), "{body}");
    // Everything else needs the agent's token: nothing is attached without it.
    let attach = serde_json::json!({"vm_id": "v", "volume": "x", "epoch": 1});
    let call = |auth: Option<&str>, method: &str, path: &str, body: Option<&serde_json::Value>| {
        http.rt.block_on(async {
            let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
            let mut req = http.c.request(m, format!("http://{listen}{path}"));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            if let Some(b) = body {
                req = req.json(b);
            }
            let resp = req.send().await.expect("send");
            let www = resp.headers().get("www-authenticate").is_some();
            (resp.status().as_u16(), www, resp.text().await.expect("body"))
        })
    };
    for auth in [None, Some("Bearer wrong-agent-token-0123456789")] {
        for (method, path, body) in [
            ("POST", "/v1/attachments", Some(&attach)),
            ("GET", "/v1/attachments", None),
            ("DELETE", "/v1/attachments/v", None),
        ] {
            let (code, www, text) = call(auth, method, path, body);
            assert_eq!((code, www), (401, true), "{method} {path} {auth:?}: {text}");
            assert!(text.contains("unauthorized"), "{text}");
        }
    }
    let (code, _, text) = call(Some(&format!("Bearer {AGENT_TOKEN}")), "GET", "/v1/attachments", None);
    assert_eq!((code, text.as_str()), (200, "[]"), "the refused attach made nothing");
    // Off loopback without a token the agent and the server refuse to start.
    let none = dir.path().join("none").display().to_string();
    for args in [
        &["agent", "--listen", "0.0.0.0:0", "--name", "z"][..],
        &["serve", "--listen", "0.0.0.0:0", "--data-dir", &none],
    ] {
        let out = Command::new(&exe)
            .args(args)
            .env_remove("PLASMAVMC_AGENT_TOKEN")
            .env_remove("PLASMAVMC_API_TOKEN")
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("no API token is set"), "{args:?}: {err}");
        assert!(err.contains("--no-api-token"), "{err}");
    }
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
    let _gate = crate::gate::shared();
    let mut lab = Lab::start();
    let vol = lab.volume(31);
    let name = vol.coronafs_volume.clone();
    let id = lab.create_vm(&vol, "a", 100000).expect("create vm").id;
    lab.wait_acked(&id, 100);
    let flushed = lab.flush(0, &id, false);
    let before = flushed.writes_acked;

    let (nbd, api) = (lab.corona.nbd, lab.corona.api);
    let _ = lab.corona.child.kill(); // SIGKILL
    let _ = lab.corona.child.wait();
    std::thread::sleep(Duration::from_millis(500));
    lab.corona = CoronaProc::spawn_at(&lab.dir.path().join("corona"), IoEngine::Threads, nbd, api);

    // The guest goes on: more writes acknowledged after the restart, on a
    // connection it opened again.
    let t0 = Instant::now();
    let report = loop {
        let r = lab.run(lab.agents[0].1.report(&id)).expect("report");
        if r.reconnects >= 1 && r.writes_acked > before + 200 {
            break r;
        }
        assert!(r.stopped_by.is_none(), "the guest stopped instead of reconnecting: {r:?}");
        assert!(t0.elapsed() < Duration::from_secs(60), "the guest did not resume after the restart: {r:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(report.epoch, 1, "{report:?}");
    // Paused before reading back: a block read while the guest rewrites it
    // could come back torn. The final log holds: on reconnecting the guest
    // dropped what it had not flushed (NBD promises only what a FLUSH
    // covered; CoronaFS drops copy-ups its map never recorded), and its
    // entries from before the kill are a subset of the flushed log's.
    let last = lab.flush(0, &id, true).log;
    lab.check_log(&id, &name, &flushed.log);
    lab.check_log(&id, &name, &last);
    // Writes newer than every entry of the flushed log came after that
    // FLUSH (the guest writes one at a time). (The report's next_seq is
    // read before the log is taken, so it can be older than the log.)
    let flushed = flushed.log;
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

/// kill -9 in the middle of an upload used to leave its multipart upload in
/// LightningStor forever (also after the image was deleted), and kill -9
/// during a first-time create left the qcow2 scratch file in the data dir.
/// The restarted server cleans both up, and deleting an image does too.
#[test]
fn kill_9_during_an_upload_leaves_no_multipart_upload_or_scratch_file_behind() {
    let _gate = crate::gate::shared();
    use std::io::Write;
    let mut lab = Lab::start();
    let img: Image =
        lab.run(lab.api.create_image(&CreateImage { name: "cut".into(), ..Default::default() })).expect("image");
    let id = img.id;
    // Announce 64 MiB, send 12 MiB (two 5 MiB parts leave), keep the connection.
    let mut conn = std::net::TcpStream::connect(lab.api.base().trim_start_matches("http://")).expect("connect");
    let head = format!("PUT /v1/images/{id}/file HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {VMC_TOKEN}\r\n");
    write!(conn, "{head}Content-Length: {}\r\n\r\n", 64u64 << 20).expect("head");
    conn.write_all(&stack_tests::pattern(12 << 20, 9)).expect("body");
    let t0 = Instant::now();
    while !lab.open_uploads().iter().any(|(k, n)| k.ends_with(&id) && *n >= 2) {
        assert!(t0.elapsed() < Duration::from_secs(30), "parts never reached LightningStor: {:?}", lab.open_uploads());
        std::thread::sleep(Duration::from_millis(50));
    }
    // Scratch files of fills a crash interrupted: one of this image, one of an image since gone.
    let scratch = lab.dir.path().join("vmc").join("scratch");
    std::fs::create_dir_all(&scratch).expect("mkdir");
    std::fs::write(scratch.join("img-gone.qcow2"), b"half a fill").expect("write");
    lab.kill9_and_restart_vmc();
    drop(conn);
    let img = lab.run(lab.api.image(&id)).expect("image");
    assert_eq!(img.status, Status::Error, "{img:?}");
    let t0 = Instant::now();
    while !lab.open_uploads().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "left in LightningStor: {:?}", lab.open_uploads());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!scratch.join("img-gone.qcow2").exists(), "a scratch file survived the restart");
    // Leftovers found later (a crash the start-up did not see) go with the image.
    std::fs::write(scratch.join(format!("{id}.qcow2")), b"half a fill").expect("write");
    lab.run(lab.api.delete_image(&id)).expect("delete image");
    assert!(!scratch.join(format!("{id}.qcow2")).exists(), "deleting the image left its scratch file");
    // The server works on.
    lab.volume(31);
}

/// CoronaFS frozen (SIGSTOP, what `docker pause` does): the agent
/// acknowledges no write while it is frozen (a write is acknowledged only
/// when CoronaFS answers it), and a FLUSH asked of the agent does not
/// complete until CoronaFS has answered it. After the thaw the FLUSH
/// completes and every write its report lists reads back.
#[test]
fn a_flush_does_not_complete_while_coronafs_is_frozen() {
    let _gate = crate::gate::shared();
    let lab = Lab::start();
    let vol = lab.volume(41);
    let name = vol.coronafs_volume.clone();
    let id = lab.create_vm(&vol, "a", 100000).expect("create vm").id;
    lab.wait_acked(&id, 100);
    let pid = lab.corona.child.id() as i32;
    let acked = || lab.run(lab.agents[0].1.report(&id)).expect("report").writes_acked;
    // SAFETY: signalling our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // Replies already on their way when the signal landed may still arrive.
    std::thread::sleep(Duration::from_millis(300));
    let at_freeze = acked();
    let flush = {
        let (agent, id) = (lab.agents[0].1.clone(), id.clone());
        std::thread::spawn(move || Http::new().rt.block_on(agent.flush(&id, FlushReq::default())))
    };
    std::thread::sleep(Duration::from_secs(2));
    let frozen = acked();
    let flush_done_while_frozen = flush.is_finished();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert!(!flush_done_while_frozen, "a FLUSH completed while CoronaFS was frozen");
    assert_eq!(frozen, at_freeze, "writes were acknowledged while CoronaFS was frozen");
    let report = flush.join().expect("flush thread").expect("flush");
    assert!(report.writes_acked >= frozen, "{report:?}");
    let last = lab.flush(0, &id, true);
    lab.check_log(&id, &name, &report.log);
    lab.check_log(&id, &name, &last.log);
}
