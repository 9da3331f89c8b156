//! An async NBD client with pipelining: many requests in flight on one
//! connection, replies matched by cookie as they arrive.
//!
//! It negotiates fixed newstyle with structured replies and `base:allocation`
//! when the server offers them. The bench, PlasmaVMC and the tests use it.

use crate::error::{CoronaError, Result};
use crate::proto::handshake::{self, ClientOption, InfoItem};
use crate::proto::reply::{self, Extent, ReplyHeader};
use crate::proto::request::{Command, Request};
use crate::proto::{
    BASE_ALLOCATION, NbdErrno, ProtoError, chunk, client_flags, handshake_flags, info, opt, rep, tx_flags,
};
use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio::sync::oneshot;

/// What the server told us about the export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    pub min_block: u32,
    pub pref_block: u32,
    pub max_block: u32,
    pub structured: bool,
    pub base_allocation: bool,
}

impl ExportInfo {
    pub fn read_only(&self) -> bool {
        self.flags & tx_flags::READ_ONLY != 0
    }
    pub fn can_multi_conn(&self) -> bool {
        self.flags & tx_flags::CAN_MULTI_CONN != 0
    }
}

enum Kind {
    Read { buf: Vec<u8>, offset: u64 },
    Status { extents: Vec<Extent> },
    Plain,
}

enum Done {
    Data(Vec<u8>),
    Extents(Vec<Extent>),
    Unit,
}

struct Pending {
    kind: Kind,
    error: Option<(u32, String)>,
    tx: oneshot::Sender<Result<Done>>,
}

#[derive(Default)]
struct Shared {
    pending: Mutex<HashMap<u64, Pending>>,
    dead: AtomicBool,
}

/// One NBD connection. Cheap to share behind an `Arc`: every method takes
/// `&self`, so many tasks can keep requests in flight at once.
pub struct NbdClient {
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
    shared: Arc<Shared>,
    next_cookie: AtomicU64,
    info: ExportInfo,
    reader: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient").field("info", &self.info).finish()
    }
}

async fn read_array<const N: usize>(rd: &mut (impl AsyncReadExt + Unpin)) -> Result<[u8; N]> {
    let mut b = [0u8; N];
    rd.read_exact(&mut b).await.map_err(eof)?;
    Ok(b)
}

fn eof(e: std::io::Error) -> CoronaError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof { CoronaError::Disconnected } else { e.into() }
}

/// Reads option replies for `code` until ACK (or an error reply), handing
/// each non-ACK reply to `each`.
async fn option_replies(
    rd: &mut BufReader<OwnedReadHalf>,
    code: u32,
    mut each: impl FnMut(u32, &[u8]) -> Result<()>,
) -> Result<std::result::Result<(), (u32, String)>> {
    loop {
        let h = read_array::<{ handshake::OPTION_REPLY_HEADER_LEN }>(rd).await?;
        let (c, ty, len) = handshake::decode_option_reply_header(&h)?;
        if len > 16 << 20 {
            return Err(ProtoError::BadLength("option reply too large").into());
        }
        let mut data = vec![0u8; len as usize];
        rd.read_exact(&mut data).await.map_err(eof)?;
        if c != code {
            return Err(ProtoError::Unexpected(format!("reply to option {c} while waiting for {code}")).into());
        }
        if ty == rep::ACK {
            return Ok(Ok(()));
        }
        if ty & (1 << 31) != 0 {
            return Ok(Err((ty, String::from_utf8_lossy(&data).into_owned())));
        }
        each(ty, &data)?;
    }
}

async fn send_option(wr: &mut OwnedWriteHalf, o: &ClientOption) -> Result<()> {
    let (code, data) = o.encode_payload();
    let mut out = Vec::with_capacity(16 + data.len());
    handshake::encode_option(code, &data, &mut out);
    wr.write_all(&out).await?;
    Ok(())
}

async fn greet(addr: impl ToSocketAddrs) -> Result<(BufReader<OwnedReadHalf>, OwnedWriteHalf)> {
    let s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let (rd, mut wr) = s.into_split();
    // 64 KiB: room for a few dozen small replies per read(2), while a large
    // READ reply's payload mostly goes straight from the socket into the
    // caller's buffer (what the buffer holds beyond a header is copied once
    // more; with 256 KiB that was a quarter of every 1 MiB read).
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let g = read_array::<{ handshake::GREETING_LEN }>(&mut rd).await?;
    let flags = handshake::decode_greeting(&g)?;
    if flags & handshake_flags::FIXED_NEWSTYLE == 0 {
        return Err(CoronaError::Negotiation("server does not speak fixed newstyle".into()));
    }
    let mut cf = client_flags::FIXED_NEWSTYLE;
    if flags & handshake_flags::NO_ZEROES != 0 {
        cf |= client_flags::NO_ZEROES;
    }
    wr.write_all(&cf.to_be_bytes()).await?;
    Ok((rd, wr))
}

/// Lists the exports of the server at `addr`.
pub async fn list_exports(addr: impl ToSocketAddrs) -> Result<Vec<String>> {
    let (mut rd, mut wr) = greet(addr).await?;
    send_option(&mut wr, &ClientOption::List).await?;
    let mut names = Vec::new();
    let r = option_replies(&mut rd, opt::LIST, |ty, d| {
        if ty == rep::SERVER && d.len() >= 4 {
            let n = (u32::from_be_bytes([d[0], d[1], d[2], d[3]]) as usize).min(d.len() - 4);
            names.push(String::from_utf8_lossy(&d[4..4 + n]).into_owned());
        }
        Ok(())
    })
    .await?;
    if let Err((_, msg)) = r {
        return Err(CoronaError::Negotiation(format!("LIST refused: {msg}")));
    }
    send_option(&mut wr, &ClientOption::Abort).await?;
    Ok(names)
}

/// The primary's NBD address in a refusal from a node that holds only a
/// replica of the export (`... primary-nbd=ADDR`).
pub fn primary_hint(refusal: &str) -> Option<std::net::SocketAddr> {
    let (_, rest) = refusal.split_once("primary-nbd=")?;
    rest.split(|c: char| c.is_whitespace() || c == ')').next()?.parse().ok()
}

/// In a refusal of `VOL;epoch=N` from a primary that a failover elected
/// after a stream of epoch N: `(N, M)`, M the epoch it serves at
/// (`... failover-from=N failover-epoch=M`). A client that held epoch N
/// on the old primary may reconnect declaring M; nobody else may.
pub fn failover_hint(refusal: &str) -> Option<(u64, u64)> {
    let num = |key: &str| -> Option<u64> {
        let (_, rest) = refusal.split_once(key)?;
        rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    Some((num("failover-from=")?, num("failover-epoch=")?))
}

/// How long [`NbdClient::connect_primary`] gives one node to connect and
/// negotiate before it counts as unreachable and the next is tried.
pub const NEGOTIATION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl NbdClient {
    /// Connects to `export` on whichever of `nodes` (a cluster file's NBD
    /// addresses) serves it: each in turn, following a replica's "the
    /// primary is at" answer first. Gives the client and the address that
    /// took it; bounded by twice the number of nodes, and each node by
    /// [`NEGOTIATION_TIMEOUT`] (one that accepts and never negotiates, a
    /// frozen process, counts as unreachable). A primary's refusal
    /// that names a failover ([`failover_hint`]) ends the search: it is the
    /// primary, and the caller decides whether to follow.
    pub async fn connect_primary(nodes: &[std::net::SocketAddr], export: &str) -> Result<(Self, std::net::SocketAddr)> {
        let mut queue: std::collections::VecDeque<std::net::SocketAddr> = nodes.iter().copied().collect();
        let mut last = CoronaError::Negotiation(format!("no node to connect to for {export}"));
        // A node that could not be reached may be the one holding the
        // export (restarting): that, not another node's "no such export",
        // is the answer then, so a caller retries instead of giving up.
        let mut unreachable = None;
        for _ in 0..nodes.len() * 2 {
            let Some(addr) = queue.pop_front() else { break };
            let tried = match tokio::time::timeout(NEGOTIATION_TIMEOUT, NbdClient::connect(addr, export)).await {
                Ok(r) => r,
                // Accepted but never answered (a frozen process, a host whose
                // kernel still completes handshakes): as unreachable, go on.
                Err(_) => Err(CoronaError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("{addr}: no NBD negotiation within {NEGOTIATION_TIMEOUT:?}"),
                ))),
            };
            match tried {
                Ok(c) => return Ok((c, addr)),
                Err(e) => {
                    let msg = e.to_string();
                    if failover_hint(&msg).is_some() {
                        return Err(e);
                    }
                    if let Some(p) = primary_hint(&msg) {
                        queue.retain(|a| *a != p);
                        queue.push_front(p);
                    }
                    if matches!(e, CoronaError::Io(_) | CoronaError::Disconnected) {
                        unreachable = Some(e);
                    } else {
                        last = e;
                    }
                }
            }
        }
        Err(unreachable.unwrap_or(last))
    }

    /// Connects to `export` on the server at `addr` (`host:port`).
    pub async fn connect(addr: impl ToSocketAddrs, export: &str) -> Result<Self> {
        let (mut rd, mut wr) = greet(addr).await?;
        send_option(&mut wr, &ClientOption::StructuredReply).await?;
        let structured = option_replies(&mut rd, opt::STRUCTURED_REPLY, |_, _| Ok(())).await?.is_ok();
        let mut base_allocation = false;
        if structured {
            let q = ClientOption::SetMetaContext { name: export.into(), queries: vec![BASE_ALLOCATION.into()] };
            send_option(&mut wr, &q).await?;
            let r = option_replies(&mut rd, opt::SET_META_CONTEXT, |ty, d| {
                if ty == rep::META_CONTEXT && &d[4.min(d.len())..] == BASE_ALLOCATION.as_bytes() {
                    base_allocation = true;
                }
                Ok(())
            })
            .await?;
            if let Err((ty, msg)) = r
                && ty == rep::ERR_UNKNOWN
            {
                return Err(CoronaError::NotFound(format!("{export} ({msg})")));
            }
        }
        let go = ClientOption::Go { name: export.into(), requests: vec![info::BLOCK_SIZE] };
        send_option(&mut wr, &go).await?;
        let mut info = ExportInfo {
            size: 0,
            flags: 0,
            min_block: 1,
            pref_block: 4096,
            max_block: 32 << 20,
            structured,
            base_allocation,
        };
        let mut got_export = false;
        let r = option_replies(&mut rd, opt::GO, |ty, d| {
            if ty == rep::INFO {
                match handshake::decode_info(d)? {
                    InfoItem::Export { size, flags } => {
                        info.size = size;
                        info.flags = flags;
                        got_export = true;
                    }
                    InfoItem::BlockSize { min, pref, max } => {
                        info.min_block = min;
                        info.pref_block = pref;
                        info.max_block = max;
                    }
                    _ => {}
                }
            }
            Ok(())
        })
        .await?;
        match r {
            Ok(()) if got_export => {}
            Ok(()) => {
                return Err(CoronaError::Negotiation("GO acknowledged without export info".into()));
            }
            Err((rep::ERR_UNKNOWN, msg)) => {
                return Err(CoronaError::NotFound(format!("{export} ({msg})")));
            }
            Err((ty, msg)) => {
                return Err(CoronaError::Negotiation(format!("GO refused ({ty:#x}): {msg}")));
            }
        }
        let shared = Arc::new(Shared::default());
        let reader = tokio::spawn(read_replies(rd, shared.clone()));
        Ok(NbdClient { wr: tokio::sync::Mutex::new(wr), shared, next_cookie: AtomicU64::new(1), info, reader })
    }

    pub fn info(&self) -> &ExportInfo {
        &self.info
    }

    pub fn size(&self) -> u64 {
        self.info.size
    }

    async fn submit(
        &self,
        command: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
        kind: Kind,
    ) -> Result<Done> {
        if self.shared.dead.load(Ordering::Acquire) {
            return Err(CoronaError::Disconnected);
        }
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shared
            .pending
            .lock()
            .map_err(|_| CoronaError::Disconnected)?
            .insert(cookie, Pending { kind, error: None, tx });
        // The reader marks the connection dead before it fails what is
        // pending; a request added after that would wait forever.
        if self.shared.dead.load(Ordering::Acquire) {
            self.shared.pending.lock().ok().and_then(|mut p| p.remove(&cookie));
            return Err(CoronaError::Disconnected);
        }
        let hdr = Request::new(command, flags, cookie, offset, length as u64).encode();
        {
            let mut wr = self.wr.lock().await;
            let mut slices = [IoSlice::new(&hdr), IoSlice::new(payload)];
            let mut s: &mut [IoSlice<'_>] = &mut slices;
            if payload.is_empty() {
                s = &mut s[..1];
            }
            while !s.is_empty() {
                match wr.write_vectored(s).await {
                    Ok(0) | Err(_) => {
                        self.shared.pending.lock().ok().and_then(|mut p| p.remove(&cookie));
                        return Err(CoronaError::Disconnected);
                    }
                    Ok(n) => IoSlice::advance_slices(&mut s, n),
                }
            }
        }
        rx.await.map_err(|_| CoronaError::Disconnected)?
    }

    /// Reads `buf.len()` bytes at `offset` into `buf` and gives it back.
    pub async fn read_into(&self, buf: Vec<u8>, offset: u64) -> Result<Vec<u8>> {
        let len = buf.len() as u32;
        match self.submit(Command::Read, 0, offset, len, &[], Kind::Read { buf, offset }).await? {
            Done::Data(b) => Ok(b),
            _ => Err(ProtoError::Unexpected("read completed without data".into()).into()),
        }
    }

    pub async fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.read_into(vec![0; len], offset).await
    }

    pub async fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let flags = if fua { crate::proto::cmd_flags::FUA } else { 0 };
        self.submit(Command::Write, flags, offset, data.len() as u32, data, Kind::Plain).await.map(|_| ())
    }

    pub async fn flush(&self) -> Result<()> {
        self.submit(Command::Flush, 0, 0, 0, &[], Kind::Plain).await.map(|_| ())
    }

    pub async fn trim(&self, offset: u64, len: u32) -> Result<()> {
        self.submit(Command::Trim, 0, offset, len, &[], Kind::Plain).await.map(|_| ())
    }

    /// `WRITE_ZEROES` with raw command flags (`NO_HOLE`, `FAST_ZERO`, `FUA`).
    pub async fn write_zeroes(&self, offset: u64, len: u32, flags: u16) -> Result<()> {
        self.submit(Command::WriteZeroes, flags, offset, len, &[], Kind::Plain).await.map(|_| ())
    }

    pub async fn cache(&self, offset: u64, len: u32) -> Result<()> {
        self.submit(Command::Cache, 0, offset, len, &[], Kind::Plain).await.map(|_| ())
    }

    /// `base:allocation` extents of a range.
    pub async fn block_status(&self, offset: u64, len: u32) -> Result<Vec<Extent>> {
        if !self.info.base_allocation {
            return Err(CoronaError::Negotiation("base:allocation was not negotiated".into()));
        }
        match self.submit(Command::BlockStatus, 0, offset, len, &[], Kind::Status { extents: Vec::new() }).await? {
            Done::Extents(e) => Ok(e),
            _ => Err(ProtoError::Unexpected("block status without extents".into()).into()),
        }
    }

    /// Sends an arbitrary request (tests use this for requests a polite
    /// client would never send).
    pub async fn raw(&self, command: Command, flags: u16, offset: u64, length: u32, payload: &[u8]) -> Result<()> {
        let kind =
            if command == Command::Read { Kind::Read { buf: vec![0; length as usize], offset } } else { Kind::Plain };
        self.submit(command, flags, offset, length, payload, kind).await.map(|_| ())
    }

    /// Sends `NBD_CMD_DISC` after waiting for nothing: callers should let
    /// their requests finish first.
    pub async fn disconnect(self) -> Result<()> {
        let hdr = Request::new(Command::Disc, 0, 0, 0, 0).encode();
        let mut wr = self.wr.lock().await;
        wr.write_all(&hdr).await?;
        let _ = wr.shutdown().await;
        Ok(())
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

async fn read_replies(mut rd: BufReader<OwnedReadHalf>, shared: Arc<Shared>) {
    let err = match reply_loop(&mut rd, &shared).await {
        Ok(()) => CoronaError::Disconnected,
        Err(e) => e,
    };
    shared.dead.store(true, Ordering::Release);
    let pending: Vec<Pending> = match shared.pending.lock() {
        Ok(mut p) => p.drain().map(|(_, v)| v).collect(),
        Err(_) => Vec::new(),
    };
    tracing::debug!(error = %err, n = pending.len(), "NBD client connection ended");
    for p in pending {
        let _ = p.tx.send(Err(CoronaError::Disconnected));
    }
}

fn take(shared: &Shared, cookie: u64) -> Result<Pending> {
    shared
        .pending
        .lock()
        .map_err(|_| CoronaError::Disconnected)?
        .remove(&cookie)
        .ok_or_else(|| ProtoError::Unexpected(format!("reply for unknown cookie {cookie}")).into())
}

fn finish(p: Pending) {
    let r = match p.error {
        Some((errno, message)) => Err(CoronaError::Nbd { errno: NbdErrno::from_wire(errno), message }),
        None => Ok(match p.kind {
            Kind::Read { buf, .. } => Done::Data(buf),
            Kind::Status { extents } => Done::Extents(extents),
            Kind::Plain => Done::Unit,
        }),
    };
    let _ = p.tx.send(r);
}

async fn reply_loop(rd: &mut BufReader<OwnedReadHalf>, shared: &Shared) -> Result<()> {
    let mut payload = Vec::new();
    loop {
        let mut magic = [0u8; 4];
        match rd.read_exact(&mut magic).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let hlen = ReplyHeader::header_len(u32::from_be_bytes(magic))?;
        if hlen > reply::CHUNK_LEN {
            // This client never asks for extended headers.
            return Err(ProtoError::Unexpected("extended reply without extended headers".into()).into());
        }
        let mut h = [0u8; reply::CHUNK_LEN];
        h[..4].copy_from_slice(&magic);
        rd.read_exact(&mut h[4..hlen]).await.map_err(eof)?;
        let header = ReplyHeader::decode(&h[..hlen])?;
        let mut p = take(shared, header.cookie())?;
        match header {
            ReplyHeader::Simple { error, .. } => {
                if error != 0 {
                    p.error = Some((error, String::new()));
                } else if let Kind::Read { buf, .. } = &mut p.kind {
                    rd.read_exact(buf).await.map_err(eof)?;
                }
                finish(p);
                // Let the task waiting for this reply run now (on a
                // current-thread runtime it would otherwise wait until the
                // socket runs dry): it usually sends its next request, so
                // the pipeline stays as deep as the caller keeps it.
                tokio::task::yield_now().await;
            }
            ReplyHeader::Extended { .. } => {
                return Err(ProtoError::Unexpected("extended reply without extended headers".into()).into());
            }
            ReplyHeader::Chunk { flags, ty, length, cookie } => {
                match (ty, &mut p.kind) {
                    (chunk::OFFSET_DATA, Kind::Read { buf, offset }) if length >= 8 => {
                        let at = u64::from_be_bytes(read_array::<8>(rd).await?);
                        let n = (length - 8) as usize;
                        let start = at.checked_sub(*offset).map(|s| s as usize);
                        match start {
                            Some(s) if s + n <= buf.len() => rd.read_exact(&mut buf[s..s + n]).await.map_err(eof)?,
                            _ => {
                                return Err(ProtoError::Unexpected("data chunk outside the request".into()).into());
                            }
                        };
                    }
                    (chunk::OFFSET_HOLE, Kind::Read { buf, offset }) if length == 12 => {
                        let at = u64::from_be_bytes(read_array::<8>(rd).await?);
                        let n = u32::from_be_bytes(read_array::<4>(rd).await?) as usize;
                        match at.checked_sub(*offset).map(|s| s as usize) {
                            Some(s) if s + n <= buf.len() => buf[s..s + n].fill(0),
                            _ => {
                                return Err(ProtoError::Unexpected("hole chunk outside the request".into()).into());
                            }
                        }
                    }
                    _ => {
                        if length > 64 << 20 {
                            return Err(ProtoError::BadLength("chunk too large").into());
                        }
                        payload.resize(length as usize, 0);
                        rd.read_exact(&mut payload).await.map_err(eof)?;
                        match (ty, &mut p.kind) {
                            (chunk::NONE, _) => {}
                            (chunk::BLOCK_STATUS, Kind::Status { extents }) => {
                                extents.extend(reply::decode_block_status(&payload)?.1);
                            }
                            (t, _) if t & 0x8000 != 0 => {
                                let (errno, msg) = reply::decode_error_payload(&payload)?;
                                p.error.get_or_insert((errno, msg));
                            }
                            (t, _) => {
                                return Err(
                                    ProtoError::Unexpected(format!("chunk type {t} for cookie {cookie}")).into()
                                );
                            }
                        }
                    }
                }
                if flags & chunk::FLAG_DONE != 0 {
                    finish(p);
                    tokio::task::yield_now().await;
                } else if let Ok(mut m) = shared.pending.lock() {
                    m.insert(cookie, p);
                }
            }
        }
    }
}
