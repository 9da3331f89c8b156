//! Hybrid logical clock: row versions that order causally related writes
//! correctly even when node clocks drift.
//!
//! A version is one `u64`: 44 bits of Unix milliseconds, 12 bits of logical
//! counter, 8 bits of node id. Versions are unique across the cluster (the
//! node id), increase on every node, and a node that sees a version from
//! the future advances past it ([`Hlc::observe`]), so a write that follows a
//! read of version v always gets a version above v. Merging two rows keeps
//! the higher version: deterministic on every replica.

use std::sync::atomic::{AtomicU64, Ordering};

const NODE_BITS: u32 = 8;
const LOGICAL_BITS: u32 = 12;
const LOW_BITS: u32 = NODE_BITS + LOGICAL_BITS;

/// One node's clock.
#[derive(Debug)]
pub struct Hlc {
    node: u8,
    /// The last (ms << LOGICAL_BITS | logical) handed out or observed.
    last: AtomicU64,
}

/// The wall-clock milliseconds a version was made at.
pub fn version_ms(v: u64) -> u64 {
    v >> LOW_BITS
}

/// The lowest version made at wall-clock millisecond `ms`.
pub fn first_version_at(ms: u64) -> u64 {
    ms << LOW_BITS
}

fn wall_ms() -> u64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(d.as_millis()).unwrap_or(0)
}

impl Hlc {
    /// A clock for node `node`.
    pub fn new(node: u8) -> Self {
        Hlc { node, last: AtomicU64::new(0) }
    }

    /// A fresh version, above every version this node made or observed.
    pub fn now(&self) -> u64 {
        self.tick(wall_ms())
    }

    fn tick(&self, wall: u64) -> u64 {
        let floor = wall << LOGICAL_BITS;
        let mut cur = self.last.load(Ordering::Relaxed);
        loop {
            let next = (cur + 1).max(floor);
            match self.last.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return (next << NODE_BITS) | u64::from(self.node),
                Err(c) => cur = c,
            }
        }
    }

    /// Moves the clock past a version seen from another node.
    pub fn observe(&self, version: u64) {
        let seen = version >> NODE_BITS;
        self.last.fetch_max(seen, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_increase_and_carry_the_node_id() {
        let c = Hlc::new(7);
        let mut prev = 0;
        for _ in 0..10_000 {
            let v = c.now();
            assert!(v > prev);
            assert_eq!(v & 0xff, 7);
            prev = v;
        }
    }

    #[test]
    fn a_clock_behind_another_still_orders_after_what_it_observed() {
        let fast = Hlc::new(1);
        let slow = Hlc::new(2);
        // `fast` runs an hour ahead.
        let v_fast = fast.tick(wall_ms() + 3_600_000);
        slow.observe(v_fast);
        let v_slow = slow.now();
        assert!(v_slow > v_fast, "a write after observing must order after it");
        assert!(version_ms(v_slow) >= version_ms(v_fast));
    }

    #[test]
    fn equal_instants_on_two_nodes_still_give_distinct_versions() {
        let a = Hlc::new(1);
        let b = Hlc::new(2);
        assert_ne!(a.tick(1000), b.tick(1000));
    }
}
