//! Feeds arbitrary bytes to every NBD decoder and to the server's option
//! state machine: each must return a value or an error, never panic.
#![no_main]

use coronafs::proto::handshake::{self, ClientOption, ExportCatalog, ExportDesc, Negotiator, TlsMode};
use coronafs::proto::reply::{self, ReplyHeader};
use coronafs::proto::request::Request;
use libfuzzer_sys::fuzz_target;

struct Catalog;
impl ExportCatalog for Catalog {
    fn lookup(&self, name: &str) -> Result<ExportDesc, String> {
        (name == "disk")
            .then(|| ExportDesc {
                name: name.into(),
                size: 1 << 30,
                read_only: false,
                description: String::new(),
                min_block: 1,
                pref_block: 4096,
                max_block: 32 << 20,
            })
            .ok_or_else(|| "no such export".into())
    }
    fn names(&self) -> Vec<String> {
        vec!["disk".into()]
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = <&[u8; 28]>::try_from(data.get(..28).unwrap_or(&[])) {
        if let Ok(r) = Request::decode(h) {
            let _ = r.validate(1 << 30, false, 32 << 20);
        }
    }
    if let Ok(h) = <&[u8; 32]>::try_from(data.get(..32).unwrap_or(&[])) {
        if let Ok(r) = Request::decode_ext(h) {
            let _ = r.validate(1 << 40, false, 32 << 20);
        }
    }
    let _ = ReplyHeader::decode(data);
    let _ = reply::decode_block_status(data);
    let _ = reply::decode_block_status_ext(data);
    let _ = reply::decode_error_payload(data);
    let _ = handshake::decode_info(data);
    if data.len() >= 4 {
        let code = u32::from_be_bytes([data[0], data[1], data[2], data[3]]) % 16;
        let _ = ClientOption::parse(code, &data[4..]);
        // The TLS policy from the first byte, so every mode is fuzzed.
        let tls = [TlsMode::Off, TlsMode::Allow, TlsMode::Require][data[0] as usize % 3];
        let mut n = Negotiator::with_tls(u32::from(data[1] & 3), tls);
        let mut out = Vec::new();
        // Feed the rest as a sequence of options: [code u8][len u8][payload].
        let mut rest = &data[4..];
        while rest.len() >= 2 {
            let (c, l) = (rest[0] as u32 % 16, rest[1] as usize);
            let end = (2 + l).min(rest.len());
            let _ = n.handle(c, &rest[2..end], &Catalog, &mut out);
            rest = &rest[end..];
        }
    }
});
