//! README.md's "Running the stack by hand" as a newcomer runs it: every
//! fenced block marked `<!-- by-hand: NAME -->`, in order, in one bash, as
//! written. Only the variables the README documents for that (`DEMO_DIR`,
//! `S3_PORT`, `NBD_PORT`, `CORONAFS_API_PORT`, `PLASMAVMC_PORT`) are set
//! beforehand, to a temporary directory and free ports, so the run never
//! meets another process on the default ports.
//!
//! The `build` block is the one not run: the test builds the same binaries
//! through `stack_tests::bin` (a nested `cargo build -p ...` would compile
//! shared crates again with other features, minutes of CI) and runs the
//! blocks in a directory whose `target/release` is the test build's. It
//! checks instead that the block builds every binary the others call.

use stack_tests::{bin, require, target_dir};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The variables the README lets a reader set before its blocks.
const PORT_VARS: [&str; 4] = ["S3_PORT", "NBD_PORT", "CORONAFS_API_PORT", "PLASMAVMC_PORT"];
/// The README's default ports: no block may use them except through the variables.
const DEFAULT_PORTS: [&str; 5] = ["3900", "3901", "3902", "10809", "7070"];
/// How long the whole sequence may take.
const LIMIT: Duration = Duration::from_secs(90);

/// The `(name, body)` of every fenced block preceded by `<!-- by-hand: NAME -->`.
fn by_hand_blocks(readme: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line.trim().strip_prefix("<!-- by-hand:").and_then(|r| r.strip_suffix("-->")) else {
            continue;
        };
        let fence = lines.find(|l| !l.trim().is_empty()).unwrap_or_default();
        assert!(fence.starts_with("```"), "<!-- by-hand:{name}--> is not followed by a fenced block but {fence:?}");
        let body: Vec<&str> = lines.by_ref().take_while(|l| !l.starts_with("```")).collect();
        blocks.push((name.trim().to_owned(), body.join("\n")));
    }
    blocks
}

fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// A base port with `base..base+3` and `base+100..base+103` free (the
/// LightningStor nodes' S3 and RPC ports), in the dynamic range.
fn s3_base() -> u16 {
    for _ in 0..200 {
        let base = stack_tests::free_port();
        if base > 65000 || base < 20000 {
            continue;
        }
        if (0..3).all(|i| port_free(base + i) && port_free(base + 100 + i)) {
            return base;
        }
    }
    panic!("no free run of ports for the LightningStor nodes");
}

/// Kills the blocks' process group (the servers they started) when the test ends.
struct Group(i32);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a negative pid signals the process group this
        // test created for the script; no memory is involved.
        unsafe {
            libc::kill(-self.0, libc::SIGKILL);
        }
    }
}

#[test]
fn readme_by_hand_blocks_run_in_order_as_written() {
    let _gate = crate::gate::shared();
    for tool in ["bash", "nbdinfo", "qemu-img", "qemu-io", "curl", "jq"] {
        require(tool);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
    let readme = std::fs::read_to_string(repo.join("README.md")).expect("README.md");
    let blocks = by_hand_blocks(&readme);
    let names: Vec<&str> = blocks.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["build", "setup", "lightningstor", "coronafs", "plasmavmc", "stop"], "README's by-hand blocks");

    // The build block builds every binary the other blocks run.
    let build = &blocks[0].1;
    assert!(build.starts_with("cargo build --release "), "{build}");
    let rest: String = blocks[1..].iter().map(|(_, b)| b.as_str()).collect::<Vec<_>>().join("\n");
    for b in ["coronafs", "lightningstor", "plasmavmc", "bench"] {
        if rest.contains(&format!("./target/release/{b} ")) {
            assert!(build.contains(&format!("-p {b}")), "the build block does not build {b}: {build}");
        }
        bin(b, b);
    }
    // Ports only through the variables: a default port written into a
    // command would reach whatever listens there on this machine.
    let setup_line = blocks[1].1.lines().next().unwrap_or_default();
    for (name, body) in &blocks[1..] {
        for line in body.lines().filter(|l| *l != setup_line) {
            for p in DEFAULT_PORTS {
                assert!(!line.contains(p), "block {name} uses port {p} directly: {line}");
            }
        }
    }

    // A directory whose target/release is this build's, and the variables.
    let work = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(work.path().join("target")).expect("mkdir target");
    std::os::unix::fs::symlink(target_dir(), work.path().join("target/release")).expect("symlink");
    let demo = work.path().join("demo");
    let s3 = s3_base();
    let mut ports = vec![s3];
    while ports.len() < PORT_VARS.len() {
        let p = stack_tests::free_port();
        if !ports.contains(&p) && !(s3..s3 + 3).contains(&p) && !(s3 + 100..s3 + 103).contains(&p) {
            ports.push(p);
        }
    }
    let script = format!("set -euo pipefail\nset -x\n{rest}\n");
    let mut cmd = Command::new("bash");
    cmd.arg("-c").arg(&script).current_dir(work.path()).env("DEMO_DIR", &demo);
    for (var, port) in PORT_VARS.iter().zip(&ports) {
        cmd.env(var, port.to_string());
    }
    // Nothing the README does not set: a reader's shell has none of these.
    for var in [
        "PLASMAVMC_API",
        "LIGHTNINGSTOR_ACCESS_KEY",
        "LIGHTNINGSTOR_SECRET_KEY",
        "RUST_LOG",
        "CORONAFS_API_TOKEN",
        "PLASMAVMC_API_TOKEN",
    ] {
        cmd.env_remove(var);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let t = Instant::now();
    let child = cmd.spawn().expect("bash");
    let _group = Group(i32::try_from(child.id()).expect("pid"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(LIMIT) {
        Ok(r) => r.expect("bash ran"),
        Err(_) => panic!("README's by-hand blocks did not finish within {LIMIT:?}"),
    };
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("README by-hand blocks: {:.1} s, exit {}\n{stdout}", t.elapsed().as_secs_f64(), out.status);
    assert!(out.status.success(), "README's by-hand blocks failed:\nstdout:\n{stdout}\nstderr:\n{stderr}");

    // What the reader is told to expect.
    assert!(stdout.contains("ok http://127.0.0.1:"), "no healthcheck answered:\n{stdout}");
    let up = stdout.lines().filter(|l| l.split_whitespace().nth(4) == Some("up")).count();
    assert_eq!(up, 3, "cluster status should show the three nodes up:\n{stdout}");
    assert!(stdout.contains("without the token: 401"), "the control API took a request without its token:\n{stdout}");
    assert!(stdout.contains("flattened vm2 (4194304 bytes allocated, no parent)"), "{stdout}");
    assert!(stdout.contains("export-size: 1073741824"), "nbdinfo of the PlasmaVMC volume (1 GiB) missing:\n{stdout}");
    assert!(stdout.contains("/v1/volumes"), "PlasmaVMC's OpenAPI paths missing:\n{stdout}");
    assert!(!demo.exists(), "the stop block leaves {}", demo.display());
    assert!(t.elapsed() < LIMIT);
}
