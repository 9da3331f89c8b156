//! Write fencing: a volume's write epoch, and the writers that hold one.
//!
//! A client declares its epoch when it opens the export
//! (`VOL;epoch=N`, see [`parse_export`]); a client that declares nothing holds
//! epoch 0. Every WRITE, TRIM and WRITE_ZEROES of a connection whose epoch is
//! below the volume's current one is refused with `EPERM`. The control API
//! raises the epoch ([`Fence::raise`]) and returns only once every mutating
//! request that passed the check under an older epoch has finished, so after
//! it returns no stale write can land.
//!
//! The check must not cost the hot path more than a few uncontended atomics:
//! a request marks itself in flight on its *connection's* counter
//! ([`Writer`], one cache line per connection), then loads the volume's
//! epoch. Both are `SeqCst`, as are the raiser's store of the new epoch and
//! its reads of the counters, so either the raiser sees the request in flight
//! (and waits for it) or the request sees the new epoch (and is refused);
//! never neither.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The export-name suffix that declares an epoch: `VOL;epoch=N`.
pub const EPOCH_SUFFIX: &str = ";epoch=";

/// Splits an export name into the export and the epoch it declares.
///
/// `vm1` -> `("vm1", None)`, `vm1;epoch=7` -> `("vm1", Some(7))`. A suffix
/// that is not a decimal `u64` is an error (the caller says which name).
pub fn parse_export(name: &str) -> Result<(&str, Option<u64>), String> {
    match name.split_once(EPOCH_SUFFIX) {
        None => Ok((name, None)),
        Some((base, n)) => {
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("export {name:?}: the epoch after {EPOCH_SUFFIX:?} must be a decimal number"));
            }
            let e = n.parse::<u64>().map_err(|_| format!("export {name:?}: the epoch is out of range"))?;
            Ok((base, Some(e)))
        }
    }
}

/// One connection's stake in a volume: the epoch it declared and how many of
/// its mutating requests are past the check and not yet done.
#[derive(Debug)]
pub struct Writer {
    pub epoch: u64,
    inflight: AtomicU64,
}

/// A mutating request in flight; dropping it marks the request done.
#[derive(Debug)]
pub struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The epoch of one open volume and the writers connected to it.
#[derive(Debug)]
pub struct Fence {
    epoch: AtomicU64,
    writers: Mutex<Vec<Weak<Writer>>>,
}

impl Fence {
    pub fn new(epoch: u64) -> Self {
        Fence { epoch: AtomicU64::new(epoch), writers: Mutex::new(Vec::new()) }
    }

    /// The current epoch.
    pub fn current(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Registers a connection holding `epoch`.
    pub fn register(&self, epoch: u64) -> Arc<Writer> {
        let w = Arc::new(Writer { epoch, inflight: AtomicU64::new(0) });
        if let Ok(mut ws) = self.writers.lock() {
            ws.retain(|w| w.strong_count() > 0);
            ws.push(Arc::downgrade(&w));
        }
        w
    }

    /// Lets one mutating request of `w` through, or refuses it with the
    /// current epoch when `w` has been fenced.
    pub fn enter<'a>(&self, w: &'a Writer) -> Result<InFlight<'a>, u64> {
        w.inflight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight(&w.inflight);
        let cur = self.epoch.load(Ordering::SeqCst);
        if w.epoch < cur { Err(cur) } else { Ok(guard) }
    }

    /// Raises the epoch to `epoch` (never lowers it), then waits until no
    /// writer below it has a mutating request in flight. Returns how many
    /// such requests it waited for at first, or, after `timeout`, how many
    /// are still in flight.
    pub async fn raise(&self, epoch: u64, timeout: Duration) -> Result<u64, u64> {
        self.epoch.fetch_max(epoch, Ordering::SeqCst);
        let cur = self.current();
        let stale: Vec<Arc<Writer>> = match self.writers.lock() {
            Ok(ws) => ws.iter().filter_map(Weak::upgrade).filter(|w| w.epoch < cur).collect(),
            Err(_) => Vec::new(),
        };
        let busy = |ws: &[Arc<Writer>]| ws.iter().map(|w| w.inflight.load(Ordering::SeqCst)).sum::<u64>();
        let first = busy(&stale);
        let start = Instant::now();
        let mut left = first;
        while left > 0 {
            if start.elapsed() >= timeout {
                return Err(left);
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
            left = busy(&stale);
        }
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_carry_an_optional_epoch() {
        assert_eq!(parse_export("vm1"), Ok(("vm1", None)));
        assert_eq!(parse_export("vm1;epoch=7"), Ok(("vm1", Some(7))));
        assert_eq!(parse_export("img@gold"), Ok(("img@gold", None)));
        for bad in ["vm1;epoch=", "vm1;epoch=-1", "vm1;epoch=1x", "vm1;epoch=99999999999999999999999"] {
            assert!(parse_export(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn a_fenced_writer_is_refused_and_the_raise_waits_for_its_request_in_flight() {
        let f = Arc::new(Fence::new(1));
        let old = f.register(1);
        let new = f.register(2);
        let g = f.enter(&old).expect("epoch 1 may write at 1");
        let f2 = f.clone();
        let raise = tokio::spawn(async move { f2.raise(2, Duration::from_secs(10)).await });
        // The raise cannot finish while the old request is in flight.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!raise.is_finished());
        assert_eq!(f.enter(&old).map(drop), Err(2), "a new request of the old epoch is refused");
        assert!(f.enter(&new).is_ok(), "the new epoch writes");
        drop(g);
        assert_eq!(raise.await.expect("join"), Ok(1));
        assert_eq!(f.current(), 2);
        // Never lowered; a raise to the current epoch drains nothing.
        assert_eq!(f.raise(1, Duration::from_secs(1)).await, Ok(0));
        assert_eq!(f.current(), 2);
    }

    #[tokio::test]
    async fn a_raise_reports_requests_that_never_finish() {
        let f = Fence::new(0);
        let w = f.register(0);
        let _g = f.enter(&w).expect("enter");
        assert_eq!(f.raise(1, Duration::from_millis(5)).await, Err(1));
    }
}
