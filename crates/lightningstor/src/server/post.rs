//! POST object (browser form uploads): what S3 does that s3s 0.14.1 does not.
//!
//! s3s parses the form, checks its signature and policy, and hands the
//! handler a PutObject. Two things clients see differ from S3, and both are
//! fixed here, around the s3s service:
//!
//! - `${filename}` in the `key` field is replaced by the name of the
//!   uploaded file (its `filename=` in the `file` part's
//!   Content-Disposition), before s3s checks the policy against the key, as
//!   S3 does. The fields come before the file, so only the form's head is
//!   read ahead (at most [`MAX_FORM_HEAD`] bytes) and rewritten; the file's
//!   bytes stream on untouched.
//! - A form that breaks a condition of its policy is 403 AccessDenied
//!   ("Invalid according to Policy"), not 400 InvalidPolicyDocument; a
//!   policy that is malformed (JSON, expiration) stays 400.
//!
//! The form parsing is pure ([`rewrite_filename`]) and unit-tested.

use bytes::{Bytes, BytesMut};
use hyper::body::{Body as _, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};

/// How much of a form is read ahead to find the file part.
pub const MAX_FORM_HEAD: usize = 1 << 20;

const FILENAME: &[u8] = b"${filename}";

/// The boundary of a `multipart/form-data` POST, if `req` is one.
pub fn form_boundary(method: &http::Method, headers: &http::HeaderMap) -> Option<String> {
    if method != http::Method::POST {
        return None;
    }
    let ct = headers.get(http::header::CONTENT_TYPE)?.to_str().ok()?;
    let (kind, params) = ct.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"').to_owned())
    })
}

/// What [`rewrite_filename`] found in the head of a form.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// The head ends before the file part's headers do: read more.
    NeedMore,
    /// Nothing to replace (no `${filename}` in the key, or no file part).
    Unchanged,
    /// `head[..consumed]` becomes `bytes`.
    Rewritten { consumed: usize, bytes: Vec<u8> },
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The `name` and `filename` parameters of a part's Content-Disposition.
fn disposition(headers: &[u8]) -> (Option<String>, Option<String>) {
    let text = String::from_utf8_lossy(headers);
    let Some(line) = text
        .split("\r\n")
        .find(|l| l.split_once(':').is_some_and(|(k, _)| k.trim().eq_ignore_ascii_case("content-disposition")))
    else {
        return (None, None);
    };
    let mut name = None;
    let mut filename = None;
    for p in line.split(';').skip(1) {
        let Some((k, v)) = p.split_once('=') else { continue };
        let v = v.trim().trim_matches('"').to_owned();
        match k.trim().to_ascii_lowercase().as_str() {
            "name" => name = Some(v),
            "filename" => filename = Some(v),
            _ => {}
        }
    }
    (name, filename)
}

/// Replaces `${filename}` in the `key` field of a form's head with the
/// `file` part's file name (S3 keeps only the name, not a path a browser
/// may send). `head` is the start of a `multipart/form-data` body with
/// `boundary`.
pub fn rewrite_filename(head: &[u8], boundary: &str) -> Head {
    let delim = [b"--".as_slice(), boundary.as_bytes()].concat();
    let next_delim = [b"\r\n".as_slice(), &delim].concat();
    let Some(mut pos) = find(head, &delim) else {
        return if head.len() < delim.len() + 2 { Head::NeedMore } else { Head::Unchanged };
    };
    let mut key: Option<std::ops::Range<usize>> = None;
    loop {
        let after = pos + delim.len();
        if head.len() < after + 2 {
            return Head::NeedMore;
        }
        if &head[after..after + 2] == b"--" {
            return Head::Unchanged;
        }
        let start = after + 2;
        let Some(end) = find(&head[start..], b"\r\n\r\n").map(|e| start + e) else { return Head::NeedMore };
        let (name, filename) = disposition(&head[start..end]);
        let body = end + 4;
        if name.as_deref() == Some("file") {
            let Some(k) = key.filter(|k| find(&head[k.clone()], FILENAME).is_some()) else { return Head::Unchanged };
            let file = filename.unwrap_or_default();
            let file = file.rsplit(['/', '\\']).next().unwrap_or_default();
            let value = String::from_utf8_lossy(&head[k.clone()]).replace("${filename}", file);
            let mut bytes = Vec::with_capacity(body + file.len());
            bytes.extend_from_slice(&head[..k.start]);
            bytes.extend_from_slice(value.as_bytes());
            bytes.extend_from_slice(&head[k.end..body]);
            return Head::Rewritten { consumed: body, bytes };
        }
        let Some(value_end) = find(&head[body..], &next_delim).map(|e| body + e) else { return Head::NeedMore };
        if name.as_deref() == Some("key") {
            key = Some(body..value_end);
        }
        pos = value_end + 2;
    }
}

/// A body whose first bytes were read ahead (and maybe rewritten); when
/// reading them ahead failed, the failure comes after them.
struct Prefixed {
    prefix: Option<Bytes>,
    failed: Option<s3s::StdError>,
    rest: s3s::Body,
}

impl hyper::body::Body for Prefixed {
    type Data = Bytes;
    type Error = s3s::StdError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(p) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(p))));
        }
        if let Some(e) = this.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.failed.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self.rest.size_hint();
        let n = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let mut h = SizeHint::new();
        if let Some(u) = rest.upper() {
            h.set_upper(u + n);
        }
        h.set_lower(rest.lower() + n);
        h
    }
}

/// Reads the head of a form body and replaces `${filename}` in its key
/// (see [`rewrite_filename`]); fixes `Content-Length` when the length
/// changes. A body that fails while its head is read fails the same way
/// later, in s3s.
pub async fn with_filename(parts: &mut http::request::Parts, mut body: s3s::Body, boundary: &str) -> s3s::Body {
    let mut head = BytesMut::new();
    let mut failed = None;
    let outcome = loop {
        match rewrite_filename(&head, boundary) {
            Head::NeedMore if head.len() < MAX_FORM_HEAD => {}
            Head::NeedMore => break Head::Unchanged,
            done => break done,
        }
        match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
            Some(Ok(frame)) => {
                if let Ok(d) = frame.into_data() {
                    head.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => {
                failed = Some(e);
                break Head::Unchanged;
            }
            None => break Head::Unchanged,
        }
    };
    let head = head.freeze();
    let prefix = match outcome {
        Head::Rewritten { consumed, bytes } => {
            let grown = bytes.len() as i128 - consumed as i128;
            if let Some(n) = parts
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i128>().ok())
                && let Ok(v) = u64::try_from(n + grown)
            {
                parts.headers.insert(http::header::CONTENT_LENGTH, v.into());
            }
            let mut b = BytesMut::from(bytes.as_slice());
            b.extend_from_slice(&head[consumed..]);
            b.freeze()
        }
        _ => head,
    };
    s3s::Body::http_body_unsync(Prefixed { prefix: Some(prefix), failed, rest: body })
}

/// S3's answer to a form that breaks its policy: s3s answers 400
/// InvalidPolicyDocument for a failed `eq` / `starts-with` condition or a
/// bucket field that is not the URL's; S3 answers 403 AccessDenied. Other
/// replies pass unchanged.
pub fn policy_violation_is_access_denied(resp: http::Response<s3s::Body>) -> http::Response<s3s::Body> {
    if resp.status() != http::StatusCode::BAD_REQUEST {
        return resp;
    }
    let Some(body) = resp.body().bytes() else { return resp };
    let text = String::from_utf8_lossy(&body);
    let message = text
        .split_once("<Message>")
        .and_then(|(_, m)| m.split_once("</Message>"))
        .map(|(m, _)| m.to_owned())
        .unwrap_or_default();
    let violated = text.contains("<Code>InvalidPolicyDocument</Code>")
        && (message.starts_with("Policy condition") || message.starts_with("Bucket in form field"));
    if !violated {
        return resp;
    }
    let message = message
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&");
    super::limits::early_error(
        http::StatusCode::FORBIDDEN,
        "AccessDenied",
        &format!("Invalid according to Policy: {message}"),
        "",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(fields: &[(&str, &str)], file: &str) -> Vec<u8> {
        let mut b = Vec::new();
        for (k, v) in fields {
            b.extend_from_slice(
                format!("--XB\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n").as_bytes(),
            );
        }
        b.extend_from_slice(
            format!("--XB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{file}\"\r\nContent-Type: text/plain\r\n\r\nDATA\r\n--XB--\r\n")
                .as_bytes(),
        );
        b
    }

    #[test]
    fn the_filename_replaces_its_placeholder_in_the_key_and_nothing_else_changes() {
        let f = form(&[("key", "up/${filename}"), ("policy", "${filename}")], "a.txt");
        let Head::Rewritten { consumed, bytes } = rewrite_filename(&f, "XB") else { panic!("not rewritten") };
        let mut out = bytes.clone();
        out.extend_from_slice(&f[consumed..]);
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&f).replacen("up/${filename}", "up/a.txt", 1)
        );
        assert!(String::from_utf8_lossy(&bytes).ends_with("Content-Type: text/plain\r\n\r\n"));
        // A browser's path is cut to the name.
        let f = form(&[("key", "${filename}")], "C:\\Users\\me\\b.bin");
        let Head::Rewritten { bytes, .. } = rewrite_filename(&f, "XB") else { panic!("not rewritten") };
        assert!(String::from_utf8_lossy(&bytes).contains("\r\n\r\nb.bin\r\n"));
    }

    #[test]
    fn forms_without_the_placeholder_or_a_file_are_left_alone_and_short_heads_ask_for_more() {
        assert_eq!(rewrite_filename(&form(&[("key", "plain")], "a"), "XB"), Head::Unchanged);
        assert_eq!(
            rewrite_filename(b"--XB\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nk\r\n--XB--\r\n", "XB"),
            Head::Unchanged
        );
        let f = form(&[("key", "${filename}")], "a");
        for cut in [0, 3, 10, 50, f.len() - 30] {
            assert_eq!(rewrite_filename(&f[..cut], "XB"), Head::NeedMore, "cut at {cut}");
        }
        assert_eq!(rewrite_filename(b"no form here at all", "XB"), Head::Unchanged);
    }

    #[test]
    fn the_boundary_is_read_from_a_form_post_only() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("multipart/form-data; boundary=\"ab c\""));
        assert_eq!(form_boundary(&http::Method::POST, &h).as_deref(), Some("ab c"));
        assert_eq!(form_boundary(&http::Method::PUT, &h), None);
        h.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/xml"));
        assert_eq!(form_boundary(&http::Method::POST, &h), None);
    }

    #[test]
    fn policy_condition_failures_become_access_denied_and_other_errors_stay() {
        let reply = |status: u16, code: &str, msg: &str| {
            let xml = format!("<?xml version=\"1.0\"?><Error><Code>{code}</Code><Message>{msg}</Message></Error>");
            let mut r = http::Response::new(s3s::Body::from(xml));
            *r.status_mut() = http::StatusCode::from_u16(status).expect("status");
            r
        };
        let r = policy_violation_is_access_denied(reply(400, "InvalidPolicyDocument", "Policy condition 'eq' failed"));
        assert_eq!(r.status(), 403);
        let text = String::from_utf8_lossy(&r.body().bytes().expect("bytes")).into_owned();
        assert!(text.contains("<Code>AccessDenied</Code>") && text.contains("Invalid according to Policy"), "{text}");
        let r = policy_violation_is_access_denied(reply(400, "InvalidPolicyDocument", "failed to parse POST policy"));
        assert_eq!(r.status(), 400);
        let r = policy_violation_is_access_denied(reply(400, "EntityTooLarge", "Policy condition"));
        assert_eq!(r.status(), 400);
    }
}
