//! `plasmavmc nbd-front` (the binary, as a child process) between real NBD
//! clients and CoronaFS: fio's `nbd` engine verifying crc32c while the
//! primary of a volume with 3 copies (a child process) is SIGKILLed under
//! it, and clients that break the protocol or ask for what the front does
//! not forward.

use bench::cluster::corona_procs::CoronaProcs;
use bench::fault::{Fault, FaultDriver, FaultKind};
use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use coronafs::proto::handshake::{self, ClientOption};
use coronafs::proto::request::Command;
use coronafs::proto::{NbdErrno, client_flags, cmd_flags, opt, rep};
use stack_tests::{Corona, NbdFront as Front, bin, fio_verify as fio, require, run};
use std::io::{Read, Write};
use std::process::{Command as Proc, Stdio};
use std::time::{Duration, Instant};

/// The stats line a stopped front printed, parsed.
fn stopped(front: Front) -> serde_json::Value {
    serde_json::from_str(&front.stop()).expect("stats JSON")
}

const MIB: u64 = 1 << 20;

/// A volume with 3 copies on 3 CoronaFS child processes (as the bench's
/// failover row runs them: 250 ms heartbeats, 1.5 s failover timeout), fio writing 64 MiB through the front at 8 MiB/s
/// with crc32c verify; the primary is SIGKILLed 2 s in. The front follows
/// the failover (epoch 2), writes again what no FLUSH had covered, and fio
/// ends with 0 errors, its read-back of every block (from the new primary)
/// matching.
#[test]
fn fio_verifies_through_the_front_while_the_primary_is_killed() {
    let _gate = crate::gate::shared();
    require("fio");
    // CoronaProcs starts its nodes from the bench binary beside this test's.
    bin("bench", "bench");
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let procs = rt.block_on(CoronaProcs::start(dir.path())).expect("start 3 CoronaFS nodes");
    let nodes: Vec<String> = procs.file.nodes.iter().map(|n| n.nbd.to_string()).collect();
    let primary = procs.file.nodes[0].clone();
    let volume = "fio-failover";
    rt.block_on(async {
        let api = coronafs::api_client::ApiClient::new(&format!("http://{}", primary.api));
        let req = coronafs::dto::CreateVolume {
            name: volume.into(),
            size: Some(64 * MIB),
            from_snapshot: None,
            replicas: Some(3),
        };
        api.create_volume(&req).await.expect("a volume with 3 copies");
        api.fence(volume, 1).await.expect("fence at epoch 1, as PlasmaVMC does when it attaches");
    });
    let front = Front::start(&nodes, volume, 1);
    let started = Instant::now();
    let mut job = fio(&front.uri(volume), "64m", &["--rate=8m"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fio");
    std::thread::sleep(Duration::from_secs(2));
    assert!(job.try_wait().expect("fio").is_none(), "fio ended before the kill: the kill would not be mid-write");
    let fault = Fault::new(FaultKind::Kill, "coronafs", &primary.name).expect("fault");
    let killed = Instant::now();
    rt.block_on(procs.inject(&fault)).expect("SIGKILL the primary");
    eprintln!("killed {} (the primary) {:.2} s after fio started", primary.name, started.elapsed().as_secs_f64());
    let t = Instant::now();
    let status = loop {
        if let Some(s) = job.try_wait().expect("fio") {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(180), "fio did not finish 180 s after the kill");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut text = String::new();
    job.stdout.take().expect("fio stdout").read_to_string(&mut text).expect("fio output");
    job.stderr.take().expect("fio stderr").read_to_string(&mut text).expect("fio errors");
    assert!(status.success(), "fio failed ({status}) through the failover:\n{text}");
    assert!(text.contains("err= 0"), "fio reported errors:\n{text}");
    assert!(!text.contains("verify failed") && !text.contains("bad magic"), "fio reported a verify error:\n{text}");
    let reconnects = front.last("reconnected", "reconnects").expect("the front reconnected");
    let epoch = front.last("reconnected", "epoch");
    let replayed = front.last("reconnected", "replayed_ops").unwrap_or(0);
    let pause = front.last("resumed", "io_pause_ms").expect("a write was acknowledged after the reconnect");
    let reconnect_ms = front.last("reconnected", "reconnect_ms").unwrap_or(0);
    eprintln!(
        "nbd-front failover: fio (64 MiB randwrite at 8 MiB/s, crc32c verify) ended with 0 errors {:.1} s after the \
         kill; {reconnects} reconnect(s) to epoch {epoch:?} after {reconnect_ms} ms, {replayed} unflushed writes \
         written again; I/O pause {pause} ms (loss noticed to the first write acknowledged after it; heartbeat 250 \
         ms, failover after 1.5 s)",
        killed.elapsed().as_secs_f64()
    );
    assert_eq!(epoch, Some(2), "the front did not follow the failover's epoch");
    assert!(replayed > 0, "writes acknowledged before the kill and not flushed should have been written again");
    let stats = stopped(front);
    assert_eq!(stats["errors"], 0, "{stats}");
    assert_eq!(stats["protocol_errors"], 0, "{stats}");
    rt.block_on(procs.stop());
}

/// Reads one option reply: (option, reply type, payload).
fn option_reply(s: &mut std::net::TcpStream) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; handshake::OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).expect("option reply");
    let (code, ty, len) = handshake::decode_option_reply_header(&h).expect("a reply header");
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).expect("option reply payload");
    (code, ty, data)
}

fn send_option(s: &mut std::net::TcpStream, o: &ClientOption) {
    let (code, data) = o.encode_payload();
    let mut out = Vec::new();
    handshake::encode_option(code, &data, &mut out);
    s.write_all(&out).expect("send option");
}

/// Connects and answers the greeting.
fn greeted(addr: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the front");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut g = [0u8; handshake::GREETING_LEN];
    s.read_exact(&mut g).expect("greeting");
    handshake::decode_greeting(&g).expect("an NBD greeting");
    s.write_all(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes()).expect("flags");
    s
}

/// The server closed the connection (EOF, or a reset) instead of answering.
fn closed(s: &mut std::net::TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

/// Options the front does not implement get errors and negotiation goes
/// on; garbage, in negotiation or transmission, drops that client only;
/// commands it does not forward get EINVAL; the next clients (NbdClient,
/// nbdinfo, fio) are served.
#[test]
fn the_front_refuses_what_it_does_not_forward_drops_garbage_and_serves_the_next_client() {
    let _gate = crate::gate::shared();
    require("nbdinfo");
    require("fio");
    let c = Corona::start(IoEngine::Threads);
    c.create("disk", 16 * MIB);
    let front = Front::start(&[c.addr().to_string()], "disk", 1);

    // Negotiation: refused options, then garbage.
    let mut s = greeted(&front.addr);
    for (o, want) in [
        (ClientOption::ExtendedHeaders, rep::ERR_UNSUP),
        (ClientOption::SetMetaContext { name: "disk".into(), queries: vec!["base:allocation".into()] }, rep::ERR_UNSUP),
        (ClientOption::StartTls, rep::ERR_UNSUP),
        (ClientOption::Go { name: "other".into(), requests: vec![] }, rep::ERR_UNKNOWN),
        (ClientOption::Unknown(99), rep::ERR_UNSUP),
    ] {
        send_option(&mut s, &o);
        let (code, ty, msg) = option_reply(&mut s);
        assert_eq!((code, ty), (o.encode_payload().0, want), "{o:?}: {}", String::from_utf8_lossy(&msg));
    }
    send_option(&mut s, &ClientOption::List);
    let (_, ty, name) = option_reply(&mut s);
    assert_eq!((ty, &name[4..]), (rep::SERVER, &b"disk"[..]));
    assert_eq!(option_reply(&mut s).1, rep::ACK);
    s.write_all(b"this is not an NBD option header").expect("garbage");
    assert!(closed(&mut s), "the front kept a client that sent garbage in negotiation");

    // Transmission: garbage after a good EXPORT_NAME.
    let mut s = greeted(&front.addr);
    let mut out = Vec::new();
    handshake::encode_option(opt::EXPORT_NAME, b"disk", &mut out);
    s.write_all(&out).expect("export name");
    let mut info = [0u8; 10];
    s.read_exact(&mut info).expect("size and flags");
    assert_eq!(u64::from_be_bytes(info[..8].try_into().expect("8 bytes")), 16 * MIB);
    let flags = u16::from_be_bytes([info[8], info[9]]);
    assert_eq!(flags & coronafs::proto::tx_flags::SEND_CACHE, 0, "CACHE is not forwarded: {flags:#x}");
    s.write_all(&[0xee; 28]).expect("garbage request");
    assert!(closed(&mut s), "the front kept a client that sent a request with a bad magic");

    // A well-behaved client: data round-trips; what is not forwarded is EINVAL.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let n = NbdClient::connect(front.addr.as_str(), "disk").await.expect("connect through the front");
        assert!(n.info().structured && !n.info().base_allocation, "{:?}", n.info());
        let data = stack_tests::pattern(256 << 10, 7);
        n.write(MIB, &data, true).await.expect("write");
        assert_eq!(n.read(MIB, data.len()).await.expect("read"), data);
        n.write_zeroes(MIB, 4096, 0).await.expect("write zeroes");
        assert_eq!(n.read(MIB, 4096).await.expect("read"), vec![0; 4096]);
        n.flush().await.expect("flush");
        for (cmd, flags) in [(Command::Cache, 0), (Command::Unknown(42), 0), (Command::Read, cmd_flags::DF)] {
            match n.raw(cmd, flags, 0, 4096, &[]).await {
                Err(coronafs::CoronaError::Nbd { errno: NbdErrno::Inval, .. }) => {}
                other => panic!("{cmd:?} flags {flags:#x}: {other:?}"),
            }
        }
        match n.read(16 * MIB - 1, 2).await {
            Err(coronafs::CoronaError::Nbd { errno: NbdErrno::Inval, .. }) => {}
            other => panic!("a read past the end: {other:?}"),
        }
        assert_eq!(n.read(MIB + 4096, 4096).await.expect("still served"), data[4096..8192]);
        n.disconnect().await.expect("disconnect");
        // The data reached CoronaFS itself.
        let direct = NbdClient::connect(c.addr(), "disk").await.expect("connect to CoronaFS");
        assert_eq!(direct.read(MIB + 4096, 4096).await.expect("read"), data[4096..8192]);
    });
    let out = run(Proc::new("nbdinfo").arg(front.uri("disk")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export-size: 16777216"), "{text}");
    let out = run(&mut fio(&front.uri("disk"), "8m", &[]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("err= 0"));
    let stats = stopped(front);
    assert_eq!(stats["protocol_errors"], 2, "the two garbage clients: {stats}");
    assert_eq!(stats["reconnects"], 0, "{stats}");

    // The same export on a Unix socket, for its owner only.
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("front.sock");
    let mut unix = Proc::new(bin("plasmavmc", "plasmavmc"))
        .args(["nbd-front", "--volume", "disk", "--epoch", "1"])
        .arg(format!("--coronafs-nodes={}", c.addr()))
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .spawn()
        .expect("start the front on a Unix socket");
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "no socket at {}", sock.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = run(Proc::new("nbdinfo").arg(format!("nbd+unix:///disk?socket={}", sock.display())));
    // Read once the front served a client: it sets the mode right after bind(2).
    let mode = std::fs::metadata(&sock).expect("socket").permissions().mode() & 0o777;
    let _ = unix.kill();
    let _ = unix.wait();
    assert_eq!(mode, 0o600, "the socket is for its owner only");
    assert!(String::from_utf8_lossy(&out.stdout).contains("export-size: 16777216"));
}

/// A client that sends 200 READs of 4 MiB (800 MiB of replies) and reads
/// nothing back: the front stops reading its requests once its 64 MiB
/// budget waits in replies nobody reads, so its memory stays bounded
/// (before, every reply was queued: hundreds of MiB); when the client
/// reads at last, every reply comes, in full and without an error.
#[test]
fn a_client_that_does_not_read_its_replies_holds_the_front_to_its_budget() {
    let _gate = crate::gate::shared();
    const N: u64 = 200;
    const LEN: u64 = 4 * MIB;
    let c = Corona::start(IoEngine::Threads);
    c.create("big", 64 * MIB);
    let front = Front::start(&[c.addr().to_string()], "big", 1);
    let before = stack_tests::rss_mib(front.pid());

    let mut s = greeted(&front.addr);
    let mut out = Vec::new();
    handshake::encode_option(opt::EXPORT_NAME, b"big", &mut out);
    s.write_all(&out).expect("export name");
    let mut info = [0u8; 10];
    s.read_exact(&mut info).expect("size and flags");
    let mut reqs = Vec::new();
    for i in 0..N {
        let r = coronafs::proto::request::Request::new(Command::Read, 0, i, (i % 16) * LEN, LEN);
        reqs.extend_from_slice(&r.encode());
    }
    s.write_all(&reqs).expect("send the reads");
    // Time for the front to read every request it will take and fetch its
    // data from CoronaFS (800 MiB over loopback takes well under a second).
    std::thread::sleep(Duration::from_secs(3));
    let held = stack_tests::rss_mib(front.pid());
    eprintln!("front RSS: {before} MiB before, {held} MiB with {N} reads of 4 MiB unread");
    assert!(held < before + 256, "the front queued replies nobody reads: {before} -> {held} MiB");

    let mut seen = vec![false; N as usize];
    let mut data = vec![0u8; LEN as usize];
    for _ in 0..N {
        let mut h = [0u8; 16];
        s.read_exact(&mut h).expect("reply header");
        assert_eq!(&h[..4], &0x6744_6698u32.to_be_bytes(), "a simple reply");
        assert_eq!(&h[4..8], &[0; 4], "no error");
        let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        assert!(!std::mem::replace(&mut seen[cookie as usize], true), "cookie {cookie} twice");
        s.read_exact(&mut data).expect("reply data");
    }
    assert!(seen.iter().all(|&x| x), "every read answered");
    drop(s);
    let stats = stopped(front);
    assert_eq!(stats["errors"], 0, "{stats}");
}
