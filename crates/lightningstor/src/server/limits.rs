//! Limits on slow and oversized requests, applied before the S3 service.
//!
//! A client that opens a connection and then trickles (or stops sending) a
//! header or a body holds a connection and, for a PUT, staged blocks. Like
//! nginx's `client_header_timeout` and `client_body_timeout`, a header must
//! arrive within [`Limits::header_timeout`] (hyper closes the connection
//! otherwise) and a body may pause at most [`Limits::body_idle_timeout`]
//! between two pieces (the request then fails and nothing of it is stored).
//! A PUT declaring more than [`MAX_PUT_SIZE`] (S3's limit for one PUT or one
//! part) is answered EntityTooLarge at once, before a byte of its body is
//! read.

use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// The largest object one PUT (or one part of an upload) may carry: 5 GiB.
pub const MAX_PUT_SIZE: u64 = 5 << 30;

/// Time limits for slow or stalled clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A request's header must be complete within this.
    pub header_timeout: Duration,
    /// Longest pause allowed between two pieces of a request body.
    pub body_idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { header_timeout: Duration::from_secs(30), body_idle_timeout: Duration::from_secs(60) }
    }
}

/// The size a request (a PUT, a part, a POST upload) declares, when it is
/// over [`MAX_PUT_SIZE`]: its `Content-Length`, or for aws-chunked bodies the
/// decoded length.
pub fn oversized(headers: &http::HeaderMap) -> Option<u64> {
    let num = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let declared = num("x-amz-decoded-content-length").or_else(|| num("content-length"))?;
    (declared > MAX_PUT_SIZE).then_some(declared)
}

/// The EntityTooLarge reply (see [`early_error`]).
pub fn entity_too_large(size: u64) -> http::Response<s3s::Body> {
    early_error(
        http::StatusCode::BAD_REQUEST,
        "EntityTooLarge",
        "Your proposed upload exceeds the maximum allowed size",
        &format!("<ProposedSize>{size}</ProposedSize><MaxSizeAllowed>{MAX_PUT_SIZE}</MaxSizeAllowed>"),
    )
}

/// An S3 error answered by the front end before s3s reads the request,
/// with a request id in `x-amz-request-id` and the same in its XML, as
/// every handler's reply has them (`error::with_request_id`). The body may
/// be unread, so the connection is closed after the reply instead of being
/// kept for another request. `extra` is more XML inside `<Error>`.
pub fn early_error(status: http::StatusCode, code: &str, message: &str, extra: &str) -> http::Response<s3s::Body> {
    let id = crate::error::request_id();
    let message = message.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message>\
         {extra}<RequestId>{id}</RequestId></Error>"
    );
    let mut resp = http::Response::new(s3s::Body::from(xml));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/xml"));
    h.insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    if let Ok(v) = http::HeaderValue::from_str(&id) {
        h.insert("x-amz-request-id", v);
    }
    resp
}

/// Gives a reply that has no request id one: s3s answers some errors
/// itself before any handler runs (a bad signature, an unparsable request,
/// a POST policy), without `x-amz-request-id` or `<RequestId>`. The header
/// is added, and an error's XML body (in memory) gets the same id.
pub fn tag_reply(mut resp: http::Response<s3s::Body>) -> http::Response<s3s::Body> {
    if resp.headers().contains_key("x-amz-request-id") {
        return resp;
    }
    let id = crate::error::request_id();
    let Ok(value) = http::HeaderValue::from_str(&id) else { return resp };
    resp.headers_mut().insert("x-amz-request-id", value);
    if resp.status().as_u16() < 300 {
        return resp;
    }
    let Some(body) = resp.body().bytes() else { return resp };
    let Some(end) = body.windows(8).rposition(|w| w == b"</Error>") else { return resp };
    if body.windows(11).any(|w| w == b"<RequestId>") {
        return resp;
    }
    let mut xml = Vec::with_capacity(body.len() + 48);
    xml.extend_from_slice(&body[..end]);
    xml.extend_from_slice(format!("<RequestId>{id}</RequestId>").as_bytes());
    xml.extend_from_slice(&body[end..]);
    if resp.headers().contains_key(http::header::CONTENT_LENGTH) {
        resp.headers_mut().insert(http::header::CONTENT_LENGTH, xml.len().into());
    }
    *resp.body_mut() = s3s::Body::from(xml);
    resp
}

/// A request body that fails when no data arrives for `idle`.
pub struct IdleBody {
    inner: Incoming,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl IdleBody {
    /// Wraps `inner`; the clock starts now.
    pub fn new(inner: Incoming, idle: Duration) -> Self {
        IdleBody { inner, idle, timer: Box::pin(tokio::time::sleep(idle)) }
    }
}

impl hyper::body::Body for IdleBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                let next = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(next);
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                    "the request body stalled: no data for {} s",
                    this.idle.as_secs_f64()
                )
                .into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("value"));
        }
        h
    }

    #[test]
    fn bodies_over_five_gib_are_oversized_and_others_are_not() {
        assert_eq!(oversized(&headers(&[("content-length", "5368709120")])), None);
        assert_eq!(oversized(&headers(&[("content-length", "5368709121")])), Some(5_368_709_121));
        assert_eq!(oversized(&headers(&[])), None);
        assert_eq!(oversized(&headers(&[("content-length", "garbage")])), None);
        // aws-chunked: the decoded length counts, not the framed one.
        let chunked = headers(&[("content-length", "6000000000"), ("x-amz-decoded-content-length", "100")]);
        assert_eq!(oversized(&chunked), None);
        let big = headers(&[("content-length", "100"), ("x-amz-decoded-content-length", "6000000000")]);
        assert_eq!(oversized(&big), Some(6_000_000_000));
    }

    #[test]
    fn an_error_s3s_answered_gets_a_request_id_in_the_header_and_the_xml() {
        let xml = "<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code><Message>m</Message></Error>";
        let mut r = http::Response::new(s3s::Body::from(xml.to_owned()));
        *r.status_mut() = http::StatusCode::FORBIDDEN;
        r.headers_mut().insert(http::header::CONTENT_LENGTH, xml.len().into());
        let r = tag_reply(r);
        let id = r.headers()["x-amz-request-id"].to_str().expect("ascii").to_owned();
        let len: usize = r.headers()[http::header::CONTENT_LENGTH].to_str().expect("ascii").parse().expect("number");
        let body = r.into_body().bytes().expect("in memory");
        assert_eq!(len, body.len());
        assert!(String::from_utf8_lossy(&body).ends_with(&format!("<RequestId>{id}</RequestId></Error>")));
        // A reply that has one keeps it.
        let mut ok = http::Response::new(s3s::Body::empty());
        ok.headers_mut().insert("x-amz-request-id", http::HeaderValue::from_static("0123456789ABCDEF"));
        assert_eq!(tag_reply(ok).headers()["x-amz-request-id"], "0123456789ABCDEF");
    }

    #[test]
    fn the_entity_too_large_reply_names_both_sizes_and_closes() {
        let r = entity_too_large(6_000_000_000);
        assert_eq!(r.status(), 400);
        assert_eq!(r.headers()["connection"], "close");
        let id = r.headers()["x-amz-request-id"].to_str().expect("ascii").to_owned();
        assert_eq!(id.len(), 16);
        let body = r.into_body().bytes().expect("a body in memory");
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains(&format!("<RequestId>{id}</RequestId>")), "{text}");
        assert!(text.contains("<MaxSizeAllowed>5368709120</MaxSizeAllowed>"), "{text}");
    }
}
