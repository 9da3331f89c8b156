//! The `coronafs` binary as a process: the CLI over its control API, and
//! kill -9 right after FLUSH or FUA replies, then restart: every acknowledged
//! durable byte must be there.

use coronafs::client::NbdClient;
use stack_tests::{CoronaProc, ENGINES, bin, pattern};
use std::process::Command;

fn cli(api: std::net::SocketAddr, args: &[&str]) -> std::process::Output {
    Command::new(bin("coronafs", "coronafs"))
        .arg("volume")
        .args(args)
        .args(["--api", &format!("http://{api}")])
        .env("CORONAFS_API_TOKEN", stack_tests::CORONA_TOKEN) // the CLI's environment variable
        .output()
        .expect("run coronafs volume")
}

#[test]
fn the_cli_creates_lists_and_explains_errors() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let p = CoronaProc::spawn(dir.path(), coronafs::backend::IoEngine::Threads);
    let out = cli(p.api, &["create", "vm-disk", "--size", "4G"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let layers: Vec<std::fs::Metadata> = std::fs::read_dir(dir.path().join("layers"))
        .expect("layers dir")
        .map(|e| e.expect("entry").metadata().expect("metadata"))
        .collect();
    assert_eq!(layers.len(), 1, "one data file for a new volume");
    assert_eq!(layers[0].len(), 4 << 30);
    assert!(std::os::unix::fs::MetadataExt::blocks(&layers[0]) < 64, "a new volume is thin");
    let out = cli(p.api, &["list"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("vm-disk"));
    for (args, needle) in [
        (vec!["create", "vm-disk", "--size", "1G"], "already exists"),
        (vec!["create", "../etc", "--size", "1G"], "invalid volume name"),
        (vec!["create", "x", "--size", "12Q"], "unknown unit"),
        (vec!["show", "missing"], "not found"),
    ] {
        let out = cli(p.api, &args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(needle), "{args:?}: {err}");
    }
    // Traffic shows up in the Prometheus metrics on the API address.
    let nbd = p.nbd;
    tokio::runtime::Runtime::new().expect("rt").block_on(async move {
        let c = NbdClient::connect(nbd, "vm-disk").await.expect("connect");
        c.write(0, &[1; 4096], false).await.expect("write");
        c.read(0, 4096).await.expect("read");
        let _ = c.read(5 << 30, 1).await;
    });
    let metrics = http_get(p.api, "/metrics");
    for needle in [
        "coronafs_nbd_requests_total{op=\"write\"} 1",
        "coronafs_nbd_bytes_total{op=\"read\"} 4096",
        "coronafs_nbd_errors_total{op=\"read\"} 1",
        "coronafs_nbd_request_duration_seconds_bucket{op=\"read\",le=\"+Inf\"} 2",
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
    let out = cli("127.0.0.1:1".parse().expect("addr"), &["list"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach the control API"));
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect API");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("send");
    let mut body = String::new();
    s.read_to_string(&mut body).expect("read");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

async fn write_then_make_durable(addr: std::net::SocketAddr, round: u64, use_fua: bool) -> Vec<(u64, Vec<u8>)> {
    let c = NbdClient::connect(addr, "disk").await.expect("connect");
    let mut written = Vec::new();
    for i in 0..48u64 {
        let off = (i * 7919 + round * 131) % 60 * (1 << 20) + i * 512;
        let data = pattern(64 << 10, round * 1000 + i);
        c.write(off, &data, use_fua).await.expect("write");
        written.push((off, data));
    }
    if !use_fua {
        c.flush().await.expect("flush");
    }
    written
}

#[test]
fn flushed_and_fua_writes_survive_kill_9_and_restart() {
    let _gate = crate::gate::shared();
    for engine in ENGINES {
        let dir = tempfile::tempdir().expect("tmp");
        // What the volume must hold: every acknowledged write, in order.
        let mut model = vec![0u8; 64 << 20];
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        for round in 0..3u64 {
            let p = CoronaProc::spawn(dir.path(), engine);
            if round == 0 {
                let out = cli(p.api, &["create", "disk", "--size", "64M"]);
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            }
            let nbd = p.nbd;
            // Check everything acknowledged before the previous kill.
            rt.block_on(async {
                let c = NbdClient::connect(nbd, "disk").await.expect("connect after restart");
                for off in (0..model.len()).step_by(4 << 20) {
                    let got = c.read(off as u64, 4 << 20).await.expect("read");
                    assert!(
                        got == model[off..off + (4 << 20)],
                        "{engine}: data in the 4 MiB at {off} lost across kill -9"
                    );
                }
            });
            for (off, data) in rt.block_on(write_then_make_durable(nbd, round, round % 2 == 1)) {
                model[off as usize..off as usize + data.len()].copy_from_slice(&data);
            }
            // Kill right after the last FLUSH / FUA reply.
            p.kill9();
        }
    }
}

#[test]
fn serve_refuses_a_bad_config_file_naming_the_file_and_the_line() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tmp");
    let serve = |file: &std::path::Path| {
        let out =
            Command::new(bin("coronafs", "coronafs")).args(["serve", "--config"]).arg(file).output().expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let missing = dir.path().join("missing.toml");
    let (code, err) = serve(&missing);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("cannot read {}", missing.display())), "{err}");

    let syntax = dir.path().join("syntax.toml");
    std::fs::write(&syntax, "data_dir = \"/tmp/x\"\nnbd = = \"127.0.0.1:0\"\n").expect("write");
    let (code, err) = serve(&syntax);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("{}:2:", syntax.display())), "path and line: {err}");

    let unknown = dir.path().join("unknown.toml");
    std::fs::write(&unknown, "data_dir = \"/tmp/x\"\n\ndata-dir = \"/tmp/y\"\n").expect("write");
    let (code, err) = serve(&unknown);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("{}:3:1: unknown field `data-dir`", unknown.display())), "{err}");
}
