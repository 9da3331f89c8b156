//! `bench check`'s checkers: pure functions over a history of client
//! operations (with invoke and complete times, endpoints and outcomes) that
//! say whether a service kept its promise while faults were applied.
//!
//! - [`history`]: what a history is, and its JSON-lines form;
//! - [`verdict`]: what a checker says (holds / violated / unknown, and the
//!   smallest window of the history that shows each anomaly);
//! - [`linear`]: linearizability of each register key (Wing–Gong–Lowe);
//! - [`ryw`]: read-your-acknowledged-writes of each register key;
//! - [`set`]: no acknowledged add lost, nothing never added present;
//! - [`blocks`]: self-describing blocks; no block older than its last
//!   flushed write, nothing torn or foreign, copies equal after healing;
//! - [`availability`]: the fraction of time windows with an acknowledged write.

pub mod availability;
pub mod blocks;
pub mod history;
pub mod linear;
pub mod ryw;
pub mod set;
pub mod verdict;

pub use history::{Entry, History, Nanos, Op, Operation, Outcome};
pub use verdict::{Anomaly, Validity, Verdict};

/// The verdicts of the register checkers (linearizability, then
/// read-your-writes).
pub fn register(history: &History, limits: linear::Limits) -> Vec<Verdict> {
    vec![linear::check(history, limits), ryw::check(history)]
}
