//! Availability: the fraction of fixed windows of the run in which at least
//! one write was acknowledged. A measure, not a verdict: nothing promises a
//! figure, and windows in which every node was down count like the rest.

use super::history::{History, Nanos, Outcome};
use serde::{Deserialize, Serialize};

/// The availability of writes over a history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Availability {
    /// Length of one window.
    pub window_ns: Nanos,
    /// Windows from the first operation's invoke to the last one's completion.
    pub windows: u64,
    /// Windows in which an acknowledged write completed.
    pub with_write: u64,
    /// `with_write / windows` (0 for an empty history).
    pub fraction: f64,
}

/// Measures it with windows of `window_ns` (at least 1 ns).
pub fn measure(history: &History, window_ns: Nanos) -> Availability {
    let window_ns = window_ns.max(1);
    let start = history.ops().map(|o| o.invoke).min().unwrap_or(0);
    let end = history.ops().map(|o| o.complete).max().unwrap_or(0);
    let windows = if history.ops().next().is_none() { 0 } else { (end - start) / window_ns + 1 };
    let mut hit = vec![false; windows as usize];
    for o in history.ops().filter(|o| o.outcome == Outcome::Ok && o.op.is_write()) {
        hit[((o.complete - start) / window_ns) as usize] = true;
    }
    let with_write = hit.iter().filter(|&&h| h).count() as u64;
    let fraction = if windows == 0 { 0.0 } else { with_write as f64 / windows as f64 };
    Availability { window_ns, windows, with_write, fraction }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::{Entry, Op, Operation};

    fn write(t: Nanos, outcome: Outcome) -> Entry {
        let op = Op::Write { key: "k".into(), value: t.to_string() };
        Entry::Op(Operation { process: 0, endpoint: "e".into(), invoke: t, complete: t + 1, op, outcome, error: None })
    }

    #[test]
    fn windows_without_an_acknowledged_write_count_against_it() {
        // 0..40 in windows of 10: writes ok in the first and last, failed in
        // the second, none in the third.
        let h = History { entries: vec![write(0, Outcome::Ok), write(12, Outcome::Failed), write(38, Outcome::Ok)] };
        let a = measure(&h, 10);
        assert_eq!((a.windows, a.with_write), (4, 2));
        assert!((a.fraction - 0.5).abs() < 1e-9);
    }

    #[test]
    fn an_empty_history_has_no_windows() {
        let a = measure(&History::default(), 10);
        assert_eq!((a.windows, a.fraction), (0, 0.0));
    }
}
