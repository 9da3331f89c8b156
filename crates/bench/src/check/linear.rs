//! Linearizability of each register key: the Wing–Gong–Lowe search, with
//! Lowe's memoisation (a cache of the linearized set, as a bitset, and the
//! register's state after it).
//!
//! Each key is checked apart (linearizability is compositional). Of a key's
//! operations, failed ones are dropped (they did not happen), and so are
//! reads that did not complete ok (a read changes nothing). An indeterminate
//! write never returns: it may be linearized at any point after its invoke,
//! and linearizing it after everything else is the same as it never
//! happening. An indeterminate write whose value no read returned is dropped
//! before the search: it cannot make an order valid or invalid.
//!
//! The search is bounded by a count of steps and by the cache's memory, past
//! which the key's verdict is "unknown" rather than a run that never ends.
//!
//! When a key is not linearizable the anomaly's window is a sub-history that
//! is itself not linearizable and that holds, for every read in it, the
//! write of the value it returned. Such a window proves the violation on its
//! own: adding reads can only forbid orders, and a write no read in the
//! window observed can be taken out of any order of the whole history
//! without changing what those reads return. The window is found by growing
//! a range of operations around the one the search could not place, then
//! shrunk greedily one operation at a time.

use super::history::{History, Nanos, Op, Operation, Outcome};
use super::verdict::{Anomaly, Validity, Verdict};
use std::collections::{BTreeMap, HashMap, HashSet};

/// The checker's name in reports.
pub const NAME: &str = "linearizable";

/// How much work the search may do per key.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Steps of the search (one per event looked at) before giving up.
    pub max_steps: u64,
    /// Memory of the cache, in bytes, before giving up.
    pub max_cache_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_steps: 20_000_000, max_cache_bytes: 256 << 20 }
    }
}

/// A register operation as the search sees it; values are interned, 0 is
/// the key's initial state (absent).
#[derive(Debug, Clone, Copy)]
struct RegOp {
    write: bool,
    value: u32,
    invoke: Nanos,
    /// `Nanos::MAX` for an indeterminate write: it never returns.
    ret: Nanos,
    /// Index of the operation in the key's list of [`Operation`]s.
    src: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Search {
    Linearizable,
    /// Not linearizable; `stuck` is the index (into the slice searched) of
    /// the operation whose return the deepest attempt could not get past.
    Not {
        stuck: usize,
    },
    Unknown,
}

/// Checks every register key of the history.
pub fn check(history: &History, limits: Limits) -> Verdict {
    let mut by_key: BTreeMap<&str, Vec<&Operation>> = BTreeMap::new();
    for o in history.ops() {
        match &o.op {
            Op::Write { key, .. } | Op::Read { key, .. } => by_key.entry(key.as_str()).or_default().push(o),
            _ => {}
        }
    }
    if by_key.is_empty() {
        return Verdict::from_anomalies(NAME, Validity::Unknown, "no register operations".into(), vec![]);
    }
    let mut anomalies = Vec::new();
    let mut unknown = Vec::new();
    let mut searched = 0;
    for (key, ops) in &by_key {
        let reg = prepare(ops);
        searched += reg.len();
        match search(&reg, limits) {
            Search::Linearizable => {}
            Search::Unknown => unknown.push(key.to_string()),
            Search::Not { stuck } => {
                let window = witness(&reg, stuck, limits);
                let stuck_op = ops[reg[stuck].src];
                let explanation = format!(
                    "no order of these {} operations on {key:?} agrees with their times and a register's \
                     semantics; the search could not place process {}'s {} at {} (invoked {} ns, completed {} ns)",
                    window.len(),
                    stuck_op.process,
                    describe(&stuck_op.op),
                    stuck_op.endpoint,
                    stuck_op.invoke,
                    stuck_op.complete,
                );
                let window = window.iter().map(|&i| ops[reg[i].src].clone()).collect();
                anomalies.push(Anomaly::new("not-linearizable", Some(key.to_string()), explanation, window));
            }
        }
    }
    let mut detail = format!("{} keys, {searched} operations searched", by_key.len());
    if !unknown.is_empty() {
        detail.push_str(&format!("; search effort exhausted on {}", unknown.join(", ")));
    }
    let otherwise = if unknown.is_empty() { Validity::Holds } else { Validity::Unknown };
    Verdict::from_anomalies(NAME, otherwise, detail, anomalies)
}

/// A few words for an operation.
pub(crate) fn describe(op: &Op) -> String {
    match op {
        Op::Write { value, .. } => format!("write {value:?}"),
        Op::Read { value: Some(v), .. } => format!("read {v:?}"),
        Op::Read { value: None, .. } => "read (absent)".into(),
        other => format!("{other:?}"),
    }
}

/// The key's operations as the search sees them (see the module doc).
fn prepare<'a>(ops: &[&'a Operation]) -> Vec<RegOp> {
    let mut ids: HashMap<&'a str, u32> = HashMap::new();
    let mut observed = HashSet::new();
    for o in ops {
        if let (Op::Read { value: Some(v), .. }, Outcome::Ok) = (&o.op, o.outcome) {
            observed.insert(v.as_str());
        }
    }
    let mut id_of = |v: &'a str| -> u32 {
        let next = ids.len() as u32 + 1;
        *ids.entry(v).or_insert(next)
    };
    let mut reg = Vec::new();
    for (src, &o) in ops.iter().enumerate() {
        match (&o.op, o.outcome) {
            (Op::Read { value, .. }, Outcome::Ok) => {
                let value = value.as_deref().map_or(0, &mut id_of);
                reg.push(RegOp { write: false, value, invoke: o.invoke, ret: o.complete, src });
            }
            (Op::Write { value, .. }, Outcome::Ok) => {
                let value = id_of(value);
                reg.push(RegOp { write: true, value, invoke: o.invoke, ret: o.complete, src });
            }
            (Op::Write { value, .. }, Outcome::Indeterminate) if observed.contains(value.as_str()) => {
                let value = id_of(value);
                reg.push(RegOp { write: true, value, invoke: o.invoke, ret: Nanos::MAX, src });
            }
            _ => {}
        }
    }
    reg
}

/// The doubly linked list of call and return events the search walks.
struct Events {
    /// Per node (0 is the head, `len + 1` the tail): the op and whether
    /// it is its call.
    node_op: Vec<(usize, bool)>,
    next: Vec<usize>,
    prev: Vec<usize>,
    call: Vec<usize>,
    ret: Vec<usize>,
}

impl Events {
    fn new(ops: &[RegOp]) -> Events {
        let mut ev: Vec<(Nanos, u8, usize)> = Vec::with_capacity(ops.len() * 2);
        for (i, o) in ops.iter().enumerate() {
            // At equal times a call sorts first: the two overlap (the
            // weaker claim, so no false violation from clock ties).
            ev.push((o.invoke, 0, i));
            ev.push((o.ret, 1, i));
        }
        ev.sort_unstable();
        let m = ev.len();
        let mut e = Events {
            node_op: Vec::with_capacity(m + 2),
            next: (1..=m + 2).collect(),
            prev: (0..m + 2).map(|k| k.saturating_sub(1)).collect(),
            call: vec![0; ops.len()],
            ret: vec![0; ops.len()],
        };
        e.node_op.push((usize::MAX, false));
        for (k, &(_, kind, i)) in ev.iter().enumerate() {
            e.node_op.push((i, kind == 0));
            if kind == 0 {
                e.call[i] = k + 1;
            } else {
                e.ret[i] = k + 1;
            }
        }
        e.node_op.push((usize::MAX, false));
        e
    }

    fn tail(&self) -> usize {
        self.node_op.len() - 1
    }

    fn unlink(&mut self, k: usize) {
        let (p, n) = (self.prev[k], self.next[k]);
        self.next[p] = n;
        self.prev[n] = p;
    }

    fn relink(&mut self, k: usize) {
        let (p, n) = (self.prev[k], self.next[k]);
        self.next[p] = k;
        self.prev[n] = k;
    }

    fn lift(&mut self, i: usize) {
        self.unlink(self.call[i]);
        self.unlink(self.ret[i]);
    }

    /// Undoes the last [`Events::lift`] (links are restored in reverse).
    fn unlift(&mut self, i: usize) {
        self.relink(self.ret[i]);
        self.relink(self.call[i]);
    }
}

fn search(ops: &[RegOp], limits: Limits) -> Search {
    let n = ops.len();
    let mut ev = Events::new(ops);
    let tail = ev.tail();
    let words = n.div_ceil(64).max(1);
    let entry_bytes = words * 8 + 64;
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Box<[u64]>, u32)> = HashSet::new();
    let mut stack: Vec<(usize, u32)> = Vec::new();
    let mut state = 0u32;
    let mut entry = ev.next[0];
    let mut steps = 0u64;
    let mut deepest: Option<(usize, usize)> = None;
    loop {
        if ev.next[0] == tail {
            return Search::Linearizable;
        }
        steps += 1;
        if steps > limits.max_steps || cache.len().saturating_mul(entry_bytes) > limits.max_cache_bytes {
            return Search::Unknown;
        }
        let (i, is_call) = ev.node_op[entry];
        if entry != tail && is_call {
            let o = ops[i];
            let (ok, after) = if o.write { (true, o.value) } else { (state == o.value, state) };
            if ok {
                linearized[i / 64] |= 1 << (i % 64);
                if cache.insert((linearized.clone().into_boxed_slice(), after)) {
                    stack.push((i, state));
                    state = after;
                    ev.lift(i);
                    entry = ev.next[0];
                    continue;
                }
                linearized[i / 64] &= !(1 << (i % 64));
            }
            entry = ev.next[entry];
        } else {
            // The return of an operation not yet placed: every order tried
            // from here is refuted, undo the last choice.
            if entry != tail && deepest.is_none_or(|(d, _)| stack.len() > d) {
                deepest = Some((stack.len(), i));
            }
            let Some((j, before)) = stack.pop() else {
                return Search::Not { stuck: deepest.map_or(0, |(_, i)| i) };
            };
            linearized[j / 64] &= !(1 << (j % 64));
            state = before;
            ev.unlift(j);
            entry = ev.next[ev.call[j]];
        }
    }
}

/// The indices (into `reg`) of a small non-linearizable window around `stuck`.
fn witness(reg: &[RegOp], stuck: usize, limits: Limits) -> Vec<usize> {
    let sub_limits = Limits { max_steps: (limits.max_steps / 20).max(10_000), ..limits };
    let mut by_invoke: Vec<usize> = (0..reg.len()).collect();
    by_invoke.sort_by_key(|&i| (reg[i].invoke, i));
    let pos = by_invoke.iter().position(|&i| i == stuck).unwrap_or(0);
    let writer_of: HashMap<u32, Vec<usize>> =
        reg.iter().enumerate().filter(|(_, o)| o.write).fold(HashMap::new(), |mut m, (i, o)| {
            m.entry(o.value).or_default().push(i);
            m
        });
    let close = |set: &mut Vec<usize>| {
        let mut have: HashSet<usize> = set.iter().copied().collect();
        for k in 0..set.len() {
            let o = reg[set[k]];
            if !o.write {
                for &w in writer_of.get(&o.value).into_iter().flatten() {
                    if have.insert(w) {
                        set.push(w);
                    }
                }
            }
        }
        set.sort_unstable();
    };
    let sub = |set: &[usize]| -> Vec<RegOp> { set.iter().map(|&i| reg[i]).collect() };
    let mut radius = 4usize;
    let mut window = loop {
        let lo = pos.saturating_sub(radius);
        let hi = (pos + radius / 2 + 1).min(by_invoke.len());
        let mut set: Vec<usize> = by_invoke[lo..hi].to_vec();
        close(&mut set);
        let whole = lo == 0 && hi == by_invoke.len();
        if whole || matches!(search(&sub(&set), sub_limits), Search::Not { .. }) {
            break set;
        }
        radius *= 2;
    };
    if window.len() > 200 {
        return window;
    }
    // Greedy shrinking: drop any operation whose absence keeps the window
    // closed (a read, or a write no remaining read returns) and refuted.
    let mut changed = true;
    while changed {
        changed = false;
        let mut k = window.len();
        while k > 0 {
            k -= 1;
            let o = reg[window[k]];
            let observed = o.write && window.iter().any(|&r| !reg[r].write && reg[r].value == o.value);
            if observed {
                continue;
            }
            let mut without = window.clone();
            without.remove(k);
            if matches!(search(&sub(&without), sub_limits), Search::Not { .. }) {
                window = without;
                changed = true;
            }
        }
    }
    window
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::Entry;
    use proptest::prelude::*;

    fn op(process: u32, invoke: Nanos, complete: Nanos, op: Op, outcome: Outcome) -> Entry {
        Entry::Op(Operation { process, endpoint: format!("e{process}"), invoke, complete, op, outcome, error: None })
    }
    fn w(p: u32, t0: Nanos, t1: Nanos, v: &str) -> Entry {
        op(p, t0, t1, Op::Write { key: "k".into(), value: v.into() }, Outcome::Ok)
    }
    fn wi(p: u32, t0: Nanos, t1: Nanos, v: &str) -> Entry {
        op(p, t0, t1, Op::Write { key: "k".into(), value: v.into() }, Outcome::Indeterminate)
    }
    fn r(p: u32, t0: Nanos, t1: Nanos, v: Option<&str>) -> Entry {
        op(p, t0, t1, Op::Read { key: "k".into(), value: v.map(str::to_string) }, Outcome::Ok)
    }
    fn verdict(entries: Vec<Entry>) -> Verdict {
        check(&History { entries }, Limits::default())
    }

    #[test]
    fn a_sequential_register_history_is_linearizable() {
        let v = verdict(vec![
            r(0, 0, 1, None),
            w(0, 2, 3, "a"),
            r(1, 4, 5, Some("a")),
            w(1, 6, 7, "b"),
            r(0, 8, 9, Some("b")),
        ]);
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn a_read_overlapping_a_write_may_return_either_value() {
        for seen in [Some("a"), Some("b")] {
            let v = verdict(vec![w(0, 0, 1, "a"), w(1, 2, 10, "b"), r(2, 3, 4, seen)]);
            assert_eq!(v.validity, Validity::Holds, "{seen:?}: {v:?}");
        }
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_not_linearizable() {
        let v = verdict(vec![w(0, 0, 1, "a"), w(1, 2, 3, "b"), r(2, 4, 5, Some("a"))]);
        assert_eq!(v.validity, Validity::Violated);
        let window = &v.anomalies[0].window;
        assert_eq!(window.len(), 3, "{window:?}");
    }

    #[test]
    fn two_reads_that_disagree_on_the_order_of_two_writes_are_not_linearizable() {
        // a and b are concurrent, so either order is possible, but not both:
        // process 2 sees b then a, process 3 sees a then b.
        let v = verdict(vec![
            w(0, 0, 100, "a"),
            w(1, 0, 100, "b"),
            r(2, 10, 20, Some("b")),
            r(2, 30, 40, Some("a")),
            r(3, 10, 20, Some("a")),
            r(3, 30, 40, Some("b")),
        ]);
        assert_eq!(v.validity, Validity::Violated, "{v:?}");
    }

    #[test]
    fn a_read_that_goes_back_to_an_older_value_is_not_linearizable() {
        // b's write overlaps both reads, but once a read saw b, a later read
        // cannot see a again.
        let v = verdict(vec![w(0, 0, 1, "a"), w(1, 2, 100, "b"), r(2, 10, 20, Some("b")), r(3, 30, 40, Some("a"))]);
        assert_eq!(v.validity, Validity::Violated, "{v:?}");
    }

    #[test]
    fn an_indeterminate_write_may_appear_long_after_it_timed_out() {
        let v = verdict(vec![
            w(0, 0, 1, "a"),
            wi(1, 2, 3, "b"),
            r(2, 10, 11, Some("a")),
            r(2, 20, 21, Some("b")),
            r(2, 30, 31, Some("b")),
        ]);
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn an_indeterminate_write_may_never_happen() {
        let v = verdict(vec![w(0, 0, 1, "a"), wi(1, 2, 3, "b"), r(2, 10, 11, Some("a"))]);
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn an_indeterminate_write_cannot_take_effect_before_it_was_invoked() {
        let v = verdict(vec![w(0, 0, 1, "a"), r(2, 2, 3, Some("b")), wi(1, 10, 11, "b")]);
        assert_eq!(v.validity, Validity::Violated, "{v:?}");
    }

    #[test]
    fn an_indeterminate_write_takes_effect_once() {
        // b lands, a overwrites it, b cannot land again.
        let v = verdict(vec![
            wi(1, 0, 1, "b"),
            r(2, 10, 11, Some("b")),
            w(0, 20, 21, "a"),
            r(2, 30, 31, Some("a")),
            r(2, 40, 41, Some("b")),
        ]);
        assert_eq!(v.validity, Validity::Violated, "{v:?}");
    }

    #[test]
    fn a_failed_write_never_happened() {
        let failed = op(1, 2, 3, Op::Write { key: "k".into(), value: "b".into() }, Outcome::Failed);
        let v = verdict(vec![w(0, 0, 1, "a"), failed.clone(), r(2, 10, 11, Some("a"))]);
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
        let v = verdict(vec![w(0, 0, 1, "a"), failed, r(2, 10, 11, Some("b"))]);
        assert_eq!(v.validity, Validity::Violated, "{v:?}");
    }

    #[test]
    fn a_read_of_the_initial_state_after_a_write_is_not_linearizable() {
        let v = verdict(vec![w(0, 0, 1, "a"), r(1, 2, 3, None)]);
        assert_eq!(v.validity, Validity::Violated);
    }

    #[test]
    fn keys_are_checked_apart() {
        let mut entries = vec![w(0, 0, 1, "a"), r(1, 2, 3, Some("a"))];
        entries.push(op(2, 4, 5, Op::Read { key: "other".into(), value: None }, Outcome::Ok));
        assert_eq!(verdict(entries).validity, Validity::Holds);
    }

    #[test]
    fn the_window_is_shrunk_to_the_operations_that_show_the_violation() {
        let mut entries = Vec::new();
        for i in 0..50u64 {
            entries.push(w(0, i * 10, i * 10 + 1, &format!("v{i}")));
            entries.push(r(1, i * 10 + 2, i * 10 + 3, Some(&format!("v{i}"))));
        }
        // The stale read, in the middle: v20 after v21 was read.
        entries.push(r(2, 215, 216, Some("v20")));
        let v = verdict(entries);
        assert_eq!(v.validity, Validity::Violated);
        let window = &v.anomalies[0].window;
        assert!(window.len() <= 4, "{window:#?}");
        assert!(window.iter().any(|o| o.process == 2));
    }

    #[test]
    fn an_exhausted_search_is_unknown_not_an_answer() {
        // Many concurrent writes and reads that force a long search.
        let mut entries = Vec::new();
        for i in 0..12u32 {
            entries.push(w(i, 0, 1000, &format!("v{i}")));
            entries.push(r(i + 100, 10, 990, Some(&format!("v{}", (i + 1) % 12))));
        }
        let v = check(&History { entries }, Limits { max_steps: 10, max_cache_bytes: 1 << 20 });
        assert_eq!(v.validity, Validity::Unknown, "{v:?}");
    }

    /// A register model run sequentially: each operation gets a point in
    /// time at which it happens; `spread` widens its interval around that
    /// point (0 gives a sequential history). Indeterminate writes either
    /// took effect at their point or never did.
    fn from_model(steps: &[(u8, u32, u8)], spread: &[u64]) -> (Vec<Entry>, Vec<usize>) {
        let mut state: Option<String> = None;
        let mut entries = Vec::new();
        let mut reads = Vec::new();
        for (i, &(kind, process, outcome)) in steps.iter().enumerate() {
            let point = 1_000 * (i as u64 + 1);
            let s = spread.get(i).copied().unwrap_or(0);
            let (t0, t1) = (point.saturating_sub(s), point + s);
            if kind % 2 == 0 {
                let value = format!("v{i}");
                let outcome = match outcome % 4 {
                    0 => Outcome::Indeterminate,
                    1 => Outcome::Failed,
                    _ => Outcome::Ok,
                };
                // An indeterminate write took effect when `outcome` is even.
                if outcome == Outcome::Ok || (outcome == Outcome::Indeterminate && kind % 4 == 0) {
                    state = Some(value.clone());
                }
                entries.push(op(process, t0, t1, Op::Write { key: "k".into(), value }, outcome));
            } else {
                reads.push(entries.len());
                entries.push(r(process, t0, t1, state.as_deref()));
            }
        }
        (entries, reads)
    }

    proptest! {
        #[test]
        fn a_history_from_a_real_register_is_always_linearizable(
            steps in proptest::collection::vec((0u8..8, 0u32..4, 0u8..8), 1..60),
            spread in proptest::collection::vec(0u64..1_500, 60),
        ) {
            let (seq, _) = from_model(&steps, &[]);
            let v = verdict(seq);
            prop_assert_eq!(v.validity, Validity::Holds, "{:?}", v);
            // Widened intervals around the same points: still linearizable.
            let (conc, _) = from_model(&steps, &spread);
            let v = verdict(conc);
            prop_assert_eq!(v.validity, Validity::Holds, "{:?}", v);
        }

        #[test]
        fn a_sequential_read_of_any_other_value_is_caught(
            steps in proptest::collection::vec((0u8..8, 0u32..4, 2u8..4), 2..40),
            pick in any::<proptest::sample::Index>(),
            other in any::<proptest::sample::Index>(),
        ) {
            // Only ok operations: a sequential history has one order, so a
            // read that returns anything but the model's state is refuted.
            let (mut entries, reads) = from_model(&steps, &[]);
            prop_assume!(!reads.is_empty());
            let values: Vec<Option<String>> = std::iter::once(None)
                .chain(entries.iter().filter_map(|e| match e {
                    Entry::Op(Operation { op: Op::Write { value, .. }, .. }) => Some(Some(value.clone())),
                    _ => None,
                }))
                .collect();
            let at = reads[pick.index(reads.len())];
            let Entry::Op(o) = &mut entries[at] else { unreachable!() };
            let Op::Read { value, .. } = &mut o.op else { unreachable!() };
            let replacement = values[other.index(values.len())].clone();
            prop_assume!(replacement != *value);
            *value = replacement;
            let v = verdict(entries);
            prop_assert_eq!(v.validity, Validity::Violated);
        }
    }
}
