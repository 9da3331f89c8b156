//! What the HTTP layer does before s3s sees a request: it answers admin
//! requests (see [`crate::admin`]) and, on an anonymous server, serves a
//! request signed with a key it does not know as an unsigned one.
//!
//! Why the second: every stock client (aws-sdk, aws cli, rclone) signs,
//! with whatever key it was given, and a signature made with an unknown
//! secret cannot be checked. An anonymous server lets anyone do anything,
//! so checking it would protect nothing; the signature is dropped and the
//! request handled as anonymous. Requests signed with a key the server
//! knows are still verified. One case cannot be served that way: an
//! `aws-chunked` body (`x-amz-content-sha256: STREAMING-...`), whose framing
//! only the signature check decodes; it is answered NotImplemented.

use crate::admin;
use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::keys::{self, Keyring};
use std::sync::Arc;

/// The admin endpoint and the anonymous server's handling of unknown keys.
pub struct Gate {
    keyring: Arc<dyn Keyring>,
    admin: Option<(String, String)>,
    /// Nonces of the admin requests taken (a replay is refused).
    replays: admin::Replays,
    /// When this gate (the server process) started, in Unix seconds: an
    /// admin request signed before is refused, since the nonces taken
    /// before a restart are forgotten.
    started_s: i64,
    anonymous: bool,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("anonymous", &self.anonymous).finish_non_exhaustive()
    }
}

/// The access key id a request is signed with (SigV4 header or query, SigV2 header).
pub fn signing_key(headers: &http::HeaderMap, query: Option<&str>) -> Option<String> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        if let Some(i) = v.find("Credential=") {
            return v[i + 11..].split('/').next().map(str::to_owned);
        }
        if let Some(rest) = v.strip_prefix("AWS ") {
            return rest.split(':').next().map(str::to_owned);
        }
        return None;
    }
    let q = query?;
    let cred = admin::query_value(q, "X-Amz-Credential").ok().flatten()?;
    cred.split('/').next().map(str::to_owned)
}

/// `query` without the parameters of a presigned URL's signature.
fn unsigned_query(query: &str) -> String {
    const SIGNING: [&str; 7] = [
        "X-Amz-Algorithm",
        "X-Amz-Credential",
        "X-Amz-Date",
        "X-Amz-Expires",
        "X-Amz-SignedHeaders",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
    ];
    query.split('&').filter(|kv| !SIGNING.contains(&kv.split('=').next().unwrap_or(""))).collect::<Vec<_>>().join("&")
}

fn text(status: http::StatusCode, body: String) -> http::Response<s3s::Body> {
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// `e` as an S3 error answered before s3s (request id included).
fn s3_error(e: &LightningError) -> http::Response<s3s::Body> {
    let code = e.s3_code();
    let status = code.status_code().unwrap_or(http::StatusCode::BAD_REQUEST);
    super::limits::early_error(status, code.as_str(), &e.to_string(), "")
}

impl Gate {
    /// The gate of a server with `cfg`'s admin key and anonymous flag.
    pub fn new(keyring: Arc<dyn Keyring>, cfg: &Config) -> Self {
        let admin = cfg.keys().map(|(a, s)| (a.to_owned(), s.to_owned()));
        let started_s = crate::meta::now_ms() / 1000;
        Gate { keyring, admin, replays: admin::Replays::default(), started_s, anonymous: cfg.anonymous }
    }

    /// Whether `req` is an admin request (its scheme is `LS-ADMIN`).
    pub fn is_admin<B>(req: &http::Request<B>) -> bool {
        req.headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with(admin::SCHEME) && v[admin::SCHEME.len()..].starts_with(' '))
    }

    /// Answers an admin request that arrived on a connection to `local`
    /// (this server's address the client connected to).
    pub async fn admin<B>(
        &self,
        req: &http::Request<B>,
        local: Option<std::net::SocketAddr>,
    ) -> http::Response<s3s::Body> {
        match self.admin_inner(req, local).await {
            Ok(body) => text(http::StatusCode::OK, body),
            Err(e) => {
                let status = e.s3_code().status_code().unwrap_or(http::StatusCode::BAD_REQUEST);
                text(status, format!("{}: {e}\n", e.s3_code().as_str()))
            }
        }
    }

    async fn admin_inner<B>(&self, req: &http::Request<B>, local: Option<std::net::SocketAddr>) -> Result<String> {
        let method = req.method().as_str();
        let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
        let header = req.headers().get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).unwrap_or("");
        let admin = self.admin.as_ref().map(|(a, s)| (a.as_str(), s.as_str()));
        let now_s = crate::meta::now_ms() / 1000;
        let secs = admin::verify(header, admin, now_s, self.started_s, method, target)?;
        let query = req.uri().query().unwrap_or("");
        admin::check_node(query, local)?;
        self.replays.take(query, secs, now_s)?;
        let arg = |name: &str| -> Result<String> {
            admin::query_value(query, name)?
                .ok_or_else(|| LightningError::InvalidArgument(format!("{name} is missing")))
        };
        let kr = &*self.keyring;
        match (method, req.uri().path()) {
            ("POST", "/_admin/keys") => {
                let (id, key) = keys::create_key(kr, &arg("name")?).await?;
                tracing::info!(key = %id, name = %key.name, "key created");
                Ok(format!("{id}\t{}\t{}\n", key.name, key.secret))
            }
            ("GET", "/_admin/keys") => {
                let grants = kr.grants()?;
                let mut out = String::new();
                for (id, key) in kr.keys()? {
                    let mine = grants.iter().filter(|(_, k, _)| *k == id).map(|(b, _, p)| (b.clone(), *p)).collect();
                    out.push_str(&admin::KeyInfo { id, name: key.name, grants: mine }.to_line());
                    out.push('\n');
                }
                Ok(out)
            }
            ("DELETE", "/_admin/keys") => {
                let id = keys::delete_key(kr, &arg("key")?).await?;
                tracing::info!(key = %id, "key deleted");
                Ok(format!("{id}\n"))
            }
            ("POST", "/_admin/grants") => {
                let (bucket, key) = (arg("bucket")?, arg("key")?);
                let allow = keys::Perms::parse(&admin::query_value(query, "allow")?.unwrap_or_default())?;
                let deny = keys::Perms::parse(&admin::query_value(query, "deny")?.unwrap_or_default())?;
                let (id, perms) = keys::change_grant(kr, &bucket, &key, allow, deny).await?;
                tracing::info!(key = %id, bucket = %bucket, perms = %perms, "grant changed");
                Ok(format!("{id}\t{bucket}\t{perms}\n"))
            }
            (m, p) => Err(LightningError::InvalidArgument(format!("no admin operation {m} {p}"))),
        }
    }

    /// Whether `id` is the admin key or a live key of the keyring.
    fn knows(&self, id: &str) -> bool {
        self.admin.as_ref().is_some_and(|(a, _)| a == id) || matches!(self.keyring.key(id), Ok(Some(_)))
    }

    /// Whether a body without a length may be written to a temporary file
    /// (see `server::spool`) before s3s checks the request's signature,
    /// which needs the length: only on an anonymous server, or for a
    /// request that names a key this server knows. `Some` is the answer to
    /// send instead, without reading the body. This is not the signature
    /// check (that still follows), but a client that holds no key can no
    /// longer make the server write gigabytes to its temporary directory.
    pub fn may_spool(&self, headers: &http::HeaderMap, query: Option<&str>) -> Option<http::Response<s3s::Body>> {
        if self.anonymous {
            return None;
        }
        match signing_key(headers, query) {
            Some(id) if self.knows(&id) => None,
            Some(id) => Some(s3_error(&LightningError::InvalidAccessKeyId(format!(
                "the access key {id:?} does not exist on this server"
            )))),
            None => Some(s3_error(&LightningError::AccessDenied(
                "a body without a length is only taken from a signed request".into(),
            ))),
        }
    }

    /// On an anonymous server, drops the signature of a request signed with
    /// an unknown key (see the module docs); `Some` is the answer to send
    /// instead. Other requests pass unchanged.
    pub fn unsign<B>(&self, req: &mut http::Request<B>) -> Option<http::Response<s3s::Body>> {
        if !self.anonymous {
            return None;
        }
        let id = signing_key(req.headers(), req.uri().query())?;
        if self.knows(&id) {
            return None;
        }
        let streaming = req
            .headers()
            .get("x-amz-content-sha256")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("STREAMING-"));
        if streaming {
            return Some(s3_error(&LightningError::NotImplemented(format!(
                "this anonymous server does not know the key {id:?}, so it cannot decode an aws-chunked \
                 (STREAMING-*) body, which only the signature check unwraps: sign with a key the server \
                 knows, or send the body in one piece"
            ))));
        }
        if req.headers_mut().remove(http::header::AUTHORIZATION).is_none() {
            let uri = req.uri().clone();
            let q = unsigned_query(uri.query().unwrap_or(""));
            let pq = if q.is_empty() { uri.path().to_owned() } else { format!("{}?{q}", uri.path()) };
            let mut parts = uri.into_parts();
            parts.path_and_query = pq.parse().ok();
            if let Ok(u) = http::Uri::from_parts(parts) {
                *req.uri_mut() = u;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signing_key_comes_from_the_header_or_the_query() {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            http::HeaderValue::from_static(
                "AWS4-HMAC-SHA256 Credential=AKID/20250101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=ab",
            ),
        );
        assert_eq!(signing_key(&h, None).as_deref(), Some("AKID"));
        h.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("AWS OLD:sig"));
        assert_eq!(signing_key(&h, None).as_deref(), Some("OLD"));
        let q = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=PRE%2F20250101%2Fus-east-1%2Fs3%2Faws4_request&x=1";
        assert_eq!(signing_key(&http::HeaderMap::new(), Some(q)).as_deref(), Some("PRE"));
        assert_eq!(signing_key(&http::HeaderMap::new(), Some("list-type=2")), None);
        assert_eq!(unsigned_query(q), "x=1");
        assert_eq!(unsigned_query("X-Amz-Signature=1"), "");
    }
}
