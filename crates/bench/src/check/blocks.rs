//! Self-describing blocks and the blocks checker.
//!
//! Every block a writer writes says what it is: a magic, the block's index,
//! the writer, the writer's sequence number and a checksum over the rest, then
//! a payload derived from those three numbers. A read decodes it
//! ([`decode`]) into a [`BlockContent`]: zeroes, one intact write, an intact
//! block of another index (a misdirected write), a torn block (the header of
//! one write, the checksum wrong) or something else.
//!
//! A write is durable once it was acknowledged with FUA, or once a flush by
//! the same writer on the same session (connection), invoked after the
//! write was acknowledged, was. A read of
//! a block must then return a write that is not known older than any write
//! of that block durable before the read began (a write is known older than
//! another when it was acknowledged before the other was sent; an
//! indeterminate write is never known older). Reads made once every write of
//! the block has returned, and after the last fault was healed, must agree
//! across every source (the front and each copy's export).

use super::history::{BlockContent, History, Nanos, NemesisPhase, Op, Operation, Outcome};
use super::verdict::{Anomaly, Validity, Verdict};
use std::collections::{BTreeMap, HashMap};

/// The checker's name in reports.
pub const NAME: &str = "blocks";

const MAGIC: [u8; 8] = *b"BENCHBLK";
/// Bytes of the header at the start of every block.
pub const HEADER: usize = 40;

/// FNV-1a, 64 bits: enough to tell a torn block from an intact one.
fn checksum(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn fill_payload(buf: &mut [u8], block: u64, writer: u32, seq: u64) {
    // Each of the three numbers multiplied by its own odd constant, so that
    // no two (block, writer, seq) share a payload by a bit lost in mixing.
    let mut s = block.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ u64::from(writer).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ seq.wrapping_mul(0x1656_67b1_9e37_79f9).rotate_left(31)
        ^ 0x5851_f42d_4c95_7f2d;
    if s == 0 {
        s = 0x5851_f42d_4c95_7f2d;
    }
    for chunk in buf.chunks_mut(8) {
        let v = crate::loadgen::xorshift(&mut s).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// The block `writer` writes as its `seq`th write of block `block`, `size`
/// bytes long (at least [`HEADER`]).
pub fn encode(block: u64, writer: u32, seq: u64, size: usize) -> Vec<u8> {
    let mut b = vec![0u8; size.max(HEADER)];
    b[0..8].copy_from_slice(&MAGIC);
    b[8..16].copy_from_slice(&block.to_le_bytes());
    b[16..20].copy_from_slice(&writer.to_le_bytes());
    b[24..32].copy_from_slice(&seq.to_le_bytes());
    fill_payload(&mut b[HEADER..], block, writer, seq);
    let sum = checksum(&[&b[..32], &b[HEADER..]]);
    b[32..40].copy_from_slice(&sum.to_le_bytes());
    b
}

/// What the bytes read from block `block` are.
pub fn decode(block: u64, bytes: &[u8]) -> BlockContent {
    if bytes.iter().all(|&b| b == 0) {
        return BlockContent::Zero;
    }
    if bytes.len() < HEADER || bytes[0..8] != MAGIC {
        return BlockContent::Unrecognised;
    }
    let word = |r: std::ops::Range<usize>| {
        let mut a = [0u8; 8];
        a[..r.len()].copy_from_slice(&bytes[r]);
        u64::from_le_bytes(a)
    };
    let (own, writer, seq, sum) = (word(8..16), word(16..20) as u32, word(24..32), word(32..40));
    if checksum(&[&bytes[..32], &bytes[HEADER..]]) != sum || word(20..24) != 0 {
        return BlockContent::Torn;
    }
    if own != block {
        return BlockContent::Foreign { block: own };
    }
    BlockContent::Written { writer, seq }
}

/// When each acknowledged write became durable (FUA, or a later flush).
fn durable_at(writes: &[&Operation], flushes: &HashMap<u32, Vec<&Operation>>) -> Vec<Option<Nanos>> {
    writes
        .iter()
        .map(|w| {
            if w.outcome != Outcome::Ok {
                return None;
            }
            let session = match w.op {
                Op::BlockWrite { fua: true, .. } => return Some(w.complete),
                Op::BlockWrite { session, .. } => session,
                _ => return None,
            };
            let f = flushes.get(&w.process)?;
            // The earliest acknowledgement of a flush on the same session
            // sent after the write returned.
            f.iter()
                .filter(|f| f.invoke >= w.complete && matches!(f.op, Op::BlockFlush { session: s } if s == session))
                .map(|f| f.complete)
                .min()
        })
        .collect()
}

/// Checks the history's block operations.
pub fn check(history: &History) -> Verdict {
    let mut writes: BTreeMap<u64, Vec<&Operation>> = BTreeMap::new();
    let mut reads: BTreeMap<u64, Vec<&Operation>> = BTreeMap::new();
    let mut flushes: HashMap<u32, Vec<&Operation>> = HashMap::new();
    for o in history.ops() {
        match &o.op {
            Op::BlockWrite { block, .. } => writes.entry(*block).or_default().push(o),
            Op::BlockRead { block, .. } if o.outcome == Outcome::Ok => reads.entry(*block).or_default().push(o),
            Op::BlockFlush { .. } if o.outcome == Outcome::Ok => flushes.entry(o.process).or_default().push(o),
            _ => {}
        }
    }
    for f in flushes.values_mut() {
        f.sort_by_key(|f| f.invoke);
    }
    let last_heal = history.nemesis().filter(|n| n.phase == NemesisPhase::Heal).map(|n| n.time).max().unwrap_or(0);
    let mut anomalies = Vec::new();
    let mut read_count = 0;
    for (&block, rs) in &reads {
        let ws = writes.get(&block).map(Vec::as_slice).unwrap_or(&[]);
        let durable = durable_at(ws, &flushes);
        let quiet_after = ws.iter().map(|w| w.complete).max().unwrap_or(0).max(last_heal);
        let mut settled: Vec<&Operation> = Vec::new();
        for r in rs {
            read_count += 1;
            if let Some(a) = check_read(block, ws, &durable, r) {
                anomalies.push(a);
            }
            if r.invoke > quiet_after {
                settled.push(r);
            }
        }
        if let Some(a) = copies_differ(block, &settled) {
            anomalies.push(a);
        }
    }
    let detail = format!(
        "{read_count} reads of {} blocks, {} writes",
        reads.len(),
        writes.values().map(Vec::len).sum::<usize>()
    );
    let otherwise = if read_count == 0 { Validity::Unknown } else { Validity::Holds };
    Verdict::from_anomalies(NAME, otherwise, detail, anomalies)
}

fn found_of(r: &Operation) -> (&BlockContent, &str) {
    match &r.op {
        Op::BlockRead { found, source, .. } => (found, source),
        _ => (&BlockContent::Unrecognised, ""),
    }
}

fn check_read(block: u64, ws: &[&Operation], durable: &[Option<Nanos>], r: &Operation) -> Option<Anomaly> {
    let (found, source) = found_of(r);
    let subject = Some(format!("block {block}"));
    let one = |kind: &str, why: String| Some(Anomaly::new(kind, subject.clone(), why, vec![r.clone()]));
    // The newest write (by invoke) durable before the read began.
    let newest_durable = ws
        .iter()
        .zip(durable)
        .filter(|(_, d)| d.is_some_and(|d| d < r.invoke))
        .max_by_key(|(w, _)| w.invoke)
        .map(|(w, _)| *w);
    let seen = match found {
        BlockContent::Torn => return one("torn-block", format!("block {block} read from {source} is torn")),
        BlockContent::Unrecognised => {
            return one("unrecognised-block", format!("block {block} read from {source} is not one of ours"));
        }
        BlockContent::Foreign { block: other } => {
            return one("foreign-block", format!("block {block} read from {source} holds block {other}"));
        }
        BlockContent::Zero => None,
        BlockContent::Written { writer, seq } => {
            let w =
                ws.iter().find(|w| w.process == *writer && matches!(w.op, Op::BlockWrite { seq: s, .. } if s == *seq));
            let Some(w) = w else {
                return one(
                    "never-written",
                    format!("block {block} from {source} holds writer {writer}'s write {seq}, never made"),
                );
            };
            if w.outcome == Outcome::Failed || w.invoke > r.complete {
                let why = format!("block {block} from {source} holds a write that failed or was not yet sent");
                return Some(Anomaly::new("impossible-write-visible", subject, why, vec![(*w).clone(), r.clone()]));
            }
            Some(*w)
        }
    };
    let d = newest_durable?;
    let stale = match seen {
        None => true,
        Some(w) => w.outcome == Outcome::Ok && d.invoke > w.complete,
    };
    if !stale {
        return None;
    }
    let why = format!("block {block} from {source} is older than a write flushed before the read began");
    let mut window = vec![d.clone(), r.clone()];
    window.extend(seen.cloned());
    Some(Anomaly::new("lost-flushed-write", subject, why, window))
}

fn copies_differ(block: u64, settled: &[&Operation]) -> Option<Anomaly> {
    let mut firsts: Vec<&Operation> = Vec::new();
    for r in settled {
        if !firsts.iter().any(|f| found_of(f).0 == found_of(r).0) {
            firsts.push(r);
        }
    }
    if firsts.len() < 2 {
        return None;
    }
    let sources: Vec<String> = firsts.iter().map(|r| format!("{} {:?}", found_of(r).1, found_of(r).0)).collect();
    let why = format!("after healing, block {block} differs between sources: {}", sources.join("; "));
    Some(Anomaly::new("copies-differ", Some(format!("block {block}")), why, firsts.into_iter().cloned().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::{Entry, NemesisEvent};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn an_encoded_block_decodes_to_its_write(block in any::<u64>(), writer in any::<u32>(), seq in any::<u64>(), size in 40usize..5000) {
            prop_assert_eq!(decode(block, &encode(block, writer, seq, size)), BlockContent::Written { writer, seq });
        }

        #[test]
        fn a_block_made_of_two_writes_is_torn(seq in 0u64..1000, cut in 41usize..4095) {
            let (a, b) = (encode(3, 1, seq, 4096), encode(3, 1, seq + 1, 4096));
            let mut torn = a[..cut].to_vec();
            torn.extend_from_slice(&b[cut..]);
            prop_assert_eq!(decode(3, &torn), BlockContent::Torn);
        }
    }

    #[test]
    fn zeroes_misdirected_and_garbage_blocks_are_told_apart() {
        assert_eq!(decode(0, &[0; 4096]), BlockContent::Zero);
        assert_eq!(decode(5, &encode(6, 0, 0, 4096)), BlockContent::Foreign { block: 6 });
        assert_eq!(decode(5, &[7; 4096]), BlockContent::Unrecognised);
        let mut half = encode(5, 0, 0, 4096);
        half[..2048].fill(0);
        assert_eq!(decode(5, &half), BlockContent::Unrecognised);
    }

    fn op(process: u32, invoke: Nanos, complete: Nanos, op: Op, outcome: Outcome) -> Entry {
        Entry::Op(Operation { process, endpoint: "front".into(), invoke, complete, op, outcome, error: None })
    }
    fn write(p: u32, t: Nanos, seq: u64, fua: bool, outcome: Outcome) -> Entry {
        op(p, t, t + 1, Op::BlockWrite { block: 0, seq, fua, session: 0 }, outcome)
    }
    fn flush(p: u32, t: Nanos) -> Entry {
        op(p, t, t + 1, Op::BlockFlush { session: 0 }, Outcome::Ok)
    }
    fn read(t: Nanos, source: &str, found: BlockContent) -> Entry {
        op(9, t, t + 1, Op::BlockRead { block: 0, source: source.into(), found }, Outcome::Ok)
    }
    fn kinds(entries: Vec<Entry>) -> Vec<String> {
        check(&History { entries }).anomalies.into_iter().map(|a| a.kind).collect()
    }
    const fn wr(writer: u32, seq: u64) -> BlockContent {
        BlockContent::Written { writer, seq }
    }

    #[test]
    fn the_last_flushed_write_read_from_every_copy_holds() {
        let v = check(&History {
            entries: vec![
                write(0, 0, 1, false, Outcome::Ok),
                write(0, 2, 2, false, Outcome::Ok),
                flush(0, 4),
                read(10, "front", wr(0, 2)),
                read(12, "copy1", wr(0, 2)),
            ],
        });
        assert_eq!(v.validity, Validity::Holds, "{v:?}");
    }

    #[test]
    fn an_unflushed_write_may_be_lost() {
        let e = vec![
            write(0, 0, 1, false, Outcome::Ok),
            flush(0, 2),
            write(0, 4, 2, false, Outcome::Ok),
            read(10, "front", wr(0, 1)),
        ];
        assert!(kinds(e).is_empty());
    }

    #[test]
    fn a_block_older_than_its_flushed_write_is_caught() {
        let e = vec![
            write(0, 0, 1, false, Outcome::Ok),
            write(0, 2, 2, false, Outcome::Ok),
            flush(0, 4),
            read(10, "front", wr(0, 1)),
        ];
        assert_eq!(kinds(e), ["lost-flushed-write"]);
        let e = vec![write(0, 0, 1, true, Outcome::Ok), read(10, "front", BlockContent::Zero)];
        assert_eq!(kinds(e), ["lost-flushed-write"]);
    }

    #[test]
    fn a_flush_covers_only_writes_acknowledged_before_it_was_sent() {
        // The flush was sent while write 2 was in flight: write 2 is not durable.
        let e = vec![
            write(0, 0, 1, true, Outcome::Ok),
            op(0, 2, 20, Op::BlockWrite { block: 0, seq: 2, fua: false, session: 0 }, Outcome::Ok),
            flush(0, 5),
            read(30, "front", wr(0, 1)),
        ];
        assert!(kinds(e).is_empty());
    }

    #[test]
    fn a_flush_on_a_new_connection_does_not_cover_writes_of_the_old_one() {
        let w2 = op(0, 2, 3, Op::BlockWrite { block: 0, seq: 2, fua: false, session: 0 }, Outcome::Ok);
        let new_conn_flush = op(0, 5, 6, Op::BlockFlush { session: 1 }, Outcome::Ok);
        let e = vec![write(0, 0, 1, true, Outcome::Ok), w2.clone(), new_conn_flush, read(30, "front", wr(0, 1))];
        assert!(kinds(e).is_empty());
        let same_conn_flush = op(0, 5, 6, Op::BlockFlush { session: 0 }, Outcome::Ok);
        let e = vec![write(0, 0, 1, true, Outcome::Ok), w2, same_conn_flush, read(30, "front", wr(0, 1))];
        assert_eq!(kinds(e), ["lost-flushed-write"]);
    }

    #[test]
    fn an_indeterminate_write_that_lands_later_is_not_stale() {
        let e = vec![
            write(0, 0, 1, false, Outcome::Indeterminate),
            write(1, 5, 2, true, Outcome::Ok),
            read(10, "front", wr(0, 1)),
        ];
        assert!(kinds(e).is_empty());
    }

    #[test]
    fn torn_foreign_and_impossible_blocks_are_caught() {
        assert_eq!(kinds(vec![read(0, "front", BlockContent::Torn)]), ["torn-block"]);
        assert_eq!(kinds(vec![read(0, "front", BlockContent::Foreign { block: 9 })]), ["foreign-block"]);
        assert_eq!(kinds(vec![read(0, "front", wr(0, 7))]), ["never-written"]);
        assert_eq!(
            kinds(vec![write(0, 0, 1, false, Outcome::Failed), read(5, "front", wr(0, 1))]),
            ["impossible-write-visible"]
        );
    }

    #[test]
    fn copies_that_differ_after_healing_are_caught() {
        let heal = Entry::Nemesis(NemesisEvent {
            time: 8,
            fault: "kill:coronafs@n1".into(),
            phase: NemesisPhase::Heal,
            error: None,
        });
        let e = vec![
            write(0, 0, 1, false, Outcome::Ok),
            write(0, 2, 2, false, Outcome::Ok),
            heal,
            read(10, "copy0", wr(0, 2)),
            read(11, "copy1", wr(0, 1)),
        ];
        assert_eq!(kinds(e), ["copies-differ"]);
    }
}
