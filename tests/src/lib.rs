//! Helpers shared by the integration tests: locating our binaries, checking
//! that the external tools a test needs are installed (a missing tool fails
//! the test, it never skips), and running servers in-process or as processes.

use coronafs::backend::IoEngine;
use coronafs::config::ServerConfig;
use coronafs::service::{self, RunningServer};
use std::io::BufRead;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Both data-path engines: tests that touch the data path run on each.
pub const ENGINES: [IoEngine; 2] = [IoEngine::Uring, IoEngine::Threads];

/// Panics with a clear message if `tool` is not on PATH. CI installs every
/// tool through `.ci/run`; a missing one is a broken environment, not a skip.
pub fn require(tool: &str) {
    let found =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false);
    assert!(found, "`{tool}` is required by this test but not installed; run `bash .ci/run` or apt-get install it");
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Directory holding the binaries of the profile these tests were built with.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test-binary>
    exe.parent().and_then(|d| d.parent()).expect("target dir").to_path_buf()
}

static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Path to one of the workspace's binaries, (re)built once per test process
/// so a test never runs a stale binary (cargo returns at once when it is fresh).
///
/// The build selects the whole workspace with its test targets, as
/// `cargo test --workspace` does, so cargo resolves the same dependency
/// features and reuses what the test build compiled. Building only
/// `-p PACKAGE --bin NAME` leaves dev-dependency features out, which changes
/// the features of shared crates (aws-sdk-s3, sha2, regex, ...) and recompiles
/// them: about seven minutes of CI. `STACK_TESTS_BIN_BUILD=package` builds just
/// the one binary instead, for a quick run of a few tests.
pub fn bin(package: &str, name: &str) -> PathBuf {
    let path = target_dir().join(name);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == name) {
        let release = target_dir().file_name().is_some_and(|n| n == "release");
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        if std::env::var("STACK_TESTS_BIN_BUILD").is_ok_and(|v| v == "package") {
            cmd.args(["build", "-p", package, "--bin", name]);
            built.push(name.to_owned());
        } else {
            cmd.args(["build", "--workspace", "--bins", "--tests"]);
            built.extend(["coronafs", "lightningstor", "plasmavmc", "bench"].map(String::from));
            built.push(name.to_owned());
        }
        // `cargo test` gives the test process the variables it gives build
        // scripts (CARGO_MANIFEST_DIR, CARGO_PKG_*, ...). Passed on, they
        // change the fingerprint of build scripts that watch them (ring's
        // watches CARGO_MANIFEST_DIR), and ring, rustls and aws-sdk-s3 get
        // rebuilt: minutes of CI for nothing. The nested cargo gets the
        // environment a user's shell would have.
        for (k, _) in std::env::vars_os() {
            if let Some(k) = k.to_str()
                && is_cargo_set(k)
            {
                cmd.env_remove(k);
            }
        }
        // The target dir the tests were built in, whatever CARGO_TARGET_DIR says.
        if let Some(dir) = target_dir().parent() {
            cmd.arg("--target-dir").arg(dir);
        }
        if release {
            cmd.arg("--release");
        }
        run(&mut cmd);
    }
    path
}

/// Variables cargo sets for a test process (and build scripts), as opposed
/// to ones a user sets to configure cargo (CARGO_HOME, CARGO_TARGET_DIR, ...).
fn is_cargo_set(k: &str) -> bool {
    ["CARGO_PKG_", "CARGO_CRATE_", "CARGO_BIN_"].iter().any(|p| k.starts_with(p))
        || [
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_PATH",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_RUSTC_CURRENT_DIR",
            "OUT_DIR",
        ]
        .contains(&k)
}

/// A free loopback port (bound then released; fine for tests).
pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct free loopback ports, all held bound until the last is picked
/// (one [`free_port`] after another may return the same port twice).
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N).map(|_| TcpListener::bind("127.0.0.1:0").expect("bind")).collect();
    std::array::from_fn(|i| held[i].local_addr().expect("bound").port())
}

/// Waits until something accepts TCP connections at `addr`.
pub fn wait_for_port(addr: SocketAddr, timeout: Duration) {
    let start = Instant::now();
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(start.elapsed() < timeout, "nothing listening on {addr} after {timeout:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A CoronaFS server running in this process on its own runtime, with a
/// temporary data dir. Shut down on drop.
pub struct Corona {
    pub rt: tokio::runtime::Runtime,
    pub srv: Option<RunningServer>,
    pub dir: tempfile::TempDir,
}

impl Corona {
    pub fn start(engine: IoEngine) -> Self {
        Self::start_with(engine, false)
    }

    pub fn start_with(engine: IoEngine, read_only: bool) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::start_in(dir, engine, read_only)
    }

    pub fn start_in(dir: tempfile::TempDir, engine: IoEngine, read_only: bool) -> Self {
        Self::start_configured(dir, engine, |cfg| cfg.read_only = read_only)
    }

    /// A server whose config `configure` adjusts first (TLS, say).
    pub fn start_configured(
        dir: tempfile::TempDir,
        engine: IoEngine,
        configure: impl FnOnce(&mut ServerConfig),
    ) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let mut cfg = ServerConfig::ephemeral(dir.path(), engine);
        configure(&mut cfg);
        let srv = rt.block_on(service::start(cfg)).expect("start coronafs");
        assert_eq!(srv.engine, engine, "engine fell back unexpectedly");
        Corona { rt, srv: Some(srv), dir }
    }

    pub fn srv(&self) -> &RunningServer {
        self.srv.as_ref().expect("running")
    }

    /// Creates a thin volume through the volume manager.
    pub fn create(&self, name: &str, size: u64) {
        self.rt.block_on(self.srv().volumes.create(name, size)).expect("create volume");
    }

    pub fn uri(&self, name: &str) -> String {
        self.srv().nbd_uri(name)
    }

    pub fn addr(&self) -> SocketAddr {
        self.srv().nbd_addr
    }

    /// The data file a volume's writes land in.
    pub fn path(&self, name: &str) -> PathBuf {
        self.srv().volumes.head_path(name).expect("volume path")
    }
}

impl Drop for Corona {
    fn drop(&mut self) {
        if let Some(s) = self.srv.take() {
            self.rt.block_on(s.shutdown());
        }
    }
}

/// The control API token of every `coronafs serve` [`CoronaProc`] spawns
/// (the same across restarts, so clients made before one still work).
pub const CORONA_TOKEN: &str = "stack-tests-coronafs-api-token-0123";

/// A spawned `coronafs serve` process, its API requiring [`CORONA_TOKEN`]
/// (given in a file, as a deployment would).
pub struct CoronaProc {
    pub child: Child,
    pub nbd: SocketAddr,
    pub api: SocketAddr,
    /// The `--api-token-file` (removed on drop).
    pub token_file: tempfile::NamedTempFile,
}

impl CoronaProc {
    /// A server on two free ports. The ports are released before the server
    /// binds them, so another process may take one in between: a server
    /// that exits before listening is started again on new ports (3 tries).
    pub fn spawn(data_dir: &std::path::Path, engine: IoEngine) -> Self {
        let mut last = String::new();
        for _ in 0..3 {
            let [nbd_port, api_port] = free_ports::<2>();
            let nbd: SocketAddr = format!("127.0.0.1:{nbd_port}").parse().expect("addr");
            let api: SocketAddr = format!("127.0.0.1:{api_port}").parse().expect("addr");
            match Self::try_spawn_at(data_dir, engine, nbd, api) {
                Ok(p) => return p,
                Err(e) => last = e,
            }
        }
        panic!("coronafs did not start in 3 tries: {last}");
    }

    /// A server on given addresses (to restart one where it was).
    pub fn spawn_at(data_dir: &std::path::Path, engine: IoEngine, nbd: SocketAddr, api: SocketAddr) -> Self {
        Self::try_spawn_at(data_dir, engine, nbd, api).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts a server and waits for both its ports; `Err` if it exited first.
    fn try_spawn_at(
        data_dir: &std::path::Path,
        engine: IoEngine,
        nbd: SocketAddr,
        api: SocketAddr,
    ) -> Result<Self, String> {
        let token_file = tempfile::NamedTempFile::new().expect("token file");
        std::fs::write(token_file.path(), format!("{CORONA_TOKEN}\n")).expect("write token file");
        let child = Command::new(bin("coronafs", "coronafs"))
            .args(["serve", "--data-dir"])
            .arg(data_dir)
            .args(["--nbd", &nbd.to_string(), "--api", &api.to_string(), "--io-engine", &engine.to_string()])
            .arg("--api-token-file")
            .arg(token_file.path())
            .env_remove("CORONAFS_API_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn coronafs");
        // Dropped (killed) on an early return.
        let mut p = CoronaProc { child, nbd, api, token_file };
        let start = Instant::now();
        for addr in [nbd, api] {
            while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    return Err(format!("coronafs on {nbd} / {api} exited before listening: {status}"));
                }
                assert!(start.elapsed() < Duration::from_secs(20), "coronafs not listening on {addr} after 20 s");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Both answered; the server is ours if it is still running.
        match p.child.try_wait() {
            Ok(Some(status)) => Err(format!("coronafs on {nbd} / {api} exited: {status}")),
            _ => Ok(p),
        }
    }

    /// The API's token.
    pub fn token(&self) -> svc_kit::api_token::ApiToken {
        svc_kit::api_token::ApiToken::new(CORONA_TOKEN).expect("a valid token")
    }

    /// The typed client of the control API, with the token.
    pub fn client(&self) -> coronafs::api_client::ApiClient {
        coronafs::api_client::ApiClient::new(&format!("http://{}", self.api)).with_token(Some(self.token()))
    }

    /// SIGKILL, no chance to clean up.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for CoronaProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A running `plasmavmc nbd-front` (a child process) and the lines it printed.
pub struct NbdFront {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    lines: Arc<Mutex<Vec<String>>>,
}

impl NbdFront {
    pub fn start(nodes: &[String], volume: &str, epoch: u64) -> NbdFront {
        let mut child = Command::new(bin("plasmavmc", "plasmavmc"))
            .args(["nbd-front", "--listen", "127.0.0.1:0", "--volume", volume])
            .arg(format!("--epoch={epoch}"))
            .arg(format!("--coronafs-nodes={}", nodes.join(",")))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start plasmavmc nbd-front");
        let out = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let keep = lines.clone();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("nbd-front: {l}");
                if let Some(rest) = l.strip_prefix("listening on ") {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
                }
                keep.lock().unwrap_or_else(|e| e.into_inner()).push(l);
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(30)).expect("the front printed `listening on ADDR`");
        NbdFront { child, addr, lines }
    }

    pub fn uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.addr)
    }

    /// The value of `key=` in the last line starting with `word`.
    pub fn last(&self, word: &str, key: &str) -> Option<u64> {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        let l = lines.iter().rev().find(|l| l.starts_with(word))?;
        l.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{key}=")))?.parse().ok()
    }

    /// The front's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then the stats it printed on the way out (JSON).
    pub fn stop(mut self) -> String {
        // SAFETY: a plain kill(2) of our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().expect("wait for the front");
        let t = Instant::now();
        loop {
            let last = self.lines.lock().unwrap_or_else(|e| e.into_inner()).last().cloned().unwrap_or_default();
            if let Some(json) = last.strip_prefix("stopped ") {
                assert!(status.success(), "the front's last FLUSH failed: {status}");
                return json.to_owned();
            }
            assert!(t.elapsed() < Duration::from_secs(10), "no `stopped` line (exit {status}): {last}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NbdFront {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// fio's `nbd` engine writing `size` at random 64 KiB blocks through `uri`
/// and reading every block back with crc32c verify (the first error is fatal).
pub fn fio_verify(uri: &str, size: &str, extra: &[&str]) -> Command {
    let mut c = Command::new("fio");
    c.args([
        "--name=front",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bs=64k",
        "--iodepth=8",
        &format!("--size={size}"),
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--randrepeat=1",
        // fio would otherwise leave its verify state file in the working directory.
        "--verify_state_save=0",
    ])
    .args(extra);
    c
}

/// Resident memory of a process, in MiB.
pub fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib >> 10
}
