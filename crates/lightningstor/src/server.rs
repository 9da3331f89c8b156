//! Serving: the s3s service (auth, virtual hosts) over hyper, plus `/metrics`.

use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::keys::{self, Keyring, Need, Perms};
use crate::s3::LightningS3;
use crate::store::Store;
pub use gate::Gate;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder as ConnBuilder;
pub use limits::Limits;
use s3s::access::{S3Access, S3AccessContext};
use s3s::auth::{S3Auth, SecretKey};
use s3s::host::{S3Host, VirtualHost};
use s3s::service::{S3Service, S3ServiceBuilder};
use s3s::{HttpError, S3Result};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

mod gate;
mod limits;
mod post;
mod spool;

/// Virtual-hosted-style parsing: `BUCKET.DOMAIN[:port]` names a bucket; any
/// other host (an IP, `DOMAIN` itself, an unknown name) means path style.
#[derive(Debug, Clone)]
pub struct Domains(pub Vec<String>);

fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((h, p)) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    }
}

impl Domains {
    /// The bucket a Host header names, if any.
    pub fn bucket<'a>(&self, host: &'a str) -> Option<&'a str> {
        let name = strip_port(host);
        self.0
            .iter()
            .find_map(|d| name.strip_suffix(d.as_str()).and_then(|h| h.strip_suffix('.')).filter(|b| !b.is_empty()))
    }
}

impl S3Host for Domains {
    fn parse_host_header<'a>(&'a self, host: &'a str) -> S3Result<VirtualHost<'a>> {
        let name = strip_port(host);
        Ok(match self.bucket(host) {
            Some(b) => VirtualHost::new(name).with_bucket(b),
            None => VirtualHost::new(name),
        })
    }
}

/// Signature keys: the configured admin key, then the keyring's. Unknown
/// keys are `InvalidAccessKeyId`, as S3 answers (s3s's `SimpleAuth` says
/// `NotSignedUp`).
struct KeyAuth {
    admin: Option<(String, String)>,
    keyring: Arc<dyn Keyring>,
}

#[async_trait::async_trait]
impl S3Auth for KeyAuth {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<SecretKey> {
        if let Some((ak, sk)) = &self.admin
            && ak == access_key
        {
            return Ok(SecretKey::from(sk.clone()));
        }
        match self.keyring.key(access_key) {
            Ok(Some(k)) => Ok(SecretKey::from(k.secret)),
            Ok(None) => Err(LightningError::InvalidAccessKeyId(access_key.to_owned()).to_s3_error()),
            Err(e) => Err(e.to_s3_error()),
        }
    }
}

/// Longest validity of a presigned URL, as S3 allows: seven days.
pub const MAX_PRESIGNED_EXPIRES_S: u64 = 7 * 24 * 3600;

/// The access check of every request, after its signature was verified:
/// the one place permissions are enforced, for a single node and a cluster.
///
/// - unsigned: allowed on an anonymous server, else AccessDenied;
/// - on an anonymous server, or signed with the admin key: everything;
/// - signed with a keyring key: what [`keys::need`] asks of the request's
///   bucket (and of a copy's source bucket), from the key's grants.
///
/// A presigned URL valid for more than seven days is refused as S3 refuses
/// it (s3s accepts any lifetime).
struct Access {
    anonymous: bool,
    admin: Option<String>,
    keyring: Arc<dyn Keyring>,
}

impl Access {
    fn allowed(&self, id: &str, bucket: &str, need: Perms) -> S3Result<()> {
        let have = self.keyring.perms(bucket, id).map_err(|e| e.to_s3_error())?;
        if have.contains(need) {
            Ok(())
        } else {
            Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::AccessDenied,
                format!("key {id} lacks the {need} permission on bucket {bucket:?} (it has: {have})"),
            ))
        }
    }
}

/// `X-Amz-Expires` of a presigned URL's query, checked against S3's bounds.
fn check_presigned_expires(query: Option<&str>) -> S3Result<()> {
    let Some(q) = query else { return Ok(()) };
    for (k, v) in q.split('&').filter_map(|kv| kv.split_once('=')) {
        if k != "X-Amz-Expires" {
            continue;
        }
        return match v.parse::<u64>() {
            Ok(n) if (1..=MAX_PRESIGNED_EXPIRES_S).contains(&n) => Ok(()),
            _ => Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::AuthorizationQueryParametersError,
                format!(
                    "X-Amz-Expires must be between 1 and {MAX_PRESIGNED_EXPIRES_S} seconds (seven days), not {v:?}"
                ),
            )),
        };
    }
    Ok(())
}

#[async_trait::async_trait]
impl S3Access for Access {
    async fn check(&self, cx: &mut S3AccessContext<'_>) -> S3Result<()> {
        check_presigned_expires(cx.uri().query())?;
        let Some(creds) = cx.credentials() else {
            if self.anonymous {
                return Ok(());
            }
            return Err(s3s::S3Error::with_message(s3s::S3ErrorCode::AccessDenied, "Signature is required"));
        };
        if self.anonymous || self.admin.as_deref() == Some(creds.access_key.as_str()) {
            return Ok(());
        }
        let id = creds.access_key.clone();
        let bucket = cx.s3_path().get_bucket_name();
        match (keys::need(cx.s3_op().name()), bucket) {
            (Need::AnyKey, _) => Ok(()),
            (Need::Bucket(p), Some(b)) => self.allowed(&id, b, p),
            (Need::Copy, Some(b)) => {
                self.allowed(&id, b, Perms::WRITE)?;
                let src = cx.headers().get("x-amz-copy-source").and_then(|v| v.to_str().ok()).unwrap_or("");
                match keys::copy_source_bucket(src) {
                    Some(sb) => self.allowed(&id, sb, Perms::READ),
                    // s3s refuses the malformed header itself.
                    None => Ok(()),
                }
            }
            _ => Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::AccessDenied,
                format!("{} is for the admin key only", cx.s3_op().name()),
            )),
        }
    }
}

/// Builds the s3s service for `store` as its configuration says.
pub fn service(store: Arc<Store>) -> S3Service {
    let cfg = store.config.clone();
    service_for(LightningS3::new(store.clone()), &cfg, store)
}

/// Starts the single node's background work (the lifecycle task); it ends
/// when `store` is dropped. [`serve`] calls it; in-process users of
/// [`service`] call it themselves.
pub fn spawn_background(store: &Arc<Store>) -> tokio::task::JoinHandle<()> {
    crate::s3::lifecycle::spawn(store)
}

/// Builds an s3s service over any `S3` implementation with the auth, access
/// and virtual-host settings of `cfg` and the keys of `keyring`.
pub fn service_for(s3: impl s3s::S3, cfg: &Config, keyring: Arc<dyn Keyring>) -> S3Service {
    let mut b = S3ServiceBuilder::new(s3);
    let admin = cfg.keys().map(|(a, s)| (a.to_owned(), s.to_owned()));
    // Always an auth provider, also on an anonymous server: without one s3s
    // answers every signed request NotImplemented.
    b.set_auth(KeyAuth { admin: admin.clone(), keyring: keyring.clone() });
    b.set_access(Access { anonymous: cfg.anonymous, admin: admin.map(|(a, _)| a), keyring });
    if !cfg.domains.is_empty() {
        b.set_host(Domains(cfg.domains.clone()));
    }
    b.build()
}

fn is_metrics(req: &http::Request<Incoming>) -> bool {
    // A signed or presigned `GET /metrics` is ListObjects on a bucket named
    // "metrics"; only the plain unsigned request is ours.
    req.method() == http::Method::GET
        && req.uri().path() == "/metrics"
        && req.uri().query().is_none()
        && !req.headers().contains_key(http::header::AUTHORIZATION)
}

/// The node's Prometheus text.
pub fn store_metrics(store: &Store) -> String {
    let (blocks, objects) = store.meta.counts().unwrap_or((0, 0));
    store.metrics.render(&[("objects", "objects stored", objects), ("blocks", "distinct blocks referenced", blocks)])
}

/// Renders `/metrics`.
pub type MetricsFn = Arc<dyn Fn() -> String + Send + Sync>;

fn metrics_response(text: String) -> http::Response<s3s::Body> {
    let mut resp = http::Response::new(s3s::Body::from(text));
    resp.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/plain; version=0.0.4"));
    resp
}

/// A running server; dropping the handle does not stop it, [`Running::shutdown`] does.
#[derive(Debug)]
pub struct Running {
    /// The address it listens on.
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops accepting, lets in-flight requests finish (up to 10 s), and returns.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Binds `config.listen`, opens the store and serves until shutdown.
pub async fn start(config: Config) -> Result<(Running, Arc<Store>)> {
    let listener = TcpListener::bind(config.listen).await?;
    let store = tokio::task::spawn_blocking(move || Store::open(config))
        .await
        .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
    let running = serve(listener, store.clone())?;
    Ok((running, store))
}

/// Serves `store` on an already bound listener.
pub fn serve(listener: TcpListener, store: Arc<Store>) -> Result<Running> {
    spawn_background(&store);
    let svc = service(store.clone());
    let gate = Arc::new(Gate::new(store.clone(), &store.config));
    let metrics: MetricsFn = Arc::new(move || store_metrics(&store));
    serve_with(listener, svc, metrics, Some(gate))
}

/// Serves an s3s service, `/metrics` and (with a [`Gate`]) the admin API on
/// an already bound listener, with the default [`Limits`].
pub fn serve_with(
    listener: TcpListener,
    svc: S3Service,
    metrics: MetricsFn,
    gate: Option<Arc<Gate>>,
) -> Result<Running> {
    serve_with_limits(listener, svc, metrics, gate, Limits::default())
}

/// [`serve_with`] with the given limits on slow and oversized requests.
pub fn serve_with_limits(
    listener: TcpListener,
    svc: S3Service,
    metrics: MetricsFn,
    gate: Option<Arc<Gate>>,
    limits: Limits,
) -> Result<Running> {
    let addr = listener.local_addr()?;
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let mut builder = ConnBuilder::new(TokioExecutor::new());
        builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(limits.header_timeout);
        loop {
            let (sock, _) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = stopped.changed() => break,
            };
            let _ = sock.set_nodelay(true);
            // Admin requests name the address they were sent to (admin.rs).
            let local = sock.local_addr().ok();
            let svc = svc.clone();
            let metrics = metrics.clone();
            let gate = gate.clone();
            let handler = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
                let svc = svc.clone();
                let metrics = metrics.clone();
                let gate = gate.clone();
                async move {
                    if is_metrics(&req) {
                        return Ok::<_, HttpError>(metrics_response(metrics()));
                    }
                    if let Some(g) = &gate {
                        if Gate::is_admin(&req) {
                            return Ok(g.admin(&req, local).await);
                        }
                        if let Some(resp) = g.unsign(&mut req) {
                            return Ok(resp);
                        }
                    }
                    if let Some(size) = limits::oversized(req.headers()) {
                        return Ok(limits::entity_too_large(size));
                    }
                    let idle = limits.body_idle_timeout;
                    let (mut parts, body) = req.into_parts();
                    let ended = hyper::body::Body::is_end_stream(&body);
                    let body = if spool::lacks_length(&parts.headers, &hyper::body::Body::size_hint(&body), ended) {
                        if let Some(resp) = gate.as_ref().and_then(|g| g.may_spool(&parts.headers, parts.uri.query())) {
                            return Ok(limits::tag_reply(resp));
                        }
                        match spool::spool(limits::IdleBody::new(body, idle)).await {
                            Ok(spooled) => {
                                parts.headers.insert(http::header::CONTENT_LENGTH, spooled.len().into());
                                s3s::Body::http_body_unsync(spooled)
                            }
                            Err(e) => return Ok(spool_failed(e)),
                        }
                    } else if ended {
                        // Only a request that carries a body gets the idle timer
                        // (a boxed timer per request); a GET keeps s3s's direct path.
                        s3s::Body::from(body)
                    } else {
                        s3s::Body::http_body_unsync(limits::IdleBody::new(body, idle))
                    };
                    let resp = match post::form_boundary(&parts.method, &parts.headers) {
                        None => svc.call(http::Request::from_parts(parts, body)).await?,
                        Some(boundary) => {
                            let body = post::with_filename(&mut parts, body, &boundary).await;
                            let resp = svc.call(http::Request::from_parts(parts, body)).await?;
                            post::policy_violation_is_access_denied(resp)
                        }
                    };
                    Ok(limits::tag_reply(resp))
                }
            });
            let conn = builder.serve_connection(TokioIo::new(sock), handler).into_owned();
            let conn = graceful.watch(conn);
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
            });
        }
        drop(listener);
        tokio::select! {
            () = graceful.shutdown() => {}
            () = tokio::time::sleep(std::time::Duration::from_secs(10)) => {
                tracing::warn!("connections still open after 10 s; stopping anyway");
            }
        }
    });
    Ok(Running { addr, stop, task })
}

/// The reply to a length-less body that could not be spooled.
fn spool_failed(e: LightningError) -> http::Response<s3s::Body> {
    if let LightningError::EntityTooLarge { size } = e {
        return limits::entity_too_large(size);
    }
    let code = e.s3_code();
    if code == s3s::S3ErrorCode::InternalError {
        tracing::error!(error = %e, "spooling a request body without a length failed");
    }
    let status = code.status_code().unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    limits::early_error(status, code.as_str(), &e.to_string(), "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_under_a_base_domain_name_their_bucket() {
        let d = Domains(vec!["localhost".into(), "s3.example.com".into()]);
        assert_eq!(d.bucket("photos.localhost:9000"), Some("photos"));
        assert_eq!(d.bucket("a.b.s3.example.com"), Some("a.b"));
        assert_eq!(d.bucket("localhost:9000"), None);
        assert_eq!(d.bucket("127.0.0.1:9000"), None);
        assert_eq!(d.bucket("other.org"), None);
    }
}
