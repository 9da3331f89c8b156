//! NBD over TLS (STARTTLS) against real clients: nbdinfo, nbdcopy and nbdsh
//! (libnbd, GnuTLS) over nbds:// URIs, and qemu-img with a tls-creds-x509
//! object. The CA and the certificates are made at test time with the
//! `openssl` command, in nbdkit's directory layout.

use coronafs::backend::IoEngine;
use coronafs::config::TlsConfig;
use coronafs::proto::handshake::TlsMode;
use stack_tests::{Corona, pattern, require, run};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;

const MIB: u64 = 1 << 20;

/// A test PKI: `server/` is what `--tls-certificates` reads, `client/`
/// holds only the CA (what a client needs to check the server), and
/// `client-auth/` adds a client certificate signed by the same CA.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        require("openssl");
        let dir = tempfile::tempdir().expect("tmp");
        let d = dir.path();
        for sub in ["server", "client", "client-auth"] {
            std::fs::create_dir(d.join(sub)).expect("mkdir");
        }
        let openssl = |args: &[&str]| {
            run(Command::new("openssl").args(args).current_dir(d));
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca-key.pem", "-out", "ca-cert.pem", "-days", "2", "-subj", "/CN=CoronaFS test CA"]);
        ca.extend(["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        openssl(&ca);
        // A leaf for 127.0.0.1 (servers) or a client, signed by the CA.
        let leaf = |name: &str, cn: &str, ext: &str| {
            std::fs::write(d.join(format!("{name}.ext")), ext).expect("ext file");
            let mut req = vec!["req"];
            req.extend(ec);
            let (key, csr) = (format!("{name}-key.pem"), format!("{name}.csr"));
            req.extend(["-keyout", &key, "-out", &csr, "-subj", cn]);
            openssl(&req);
            let (cert, extfile) = (format!("{name}-cert.pem"), format!("{name}.ext"));
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca-cert.pem",
                "-CAkey",
                "ca-key.pem",
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                &extfile,
            ]);
        };
        leaf(
            "server",
            "/CN=127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n",
        );
        leaf("client", "/CN=coronafs-test-client", "extendedKeyUsage=clientAuth\nbasicConstraints=CA:FALSE\n");
        let copy = |from: &str, to: &str| std::fs::copy(d.join(from), d.join(to)).map(|_| ()).expect("copy");
        for sub in ["server", "client", "client-auth"] {
            copy("ca-cert.pem", &format!("{sub}/ca-cert.pem"));
        }
        copy("server-cert.pem", "server/server-cert.pem");
        copy("server-key.pem", "server/server-key.pem");
        copy("client-cert.pem", "client-auth/client-cert.pem");
        copy("client-key.pem", "client-auth/client-key.pem");
        Pki { dir }
    }

    fn path(&self, sub: &str) -> PathBuf {
        self.dir.path().join(sub)
    }
}

fn start(pki: &Pki, mode: TlsMode, verify_peer: bool) -> Corona {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki.path("server");
    Corona::start_configured(dir, IoEngine::Threads, |cfg| {
        cfg.tls = TlsConfig { mode, certificates: Some(certs), verify_peer };
    })
}

/// `nbds://127.0.0.1:PORT/NAME?tls-certificates=DIR`, as libnbd takes it.
fn nbds(c: &Corona, name: &str, certs: &Path) -> String {
    format!("nbds://{}/{name}?tls-certificates={}", c.addr(), certs.display())
}

fn tls_sessions(c: &Corona) -> u64 {
    c.srv().metrics.tls_sessions.load(Ordering::Relaxed)
}

/// qemu-img's options for an NBD export over TLS, for `--image-opts`.
fn qemu_opts(c: &Corona, name: &str) -> String {
    format!(
        "driver=raw,file.driver=nbd,file.host=127.0.0.1,file.port={},file.export={name},file.tls-creds=tls0",
        c.addr().port()
    )
}

fn qemu_tls_object(certs: &Path) -> String {
    format!("tls-creds-x509,id=tls0,dir={},endpoint=client", certs.display())
}

#[test]
fn nbdinfo_over_nbds_works_and_a_plain_client_is_refused_under_require() {
    let _gate = crate::gate::shared();
    require("nbdinfo");
    let pki = Pki::new();
    let c = start(&pki, TlsMode::Require, false);
    c.create("disk", 8 * MIB);
    let out = run(Command::new("nbdinfo").arg(nbds(&c, "disk", &pki.path("client"))));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("with TLS"), "nbdinfo should report TLS: {text}");
    assert!(text.contains(&format!("export-size: {}", 8 * MIB)), "{text}");
    assert_eq!(tls_sessions(&c), 1);
    // A plain client gets a clear refusal, not a hang or a garbled reply.
    // libnbd 1.14 prints the server's message only in its debug output.
    let plain = Command::new("nbdinfo").arg(c.uri("disk")).env("LIBNBD_DEBUG", "1").output().expect("run nbdinfo");
    assert!(!plain.status.success(), "a plain client got in under --tls require");
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(err.contains("nbd_opt_go: server replied with error"), "refused at NBD_OPT_GO: {err}");
    assert!(
        err.contains("server error message: this server requires TLS: send NBD_OPT_STARTTLS first"),
        "the refusal should say TLS is required: {err}"
    );
    // So does listing the exports in the clear.
    let list = Command::new("nbdinfo").arg("--list").arg(format!("nbd://{}", c.addr())).output().expect("run");
    assert!(!list.status.success() || !String::from_utf8_lossy(&list.stdout).contains("disk"), "listed in the clear");
    // A client that does not trust the server's CA fails its TLS handshake.
    let strangers = tempfile::tempdir().expect("tmp");
    let other = Pki::new();
    std::fs::copy(other.path("client/ca-cert.pem"), strangers.path().join("ca-cert.pem")).expect("copy");
    let untrusted = Command::new("nbdinfo").arg(nbds(&c, "disk", strangers.path())).output().expect("run");
    assert!(!untrusted.status.success(), "a client trusting another CA got in");
    // ...and the server goes on serving TLS clients.
    let out = run(Command::new("nbdinfo").arg("--list").arg(format!(
        "nbds://{}/?tls-certificates={}",
        c.addr(),
        pki.path("client").display()
    )));
    assert!(String::from_utf8_lossy(&out.stdout).contains("export=\"disk\""), "list over TLS");
    assert!(c.srv().metrics.handshake_failures.load(Ordering::Relaxed) >= 1, "the failed handshakes are counted");
}

#[test]
fn nbdcopy_and_qemu_img_round_trip_data_over_tls() {
    let _gate = crate::gate::shared();
    require("nbdcopy");
    require("qemu-img");
    let pki = Pki::new();
    let c = start(&pki, TlsMode::Require, false);
    c.create("disk", 32 * MIB);
    let tmp = tempfile::tempdir().expect("tmp");
    let src = tmp.path().join("src.raw");
    let data = pattern(24 * MIB as usize + 4321, 11);
    std::fs::write(&src, &data).expect("write src");
    let uri = nbds(&c, "disk", &pki.path("client"));
    // nbdcopy in (several connections, each its own TLS session) and out.
    run(Command::new("nbdcopy").args(["--connections=4", "--flush"]).arg(&src).arg(&uri));
    let back = tmp.path().join("back.raw");
    run(Command::new("nbdcopy").arg(&uri).arg(&back));
    let got = std::fs::read(&back).expect("read back");
    assert_eq!(got.len(), 32 * MIB as usize);
    assert!(got[..data.len()] == data[..], "nbdcopy round trip over TLS differs");
    assert!(got[data.len()..].iter().all(|&b| b == 0), "the tail of the volume is zero");
    let sessions = tls_sessions(&c);
    assert!(sessions >= 2, "every connection ran in TLS ({sessions})");
    // qemu-img: write other data over TLS, then compare the export with it.
    let src2 = tmp.path().join("src2.raw");
    let data2 = pattern(20 * MIB as usize, 12);
    std::fs::write(&src2, &data2).expect("write src2");
    let object = qemu_tls_object(&pki.path("client"));
    run(Command::new("qemu-img")
        .args(["convert", "--object", &object, "-n", "-f", "raw", "--target-image-opts"])
        .arg(&src2)
        .arg(qemu_opts(&c, "disk")));
    let out = tmp.path().join("out.raw");
    run(Command::new("qemu-img")
        .args(["convert", "--object", &object, "--image-opts", &qemu_opts(&c, "disk"), "-O", "raw"])
        .arg(&out));
    let got = std::fs::read(&out).expect("read qemu copy");
    assert!(got[..data2.len()] == data2[..], "qemu-img round trip over TLS differs");
    assert!(got[data2.len()..data.len()] == data[data2.len()..], "bytes past the second write are the first's");
    assert!(tls_sessions(&c) > sessions, "qemu-img connected over TLS");
    // The volume's file holds exactly what went over the wire.
    let file = std::fs::read(c.path("disk")).expect("volume file");
    assert!(file[..data2.len()] == data2[..], "on disk");
}

#[test]
fn allow_serves_plain_and_tls_clients_side_by_side() {
    let _gate = crate::gate::shared();
    require("nbdsh");
    let pki = Pki::new();
    let c = start(&pki, TlsMode::Allow, false);
    c.create("disk", 4 * MIB);
    // nbdsh refuses tls-certificates in a URI unless allowed, so it connects by hand.
    let script = |uri: &str, tag: &str, tls: bool| {
        format!(
            "h.set_uri_allow_local_file(True)\nh.connect_uri('{uri}')\nassert h.get_tls_negotiated() == {}\nh.pwrite(b'{tag}' * 1024, 0)\nassert h.pread(4096, 0) == b'{tag}' * 1024\nprint('ok {tag}')\n",
            if tls { "True" } else { "False" }
        )
    };
    let nbdsh = |code: String| {
        let mut cmd = Command::new("/usr/bin/nbdsh");
        cmd.env("PATH", format!("/usr/bin:/bin:{}", std::env::var("PATH").unwrap_or_default()));
        cmd.args(["-c", &code]);
        cmd
    };
    let out = run(&mut nbdsh(script(&c.uri("disk"), "pl41", false)));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok pl41"));
    assert_eq!(tls_sessions(&c), 0, "the plain client stayed plain");
    let out = run(&mut nbdsh(script(&nbds(&c, "disk", &pki.path("client")), "tl52", true)));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok tl52"));
    assert_eq!(tls_sessions(&c), 1);
    // With TLS off, an nbds:// client is refused (libnbd requires TLS for nbds).
    let off = Corona::start(IoEngine::Threads);
    off.create("disk", MIB);
    let r = Command::new("nbdinfo").arg(nbds(&off, "disk", &pki.path("client"))).output().expect("run nbdinfo");
    assert!(!r.status.success(), "nbds:// got in with TLS off");
}

#[test]
fn verify_peer_wants_a_client_certificate_from_the_ca() {
    let _gate = crate::gate::shared();
    require("nbdinfo");
    let pki = Pki::new();
    let c = start(&pki, TlsMode::Require, true);
    c.create("disk", MIB);
    let anonymous = Command::new("nbdinfo").arg(nbds(&c, "disk", &pki.path("client"))).output().expect("run");
    assert!(!anonymous.status.success(), "a client without a certificate got in under --tls-verify-peer");
    let out = run(Command::new("nbdinfo").arg(nbds(&c, "disk", &pki.path("client-auth"))));
    assert!(String::from_utf8_lossy(&out.stdout).contains("with TLS"));
    assert_eq!(tls_sessions(&c), 1, "only the client with a certificate completed TLS");
}

#[test]
fn a_broken_certificate_directory_and_psk_fail_at_start_with_the_reason() {
    let _gate = crate::gate::shared();
    let pki = Pki::new();
    // The key of another certificate: rustls refuses the pair.
    let bad = tempfile::tempdir().expect("tmp");
    std::fs::copy(pki.path("server/server-cert.pem"), bad.path().join("server-cert.pem")).expect("copy");
    std::fs::copy(pki.path("client-auth/client-key.pem"), bad.path().join("server-key.pem")).expect("copy");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
    let data = tempfile::tempdir().expect("tmp");
    let mut cfg = coronafs::config::ServerConfig::ephemeral(data.path(), IoEngine::Threads);
    cfg.tls = TlsConfig { mode: TlsMode::Require, certificates: Some(bad.path().into()), verify_peer: false };
    let e = rt.block_on(coronafs::service::start(cfg.clone())).expect_err("a mismatched key").to_string();
    assert!(e.contains("server-cert.pem and server-key.pem"), "{e}");
    cfg.tls.certificates = Some(data.path().join("nowhere"));
    let e = rt.block_on(coronafs::service::start(cfg)).expect_err("no directory").to_string();
    assert!(e.contains("nowhere/server-cert.pem"), "{e}");
    // The binary refuses --tls-psk with the reason, before serving anything.
    let psk = data.path().join("keys.psk");
    std::fs::write(&psk, "alice:0123456789abcdef0123456789abcdef\n").expect("psk");
    let out = Command::new(stack_tests::bin("coronafs", "coronafs"))
        .args(["serve", "--data-dir"])
        .arg(data.path())
        .args(["--nbd", "127.0.0.1:0", "--api", "127.0.0.1:0", "--tls", "require", "--tls-psk"])
        .arg(&psk)
        .output()
        .expect("run coronafs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--tls-psk") && err.contains("not implemented") && err.contains("rustls"), "{err}");
}

#[test]
fn in_the_clear_a_require_server_answers_err_tls_reqd_with_a_message_and_closes_export_name() {
    let _gate = crate::gate::shared();
    use coronafs::proto::handshake::{
        ClientOption, OPTION_REPLY_HEADER_LEN, decode_option_reply_header, encode_option,
    };
    use coronafs::proto::{opt, rep};
    use std::io::{Read, Write};
    let pki = Pki::new();
    let c = start(&pki, TlsMode::Require, false);
    c.create("disk", MIB);
    let connect = || {
        let mut s = std::net::TcpStream::connect(c.addr()).expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(10))).expect("timeout");
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).expect("greeting");
        s.write_all(&3u32.to_be_bytes()).expect("flags");
        s
    };
    let mut s = connect();
    for o in [ClientOption::Go { name: "disk".into(), requests: vec![] }, ClientOption::List, ClientOption::Unknown(42)]
    {
        let (code, data) = o.encode_payload();
        let mut msg = Vec::new();
        encode_option(code, &data, &mut msg);
        s.write_all(&msg).expect("option");
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        s.read_exact(&mut h).expect("reply");
        let (got, ty, len) = decode_option_reply_header(&h).expect("magic");
        let mut text = vec![0u8; len as usize];
        s.read_exact(&mut text).expect("message");
        assert_eq!((got, ty), (code, rep::ERR_TLS_REQD), "{o:?}");
        let text = String::from_utf8_lossy(&text);
        assert!(text.contains("requires TLS") && text.contains("STARTTLS"), "{o:?}: {text}");
    }
    // NBD_OPT_EXPORT_NAME cannot carry an error: the server hangs up.
    let mut s = connect();
    let mut msg = Vec::new();
    encode_option(opt::EXPORT_NAME, b"disk", &mut msg);
    s.write_all(&msg).expect("option");
    let mut b = [0u8; 1];
    assert!(matches!(s.read(&mut b), Ok(0) | Err(_)), "EXPORT_NAME in the clear must close the connection");
    assert_eq!(c.srv().metrics.connections.load(Ordering::Relaxed), 0, "nobody reached transmission");
}
