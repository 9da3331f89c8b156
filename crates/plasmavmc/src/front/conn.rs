//! One local client of the front: the greeting and the options (driven
//! through coronafs's sans-IO [`Negotiator`]), then the transmission phase
//! with compact request headers and simple or structured replies.
//!
//! Each request runs in a task of its own, so a client's requests are in
//! flight at once (as they are on the upstream connection) and answered as
//! they complete; a writer task sends the replies. A semaphore counted in
//! bytes bounds the data one client may hold in flight.

use super::Front;
use super::journal::Op;
use bytes::Bytes;
use coronafs::proto::handshake::{self, ExportCatalog, ExportDesc, Negotiator, Step};
use coronafs::proto::reply::{self, ReplyMode};
use coronafs::proto::request::{Command, REQUEST_LEN, Request};
use coronafs::proto::{NbdErrno, cmd_flags};
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// Time a client has to finish negotiation.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes of request data one client may have in flight (being served, or
/// answered with the reply not yet written to it).
const INFLIGHT_BYTES: u32 = 64 << 20;
/// Cost charged to requests without data (bounds their count).
const MIN_COST: u32 = 64 << 10;

/// The one export: the volume, under its name or as the default export ("").
struct Catalog<'a>(&'a ExportDesc);

impl ExportCatalog for Catalog<'_> {
    fn lookup(&self, name: &str) -> Result<ExportDesc, String> {
        if name.is_empty() || name == self.0.name {
            Ok(ExportDesc { name: name.to_owned(), ..self.0.clone() })
        } else {
            Err(format!("this front serves only {:?} (or the default export \"\")", self.0.name))
        }
    }

    fn names(&self) -> Vec<String> {
        vec![self.0.name.clone()]
    }
}

/// Serves one accepted client until it leaves or breaks the protocol.
pub async fn serve<R, W>(rd: R, wr: W, front: Arc<Front>, peer: String)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    front.clients.fetch_add(1, Ordering::Relaxed);
    let mut rd = BufReader::with_capacity(16 << 10, rd);
    let mut wr = wr;
    let r = match tokio::time::timeout(HANDSHAKE_TIMEOUT, negotiate(&mut rd, &mut wr, &front)).await {
        Ok(Ok(Some((mode, tx_flags)))) => transmit(rd, wr, &front, mode, tx_flags).await,
        Ok(Ok(None)) => Ok(()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "negotiation timed out")),
    };
    match r {
        // A client that hung up, in negotiation or mid-request, broke nothing.
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            tracing::debug!(%peer, "local NBD client hung up");
        }
        Err(e) => {
            front.protocol_errors.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, error = %e, "local NBD client dropped");
        }
        Ok(()) => {}
    }
    front.clients.fetch_sub(1, Ordering::Relaxed);
}

/// The greeting and the options. `None`: the client left or was refused.
async fn negotiate<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    rd: &mut BufReader<R>,
    wr: &mut W,
    front: &Front,
) -> io::Result<Option<(ReplyMode, u16)>> {
    let mut out = Vec::with_capacity(256);
    handshake::encode_greeting(&mut out);
    wr.write_all(&out).await?;
    let mut flags = [0u8; 4];
    rd.read_exact(&mut flags).await?;
    let flags = handshake::decode_client_flags(&flags).map_err(io::Error::other)?;
    let mut neg = Negotiator::new(flags).offering(front.offer);
    match coronafs::server::conn::run_options(rd, wr, &mut neg, &Catalog(&front.desc)).await? {
        Step::Continue => unreachable!("run_options returns on the first other step"),
        Step::Close => Ok(None),
        // The negotiator runs with TLS off: it never asks for it.
        Step::StartTls => Err(io::Error::other("STARTTLS acknowledged without TLS")),
        Step::Transmit(desc) => {
            let tx_flags = neg.tx_flags(&desc);
            Ok(Some((neg.finish(desc).mode, tx_flags)))
        }
    }
}

/// A reply's bytes: a simple reply, or structured chunks.
fn error_reply(cookie: u64, mode: ReplyMode, errno: NbdErrno, msg: &str) -> Vec<u8> {
    match mode {
        ReplyMode::Simple => reply::simple(cookie, errno as u32).as_bytes().to_vec(),
        _ => {
            let mut out = Vec::new();
            reply::error_chunk(cookie, errno, msg, &mut out);
            out
        }
    }
}

/// The transmission phase.
async fn transmit<R, W>(
    mut rd: BufReader<R>,
    mut wr: W,
    front: &Arc<Front>,
    mode: ReplyMode,
    tx_flags: u16,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // Extended headers are never offered, so requests are compact.
    debug_assert!(mode != ReplyMode::Extended);
    // A reply keeps its request's share of the budget until it is written,
    // so a client that sends requests and never reads the replies stops
    // being read once the budget is queued up (memory stays bounded).
    let (tx, mut replies) = mpsc::unbounded_channel::<(Vec<u8>, OwnedSemaphorePermit)>();
    let writer = tokio::spawn(async move {
        while let Some((r, permit)) = replies.recv().await {
            wr.write_all(&r).await?;
            drop(permit);
        }
        wr.shutdown().await
    });
    let budget = Arc::new(Semaphore::new(INFLIGHT_BYTES as usize));
    let desc = &front.desc;
    let result = loop {
        let mut hdr = [0u8; REQUEST_LEN];
        match rd.read_exact(&mut hdr).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e),
        }
        let req = match Request::decode(&hdr) {
            Ok(r) => r,
            // A wrong magic: the stream cannot be framed any more.
            Err(e) => break Err(io::Error::new(io::ErrorKind::InvalidData, e)),
        };
        if req.command == Command::Disc {
            break Ok(());
        }
        let check =
            req.validate(desc.size, desc.read_only, desc.max_block).and_then(|()| req.check_offered(tx_flags, false));
        let payload_len = req.payload_len(false);
        let payload = if payload_len == 0 {
            Bytes::new()
        } else if check.is_err() {
            // Refused: its payload is read and dropped to stay in step.
            let n = tokio::io::copy(&mut (&mut rd).take(payload_len), &mut tokio::io::sink()).await?;
            if n < payload_len {
                break Err(io::ErrorKind::UnexpectedEof.into());
            }
            Bytes::new()
        } else {
            let mut b = vec![0u8; payload_len as usize];
            rd.read_exact(&mut b).await?;
            Bytes::from(b)
        };
        if let Err(errno) = check {
            let permit = match budget.clone().acquire_many_owned(MIN_COST).await {
                Ok(p) => p,
                Err(_) => break Err(io::Error::other("request budget closed")),
            };
            front.requests.fetch_add(1, Ordering::Relaxed);
            front.errors.fetch_add(1, Ordering::Relaxed);
            let msg = format!("{} refused by plasmavmc nbd-front", req.command.name());
            let _ = tx.send((error_reply(req.cookie, mode, errno, &msg), permit));
            continue;
        }
        let cost = (req.length.min(INFLIGHT_BYTES as u64) as u32).max(MIN_COST);
        let permit = match budget.clone().acquire_many_owned(cost).await {
            Ok(p) => p,
            Err(_) => break Err(io::Error::other("request budget closed")),
        };
        let (front, tx) = (front.clone(), tx.clone());
        tokio::spawn(async move {
            let reply = handle(&front, req, payload, mode).await;
            front.requests.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send((reply, permit));
        });
    };
    drop(tx);
    // The writer ends once every request task sent its reply.
    let written = writer.await.map_err(io::Error::other)?;
    result.and(written)
}

/// Runs one valid request against the volume; the reply's bytes.
async fn handle(front: &Front, req: Request, payload: Bytes, mode: ReplyMode) -> Vec<u8> {
    let fua = req.flags & cmd_flags::FUA != 0;
    let (offset, len) = (req.offset, req.length as u32);
    let done = |r: Result<(), (NbdErrno, String)>| match r {
        Ok(()) => reply::done_head(req.cookie, mode, offset).as_bytes().to_vec(),
        Err((errno, msg)) => {
            front.errors.fetch_add(1, Ordering::Relaxed);
            error_reply(req.cookie, mode, errno, &msg)
        }
    };
    if req.is_no_op() {
        return match req.command {
            Command::Read => reply::read_head(req.cookie, mode, offset, 0).as_bytes().to_vec(),
            _ => done(Ok(())),
        };
    }
    match req.command {
        Command::Read => match front.read(offset, len).await {
            Ok(data) => {
                let head = reply::read_head(req.cookie, mode, offset, data.len() as u32);
                let mut out = Vec::with_capacity(head.as_bytes().len() + data.len());
                out.extend_from_slice(head.as_bytes());
                out.extend_from_slice(&data);
                out
            }
            Err((errno, msg)) => done(Err((errno, msg))),
        },
        Command::Write => done(front.change(Op::Write { offset, data: payload }, fua).await),
        Command::WriteZeroes => {
            let flags = req.flags & (cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO);
            done(front.change(Op::Zeroes { offset, len, flags }, fua).await)
        }
        Command::Trim => done(front.change(Op::Trim { offset, len, flags: 0 }, fua).await),
        Command::Flush => done(front.flush().await),
        // Refused by `check_offered` before a task is started.
        Command::Cache | Command::BlockStatus | Command::Disc | Command::Unknown(_) => {
            done(Err((NbdErrno::Inval, format!("{} is not forwarded", req.command.name()))))
        }
    }
}
