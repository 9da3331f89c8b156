//! The front's journal: the writes CoronaFS acknowledged that no FLUSH has
//! covered yet, in the order they were acknowledged, kept so they can be
//! written again on the new primary after a failover (which may have lost
//! them: a primary answers a write once it is local, before its replicas
//! have it). Pure: no I/O, no clock.
//!
//! A FLUSH covers every write acknowledged before it was sent, so the
//! front takes a [`Journal::mark`] before sending one and drops what it
//! covered ([`Journal::covered`]) when it succeeds. Replaying keeps the
//! order of overlapping operations ([`batches`]): a later write to a range
//! is never overtaken by an earlier one.

use bytes::Bytes;
use std::collections::VecDeque;

/// Bytes charged for an operation without data (bounds their count).
pub const OP_COST: u64 = 64;

/// One acknowledged operation that changes data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write {
        offset: u64,
        data: Bytes,
    },
    /// `NBD_CMD_WRITE_ZEROES` with its command flags (`NO_HOLE`, `FUA`).
    Zeroes {
        offset: u64,
        len: u32,
        flags: u16,
    },
    /// `NBD_CMD_TRIM` with its command flags (`FUA`).
    Trim {
        offset: u64,
        len: u32,
        flags: u16,
    },
}

impl Op {
    /// The byte range the operation changes, `[start, end)`.
    pub fn range(&self) -> (u64, u64) {
        let (offset, len) = match self {
            Op::Write { offset, data } => (*offset, data.len() as u64),
            Op::Zeroes { offset, len, .. } | Op::Trim { offset, len, .. } => (*offset, *len as u64),
        };
        (offset, offset.saturating_add(len))
    }

    /// What keeping it costs against the budget.
    pub fn cost(&self) -> u64 {
        match self {
            Op::Write { data, .. } => (data.len() as u64).max(OP_COST),
            _ => OP_COST,
        }
    }

    fn overlaps(&self, other: &Op) -> bool {
        let (a, b) = (self.range(), other.range());
        a.0 < b.1 && b.0 < a.1
    }
}

/// Acknowledged, unflushed operations, numbered in the order they were
/// acknowledged.
#[derive(Debug, Default)]
pub struct Journal {
    entries: VecDeque<(u64, Op)>,
    next: u64,
    bytes: u64,
}

impl Journal {
    /// Keeps `op`, acknowledged just now.
    pub fn record(&mut self, op: Op) {
        self.bytes += op.cost();
        self.entries.push_back((self.next, op));
        self.next += 1;
    }

    /// The point a FLUSH sent now covers: everything recorded so far.
    pub fn mark(&self) -> u64 {
        self.next
    }

    /// A FLUSH sent at `mark` succeeded: what was recorded before it is durable.
    pub fn covered(&mut self, mark: u64) {
        while let Some((seq, op)) = self.entries.front() {
            if *seq >= mark {
                break;
            }
            self.bytes -= op.cost();
            self.entries.pop_front();
        }
    }

    /// What is kept, counted as against the budget.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The kept operations, oldest first.
    pub fn ops(&self) -> Vec<Op> {
        self.entries.iter().map(|(_, op)| op.clone()).collect()
    }
}

/// Cuts `ops` (in order) into batches that may each be sent at once: no
/// two operations of a batch overlap, and a batch holds at most `max`
/// operations. Sending batch after batch keeps the order of every two
/// overlapping operations.
pub fn batches(ops: &[Op], max: usize) -> Vec<&[Op]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 0..ops.len() {
        let clash = i - start >= max.max(1) || ops[start..i].iter().any(|o| o.overlaps(&ops[i]));
        if clash {
            out.push(&ops[start..i]);
            start = i;
        }
    }
    if start < ops.len() {
        out.push(&ops[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn write(offset: u64, len: usize, fill: u8) -> Op {
        Op::Write { offset, data: Bytes::from(vec![fill; len]) }
    }

    #[test]
    fn a_flush_drops_what_was_recorded_before_its_mark_and_keeps_the_rest() {
        let mut j = Journal::default();
        j.record(write(0, 4096, 1));
        j.record(Op::Trim { offset: 8192, len: 4096, flags: 0 });
        let mark = j.mark();
        j.record(write(4096, 100, 2));
        assert_eq!((j.len(), j.bytes()), (3, 4096 + OP_COST + 100));
        j.covered(mark);
        assert_eq!(j.ops(), vec![write(4096, 100, 2)]);
        assert_eq!(j.bytes(), 100);
        // An older mark (a FLUSH sent earlier, answered later) changes nothing more.
        j.covered(mark - 1);
        assert_eq!(j.len(), 1);
        j.covered(j.mark());
        assert!(j.is_empty() && j.bytes() == 0);
    }

    #[test]
    fn overlapping_operations_go_to_later_batches_in_order() {
        let ops = vec![write(0, 10, 1), write(10, 10, 2), write(5, 10, 3), write(100, 1, 4), write(0, 1, 5)];
        let b = batches(&ops, 64);
        assert_eq!(b, vec![&ops[0..2], &ops[2..5]]);
        // Each overlaps the one before: one batch each.
        let ops = vec![write(0, 10, 1), write(5, 10, 3), write(6, 1, 5)];
        assert_eq!(batches(&ops, 64), vec![&ops[0..1], &ops[1..2], &ops[2..3]]);
        assert_eq!(batches(&ops[..0], 64), Vec::<&[Op]>::new());
        let many: Vec<Op> = (0..5).map(|i| write(i * 10, 10, 0)).collect();
        assert_eq!(batches(&many, 2).len(), 3);
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..64, 1usize..16, any::<u8>()).prop_map(|(o, l, f)| write(o, l, f)),
            (0u64..64, 1u32..16).prop_map(|(offset, len)| Op::Zeroes { offset, len, flags: 0 }),
            (0u64..64, 1u32..16).prop_map(|(offset, len)| Op::Trim { offset, len, flags: 0 }),
        ]
    }

    /// Applies `ops` to a 128-byte image (a trim reads as zeroes here).
    fn apply(img: &mut [u8], ops: &[Op]) {
        for op in ops {
            let (s, e) = op.range();
            match op {
                Op::Write { data, .. } => img[s as usize..e as usize].copy_from_slice(data),
                _ => img[s as usize..e as usize].fill(0),
            }
        }
    }

    proptest! {
        /// Against a model (the list of every recorded op with its number):
        /// the journal keeps exactly what the last covering mark left, in
        /// order, and its byte count is their cost.
        #[test]
        fn the_journal_keeps_exactly_the_ops_after_the_highest_covered_mark(
            steps in prop::collection::vec((arb_op(), any::<bool>(), any::<u8>()), 0..60)
        ) {
            let mut j = Journal::default();
            let mut all: Vec<(u64, Op)> = Vec::new();
            let mut marks = Vec::new();
            let mut floor = 0;
            for (op, flush, pick) in steps {
                all.push((j.mark(), op.clone()));
                j.record(op);
                if flush {
                    marks.push(j.mark());
                    let m = marks[pick as usize % marks.len()];
                    j.covered(m);
                    floor = floor.max(m);
                }
                let kept: Vec<Op> = all.iter().filter(|(s, _)| *s >= floor).map(|(_, o)| o.clone()).collect();
                prop_assert_eq!(j.bytes(), kept.iter().map(Op::cost).sum::<u64>());
                prop_assert_eq!(j.ops(), kept);
            }
        }

        /// Replaying batch after batch, each batch in any order, leaves the
        /// image the ops applied one by one leave.
        #[test]
        fn batches_replayed_in_any_inner_order_give_the_same_image(
            ops in prop::collection::vec(arb_op(), 0..40), max in 1usize..8, seed: u64
        ) {
            let mut want = vec![0xaa; 128];
            apply(&mut want, &ops);
            let mut got = vec![0xaa; 128];
            let mut n = 0;
            for (i, b) in batches(&ops, max).into_iter().enumerate() {
                prop_assert!(b.len() <= max && !b.is_empty());
                n += b.len();
                let mut shuffled = b.to_vec();
                if (seed >> (i % 64)) & 1 == 1 {
                    shuffled.reverse();
                }
                apply(&mut got, &shuffled);
            }
            prop_assert_eq!(n, ops.len());
            prop_assert_eq!(got, want);
        }
    }
}
