//! What a history is: the operations clients made, each with its invoke and
//! complete times on one monotonic clock, who made it, which endpoint served
//! it and what came of it, and the nemesis events between them. One
//! [`Entry`] per JSON line; pure (the recorder in the workloads writes them).

use serde::{Deserialize, Serialize};
use std::io::{self, BufRead, Write};

/// A point on the run's monotonic clock, in nanoseconds since the run began.
pub type Nanos = u64;

/// What came of an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Acknowledged: it happened, between invoke and complete.
    Ok,
    /// Definitely did not happen (connection refused, a 4xx answer).
    Failed,
    /// May or may not have happened (a 5xx, a timeout, the connection lost
    /// mid-request): its effect may land any time after invoke, or never.
    Indeterminate,
}

/// What a block read found, decoded by [`super::blocks::decode`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "content")]
pub enum BlockContent {
    /// Nothing was ever written there (all zeroes).
    Zero,
    /// One whole, intact write of this block.
    Written {
        /// The writer (process) that wrote it.
        writer: u32,
        /// That writer's sequence number for the write.
        seq: u64,
    },
    /// A whole, intact block that describes itself as another block's.
    Foreign {
        /// The block it says it belongs to.
        block: u64,
    },
    /// Our header, but the checksum does not match: parts of several writes.
    Torn,
    /// Neither zeroes nor one of our blocks.
    Unrecognised,
}

/// The operation itself; a read's field holds what it returned (meaningful
/// only when the outcome is [`Outcome::Ok`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "f")]
pub enum Op {
    /// Register write: PUT `value` to `key`. Values are unique per run.
    Write { key: String, value: String },
    /// Register read: GET `key`; `value` is `None` when the key was absent.
    Read { key: String, value: Option<String> },
    /// Set add: the element (an object key in `s3-set`).
    SetAdd { element: String },
    /// Set read of every element (a listing).
    SetRead { elements: Vec<String> },
    /// A self-describing block write; `fua` when it asked for Force Unit
    /// Access. `session` is the connection it went over (a client that
    /// reconnects starts a new one).
    BlockWrite {
        block: u64,
        seq: u64,
        fua: bool,
        #[serde(default)]
        session: u64,
    },
    /// A flush: every write of this process and session acknowledged before
    /// its invoke is durable once it is acknowledged.
    BlockFlush {
        #[serde(default)]
        session: u64,
    },
    /// A block read from `source` (the front, or one copy's export).
    BlockRead { block: u64, source: String, found: BlockContent },
}

impl Op {
    /// Does the operation change state (the availability checker's writes)?
    pub fn is_write(&self) -> bool {
        matches!(self, Op::Write { .. } | Op::SetAdd { .. } | Op::BlockWrite { .. })
    }
}

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Operation {
    /// The client (process) that made it; one operation at a time each.
    pub process: u32,
    /// The endpoint that served it (`127.0.0.1:9001`, `node02`).
    pub endpoint: String,
    /// When the client sent it.
    pub invoke: Nanos,
    /// When the client had its answer, or gave up on one.
    pub complete: Nanos,
    /// What it was.
    pub op: Op,
    /// What came of it.
    pub outcome: Outcome,
    /// Why it failed or is indeterminate, in a few words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A fault starting or ending.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NemesisEvent {
    /// When it happened.
    pub time: Nanos,
    /// The fault, in `bench --fault` form (`kill:lightningstor@node02`).
    pub fault: String,
    /// `start` (applied) or `heal` (healed).
    pub phase: NemesisPhase,
    /// What went wrong applying or healing it, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Whether a fault was applied or healed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NemesisPhase {
    Start,
    Heal,
}

/// One line of `history.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type")]
pub enum Entry {
    Op(Operation),
    Nemesis(NemesisEvent),
}

/// A whole history: the entries in the order they were recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct History {
    pub entries: Vec<Entry>,
}

impl History {
    /// Every client operation, in recording order.
    pub fn ops(&self) -> impl Iterator<Item = &Operation> {
        self.entries.iter().filter_map(|e| match e {
            Entry::Op(o) => Some(o),
            Entry::Nemesis(_) => None,
        })
    }

    /// Every nemesis event, in recording order.
    pub fn nemesis(&self) -> impl Iterator<Item = &NemesisEvent> {
        self.entries.iter().filter_map(|e| match e {
            Entry::Nemesis(n) => Some(n),
            Entry::Op(_) => None,
        })
    }

    /// Count of operations per outcome: (ok, failed, indeterminate).
    pub fn outcome_counts(&self) -> (usize, usize, usize) {
        self.ops().fold((0, 0, 0), |(o, f, i), op| match op.outcome {
            Outcome::Ok => (o + 1, f, i),
            Outcome::Failed => (o, f + 1, i),
            Outcome::Indeterminate => (o, f, i + 1),
        })
    }

    /// Writes the history as JSON lines.
    pub fn write_jsonl(&self, mut w: impl Write) -> io::Result<()> {
        for e in &self.entries {
            serde_json::to_writer(&mut w, e)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    }

    /// Reads JSON lines; blank lines are skipped, a bad line is an error
    /// naming its number.
    pub fn read_jsonl(r: impl BufRead) -> anyhow::Result<History> {
        let mut entries = Vec::new();
        for (i, line) in r.lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let e = serde_json::from_str(&line).map_err(|e| anyhow::anyhow!("history line {}: {e}", i + 1))?;
            entries.push(e);
        }
        Ok(History { entries })
    }
}

impl FromIterator<Entry> for History {
    fn from_iter<I: IntoIterator<Item = Entry>>(iter: I) -> Self {
        History { entries: iter.into_iter().collect() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op_strategy() -> impl Strategy<Value = Op> {
        prop_oneof![
            ("[a-c]", "[0-9]{1,4}").prop_map(|(key, value)| Op::Write { key, value }),
            ("[a-c]", proptest::option::of("[0-9]{1,4}")).prop_map(|(key, value)| Op::Read { key, value }),
            "[a-z0-9]{1,6}".prop_map(|element| Op::SetAdd { element }),
            proptest::collection::vec("[a-z]{1,3}", 0..4).prop_map(|elements| Op::SetRead { elements }),
            (0u64..9, 0u64..99, any::<bool>(), 0u64..3).prop_map(|(block, seq, fua, session)| Op::BlockWrite {
                block,
                seq,
                fua,
                session
            }),
            (0u64..3).prop_map(|session| Op::BlockFlush { session }),
            (0u64..9, "[a-z]{1,5}", 0u32..3, 0u64..9).prop_map(|(block, source, writer, seq)| Op::BlockRead {
                block,
                source,
                found: BlockContent::Written { writer, seq }
            }),
            (0u64..9, "[a-z]{1,5}").prop_map(|(block, source)| Op::BlockRead {
                block,
                source,
                found: BlockContent::Torn
            }),
        ]
    }

    fn entry_strategy() -> impl Strategy<Value = Entry> {
        let outcome = prop_oneof![Just(Outcome::Ok), Just(Outcome::Failed), Just(Outcome::Indeterminate)];
        prop_oneof![
            (
                0u32..4,
                "[a-z0-9:.]{1,12}",
                0u64..1000,
                0u64..1000,
                op_strategy(),
                outcome,
                proptest::option::of("[a-z ]{0,8}")
            )
                .prop_map(|(process, endpoint, invoke, d, op, outcome, error)| Entry::Op(Operation {
                    process,
                    endpoint,
                    invoke,
                    complete: invoke + d,
                    op,
                    outcome,
                    error
                })),
            (0u64..1000, "[a-z:@0-9]{1,20}", any::<bool>()).prop_map(|(time, fault, start)| Entry::Nemesis(
                NemesisEvent {
                    time,
                    fault,
                    phase: if start { NemesisPhase::Start } else { NemesisPhase::Heal },
                    error: None
                }
            )),
        ]
    }

    proptest! {
        #[test]
        fn a_history_reads_back_as_it_was_written(entries in proptest::collection::vec(entry_strategy(), 0..20)) {
            let h = History { entries };
            let mut buf = Vec::new();
            h.write_jsonl(&mut buf).expect("writes to a Vec");
            let back = History::read_jsonl(&buf[..]).expect("reads back");
            prop_assert_eq!(back, h);
        }
    }

    #[test]
    fn a_bad_line_is_an_error_naming_its_number() {
        let text = "\n{\"type\":\"nemesis\",\"time\":1,\"fault\":\"kill:x@y\",\"phase\":\"start\"}\nnot json\n";
        let err = History::read_jsonl(text.as_bytes()).expect_err("line 3 is not JSON").to_string();
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn outcomes_are_counted() {
        let mk = |outcome| {
            Entry::Op(Operation {
                process: 0,
                endpoint: "e".into(),
                invoke: 0,
                complete: 1,
                op: Op::BlockFlush { session: 0 },
                outcome,
                error: None,
            })
        };
        let h: History =
            [Outcome::Ok, Outcome::Ok, Outcome::Failed, Outcome::Indeterminate].map(mk).into_iter().collect();
        assert_eq!(h.outcome_counts(), (2, 1, 1));
    }
}
