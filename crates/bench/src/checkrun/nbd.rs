//! The `nbd-blocks` workload's clients: writers of self-describing blocks
//! ([`crate::check::blocks::encode`]) through PlasmaVMC's reconnecting
//! attachment (the VM disk path, which follows a failover to the new
//! primary), a FLUSH every few writes, and after healing every block read
//! back through it.
//!
//! A write or FLUSH is recorded with the attachment's connection (its count
//! of reconnects when the request returned) as its session: a FLUSH makes
//! durable only the writes acknowledged on its own connection before it was
//! sent, and a FLUSH during which the connection changed is indeterminate.
//! Replicas do not serve their copy over NBD (they answer with the
//! primary's address), so copies are not read one by one.

use super::record::Recorder;
use super::s3::Pace;
use crate::check::blocks::{decode, encode};
use crate::check::history::{Op, Operation, Outcome};
use plasmavmc::guest::Attachment;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of every block.
pub const BLOCK_SIZE: usize = 4096;
/// A FLUSH after every this many writes of a writer.
pub const FLUSH_EVERY: u64 = 8;
/// The history's name for the attachment.
pub const FRONT: &str = "front";

/// The volume under test, through its attachment.
#[derive(Clone)]
pub struct NbdVolume {
    pub att: Arc<Attachment>,
    /// Blocks the writers spread over, from block 0.
    pub blocks: u64,
    /// Longest one request may take before it is indeterminate.
    pub op_timeout: Duration,
}

impl std::fmt::Debug for NbdVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdVolume").field("blocks", &self.blocks).finish()
    }
}

/// What came of a request bounded by `limit`.
async fn bounded<T>(
    limit: Duration,
    fut: impl std::future::Future<Output = plasmavmc::Result<T>>,
) -> Result<T, (Outcome, String)> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        // An error answer or a lost connection: the write may have landed.
        Ok(Err(e)) => Err((Outcome::Indeterminate, e.to_string())),
        Err(_) => Err((Outcome::Indeterminate, "timeout".into())),
    }
}

impl NbdVolume {
    async fn conn(&self) -> u64 {
        self.att.report().await.reconnects
    }

    fn record(&self, rec: &Recorder, process: u32, invoke: u64, op: Op, r: Result<(), (Outcome, String)>) -> bool {
        let (outcome, error) = match r {
            Ok(()) => (Outcome::Ok, None),
            Err((o, e)) => (o, Some(e)),
        };
        rec.op(Operation { process, endpoint: FRONT.into(), invoke, complete: rec.now(), op, outcome, error })
    }

    /// One writer until `deadline`, then a last FLUSH.
    pub async fn writer(&self, rec: &Recorder, process: u32, seed: u64, pace: Pace, deadline: Instant) {
        let mut rng = (seed ^ (u64::from(process) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
        let mut seq = 0u64;
        while seq < pace.max_ops as u64 && Instant::now() < deadline {
            let block = crate::loadgen::xorshift(&mut rng) % self.blocks.max(1);
            let data = encode(block, process, seq, BLOCK_SIZE);
            let invoke = rec.now();
            let r = bounded(self.op_timeout, self.att.write(block * BLOCK_SIZE as u64, &data)).await;
            let session = self.conn().await;
            if !self.record(rec, process, invoke, Op::BlockWrite { block, seq, fua: false, session }, r) {
                return;
            }
            seq += 1;
            if seq.is_multiple_of(FLUSH_EVERY) && !self.flush(rec, process).await {
                return;
            }
            tokio::time::sleep(pace.think).await;
        }
        self.flush(rec, process).await;
    }

    async fn flush(&self, rec: &Recorder, process: u32) -> bool {
        let before = self.conn().await;
        let invoke = rec.now();
        let mut r = bounded(self.op_timeout, self.att.flush()).await;
        let session = self.conn().await;
        if r.is_ok() && session != before {
            r = Err((Outcome::Indeterminate, format!("reconnected during the FLUSH ({before} -> {session})")));
        }
        self.record(rec, process, invoke, Op::BlockFlush { session }, r)
    }

    /// Waits (at most `limit`) until a read through the attachment answers.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if bounded(self.op_timeout, self.att.read(0, BLOCK_SIZE)).await.is_ok() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// After healing: every block read back (each read tried up to 3 times,
    /// every attempt recorded).
    pub async fn final_reads(&self, rec: &Recorder, process: u32) {
        for block in 0..self.blocks {
            for attempt in 0..3u64 {
                let invoke = rec.now();
                let r = bounded(self.op_timeout, self.att.read(block * BLOCK_SIZE as u64, BLOCK_SIZE)).await;
                let (found, result) = match r {
                    Ok(data) => (decode(block, &data), Ok(())),
                    // A read that failed changes nothing: failed, whatever the cause.
                    Err((_, e)) => (crate::check::history::BlockContent::Unrecognised, Err((Outcome::Failed, e))),
                };
                let ok = result.is_ok();
                let op = Op::BlockRead { block, source: FRONT.into(), found };
                if !self.record(rec, process, invoke, op, result) || ok {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200 * (attempt + 1))).await;
            }
        }
    }
}
