//! Key leases for conditional writes (If-Match / If-None-Match).
//!
//! A conditional write must check the current ETag and commit without
//! another conditional write to the same key slipping in between. The
//! coordinator leases the key on a write quorum of its replicas (every
//! write set during a layout change) before the quorum read, and releases
//! it after the commit. Two coordinators need W grants each from the same
//! N replicas and 2W > N, so at most one holds the lease. Leases expire
//! after `key_lease_ms` (10 s by default), so a coordinator that dies
//! cannot block the key. A holder renews its lease every third of that
//! while it works (a complete that copies blocks to a lagging replica may
//! take longer than a lease); should a renewal round fail to keep a write
//! quorum of grants, the work is abandoned (503) well before the grants it
//! lost have expired, so no other writer can take the key while it still
//! commits. (A commit message already in flight when the work is abandoned
//! may still land: the write is then partly applied, as any write answered
//! 503 may be.)

use super::NodeId;
use super::coord::Coordinator;
use super::coord::{session_id, union};
use super::rpc::{Msg, Req, Resp};
use crate::error::{LightningError, Result};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a coordinator keeps trying to get a contended lease.
const WAIT: Duration = Duration::from_secs(10);

/// A lease: the token of its holder and when it ends.
type Lease = (u64, Instant);

/// The leases granted by one node, by (bucket, key).
#[derive(Debug, Default)]
pub struct KeyLocks {
    held: Mutex<HashMap<(String, Vec<u8>), Lease>>,
}

impl KeyLocks {
    /// Grants the lease to `token` if it is free, expired or already its own.
    pub fn try_lock(&self, bucket: String, key: Vec<u8>, token: u64, ttl_ms: u32) -> bool {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        held.retain(|_, (_, until)| *until > now);
        let until = now + Duration::from_millis(u64::from(ttl_ms));
        match held.get_mut(&(bucket.clone(), key.clone())) {
            Some((t, u)) if *t == token => {
                *u = until;
                true
            }
            Some(_) => false,
            None => {
                held.insert((bucket, key), (token, until));
                true
            }
        }
    }

    /// Releases the lease if `token` holds it.
    pub fn unlock(&self, bucket: String, key: Vec<u8>, token: u64) {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.get(&(bucket.clone(), key.clone())).is_some_and(|(t, _)| *t == token) {
            held.remove(&(bucket, key));
        }
    }
}

impl Coordinator {
    /// Runs `f` holding the lease on (bucket, key) on a write quorum of
    /// every write set, renewing it while `f` runs; `f` is abandoned (503)
    /// when a renewal cannot keep that quorum. Contention is retried with
    /// back-off for a while, then answered 503 (SlowDown-like; SDKs retry).
    pub async fn with_key_lease<T, F>(self: &Arc<Self>, bucket: &str, key: &[u8], f: F) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        if matches!(self.node.consistency(), super::config::Consistency::Degraded) {
            // A degraded node takes a lease on the replicas it reaches, even
            // one of them: two sides of a partition could both hold it.
            return Err(LightningError::NotImplemented(
                "conditional writes (If-Match, If-None-Match, conditional deletes and completes) on a cluster \
                 with consistency = \"degraded\", whose key leases are not exclusive"
                    .into(),
            ));
        }
        self.with_key_lease_even_degraded(bucket, key, f).await
    }

    /// [`Coordinator::with_key_lease`] also in degraded mode, where the lease is
    /// exclusive only among nodes that reach each other: for the lifecycle
    /// task's deletes of the object it listed, which must go on there.
    pub async fn with_key_lease_even_degraded<T, F>(self: &Arc<Self>, bucket: &str, key: &[u8], f: F) -> Result<T>
    where
        F: Future<Output = Result<T>>,
    {
        let token = session_id();
        let sets = self.node.write_sets(bucket, key);
        let targets = union(&sets);
        let lease = self.lease();
        let start = Instant::now();
        let mut backoff = Duration::from_millis(2);
        loop {
            let granted = self.lock_on(bucket, key, token, &targets, None).await;
            if self.has_write_quorum(&sets, &granted) {
                let r = tokio::select! {
                    r = f => r,
                    e = self.keep_lease(bucket, key, token, &sets, &granted) => Err(e),
                };
                self.release(bucket, key, token, &granted).await;
                return r;
            }
            self.release(bucket, key, token, &granted).await;
            if start.elapsed() > WAIT.max(lease) {
                return Err(
                    self.quorum_failed("the key is locked by another conditional write, or too few replicas answered")
                );
            }
            // Jitter from the token keeps two contenders from retrying in step.
            tokio::time::sleep(backoff + Duration::from_micros(token % 2000)).await;
            backoff = (backoff * 2).min(Duration::from_millis(100));
        }
    }

    /// How long a lease lasts unless renewed (`key_lease_ms`).
    fn lease(&self) -> Duration {
        Duration::from_millis(self.node.config().key_lease_ms)
    }

    fn has_write_quorum(&self, sets: &[Vec<NodeId>], granted: &[NodeId]) -> bool {
        sets.iter().all(|s| s.iter().filter(|n| granted.contains(n)).count() >= self.need_w(s.len()))
    }

    /// Asks `targets` to lease the key to `token` (each call given up after
    /// `timeout`, if any); returns those that granted it.
    async fn lock_on(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        token: u64,
        targets: &[NodeId],
        timeout: Option<Duration>,
    ) -> Vec<NodeId> {
        let ttl_ms = u32::try_from(self.lease().as_millis()).unwrap_or(u32::MAX);
        let calls = targets.iter().map(|&n| {
            let node = self.clone();
            let req = Req::LockKey { bucket: bucket.to_owned(), key: key.to_vec(), token, ttl_ms };
            async move {
                let call = node.node.call(n, Msg::new(req));
                let r = match timeout {
                    Some(t) => tokio::time::timeout(t, call).await.ok(),
                    None => Some(call.await),
                };
                (n, matches!(r, Some(Ok(Msg { head: Resp::Flag(true), .. }))))
            }
        });
        futures::future::join_all(calls).await.into_iter().filter(|(_, g)| *g).map(|(n, _)| n).collect()
    }

    /// Renews the lease on the nodes that `granted` it every third of its
    /// length; returns (an error) only when a round cannot keep a write
    /// quorum of grants. A round's calls are given up after a sixth of the
    /// lease, so that is known before the lost grants expire.
    async fn keep_lease(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        token: u64,
        sets: &[Vec<NodeId>],
        granted: &[NodeId],
    ) -> LightningError {
        let lease = self.lease();
        loop {
            tokio::time::sleep(lease / 3).await;
            let kept = self.lock_on(bucket, key, token, granted, Some(lease / 6)).await;
            if !self.has_write_quorum(sets, &kept) {
                return self.quorum_failed("the conditional write lost the key's lease (too few replicas renewed it)");
            }
        }
    }

    async fn release(self: &Arc<Self>, bucket: &str, key: &[u8], token: u64, granted: &[NodeId]) {
        let calls = granted.iter().map(|&n| {
            let node = self.clone();
            let req = Req::UnlockKey { bucket: bucket.to_owned(), key: key.to_vec(), token };
            async move { node.node.call(n, Msg::new(req)).await }
        });
        futures::future::join_all(calls).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_excludes_other_tokens_until_released_or_expired() {
        let l = KeyLocks::default();
        let k = || ("b".to_owned(), b"k".to_vec());
        assert!(l.try_lock(k().0, k().1, 1, 60_000));
        assert!(l.try_lock(k().0, k().1, 1, 60_000), "re-entrant for the same token");
        assert!(!l.try_lock(k().0, k().1, 2, 60_000));
        l.unlock(k().0, k().1, 2);
        assert!(!l.try_lock(k().0, k().1, 2, 60_000), "only the holder releases");
        l.unlock(k().0, k().1, 1);
        assert!(l.try_lock(k().0, k().1, 2, 0), "free after release");
        assert!(l.try_lock(k().0, k().1, 3, 60_000), "a zero-length lease has expired");
    }
}
