//! The admin API: key and permission changes sent to a running server
//! (`lightningstor key ...`, `lightningstor bucket allow ...`), and its client.
//!
//! The server owns its metadata database (redb has one writer), so the CLI
//! does not open it: it sends HTTP requests to the server's S3 address,
//! signed with the admin key (the configured `access_key`/`secret_key`):
//!
//! ```text
//! POST /_admin/keys?name=NAME                      create a key
//! GET  /_admin/keys                                list keys and grants
//! DELETE /_admin/keys?key=ID_OR_NAME               delete a key
//! POST /_admin/grants?bucket=B&key=K&allow=P&deny=P change a grant
//!      (each with &nonce=N: 16 to 64 hex digits, new for every request,
//!       and &node=IP:PORT: the address the client connected to)
//! Authorization: LS-ADMIN <access key id>:<unix seconds>:<hex HMAC-SHA256(secret,
//!                "LS-ADMIN\n" seconds "\n" METHOD "\n" path?query)>
//! ```
//!
//! The server accepts the tag of the admin key only, within five minutes of
//! its clock; no S3 request carries this scheme, so the two never mix. A
//! recorded request cannot be used again:
//!
//! - every request carries a random `nonce=` in its (signed) query, and a
//!   server takes each nonce once: it remembers the nonces of the requests
//!   it took until their time leaves the five minutes ([`Replays`]);
//! - that memory is per process, so a request names the node it is for:
//!   `node=` is the socket address the client's connection went to, and the
//!   server takes only requests naming the address the connection arrived
//!   at ([`check_node`]; the server checks it against its own socket, no
//!   guessing). Sent to another node of a cluster, or to another server
//!   with the same admin key, it is refused. Through NAT or a port forward
//!   the two addresses differ and every admin request is refused: run the
//!   CLI where it reaches the node's own address;
//! - a request signed before the server process started is refused
//!   ([`verify`]'s `started_s`), so a restart, which empties the nonce
//!   memory, does not open a replay. Times are in seconds: a request signed
//!   in the very second the server started is taken (its nonce memory is
//!   that process's from then on), and a client whose clock trails the
//!   server's must wait that much after a start.
//!
//! The requests have no body. Answers are text: `200` with tab-separated
//! lines, or an error status with `CODE: message`. Nothing is encrypted (a
//! created key's secret travels in the answer): reach the admin API over
//! loopback or a trusted network.

use crate::error::{LightningError, Result};
use crate::keys::Perms;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::time::Duration;

/// The authorization scheme of admin requests.
pub const SCHEME: &str = "LS-ADMIN";
/// How far the request's time may be from the server's.
pub const MAX_SKEW_S: i64 = 300;

fn tag(secret: &str, secs: i64, method: &str, target: &str) -> Hmac<Sha256> {
    // An HMAC key may have any length: this cannot fail.
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    mac.update(format!("{SCHEME}\n{secs}\n{method}\n{target}").as_bytes());
    mac
}

/// The `Authorization` value of an admin request to `target` (path and query).
pub fn authorization(access_key: &str, secret: &str, secs: i64, method: &str, target: &str) -> String {
    let t = hex::encode(tag(secret, secs, method, target).finalize().into_bytes());
    format!("{SCHEME} {access_key}:{secs}:{t}")
}

/// Checks an admin request's `Authorization` value against the admin key
/// at server time `now_s` (constant-time tag comparison), for a server
/// process that started at `started_s`; returns the request's time (unix
/// seconds).
pub fn verify(
    header: &str,
    admin: Option<(&str, &str)>,
    now_s: i64,
    started_s: i64,
    method: &str,
    target: &str,
) -> Result<i64> {
    let denied = |m: &str| Err(LightningError::AccessDenied(m.to_owned()));
    let Some(rest) = header.strip_prefix(SCHEME).and_then(|r| r.strip_prefix(' ')) else {
        return denied("not an admin request");
    };
    let mut parts = rest.splitn(3, ':');
    let (Some(ak), Some(secs), Some(t)) = (parts.next(), parts.next(), parts.next()) else {
        return denied("malformed admin authorization");
    };
    let Some((admin_ak, admin_sk)) = admin else {
        return denied("this server has no admin key (access_key/secret_key): it takes no admin requests");
    };
    if ak != admin_ak {
        return denied("admin requests must be signed with the admin key");
    }
    let Ok(secs) = secs.parse::<i64>() else { return denied("malformed admin authorization time") };
    if (now_s - secs).abs() > MAX_SKEW_S {
        return denied("the admin request's time is more than five minutes from the server's");
    }
    let Ok(t) = hex::decode(t) else { return denied("malformed admin authorization tag") };
    if tag(admin_sk, secs, method, target).verify_slice(&t).is_err() {
        return denied("admin signature does not match");
    }
    if secs < started_s {
        // The nonces this process remembers are those it took since it
        // started: an older request may have been taken by its predecessor.
        return denied("the admin request was signed before this server started; sign a new request");
    }
    Ok(secs)
}

/// Checks that an admin request's (signed) query names the node it reached:
/// `node=` must be `local`, the address its connection arrived at (IPv4 and
/// IPv4-mapped IPv6 forms of one address are the same). AccessDenied when
/// it names another node or none.
pub fn check_node(query: &str, local: Option<std::net::SocketAddr>) -> Result<()> {
    let denied = |m: String| Err(LightningError::AccessDenied(m));
    let Some(named) = query_value(query, "node")? else {
        return denied(
            "an admin request must name the node it is for (node=IP:PORT, the address the client connected to, \
             in its signed query); update the client"
                .into(),
        );
    };
    let Some(local) = local else {
        return denied("this server cannot tell which address the connection arrived at".into());
    };
    let canonical = |a: std::net::SocketAddr| (a.ip().to_canonical(), a.port());
    match named.parse::<std::net::SocketAddr>() {
        Ok(a) if canonical(a) == canonical(local) => Ok(()),
        Ok(_) => denied(format!(
            "this admin request was signed for another node ({named}); this is {local}: \
             a request is taken only by the node it names"
        )),
        Err(_) => denied(format!("node={named:?} is not an IP address and port")),
    }
}

/// The nonces of the admin requests a server took, each kept until its
/// request's time is out of the accepted window (then [`verify`] refuses the
/// request anyway). Only requests whose signature checked are recorded, so
/// nobody without the admin key can fill it; it is still capped.
#[derive(Debug, Default)]
pub struct Replays {
    /// nonce -> the last second at which its request would still be accepted.
    seen: std::sync::Mutex<std::collections::HashMap<String, i64>>,
}

/// Most nonces remembered at once (admin requests are rare: at one request a
/// second, five minutes hold 600).
const MAX_REMEMBERED: usize = 100_000;

impl Replays {
    /// Takes the nonce of a verified request made at `secs`, at server time
    /// `now_s`: AccessDenied if it is missing, malformed or already taken.
    pub fn take(&self, query: &str, secs: i64, now_s: i64) -> Result<()> {
        let denied = |m: &str| Err(LightningError::AccessDenied(m.to_owned()));
        let nonce = query_value(query, "nonce")?.unwrap_or_default();
        if !(16..=64).contains(&nonce.len()) || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return denied("an admin request needs a nonce of 16 to 64 hex digits in its query");
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, until| *until >= now_s);
        if seen.contains_key(&nonce) {
            return denied("this admin request was already taken (a replay): each request needs a new nonce");
        }
        if seen.len() >= MAX_REMEMBERED {
            return Err(LightningError::Unavailable("too many admin requests in five minutes; try again later".into()));
        }
        seen.insert(nonce, secs + MAX_SKEW_S);
        Ok(())
    }
}

/// A fresh nonce for an admin request: 16 random bytes in hex.
pub fn new_nonce() -> Result<String> {
    let mut b = [0u8; 16];
    crate::keys::random(&mut b)?;
    Ok(hex::encode(b))
}

/// Percent-encodes a query value (unreserved characters pass).
pub fn encode(v: &str) -> String {
    let mut out = String::new();
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The value of `name` in a query string, percent-decoded.
pub fn query_value(query: &str, name: &str) -> Result<Option<String>> {
    for (k, v) in query.split('&').filter_map(|kv| kv.split_once('=')) {
        if k == name {
            let mut out = Vec::new();
            let b = v.as_bytes();
            let mut i = 0;
            while i < b.len() {
                if b[i] == b'%' {
                    let hex = v.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok());
                    let Some(x) = hex else {
                        return Err(LightningError::InvalidArgument(format!("bad percent-encoding in {name}")));
                    };
                    out.push(x);
                    i += 3;
                } else {
                    out.push(if b[i] == b'+' { b' ' } else { b[i] });
                    i += 1;
                }
            }
            return String::from_utf8(out)
                .map(Some)
                .map_err(|_| LightningError::InvalidArgument(format!("{name} is not UTF-8")));
        }
    }
    Ok(None)
}

/// A created key, as `key create` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewKey {
    /// Access key id.
    pub id: String,
    /// Name.
    pub name: String,
    /// Secret (shown once).
    pub secret: String,
}

/// A key as `key list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    /// Access key id.
    pub id: String,
    /// Name.
    pub name: String,
    /// Grants: (bucket, permissions).
    pub grants: Vec<(String, Perms)>,
}

impl KeyInfo {
    /// One line: `id \t name \t bucket=perms bucket=perms`.
    pub fn to_line(&self) -> String {
        let g: Vec<String> = self.grants.iter().map(|(b, p)| format!("{b}={p}")).collect();
        format!("{}\t{}\t{}", self.id, self.name, g.join(" "))
    }

    /// Parses [`KeyInfo::to_line`].
    pub fn from_line(line: &str) -> Result<Self> {
        let bad = || LightningError::InvalidArgument(format!("bad key line {line:?}"));
        let mut f = line.split('\t');
        let (Some(id), Some(name), grants) = (f.next(), f.next(), f.next().unwrap_or("")) else { return Err(bad()) };
        let mut out = Vec::new();
        for g in grants.split(' ').filter(|g| !g.is_empty()) {
            let (b, p) = g.split_once('=').ok_or_else(bad)?;
            out.push((b.to_owned(), Perms::parse(p)?));
        }
        Ok(KeyInfo { id: id.to_owned(), name: name.to_owned(), grants: out })
    }
}

/// The admin API's client, used by the CLI and the tests.
#[derive(Debug, Clone)]
pub struct Client {
    /// `host:port` of the server's S3 address.
    pub addr: String,
    access_key: String,
    secret_key: String,
    timeout: Duration,
}

impl Client {
    /// A client of the server at `addr` (`host:port`) signing with the admin key.
    pub fn new(addr: &str, access_key: &str, secret_key: &str) -> Self {
        Client {
            addr: addr.to_owned(),
            access_key: access_key.to_owned(),
            secret_key: secret_key.to_owned(),
            timeout: Duration::from_secs(30),
        }
    }

    async fn call(&self, method: &str, target: &str) -> Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let nonce = new_nonce()?;
        let io = async {
            let mut s = tokio::net::TcpStream::connect(&self.addr).await?;
            // The request names the node it is for: the address this
            // connection went to (see the module docs).
            let node = s.peer_addr()?;
            let sep = if target.contains('?') { '&' } else { '?' };
            let target = format!("{target}{sep}nonce={nonce}&node={}", encode(&node.to_string()));
            let secs = crate::meta::now_ms() / 1000;
            let auth = authorization(&self.access_key, &self.secret_key, secs, method, &target);
            let req = format!(
                "{method} {target} HTTP/1.1\r\nHost: {}\r\nAuthorization: {auth}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                self.addr
            );
            s.write_all(req.as_bytes()).await?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await?;
            Ok::<_, std::io::Error>(buf)
        };
        let buf = tokio::time::timeout(self.timeout, io)
            .await
            .map_err(|_| {
                LightningError::Unavailable(format!("{} did not answer within {:?}", self.addr, self.timeout))
            })?
            .map_err(|e| LightningError::Unavailable(format!("cannot reach {}: {e}", self.addr)))?;
        let text = String::from_utf8_lossy(&buf);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = dechunk(head, body);
        match status {
            200 => Ok(body),
            403 => Err(LightningError::AccessDenied(body.trim().to_owned())),
            404 => Err(LightningError::InvalidArgument(body.trim().to_owned())),
            400 => Err(LightningError::InvalidArgument(body.trim().to_owned())),
            0 => Err(LightningError::Unavailable(format!("{} answered no HTTP", self.addr))),
            s => Err(LightningError::Unavailable(format!("{} answered {s}: {}", self.addr, body.trim()))),
        }
    }

    /// Creates key `name`.
    pub async fn create_key(&self, name: &str) -> Result<NewKey> {
        let body = self.call("POST", &format!("/_admin/keys?name={}", encode(name))).await?;
        let mut f = body.trim_end().split('\t');
        match (f.next(), f.next(), f.next()) {
            (Some(id), Some(name), Some(secret)) => {
                Ok(NewKey { id: id.to_owned(), name: name.to_owned(), secret: secret.to_owned() })
            }
            _ => Err(LightningError::Unavailable(format!("unexpected answer {body:?}"))),
        }
    }

    /// Every live key with its grants.
    pub async fn list_keys(&self) -> Result<Vec<KeyInfo>> {
        let body = self.call("GET", "/_admin/keys").await?;
        body.lines().filter(|l| !l.is_empty()).map(KeyInfo::from_line).collect()
    }

    /// Deletes a key (by id or name); returns its id.
    pub async fn delete_key(&self, key: &str) -> Result<String> {
        Ok(self.call("DELETE", &format!("/_admin/keys?key={}", encode(key))).await?.trim().to_owned())
    }

    /// Adds `allow` to and removes `deny` from a key's permissions on a
    /// bucket; returns the permissions afterwards.
    pub async fn change_grant(&self, bucket: &str, key: &str, allow: Perms, deny: Perms) -> Result<Perms> {
        let target = format!(
            "/_admin/grants?bucket={}&key={}&allow={}&deny={}",
            encode(bucket),
            encode(key),
            encode(&allow.to_string()),
            encode(&deny.to_string())
        );
        let body = self.call("POST", &target).await?;
        let p = body.trim().rsplit('\t').next().unwrap_or("");
        Perms::parse(p)
    }
}

/// The body of an HTTP/1.1 answer, undoing chunked transfer encoding.
fn dechunk(head: &str, body: &str) -> String {
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_admin_key_s_fresh_tag_for_this_request_is_accepted() {
        let admin = Some(("AK", "secret"));
        let verify = |h: &str, admin, now_s, method, target| verify(h, admin, now_s, 0, method, target);
        let h = authorization("AK", "secret", 1000, "POST", "/_admin/keys?name=a");
        verify(&h, admin, 1000, "POST", "/_admin/keys?name=a").expect("accepted");
        verify(&h, admin, 1000 + MAX_SKEW_S, "POST", "/_admin/keys?name=a").expect("within the skew");
        assert!(verify(&h, admin, 1001 + MAX_SKEW_S, "POST", "/_admin/keys?name=a").is_err(), "too old");
        assert!(verify(&h, admin, 1000, "POST", "/_admin/keys?name=b").is_err(), "other target");
        assert!(verify(&h, admin, 1000, "DELETE", "/_admin/keys?name=a").is_err(), "other method");
        assert!(verify(&h, Some(("AK", "other")), 1000, "POST", "/_admin/keys?name=a").is_err(), "other secret");
        assert!(verify(&h, Some(("BK", "secret")), 1000, "POST", "/_admin/keys?name=a").is_err(), "other key");
        let e = verify(&h, None, 1000, "POST", "/_admin/keys?name=a").expect_err("no admin key");
        assert!(e.to_string().contains("no admin key"), "{e}");
        assert!(verify("LS-ADMIN AK:1000", admin, 1000, "GET", "/").is_err());
    }

    #[test]
    fn a_nonce_is_taken_once_while_its_request_could_be_accepted() {
        let r = Replays::default();
        let n = "nonce=0123456789abcdef";
        r.take(n, 1000, 1000).expect("first");
        let e = r.take(&format!("a=1&{n}"), 1000, 1100).expect_err("replay");
        assert!(e.to_string().contains("replay"), "{e}");
        // Once the request's time is out of the window, verify refuses it,
        // so the nonce is forgotten.
        r.take(n, 1400, 1000 + MAX_SKEW_S + 1).expect("forgotten after the window");
        for bad in ["", "nonce=", "nonce=0123", "nonce=0123456789abcdeg", &format!("nonce={}", "a".repeat(65))] {
            assert!(r.take(bad, 1000, 1000).is_err(), "{bad:?}");
        }
        let a = new_nonce().expect("nonce");
        assert_eq!(a.len(), 32);
        assert_ne!(a, new_nonce().expect("nonce"));
        let h = authorization("AK", "s", 1234, "GET", "/");
        assert_eq!(verify(&h, Some(("AK", "s")), 1300, 0, "GET", "/").expect("accepted"), 1234, "the request's time");
    }

    #[test]
    fn a_request_signed_before_the_server_started_is_refused() {
        let admin = Some(("AK", "s"));
        let h = authorization("AK", "s", 1000, "GET", "/_admin/keys");
        assert_eq!(verify(&h, admin, 1010, 1000, "GET", "/_admin/keys").expect("signed as it started"), 1000);
        assert_eq!(verify(&h, admin, 1010, 990, "GET", "/_admin/keys").expect("signed after it started"), 1000);
        // The same request after a restart at 1001, within the five minutes:
        // the new process has no memory of its nonce.
        let e = verify(&h, admin, 1010, 1001, "GET", "/_admin/keys").expect_err("signed before the start");
        assert!(e.to_string().contains("signed before this server started; sign a new request"), "{e}");
        // A bad signature is still reported as such.
        let forged = authorization("AK", "other", 1000, "GET", "/_admin/keys");
        let e = verify(&forged, admin, 1010, 1001, "GET", "/_admin/keys").expect_err("forged");
        assert!(e.to_string().contains("signature does not match"), "{e}");
    }

    #[test]
    fn a_request_is_taken_only_by_the_node_it_names() {
        let here: std::net::SocketAddr = "10.0.0.2:9000".parse().expect("addr");
        let q = |node: &str| format!("name=a&nonce=0123456789abcdef&node={}", encode(node));
        check_node(&q("10.0.0.2:9000"), Some(here)).expect("this node");
        let mapped: std::net::SocketAddr = "[::ffff:10.0.0.2]:9000".parse().expect("addr");
        check_node(&q("10.0.0.2:9000"), Some(mapped)).expect("a dual-stack socket's form of it");
        for other in ["10.0.0.3:9000", "10.0.0.2:9001", "127.0.0.1:9000"] {
            let e = check_node(&q(other), Some(here)).expect_err("another node");
            assert!(e.to_string().contains("another node"), "{e}");
        }
        let e = check_node("name=a&nonce=0123456789abcdef", Some(here)).expect_err("none named");
        assert!(e.to_string().contains("must name the node"), "{e}");
        let e = check_node(&q("n2"), Some(here)).expect_err("not an address");
        assert!(e.to_string().contains("not an IP address"), "{e}");
        assert!(check_node(&q("10.0.0.2:9000"), None).is_err(), "no local address, no admin request");
    }

    #[test]
    fn query_values_round_trip_through_encoding() {
        let q = format!("a=1&name={}&b=", encode("x y/ü&=z"));
        assert_eq!(query_value(&q, "name").expect("ok").as_deref(), Some("x y/ü&=z"));
        assert_eq!(query_value(&q, "b").expect("ok").as_deref(), Some(""));
        assert_eq!(query_value(&q, "c").expect("ok"), None);
        assert!(query_value("name=%zz", "name").is_err());
    }

    #[test]
    fn key_lines_round_trip() {
        let k = KeyInfo {
            id: "LS0123".into(),
            name: "job".into(),
            grants: vec![("a".into(), Perms::READ), ("b".into(), Perms::ALL)],
        };
        assert_eq!(KeyInfo::from_line(&k.to_line()).expect("parse"), k);
        let none = KeyInfo { grants: Vec::new(), ..k };
        assert_eq!(KeyInfo::from_line(&none.to_line()).expect("parse"), none);
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            "abcde"
        );
        assert_eq!(dechunk("HTTP/1.1 200 OK\r\nContent-Length: 2", "ab"), "ab");
    }
}
