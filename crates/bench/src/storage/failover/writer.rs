//! The failover row's client: one guest-like writer on PlasmaVMC's
//! reconnecting attachment ([`plasmavmc::guest::Attachment`], the code a
//! VM's disk runs through), which finds the new primary after a failover
//! and follows its epoch. Every block written carries its write's sequence
//! number ([`plasmavmc::guest::pattern`]), so a read tells which write a
//! block holds.
//!
//! The writer keeps its own record of what is durable: a write is promised
//! only once a FLUSH sent after it succeeded on the same connection. When
//! a write or a FLUSH had to reconnect, writes acknowledged since the last
//! FLUSH are forgotten (the old primary may have died with them), as
//! the attachment's own guest does.

use plasmavmc::guest::{Attachment, BLOCK, pattern};
use plasmavmc::wire::WriteLog;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A FLUSH after every this many writes.
pub const FLUSH_EVERY: u64 = 16;

/// One acknowledged write: when, and on which connection (the
/// attachment's count of reconnects at the time).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Ack {
    pub t_s: f64,
    pub conn: u64,
}

/// One FLUSH that succeeded: when, on which connection, and the writes
/// made durable so far.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FlushMark {
    pub t_s: f64,
    pub conn: u64,
    pub durable: u64,
}

/// What the writer has done so far, shared with whoever watches it.
#[derive(Debug, Default)]
pub struct Record {
    pub acks: Vec<Ack>,
    pub flushes: Vec<FlushMark>,
    /// Why the writer stopped before it was asked to.
    pub error: Option<String>,
    /// FLUSHes answered EIO (each retried, see [`FLUSH_RETRY_FOR`]).
    pub flush_eio: u64,
    /// The first of those answers, and when.
    pub first_flush_eio: Option<(f64, String)>,
}

/// How long a FLUSH answered EIO is retried (every 50 ms). A new primary
/// may refuse FLUSHes until it has caught the other copy up; like a
/// hypervisor that stops the VM on an I/O error and resumes it, the client
/// retries, and the row counts the refusals.
pub const FLUSH_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// The client, for the report.
pub fn describe() -> String {
    format!(
        "one client writes {} KiB blocks one at a time, each holding its write's sequence number, and FLUSHes after \
         every {FLUSH_EVERY} writes, through PlasmaVMC's reconnecting attachment (the VM disk path: on a broken \
         connection it asks the cluster's nodes for the primary every 200 ms and follows a failover's new epoch)",
        BLOCK >> 10
    )
}

/// The block of write `seq` among `blocks`: spread over the volume.
fn block_of(seq: u64, blocks: u64) -> u64 {
    (seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) % blocks
}

struct Writer {
    att: Arc<Attachment>,
    blocks: u64,
    t0: Instant,
    record: Arc<Mutex<Record>>,
    conn: u64,
    acked_log: WriteLog,
    flushed_log: WriteLog,
    durable: u64,
    pending: u64,
    seq: u64,
}

impl Writer {
    async fn reconnects(&self) -> u64 {
        self.att.report().await.reconnects
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets unflushed writes when the connection changed under `op`.
    async fn after_op(&mut self) {
        let now = self.reconnects().await;
        if now != self.conn {
            self.acked_log = self.flushed_log.clone();
            self.pending = 0;
            self.conn = now;
        }
    }

    async fn write(&mut self) -> Result<(), String> {
        let (seq, block) = (self.seq, block_of(self.seq, self.blocks));
        let data = pattern(&self.att.vm_id, block, seq);
        self.att.write(block * BLOCK, &data).await.map_err(|e| format!("write {seq}: {e}"))?;
        self.after_op().await;
        self.acked_log.insert(block, seq);
        self.pending += 1;
        self.seq += 1;
        let ack = Ack { t_s: self.t0.elapsed().as_secs_f64(), conn: self.conn };
        self.lock().acks.push(ack);
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), String> {
        let (covered, n, conn) = (self.acked_log.clone(), self.pending, self.conn);
        let started = Instant::now();
        loop {
            match self.att.flush().await {
                Ok(()) => break,
                Err(e) if e.to_string().contains("EIO") && started.elapsed() < FLUSH_RETRY_FOR => {
                    let t = self.t0.elapsed().as_secs_f64();
                    let what = format!("FLUSH after write {}: {e}", self.seq);
                    {
                        let mut r = self.lock();
                        r.flush_eio += 1;
                        r.first_flush_eio.get_or_insert((t, what));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => return Err(format!("FLUSH after write {}: {e}", self.seq)),
            }
        }
        self.after_op().await;
        if self.conn == conn {
            for (b, s) in covered {
                let e = self.flushed_log.entry(b).or_insert(s);
                *e = (*e).max(s);
            }
            self.durable += n;
            self.pending = 0;
        }
        let mark = FlushMark { t_s: self.t0.elapsed().as_secs_f64(), conn: self.conn, durable: self.durable };
        self.lock().flushes.push(mark);
        Ok(())
    }
}

/// Writes until `stop` is set (then FLUSHes once more) or a write fails
/// for good. Returns the flushed log: block -> the last write to it that a
/// FLUSH covered.
pub async fn run(
    att: Arc<Attachment>,
    blocks: u64,
    t0: Instant,
    stop: Arc<AtomicBool>,
    record: Arc<Mutex<Record>>,
) -> WriteLog {
    let conn = att.report().await.reconnects;
    let mut w = Writer {
        att,
        blocks: blocks.max(1),
        t0,
        record,
        conn,
        acked_log: WriteLog::new(),
        flushed_log: WriteLog::new(),
        durable: 0,
        pending: 0,
        seq: 0,
    };
    let mut result = Ok(());
    while result.is_ok() && !stop.load(Ordering::Relaxed) {
        result = w.write().await;
        if result.is_ok() && w.seq.is_multiple_of(FLUSH_EVERY) {
            result = w.flush().await;
        }
    }
    if result.is_ok() {
        result = w.flush().await;
    }
    if let Err(e) = result {
        w.lock().error = Some(e);
    }
    w.flushed_log
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_spread_over_every_block() {
        let mut seen = std::collections::BTreeSet::new();
        for s in 0..20_000 {
            let b = block_of(s, 1024);
            assert!(b < 1024);
            seen.insert(b);
        }
        assert!(seen.len() > 1000, "{} blocks of 1024 written", seen.len());
        assert_eq!(block_of(5, 0u64.max(1)), 0);
    }
}
