//! The replica listener: takes a primary's authenticated connection, binds
//! it to one of this node's volumes (OPEN), and applies its frames in
//! order through the volume's fence, answering each, and noting each frame
//! and heartbeat as a sign of the primary's life; or answers a new
//! primary's VOTE (`volume/failover.rs`), or a primary's DELETE_VOLUME
//! (`volume/copies.rs`), on a connection of its own; or hands a volume map
//! connection to the map (`replication/map`)
//! (docs/design/replication-volumes.md).

use crate::backend::replicated::apply::{Applier, Snapshots};
use crate::error::{CoronaError, Result};
use crate::replica::auth::{self, RpcSecret};
use crate::replica::wire::{Body, HEADER_LEN, Header, Reply};
use crate::volume::Volumes;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long a caller has to finish the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts replica connections on `listener` until `stopped` turns true,
/// then drops them all.
pub async fn serve(
    listener: TcpListener,
    volumes: Arc<Volumes>,
    secret: RpcSecret,
    mut stopped: watch::Receiver<bool>,
) {
    let secret = Arc::new(secret);
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let (volumes, secret) = (volumes.clone(), secret.clone());
                    conns.spawn(async move {
                        if let Err(e) = connection(stream, &volumes, &secret).await {
                            tracing::warn!(%peer, error = %e, "replica connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "replica accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = async { let _ = stopped.wait_for(|s| *s).await; } => break,
        }
    }
    conns.shutdown().await;
}

/// A copy takes its primary's snapshots through its volume manager.
struct CopySnapshots<'a> {
    volumes: &'a Volumes,
    volume: &'a str,
}

/// The errno a replica answers a snapshot frame it could not apply with.
fn snapshot_errno(volume: &str, name: &str, e: CoronaError) -> std::io::Error {
    tracing::warn!(volume, snapshot = name, error = %e, "snapshot frame failed");
    let errno = match e {
        CoronaError::SnapshotExists(_) => libc::EEXIST,
        CoronaError::InvalidName { .. } => libc::EINVAL,
        CoronaError::NotFound(_) => libc::ENOENT,
        CoronaError::Conflict(_) => libc::EBUSY,
        CoronaError::ReadOnly(_) => libc::EROFS,
        _ => libc::EIO,
    };
    std::io::Error::from_raw_os_error(errno)
}

impl Snapshots for CopySnapshots<'_> {
    fn take<'a>(&'a self, name: &'a str) -> futures::future::BoxFuture<'a, std::io::Result<()>> {
        Box::pin(async move {
            self.volumes.snapshot_as_copy(self.volume, name).await.map_err(|e| snapshot_errno(self.volume, name, e))
        })
    }
    fn delete<'a>(&'a self, name: &'a str) -> futures::future::BoxFuture<'a, std::io::Result<()>> {
        Box::pin(async move {
            self.volumes
                .delete_snapshot_as_copy(self.volume, name)
                .await
                .map_err(|e| snapshot_errno(self.volume, name, e))
        })
    }
    fn resize(&self, size: u64) -> futures::future::BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move {
            self.volumes.resize_as_copy(self.volume, size).await.map_err(|e| snapshot_errno(self.volume, "(resize)", e))
        })
    }
    fn flatten(&self) -> futures::future::BoxFuture<'_, std::io::Result<()>> {
        Box::pin(async move {
            self.volumes.flatten_as_copy(self.volume).map_err(|e| snapshot_errno(self.volume, "(flatten)", e))
        })
    }
}

/// The listener's half of the handshake (`replica/auth.rs`).
pub async fn handshake_as_listener(s: &mut TcpStream, secret: &RpcSecret) -> Result<()> {
    Ok(svc_kit::rpc_auth::io::as_listener(s, &auth::PROTOCOL, secret).await?)
}

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<Option<crate::replica::wire::Msg>> {
    let mut h = [0u8; HEADER_LEN];
    match r.read_exact(&mut h).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let header = Header::decode(&h)?;
    // Read into spare capacity: no zeroing of up to 32 MiB first.
    let len = header.payload_len();
    let mut payload = Vec::with_capacity(len);
    let got = r.take(len as u64).read_to_end(&mut payload).await?;
    if got != len {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    Ok(Some(header.finish(payload)?))
}

async fn connection(mut s: TcpStream, volumes: &Volumes, secret: &RpcSecret) -> Result<()> {
    s.set_nodelay(true)?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake_as_listener(&mut s, secret))
        .await
        .map_err(|_| CoronaError::Replica("handshake timed out".into()))??;
    // A replica stream's first frame starts with its magic; a connection
    // of the volume map starts with the map's instead.
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic).await?;
    if magic == crate::replication::map::net::MAGIC {
        let Some(map) = volumes.volume_map().cloned() else {
            return Err(CoronaError::Replica("a volume map connection, but this node runs no volume map".into()));
        };
        let (rd, wr) = s.into_split();
        return Ok(map.serve(BufReader::new(rd), wr).await?);
    }
    let (rd, wr) = s.into_split();
    let rd = tokio::io::AsyncReadExt::chain(std::io::Cursor::new(magic), rd);
    let mut rd = BufReader::with_capacity(256 * 1024, rd);
    let mut wr = BufWriter::new(wr);
    let Some(open) = read_frame(&mut rd).await? else { return Ok(()) };
    let (volume, size, origin) = match &open.body {
        Body::Open { volume, size, origin } => (volume, size, origin),
        Body::Vote { volume, candidate } => {
            let answer = volumes.vote(volume, open.epoch, candidate).await;
            wr.write_all(&answer.encode()).await?;
            wr.flush().await?;
            return Ok(());
        }
        Body::DeleteVolume { volume, primary } => {
            let errno = volumes.delete_as_copy(volume, open.epoch, primary).await;
            wr.write_all(&Reply { seq: 0, errno }.encode()).await?;
            wr.flush().await?;
            return Ok(());
        }
        _ => {
            return Err(CoronaError::Replica("the first frame is neither OPEN, VOTE nor DELETE_VOLUME".into()));
        }
    };
    // A node that is the volume's primary takes no stream for it (a deposed
    // primary is not a replica until an operator makes it one).
    let export = if volumes.is_primary(volume) {
        Err(libc::EBUSY)
    } else {
        match volumes.open(volume) {
            Ok(e) if e.read_only => Err(libc::EROFS),
            Ok(e) if open.epoch < e.fence.current() => Err(libc::EPERM),
            // Not the copy the primary knows: deleted and made again since.
            Ok(_) if origin.incarnation != 0 && volumes.incarnation(volume) != origin.incarnation => Err(libc::ENXIO),
            Ok(e) => Ok(e),
            Err(_) => Err(libc::ENOENT),
        }
    };
    let export = match export {
        Ok(e) if crate::backend::BlockBackend::size(&e.backend) != *size => {
            // A primary's catch-up stream (stream 0, a primary named) of a
            // volume that grew while this copy was out of the live set: the
            // copy grows first.
            let have = crate::backend::BlockBackend::size(&e.backend);
            if origin.stream == 0 && !origin.primary.is_empty() && *size > have {
                match volumes.resize_as_copy(volume, *size).await {
                    Ok(()) => Ok(e),
                    Err(err) => {
                        tracing::warn!(volume = %volume, size, error = %err, "could not grow for a catch-up");
                        Err(libc::EINVAL)
                    }
                }
            } else {
                Err(libc::EINVAL)
            }
        }
        other => other,
    };
    let export = match export {
        Ok(e) => e,
        Err(errno) => {
            wr.write_all(&Reply { seq: open.seq, errno: errno as u32 }.encode()).await?;
            wr.flush().await?;
            return Err(CoronaError::Replica(format!("refused OPEN of {volume:?} ({size} bytes): errno {errno}")));
        }
    };
    // The copy takes the stream's epoch as its own fence (persisted by
    // `stream_opened` first): a primary of an older epoch, one deposed by
    // the takeover that made this stream's primary, can no longer open a
    // stream here, not even to a copy that was not fenced in that takeover.
    let tracker = volumes.stream_opened(volume, open.epoch, origin, open.seq).await?;
    if let Err(left) = export.fence.raise(open.epoch, crate::volume::FENCE_DRAIN_TIMEOUT).await {
        wr.write_all(&Reply { seq: open.seq, errno: libc::EIO as u32 }.encode()).await?;
        wr.flush().await?;
        return Err(CoronaError::Replica(format!("{left} frames of an older stream of {volume:?} did not drain")));
    }
    let writer = export.fence.register(open.epoch);
    // OPEN's answer carries the copy's incarnation in place of the seq.
    wr.write_all(&Reply { seq: tracker.incarnation, errno: 0 }.encode()).await?;
    wr.flush().await?;
    tracing::info!(volume = %export.name, epoch = open.epoch, primary = %origin.primary, "replica stream opened");
    let mut applier = Applier::opened(open.seq);
    let snaps = CopySnapshots { volumes, volume: &export.name };
    while let Some(msg) = read_frame(&mut rd).await? {
        if msg.body == Body::Heartbeat {
            // Unanswered. A heartbeat of a fenced primary is not heard: the
            // stream ends, as at its next write.
            if msg.epoch < export.fence.current() || export.fence.enter(&writer).is_err() {
                wr.flush().await?;
                return Err(CoronaError::Replica(format!("heartbeat at epoch {} from a fenced primary", msg.epoch)));
            }
            tracker.heard();
            if rd.buffer().is_empty() {
                wr.flush().await?;
            }
            continue;
        }
        let seq = msg.seq;
        let result = match export.fence.enter(&writer) {
            Err(_) => Err(libc::EPERM as u32),
            // The position moves while the frame is in flight, so a vote's
            // fence (which drains in-flight frames) sees its final value.
            Ok(_inflight) => match tracker.turn().await {
                // A later OPEN (the primary's next stream, or a resync)
                // took over this copy: nothing more from this one.
                None => Err(libc::ESTALE as u32),
                Some(_turn) => {
                    tracker.heard();
                    let epoch = msg.epoch;
                    let r = applier.apply(&export.backend, &snaps, msg, export.fence.current()).await;
                    if r.is_ok() {
                        tracker.applied(seq, epoch);
                    }
                    r
                }
            },
        };
        let errno = result.err().unwrap_or(0);
        wr.write_all(&Reply { seq, errno }.encode()).await?;
        if errno != 0 {
            wr.flush().await?;
            return Err(CoronaError::Replica(format!("frame {seq} failed with errno {errno}; closing")));
        }
        // Answer in batches: flush only when no further frame is already buffered.
        if rd.buffer().is_empty() {
            wr.flush().await?;
        }
    }
    wr.flush().await?;
    Ok(())
}
