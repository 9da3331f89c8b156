//! Version asks batched per replica (sans-IO: the queues only; the
//! sending is [`super::coord`]'s).
//!
//! A consistent read asks one replica for the row and the others only for
//! its version ([`super::coord`]). Under concurrent reads a coordinator has
//! many such asks to the same replica at once; each as its own message
//! costs a round trip's system calls and a wake-up of the replica per key.
//! So at most one [`super::rpc::Req::RowVersions`] is in flight to each
//! replica: an ask that finds none in flight starts a sender, one that
//! finds one waits in the queue and goes with the next batch, sent as soon
//! as the one in flight has been answered (group commit, for reads). An
//! ask alone on an idle replica goes at once, so a quiet coordinator pays
//! no wait; a busy one sends fewer, larger messages.
//!
//! An answer read after the ask was queued is as good as one asked alone:
//! every batch leaves after the asks it carries were queued, so a version
//! it reports is one the replica held after the read began.
//!
//! A replica of an older build does not know `RowVersions` and answers it
//! as unsupported (during a rolling upgrade). Its asks then fail with
//! [`LightningError::UnsupportedRequest`], and the read asks it for the
//! whole row instead (`GetRow`, which every build knows), so it keeps its
//! quorum. [`OldBuilds`] remembers such a replica for [`OLD_BUILD_RECHECK`],
//! so reads go straight to the row meanwhile and ask versions again after
//! it (the replica may have been upgraded).
//!
//! [`Batches`] allows more than one message in flight per replica; reads
//! use one. (Writes' commits were batched the same way, with two in
//! flight, in an experiment: 4 KiB PUTs were no faster, so commits go one
//! message each.)

use super::NodeId;
use crate::error::{LightningError, Result};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// One read's ask for the version of a key's row on a replica.
#[derive(Debug)]
pub struct VersionAsk {
    /// The bucket.
    pub bucket: String,
    /// The key.
    pub key: Vec<u8>,
    /// Where the version (0: no row) or the failure goes.
    pub reply: oneshot::Sender<Result<u64>>,
}

/// Most asks in one message (the rest go with the next).
pub const MAX_BATCH: usize = 256;

/// Waiting asks to each replica, and how many senders run for it.
#[derive(Debug)]
pub struct Batches<A> {
    /// Most senders (messages in flight) per replica.
    senders: usize,
    peers: Mutex<HashMap<NodeId, Peer<A>>>,
}

#[derive(Debug)]
struct Peer<A> {
    /// Senders running for this replica (each empties the queue).
    sending: usize,
    waiting: Vec<A>,
}

impl<A> Batches<A> {
    /// Queues with at most `senders` messages in flight to each replica.
    pub fn new(senders: usize) -> Self {
        Batches { senders: senders.max(1), peers: Mutex::new(HashMap::new()) }
    }

    /// Queues `ask` for replica `to`; true when the caller must start a
    /// sender for `to` (fewer than the limit run), which calls
    /// [`Batches::next`] until it returns `None`.
    pub fn push(&self, to: NodeId, ask: A) -> bool {
        let mut peers = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let p = peers.entry(to).or_insert_with(|| Peer { sending: 0, waiting: Vec::new() });
        p.waiting.push(ask);
        if p.sending < self.senders {
            p.sending += 1;
            return true;
        }
        false
    }

    /// A sender's next batch for `to`: up to [`MAX_BATCH`] waiting asks
    /// that `live` keeps (an ask whose caller has gone is dropped), oldest
    /// first. `None` when none wait: that sender stops, and a later
    /// [`Batches::push`] starts a new one.
    pub fn next(&self, to: NodeId, live: impl Fn(&A) -> bool) -> Option<Vec<A>> {
        let mut peers = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let p = peers.get_mut(&to)?;
        p.waiting.retain(|a| live(a));
        if p.waiting.is_empty() {
            p.sending = p.sending.saturating_sub(1);
            if p.sending == 0 {
                peers.remove(&to);
            }
            return None;
        }
        let rest = p.waiting.split_off(p.waiting.len().min(MAX_BATCH));
        Some(std::mem::replace(&mut p.waiting, rest))
    }
}

/// How long a replica that answered version asks as unsupported is asked
/// for rows instead, before versions are tried again.
pub const OLD_BUILD_RECHECK: Duration = Duration::from_secs(60);

/// Replicas that answered [`super::rpc::Req::RowVersions`] as unsupported,
/// and when.
#[derive(Debug, Default)]
pub struct OldBuilds {
    since: Mutex<HashMap<NodeId, Instant>>,
}

impl OldBuilds {
    /// Replica `n` answered version asks as unsupported at `now`.
    pub fn mark(&self, n: NodeId, now: Instant) {
        self.since.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(n, now);
    }

    /// Whether reads should ask replica `n` for rows rather than versions
    /// at `now`: it answered unsupported less than [`OLD_BUILD_RECHECK`] ago.
    pub fn is_old(&self, n: NodeId, now: Instant) -> bool {
        let mut since = self.since.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match since.get(&n) {
            Some(t) if now.saturating_duration_since(*t) < OLD_BUILD_RECHECK => true,
            Some(_) => {
                since.remove(&n);
                false
            }
            None => false,
        }
    }
}

/// The error each ask of a batch that replica `n` answered as unsupported gets.
pub fn unsupported(n: NodeId, why: &str) -> LightningError {
    LightningError::UnsupportedRequest(format!("node {n} does not know RowVersions: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_ask_starts_a_sender_and_the_rest_wait_for_its_next_batch() {
        let b = Batches::new(1);
        assert!(b.push(2, 1), "no sender runs for node 2");
        assert!(!b.push(2, 2), "a sender runs for node 2");
        assert!(b.push(3, 10), "node 3 has its own sender");
        assert_eq!(b.next(2, |_| true), Some(vec![1, 2]));
        assert!(!b.push(2, 3), "the sender still runs until its queue is empty");
        assert_eq!(b.next(2, |_| true), Some(vec![3]));
        assert_eq!(b.next(2, |_| true), None);
        assert!(b.push(2, 4), "the sender stopped: the next ask starts one");
        assert_eq!(b.next(3, |_| true), Some(vec![10]));
    }

    #[test]
    fn asks_whose_reads_have_gone_are_not_sent_and_batches_are_bounded() {
        let b = Batches::new(1);
        for i in 0..(MAX_BATCH + 10) {
            b.push(1, i);
        }
        let first = b.next(1, |a| a % 2 == 0).expect("a batch");
        assert_eq!(first.len(), (MAX_BATCH + 10) / 2);
        assert!(first.iter().all(|a| a % 2 == 0));
        assert_eq!(b.next(1, |_| true), None);
        for i in 0..(MAX_BATCH + 10) {
            b.push(1, i);
        }
        assert_eq!(b.next(1, |_| true).map(|v| v.len()), Some(MAX_BATCH));
        assert_eq!(b.next(1, |_| true), Some((MAX_BATCH..MAX_BATCH + 10).collect()));
        assert_eq!(b.next(1, |_| true), None);
    }

    #[test]
    fn with_two_senders_the_second_ask_starts_the_second_and_the_third_waits() {
        let b = Batches::new(2);
        assert!(b.push(1, 1));
        assert!(b.push(1, 2), "one sender runs: a second may start");
        assert!(!b.push(1, 3), "two run: the ask waits");
        assert_eq!(b.next(1, |_| true), Some(vec![1, 2, 3]));
        assert_eq!(b.next(1, |_| true), None, "the first sender stops");
        assert!(b.push(1, 4), "one sender still runs: a second may start");
        assert_eq!(b.next(1, |_| true), Some(vec![4]));
        assert_eq!(b.next(1, |_| true), None);
        assert_eq!(b.next(1, |_| true), None);
        assert!(b.push(1, 5), "no sender runs");
    }

    #[test]
    fn a_replica_of_an_older_build_is_asked_for_rows_until_the_recheck() {
        let old = OldBuilds::default();
        let t0 = Instant::now();
        assert!(!old.is_old(2, t0));
        old.mark(2, t0);
        assert!(old.is_old(2, t0 + OLD_BUILD_RECHECK / 2));
        assert!(!old.is_old(3, t0), "only the replica that answered unsupported");
        assert!(!old.is_old(2, t0 + OLD_BUILD_RECHECK), "asked for versions again (it may have been upgraded)");
        assert!(!old.is_old(2, t0), "and forgotten until it answers unsupported again");
    }
}
