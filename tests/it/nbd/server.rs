//! The NBD server under a model and under abuse: random operation sequences
//! over several connections checked against a byte-vector model, garbage,
//! vanishing and slow clients. (Replies out of order and injected I/O
//! errors need the fault backend, a test double compiled only into
//! coronafs's own tests: crates/coronafs/src/server/tests.rs.)

use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use coronafs::proto::cmd_flags;
use coronafs::proto::request::{Command, Request};
use coronafs::{CoronaError, proto::NbdErrno};
use proptest::prelude::*;
use stack_tests::{Corona, ENGINES, pattern};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

const SIZE: u64 = 4 << 20;

#[derive(Debug, Clone)]
enum Op {
    Read { conn: usize, off: u64, len: u32 },
    Write { conn: usize, off: u64, len: u32, seed: u64, fua: bool },
    Trim { conn: usize, off: u64, len: u32 },
    Zero { conn: usize, off: u64, len: u32, no_hole: bool },
    Flush { conn: usize },
}

fn range() -> impl Strategy<Value = (u64, u32)> {
    // Mostly small unaligned ranges, some large ones, all inside the volume.
    prop_oneof![
        (0..SIZE - 70_000, 1u32..70_000).prop_map(|(o, l)| (o, l)),
        (0..(SIZE >> 12) - 256, 1u32..256).prop_map(|(b, n)| (b << 12, n << 12)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let conn = 0usize..3;
    prop_oneof![
        3 => (conn.clone(), range()).prop_map(|(conn, (off, len))| Op::Read { conn, off, len }),
        4 => (conn.clone(), range(), any::<u64>(), any::<bool>())
            .prop_map(|(conn, (off, len), seed, fua)| Op::Write { conn, off, len, seed, fua }),
        1 => (conn.clone(), range()).prop_map(|(conn, (off, len))| Op::Trim { conn, off, len }),
        1 => (conn.clone(), range(), any::<bool>()).prop_map(|(conn, (off, len), no_hole)| Op::Zero { conn, off, len, no_hole }),
        1 => conn.prop_map(|conn| Op::Flush { conn }),
    ]
}

/// Runs `ops` against a real server over three connections and a `Vec<u8>`
/// model; every read must match the model. Trimmed ranges read as zero on
/// CoronaFS (it punches holes), so the model zeroes them too.
async fn check_against_model(addr: std::net::SocketAddr, ops: &[Op]) {
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(NbdClient::connect(addr, "model").await.expect("connect"));
    }
    let mut model = vec![0u8; SIZE as usize];
    for op in ops {
        match *op {
            Op::Read { conn, off, len } => {
                let got = conns[conn].read(off, len as usize).await.expect("read");
                assert!(
                    got == model[off as usize..off as usize + len as usize],
                    "read {off}+{len} differs from the model"
                );
            }
            Op::Write { conn, off, len, seed, fua } => {
                let data = pattern(len as usize, seed);
                conns[conn].write(off, &data, fua).await.expect("write");
                model[off as usize..off as usize + len as usize].copy_from_slice(&data);
            }
            Op::Trim { conn, off, len } => {
                conns[conn].trim(off, len).await.expect("trim");
                model[off as usize..off as usize + len as usize].fill(0);
            }
            Op::Zero { conn, off, len, no_hole } => {
                let flags = if no_hole { cmd_flags::NO_HOLE } else { 0 };
                conns[conn].write_zeroes(off, len, flags).await.expect("zero");
                model[off as usize..off as usize + len as usize].fill(0);
            }
            Op::Flush { conn } => conns[conn].flush().await.expect("flush"),
        }
    }
    // Everything again, through a fresh connection, in 1 MiB pieces.
    let c = NbdClient::connect(addr, "model").await.expect("connect");
    for off in (0..SIZE).step_by(1 << 20) {
        let got = c.read(off, 1 << 20).await.expect("read");
        assert!(got == model[off as usize..off as usize + (1 << 20)], "final read at {off} differs");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_over_three_connections_match_a_model(ops in prop::collection::vec(op(), 1..60)) {
        let _gate = crate::gate::shared();
        for engine in ENGINES {
            let c = Corona::start(engine);
            c.create("model", SIZE);
            c.rt.block_on(check_against_model(c.addr(), &ops));
        }
    }
}

#[test]
fn concurrent_pipelined_writes_from_many_connections_are_all_visible() {
    let _gate = crate::gate::shared();
    for engine in ENGINES {
        let c = Corona::start(engine);
        c.create("disk", 16 << 20);
        let addr = c.addr();
        c.rt.block_on(async move {
            let mut tasks = Vec::new();
            for conn in 0..4u64 {
                tasks.push(tokio::spawn(async move {
                    let client = Arc::new(NbdClient::connect(addr, "disk").await.expect("connect"));
                    let mut inflight = Vec::new();
                    for i in 0..64u64 {
                        let client = client.clone();
                        let off = (i * 4 + conn) * 65536;
                        inflight.push(tokio::spawn(async move {
                            client.write(off, &pattern(65536, off), false).await.expect("write");
                        }));
                    }
                    for t in inflight {
                        t.await.expect("task");
                    }
                    client.flush().await.expect("flush");
                }));
            }
            for t in tasks {
                t.await.expect("conn task");
            }
            let reader = NbdClient::connect(addr, "disk").await.expect("connect");
            for blk in 0..256u64 {
                let off = blk * 65536;
                assert_eq!(reader.read(off, 65536).await.expect("read"), pattern(65536, off), "block {blk}");
            }
        });
    }
}

#[test]
fn unknown_commands_and_bad_flags_get_einval_without_a_disconnect() {
    let _gate = crate::gate::shared();
    let c = Corona::start(IoEngine::Threads);
    c.create("disk", SIZE);
    let addr = c.addr();
    c.rt.block_on(async move {
        let client = NbdClient::connect(addr, "disk").await.expect("connect");
        for (cmd, flags) in
            [(Command::Unknown(99), 0), (Command::Flush, cmd_flags::DF), (Command::Write, cmd_flags::REQ_ONE)]
        {
            let payload = if cmd == Command::Write { vec![0; 16] } else { vec![] };
            match client.raw(cmd, flags, 0, payload.len() as u32, &payload).await {
                Err(CoronaError::Nbd { errno: NbdErrno::Inval, .. }) => {}
                other => panic!("{cmd:?} with flags {flags:#x}: {other:?}"),
            }
        }
        client.write(0, b"fine", true).await.expect("write");
        assert_eq!(client.read(0, 4).await.expect("read"), b"fine");
    });
}

/// Completes the handshake by hand (fixed newstyle, EXPORT_NAME, no zeroes)
/// and returns the raw socket in transmission phase.
fn raw_transmission(addr: std::net::SocketAddr, export: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&3u32.to_be_bytes()).expect("flags");
    let mut opt = Vec::new();
    coronafs::proto::handshake::encode_option(coronafs::proto::opt::EXPORT_NAME, export.as_bytes(), &mut opt);
    s.write_all(&opt).expect("option");
    let mut info = [0u8; 10];
    s.read_exact(&mut info).expect("export info");
    s
}

#[test]
fn garbage_vanishing_and_stalled_clients_do_not_disturb_others() {
    let _gate = crate::gate::shared();
    let c = Corona::start(IoEngine::Threads);
    c.create("disk", SIZE);
    let addr = c.addr();
    let mut abusers = Vec::new();
    // Garbage instead of client flags and options.
    let mut s = TcpStream::connect(addr).expect("connect");
    let _ = s.write_all(&pattern(4096, 7));
    abusers.push(s);
    // A valid option header announcing a huge payload, then silence.
    let mut s = TcpStream::connect(addr).expect("connect");
    let mut g = [0u8; 18];
    s.read_exact(&mut g).expect("greeting");
    s.write_all(&1u32.to_be_bytes()).expect("flags");
    let mut h = Vec::new();
    h.extend_from_slice(&coronafs::proto::IHAVEOPT.to_be_bytes());
    h.extend_from_slice(&7u32.to_be_bytes());
    h.extend_from_slice(&u32::MAX.to_be_bytes());
    s.write_all(&h).expect("option header");
    abusers.push(s);
    // Vanishes in the middle of a write payload.
    let mut s = raw_transmission(addr, "disk");
    let req = Request::new(Command::Write, 0, 1, 0, 1 << 20);
    s.write_all(&req.encode()).expect("header");
    s.write_all(&[0xEE; 1000]).expect("partial payload");
    drop(s);
    // Garbage in transmission phase (bad magic).
    let mut s = raw_transmission(addr, "disk");
    s.write_all(&[0xFF; 28]).expect("garbage");
    abusers.push(s);
    // Sends many reads and never reads a reply: its socket buffers fill up.
    let mut stalled = raw_transmission(addr, "disk");
    for i in 0..512u64 {
        let req = Request::new(Command::Read, 0, i, 0, 1 << 20);
        if stalled.write_all(&req.encode()).is_err() {
            break;
        }
    }
    // Meanwhile a well-behaved client is served normally.
    c.rt.block_on(async move {
        let client = NbdClient::connect(addr, "disk").await.expect("connect while others misbehave");
        for i in 0..32u64 {
            client.write(i * 4096 + (2 << 20), &pattern(4096, i), false).await.expect("write");
        }
        client.flush().await.expect("flush");
        for i in 0..32u64 {
            assert_eq!(client.read(i * 4096 + (2 << 20), 4096).await.expect("read"), pattern(4096, i));
        }
    });
    // The half-sent write never reached the volume.
    let head = std::fs::read(c.path("disk")).expect("read file");
    assert!(head[..1000].iter().all(|&b| b == 0), "a partial payload was written");
    assert!(c.srv().metrics.protocol_errors.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    drop(stalled);
    drop(abusers);
}

/// Drops the file's pages from the page cache, so the next reads miss it.
fn evict_from_page_cache(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).expect("open volume file");
    f.sync_all().expect("sync");
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(r, 0, "posix_fadvise");
}

#[test]
fn large_reads_from_the_page_cache_use_sendfile_and_return_the_right_bytes() {
    let _gate = crate::gate::shared();
    const MIB: u64 = 1 << 20;
    for engine in ENGINES {
        let c = Corona::start(engine);
        c.create("big", 8 * MIB);
        let data = pattern(8 * MIB as usize, 77);
        std::fs::write(c.path("big"), &data).expect("fill the volume file");
        let sendfile = || c.srv().metrics.sendfile_reads.load(std::sync::atomic::Ordering::Relaxed);
        let addr = c.addr();
        // Structured replies, pipelined, with sizes on both sides of the threshold
        // and ranges that do not start on a page boundary.
        let check = |label: &str| {
            let data = data.clone();
            c.rt.block_on(async move {
                let client = Arc::new(NbdClient::connect(addr, "big").await.expect("connect"));
                let mut tasks = Vec::new();
                for (off, len) in [(0, MIB), (MIB + 3, 2 * MIB), (5 * MIB - 100, 65536), (7 * MIB, 4096), (0, 8 * MIB)]
                {
                    let client = client.clone();
                    tasks.push(tokio::spawn(async move { (off, len, client.read(off, len as usize).await) }));
                }
                for t in tasks {
                    let (off, len, got) = t.await.expect("task");
                    let got = got.expect("read");
                    assert!(got == data[off as usize..(off + len) as usize], "{label}: {len} bytes at {off} differ");
                }
            });
        };
        check("cached");
        assert!(sendfile() >= 4, "{engine}: cached 64 KiB+ reads should go out with sendfile, got {}", sendfile());
        evict_from_page_cache(&c.path("big"));
        check("after eviction");
        // Simple (unstructured) replies take the same path.
        let mut s = raw_transmission(addr, "big");
        let before = sendfile();
        let req = Request::new(Command::Read, 0, 9, 3 * MIB, MIB);
        s.write_all(&req.encode()).expect("send read");
        let mut reply = [0u8; 16];
        s.read_exact(&mut reply).expect("reply header");
        assert_eq!(&reply[4..8], &[0, 0, 0, 0], "no error");
        assert_eq!(u64::from_be_bytes(reply[8..16].try_into().expect("8 bytes")), 9, "cookie");
        let mut got = vec![0u8; MIB as usize];
        s.read_exact(&mut got).expect("payload");
        assert!(got == data[3 * MIB as usize..4 * MIB as usize], "simple-reply read differs");
        // The reads after eviction brought those pages back into the cache.
        assert!(sendfile() > before, "{engine}: the simple-reply read should also use sendfile");
    }
}

/// Reads option replies up to the final one, returning their types.
fn option_replies(s: &mut TcpStream) -> Vec<u32> {
    use coronafs::proto::handshake::{OPTION_REPLY_HEADER_LEN, decode_option_reply_header};
    let mut types = Vec::new();
    loop {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        s.read_exact(&mut h).expect("option reply");
        let (_, ty, len) = decode_option_reply_header(&h).expect("reply magic");
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).expect("reply payload");
        types.push(ty);
        if ty != coronafs::proto::rep::INFO && ty != coronafs::proto::rep::META_CONTEXT {
            return types;
        }
    }
}

/// Negotiates extended headers and `base:allocation` by hand and enters
/// transmission on `export` with NBD_OPT_GO.
fn ext_transmission(addr: std::net::SocketAddr, export: &str) -> TcpStream {
    use coronafs::proto::handshake::{ClientOption, encode_option};
    use coronafs::proto::{BASE_ALLOCATION, rep};
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&3u32.to_be_bytes()).expect("flags");
    let options = [
        ClientOption::ExtendedHeaders,
        ClientOption::SetMetaContext { name: export.into(), queries: vec![BASE_ALLOCATION.into()] },
        ClientOption::Go { name: export.into(), requests: vec![] },
    ];
    for o in options {
        let (code, data) = o.encode_payload();
        let mut msg = Vec::new();
        encode_option(code, &data, &mut msg);
        s.write_all(&msg).expect("option");
        assert_eq!(option_replies(&mut s).last(), Some(&rep::ACK), "{o:?}");
    }
    s
}

/// Reads one extended reply chunk: its header and payload.
fn ext_reply(s: &mut TcpStream) -> (coronafs::proto::reply::ReplyHeader, Vec<u8>) {
    use coronafs::proto::reply::{EXT_CHUNK_LEN, ReplyHeader};
    let mut h = [0u8; EXT_CHUNK_LEN];
    s.read_exact(&mut h).expect("extended reply header");
    let header = ReplyHeader::decode(&h).expect("decode");
    let ReplyHeader::Extended { length, .. } = header else { panic!("not an extended reply: {header:?}") };
    assert!(length < 64 << 20, "reply payload of {length} bytes");
    let mut payload = vec![0u8; length as usize];
    s.read_exact(&mut payload).expect("reply payload");
    (header, payload)
}

#[test]
fn extended_headers_serve_64_bit_lengths_and_refuse_what_we_do_not_serve() {
    let _gate = crate::gate::shared();
    use coronafs::proto::chunk;
    use coronafs::proto::reply::{ReplyHeader, decode_block_status_ext, decode_error_payload};
    const GIB: u64 = 1 << 30;
    let c = Corona::start(IoEngine::Threads);
    c.create("big", 16 * GIB);
    let mut s = ext_transmission(c.addr(), "big");
    // `payload` on anything but a WRITE (which always has one) is NBD_CMD_FLAG_PAYLOAD_LEN.
    let ext = |command, cookie, offset, length, payload: bool| {
        let flags = if payload && command != Command::Write { cmd_flags::PAYLOAD_LEN } else { 0 };
        Request::new(command, flags, cookie, offset, length)
    };
    let expect_done = |s: &mut TcpStream, cookie: u64, offset: u64| {
        let (h, _) = ext_reply(s);
        let done = ReplyHeader::Extended { cookie, flags: chunk::FLAG_DONE, ty: chunk::NONE, offset, length: 0 };
        assert_eq!(h, done, "cookie {cookie}: a final NONE chunk, never a simple reply");
    };
    let expect_error = |s: &mut TcpStream, cookie: u64, errno: u32| {
        let (h, p) = ext_reply(s);
        let ReplyHeader::Extended { cookie: got, ty, flags, .. } = h else { unreachable!() };
        assert_eq!((got, ty, flags), (cookie, chunk::ERROR, chunk::FLAG_DONE), "cookie {cookie}");
        let (e, msg) = decode_error_payload(&p).expect("error payload");
        assert_eq!(e, errno, "cookie {cookie}: {msg}");
    };
    // A write and a read at 5 GiB, past any 32-bit offset.
    let data = pattern(4096, 5);
    s.write_all(&ext(Command::Write, 1, 5 * GIB, 4096, true).encode_ext()).expect("write");
    s.write_all(&data).expect("payload");
    expect_done(&mut s, 1, 5 * GIB);
    s.write_all(&ext(Command::Read, 2, 5 * GIB, 4096, false).encode_ext()).expect("read");
    let (h, p) = ext_reply(&mut s);
    let ReplyHeader::Extended { ty, offset, length, .. } = h else { unreachable!() };
    assert_eq!((ty, offset, length), (chunk::OFFSET_DATA, 5 * GIB, 4096 + 8));
    assert_eq!(u64::from_be_bytes(p[..8].try_into().expect("8")), 5 * GIB);
    assert!(p[8..] == data[..], "read back at 5 GiB");
    // Block status over 6 GiB in one request: the hole before the data is
    // one extent longer than 32 bits can say.
    s.write_all(&ext(Command::BlockStatus, 3, 0, 6 * GIB, false).encode_ext()).expect("block status");
    let (h, p) = ext_reply(&mut s);
    let ReplyHeader::Extended { ty, .. } = h else { unreachable!() };
    assert_eq!(ty, chunk::BLOCK_STATUS_EXT);
    let (ctx, extents) = decode_block_status_ext(&p).expect("extents");
    assert_eq!(ctx, coronafs::proto::BASE_ALLOCATION_ID);
    assert_eq!((extents[0].length, extents[0].flags), (5 * GIB, 3), "one hole of 5 GiB: {extents:?}");
    assert_eq!(extents[1].flags, 0, "then data: {extents:?}");
    // A 64-bit TRIM and WRITE_ZEROES are served in one request each.
    s.write_all(&ext(Command::Trim, 4, 0, 5 * GIB + 4096, false).encode_ext()).expect("trim");
    expect_done(&mut s, 4, 0);
    s.write_all(&ext(Command::WriteZeroes, 5, GIB, 10 * GIB, false).encode_ext()).expect("zero");
    expect_done(&mut s, 5, GIB);
    s.write_all(&ext(Command::Read, 6, 5 * GIB, 4096, false).encode_ext()).expect("read");
    let (_, p) = ext_reply(&mut s);
    assert!(p[8..].iter().all(|&b| b == 0), "trimmed");
    // A WRITE without NBD_CMD_FLAG_PAYLOAD_LEN, as qemu sends it, still
    // carries its payload.
    let mut bare = ext(Command::Write, 8, 7 * GIB, 4096, true).encode_ext();
    bare[4..6].copy_from_slice(&0u16.to_be_bytes());
    s.write_all(&bare).expect("unflagged write");
    s.write_all(&data).expect("payload");
    expect_done(&mut s, 8, 7 * GIB);
    s.write_all(&ext(Command::Read, 13, 7 * GIB, 4096, false).encode_ext()).expect("read");
    let (_, p) = ext_reply(&mut s);
    assert!(p[8..] == data[..], "the unflagged write landed");
    // What we do not serve is refused, and the connection goes on:
    // a READ longer than the block size limit,
    s.write_all(&ext(Command::Read, 7, 0, 5 * GIB, false).encode_ext()).expect("huge read");
    expect_error(&mut s, 7, NbdErrno::Overflow as u32);
    // a payload on a READ (read and dropped),
    s.write_all(&ext(Command::Read, 9, 0, 16, true).encode_ext()).expect("read with payload");
    s.write_all(&[0xAB; 16]).expect("its payload");
    expect_error(&mut s, 9, NbdErrno::Inval as u32);
    // a range past the end.
    s.write_all(&ext(Command::Trim, 10, 8 * GIB, 9 * GIB, false).encode_ext()).expect("trim past the end");
    expect_error(&mut s, 10, NbdErrno::Inval as u32);
    s.write_all(&ext(Command::Flush, 11, 0, 0, false).encode_ext()).expect("flush");
    expect_done(&mut s, 11, 0);
    // A payload over 4 GiB is not read: the server hangs up.
    s.write_all(&ext(Command::Write, 12, 0, 8 * GIB, true).encode_ext()).expect("huge write");
    let mut b = [0u8; 1];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "the connection is closed");
    assert!(c.srv().metrics.extended_sessions.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

/// A client that sends a million READs past the end (each refused) and
/// reads no reply: the refusals wait within the connection's budget, so
/// the server stops reading that client instead of queueing a million
/// replies (before: one reply of about 150 bytes each, queued in memory
/// without end); when the client reads, every refusal comes, and other
/// clients are served meanwhile.
#[test]
fn refusals_a_client_does_not_read_stay_within_its_budget() {
    let _gate = crate::gate::shared();
    const N: u64 = 1_000_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let p = stack_tests::CoronaProc::spawn(dir.path(), IoEngine::Threads);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(p.client().create("disk", SIZE)).expect("create");
    let before = stack_tests::rss_mib(p.child.id());
    let s = raw_transmission(p.nbd, "disk");
    let mut writer = s.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let mut buf = Vec::with_capacity(28 * 4096);
        for i in 0..N {
            buf.extend_from_slice(&Request::new(Command::Read, 0, i, SIZE, 4096).encode());
            if buf.len() == buf.capacity() || i == N - 1 {
                writer.write_all(&buf).expect("send requests");
                buf.clear();
            }
        }
    });
    std::thread::sleep(Duration::from_secs(3));
    let held = stack_tests::rss_mib(p.child.id());
    eprintln!("coronafs RSS: {before} MiB before, {held} MiB with refusals unread");
    assert!(held < before + 48, "the server queued replies nobody reads: {before} -> {held} MiB");
    rt.block_on(async {
        let other = NbdClient::connect(p.nbd, "disk").await.expect("another client");
        other.write(0, &pattern(4096, 3), true).await.expect("served meanwhile");
    });
    let mut r = std::io::BufReader::with_capacity(1 << 20, s);
    for _ in 0..N {
        let mut h = [0u8; 16];
        r.read_exact(&mut h).expect("reply");
        assert_eq!(u32::from_be_bytes(h[4..8].try_into().expect("4 bytes")), NbdErrno::Inval as u32);
    }
    sender.join().expect("sender");
}
