//! Who may load the machine while a test measures.
//!
//! The tests of this binary run on parallel threads (as many as the machine
//! has cores, two here). A test whose figures are compared against a peer's
//! or against another load generator's takes the gate exclusively; every
//! other test takes it shared, so nothing else of this binary runs while one
//! measures. A test takes it once, first thing (a second shared take while a
//! measuring test waits would block on itself).

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static GATE: RwLock<()> = RwLock::new(());

/// For a test that only needs to run: other such tests may run beside it.
pub fn shared() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|e| e.into_inner())
}

/// For a test that measures: it runs alone in this binary.
pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    GATE.write().unwrap_or_else(|e| e.into_inner())
}
