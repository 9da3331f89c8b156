//! The replica's side of the write stream, over any backend: checks each
//! frame's number and epoch, applies it, and says what to answer. Used by the
//! TCP listener (`server/replica.rs`) and by the in-memory test link, so both
//! apply frames exactly alike.

use crate::backend::traits::BlockBackend;
use crate::replica::wire::{Body, Msg};
use futures::future::BoxFuture;
use std::io;

/// Where a replica applies the frames that change its volume's catalog:
/// SNAPSHOT, DELETE_SNAPSHOT, RESIZE and FLATTEN (the volume manager on a
/// node; tests over bare backends have none, [`NoSnapshots`]).
pub trait Snapshots: Send + Sync {
    /// Freezes the copy's head as snapshot `name`, durably.
    fn take<'a>(&'a self, name: &'a str) -> BoxFuture<'a, io::Result<()>>;
    /// Deletes snapshot `name`; Ok if the copy does not have it.
    fn delete<'a>(&'a self, name: &'a str) -> BoxFuture<'a, io::Result<()>>;
    /// Grows the copy to `size` bytes, durably.
    fn resize(&self, _size: u64) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async { Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)) })
    }
    /// Starts flattening the copy (its bytes stay the same).
    fn flatten(&self) -> BoxFuture<'_, io::Result<()>> {
        Box::pin(async { Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)) })
    }
}

/// A copy that cannot take snapshots: it answers them `EOPNOTSUPP`.
pub struct NoSnapshots;

impl Snapshots for NoSnapshots {
    fn take<'a>(&'a self, _: &'a str) -> BoxFuture<'a, io::Result<()>> {
        Box::pin(async { Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)) })
    }
    fn delete<'a>(&'a self, _: &'a str) -> BoxFuture<'a, io::Result<()>> {
        Box::pin(async { Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)) })
    }
}

/// Where a replica is in one primary's write stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applier {
    /// The `seq` the next frame must carry.
    pub next_seq: u64,
}

fn errno(e: &io::Error) -> u32 {
    e.raw_os_error().filter(|&n| n > 0).unwrap_or(libc::EIO) as u32
}

impl Applier {
    /// The stream after an OPEN numbered `seq`.
    pub fn opened(seq: u64) -> Self {
        Applier { next_seq: seq }
    }

    /// Applies one frame to `backend` (snapshot frames to `snaps`), whose
    /// fence is at `fence_epoch`. `Err(errno)` is the answer to send; the
    /// caller then closes the connection, so nothing after a failed frame
    /// is ever applied.
    pub async fn apply<B: BlockBackend>(
        &mut self,
        backend: &B,
        snaps: &dyn Snapshots,
        msg: Msg,
        fence_epoch: u64,
    ) -> Result<(), u32> {
        if msg.seq != self.next_seq {
            tracing::warn!(got = msg.seq, want = self.next_seq, "replica frame out of order");
            return Err(libc::EPROTO as u32);
        }
        if msg.epoch < fence_epoch {
            tracing::warn!(epoch = msg.epoch, fence_epoch, "replica frame from a fenced primary");
            return Err(libc::EPERM as u32);
        }
        self.next_seq = msg.seq.wrapping_add(1);
        let r = match msg.body {
            Body::Open { .. } | Body::Vote { .. } | Body::Heartbeat | Body::DeleteVolume { .. } => {
                Err(io::Error::from_raw_os_error(libc::EPROTO))
            }
            // A page-cache write without waiting when the file system can.
            Body::Write { offset, data } if backend.try_write_now(&data, offset) => Ok(()),
            Body::Write { offset, data } => backend.write_at(Vec::from(data), offset, false).await.0,
            Body::WriteZeroes { offset, len, punch } => backend.write_zeroes(offset, len, punch, false).await,
            Body::Trim { offset, len } => backend.trim(offset, len).await,
            Body::Flush => backend.flush().await,
            Body::Snapshot { name } => snaps.take(&name).await,
            Body::DeleteSnapshot { name } => snaps.delete(&name).await,
            Body::Resize { size } => snaps.resize(size).await,
            Body::Flatten => snaps.flatten().await,
        };
        r.map_err(|e| errno(&e))
    }
}
