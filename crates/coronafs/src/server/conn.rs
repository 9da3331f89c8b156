//! One NBD connection: negotiation (with STARTTLS), then the pipelined
//! transmission phase over the plain socket or the TLS stream.
//!
//! The reader loop decodes request headers, reads write payloads straight
//! into pooled buffers and spawns one task per request, so requests complete
//! and are answered out of order. Replies go through a channel to a writer
//! task that gathers whatever is ready into one vectored write. A semaphore
//! counted in bytes caps the data a connection may hold in flight, so a slow
//! reader of replies only slows itself down.
//!
//! The stream is a type parameter: the plain path is compiled for the TCP
//! halves (and keeps `sendfile`), the TLS path for the halves of a rustls
//! stream (READ data is copied into the TLS records instead).

use super::bufpool::{BufPool, PooledBuf};
use super::shared::Shared;
use crate::backend::{BlockBackend, SpliceSource};
use crate::proto::handshake::{self, Negotiated, Negotiator, Step};
use crate::proto::reply::{self, Extent, ExtentExt, Head, ReplyMode};
use crate::proto::request::{Command, EXT_REQUEST_LEN, REQUEST_LEN, Request};
use crate::proto::{BASE_ALLOCATION_ID, MAX_OPTION_LEN, NbdErrno, cmd_flags, rep};
use crate::volume::export::{Export, MAX_BLOCK};
use crate::volume::fence::Writer;
use std::io::{self, IoSlice};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_rustls::server::TlsStream;

/// Time a client has to finish negotiation (the TLS handshake included).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bytes of request data one connection may have in flight.
pub const INFLIGHT_BYTES: u32 = 64 << 20;
/// Cost charged to requests without a data payload (bounds their count).
const MIN_COST: u32 = 64 << 10;
/// Most extents returned by one BLOCK_STATUS.
const MAX_EXTENTS: usize = 1024;
/// Receive buffer for request headers.
const READ_BUFFER: usize = 16 << 10;
/// Replies gathered into one vectored write.
const BATCH: usize = 64;
/// Smallest READ sent with `sendfile` from the page cache. Below this the
/// copy is cheaper than the extra `cachestat` and `sendfile` syscalls.
const SPLICE_MIN: u32 = 64 << 10;

/// The connection after negotiation: the plain socket's halves, or the TLS
/// stream's.
enum Link {
    Plain(BufReader<OwnedReadHalf>, OwnedWriteHalf),
    Tls(BufReader<ReadHalf<TlsStream<TcpStream>>>, WriteHalf<TlsStream<TcpStream>>),
}

/// Serves one accepted connection until the client leaves or breaks the protocol.
pub async fn serve(stream: TcpStream, shared: Arc<Shared>) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let (negotiated, link) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, &shared)).await {
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => return,
        Ok(Err(e)) => {
            shared.metrics.handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(?peer, error = %e, "negotiation ended");
            return;
        }
        Err(_) => {
            shared.metrics.handshake_failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(?peer, "negotiation timed out");
            return;
        }
    };
    let (volume, declared) = match shared.volumes.open_export(&negotiated.export.name) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(?peer, error = %e, "export vanished after negotiation");
            return;
        }
    };
    volume.connections.fetch_add(1, Ordering::Relaxed);
    shared.metrics.connections.fetch_add(1, Ordering::Relaxed);
    if negotiated.mode == ReplyMode::Extended {
        shared.metrics.extended_sessions.fetch_add(1, Ordering::Relaxed);
    }
    tracing::debug!(?peer, export = %volume.name, mode = ?negotiated.mode, tls = negotiated.tls, "transmission");
    let writer = volume.fence.register(declared.unwrap_or(0));
    let result = match link {
        Link::Plain(rd, wr) => transmit(rd, wr, &shared, &volume, writer, &negotiated).await,
        Link::Tls(rd, wr) => transmit(rd, wr, &shared, &volume, writer, &negotiated).await,
    };
    if let Err(e) = result {
        shared.metrics.protocol_errors.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(?peer, error = %e, "connection dropped");
    }
    volume.connections.fetch_sub(1, Ordering::Relaxed);
    shared.metrics.connections.fetch_sub(1, Ordering::Relaxed);
}

/// The greeting, the options in the clear and, after STARTTLS, the TLS
/// handshake and the options inside TLS. `None`: the client left or was
/// refused.
async fn handshake(stream: TcpStream, shared: &Shared) -> io::Result<Option<(Negotiated, Link)>> {
    let (rd, mut wr) = stream.into_split();
    // Small on purpose: it batches request headers, while write payloads are
    // read past it straight into pooled buffers (a big buffer would copy part
    // of every payload twice).
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    let mut out = Vec::with_capacity(256);
    handshake::encode_greeting(&mut out);
    wr.write_all(&out).await?;
    let mut flags = [0u8; 4];
    rd.read_exact(&mut flags).await?;
    let flags = handshake::decode_client_flags(&flags).map_err(io::Error::other)?;
    let mut neg = Negotiator::with_tls(flags, shared.tls_mode);
    match negotiate(&mut rd, &mut wr, &mut neg, shared).await? {
        Outcome::Close => return Ok(None),
        Outcome::Transmit(n) => return Ok(Some((n, Link::Plain(rd, wr)))),
        Outcome::StartTls => {}
    }
    // The negotiator only agrees to STARTTLS when TLS is on.
    let acceptor = shared.tls.as_ref().ok_or_else(|| io::Error::other("STARTTLS without TLS credentials"))?;
    // The client may send nothing between STARTTLS and our reply: bytes
    // already buffered would be TLS records read in the clear.
    if !rd.buffer().is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "client sent data before the STARTTLS reply"));
    }
    let stream = rd.into_inner().reunite(wr).map_err(io::Error::other)?;
    let tls = acceptor.accept(stream).await?;
    shared.metrics.tls_sessions.fetch_add(1, Ordering::Relaxed);
    let (rd, mut wr) = tokio::io::split(tls);
    let mut rd = BufReader::with_capacity(READ_BUFFER, rd);
    match negotiate(&mut rd, &mut wr, &mut neg, shared).await? {
        Outcome::Transmit(n) => Ok(Some((n, Link::Tls(rd, wr)))),
        Outcome::Close => {
            // A clean close_notify, as the spec asks of whoever ends TLS.
            let _ = wr.shutdown().await;
            Ok(None)
        }
        Outcome::StartTls => Err(io::Error::other("a second STARTTLS was acknowledged")),
    }
}

/// How a run of options ended.
enum Outcome {
    Transmit(Negotiated),
    StartTls,
    Close,
}

/// Drives the sans-IO [`Negotiator`] over a stream until it asks for
/// something other than the next option.
async fn negotiate<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    rd: &mut BufReader<R>,
    wr: &mut W,
    neg: &mut Negotiator,
    shared: &Shared,
) -> io::Result<Outcome> {
    Ok(match run_options(rd, wr, neg, &*shared.volumes).await? {
        Step::Continue => unreachable!("run_options returns on the first other step"),
        Step::Close => Outcome::Close,
        Step::StartTls => Outcome::StartTls,
        Step::Transmit(desc) => Outcome::Transmit(neg.finish(desc)),
    })
}

/// Reads options and answers them through `neg` (every answer written and
/// flushed) until it returns a step other than [`Step::Continue`], which is
/// given back. An option announcing more than [`MAX_OPTION_LEN`] bytes is
/// skipped and refused. Shared by the server and by other NBD servers built
/// on [`Negotiator`] (PlasmaVMC's front).
pub async fn run_options<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    rd: &mut R,
    wr: &mut W,
    neg: &mut Negotiator,
    catalog: &(dyn handshake::ExportCatalog + Sync),
) -> io::Result<Step> {
    let mut out = Vec::with_capacity(256);
    let mut data = Vec::new();
    loop {
        let mut hdr = [0u8; handshake::OPTION_HEADER_LEN];
        rd.read_exact(&mut hdr).await?;
        let (code, len) = handshake::decode_option_header(&hdr).map_err(io::Error::other)?;
        out.clear();
        if len > MAX_OPTION_LEN {
            let skipped = tokio::io::copy(&mut (&mut *rd).take(len as u64), &mut tokio::io::sink()).await?;
            if skipped < len as u64 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            handshake::error_reply(code, rep::ERR_TOO_BIG, "option payload too large", &mut out);
            wr.write_all(&out).await?;
            wr.flush().await?;
            continue;
        }
        data.resize(len as usize, 0);
        rd.read_exact(&mut data).await?;
        let step = neg.handle(code, &data, catalog, &mut out);
        wr.write_all(&out).await?;
        // A TLS stream keeps what it could not send yet: push it out.
        wr.flush().await?;
        if !matches!(step, Step::Continue) {
            return Ok(step);
        }
    }
}

/// Where the writer task sends replies: the TCP socket, which can
/// `sendfile` from the page cache, or a TLS stream, which cannot.
trait ReplySink: AsyncWrite + Unpin + Send + 'static {
    /// Whether READs may be answered with [`ReplySink::send_file`].
    const SENDFILE: bool;
    /// Sends `len` bytes of `src` after what was written so far.
    fn send_file(&mut self, src: &SpliceSource, len: usize) -> impl Future<Output = io::Result<()>> + Send;
}

impl ReplySink for OwnedWriteHalf {
    const SENDFILE: bool = true;
    fn send_file(&mut self, src: &SpliceSource, len: usize) -> impl Future<Output = io::Result<()>> + Send {
        send_file(self, src, len)
    }
}

impl ReplySink for WriteHalf<TlsStream<TcpStream>> {
    /// The bytes must pass through rustls to be encrypted.
    const SENDFILE: bool = false;
    /// Not reached (no `file` reply is made without `SENDFILE`); copies the
    /// range, which is in the page cache, so a stray one is still correct.
    async fn send_file(&mut self, src: &SpliceSource, len: usize) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut data = vec![0u8; len];
        src.file.read_exact_at(&mut data, src.offset)?;
        self.write_all(&data).await
    }
}

/// A reply ready to be written.
struct Reply {
    head: Head,
    /// Pooled READ data following `head`.
    data: Option<PooledBuf>,
    /// READ data to `sendfile` from the page cache after `head` (instead of `data`).
    file: Option<(SpliceSource, usize)>,
    /// A complete extra message (error or block-status chunk).
    tail: Vec<u8>,
    _permit: Option<OwnedSemaphorePermit>,
}

/// Per-connection state shared by the request tasks.
struct Ctx {
    shared: Arc<Shared>,
    volume: Arc<Export>,
    /// Simple, structured or extended replies (and compact or extended requests).
    mode: ReplyMode,
    /// Cached READs may become `sendfile` replies (a plain socket).
    sendfile: bool,
    base_allocation: bool,
    max_block: u32,
    /// As negotiated: a volume, or a fenced volume opened without an epoch.
    read_only: bool,
    /// This connection's epoch and its mutating requests in flight.
    writer: Arc<Writer>,
    tx: mpsc::UnboundedSender<Reply>,
}

async fn transmit<R: AsyncRead + Unpin + Send, W: ReplySink>(
    mut rd: BufReader<R>,
    wr: W,
    shared: &Arc<Shared>,
    volume: &Arc<Export>,
    fence_writer: Arc<Writer>,
    n: &Negotiated,
) -> io::Result<()> {
    let (tx, rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_replies(wr, rx, shared.clone()));
    let ctx = Arc::new(Ctx {
        shared: shared.clone(),
        volume: volume.clone(),
        mode: n.mode,
        sendfile: W::SENDFILE,
        base_allocation: n.base_allocation,
        max_block: n.export.max_block,
        read_only: n.export.read_only,
        writer: fence_writer,
        tx,
    });
    let budget = Arc::new(Semaphore::new(INFLIGHT_BYTES as usize));
    let result = read_requests(&mut rd, &ctx, &budget).await;
    // Let requests in flight finish and their replies go out, then close.
    drop(ctx);
    let _ = writer.await;
    result
}

/// Reads the next request header, compact or extended as negotiated;
/// `None` when the client went away between requests (not an error).
async fn read_header<R: AsyncRead + Unpin>(rd: &mut BufReader<R>, extended: bool) -> io::Result<Option<Request>> {
    let read = if extended {
        let mut hdr = [0u8; EXT_REQUEST_LEN];
        rd.read_exact(&mut hdr).await.map(|_| Request::decode_ext(&hdr))
    } else {
        let mut hdr = [0u8; REQUEST_LEN];
        rd.read_exact(&mut hdr).await.map(|_| Request::decode(&hdr))
    };
    match read {
        Ok(req) => req.map(Some).map_err(io::Error::other),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e),
    }
}

async fn read_requests<R: AsyncRead + Unpin>(
    rd: &mut BufReader<R>,
    ctx: &Arc<Ctx>,
    budget: &Arc<Semaphore>,
) -> io::Result<()> {
    let size = ctx.volume.backend.size();
    let extended = ctx.mode == ReplyMode::Extended;
    loop {
        let Some(req) = read_header(rd, extended).await? else { return Ok(()) };
        if req.command == Command::Disc {
            return Ok(());
        }
        let started = Instant::now();
        let cost = match admit(ctx, &req, size, started) {
            Ok(cost) => cost,
            Err(refusal) => {
                // Keep the stream in step: a refused WRITE's payload is still on the wire.
                let skip = req.payload_len(extended);
                if skip > u32::MAX as u64 {
                    // Only an extended header can announce this much; the
                    // spec lets the server hang up rather than read it all.
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "payload over 4 GiB announced"));
                }
                if skip > 0 {
                    let n = tokio::io::copy(&mut (&mut *rd).take(skip), &mut tokio::io::sink()).await?;
                    if n < skip {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                }
                // A refusal's reply holds budget too until it is written, so
                // a client that sends bad requests and reads no replies stops
                // being read instead of queueing replies without end.
                let mut refusal = refusal;
                refusal._permit = Some(budget.clone().acquire_many_owned(MIN_COST).await.map_err(io::Error::other)?);
                ctx.send(refusal);
                continue;
            }
        };
        let permit = budget.clone().acquire_many_owned(cost).await.map_err(io::Error::other)?;
        let payload = if req.command == Command::Write {
            let mut buf = ctx.shared.pool.get(req.length as usize);
            if let Err(e) = rd.read_exact(&mut buf).await {
                ctx.shared.pool.put(buf);
                return Err(e);
            }
            Some(buf)
        } else {
            None
        };
        let (payload, permit) = match answer_now(ctx, &req, payload, permit, started) {
            Ok(reply) => {
                ctx.send(reply);
                continue;
            }
            Err(back) => back,
        };
        ctx.shared.metrics.inflight.fetch_add(1, Ordering::Relaxed);
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let reply = execute(&ctx, req, payload, permit, started).await;
            ctx.shared.metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            ctx.send(reply);
        });
    }
}

impl Ctx {
    fn send(&self, r: Reply) {
        if let Err(mpsc::error::SendError(r)) = self.tx.send(r) {
            // The writer is gone (client vanished): recycle the buffer and drop the reply.
            if let Some(d) = r.data {
                self.shared.pool.put(d);
            }
        }
    }
}

/// The checks every decoded request passes before it may touch the backend
/// (range, flags, permissions, negotiated contexts): its cost against the
/// connection's in-flight budget, or the error reply that refuses it (and is
/// counted as a failed request).
#[allow(clippy::result_large_err)]
fn admit(ctx: &Ctx, req: &Request, size: u64, started: Instant) -> Result<u32, Reply> {
    let refusal = if let Err(errno) = req.validate(size, ctx.read_only, ctx.max_block) {
        let msg = format!("{} of {} bytes at offset {} refused", req.command.name(), req.length, req.offset);
        error_reply(ctx, req, errno, &msg, None)
    } else if req.command == Command::BlockStatus && !ctx.base_allocation {
        let msg = "BLOCK_STATUS needs the base:allocation context to be negotiated";
        error_reply(ctx, req, NbdErrno::Inval, msg, None)
    } else {
        return Ok(match req.command {
            // At most `max_block` (a u32) once validated.
            Command::Read | Command::Write => (req.length as u32).max(MIN_COST),
            _ => MIN_COST,
        });
    };
    ctx.shared.metrics.record(req.command, 0, false, started.elapsed());
    Err(refusal)
}

/// The header that precedes READ data (at most `max_block` of it).
fn read_head(ctx: &Ctx, req: &Request) -> Head {
    reply::read_head(req.cookie, ctx.mode, req.offset, req.length as u32)
}

/// Answers, right in the reader, a READ or plain WRITE that the page cache
/// can serve at once: no task spawn and no hand-off to another thread, and a
/// write payload is copied into the file while still hot in this core's cache.
/// Large cached READs become `sendfile` replies. Anything that would wait is
/// handed back (with its payload and budget) for a request task.
#[allow(clippy::result_large_err)]
fn answer_now(
    ctx: &Ctx,
    req: &Request,
    payload: Option<PooledBuf>,
    permit: OwnedSemaphorePermit,
    started: Instant,
) -> Result<Reply, (Option<PooledBuf>, OwnedSemaphorePermit)> {
    let b = &ctx.volume.backend;
    let len = req.length as usize;
    let reply = match (req.command, payload) {
        (Command::Read, None) if ctx.sendfile && req.length >= SPLICE_MIN as u64 => {
            match b.splice_source(req.offset, len as u64) {
                Some(src) => {
                    ctx.shared.metrics.sendfile_reads.fetch_add(1, Ordering::Relaxed);
                    Reply {
                        head: read_head(ctx, req),
                        data: None,
                        file: Some((src, len)),
                        tail: Vec::new(),
                        _permit: Some(permit),
                    }
                }
                None => return Err((None, permit)),
            }
        }
        (Command::Read, None) => {
            let mut buf = ctx.shared.pool.get(len);
            if !b.try_read_now(&mut buf, req.offset) {
                ctx.shared.pool.put(buf);
                return Err((None, permit));
            }
            Reply { head: read_head(ctx, req), data: Some(buf), file: None, tail: Vec::new(), _permit: Some(permit) }
        }
        (Command::Write, Some(buf)) if !req.fua() => {
            // A fenced connection's write goes to `execute`, which refuses it.
            let Ok(_in_flight) = ctx.volume.fence.enter(&ctx.writer) else {
                return Err((Some(buf), permit));
            };
            if !b.try_write_now(&buf, req.offset) {
                return Err((Some(buf), permit));
            }
            ctx.shared.pool.put(buf);
            ok_reply(ctx, req, Some(permit))
        }
        (_, payload) => return Err((payload, permit)),
    };
    ctx.shared.metrics.record(req.command, len as u64, true, started.elapsed());
    Ok(reply)
}

fn ok_reply(ctx: &Ctx, req: &Request, permit: Option<OwnedSemaphorePermit>) -> Reply {
    let head = reply::done_head(req.cookie, ctx.mode, req.offset);
    Reply { head, data: None, file: None, tail: Vec::new(), _permit: permit }
}

fn error_reply(ctx: &Ctx, req: &Request, errno: NbdErrno, msg: &str, permit: Option<OwnedSemaphorePermit>) -> Reply {
    if ctx.mode == ReplyMode::Simple {
        let head = reply::simple(req.cookie, errno as u32);
        return Reply { head, data: None, file: None, tail: Vec::new(), _permit: permit };
    }
    let mut tail = Vec::with_capacity(48 + msg.len());
    if ctx.mode == ReplyMode::Extended {
        reply::ext_error_chunk(req.cookie, req.offset, errno, msg, &mut tail);
    } else {
        reply::error_chunk(req.cookie, errno, msg, &mut tail);
    }
    // The whole chunk is in `tail`; an empty head keeps the writer simple.
    Reply { head: reply::empty(), data: None, file: None, tail, _permit: permit }
}

async fn execute(
    ctx: &Ctx,
    req: Request,
    payload: Option<PooledBuf>,
    permit: OwnedSemaphorePermit,
    started: Instant,
) -> Reply {
    let b = &ctx.volume.backend;
    let (off, len) = (req.offset, req.length);
    let permit = Some(permit);
    // Held until the backend is done, so a fence waits for this request.
    let _in_flight = if matches!(req.command, Command::Write | Command::Trim | Command::WriteZeroes) {
        match ctx.volume.fence.enter(&ctx.writer) {
            Ok(g) => Some(g),
            Err(current) => {
                if let Some(buf) = payload {
                    ctx.shared.pool.put(buf);
                }
                ctx.shared.metrics.fenced_requests.fetch_add(1, Ordering::Relaxed);
                ctx.shared.metrics.record(req.command, 0, false, started.elapsed());
                let msg = format!(
                    "{} refused: this connection holds epoch {}, volume {} is fenced at epoch {current}",
                    req.command.name(),
                    ctx.writer.epoch,
                    ctx.volume.name
                );
                return error_reply(ctx, &req, NbdErrno::Perm, &msg, None);
            }
        }
    } else {
        None
    };
    if req.is_no_op() {
        // Zero bytes: nothing to ask the backend (fallocate and friends
        // refuse an empty range), and a READ answers with no data.
        ctx.shared.metrics.record(req.command, 0, true, started.elapsed());
        if req.command == Command::Read {
            return Reply { head: read_head(ctx, &req), data: None, file: None, tail: Vec::new(), _permit: permit };
        }
        return ok_reply(ctx, &req, permit);
    }
    let result: io::Result<Reply> = match req.command {
        Command::Read => {
            let (r, buf) = b.read_at(ctx.shared.pool.get(req.length as usize).into_vec(), off).await;
            let buf = PooledBuf::from_vec(buf);
            match r {
                Ok(()) => Ok(Reply {
                    head: read_head(ctx, &req),
                    data: Some(buf),
                    file: None,
                    tail: Vec::new(),
                    _permit: permit,
                }),
                Err(e) => {
                    ctx.shared.pool.put(buf);
                    Err(e)
                }
            }
        }
        Command::Write => {
            let buf = payload.unwrap_or_else(|| PooledBuf::zeroed(0));
            let (r, buf) = b.write_at(buf.into_vec(), off, req.fua()).await;
            ctx.shared.pool.put(PooledBuf::from_vec(buf));
            r.map(|()| ok_reply(ctx, &req, permit))
        }
        Command::Flush => b.flush().await.map(|()| ok_reply(ctx, &req, permit)),
        Command::Trim => async {
            b.trim(off, len).await?;
            if req.fua() {
                b.flush().await?;
            }
            Ok(())
        }
        .await
        .map(|()| ok_reply(ctx, &req, permit)),
        Command::WriteZeroes => async {
            let punch = req.flags & cmd_flags::NO_HOLE == 0;
            b.write_zeroes(off, len, punch, req.flags & cmd_flags::FAST_ZERO != 0).await?;
            if req.fua() {
                b.flush().await?;
            }
            Ok(())
        }
        .await
        .map(|()| ok_reply(ctx, &req, permit)),
        Command::Cache => b.cache(off, len).await.map(|()| ok_reply(ctx, &req, permit)),
        Command::BlockStatus => {
            let max = if req.flags & cmd_flags::REQ_ONE != 0 { 1 } else { MAX_EXTENTS };
            b.extents(off, len, max).await.and_then(|ext| {
                if ext.is_empty() {
                    return Err(io::Error::other("backend returned no extents"));
                }
                let mut tail = Vec::with_capacity(48 + 16 * ext.len());
                if ctx.mode == ReplyMode::Extended {
                    // 64-bit extents: the range asked for may pass 4 GiB.
                    let ext: Vec<ExtentExt> =
                        ext.iter().map(|e| ExtentExt { length: e.length.min(len), flags: e.flags as u64 }).collect();
                    reply::ext_block_status_chunk(req.cookie, off, BASE_ALLOCATION_ID, &ext, &mut tail);
                } else {
                    // A compact request's length fits in 32 bits, and so does every extent cut to it.
                    let ext: Vec<Extent> =
                        ext.iter().map(|e| Extent { length: e.length.min(len) as u32, flags: e.flags }).collect();
                    reply::block_status_chunk(req.cookie, BASE_ALLOCATION_ID, &ext, &mut tail);
                }
                Ok(Reply { head: reply::empty(), data: None, file: None, tail, _permit: permit })
            })
        }
        Command::Disc | Command::Unknown(_) => Err(io::Error::from_raw_os_error(libc::EINVAL)),
    };
    let bytes = if matches!(req.command, Command::Read | Command::Write) { len } else { 0 };
    ctx.shared.metrics.record(req.command, bytes, result.is_ok(), started.elapsed());
    match result {
        Ok(r) => r,
        Err(e) => {
            let errno = NbdErrno::from_io(&e);
            if errno == NbdErrno::Io {
                tracing::warn!(volume = %ctx.volume.name, op = req.command.name(), error = %e, "I/O error");
            }
            let msg = format!("{} at offset {off}: {e}", req.command.name());
            error_reply(ctx, &req, errno, &msg, None)
        }
    }
}

/// Writes replies as they arrive, several per syscall when they queue up.
async fn write_replies<W: ReplySink>(mut wr: W, mut rx: mpsc::UnboundedReceiver<Reply>, shared: Arc<Shared>) {
    let pool: &BufPool = &shared.pool;
    let mut batch: Vec<Reply> = Vec::with_capacity(BATCH);
    let mut failed = false;
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        if !failed && let Err(e) = write_batch(&mut wr, &batch).await {
            tracing::debug!(error = %e, "client stopped reading replies");
            // Keep draining so request tasks can finish, but stop writing.
            failed = true;
        }
        for r in batch.drain(..) {
            if let Some(d) = r.data {
                pool.put(d);
            }
        }
    }
    let _ = wr.shutdown().await;
}

/// Writes a batch of replies: runs of in-memory parts go out in one vectored
/// write; page-cache data goes out with `sendfile` in between.
async fn write_batch<W: ReplySink>(wr: &mut W, batch: &[Reply]) -> io::Result<()> {
    let mut slices: [IoSlice<'_>; 3 * BATCH] = [IoSlice::new(&[]); 3 * BATCH];
    let mut n = 0;
    for r in batch {
        for part in [r.head.as_bytes(), r.data.as_deref().unwrap_or(&[])] {
            if !part.is_empty() {
                slices[n] = IoSlice::new(part);
                n += 1;
            }
        }
        if let Some((src, len)) = &r.file {
            write_all_vectored(wr, &mut slices[..n]).await?;
            n = 0;
            wr.send_file(src, *len).await?;
        }
        if !r.tail.is_empty() {
            slices[n] = IoSlice::new(&r.tail);
            n += 1;
        }
    }
    write_all_vectored(wr, &mut slices[..n]).await?;
    // A TLS stream may hold the last record back; the socket has nothing to flush.
    wr.flush().await
}

/// Sends `len` bytes of `src` to the socket with `sendfile(2)`: the pages go
/// from the page cache to the socket without a copy through user space.
async fn send_file(wr: &mut OwnedWriteHalf, src: &SpliceSource, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let sock: &TcpStream = wr.as_ref();
    let (sock_fd, file_fd) = (sock.as_raw_fd(), src.file.as_raw_fd());
    let mut off = src.offset as libc::off_t;
    let end = off + len as libc::off_t;
    while off < end {
        sock.writable().await?;
        let sent = sock.try_io(tokio::io::Interest::WRITABLE, || {
            // SAFETY: both fds stay open for the call (the file is held by `src`,
            // the socket by `wr`), and `off` is a live local.
            let r = unsafe { libc::sendfile(sock_fd, file_fd, &mut off, (end - off) as usize) };
            if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as usize) }
        });
        match sent {
            Ok(0) => {
                // The file ended early (shrunk under us): the rest reads as zeroes.
                let zeros = vec![0u8; (end - off) as usize];
                wr.write_all(&zeros).await?;
                return Ok(());
            }
            Ok(_) => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(wr: &mut W, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        let n = wr.write_vectored(slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

/// One connection's request path without its socket: a request header (and
/// a WRITE's payload) goes through the same functions as in
/// [`read_requests`] (decode, [`admit`], [`answer_now`], else [`execute`])
/// and the reply's parts come out in the order the writer would send them.
/// For the bench crate's instruction-count gate, which measures the
/// server's per-request cost without the network.
pub struct Loopback {
    ctx: Arc<Ctx>,
    budget: Arc<Semaphore>,
}

impl std::fmt::Debug for Loopback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loopback").field("volume", &self.ctx.volume.name).finish()
    }
}

impl Loopback {
    /// A connection in the transmission phase to `volume`, as a client that
    /// declared no epoch and negotiated structured replies (or not).
    pub fn new(shared: Arc<Shared>, volume: Arc<Export>, structured: bool) -> Self {
        // Replies are returned, never sent: the receiver is not needed.
        let (tx, _) = mpsc::unbounded_channel();
        let ctx = Arc::new(Ctx {
            shared,
            writer: volume.fence.register(0),
            read_only: volume.read_only,
            volume,
            mode: if structured { ReplyMode::Structured } else { ReplyMode::Simple },
            sendfile: true,
            base_allocation: structured,
            max_block: MAX_BLOCK,
            tx,
        });
        Loopback { ctx, budget: Arc::new(Semaphore::new(INFLIGHT_BYTES as usize)) }
    }

    /// Serves one request: `payload` is a WRITE's data (empty otherwise);
    /// `sink` gets the reply's parts in wire order. A DISC gets no reply.
    pub async fn request(
        &self,
        hdr: &[u8; REQUEST_LEN],
        payload: &[u8],
        mut sink: impl FnMut(&[u8]),
    ) -> io::Result<()> {
        let ctx = &self.ctx;
        let req = Request::decode(hdr).map_err(io::Error::other)?;
        if req.command == Command::Disc {
            return Ok(());
        }
        if payload.len() as u64 != req.payload_len(false) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "payload length does not match the header"));
        }
        let started = Instant::now();
        let reply = match admit(ctx, &req, ctx.volume.backend.size(), started) {
            Err(refusal) => refusal,
            Ok(cost) => {
                let permit = self.budget.clone().acquire_many_owned(cost).await.map_err(io::Error::other)?;
                let payload = (req.command == Command::Write).then(|| {
                    let mut buf = ctx.shared.pool.get(req.length as usize);
                    buf.copy_from_slice(payload);
                    buf
                });
                match answer_now(ctx, &req, payload, permit, started) {
                    Ok(reply) => reply,
                    Err((payload, permit)) => execute(ctx, req, payload, permit, started).await,
                }
            }
        };
        for part in [reply.head.as_bytes(), reply.data.as_deref().unwrap_or(&[])] {
            if !part.is_empty() {
                sink(part);
            }
        }
        if let Some((src, len)) = &reply.file {
            use std::os::unix::fs::FileExt;
            let mut data = vec![0u8; *len];
            src.file.read_exact_at(&mut data, src.offset)?;
            sink(&data);
        }
        if !reply.tail.is_empty() {
            sink(&reply.tail);
        }
        if let Some(d) = reply.data {
            ctx.shared.pool.put(d);
        }
        Ok(())
    }
}
