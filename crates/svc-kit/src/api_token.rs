//! Bearer tokens for the HTTP control APIs (CoronaFS's control API,
//! PlasmaVMC's REST API and its worker agents' API).
//!
//! A server holding an [`ApiToken`] wraps its router with [`protect`]: every
//! request must carry `Authorization: Bearer TOKEN`, except `GET`/`HEAD` of
//! [`OPEN_PATHS`] (`/healthz` and `/metrics`, for monitoring). A request
//! without it, with another scheme or with another token is answered 401,
//! with a `WWW-Authenticate: Bearer` header and the service's own JSON error
//! body, before any handler runs, so it changes nothing.
//!
//! Where a server finds its token ([`TokenSources::resolve`], first wins):
//! `--api-token-file PATH`, the service's environment variable, then
//! `api_token_file` or `api_token` in its config file (not both). A file
//! keeps the token out of `ps`; its surrounding whitespace (the trailing
//! newline) is dropped. Without a token a server may only listen on loopback
//! (with a warning), or anywhere if its operator passed `--no-api-token`
//! (unsafe: anyone who reaches the port may change state); see
//! [`check_exposure`].
//!
//! Tokens are compared in constant time: both sides are hashed with SHA-256
//! and the digests compared without an early exit, so neither the content
//! nor the length of the token leaks through the answer's timing.

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The shortest token accepted.
pub const MIN_LEN: usize = 16;

/// The paths open without a token (to `GET` and `HEAD` only).
pub const OPEN_PATHS: [&str; 2] = ["/healthz", "/metrics"];

/// What can be wrong with a token or with where it comes from.
#[derive(Debug, thiserror::Error)]
pub enum ApiTokenError {
    /// The token is shorter than [`MIN_LEN`].
    #[error("the API token has {len} characters; at least {MIN_LEN} are required")]
    TooShort { len: usize },
    /// The token holds a character that cannot go in an HTTP header as is.
    #[error("the API token may hold only printable ASCII characters, no spaces (it is sent in an HTTP header)")]
    BadCharacter,
    /// The token file could not be read.
    #[error("cannot read the API token file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// The token file holds no valid token.
    #[error("{path}: {source}")]
    InFile { path: PathBuf, source: Box<ApiTokenError> },
    /// A token given twice (e.g. `api_token` and `api_token_file`), or an
    /// invalid one, named by where it came from.
    #[error("{0}")]
    Invalid(String),
    /// No random source for [`ApiToken::random`].
    #[error("no random source for an API token: {0}")]
    NoRandom(String),
    /// The API would be open to the network.
    #[error(
        "{service}'s API listens on {listen}, which is not loopback, and no API token is set: \
         give one ({how}), or pass --no-api-token to run without one (unsafe: anyone who can reach \
         the port can change state)"
    )]
    Missing { service: String, listen: SocketAddr, how: String },
}

/// A bearer token: at least [`MIN_LEN`] printable ASCII characters without
/// spaces. Its `Debug` form does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken(Arc<str>);

impl std::fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiToken(..)")
    }
}

impl std::str::FromStr for ApiToken {
    type Err = ApiTokenError;
    fn from_str(s: &str) -> Result<Self, ApiTokenError> {
        ApiToken::new(s)
    }
}

impl ApiToken {
    /// `text` as a token, if long enough and made of printable ASCII.
    pub fn new(text: &str) -> Result<Self, ApiTokenError> {
        if !text.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ApiTokenError::BadCharacter);
        }
        if text.len() < MIN_LEN {
            return Err(ApiTokenError::TooShort { len: text.len() });
        }
        Ok(ApiToken(text.into()))
    }

    /// The token in the file at `path`, without surrounding whitespace.
    pub fn from_file(path: &Path) -> Result<Self, ApiTokenError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ApiTokenError::Read { path: path.to_owned(), source })?;
        ApiToken::new(text.trim()).map_err(|e| ApiTokenError::InFile { path: path.to_owned(), source: Box::new(e) })
    }

    /// A fresh random token (64 hex digits, 256 bits).
    pub fn random() -> Result<Self, ApiTokenError> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| ApiTokenError::NoRandom(e.to_string()))?;
        Ok(ApiToken(hex::encode(b).into()))
    }

    /// The token itself, to send or to write into a file.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time independent of both.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (Sha256::digest(self.0.as_bytes()), Sha256::digest(presented.as_bytes()));
        a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// A client's token: `--token-file PATH` when given, else `--token TEXT`
    /// (which clap also fills from the service's environment variable), as
    /// a server takes its file flag before its variable. The file wins so
    /// that `--token-file` works where the variable is set.
    pub fn for_client(text: Option<&str>, file: Option<&Path>) -> Result<Option<Self>, ApiTokenError> {
        match (text, file) {
            (_, Some(p)) => ApiToken::from_file(p).map(Some),
            (Some(t), None) => ApiToken::new(t).map(Some),
            (None, None) => Ok(None),
        }
    }
}

/// Where a server may find its token; [`TokenSources::resolve`] takes the
/// first that is set, in the order of the fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenSources {
    /// `--api-token-file PATH`.
    pub flag_file: Option<PathBuf>,
    /// The service's environment variable (name, value), when set.
    pub env: Option<(String, String)>,
    /// `api_token_file` in the config file.
    pub config_file: Option<PathBuf>,
    /// `api_token` in the config file.
    pub config_token: Option<String>,
}

impl TokenSources {
    /// Adds the value of the environment variable `var`, if set and not empty.
    pub fn with_env(mut self, var: &str) -> Self {
        self.env = std::env::var(var).ok().filter(|v| !v.is_empty()).map(|v| (var.to_owned(), v));
        self
    }

    /// The token, from the first source set; an invalid token is an error
    /// naming where it came from.
    pub fn resolve(&self) -> Result<Option<ApiToken>, ApiTokenError> {
        if self.config_file.is_some() && self.config_token.is_some() {
            return Err(ApiTokenError::Invalid(
                "the config file sets both api_token and api_token_file: keep one".into(),
            ));
        }
        let named = |what: &str, e: ApiTokenError| match e {
            e @ (ApiTokenError::Read { .. } | ApiTokenError::InFile { .. }) => e,
            e => ApiTokenError::Invalid(format!("{what}: {e}")),
        };
        if let Some(p) = &self.flag_file {
            return ApiToken::from_file(p).map(Some).map_err(|e| named("--api-token-file", e));
        }
        if let Some((var, value)) = &self.env {
            return ApiToken::new(value.trim()).map(Some).map_err(|e| named(var, e));
        }
        if let Some(p) = &self.config_file {
            return ApiToken::from_file(p).map(Some).map_err(|e| named("api_token_file", e));
        }
        match &self.config_token {
            Some(t) => ApiToken::new(t).map(Some).map_err(|e| named("api_token", e)),
            None => Ok(None),
        }
    }
}

/// Decides whether a server may start: with a token always; without one
/// only on a loopback address (logged as a warning) or when `no_token`
/// (`--no-api-token`, logged as a warning too). `how` tells the operator
/// where a token can be set (in the error).
pub fn check_exposure(
    service: &str,
    listen: SocketAddr,
    token: Option<&ApiToken>,
    no_token: bool,
    how: &str,
) -> Result<(), ApiTokenError> {
    if token.is_some() {
        if no_token {
            return Err(ApiTokenError::Invalid("--no-api-token given together with an API token: drop one".into()));
        }
        return Ok(());
    }
    if no_token {
        tracing::warn!(%listen, "{service}'s API runs without a token (--no-api-token): anyone who reaches it can change state");
        return Ok(());
    }
    if listen.ip().is_loopback() {
        tracing::warn!(%listen, "{service}'s API has no token: open to every local user ({how})");
        return Ok(());
    }
    Err(ApiTokenError::Missing { service: service.to_owned(), listen, how: how.to_owned() })
}

/// Renders a refusal in the service's own JSON error body (the status is
/// set to 401 afterwards).
pub type Refusal = fn(String) -> Response;

struct Guard {
    token: ApiToken,
    refusal: Refusal,
}

/// `router` with every request but `GET`/`HEAD` of [`OPEN_PATHS`]
/// requiring `token`; without a token, `router` as it is.
pub fn protect(router: Router, token: Option<ApiToken>, refusal: Refusal) -> Router {
    match token {
        Some(token) => router.layer(axum::middleware::from_fn_with_state(Arc::new(Guard { token, refusal }), check)),
        None => router,
    }
}

/// The token of an `Authorization` header, or why there is none.
fn presented(req: &Request) -> Result<&str, &'static str> {
    let value = req.headers().get(header::AUTHORIZATION).ok_or("missing `Authorization: Bearer TOKEN`")?;
    let text = value.to_str().map_err(|_| "the Authorization header is not ASCII")?;
    match text.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => Ok(token.trim()),
        _ => Err("the Authorization header must be `Bearer TOKEN`"),
    }
}

async fn check(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    let open = matches!(*req.method(), Method::GET | Method::HEAD) && OPEN_PATHS.contains(&req.uri().path());
    if open {
        return next.run(req).await;
    }
    let (why, challenge) = match presented(&req) {
        Ok(t) if g.token.matches(t) => return next.run(req).await,
        Ok(_) => ("wrong API token", "Bearer error=\"invalid_token\""),
        Err(why) => (why, "Bearer"),
    };
    let mut resp = (g.refusal)(format!("unauthorized: {why}"));
    *resp.status_mut() = StatusCode::UNAUTHORIZED;
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TOKEN: &str = "0123456789abcdef-token";

    #[test]
    fn short_tokens_and_tokens_with_spaces_are_refused() {
        let e = ApiToken::new("short").expect_err("refused").to_string();
        assert!(e.contains("5 characters") && e.contains("at least 16"), "{e}");
        assert!(matches!(ApiToken::new("0123456789 abcdefgh"), Err(ApiTokenError::BadCharacter)));
        assert!(matches!(ApiToken::new("0123456789abcdefé"), Err(ApiTokenError::BadCharacter)));
        assert_eq!(ApiToken::new("0123456789abcdef").expect("16 is enough").expose(), "0123456789abcdef");
        assert_eq!(format!("{:?}", ApiToken::new(TOKEN).expect("ok")), "ApiToken(..)", "Debug hides it");
    }

    #[test]
    fn tokens_match_only_themselves() {
        let t = ApiToken::new(TOKEN).expect("ok");
        assert!(t.matches(TOKEN));
        assert!(!t.matches("0123456789abcdef-tokeN"));
        assert!(!t.matches("0123456789abcdef-token-"));
        assert!(!t.matches(""));
        let (a, b) = (ApiToken::random().expect("random"), ApiToken::random().expect("random"));
        assert_eq!(a.expose().len(), 64);
        assert_ne!(a, b);
    }

    #[test]
    fn sources_are_taken_in_order_and_files_are_trimmed() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("token");
        std::fs::write(&file, format!("{TOKEN}\n")).expect("write");
        let other = "fedcba9876543210-other";
        let all = TokenSources {
            flag_file: Some(file.clone()),
            env: Some(("X_TOKEN".into(), other.into())),
            config_file: None,
            config_token: Some(other.into()),
        };
        assert_eq!(all.resolve().expect("ok").expect("set").expose(), TOKEN, "the flag's file first");
        let env = TokenSources { flag_file: None, ..all.clone() };
        assert_eq!(env.resolve().expect("ok").expect("set").expose(), other);
        let cfg = TokenSources { config_file: Some(file.clone()), config_token: None, ..TokenSources::default() };
        assert_eq!(cfg.resolve().expect("ok").expect("set").expose(), TOKEN);
        assert!(TokenSources::default().resolve().expect("ok").is_none());
        let both = TokenSources { config_file: Some(file.clone()), ..all.clone() };
        assert!(both.resolve().expect_err("refused").to_string().contains("both api_token and api_token_file"));
        let short = TokenSources { env: Some(("X_TOKEN".into(), "abc".into())), ..TokenSources::default() };
        let e = short.resolve().expect_err("refused").to_string();
        assert!(e.starts_with("X_TOKEN: ") && e.contains("at least 16"), "{e}");
        std::fs::write(&file, "short\n").expect("write");
        let e = cfg.resolve().expect_err("refused").to_string();
        assert!(e.starts_with(&format!("{}: ", file.display())) && e.contains("at least 16"), "{e}");
        let gone = TokenSources { flag_file: Some(dir.path().join("none")), ..TokenSources::default() };
        assert!(gone.resolve().expect_err("refused").to_string().contains("cannot read the API token file"));
    }

    #[test]
    fn without_a_token_only_loopback_or_an_explicit_opt_out_may_start() {
        let lo: SocketAddr = "127.0.0.1:7070".parse().expect("addr");
        let any: SocketAddr = "0.0.0.0:7070".parse().expect("addr");
        let t = ApiToken::new(TOKEN).expect("ok");
        check_exposure("svc", lo, None, false, "--api-token-file").expect("loopback");
        check_exposure("svc", any, Some(&t), false, "--api-token-file").expect("token");
        check_exposure("svc", any, None, true, "--api-token-file").expect("explicitly unsafe");
        let e = check_exposure("svc", any, None, false, "--api-token-file").expect_err("refused").to_string();
        assert!(e.contains("0.0.0.0:7070") && e.contains("--no-api-token") && e.contains("--api-token-file"), "{e}");
        assert!(check_exposure("svc", any, Some(&t), true, "x").is_err(), "both is a contradiction");
    }

    fn refusal(m: String) -> Response {
        axum::response::IntoResponse::into_response(axum::Json(serde_like(&m)))
    }

    /// `{"error": m}` without serde_json (not a dependency here).
    fn serde_like(m: &str) -> std::collections::BTreeMap<&'static str, String> {
        std::collections::BTreeMap::from([("error", m.to_owned())])
    }

    /// One raw HTTP/1.1 request to `addr`; the answer's text.
    async fn http(addr: SocketAddr, method: &str, path: &str, auth: Option<&str>) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let auth = auth.map(|a| format!("authorization: {a}\r\n")).unwrap_or_default();
        let req =
            format!("{method} {path} HTTP/1.1\r\nhost: x\r\n{auth}content-length: 0\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        out
    }

    #[tokio::test]
    async fn the_layer_lets_only_the_right_bearer_token_through_and_health_stays_open() {
        let changed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = changed.clone();
        let app = Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/metrics", get(|| async { "m 1\n" }))
            .route(
                "/v1/things",
                post(move || {
                    let c = c.clone();
                    async move {
                        c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        "made\n"
                    }
                }),
            );
        let app = protect(app, Some(ApiToken::new(TOKEN).expect("ok")), refusal);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let refused = [
            None,
            Some("Bearer wrong-token-0123456789".to_owned()),
            Some(format!("Basic {TOKEN}")),
            Some(format!("Bearer{TOKEN}")),
            Some("Bearer ".to_owned()),
        ];
        for auth in &refused {
            let r = http(addr, "POST", "/v1/things", auth.as_deref()).await;
            assert!(r.starts_with("HTTP/1.1 401"), "{auth:?}: {r}");
            assert!(r.to_ascii_lowercase().contains("www-authenticate: bearer"), "{r}");
            assert!(r.contains("{\"error\":\"unauthorized: "), "{r}");
        }
        let r = http(addr, "POST", "/v1/things", Some("Bearer wrong-token-0123456789")).await;
        assert!(r.contains("wrong API token") && r.contains("invalid_token"), "{r}");
        assert_eq!(changed.load(std::sync::atomic::Ordering::SeqCst), 0, "no refused request reached the handler");
        let r = http(addr, "POST", "/v1/things", Some(&format!("Bearer {TOKEN}"))).await;
        assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("made\n"), "{r}");
        let r = http(addr, "POST", "/v1/things", Some(&format!("bearer {TOKEN}"))).await;
        assert!(r.starts_with("HTTP/1.1 200"), "the scheme is case-insensitive: {r}");
        assert_eq!(changed.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(http(addr, "GET", "/healthz", None).await.starts_with("HTTP/1.1 200"));
        assert!(http(addr, "GET", "/metrics", None).await.starts_with("HTTP/1.1 200"));
        assert!(http(addr, "POST", "/healthz", None).await.starts_with("HTTP/1.1 401"), "only reads are open");
        assert!(http(addr, "GET", "/nowhere", None).await.starts_with("HTTP/1.1 401"), "unknown paths too");
        server.abort();
    }

    #[test]
    fn a_client_takes_its_token_file_before_its_token_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("token");
        std::fs::write(&f, "from-the-file-0123456789\n").expect("write");
        let t = ApiToken::for_client(Some("from-the-variable-0123456"), Some(&f)).expect("file").expect("some");
        assert_eq!(t.expose(), "from-the-file-0123456789");
        let t = ApiToken::for_client(Some("from-the-variable-0123456"), None).expect("text").expect("some");
        assert_eq!(t.expose(), "from-the-variable-0123456");
        assert!(ApiToken::for_client(None, None).expect("none").is_none());
        assert!(ApiToken::for_client(Some("short"), None).is_err(), "a short token is refused");
    }
}
