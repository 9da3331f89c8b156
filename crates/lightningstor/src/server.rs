//! Serving: the s3s service (auth, virtual hosts) over hyper, plus `/metrics`.

use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::s3::LightningS3;
use crate::store::Store;
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

/// The configured key pair. Unknown keys are `InvalidAccessKeyId`, as S3
/// answers (s3s's `SimpleAuth` says `NotSignedUp`).
struct KeyAuth {
    access_key: String,
    secret_key: String,
}

#[async_trait::async_trait]
impl S3Auth for KeyAuth {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<SecretKey> {
        if access_key == self.access_key {
            Ok(SecretKey::from(self.secret_key.clone()))
        } else {
            Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::InvalidAccessKeyId,
                "the access key id you provided does not exist in our records",
            ))
        }
    }
}

/// Longest validity of a presigned URL, as S3 allows: seven days.
pub const MAX_PRESIGNED_EXPIRES_S: u64 = 7 * 24 * 3600;

/// The access check of every request, after its signature was verified.
/// With keys *and* `anonymous`, unsigned requests are allowed; without
/// `anonymous`, a request must be signed. A presigned URL valid for more
/// than seven days is refused as S3 refuses it (s3s accepts any lifetime).
struct Access {
    anonymous: bool,
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
        if cx.credentials().is_none() && !self.anonymous {
            return Err(s3s::S3Error::with_message(s3s::S3ErrorCode::AccessDenied, "Signature is required"));
        }
        Ok(())
    }
}

/// Builds the s3s service for `store` as its configuration says.
pub fn service(store: Arc<Store>) -> S3Service {
    let cfg = store.config.clone();
    service_for(LightningS3::new(store), &cfg)
}

/// Builds an s3s service over any `S3` implementation with the auth, access
/// and virtual-host settings of `cfg`.
pub fn service_for(s3: impl s3s::S3, cfg: &Config) -> S3Service {
    let mut b = S3ServiceBuilder::new(s3);
    if let Some((ak, sk)) = cfg.keys() {
        b.set_auth(KeyAuth { access_key: ak.to_owned(), secret_key: sk.to_owned() });
        b.set_access(Access { anonymous: cfg.anonymous });
    }
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
    let svc = service(store.clone());
    let metrics: MetricsFn = Arc::new(move || store_metrics(&store));
    serve_with(listener, svc, metrics)
}

/// Serves an s3s service and `/metrics` on an already bound listener, with
/// the default [`Limits`].
pub fn serve_with(listener: TcpListener, svc: S3Service, metrics: MetricsFn) -> Result<Running> {
    serve_with_limits(listener, svc, metrics, Limits::default())
}

/// [`serve_with`] with the given limits on slow and oversized requests.
pub fn serve_with_limits(listener: TcpListener, svc: S3Service, metrics: MetricsFn, limits: Limits) -> Result<Running> {
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
            let svc = svc.clone();
            let metrics = metrics.clone();
            let handler = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let svc = svc.clone();
                let metrics = metrics.clone();
                async move {
                    if is_metrics(&req) {
                        return Ok::<_, HttpError>(metrics_response(metrics()));
                    }
                    if let Some(size) = limits::oversized(req.headers()) {
                        return Ok(limits::entity_too_large(size));
                    }
                    let idle = limits.body_idle_timeout;
                    let (mut parts, body) = req.into_parts();
                    let ended = hyper::body::Body::is_end_stream(&body);
                    let body = if spool::lacks_length(&parts.headers, &hyper::body::Body::size_hint(&body), ended) {
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
