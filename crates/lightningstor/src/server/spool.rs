//! Request bodies sent without any length (HTTP/1.1 `Transfer-Encoding:
//! chunked`, no `Content-Length`, no aws-chunked framing).
//!
//! s3s 0.14.1 needs a body's length before it runs an operation: a signed
//! `x-amz-content-sha256` is checked against a declared length, and an
//! `UNSIGNED-PAYLOAD` request without one is refused with 411
//! MissingContentLength. S3-compatible servers take such a PUT (the
//! compatibility suite's `test_object_write_with_chunked_transfer_encoding`),
//! so the front end first writes the body to an unnamed temporary file
//! (`O_TMPFILE` under the system temporary directory, gone when closed) and
//! hands s3s that file with its `Content-Length`. Only such bodies take this
//! path; at most [`MAX_SPOOLING`] are written at once, each at most
//! [`MAX_PUT_SIZE`] (beyond: EntityTooLarge), and the body-idle timeout
//! applies while it is read. Before any of it, the request must name a key
//! the server knows, unless it is anonymous (`Gate::may_spool`).

use super::limits::{IdleBody, MAX_PUT_SIZE};
use crate::error::{LightningError, Result};
use bytes::Bytes;
use hyper::body::{Body as _, Frame, SizeHint};
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncSeekExt as _, AsyncWriteExt as _, ReadBuf};

/// How many length-less bodies may be written to temporary files at once.
pub const MAX_SPOOLING: usize = 4;

static SPOOLING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_SPOOLING);

/// Whether a request's body has no length the S3 layer can use: it has
/// one (it is not already at its end), and neither `Content-Length` nor
/// `x-amz-decoded-content-length` (aws-chunked) declares its size.
pub fn lacks_length(headers: &http::HeaderMap, body_hint: &SizeHint, body_ended: bool) -> bool {
    !body_ended
        && body_hint.exact().is_none()
        && !headers.contains_key(http::header::CONTENT_LENGTH)
        && !headers.contains_key("x-amz-decoded-content-length")
}

/// A spooled body: the temporary file, read from its start, and its length.
pub struct Spooled {
    file: tokio::fs::File,
    remaining: u64,
    buf: Box<[u8]>,
}

impl Spooled {
    /// The body's length in bytes.
    pub fn len(&self) -> u64 {
        self.remaining
    }
}

/// An unnamed file under the system temporary directory (a file system
/// without `O_TMPFILE` gets a named one, removed as soon as it is open).
fn temp_file() -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir();
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true).mode(0o600);
    if let Ok(f) = o.clone().custom_flags(libc::O_TMPFILE).open(&dir) {
        return Ok(f);
    }
    let name = format!("lightningstor-body-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    let path = dir.join(name);
    let f = o.create_new(true).open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(f)
}

/// Reads `body` to its end into a temporary file: EntityTooLarge past
/// [`MAX_PUT_SIZE`], Body when the client's body fails (stalls, is cut off).
pub async fn spool(mut body: IdleBody) -> Result<Spooled> {
    let _permit = SPOOLING.acquire().await.map_err(|e| LightningError::Io(std::io::Error::other(e)))?;
    let mut file = tokio::fs::File::from_std(temp_file()?);
    let mut len = 0u64;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(LightningError::body)?;
        let Ok(data) = frame.into_data() else { continue };
        len += data.len() as u64;
        if len > MAX_PUT_SIZE {
            return Err(LightningError::EntityTooLarge { size: len });
        }
        file.write_all(&data).await?;
    }
    file.flush().await?;
    file.rewind().await?;
    Ok(Spooled { file, remaining: len, buf: vec![0u8; 256 * 1024].into_boxed_slice() })
}

impl hyper::body::Body for Spooled {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        let want = usize::try_from(this.remaining).unwrap_or(usize::MAX).min(this.buf.len());
        let mut rb = ReadBuf::new(&mut this.buf[..want]);
        match Pin::new(&mut this.file).poll_read(cx, &mut rb) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Ready(Ok(())) if rb.filled().is_empty() => Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the spooled body's file is shorter than what was written",
            )))),
            Poll::Ready(Ok(())) => {
                let n = rb.filled().len();
                this.remaining -= n as u64;
                Poll::Ready(Some(Ok(Frame::data(Bytes::copy_from_slice(&this.buf[..n])))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_body_without_any_declared_length_is_spooled() {
        let unknown = SizeHint::new();
        let mut h = http::HeaderMap::new();
        assert!(lacks_length(&h, &unknown, false));
        assert!(!lacks_length(&h, &unknown, true), "no body at all");
        assert!(!lacks_length(&h, &SizeHint::with_exact(5), false));
        h.insert("x-amz-decoded-content-length", http::HeaderValue::from_static("5"));
        assert!(!lacks_length(&h, &unknown, false), "aws-chunked declares its length");
        let mut h = http::HeaderMap::new();
        h.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from_static("5"));
        assert!(!lacks_length(&h, &unknown, false));
    }

    #[test]
    fn an_unnamed_temporary_file_can_be_made() {
        assert!(temp_file().is_ok(), "O_TMPFILE under {:?}", std::env::temp_dir());
    }
}
