//! The set: elements added (unique object keys in `s3-set`), then read
//! whole (listings) once every add has returned. A final read (one invoked
//! after the last add completed) must hold every acknowledged add; no read
//! may hold an element never added, one whose add failed, or one whose add
//! began after the read ended. Indeterminate adds may be present or not.
//!
//! Reads made while adds are still running are checked only for elements
//! that should not be there: a listing's promise while writes are in flight
//! is not checked here.

use super::history::{History, Nanos, Op, Operation, Outcome};
use super::verdict::{Anomaly, Validity, Verdict};
use std::collections::{HashMap, HashSet};

/// The checker's name in reports.
pub const NAME: &str = "set";

/// Checks the history's set operations.
pub fn check(history: &History) -> Verdict {
    let mut adds: HashMap<&str, Vec<&Operation>> = HashMap::new();
    let mut reads = Vec::new();
    let mut last_add: Nanos = 0;
    for o in history.ops() {
        match &o.op {
            Op::SetAdd { element } => {
                adds.entry(element.as_str()).or_default().push(o);
                last_add = last_add.max(o.complete);
            }
            Op::SetRead { .. } if o.outcome == Outcome::Ok => reads.push(o),
            _ => {}
        }
    }
    let mut anomalies = Vec::new();
    let mut finals = 0;
    let mut lost_seen = HashSet::new();
    for r in &reads {
        let Op::SetRead { elements } = &r.op else { continue };
        let present: HashSet<&str> = elements.iter().map(String::as_str).collect();
        for e in &present {
            if let Some(a) = unexpected(adds.get(e).map(Vec::as_slice).unwrap_or(&[]), e, r) {
                anomalies.push(a);
            }
        }
        if r.invoke <= last_add {
            continue;
        }
        finals += 1;
        let mut missing: Vec<(&str, &Operation)> = adds
            .iter()
            .filter(|(e, _)| !present.contains(*e))
            .filter_map(|(e, ops)| ops.iter().find(|o| o.outcome == Outcome::Ok).map(|o| (*e, *o)))
            .collect();
        missing.sort_by_key(|(_, o)| o.invoke);
        for (e, add) in missing {
            // One anomaly per lost element, with the first read missing it.
            if lost_seen.insert(e) {
                let why =
                    format!("element {e:?} was acknowledged but is missing from the final read at {}", r.endpoint);
                anomalies.push(Anomaly::new("lost-element", Some(e.to_string()), why, vec![add.clone(), (*r).clone()]));
            }
        }
    }
    let detail = format!("{} elements added, {} reads of which {finals} final", adds.len(), reads.len());
    let otherwise = if finals == 0 { Validity::Unknown } else { Validity::Holds };
    let mut v = Verdict::from_anomalies(NAME, otherwise, detail, anomalies);
    if finals == 0 && v.validity == Validity::Unknown {
        v.detail.push_str("; no read after the last add");
    }
    v
}

/// An anomaly when element `e`, present in read `r`, should not be there.
fn unexpected(adds: &[&Operation], e: &str, r: &Operation) -> Option<Anomaly> {
    let possible = adds.iter().find(|a| a.outcome != Outcome::Failed && a.invoke <= r.complete);
    if possible.is_some() {
        return None;
    }
    let subject = Some(e.to_string());
    let (kind, why) = match adds.first() {
        None => ("never-added", format!("element {e:?} read at {} was never added", r.endpoint)),
        Some(a) if a.outcome == Outcome::Failed && adds.iter().all(|a| a.outcome == Outcome::Failed) => {
            ("failed-add-present", format!("element {e:?} read at {} though its add failed", r.endpoint))
        }
        Some(_) => ("read-from-future", format!("element {e:?} read at {} before its add was sent", r.endpoint)),
    };
    let mut window: Vec<Operation> = adds.iter().map(|o| (*o).clone()).collect();
    window.push(r.clone());
    Some(Anomaly::new(kind, subject, why, window))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::Entry;

    fn op(invoke: Nanos, complete: Nanos, op: Op, outcome: Outcome) -> Entry {
        Entry::Op(Operation { process: 0, endpoint: "e".into(), invoke, complete, op, outcome, error: None })
    }
    fn add(t: Nanos, e: &str, outcome: Outcome) -> Entry {
        op(t, t + 1, Op::SetAdd { element: e.into() }, outcome)
    }
    fn read(t: Nanos, es: &[&str]) -> Entry {
        op(t, t + 1, Op::SetRead { elements: es.iter().map(|s| s.to_string()).collect() }, Outcome::Ok)
    }
    fn verdict(entries: Vec<Entry>) -> Verdict {
        check(&History { entries })
    }

    #[test]
    fn every_acknowledged_add_in_the_final_read_holds() {
        let v = verdict(vec![
            add(0, "a", Outcome::Ok),
            add(2, "b", Outcome::Indeterminate),
            add(4, "c", Outcome::Failed),
            add(6, "d", Outcome::Ok),
            read(10, &["a", "d"]),
            read(12, &["a", "b", "d"]),
        ]);
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn a_lost_element_is_caught_once_with_its_add() {
        let v = verdict(vec![add(0, "a", Outcome::Ok), add(2, "b", Outcome::Ok), read(10, &["a"]), read(12, &["a"])]);
        assert_eq!(v.validity, Validity::Violated);
        assert_eq!(v.anomaly_count, 1);
        let a = &v.anomalies[0];
        assert_eq!((a.kind.as_str(), a.subject.as_deref()), ("lost-element", Some("b")));
        assert!(matches!(a.window[0].op, Op::SetAdd { .. }));
    }

    #[test]
    fn elements_never_added_or_failed_are_caught_in_any_read() {
        let v = verdict(vec![add(0, "a", Outcome::Failed), read(1, &["a", "z"]), add(5, "b", Outcome::Ok)]);
        let mut kinds: Vec<&str> = v.anomalies.iter().map(|a| a.kind.as_str()).collect();
        kinds.sort_unstable();
        assert_eq!(kinds, ["failed-add-present", "never-added"]);
    }

    #[test]
    fn an_element_read_before_its_add_was_sent_is_caught() {
        let v = verdict(vec![read(0, &["a"]), add(5, "a", Outcome::Ok), read(10, &["a"])]);
        assert_eq!(v.anomalies.iter().map(|a| a.kind.as_str()).collect::<Vec<_>>(), ["read-from-future"]);
    }

    #[test]
    fn without_a_final_read_the_set_is_unknown() {
        let v = verdict(vec![add(0, "a", Outcome::Ok), read(0, &[]), add(5, "b", Outcome::Ok)]);
        assert_eq!(v.validity, Validity::Unknown, "{v:?}");
    }
}
