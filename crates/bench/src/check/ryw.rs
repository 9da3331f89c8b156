//! Read-your-acknowledged-writes, LightningStor's documented promise: a read
//! returns the latest write acknowledged before the read began, or a newer
//! one. Per key, with unique values, so a read names the write it saw.
//!
//! A read of value `v` is stale when some write `a` was acknowledged before
//! the read began and was invoked after `v`'s write had been acknowledged
//! (`a` is known newer). An indeterminate write is never known older: it may
//! have landed at any time after its invoke. A read also fails the check
//! when it returns a value no write ever had, the value of a failed write,
//! a value whose write began after the read ended, or nothing once a write
//! was acknowledged.
//!
//! This is weaker than linearizability: it says nothing about two reads of
//! concurrent writes agreeing, nor about a read going back to an older value
//! no acknowledged write has superseded yet.

use super::history::{History, Nanos, Op, Operation, Outcome};
use super::verdict::{Anomaly, Validity, Verdict};
use std::collections::{BTreeMap, HashMap};

/// The checker's name in reports.
pub const NAME: &str = "read-your-writes";

#[derive(Default)]
struct Key<'a> {
    by_value: HashMap<&'a str, &'a Operation>,
    /// Acknowledged writes sorted by completion, and the running maximum of
    /// their invoke times (with the write that has it).
    acked: Vec<&'a Operation>,
    newest_invoked: Vec<usize>,
    reads: Vec<&'a Operation>,
}

impl<'a> Key<'a> {
    /// The acknowledged write invoked last among those completed before `t`.
    fn newest_acked_before(&self, t: Nanos) -> Option<&'a Operation> {
        let n = self.acked.partition_point(|w| w.complete < t);
        (n > 0).then(|| self.acked[self.newest_invoked[n - 1]])
    }
}

/// Checks every register key of the history.
pub fn check(history: &History) -> Verdict {
    let mut keys: BTreeMap<&str, Key> = BTreeMap::new();
    for o in history.ops() {
        match &o.op {
            Op::Write { key, value } => {
                let k = keys.entry(key.as_str()).or_default();
                k.by_value.insert(value.as_str(), o);
                if o.outcome == Outcome::Ok {
                    k.acked.push(o);
                }
            }
            Op::Read { key, .. } if o.outcome == Outcome::Ok => keys.entry(key.as_str()).or_default().reads.push(o),
            _ => {}
        }
    }
    let mut anomalies = Vec::new();
    let mut reads = 0;
    for (key, k) in &mut keys {
        k.acked.sort_by_key(|w| w.complete);
        let mut best = 0;
        for (i, w) in k.acked.iter().enumerate() {
            if w.invoke > k.acked[best].invoke {
                best = i;
            }
            k.newest_invoked.push(best);
        }
        for r in &k.reads {
            reads += 1;
            if let Some(a) = check_read(k, r) {
                let mut a = a;
                a.subject = Some(key.to_string());
                anomalies.push(a);
            }
        }
    }
    let detail = format!("{reads} ok reads of {} keys", keys.len());
    let otherwise = if reads == 0 { Validity::Unknown } else { Validity::Holds };
    Verdict::from_anomalies(NAME, otherwise, detail, anomalies)
}

fn check_read(k: &Key, r: &Operation) -> Option<Anomaly> {
    let Op::Read { value, .. } = &r.op else { return None };
    let newest = k.newest_acked_before(r.invoke);
    let Some(v) = value else {
        let a = newest?;
        return Some(Anomaly::new(
            "absent-after-write",
            None,
            format!("read found no value at {} though a write was acknowledged before it began", r.endpoint),
            vec![a.clone(), r.clone()],
        ));
    };
    let Some(&w) = k.by_value.get(v.as_str()) else {
        let why = format!("read returned {v:?} at {}, which no write ever had", r.endpoint);
        return Some(Anomaly::new("never-written", None, why, vec![r.clone()]));
    };
    if w.outcome == Outcome::Failed {
        let why = format!("read returned {v:?} at {}, the value of a write that failed", r.endpoint);
        return Some(Anomaly::new("failed-write-visible", None, why, vec![w.clone(), r.clone()]));
    }
    if w.invoke > r.complete {
        let why = format!("read returned {v:?} at {} before its write was sent", r.endpoint);
        return Some(Anomaly::new("read-from-future", None, why, vec![w.clone(), r.clone()]));
    }
    let a = newest?;
    if w.outcome == Outcome::Ok && a.invoke > w.complete {
        let why = format!(
            "stale read at {}: returned {v:?} though a newer write ({}) was acknowledged before the read began",
            r.endpoint,
            super::linear::describe(&a.op),
        );
        return Some(Anomaly::new("stale-read", None, why, vec![w.clone(), a.clone(), r.clone()]));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::Entry;

    fn op(process: u32, invoke: Nanos, complete: Nanos, op: Op, outcome: Outcome) -> Entry {
        Entry::Op(Operation { process, endpoint: format!("e{process}"), invoke, complete, op, outcome, error: None })
    }
    fn w(t0: Nanos, t1: Nanos, v: &str, outcome: Outcome) -> Entry {
        op(0, t0, t1, Op::Write { key: "k".into(), value: v.into() }, outcome)
    }
    fn r(t0: Nanos, t1: Nanos, v: Option<&str>) -> Entry {
        op(1, t0, t1, Op::Read { key: "k".into(), value: v.map(str::to_string) }, Outcome::Ok)
    }
    fn kinds(entries: Vec<Entry>) -> Vec<String> {
        let v = check(&History { entries });
        assert_eq!(v.validity == Validity::Violated, v.anomaly_count > 0);
        v.anomalies.into_iter().map(|a| a.kind).collect()
    }

    #[test]
    fn reads_of_the_latest_acknowledged_write_hold() {
        let ok = Outcome::Ok;
        let v = check(&History {
            entries: vec![r(0, 1, None), w(2, 3, "a", ok), r(4, 5, Some("a")), w(6, 7, "b", ok), r(8, 9, Some("b"))],
        });
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn a_read_may_see_a_write_still_in_flight() {
        let ok = Outcome::Ok;
        assert!(kinds(vec![w(0, 1, "a", ok), w(2, 50, "b", ok), r(3, 4, Some("b"))]).is_empty());
        assert!(kinds(vec![w(0, 1, "a", ok), w(2, 50, "b", ok), r(3, 4, Some("a"))]).is_empty());
    }

    #[test]
    fn a_stale_read_is_caught_with_the_three_operations_that_show_it() {
        let ok = Outcome::Ok;
        let v = check(&History { entries: vec![w(0, 1, "a", ok), w(2, 3, "b", ok), r(4, 5, Some("a"))] });
        assert_eq!(v.validity, Validity::Violated);
        let a = &v.anomalies[0];
        assert_eq!(a.kind, "stale-read");
        assert_eq!(a.window.len(), 3);
        assert_eq!(a.subject.as_deref(), Some("k"));
    }

    #[test]
    fn an_indeterminate_write_seen_late_is_not_stale() {
        let (ok, ind) = (Outcome::Ok, Outcome::Indeterminate);
        assert!(kinds(vec![w(0, 1, "a", ind), w(2, 3, "b", ok), r(4, 5, Some("a"))]).is_empty());
    }

    #[test]
    fn nothing_after_an_acknowledged_write_is_caught() {
        assert_eq!(kinds(vec![w(0, 1, "a", Outcome::Ok), r(2, 3, None)]), ["absent-after-write"]);
        assert!(kinds(vec![w(0, 1, "a", Outcome::Indeterminate), r(2, 3, None)]).is_empty());
    }

    #[test]
    fn values_never_written_failed_or_from_the_future_are_caught() {
        assert_eq!(kinds(vec![r(0, 1, Some("x"))]), ["never-written"]);
        assert_eq!(kinds(vec![w(0, 1, "a", Outcome::Failed), r(2, 3, Some("a"))]), ["failed-write-visible"]);
        assert_eq!(kinds(vec![r(0, 1, Some("a")), w(2, 3, "a", Outcome::Ok)]), ["read-from-future"]);
    }

    #[test]
    fn no_reads_is_unknown() {
        let v = check(&History { entries: vec![w(0, 1, "a", Outcome::Ok)] });
        assert_eq!(v.validity, Validity::Unknown);
    }
}
