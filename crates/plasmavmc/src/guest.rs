//! The emulated guest: one NBD connection to a volume (opened with the VM's
//! write epoch, `VOL;epoch=N`) running a bounded guest-like write pattern, and
//! the log of what the volume acknowledged.
//!
//! Every block the guest writes says which write it was: the first 8 bytes
//! are the write's sequence number, the next 8 the block number, the rest a
//! pseudo-random fill derived from (VM, block, seq). So anyone can read a
//! block and tell which write it holds ([`written_seq`]) without the log,
//! and "nothing acknowledged was lost" is checkable as: every logged block
//! holds its logged write or a later one.
//!
//! Both in-process workers and `plasmavmc agent` run guests through this type;
//! the fence that stops a stale guest is CoronaFS's (its writes answer EPERM).
//!
//! Like a hypervisor's NBD client, an attachment survives a CoronaFS restart
//! and a failover of a replicated volume: its connection is a
//! [`Reconnecting`] one, which reconnects to the volume's primary (following
//! a failover's new epoch) and resends the request that was in flight. Only
//! what a FLUSH covered is promised durable, so on a reconnect the write log
//! goes back to what the last FLUSH covered, as a guest may assume nothing
//! about writes it never flushed.

use crate::error::{PlasmaError, Result};
use crate::reconnect::{OnReconnect, Reconnecting};
use crate::wire::{Report, Verified, WriteLog};
use coronafs::client::NbdClient;
use coronafs::proto::NbdErrno;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Size of one guest write.
pub const BLOCK: u64 = 64 * 1024;
/// The guest writes within the first this many bytes of the volume.
pub const WORKING_SET: u64 = 64 << 20;
/// Most guest writes one request may ask for.
pub const MAX_IO_OPS: u64 = 100_000;
/// A FLUSH after every this many writes.
const FLUSH_EVERY: u64 = 16;
/// The guest's content for `block` at write number `seq`. Pure.
pub fn pattern(vm_id: &str, block: u64, seq: u64) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ block.rotate_left(29) ^ 0x5851_f42d_4c95_7f2d;
    for b in vm_id.bytes() {
        x = (x ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut out = Vec::with_capacity(BLOCK as usize);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&block.to_le_bytes());
    while out.len() < BLOCK as usize {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// Which guest write `data` (the contents of `block`) holds, if any. Pure.
pub fn written_seq(vm_id: &str, block: u64, data: &[u8]) -> Option<u64> {
    let seq = u64::from_le_bytes(data.get(..8)?.try_into().ok()?);
    (data.len() == BLOCK as usize && data == pattern(vm_id, block, seq)).then_some(seq)
}

/// The block the guest's write number `seq` goes to, among `blocks`.
fn block_of(seq: u64, blocks: u64) -> u64 {
    (seq.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 17) % blocks
}

/// The guest's write log and what a FLUSH made durable of it. On a new
/// connection the log goes back to what was flushed: the server may have
/// restarted, and writes acknowledged since the last FLUSH may be gone
/// (a later write puts its block back).
#[derive(Debug, Default)]
pub struct GuestLog {
    log: Mutex<WriteLog>,
    /// The log as of the last FLUSH that succeeded: what is durable.
    flushed: Mutex<WriteLog>,
}

impl OnReconnect for GuestLog {
    async fn reconnected(&self, _: &NbdClient) -> coronafs::Result<()> {
        let flushed = self.flushed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        *self.log.lock().unwrap_or_else(|e| e.into_inner()) = flushed;
        Ok(())
    }
}

/// A volume attached on a worker, holding one epoch (a higher one after
/// following a failover).
#[derive(Debug)]
pub struct Attachment {
    pub vm_id: String,
    pub worker: String,
    pub volume: String,
    link: Reconnecting<GuestLog>,
    next_seq: AtomicU64,
    acked: AtomicU64,
    stop: AtomicBool,
    stopped_by: Mutex<Option<String>>,
    io: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    fenced: Arc<AtomicU64>,
}

impl Attachment {
    /// Connects to `volume` declaring `epoch`, at the primary among `nodes`
    /// (CoronaFS NBD addresses, `host:port`; one for a CoronaFS without
    /// replicas).
    pub async fn connect(
        nodes: &[String],
        vm_id: &str,
        worker: &str,
        volume: &str,
        epoch: u64,
        fenced: Arc<AtomicU64>,
    ) -> Result<Arc<Self>> {
        let link = Reconnecting::connect(nodes, volume, epoch, GuestLog::default()).await?;
        if link.read_only() {
            return Err(PlasmaError::Volume(format!("{} is exported read-only", link.export())));
        }
        Ok(Arc::new(Attachment {
            vm_id: vm_id.to_owned(),
            worker: worker.to_owned(),
            volume: volume.to_owned(),
            link,
            next_seq: AtomicU64::new(0),
            acked: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            stopped_by: Mutex::default(),
            io: tokio::sync::Mutex::new(None),
            fenced,
        }))
    }

    /// The epoch this attachment declares now.
    pub fn epoch(&self) -> u64 {
        self.link.epoch()
    }

    fn size(&self) -> u64 {
        self.link.size()
    }

    /// One guest write. A write CoronaFS refuses for a stale epoch is
    /// [`PlasmaError::Fenced`].
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_then(offset, data, || {}).await
    }

    /// A write, and `acked` once it is acknowledged, before the connection
    /// may be replaced (so a reconnect's reset of the log comes after it).
    async fn write_then(&self, offset: u64, data: &[u8], acked: impl Fn()) -> Result<()> {
        let acked = &acked;
        match self.link.call(|c| async move { c.write(offset, data, false).await.map(|()| acked()) }).await {
            Ok(()) => Ok(()),
            Err(coronafs::CoronaError::Nbd { errno: NbdErrno::Perm, message }) => {
                self.fenced.fetch_add(1, Ordering::Relaxed);
                Err(PlasmaError::Fenced { vm: self.vm_id.clone(), held: self.epoch(), reason: message })
            }
            Err(e) => Err(e.into()),
        }
    }

    pub async fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        Ok(self.link.call(|c| async move { c.read(offset, len).await }).await?)
    }

    pub async fn flush(&self) -> Result<()> {
        self.flush_covering().await.map(drop)
    }

    /// FLUSHes; the log the FLUSH covered (every write acknowledged before it
    /// was sent), now durable. After a reconnect the FLUSH is sent again and
    /// covers the log as it is then.
    async fn flush_covering(&self) -> Result<WriteLog> {
        let covered = self
            .link
            .call(|c| async move {
                let covered = self.log();
                c.flush().await?;
                // Merged, not replaced: an API flush and the guest's own
                // may finish in either order, and each made its snapshot
                // durable, so the flushed log only moves forward.
                let mut flushed = self.link.hook().flushed.lock().unwrap_or_else(|e| e.into_inner());
                for (&block, &seq) in &covered {
                    let e = flushed.entry(block).or_insert(seq);
                    *e = (*e).max(seq);
                }
                Ok(covered)
            })
            .await?;
        Ok(covered)
    }

    /// A copy of the write log.
    pub fn log(&self) -> WriteLog {
        self.link.hook().log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The current state.
    pub async fn report(&self) -> Report {
        let running = self.io.lock().await.as_ref().is_some_and(|h| !h.is_finished());
        Report {
            vm_id: self.vm_id.clone(),
            worker: self.worker.clone(),
            volume: self.volume.clone(),
            epoch: self.epoch(),
            running,
            writes_acked: self.acked.load(Ordering::Relaxed),
            next_seq: self.next_seq.load(Ordering::Relaxed),
            log: self.log(),
            stopped_by: self.stopped_by.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            reconnects: self.link.reconnects(),
        }
    }

    /// Starts `ops` guest writes numbered from `seq_start` (or where the
    /// last run stopped, if later). Refused while a run is going.
    pub async fn start_io(self: &Arc<Self>, ops: u64, seq_start: u64) -> Result<()> {
        if ops > MAX_IO_OPS {
            return Err(PlasmaError::Invalid(format!("io_ops must be at most {MAX_IO_OPS}")));
        }
        let mut io = self.io.lock().await;
        if io.as_ref().is_some_and(|h| !h.is_finished()) {
            return Err(PlasmaError::Conflict(format!("VM {} already runs guest I/O", self.vm_id)));
        }
        self.next_seq.fetch_max(seq_start, Ordering::Relaxed);
        self.stop.store(false, Ordering::Relaxed);
        let me = self.clone();
        *io = Some(tokio::spawn(async move { me.run(ops).await }));
        Ok(())
    }

    async fn run(&self, ops: u64) {
        let blocks = (self.size().min(WORKING_SET) / BLOCK).max(1);
        for n in 0..ops {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let s = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let block = block_of(s, blocks);
            let log = || {
                self.link.hook().log.lock().unwrap_or_else(|e| e.into_inner()).insert(block, s);
            };
            if let Err(e) = self.write_then(block * BLOCK, &pattern(&self.vm_id, block, s), log).await {
                tracing::info!(vm = %self.vm_id, worker = %self.worker, error = %e, "guest stopped");
                *self.stopped_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return;
            }
            self.acked.fetch_add(1, Ordering::Relaxed);
            if n % FLUSH_EVERY == FLUSH_EVERY - 1
                && let Err(e) = self.flush().await
            {
                *self.stopped_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.to_string());
                return;
            }
        }
    }

    /// Stops guest I/O and waits for its write in flight.
    pub async fn pause(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let h = self.io.lock().await.take();
        if let Some(h) = h {
            let _ = h.await;
        }
    }

    /// Waits until the guest's run has ended by itself.
    pub async fn wait_idle(&self) {
        let h = self.io.lock().await.take();
        if let Some(h) = h {
            let _ = h.await;
        }
    }

    /// Takes the log, then FLUSHes: everything in the report is durable.
    /// With `pause`, guest I/O is stopped first, so the log is final.
    pub async fn flush_report(&self, pause: bool) -> Result<Report> {
        if pause {
            self.pause().await;
        }
        let mut report = self.report().await;
        report.log = self.flush_covering().await?;
        Ok(report)
    }

    /// Reads back every logged block: each must hold its logged write or a
    /// later one. With `adopt`, what was found becomes this guest's log.
    pub async fn verify(&self, log: &WriteLog, adopt: bool) -> Result<Verified> {
        let mut out = Verified { verified: 0, max_seq: 0 };
        let mut found = WriteLog::new();
        for (&block, &seq) in log {
            let data = self.read(block * BLOCK, BLOCK as usize).await?;
            match written_seq(&self.vm_id, block, &data) {
                Some(s) if s >= seq => {
                    out.verified += 1;
                    out.max_seq = out.max_seq.max(s);
                    found.insert(block, s);
                }
                got => {
                    return Err(PlasmaError::Conflict(format!(
                        "VM {}: block {block} should hold write {seq} or later, but {} on {}",
                        self.vm_id,
                        got.map_or("holds no guest write".to_owned(), |s| format!("holds write {s}")),
                        self.worker
                    )));
                }
            }
        }
        if adopt {
            let mut l = self.link.hook().log.lock().unwrap_or_else(|e| e.into_inner());
            for (b, s) in found {
                let e = l.entry(b).or_insert(s);
                *e = (*e).max(s);
            }
            self.next_seq.fetch_max(out.max_seq + 1, Ordering::Relaxed);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_block_tells_which_write_it_holds(block in 0u64..1024, seq in any::<u64>(), flip in 0usize..BLOCK as usize) {
            let data = pattern("vm-1", block, seq);
            prop_assert_eq!(written_seq("vm-1", block, &data), Some(seq));
            prop_assert_eq!(written_seq("vm-2", block, &data), None);
            prop_assert_eq!(written_seq("vm-1", block + 1, &data), None);
            let mut bad = data.clone();
            bad[flip] ^= 1;
            prop_assert_eq!(written_seq("vm-1", block, &bad), None);
        }
    }

    #[test]
    fn zeroes_and_short_reads_hold_no_write() {
        assert_eq!(written_seq("vm", 0, &vec![0; BLOCK as usize]), None);
        assert_eq!(written_seq("vm", 0, &[1, 2, 3]), None);
    }
}
