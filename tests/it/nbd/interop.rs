//! CoronaFS against real NBD clients: qemu-img, qemu-io, nbdinfo, nbdcopy,
//! nbdsh (libnbd) and fio's nbd engine, on both I/O engines.

use coronafs::backend::IoEngine;
use stack_tests::{Corona, pattern, require, run};
use std::process::Command;

const MIB: u64 = 1 << 20;

/// nbdsh runs on Debian's python3 (the one that can import `nbd`), so put
/// /usr/bin first whatever python3 the PATH prefers.
fn nbdsh() -> Command {
    require("nbdsh");
    let mut c = Command::new("/usr/bin/nbdsh");
    let path = std::env::var("PATH").unwrap_or_default();
    c.env("PATH", format!("/usr/bin:/bin:{path}"));
    c
}

fn qemu_img_convert_into_and_out_of_the_export_and_compare(engine: IoEngine) {
    require("qemu-img");
    let c = Corona::start(engine);
    c.create("disk", 16 * MIB);
    let tmp = tempfile::tempdir().expect("tmp");
    let src = tmp.path().join("src.raw");
    std::fs::write(&src, pattern(12 * MIB as usize + 777, 1)).expect("write src");
    let uri = c.uri("disk");
    run(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(&uri));
    // The rest of the 16 MiB volume is zero, so compare says identical despite the size.
    run(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&src).arg(&uri));
    let out = tmp.path().join("out.qcow2");
    run(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "qcow2"]).arg(&uri).arg(&out));
    run(Command::new("qemu-img").args(["compare", "-f", "qcow2", "-F", "raw"]).arg(&out).arg(&uri));
    // And a real difference is noticed.
    std::fs::write(&src, pattern(12 * MIB as usize, 2)).expect("rewrite src");
    let st = Command::new("qemu-img").args(["compare", "-q", "-f", "raw", "-F", "raw"]).arg(&src).arg(&uri).status();
    assert_eq!(st.expect("compare").code(), Some(1), "compare must see the difference");
}

fn qemu_io_aio_requests_complete_and_verify(engine: IoEngine) {
    require("qemu-io");
    let c = Corona::start(engine);
    c.create("disk", 64 * MIB);
    let uri = c.uri("disk");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    // Many requests in flight at once, of mixed sizes, then read back with pattern checks.
    for i in 0..16u64 {
        cmd.args(["-c", &format!("aio_write -P {} {} {}", 0x10 + i, i * 2 * MIB, if i % 2 == 0 { MIB } else { 4096 })]);
    }
    cmd.args(["-c", "aio_flush"]);
    for i in 0..16u64 {
        cmd.args(["-c", &format!("aio_read -P {} {} {}", 0x10 + i, i * 2 * MIB, if i % 2 == 0 { MIB } else { 4096 })]);
    }
    cmd.args(["-c", "aio_flush", "-c", "read -P 0 1M 4096"]);
    cmd.arg(&uri);
    let out = run(&mut cmd);
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("verification failed") && !text.contains("failed"), "qemu-io reported: {text}");
    assert_eq!(text.matches("read ").count(), 17, "every read completed: {text}");
}

fn nbdinfo_lists_exports_and_maps_allocation(engine: IoEngine) {
    require("nbdinfo");
    require("qemu-io");
    let c = Corona::start(engine);
    c.create("alpha", 8 * MIB);
    c.create("beta", 4 * MIB);
    let out = run(Command::new("nbdinfo").arg("--list").arg(format!("nbd://{}", c.addr())));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"alpha\"") && text.contains("export=\"beta\""), "{text}");
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 9 1M 1M"]).arg(c.uri("alpha")));
    let out = run(Command::new("nbdinfo").arg("--map").arg(c.uri("alpha")));
    let rows: Vec<(u64, u64, u32)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].parse().expect("offset"), f[1].parse().expect("length"), f[2].parse().expect("type"))
        })
        .collect();
    assert_eq!(rows, vec![(0, MIB, 3), (MIB, MIB, 0), (2 * MIB, 6 * MIB, 3)], "allocation map");
}

fn nbdcopy_with_multi_conn_copies_in_and_out(engine: IoEngine) {
    require("nbdcopy");
    let c = Corona::start(engine);
    c.create("disk", 32 * MIB);
    let tmp = tempfile::tempdir().expect("tmp");
    let src = tmp.path().join("src.raw");
    let data = pattern(32 * MIB as usize, 3);
    std::fs::write(&src, &data).expect("write src");
    run(Command::new("nbdcopy").args(["--connections=4", "--requests=16", "--flush"]).arg(&src).arg(c.uri("disk")));
    let back = tmp.path().join("back.raw");
    run(Command::new("nbdcopy").args(["--connections=4"]).arg(c.uri("disk")).arg(&back));
    assert!(std::fs::read(&back).expect("read back") == data, "round trip through nbdcopy differs");
    let m = &c.srv().metrics;
    assert!(m.count(coronafs::proto::request::Command::Write) >= 32, "writes were split across requests");
}

const NBDSH_ERRORS: &str = r#"
import errno
h.set_strict_mode(0)
size = h.get_size()
def expect(what, f, want):
    try:
        f()
    except nbd.Error as ex:
        got = ex.errno if isinstance(ex.errno, str) else errno.errorcode.get(ex.errno)
        assert got in want, "%s: got errno %s (%s), want %s" % (what, got, ex.string, want)
    else:
        raise AssertionError("%s: no error" % what)
    # The connection keeps serving after every error.
    h.pwrite(b"ok" * 256, 0)
    assert h.pread(512, 0) == b"ok" * 256, what
expect("read past end", lambda: h.pread(512, size - 256), ["EINVAL"])
expect("read at huge offset", lambda: h.pread(1, 2**63), ["EINVAL"])
expect("write past end", lambda: h.pwrite(b"x" * 512, size), ["ENOSPC"])
expect("trim past end", lambda: h.trim(4096, size), ["EINVAL"])
expect("zero past end", lambda: h.zero(4096, size), ["ENOSPC"])
expect("block status past end", lambda: h.block_status(4096, size, lambda *a: 0), ["EINVAL"])
expect("oversized read", lambda: h.pread(32 * 1024 * 1024 + 4096, 0), ["EOVERFLOW", "EINVAL"])
expect("oversized write", lambda: h.pwrite(b"y" * (32 * 1024 * 1024 + 4096), 0), ["EINVAL", "EOVERFLOW"])
expect("bad flags", lambda: h.pread(512, 0, nbd.CMD_FLAG_FUA), ["EINVAL"])
h.flush()
print("all error cases answered")
"#;

fn nbdsh_error_cases_get_the_right_errno_and_keep_the_connection(engine: IoEngine) {
    let c = Corona::start(engine);
    c.create("disk", 4 * MIB);
    let out = run(nbdsh().args(["-u", &c.uri("disk"), "-c", NBDSH_ERRORS]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("all error cases answered"));
}

fn nbdsh_writes_to_a_read_only_export_get_eperm(engine: IoEngine) {
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("ro"), pattern(MIB as usize, 5)).expect("write");
    let c = Corona::start_in(dir, engine, true);
    let script = r#"
import errno
h.set_strict_mode(0)
assert h.is_read_only()
for what, f in [("write", lambda: h.pwrite(b"x" * 512, 0)), ("trim", lambda: h.trim(512, 0)), ("zero", lambda: h.zero(512, 0))]:
    try:
        f()
        raise AssertionError(what + " succeeded on a read-only export")
    except nbd.Error as ex:
        got = ex.errno if isinstance(ex.errno, str) else errno.errorcode.get(ex.errno)
        assert got == "EPERM", (what, got)
assert len(h.pread(4096, 0)) == 4096
print("read-only enforced")
"#;
    let out = run(nbdsh().args(["-u", &c.uri("ro"), "-c", script]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("read-only enforced"));
    assert_eq!(std::fs::read(c.path("ro")).expect("read"), pattern(MIB as usize, 5), "file untouched");
}

/// Zero-length requests of every kind, sent by libnbd with its client-side
/// checks off. A zero-length READ with structured replies once got an
/// `OFFSET_DATA` chunk of 8 bytes, which libnbd takes for a broken server and
/// drops the connection; a zero-length BLOCK_STATUS got EIO.
const NBDSH_ZERO_LENGTH: &str = r#"
import errno
h.set_strict_mode(0)
assert h.get_structured_replies_negotiated()
assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
size = h.get_size()
h.pwrite(b"zl" * 2048, 0)
for off in [0, 4096, size]:
    assert h.pread(0, off) == b"", off
    h.pwrite(b"", off)
    h.trim(0, off)
    h.zero(0, off)
    h.zero(0, off, nbd.CMD_FLAG_NO_HOLE)
    h.cache(0, off)
    try:
        h.block_status(0, off, lambda *a: 0)
        raise AssertionError("zero-length block status at %d succeeded" % off)
    except nbd.Error as ex:
        got = ex.errno if isinstance(ex.errno, str) else errno.errorcode.get(ex.errno)
        assert got == "EINVAL", (off, got, ex.string)
# Nothing was changed and the connection is still up.
assert h.pread(4096, 0) == b"zl" * 2048
h.flush()
print("zero-length requests answered")
"#;

fn nbdsh_zero_length_requests_are_answered_and_keep_the_connection(engine: IoEngine) {
    let c = Corona::start(engine);
    c.create("disk", 4 * MIB);
    let out = run(nbdsh().args(["--base-allocation", "-u", &c.uri("disk"), "-c", NBDSH_ZERO_LENGTH]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("zero-length requests answered"));
    let m = &c.srv().metrics;
    assert_eq!(m.protocol_errors.load(std::sync::atomic::Ordering::Relaxed), 0, "no connection was dropped");
}

fn fio_nbd_engine_verifies_crc32c(engine: IoEngine) {
    require("fio");
    let c = Corona::start(engine);
    c.create("disk", 64 * MIB);
    for (rw, bs, depth) in [("randwrite", "4k", "32"), ("write", "1m", "8"), ("randrw", "64k", "16")] {
        let out = run(Command::new("fio").args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={}", c.uri("disk")),
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={depth}"),
            "--size=32m",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--randrepeat=1",
            // fio would otherwise leave its verify state file in the working directory.
            "--verify_state_save=0",
        ]));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("err= 0"), "fio {rw}: {text}");
    }
}

/// qemu's NBD client asks for extended headers (libnbd 1.14 does not):
/// data round-trips through them, and a hole longer than 4 GiB comes back
/// as one extent, which only 64-bit block status can say.
#[test]
fn qemu_negotiates_extended_headers_and_maps_a_hole_past_4_gib() {
    let _gate = crate::gate::shared();
    require("qemu-img");
    require("qemu-io");
    const GIB: u64 = 1 << 30;
    let c = Corona::start(IoEngine::Threads);
    c.create("big", 6 * GIB);
    let uri = c.uri("big");
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x5a 5G 64k", "-c", "read -P 0x5a 5G 64k"])
        .arg(&uri));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("read 65536/65536 bytes at offset 5368709120"), "{text}");
    let extended = || c.srv().metrics.extended_sessions.load(std::sync::atomic::Ordering::Relaxed);
    assert!(extended() >= 1, "qemu-io did not negotiate extended headers");
    let out = run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw"]).arg(&uri));
    let map: serde_json::Value = serde_json::from_slice(&out.stdout).expect("map JSON");
    let rows: Vec<(u64, u64, bool)> = map
        .as_array()
        .expect("array")
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().expect("start"),
                e["length"].as_u64().expect("length"),
                e["data"].as_bool().expect("data"),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![(0, 5 * GIB, false), (5 * GIB, 65536, true), (5 * GIB + 65536, GIB - 65536, false)],
        "allocation map over extended headers"
    );
    assert!(extended() >= 2, "qemu-img map used extended headers too");
}

macro_rules! per_engine {
    ($($name:ident),* $(,)?) => {
        mod uring {
            $( #[test] fn $name() { let _gate = crate::gate::shared(); super::$name(coronafs::backend::IoEngine::Uring) } )*
        }
        mod threads {
            $( #[test] fn $name() { let _gate = crate::gate::shared(); super::$name(coronafs::backend::IoEngine::Threads) } )*
        }
    };
}

per_engine!(
    qemu_img_convert_into_and_out_of_the_export_and_compare,
    qemu_io_aio_requests_complete_and_verify,
    nbdinfo_lists_exports_and_maps_allocation,
    nbdcopy_with_multi_conn_copies_in_and_out,
    nbdsh_error_cases_get_the_right_errno_and_keep_the_connection,
    nbdsh_writes_to_a_read_only_export_get_eperm,
    nbdsh_zero_length_requests_are_answered_and_keep_the_connection,
    fio_nbd_engine_verifies_crc32c,
);
