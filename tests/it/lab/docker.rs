//! The 5-node lab of `deploy/docker` on this machine's Docker engine: the
//! image is built from our release binaries (no registry), Compose brings up
//! node01 (CoronaFS + PlasmaVMC), node02..node05 (LightningStor, RF=3, and a
//! `plasmavmc agent` each) and a client on a private network, and the tests
//! drive it across containers: the bench over the container network, a link
//! shaped with tc tbf, a LightningStor node killed during uploads, a node
//! partitioned away and healed, a cross-worker read between two worker
//! containers, a VM migrated between workers, CoronaFS restarted under a
//! running VM, a worker's agent killed during a migration, and node01's
//! CoronaFS killed under a guest writing to a volume with copies on
//! node02 and node03 (automatic failover).
//!
//! Docker, docker-compose, nsenter and tc are required: a missing one fails
//! the test with a message, it never skips. Every Docker resource carries a
//! per-run prefix (`phlab<pid>x<time>`) and is removed when the test ends,
//! pass or fail; resources left by an earlier, killed run are removed first.
//! Only one lab runs at a time (the network has a fixed subnet).

use crate::vmc::common as plasmavmc_common;

use aws_sdk_s3::primitives::ByteStream;
use coronafs::client::NbdClient;
use plasmavmc::client::Client;
use plasmavmc::guest::{BLOCK, written_seq};
use plasmavmc::model::{CreateVm, MigrateVm, VmStatus};
use plasmavmc::wire::WriteLog;
use plasmavmc_common::{Http, make_raw};
use serde_json::json;
use stack_tests::{bin, pattern, require, wait_for_port};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Prefix of every Docker resource these tests create.
const PREFIX: &str = "phlab";
/// The lab's addresses (deploy/docker/compose.yaml).
const NODE01: &str = "10.89.0.11";
const S3_NODES: [(&str, &str); 4] =
    [("node02", "10.89.0.12"), ("node03", "10.89.0.13"), ("node04", "10.89.0.14"), ("node05", "10.89.0.15")];
const KEYS: (&str, &str) = ("lab-access-key", "lab-secret-key-change-me");
/// The API tokens of deploy/docker/config: CoronaFS's control API (node01..
/// node03), PlasmaVMC's REST API and its workers' agents.
const CORONAFS_TOKEN: &str = "lab-coronafs-api-token-change-me";
const PLASMAVMC_TOKEN: &str = "lab-plasmavmc-api-token-change-me";
const AGENT_TOKEN: &str = "lab-plasmavmc-agent-token-change-me";

fn token(t: &str) -> Option<svc_kit::api_token::ApiToken> {
    Some(svc_kit::api_token::ApiToken::new(t).expect("a valid token"))
}
/// The lab's CoronaFS cluster (config/coronafs-cluster.toml): NBD addresses, node01 first.
const CORONAFS_NBD: [&str; 3] = ["10.89.0.11:10809", "10.89.0.12:10809", "10.89.0.13:10809"];
/// Every service of deploy/docker/compose.yaml.
const SERVICES: [&str; 24] = [
    "node01",
    "node01-coronafs",
    "node01-plasmavmc",
    "node01-bench",
    "node02",
    "node02-coronafs",
    "node02-lightningstor",
    "node02-agent",
    "node02-bench",
    "node03",
    "node03-coronafs",
    "node03-lightningstor",
    "node03-agent",
    "node03-bench",
    "node04",
    "node04-lightningstor",
    "node04-agent",
    "node04-bench",
    "node05",
    "node05-lightningstor",
    "node05-agent",
    "node05-bench",
    "client",
    "client-bench",
];
/// The cluster file as the client container sees it.
const CLUSTER_FILE: &str = "/etc/lightningstor-cluster.toml";

/// One lab at a time: the tests of this file take turns.
static ONE_LAB: Mutex<()> = Mutex::new(());

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Runs a command; its output, or None with the reason printed when it failed.
fn try_run(cmd: &mut Command) -> Result<Output, String> {
    let out = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn must(cmd: &mut Command) -> String {
    match try_run(cmd) {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => panic!("{e}"),
    }
}

fn docker(args: &[&str]) -> Command {
    let mut c = Command::new("docker");
    c.args(args);
    c
}

/// Names (or ids) Docker lists for `args`, one per line.
fn listed(args: &[&str]) -> Vec<String> {
    try_run(&mut docker(args))
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(str::to_owned).filter(|l| !l.is_empty()).collect())
        .unwrap_or_default()
}

/// Removes every container, network, volume and image whose name starts
/// with `prefix`: what a killed run left, or this run's own at the end.
fn remove_prefixed(prefix: &str) {
    let containers: Vec<String> =
        listed(&["ps", "-a", "--format", "{{.Names}}", "--filter", &format!("name={prefix}")])
            .into_iter()
            .filter(|n| n.starts_with(prefix))
            .collect();
    if !containers.is_empty() {
        let mut args = vec!["rm", "-f", "-v"];
        args.extend(containers.iter().map(String::as_str));
        let _ = try_run(&mut docker(&args));
    }
    for n in listed(&["network", "ls", "--format", "{{.Name}}", "--filter", &format!("name={prefix}")]) {
        if n.starts_with(prefix) {
            let _ = try_run(&mut docker(&["network", "rm", &n]));
        }
    }
    for v in listed(&["volume", "ls", "--format", "{{.Name}}", "--filter", &format!("name={prefix}")]) {
        if v.starts_with(prefix) {
            let _ = try_run(&mut docker(&["volume", "rm", "-f", &v]));
        }
    }
    for i in listed(&["images", "--format", "{{.Repository}}:{{.Tag}}", "--filter", &format!("reference={prefix}*")]) {
        if i.starts_with(prefix) {
            let _ = try_run(&mut docker(&["rmi", "-f", &i]));
        }
    }
}

/// Fails (never skips) when a tool the lab needs is missing or the engine is down.
fn require_docker() {
    for tool in ["docker", "docker-compose", "nsenter", "tc"] {
        require(tool);
    }
    if let Err(e) = try_run(&mut docker(&["info", "--format", "{{.ServerVersion}}"])) {
        panic!("the lab tests need a running Docker engine (and the right to use it): {e}");
    }
}

/// A running lab; torn down (containers, network, volumes, image) on drop.
struct Lab {
    project: String,
    image: String,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl Lab {
    /// Builds the image and brings the five nodes and the client up.
    fn up() -> Lab {
        let turn = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
        require_docker();
        remove_prefixed(PREFIX);
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let project = format!("{PREFIX}{}x{stamp}", std::process::id());
        let image = format!("{project}:lab");
        let lab = Lab { project, image, _turn: turn };
        let t = Instant::now();
        // Build (or find fresh) every binary the image carries.
        let bins: Vec<PathBuf> =
            ["coronafs", "lightningstor", "plasmavmc", "bench"].iter().map(|b| bin(b, b)).collect();
        let bin_dir = bins[0].parent().expect("target dir").to_path_buf();
        let script = repo().join("deploy/docker/build-image.sh");
        must(
            Command::new("bash")
                .arg(&script)
                .arg("--no-build")
                .arg("--bin-dir")
                .arg(&bin_dir)
                .args(["--tag", &lab.image]),
        );
        eprintln!("lab: image {} built in {:.1} s", lab.image, t.elapsed().as_secs_f64());
        let t = Instant::now();
        // `up -d` returns once the services are healthy (the client depends on
        // them with `condition: service_healthy`); wait-healthy.sh, as
        // docs/deploy.md runs it, then waits for every container, the client
        // and its agent included, to report healthy.
        must(&mut lab.compose(&["up", "-d", "--no-build"]));
        let up = t.elapsed();
        let healthy = must(Command::new("bash").arg(repo().join("deploy/docker/wait-healthy.sh")).args([
            "-p",
            &lab.project,
            "--timeout",
            "180",
        ]));
        assert!(healthy.contains("containers running and healthy"), "{healthy}");
        let mut services: Vec<String> =
            must(&mut lab.compose(&["config", "--services"])).lines().map(str::to_owned).collect();
        services.sort();
        let mut expected: Vec<String> = SERVICES.iter().map(|s| (*s).to_owned()).collect();
        expected.sort();
        assert_eq!(services, expected, "compose.yaml's services changed: update SERVICES");
        let states = lab.health();
        assert!(
            states.len() == SERVICES.len() && states.iter().all(|(_, s)| s == "running healthy"),
            "every container of the lab should run and report healthy: {states:?}"
        );
        eprintln!("lab: {} up -d returned after {:.1} s; {}", lab.project, up.as_secs_f64(), healthy.trim());
        lab
    }

    fn compose(&self, args: &[&str]) -> Command {
        let mut c = Command::new("docker-compose");
        c.arg("-f").arg(repo().join("deploy/docker/compose.yaml")).args(["-p", &self.project]).args(args);
        c.env("LAB_IMAGE", &self.image);
        // The client's fault driver finds the containers by this project name.
        c.env("LAB_PROJECT", &self.project);
        c
    }

    /// The container of a Compose service, found by the labels Compose v1
    /// and v2 both put on it (v1 names it `PROJECT_SERVICE_1`, v2
    /// `PROJECT-SERVICE-1`), as the bench's fault driver finds it; one
    /// `docker ps` instead of a `docker-compose ps -q SERVICE` (the same
    /// answer, a second of Python start-up each).
    fn container(&self, service: &str) -> String {
        let project = format!("label=com.docker.compose.project={}", self.project);
        let service_label = format!("label=com.docker.compose.service={service}");
        let ids = listed(&[
            "ps",
            "-a",
            "-q",
            "--filter",
            &project,
            "--filter",
            &service_label,
            "--filter",
            "label=com.docker.compose.oneoff=False",
        ]);
        assert!(ids.len() == 1, "service {service}: not one container: {ids:?}");
        ids[0].clone()
    }

    /// Every service's container state and health, as `docker inspect` reports them.
    fn health(&self) -> Vec<(String, String)> {
        SERVICES
            .iter()
            .map(|s| {
                let state = must(&mut docker(&[
                    "inspect",
                    "-f",
                    "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}no-healthcheck{{end}}",
                    &self.container(s),
                ]));
                ((*s).to_owned(), state.trim().to_owned())
            })
            .collect()
    }

    /// `docker exec` in a service's container; the output, or the failure.
    fn exec(&self, service: &str, args: &[&str]) -> Result<Output, String> {
        let c = self.container(service);
        let mut all = vec!["exec", c.as_str()];
        all.extend_from_slice(args);
        try_run(&mut docker(&all))
    }

    /// The host pid of a service's main process (to enter its network namespace).
    fn pid(&self, service: &str) -> String {
        must(&mut docker(&["inspect", "-f", "{{.State.Pid}}", &self.container(service)])).trim().to_owned()
    }

    /// Copies a host file into a container.
    fn copy_in(&self, service: &str, from: &Path, to: &str) {
        let dest = format!("{}:{to}", self.container(service));
        must(docker(&["cp"]).arg(from).arg(&dest));
    }

    /// Copies a container file out and reads it.
    fn read_out(&self, service: &str, path: &str) -> String {
        let dir = tempfile::tempdir().expect("tempdir");
        let local = dir.path().join("out");
        must(docker(&["cp", &format!("{}:{path}", self.container(service))]).arg(&local));
        std::fs::read_to_string(&local).expect("copied file")
    }

    /// `lightningstor cluster status` from the client: (nodes up, repair backlog).
    fn cluster_status(&self) -> (usize, Option<u64>, String) {
        match self.exec("client", &["lightningstor", "cluster", "status", "--config", CLUSTER_FILE]) {
            Ok(o) => {
                let text = String::from_utf8_lossy(&o.stdout).into_owned();
                let up = text.lines().filter(|l| l.split_whitespace().nth(4) == Some("up")).count();
                let backlog = text
                    .lines()
                    .find_map(|l| l.strip_prefix("repair backlog: "))
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|n| n.parse().ok());
                (up, backlog, text)
            }
            Err(e) => (0, None, e),
        }
    }

    /// Waits (bounded) until all four nodes answer and no repair is queued.
    fn wait_converged(&self, secs: u64) -> Duration {
        let t = Instant::now();
        loop {
            let (up, backlog, text) = self.cluster_status();
            if up == S3_NODES.len() && backlog == Some(0) {
                return t.elapsed();
            }
            assert!(t.elapsed() < Duration::from_secs(secs), "cluster not converged after {secs} s:\n{text}");
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(o) = try_run(&mut self.compose(&["logs", "--no-color", "--tail", "40"])) {
                eprintln!("lab logs (last lines per service):\n{}", String::from_utf8_lossy(&o.stdout));
            }
        }
        let _ = try_run(&mut self.compose(&["down", "-v", "--remove-orphans", "-t", "5"]));
        remove_prefixed(&self.project);
    }
}

fn s3(ip: &str) -> aws_sdk_s3::Client {
    bench::target::s3_client(&format!("http://{ip}:9000"), "us-east-1", KEYS.0, KEYS.1)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

async fn get(c: &aws_sdk_s3::Client, bucket: &str, key: &str) -> anyhow::Result<Vec<u8>> {
    let out = c.get_object().bucket(bucket).key(key).send().await?;
    Ok(out.body.collect().await?.into_bytes().to_vec())
}

/// Every acknowledged object reads back byte for byte through `ip`.
async fn check_all(ip: &str, bucket: &str, acked: &BTreeMap<String, u64>, size: usize) {
    let c = s3(ip);
    for (key, seed) in acked {
        let body =
            get(&c, bucket, key).await.unwrap_or_else(|e| panic!("acknowledged {key} unreadable via {ip}: {e:#}"));
        assert!(body == pattern(size, *seed), "acknowledged {key} read back different bytes via {ip}");
    }
}

/// 8 writers PUT objects round-robin over the `coordinators` (S3 node
/// addresses) until `count` attempts or `limit`; `during` runs once a third
/// of them are in. The acknowledged keys (with their pattern seed) and the
/// number of failed PUTs.
async fn uploads_with(
    coordinators: Vec<&'static str>,
    bucket: &str,
    count: u64,
    size: usize,
    limit: Duration,
    during: impl FnOnce() + Send + 'static,
) -> (BTreeMap<String, u64>, u64) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let next = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + limit;
    let mut tasks = Vec::new();
    for w in 0..8usize {
        let next = next.clone();
        let bucket = bucket.to_owned();
        let coordinators = coordinators.clone();
        tasks.push(tokio::spawn(async move {
            let (mut acked, mut failed) = (BTreeMap::new(), 0u64);
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= count || Instant::now() > deadline {
                    break;
                }
                let ip = coordinators[(i as usize + w) % coordinators.len()];
                let key = format!("obj-{i:05}");
                let put = s3(ip).put_object().bucket(&bucket).key(&key).body(ByteStream::from(pattern(size, i))).send();
                match tokio::time::timeout(Duration::from_secs(40), put).await {
                    Ok(Ok(_)) => {
                        acked.insert(key, i);
                    }
                    _ => failed += 1,
                }
            }
            (acked, failed)
        }));
    }
    let watch = next.clone();
    let trigger = tokio::task::spawn_blocking(move || {
        let t = Instant::now();
        while watch.load(Ordering::SeqCst) < count / 3 && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(20));
        }
        during();
    });
    let (mut acked, mut failed) = (BTreeMap::new(), 0);
    for t in tasks {
        let (a, f) = t.await.expect("writer");
        acked.extend(a);
        failed += f;
    }
    trigger.await.expect("fault");
    (acked, failed)
}

/// The CI smoke: image, five nodes, every container healthy, `bench
/// fresh-bench-storage --quick --cluster --fault kill:lightningstor@node02`
/// from the client container (the agents do the load; the fault goes
/// through the Docker socket mounted into the client), the same with that
/// node dead from the start, then a
/// LightningStor node killed during parallel uploads: everything
/// acknowledged reads back, and after a restart the cluster converges (all
/// nodes up, no repair queued).
#[test]
fn lab_smoke_bench_over_the_container_network_and_a_node_killed_during_uploads() {
    let _gate = crate::gate::shared();
    let started = Instant::now();
    let lab = Lab::up();

    let t = Instant::now();
    let out = lab
        .exec(
            "client",
            &[
                "bench",
                "fresh-bench-storage",
                "--quick",
                "--cluster",
                "/etc/photoncloud/lab.toml",
                "--fault",
                "kill:lightningstor@node02",
                "--out-dir",
                "/work/bench-out",
            ],
        )
        .unwrap_or_else(|e| panic!("fresh-bench-storage in the client container: {e}"));
    drop(out);
    let results: serde_json::Value =
        serde_json::from_str(&lab.read_out("client", "/work/bench-out/results.json")).expect("results.json");
    let report = lab.read_out("client", "/work/bench-out/storage-benchmarks.md");
    eprintln!("lab: fresh-bench-storage --quick --cluster took {:.1} s", t.elapsed().as_secs_f64());
    assert!(report.contains("lab.toml"), "the report does not name the lab's cluster file:\n{report}");
    assert!(results["cluster"].as_str().is_some_and(|c| c.contains("lab.toml")), "cluster: {}", results["cluster"]);
    for section in ["network", "coronafs", "cross_worker", "s3_large_object", "s3_small_batch", "s3_parallel_batch"] {
        assert_eq!(results[section]["status"], "measured", "section {section} of results.json: {}", results[section]);
    }
    assert_eq!(results["cross_worker"]["verified"], true, "cross-worker read not verified");
    assert_eq!(results["s3_parallel_batch"]["nodes"], 4, "the S3 sections should spread over the four nodes");
    // Measured from the agents on the workers, as in the seed: node04 to
    // CoronaFS on node01, written on node04 and read on node05, S3 from the client.
    let net = &results["network"];
    assert_eq!((net["from"].as_str(), net["to"].as_str()), (Some("node04"), Some("node01")), "{net}");
    // Between two containers: the report must not call it loopback.
    let method = net["method"].as_str().unwrap_or("");
    assert!(method.contains("across the network") && !method.contains("loopback"), "{method}");
    let (probe, iperf3) =
        (net["tcp_mib_s"]["median"].as_f64().unwrap_or(0.0), net["iperf3_mib_s"]["median"].as_f64().unwrap_or(0.0));
    let ratio = net["probe_vs_iperf3"].as_f64().unwrap_or(0.0);
    eprintln!(
        "lab: node04 -> node01: bench probe {probe:.0} MiB/s, iperf3 {iperf3:.0} MiB/s, pairs' median ratio {ratio:.3}"
    );
    assert!(probe > 0.0 && iperf3 > 0.0 && (ratio - 1.0).abs() <= 0.10, "probe and iperf3 disagree: {net}");
    let x = &results["cross_worker"];
    assert_eq!((x["writer"].as_str(), x["reader"].as_str()), (Some("node04"), Some("node05")), "{x}");
    assert!(x["eviction"][0]["Ok"]["resident_before"].as_u64().is_some(), "not evicted: {x}");
    assert!(
        results["coronafs"]["measured_by"].as_str().is_some_and(|m| m.contains("node04")),
        "{}",
        results["coronafs"]
    );
    assert_eq!(results["s3_large_object"]["measured_by"], "client");
    let agents = results["conditions"]["agents"].as_array().expect("agents");
    assert_eq!(agents.len(), 6, "node01..node05 and the client: {agents:?}");
    assert!(agents.iter().all(|a| a["info"].is_object()), "an agent did not answer: {agents:?}");
    // The degraded-cluster section: node02's LightningStor killed by the
    // client through the engine's API (Compose labels of this project), then
    // started again.
    let d = &results["s3_degraded"];
    assert_eq!(d["status"], "measured", "s3_degraded: {d}");
    assert_eq!(
        (d["fault"].as_str(), d["already_down"].as_bool()),
        (Some("kill:lightningstor@node02"), Some(false)),
        "{d}"
    );
    assert!(d["driver"].as_str().is_some_and(|s| s.contains(&lab.project)), "not the lab's Docker driver: {d}");
    assert_eq!(d["driver_errors"].as_array().map(Vec::len), Some(0), "{d}");
    assert!(d["acked"].as_u64().unwrap_or(0) > 0 && d["acked"] == d["verified"], "acknowledged objects lost: {d}");
    assert!(d["time_to_full_redundancy_s"].as_f64().is_some(), "no time back to full redundancy: {d}");
    eprintln!(
        "lab: degraded: before {} / during {} / after {} ops/s, back at full redundancy after {} s",
        d["before"]["ops_per_s"], d["during"]["ops_per_s"], d["after"]["ops_per_s"], d["time_to_full_redundancy_s"]
    );
    // The failover row: a volume with 3 copies made on node01, whose
    // CoronaFS container the client kills (through the engine's API) under
    // a writing client and starts again afterwards.
    let f = &results["coronafs_failover"];
    assert_eq!(f["status"], "measured", "coronafs_failover: {f}");
    let t = &f["trials"][0];
    eprintln!(
        "lab: failover: node01's CoronaFS killed, new primary {} at epoch {}, io pause {} s, reconnect after {} s, \
         {} writes flushed before and {} after, {} lost",
        t["new_primary"],
        t["epoch_after"],
        t["io_pause_s"],
        t["reconnect_s"],
        t["writes_flushed_before"],
        t["writes_flushed_after"],
        t["lost_flushed_writes"]
    );
    assert_eq!(f["passed"], true, "{f}");
    assert_eq!((t["old_primary"].as_str(), t["lost_flushed_writes"].as_u64()), (Some("node01"), Some(0)), "{t}");
    assert!(matches!(t["new_primary"].as_str(), Some("node02" | "node03")), "{t}");
    let notes = t["notes"].to_string();
    assert!(!notes.contains("restarting") && !notes.contains("deleting"), "restart or clean-up failed: {t}");
    let path = f["path"].as_str().unwrap_or("");
    assert!(path.contains("network") && !path.contains("loopback"), "{path}");
    assert_eq!((f["heartbeat_ms"].as_u64(), f["failover_after_ms"].as_u64()), (Some(1000), Some(5000)), "{f}");

    // node02's LightningStor already dead before the run: the run completes,
    // leaves the node out, and reports the whole load as degraded.
    must(&mut docker(&["kill", &lab.container("node02-lightningstor")]));
    let out = lab.exec(
        "client",
        &[
            "bench",
            "fresh-bench-storage",
            "--quick",
            "--cluster",
            "/etc/photoncloud/lab.toml",
            "--fault",
            "kill:lightningstor@node02",
            "--out-dir",
            "/work/bench-dead",
        ],
    );
    if let Err(e) = out {
        panic!("fresh-bench-storage with node02 already dead: {e}");
    }
    let dead: serde_json::Value =
        serde_json::from_str(&lab.read_out("client", "/work/bench-dead/results.json")).expect("results.json");
    let d = &dead["s3_degraded"];
    assert_eq!((d["status"].as_str(), d["already_down"].as_bool()), (Some("measured"), Some(true)), "{d}");
    assert!(d["acked"].as_u64().unwrap_or(0) > 0 && d["acked"] == d["verified"], "{d}");
    assert_eq!(dead["s3_large_object"]["status"], "measured", "{}", dead["s3_large_object"]);
    assert_eq!(dead["s3_large_object"]["nodes"], 3, "the dead node is left out");
    assert!(
        dead["events"].to_string().contains(S3_NODES[0].1),
        "the dead endpoint is not reported: {}",
        dead["events"]
    );
    must(&mut docker(&["start", &lab.container("node02-lightningstor")]));
    wait_for_port(format!("{}:9000", S3_NODES[0].1).parse::<SocketAddr>().expect("addr"), Duration::from_secs(60));
    lab.wait_converged(180);

    let rt = runtime();
    rt.block_on(async {
        s3(S3_NODES[1].1).create_bucket().bucket("smoke").send().await.expect("create bucket");
    });
    let victim = lab.container("node02-lightningstor");
    let coordinators = vec![S3_NODES[1].1, S3_NODES[2].1, S3_NODES[3].1];
    let (acked, failed) =
        rt.block_on(uploads_with(coordinators, "smoke", 240, 256 << 10, Duration::from_secs(120), move || {
            must(&mut docker(&["kill", &victim]));
        }));
    eprintln!("lab: node02's LightningStor killed during uploads: {} acknowledged, {failed} failed", acked.len());
    assert!(acked.len() >= 100, "too few uploads acknowledged with one node of four down ({})", acked.len());
    rt.block_on(check_all(S3_NODES[1].1, "smoke", &acked, 256 << 10));

    must(&mut docker(&["start", &lab.container("node02-lightningstor")]));
    wait_for_port(format!("{}:9000", S3_NODES[0].1).parse::<SocketAddr>().expect("addr"), Duration::from_secs(60));
    let took = lab.wait_converged(180);
    eprintln!("lab: converged {:.1} s after node02 restarted", took.as_secs_f64());
    rt.block_on(check_all(S3_NODES[0].1, "smoke", &acked, 256 << 10));
    drop(lab);
    eprintln!("lab: smoke test wall time {:.1} s", started.elapsed().as_secs_f64());
}

/// A job file for `bench run`, copied into a container.
/// With a `runtime` the job is time-based; without, it ends after `size` bytes.
fn job_file(dir: &Path, name: &str, rw: &str, size: &str, runtime: Option<&str>) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let runtime = runtime.map(|r| format!("runtime = \"{r}\"\n")).unwrap_or_default();
    let text = format!(
        "description = \"lab {name}\"\niterations = 1\n[global]\nsize = \"{size}\"\n{runtime}\
         direct = false\n[[job]]\nname = \"{name}\"\nrw = \"{rw}\"\nbs = \"1M\"\niodepth = 8\n{}",
        if rw == "write" { "fsync = 16\n" } else { "" }
    );
    std::fs::write(&path, text).expect("job file");
    path
}

/// `bench run` in a container; the median bandwidth of its one job in MiB/s.
fn bench_run(lab: &Lab, service: &str, job: &Path, target: &str, side: &str) -> f64 {
    let name = job.file_name().and_then(|n| n.to_str()).expect("name").to_owned();
    lab.copy_in(service, job, &format!("/tmp/{name}"));
    let json = format!("/tmp/{name}.json");
    lab.exec(service, &["bench", "run", "--profile", &format!("/tmp/{name}"), "--target", target, "--json", &json])
        .unwrap_or_else(|e| panic!("bench run in {service}: {e}"));
    let v: serde_json::Value = serde_json::from_str(&lab.read_out(service, &json)).expect("run json");
    let bw = v["jobs"][0][side]["bw_bytes"]["median"].as_f64().unwrap_or_else(|| panic!("no {side} bandwidth in {v}"));
    bw / 1048576.0
}

fn create_volume(lab: &Lab, name: &str, size: &str) {
    lab.exec(
        "client",
        &[
            "coronafs",
            "volume",
            "create",
            name,
            "--size",
            size,
            "--api",
            &format!("http://{NODE01}:7070"),
            "--token",
            CORONAFS_TOKEN,
        ],
    )
    .unwrap_or_else(|e| panic!("creating volume {name}: {e}"));
}

/// Links and partitions: node01's link shaped with tc tbf to 20 MiB/s
/// (measured from the client), the cross-worker read between node02 and
/// node03, and node03 cut off from the network while writes go on, then
/// reconnected: every acknowledged object reads back and the cluster
/// converges.
#[test]
fn lab_shaped_link_cross_worker_read_and_a_partition_healed() {
    let _gate = crate::gate::shared();
    let lab = Lab::up();
    let dir = tempfile::tempdir().expect("tempdir");

    // Cross-worker read: node02 writes the whole volume and flushes, node03
    // reads it (written data, not holes, crosses the network).
    create_volume(&lab, "xworker", "128M");
    let target = format!("nbd://{NODE01}:10809/xworker");
    let w = bench_run(&lab, "node02", &job_file(dir.path(), "xw-write", "write", "128M", None), &target, "write");
    let r = bench_run(&lab, "node03", &job_file(dir.path(), "xw-read", "read", "128M", Some("4s")), &target, "read");
    eprintln!("lab: cross-worker over NBD: node02 writes {w:.0} MiB/s, node03 reads {r:.0} MiB/s");
    assert!(w > 0.0 && r > 0.0);

    // Shaping: node01's egress through tbf at 20 MiB/s, read from the client.
    create_volume(&lab, "shaped", "64M");
    let target = format!("nbd://{NODE01}:10809/shaped");
    bench_run(&lab, "client", &job_file(dir.path(), "shaped-fill", "write", "64M", None), &target, "write");
    let read = job_file(dir.path(), "shaped-read", "read", "64M", Some("4s"));
    let before = bench_run(&lab, "client", &read, &target, "read");
    let pid = lab.pid("node01");
    must(
        Command::new("nsenter")
            .args(["-t", &pid, "-n", "tc", "qdisc", "add", "dev", "eth0", "root", "tbf"])
            .args(["rate", "20mibps", "burst", "256kb", "latency", "100ms"]),
    );
    let shaped = bench_run(&lab, "client", &read, &target, "read");
    must(Command::new("nsenter").args(["-t", &pid, "-n", "tc", "qdisc", "del", "dev", "eth0", "root"]));
    eprintln!("lab: NBD read from node01: {before:.0} MiB/s unshaped, {shaped:.1} MiB/s behind tbf 20 MiB/s");
    assert!((14.0..=22.0).contains(&shaped), "shaped read {shaped:.1} MiB/s is not near 20 MiB/s");
    assert!(before > shaped * 1.5, "the unshaped link ({before:.0} MiB/s) should beat the shaped one");

    // Partition node03 away during writes, then heal.
    let rt = runtime();
    rt.block_on(async {
        s3(S3_NODES[0].1).create_bucket().bucket("partition").send().await.expect("create bucket");
    });
    let net = format!("{}_lab", lab.project);
    let victim = lab.container("node03");
    let coordinators = vec![S3_NODES[0].1, S3_NODES[2].1, S3_NODES[3].1];
    let (acked, failed) =
        rt.block_on(uploads_with(coordinators, "partition", 200, 64 << 10, Duration::from_secs(120), {
            let (net, victim) = (net.clone(), victim.clone());
            move || {
                must(&mut docker(&["network", "disconnect", &net, &victim]));
            }
        }));
    eprintln!("lab: node03 partitioned during uploads: {} acknowledged, {failed} failed", acked.len());
    assert!(acked.len() >= 100, "too few uploads acknowledged with one node cut off ({})", acked.len());
    rt.block_on(check_all(S3_NODES[3].1, "partition", &acked, 64 << 10));
    let (up, _, text) = lab.cluster_status();
    assert_eq!(up, 3, "the partitioned node should show as down:\n{text}");
    must(&mut docker(&["network", "connect", "--ip", "10.89.0.13", &net, &victim]));
    let took = lab.wait_converged(180);
    eprintln!("lab: converged {:.1} s after the partition healed", took.as_secs_f64());
    rt.block_on(check_all(S3_NODES[1].1, "partition", &acked, 64 << 10));
}

/// The running VM's guest I/O on the lab: the attachment as its agent reports it.
fn attachment(http: &Http, worker_ip: &str, vm: &str) -> (u16, serde_json::Value) {
    http.call("GET", &format!("http://{worker_ip}:8090/v1/attachments/{vm}"), None)
}

/// Waits (bounded) until the attachment of `vm` on `worker_ip` acknowledged
/// more than `n` writes; its report.
fn wait_writes(http: &Http, worker_ip: &str, vm: &str, n: u64, what: &str) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        let (c, r) = attachment(http, worker_ip, vm);
        if c == 200 && r["writes_acked"].as_u64().unwrap_or(0) > n {
            return r;
        }
        assert!(c != 200 || r["stopped_by"].is_null(), "{what}: the guest stopped: {r}");
        assert!(t0.elapsed() < Duration::from_secs(90), "{what}: no progress on {worker_ip}: {c} {r}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every logged block of `vm` holds its logged write or a later one, read
/// over NBD from the host on a fresh, epoch-less (read-only) connection.
fn check_vm_log(http: &Http, vm: &str, volume: &str, log: &WriteLog) {
    assert!(!log.is_empty(), "an empty log checks nothing");
    http.rt.block_on(async {
        let c = NbdClient::connect(format!("{NODE01}:10809"), volume).await.expect("connect to the volume");
        for (&block, &seq) in log {
            let data = c.read(block * BLOCK, BLOCK as usize).await.expect("read");
            let got = written_seq(vm, block, &data);
            assert!(got.is_some_and(|s| s >= seq), "block {block}: acknowledged write {seq} lost (holds {got:?})");
        }
    });
}

fn log_of(report: &serde_json::Value) -> WriteLog {
    serde_json::from_value(report["log"].clone()).expect("log")
}

/// A volume with three copies on the lab's three CoronaFS containers
/// (node01 primary), a guest writing and flushing through PlasmaVMC's
/// attachment from this host, and node01's CoronaFS container killed
/// (SIGKILL) under it: a copy on node02 or node03 promotes itself after the
/// cluster's 5 s failover timeout, the attachment finds it and follows the
/// new epoch, the guest goes on, and every write a FLUSH covered before and
/// after the kill reads back. The I/O pause is printed. The containers share
/// this host's CPUs and disk and talk over a Docker bridge: the pause is the
/// failover protocol and its timeouts, not a network's behaviour.
///
/// Beside it, on a second volume with three copies (node01 primary too),
/// unmodified fio (`--ioengine=nbd`, crc32c verify) runs on this host
/// through `plasmavmc nbd-front` (also on this host, reaching the
/// containers over the Docker bridge) across the same kill: fio ends with
/// 0 errors, its read-back of every block it wrote matching, and the
/// front's I/O pause is printed.
#[test]
fn lab_a_replicated_volume_fails_over_when_its_primary_container_is_killed_under_a_writing_guest() {
    let _gate = crate::gate::shared();
    use coronafs::api_client::ApiClient;
    use plasmavmc::guest::{Attachment, MAX_IO_OPS};
    let lab = Lab::up();
    lab.exec(
        "client",
        &[
            "coronafs",
            "volume",
            "create",
            "replicated",
            "--size",
            "256M",
            "--replicas",
            "3",
            "--api",
            &format!("http://{NODE01}:7070"),
            "--token",
            CORONAFS_TOKEN,
        ],
    )
    .unwrap_or_else(|e| panic!("creating a volume with 3 copies: {e}"));
    lab.exec(
        "client",
        &[
            "coronafs",
            "volume",
            "create",
            "fio-replicated",
            "--size",
            "64M",
            "--replicas",
            "3",
            "--api",
            &format!("http://{NODE01}:7070"),
            "--token",
            CORONAFS_TOKEN,
        ],
    )
    .unwrap_or_else(|e| panic!("creating fio's volume with 3 copies: {e}"));
    let rt = runtime();
    let nodes: Vec<String> = CORONAFS_NBD.iter().map(|a| (*a).to_owned()).collect();
    rt.block_on(async {
        let api = ApiClient::new(&format!("http://{NODE01}:7070")).with_token(token(CORONAFS_TOKEN));
        api.fence("fio-replicated", 1).await.expect("fence fio's volume at epoch 1");
    });
    // 64 MiB at 4 MiB/s: fio still writes when node01 is killed, and its
    // verify pass reads every block from the new primary.
    let front = stack_tests::NbdFront::start(&nodes, "fio-replicated", 1);
    let fio_started = Instant::now();
    let mut fio = stack_tests::fio_verify(&front.uri("fio-replicated"), "64m", &["--rate=4m"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start fio");
    let killed = rt.block_on(async {
        let api = ApiClient::new(&format!("http://{NODE01}:7070")).with_token(token(CORONAFS_TOKEN));
        api.fence("replicated", 1).await.expect("fence at epoch 1, as PlasmaVMC does when it attaches");
        let att = Attachment::connect(&nodes, "vm-failover", "host", "replicated", 1, Default::default())
            .await
            .expect("attach through node01");
        att.start_io(MAX_IO_OPS, 0).await.expect("guest I/O");
        let wait_acked = |n: u64, what: &'static str| {
            let att = att.clone();
            async move {
                let t = Instant::now();
                loop {
                    let r = att.report().await;
                    assert!(r.stopped_by.is_none(), "the guest stopped {what}: {r:?}");
                    if r.writes_acked >= n {
                        return r;
                    }
                    assert!(t.elapsed() < Duration::from_secs(120), "no guest progress {what}: {r:?}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        wait_acked(500, "before the kill").await;
        // What a FLUSH covered while node01 was the primary.
        let before = att.flush_report(false).await.expect("flush through node01").log;
        assert!(!before.is_empty());

        assert!(
            fio.try_wait().expect("fio").is_none(),
            "fio ended {:.1} s after its start, before the kill",
            fio_started.elapsed().as_secs_f64()
        );
        let killed = Instant::now();
        must(&mut docker(&["kill", "--signal", "KILL", &lab.container("node01-coronafs")]));
        eprintln!(
            "lab failover: node01's CoronaFS killed {:.1} s after fio started",
            fio_started.elapsed().as_secs_f64()
        );
        // The pause: from the kill until a write is acknowledged on the
        // new connection.
        let t = Instant::now();
        let mut reconnected_at = None;
        let resumed = loop {
            let r = att.report().await;
            assert!(r.stopped_by.is_none(), "the guest stopped at the failover: {r:?}");
            match reconnected_at {
                None if r.reconnects > 0 => reconnected_at = Some((killed.elapsed(), r.writes_acked)),
                Some((_, acked)) if r.writes_acked > acked => break killed.elapsed(),
                _ => {}
            }
            assert!(t.elapsed() < Duration::from_secs(120), "the guest did not resume after node01's kill: {r:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let (reconnected, at_reconnect) = reconnected_at.expect("reconnected");
        eprintln!(
            "lab failover: node01's CoronaFS killed; the attachment reconnected to the new primary after {:.2} s \
             and the guest's next write was acknowledged after {:.2} s (failover_after_ms 5000, heartbeat_ms 1000)",
            reconnected.as_secs_f64(),
            resumed.as_secs_f64()
        );
        wait_acked(at_reconnect + 500, "after the failover").await;
        let after = att.flush_report(true).await.expect("flush through the new primary");
        assert_eq!(after.epoch, 2, "the attachment did not follow the failover's epoch: {after:?}");
        assert!(after.reconnects >= 1, "{after:?}");
        let v = att.verify(&before, false).await.expect("a write flushed before the kill is lost");
        assert_eq!(v.verified as usize, before.len());
        let v = att.verify(&after.log, false).await.expect("a write flushed after the failover is lost");
        assert_eq!(v.verified as usize, after.log.len());
        eprintln!(
            "lab failover: {} blocks flushed before the kill and {} after read back ({} guest writes in all)",
            before.len(),
            after.log.len(),
            after.writes_acked
        );
        // The new primary is one of the other two nodes, at epoch 2, and
        // names the other copies.
        let mut primaries = 0;
        for ip in ["10.89.0.12", "10.89.0.13"] {
            let v = ApiClient::new(&format!("http://{ip}:7070"))
                .with_token(token(CORONAFS_TOKEN))
                .get("replicated")
                .await
                .expect("the volume on a copy");
            eprintln!(
                "lab failover: on {ip}: epoch {}, replicas {:?}, stale {:?}",
                v.epoch, v.replicas, v.stale_replicas
            );
            if !v.replicas.is_empty() {
                assert_eq!(v.epoch, 2, "{v:?}");
                primaries += 1;
            }
        }
        assert_eq!(primaries, 1, "one of node02 and node03 should be the primary");
        drop(att);
        killed
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = fio.try_wait().expect("fio") {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(240), "fio did not finish");
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut text = String::new();
    use std::io::Read;
    fio.stdout.take().expect("fio stdout").read_to_string(&mut text).expect("fio output");
    fio.stderr.take().expect("fio stderr").read_to_string(&mut text).expect("fio errors");
    assert!(status.success(), "fio through nbd-front failed ({status}) across the failover:\n{text}");
    assert!(text.contains("err= 0"), "fio reported errors:\n{text}");
    assert!(!text.contains("verify failed") && !text.contains("bad magic"), "fio reported a verify error:\n{text}");
    let epoch = front.last("reconnected", "epoch");
    let reconnect_ms = front.last("reconnected", "reconnect_ms").expect("the front reconnected");
    let replayed = front.last("reconnected", "replayed_ops").unwrap_or(0);
    let pause = front.last("resumed", "io_pause_ms").expect("a write acknowledged after the reconnect");
    eprintln!(
        "lab failover: fio (64 MiB randwrite at 4 MiB/s, crc32c verify) through plasmavmc nbd-front on the host \
         ended with 0 errors {:.1} s after the kill; the front reconnected at epoch {epoch:?} {reconnect_ms} ms \
         after it noticed the loss, wrote {replayed} unflushed writes again, and its I/O pause (loss noticed to \
         the first write acknowledged after it) was {pause} ms (failover_after_ms 5000, heartbeat_ms 1000)",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(epoch, Some(2), "the front did not follow the failover's epoch");
    let stats: serde_json::Value = serde_json::from_str(&front.stop()).expect("the front's stats");
    assert_eq!(stats["errors"], 0, "{stats}");
}

/// VMs across worker containers: an image uploaded to PlasmaVMC (stored in
/// the LightningStor cluster), a volume from it in CoronaFS on node01, a VM
/// on node02's agent migrated to node03's while its guest writes; CoronaFS
/// killed and restarted under the running VM (the guest reconnects, nothing
/// it flushed is lost); then the VM migrated back while node03's agent is
/// killed: it ends on one worker or in a clear error, and nothing
/// acknowledged and flushed is lost.
#[test]
fn lab_vm_migrates_between_workers_survives_a_coronafs_restart_and_a_killed_worker() {
    let _gate = crate::gate::shared();
    let lab = Lab::up();
    let http = Http::new().with_bearer(AGENT_TOKEN); // its calls go to the agents
    let api = Client::new(&format!("http://{NODE01}:8080")).with_token(token(PLASMAVMC_TOKEN));
    let (w2, w3) = (S3_NODES[0].1, S3_NODES[1].1);

    // Image and volume through the control plane.
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = make_raw(dir.path(), "lab.raw", 41);
    let vol = http.image_volume(&api, "lab-image", std::fs::read(&raw).expect("read raw"));
    let volume = vol.coronafs_volume.clone();

    // A VM on node02, migrated to node03 while it writes.
    let req = CreateVm { volume_id: vol.id.clone(), worker: "node02".into(), io_ops: Some(100000) };
    let id = http.rt.block_on(api.create_vm(&req)).expect("create vm").id;
    wait_writes(&http, w2, &id, 100, "on node02");
    let t = Instant::now();
    let moved = http.rt.block_on(api.migrate_vm(&id, &MigrateVm { worker: "node03".into() })).expect("migrate");
    eprintln!("lab: VM migrated node02 -> node03 in {:.2} s: {moved:?}", t.elapsed().as_secs_f64());
    assert_eq!((moved.worker.as_str(), moved.epoch), ("node03", 2), "{moved:?}");
    assert!(moved.verified_blocks > 0, "{moved:?}");
    assert_eq!(attachment(&http, w2, &id).0, 404, "node02 still holds the VM");

    // CoronaFS killed and restarted under the VM, now on node03 (which ran
    // the few writes a migration hands over; more are started once it is done).
    let t0 = Instant::now();
    while attachment(&http, w3, &id).1["running"] == true {
        assert!(t0.elapsed() < Duration::from_secs(60), "the migrated guest's first writes never ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let io = format!("http://{w3}:8090/v1/attachments/{id}/io");
    let (c, r) = http.call("POST", &io, Some(json!({ "ops": 100000 })));
    assert_eq!(c, 204, "{r}");
    let base = wait_writes(&http, w3, &id, 100, "on node03")["writes_acked"].as_u64().unwrap_or(0);
    let flush = format!("http://{w3}:8090/v1/attachments/{id}/flush");
    let (c, flushed) = http.call("POST", &flush, Some(json!({})));
    assert_eq!(c, 200, "{flushed}");
    let corona = lab.container("node01-coronafs");
    must(&mut docker(&["kill", &corona]));
    std::thread::sleep(Duration::from_millis(500));
    must(&mut docker(&["start", &corona]));
    let t = Instant::now();
    let after = loop {
        let r = wait_writes(&http, w3, &id, base, "across the CoronaFS restart");
        if r["reconnects"].as_u64().unwrap_or(0) >= 1
            && r["writes_acked"].as_u64().unwrap_or(0) > flushed["writes_acked"].as_u64().unwrap_or(0) + 100
        {
            break r;
        }
        assert!(t.elapsed() < Duration::from_secs(90), "the guest did not resume after the restart: {r}");
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "lab: CoronaFS restarted under the VM; guest resumed after {:.1} s ({} reconnects)",
        t.elapsed().as_secs_f64(),
        after["reconnects"]
    );
    // CoronaFS frozen for 2 s (`docker pause`): the guest's requests wait,
    // its connection stays, and it goes on once CoronaFS thaws.
    // A write counts as acknowledged only when CoronaFS answers it, so the
    // count stands still while CoronaFS is frozen (docs/plasmavmc.md). It is
    // read once `docker pause` has returned and replies already on the wire
    // have landed (the count read before the pause command grows by the
    // writes answered while the command runs; an earlier version of this
    // test reported those as "acknowledged while frozen").
    must(&mut docker(&["pause", &corona]));
    std::thread::sleep(Duration::from_millis(300));
    let at_freeze = attachment(&http, w3, &id).1["writes_acked"].as_u64().unwrap_or(0);
    std::thread::sleep(Duration::from_secs(2));
    let frozen = attachment(&http, w3, &id).1["writes_acked"].as_u64().unwrap_or(0);
    must(&mut docker(&["unpause", &corona]));
    assert_eq!(frozen, at_freeze, "writes were acknowledged while CoronaFS was frozen");
    let thawed = wait_writes(&http, w3, &id, frozen + 100, "after CoronaFS was unpaused");
    eprintln!(
        "lab: CoronaFS paused 2 s: no write acknowledged while frozen, then {} more; reconnects {}",
        thawed["writes_acked"].as_u64().unwrap_or(0) - frozen,
        thawed["reconnects"]
    );
    // Paused while reading back (a block read during its rewrite could be torn).
    // What was flushed before the kill is there, and so is the guest's final
    // log (on reconnecting it dropped what it had not flushed: NBD promises
    // only what a FLUSH covered, and CoronaFS drops copy-ups its map never
    // recorded).
    let (c, paused) = http.call("POST", &flush, Some(json!({ "pause": true })));
    assert_eq!(c, 200, "{paused}");
    check_vm_log(&http, &id, &volume, &log_of(&flushed));
    check_vm_log(&http, &id, &volume, &log_of(&paused));
    let (c, r) = http.call("POST", &io, Some(json!({ "ops": 100000 })));
    assert_eq!(c, 204, "{r}");
    wait_writes(&http, w3, &id, paused["writes_acked"].as_u64().unwrap_or(0) + 100, "after the checks");

    // Migrating back to node02 while node03's agent is killed.
    let (c, flushed) = http.call("POST", &format!("http://{w3}:8090/v1/attachments/{id}/flush"), Some(json!({})));
    assert_eq!(c, 200, "{flushed}");
    let acked = log_of(&flushed);
    let migrating = {
        let (api, id) = (api.clone(), id.clone());
        std::thread::spawn(move || Http::new().rt.block_on(api.migrate_vm(&id, &MigrateVm { worker: "node02".into() })))
    };
    std::thread::sleep(Duration::from_millis(5));
    must(&mut docker(&["kill", &lab.container("node03-agent")]));
    let answer = migrating.join().expect("migrate thread");
    let now = http.rt.block_on(api.vm(&id)).expect("get vm");
    eprintln!("lab: migration with node03's agent killed answered {answer:?}; VM now {now:?}");
    if answer.is_ok() {
        assert_eq!((now.worker.as_str(), now.status, now.epoch), ("node02", VmStatus::Running, 3), "{now:?}");
        // Paused before reading back (the migrated guest runs a few writes).
        let (c, r) =
            http.call("POST", &format!("http://{w2}:8090/v1/attachments/{id}/flush"), Some(json!({ "pause": true })));
        assert_eq!(c, 200, "node02 does not hold the migrated VM: {r}");
    } else {
        assert!(
            now.status == VmStatus::Error && now.error_reason.is_some()
                || now.status == VmStatus::Running && now.worker == "node03",
            "{now:?}"
        );
    }
    check_vm_log(&http, &id, &volume, &acked);
}

/// Prefix of the Docker resources of the fault driver's test (apart from the
/// lab's, so neither test's clean-up removes the other's).
const FAULT_PREFIX: &str = "phfault";
/// The fault test's network: fixed, away from the lab's 10.89.0.0/24.
const FAULT_SUBNET: &str = "10.89.42.0/24";
const FAULT_NODE_IP: &str = "10.89.42.12";

/// Removes the fault test's resources when it ends, pass or fail.
struct FaultCleanup(String);

impl Drop for FaultCleanup {
    fn drop(&mut self) {
        remove_prefixed(&self.0);
    }
}

/// A throwaway image holding only `/bin/sleep` and the libraries `ldd` lists
/// for it (as deploy/docker/build-image.sh does for the lab's image).
fn sleep_image(tag: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("root");
    let sleep = Path::new("/bin/sleep");
    let mut files = vec![sleep.to_path_buf()];
    let ldd = must(Command::new("ldd").arg(sleep));
    for line in ldd.lines() {
        let lib = match line.split_once("=> ") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        files.extend(lib.filter(|l| l.starts_with('/')).map(PathBuf::from));
    }
    for f in &files {
        let dest = root.join(f.strip_prefix("/").expect("absolute"));
        std::fs::create_dir_all(dest.parent().expect("parent")).expect("mkdir");
        // The libraries are often symlinks: copy what they point at.
        std::fs::copy(f, &dest).unwrap_or_else(|e| panic!("copying {}: {e}", f.display()));
    }
    let tar = dir.path().join("image.tar");
    must(Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&tar).arg("."));
    must(docker(&["import"]).arg(&tar).arg(tag));
}

fn inspect(container: &str, format: &str) -> String {
    must(&mut docker(&["inspect", "-f", format, container])).trim().to_owned()
}

/// `DockerDriver` against this machine's engine, on containers labelled the
/// way Compose labels the lab's: a node holding a network namespace and an
/// address (`node02`) and a service in that namespace
/// (`node02-lightningstor`). Kill and start, pause and unpause, disconnect
/// and reconnect with the same address each show in `docker inspect`, and
/// `is_down` agrees at every step; unknown targets and engine refusals give
/// errors that say what exists and what the engine said.
#[test]
fn docker_driver_kills_pauses_and_partitions_containers_found_by_compose_labels() {
    let _gate = crate::gate::shared();
    use bench::fault::{DockerDriver, Fault, FaultDriver};
    require("docker");
    require("tar");
    require("ldd");
    if let Err(e) = try_run(&mut docker(&["info", "--format", "{{.ServerVersion}}"])) {
        panic!("the fault driver's test needs a running Docker engine (and the right to use it): {e}");
    }
    remove_prefixed(FAULT_PREFIX);
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let project = format!("{FAULT_PREFIX}{}x{stamp}", std::process::id());
    let _cleanup = FaultCleanup(project.clone());
    let image = format!("{project}:sleep");
    sleep_image(&image);
    let net = format!("{project}_lab");
    must(&mut docker(&["network", "create", "--driver", "bridge", "--subnet", FAULT_SUBNET, &net]));
    let labels = |service: &str, oneoff: &str| {
        vec![
            "--label".to_owned(),
            format!("com.docker.compose.project={project}"),
            "--label".to_owned(),
            format!("com.docker.compose.service={service}"),
            "--label".to_owned(),
            format!("com.docker.compose.oneoff={oneoff}"),
        ]
    };
    let node = format!("{project}_node02_1");
    let service = format!("{project}_node02-lightningstor_1");
    must(
        docker(&["run", "-d", "--name", &node, "--network", &net, "--ip", FAULT_NODE_IP, "--network-alias", "node02"])
            .args(labels("node02", "False"))
            .args([image.as_str(), "sleep", "infinity"]),
    );
    must(
        docker(&["run", "-d", "--name", &service, "--network", &format!("container:{node}")])
            .args(labels("node02-lightningstor", "False"))
            .args([image.as_str(), "sleep", "infinity"]),
    );
    // A one-off `run` of the same service (never started) must not be picked.
    must(
        docker(&["create", "--name", &format!("{project}_node02-lightningstor_run_1"), "--network", "none"])
            .args(labels("node02-lightningstor", "True"))
            .args([image.as_str(), "sleep", "infinity"]),
    );

    let driver = DockerDriver::new("/var/run/docker.sock", project.clone());
    assert_eq!(driver.describe(), format!("Docker engine at /var/run/docker.sock, Compose project {project}"));
    let kill: Fault = "kill:lightningstor@node02".parse().expect("kill");
    let pause: Fault = "pause:lightningstor@node02".parse().expect("pause");
    let partition: Fault = "partition:node02".parse().expect("partition");
    let rt = runtime();
    let down = |f: &Fault| rt.block_on(driver.is_down(f)).unwrap_or_else(|e| panic!("is_down({f}): {e:#}"));
    let apply = |f: &Fault, heal: bool| {
        let r = if heal { rt.block_on(driver.heal(f)) } else { rt.block_on(driver.inject(f)) };
        r.unwrap_or_else(|e| panic!("{} {f}: {e:#}", if heal { "heal" } else { "inject" }));
    };
    for f in [&kill, &pause, &partition] {
        assert!(!down(f), "{f}: down before any fault");
    }

    // kill: SIGKILL (exit 137), then started again.
    apply(&kill, false);
    assert_eq!(inspect(&service, "{{.State.Running}} {{.State.ExitCode}}"), "false 137");
    assert!(down(&kill) && down(&pause), "a killed service is down");
    assert!(!down(&partition), "killing a service leaves its node up");
    let again = rt.block_on(driver.inject(&kill)).expect_err("killing a stopped container");
    assert!(format!("{again:#}").contains("is not running"), "the engine's reason is missing: {again:#}");
    apply(&kill, true);
    assert_eq!(inspect(&service, "{{.State.Running}}"), "true");
    assert!(!down(&kill));
    apply(&kill, true); // healing what runs is a no-op

    // pause: frozen, then thawed.
    apply(&pause, false);
    assert_eq!(inspect(&service, "{{.State.Running}} {{.State.Paused}}"), "true true");
    assert!(down(&pause) && down(&kill), "a paused service is down");
    apply(&pause, true);
    assert_eq!(inspect(&service, "{{.State.Paused}}"), "false");
    assert!(!down(&pause));
    apply(&pause, true);

    // partition: the node off its network, then back with the same address.
    let ip = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}";
    apply(&partition, false);
    assert_eq!(inspect(&node, "{{len .NetworkSettings.Networks}}"), "0", "the node is still on a network");
    assert!(down(&partition), "a partitioned node is down");
    assert!(down(&kill), "a service on a partitioned node is down");
    assert_eq!(inspect(&service, "{{.State.Running}}"), "true", "the partition must not stop the service");
    let twice = rt.block_on(driver.inject(&partition)).expect_err("partitioning twice");
    assert!(format!("{twice:#}").contains("on no network"), "{twice:#}");
    apply(&partition, true);
    assert_eq!(inspect(&node, ip), FAULT_NODE_IP, "reconnected with another address");
    let nets = inspect(&node, "{{json .NetworkSettings.Networks}}");
    assert!(nets.contains(&net) && nets.contains("\"node02\""), "network or alias lost: {nets}");
    assert!(!down(&partition) && !down(&kill));
    apply(&partition, true);

    // Errors: what exists is named; a missing engine is said so.
    let e = rt.block_on(driver.inject(&"kill:lightningstor@node09".parse().expect("parses"))).expect_err("node09");
    let msg = format!("{e:#}");
    assert!(msg.contains("node09-lightningstor") && msg.contains("node02-lightningstor"), "{msg}");
    let other = DockerDriver::new("/var/run/docker.sock", format!("{project}-nosuch"));
    let msg = format!("{:#}", rt.block_on(other.is_down(&kill)).expect_err("no such project"));
    assert!(msg.contains(&project), "the projects present are not listed: {msg}");
    let nowhere = DockerDriver::new("/nonexistent/docker.sock", project.clone());
    let msg = format!("{:#}", rt.block_on(nowhere.is_down(&kill)).expect_err("no engine"));
    assert!(msg.contains("cannot reach the Docker engine at /nonexistent/docker.sock"), "{msg}");
    eprintln!("fault: kill, pause and partition applied and healed through the engine's API ({project})");
}
