//! Shared fixtures for the LightningStor tests: an in-process server plugged
//! straight into aws-sdk-s3, and the real `lightningstor` binary spawned on a
//! loopback port.

use aws_credential_types::Credentials;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use lightningstor::{Config, Store};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const AK: &str = "test-access-key";
pub const SK: &str = "test-secret-key-0123456789";

/// An aws-sdk-s3 client for `endpoint` with the given keys.
pub fn sdk_config(endpoint: &str, ak: &str, sk: &str) -> aws_sdk_s3::config::Builder {
    aws_sdk_s3::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new(ak, sk, None, None, "test"))
        .endpoint_url(endpoint)
        .force_path_style(true)
}

/// A store and its s3s service in this process.
pub struct InProcess {
    pub dir: tempfile::TempDir,
    pub store: Arc<Store>,
    pub service: s3s::service::S3Service,
}

impl InProcess {
    /// A server with keys [`AK`]/[`SK`].
    pub fn new() -> Self {
        Self::with(|c| c.with_keys(AK, SK))
    }

    /// A server with a configuration adjusted by `f`.
    pub fn with(f: impl FnOnce(Config) -> Config) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = f(Config::new(dir.path()));
        let store = Store::open(cfg).expect("open store");
        let service = lightningstor::server::service(store.clone());
        InProcess { dir, store, service }
    }

    /// A client signing with `ak`/`sk`, path style.
    pub fn client_with(&self, ak: &str, sk: &str) -> Client {
        let conf = sdk_config("http://localhost:9000", ak, sk)
            .http_client(testkit::sdk::InProcess::from(self.service.clone()))
            .build();
        Client::from_conf(conf)
    }

    /// A client with the right keys.
    pub fn client(&self) -> Client {
        self.client_with(AK, SK)
    }

    /// Sends a raw request to the service.
    pub async fn raw(&self, req: http::Request<s3s::Body>) -> http::Response<s3s::Body> {
        match self.service.call(req).await {
            Ok(r) => r,
            Err(e) => panic!("service failed: {e:?}"),
        }
    }
}

/// The S3 error code of a failed SDK call.
pub fn code<E: ProvideErrorMetadata, R>(e: &SdkError<E, R>) -> String {
    e.as_service_error().and_then(|s| s.code()).map(str::to_owned).unwrap_or_else(|| "<no code>".to_owned())
}

/// The whole body of a raw response.
pub async fn bytes_of(resp: http::Response<s3s::Body>) -> Vec<u8> {
    use http_body_util::BodyExt;
    match resp.into_body().collect().await {
        Ok(c) => c.to_bytes().to_vec(),
        Err(e) => panic!("body: {e}"),
    }
}

/// The HTTP status of a failed SDK call.
pub fn status<E, R: HasStatus>(e: &SdkError<E, R>) -> u16 {
    e.raw_response().map(HasStatus::status).unwrap_or(0)
}

pub trait HasStatus {
    fn status(&self) -> u16;
}

impl HasStatus for aws_smithy_runtime_api::http::Response {
    fn status(&self) -> u16 {
        self.status().as_u16()
    }
}

/// Deterministic pseudo-random bytes (the workspace's shared test pattern).
pub use stack_tests::pattern as pseudo_random;

/// Where cargo put the `lightningstor` binary; (re)built once per test process.
pub fn binary() -> PathBuf {
    stack_tests::bin("lightningstor", "lightningstor")
}

/// The real binary running on a loopback port.
pub struct Spawned {
    pub child: Child,
    pub addr: String,
}

impl Spawned {
    /// Starts `lightningstor serve --data-dir DIR --listen 127.0.0.1:0 EXTRA...`
    /// with keys [`AK`]/[`SK`] in the environment, and waits until it listens.
    pub fn start(data_dir: &Path, extra: &[&str]) -> Self {
        let mut cmd = Command::new(binary());
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"]).arg(data_dir).args(extra);
        Self::launch(cmd, "lightningstor")
    }

    /// Runs `cmd` (a `lightningstor serve ...`) with the test keys and waits
    /// for its "listening on ADDR" line.
    fn launch(cmd: Command, what: &str) -> Self {
        Self::launch_keys(cmd, what, true)
    }

    /// `lightningstor serve --anonymous` with no key at all (none in the environment).
    pub fn start_anonymous_without_keys(data_dir: &Path) -> Self {
        let mut cmd = Command::new(binary());
        cmd.args(["serve", "--anonymous", "--listen", "127.0.0.1:0", "--data-dir"]).arg(data_dir);
        Self::launch_keys(cmd, "lightningstor", false)
    }

    fn launch_keys(mut cmd: Command, what: &str, keys: bool) -> Self {
        if keys {
            cmd.env("LIGHTNINGSTOR_ACCESS_KEY", AK).env("LIGHTNINGSTOR_SECRET_KEY", SK);
        } else {
            cmd.env_remove("LIGHTNINGSTOR_ACCESS_KEY").env_remove("LIGHTNINGSTOR_SECRET_KEY");
        }
        let mut child = cmd
            .env("RUST_LOG", "warn,s3s=off")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on ") {
                    let _ = tx.send(a.to_owned());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!("{what} did not start listening within 60 s");
            }
        };
        Spawned { child, addr }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn client(&self) -> Client {
        Client::from_conf(sdk_config(&self.endpoint(), AK, SK).build())
    }

    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("pid")
    }

    /// kill -9.
    pub fn kill9(mut self) {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(self.pid(), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(mut self) {
        // SAFETY: sending a signal to our own child process.
        unsafe {
            libc::kill(self.pid(), libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every block file under a data dir.
pub fn block_files(data_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(shards) = std::fs::read_dir(data_dir.join("blocks")) else {
        return out;
    };
    for shard in shards.flatten() {
        if shard.file_name() == "tmp" {
            continue;
        }
        if let Ok(files) = std::fs::read_dir(shard.path()) {
            out.extend(files.flatten().map(|f| f.path()));
        }
    }
    out
}

/// A cluster of nodes in this process; its client sends each request to the
/// next node in turn, so consecutive operations have different coordinators.
pub struct InCluster {
    pub dir: tempfile::TempDir,
    pub cluster: testkit::lightningstor::TestCluster,
}

impl InCluster {
    /// `n` nodes with keys [`AK`]/[`SK`], default quorums.
    pub fn new(n: usize) -> Self {
        Self::with(n, |_| {})
    }

    /// `n` nodes with the cluster file adjusted by `f`.
    pub fn with(n: usize, f: impl FnOnce(&mut lightningstor::cluster::ClusterConfig)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let cluster = testkit::lightningstor::TestCluster::start(dir.path(), n, |c| {
            c.access_key = Some(AK.into());
            c.secret_key = Some(SK.into());
            c.anonymous = false;
            c.scrub_blocks_per_sec = 0;
            c.anti_entropy_secs = 0;
            f(c);
        })
        .expect("start cluster");
        InCluster { dir, cluster }
    }

    /// The S3 service whose requests rotate over every node.
    pub fn service(&self) -> s3s::service::S3Service {
        let coords = self.cluster.ids().into_iter().map(|i| self.cluster.coordinator(i)).collect();
        let s3 = lightningstor::cluster::s3::ClusterS3::rotating(coords);
        lightningstor::server::service_for(s3, &self.cluster.node(1).store.config, self.cluster.coordinator(1))
    }

    /// A client whose requests rotate over every node.
    pub fn client(&self) -> Client {
        let svc = self.service();
        let conf = sdk_config("http://localhost:9000", AK, SK).http_client(testkit::sdk::InProcess::from(svc)).build();
        Client::from_conf(conf)
    }

    /// A client talking to node `id` only.
    pub fn client_of(&self, id: u8) -> Client {
        let conf = sdk_config("http://localhost:9000", AK, SK)
            .http_client(testkit::sdk::InProcess::from(self.cluster.service(id)))
            .build();
        Client::from_conf(conf)
    }
}

/// A cluster of spawned `lightningstor serve --config FILE --node NAME` processes.
pub struct SpawnedCluster {
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    pub config: lightningstor::cluster::ClusterConfig,
    pub nodes: Vec<Option<Spawned>>,
    pub spares: Vec<lightningstor::cluster::config::NodeConfig>,
}

/// A base port with `n` free ports at `base..` and `base + 100..`, below
/// the kernel's ephemeral range (32768..) so that no outgoing connection
/// takes one while a node is down. Each call (and each attempt) tries a new
/// range: clusters started by concurrent tests of one process never share one.
fn free_base_port(n: usize) -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    for _ in 0..200u32 {
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = 20_000 + ((std::process::id() * 7 + k * 211) % 12_000) as u16;
        let all_free = (0..n as u16).all(|i| {
            std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", base + 100 + i)).is_ok()
        });
        if all_free {
            return base;
        }
    }
    panic!("no free port range found");
}

impl SpawnedCluster {
    /// Writes a cluster file with `lightningstor cluster init` and starts every node.
    pub fn start(n: usize, adjust: impl FnOnce(&mut lightningstor::cluster::ClusterConfig)) -> Self {
        Self::start_with_spares(n, 0, adjust)
    }

    /// Starts `n` nodes of a file made for `n + spares`; the spare nodes'
    /// entries are kept in `spares` (free addresses) for a layout change.
    pub fn start_with_spares(
        n: usize,
        spares: usize,
        adjust: impl FnOnce(&mut lightningstor::cluster::ClusterConfig),
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let total = n + spares;
        let base = free_base_port(total);
        let out = Command::new(binary())
            .args(["cluster", "init", "--nodes", &total.to_string(), "--base-port", &base.to_string(), "--base-dir"])
            .arg(dir.path())
            .output()
            .expect("run cluster init");
        assert!(out.status.success(), "cluster init failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).expect("utf-8 config");
        let mut config = lightningstor::cluster::ClusterConfig::from_toml(&text).expect("init prints a valid file");
        let spares = config.nodes.split_off(n);
        if config.replication_factor > n {
            config.replication_factor = n;
        }
        adjust(&mut config);
        let config_path = dir.path().join("cluster.toml");
        std::fs::write(&config_path, config.to_toml()).expect("write config");
        let mut c = SpawnedCluster { dir, config_path, config, nodes: Vec::new(), spares };
        for i in 0..n {
            let s = c.spawn(i);
            c.nodes.push(Some(s));
        }
        c
    }

    fn spawn(&self, i: usize) -> Spawned {
        let name = &self.config.nodes[i].name;
        let mut cmd = Command::new(binary());
        cmd.args(["serve", "--config"]).arg(&self.config_path).args(["--node", name]);
        Spawned::launch(cmd, &format!("node {name}"))
    }

    /// kill -9 node `i` (0-based).
    /// Replaces the cluster file (what nodes started from now on read).
    pub fn set_config(&mut self, config: lightningstor::cluster::ClusterConfig) {
        std::fs::write(&self.config_path, config.to_toml()).expect("write config");
        self.config = config;
    }

    /// Starts node `i` of the current file, which must not be running.
    pub fn add(&mut self, i: usize) {
        let s = self.spawn(i);
        while self.nodes.len() <= i {
            self.nodes.push(None);
        }
        self.nodes[i] = Some(s);
    }

    /// Runs the `lightningstor` binary with `args` and returns its status and output.
    pub fn cli(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(binary()).args(args).env("RUST_LOG", "warn").output().expect("run lightningstor");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    pub fn kill(&mut self, i: usize) {
        if let Some(s) = self.nodes[i].take() {
            s.kill9();
        }
    }

    /// Starts node `i` again on its data.
    pub fn restart(&mut self, i: usize) {
        let s = self.spawn(i);
        self.nodes[i] = Some(s);
    }

    /// A client of node `i`.
    pub fn client(&self, i: usize) -> Client {
        self.nodes[i].as_ref().expect("node running").client()
    }

    /// The value of a metric of node `i` (from /metrics).
    pub fn metric(&self, i: usize, name: &str) -> Option<f64> {
        let addr = &self.nodes[i].as_ref()?.addr;
        let text = http_get(addr, "/metrics")?;
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
    }
}

/// A plain HTTP/1.0 GET on loopback; the body, if the status is 200.
pub fn http_get(addr: &str, path: &str) -> Option<String> {
    http_get_headers(addr, path, "")
}

/// [`http_get`] with `Authorization: Bearer TOKEN` (an API that needs a token).
pub fn http_get_with_token(addr: &str, path: &str, token: &str) -> Option<String> {
    http_get_headers(addr, path, &format!("Authorization: Bearer {token}\r\n"))
}

fn http_get_headers(addr: &str, path: &str, headers: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200")
        .then(|| body.to_owned())
        .or_else(|| head.starts_with("HTTP/1.0 200").then(|| body.to_owned()))
}

/// Runs `lightningstor ARGS` with `env` set; (success, stdout, stderr).
pub fn run_cli(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let out = Command::new(binary())
        .args(args)
        .env_remove("LIGHTNINGSTOR_ACCESS_KEY")
        .env_remove("LIGHTNINGSTOR_SECRET_KEY")
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run lightningstor");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The id and secret `lightningstor key create` printed.
pub fn new_key(out: &str) -> (String, String) {
    let field = |name: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
            .unwrap_or_else(|| panic!("no {name:?} in {out:?}"))
    };
    (field("key id:"), field("secret key:"))
}

/// A client of `endpoint` (`http://host:port`) signing with `id`/`secret`.
pub fn client_of(endpoint: &str, id: &str, secret: &str) -> Client {
    Client::from_conf(sdk_config(endpoint, id, secret).build())
}

/// Runs `lightningstor ARGS` aimed at one server: (success, stdout, stderr).
pub type CliFn<'a> = dyn Fn(&[&str]) -> (bool, String, String) + 'a;

/// Keys and permissions through the CLI and aws-sdk-s3, against any server:
/// `cli(args)` runs `lightningstor ARGS` aimed at it (admin key included),
/// `endpoints` are S3 endpoints of it (a cluster: several nodes; keys made
/// through the first must work on every one). Leaves key `bob` (read on
/// bucket `adminb`) behind for the caller.
pub async fn keys_and_permissions(cli: &CliFn<'_>, endpoints: &[String]) -> (String, String) {
    let ok = |args: &[&str]| {
        let (good, out, err) = cli(args);
        assert!(good, "lightningstor {args:?} failed: {err}");
        out
    };
    let admin = client_of(&endpoints[0], AK, SK);
    admin.create_bucket().bucket("adminb").send().await.expect("admin creates a bucket");
    admin.put_object().bucket("adminb").key("k").body(b"admin data".to_vec().into()).send().await.expect("put");

    let (id, secret) = new_key(&ok(&["key", "create", "alice"]));
    assert!(id.starts_with("LS") && id.len() == 26 && secret.len() == 40, "{id} {secret}");
    let (again, _, err) = cli(&["key", "create", "alice"]);
    assert!(!again && err.contains("exists already"), "names are unique: {err}");
    let alice = client_of(&endpoints[0], &id, &secret);

    // A new key sees and touches nothing of another's bucket.
    let listed = alice.list_buckets().send().await.expect("a new key may list");
    assert!(listed.buckets().is_empty(), "{listed:?}");
    let e = alice.get_object().bucket("adminb").key("k").send().await.expect_err("no permission");
    assert_eq!(code(&e), "AccessDenied");
    let e = alice.put_object().bucket("adminb").key("x").body(b"x".to_vec().into()).send().await.expect_err("no");
    assert_eq!(code(&e), "AccessDenied");

    // Its own bucket it owns, and it lists only that one.
    alice.create_bucket().bucket("aliceb").send().await.expect("a key may create a bucket");
    alice.put_object().bucket("aliceb").key("a").body(b"mine".to_vec().into()).send().await.expect("own bucket");
    let listed = alice.list_buckets().send().await.expect("list");
    let names: Vec<_> = listed.buckets().iter().filter_map(|b| b.name()).collect();
    assert_eq!(names, ["aliceb"]);
    let all = admin.list_buckets().send().await.expect("list");
    assert_eq!(all.buckets().len(), 2, "the admin key sees every bucket");

    // read: GET and list, but no PUT, no delete of the bucket.
    let (good, _, err) = cli(&["bucket", "allow", "--read", "nosuch", "--key", "alice"]);
    assert!(!good && err.contains("nosuch"), "{err}");
    let out = ok(&["bucket", "allow", "--read", "adminb", "--key", "alice"]);
    assert!(out.contains("adminb: read"), "{out}");
    for (i, ep) in endpoints.iter().enumerate() {
        let c = client_of(ep, &id, &secret);
        let got =
            c.get_object().bucket("adminb").key("k").send().await.unwrap_or_else(|e| panic!("read on {i}: {e:?}"));
        assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), b"admin data");
        let l = c.list_objects_v2().bucket("adminb").send().await.expect("list with read");
        assert_eq!(l.key_count(), Some(1));
        let e =
            c.put_object().bucket("adminb").key("x").body(b"x".to_vec().into()).send().await.expect_err("read only");
        assert_eq!(code(&e), "AccessDenied", "endpoint {i}");
    }
    let e = alice.delete_bucket().bucket("adminb").send().await.expect_err("not the owner");
    assert_eq!(code(&e), "AccessDenied");
    // A copy needs read on the source and write on the target.
    let e = alice.copy_object().bucket("adminb").key("c").copy_source("aliceb/a").send().await.expect_err("no write");
    assert_eq!(code(&e), "AccessDenied");
    alice.copy_object().bucket("aliceb").key("c").copy_source("adminb/k").send().await.expect("read to own bucket");
    let listed = alice.list_buckets().send().await.expect("list");
    assert_eq!(listed.buckets().len(), 2, "a grant makes the bucket visible");

    let out = ok(&["key", "list"]);
    let line = out.lines().find(|l| l.starts_with(&id)).unwrap_or_else(|| panic!("{id} not listed: {out}"));
    assert!(
        line.contains("alice") && line.contains("adminb(read)") && line.contains("aliceb(read,write,owner)"),
        "{line}"
    );
    ok(&["bucket", "deny", "--read", "adminb", "--key", &id]);
    let e = alice.get_object().bucket("adminb").key("k").send().await.expect_err("revoked");
    assert_eq!(code(&e), "AccessDenied");

    // Unknown keys, and a deleted one, are InvalidAccessKeyId everywhere.
    let stranger = client_of(&endpoints[0], "LS000000000000000000000000", "nope");
    assert_eq!(code(&stranger.list_buckets().send().await.expect_err("unknown")), "InvalidAccessKeyId");
    let out = ok(&["key", "delete", "alice"]);
    assert!(out.contains(&id), "{out}");
    for ep in endpoints {
        let e = client_of(ep, &id, &secret).list_buckets().send().await.expect_err("deleted key");
        assert_eq!(code(&e), "InvalidAccessKeyId");
    }
    assert!(!ok(&["key", "list"]).contains(&id));

    // The creator's grant goes with the bucket: another key creating the
    // same name later does not find alice's grants (they are gone anyway),
    // and the admin key can still delete what alice left.
    admin.delete_object().bucket("aliceb").key("a").send().await.expect("admin may do everything");
    admin.delete_object().bucket("aliceb").key("c").send().await.expect("admin");
    admin.delete_bucket().bucket("aliceb").send().await.expect("admin deletes the bucket");

    let (bob, bob_secret) = new_key(&ok(&["key", "create", "bob"]));
    ok(&["bucket", "allow", "--read", "adminb", "--key", &bob]);
    (bob, bob_secret)
}
