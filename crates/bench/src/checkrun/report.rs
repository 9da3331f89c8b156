//! `check.json` and `check.md`: per workload, the operations by outcome, the
//! faults applied, each checker's verdict and the anomalies with their
//! windows. Pure: built from a history and verdicts, rendered to text.

use crate::check::availability::Availability;
use crate::check::history::{History, NemesisPhase, Op, Operation, Outcome};
use crate::check::verdict::{Validity, Verdict};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// Operations by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpCounts {
    pub ok: usize,
    pub failed: usize,
    pub indeterminate: usize,
}

/// One fault as it was applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultApplied {
    pub fault: String,
    /// Milliseconds from the start of the run.
    pub start_ms: f64,
    /// When it was healed (None: never healed in the history).
    pub heal_ms: Option<f64>,
    /// What went wrong applying or healing it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// One workload's run and verdicts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadReport {
    pub workload: String,
    /// What was checked (`embedded LightningStor, 3 nodes` or the URI).
    pub target: String,
    pub seed: u64,
    pub duration_s: f64,
    pub clients: usize,
    pub keys: usize,
    /// The nemesis kinds asked for.
    pub nemesis: Vec<String>,
    pub ops: OpCounts,
    /// Faults whose start succeeded.
    pub faults_applied: usize,
    pub faults: Vec<FaultApplied>,
    pub verdicts: Vec<Verdict>,
    pub availability: Availability,
    /// The worst verdict.
    pub validity: Validity,
    /// The command that replays the run (same seed, same schedule).
    pub replay: String,
    /// Notes on the run (endpoints that never came back, a full history).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// `check.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub workloads: Vec<WorkloadReport>,
}

impl Report {
    /// The worst verdict of every workload.
    pub fn validity(&self) -> Validity {
        self.workloads.iter().fold(Validity::Holds, |v, w| v.worst(w.validity))
    }

    /// 0 when every check holds, 1 on a violation, 2 when a check could not
    /// decide (and none found a violation).
    pub fn exit_code(&self) -> i32 {
        match self.validity() {
            Validity::Holds => 0,
            Validity::Violated => 1,
            Validity::Unknown => 2,
        }
    }
}

/// Op counts of a history.
pub fn counts(h: &History) -> OpCounts {
    let (ok, failed, indeterminate) = h.outcome_counts();
    OpCounts { ok, failed, indeterminate }
}

/// The faults of a history, start paired with the next heal of the same fault.
pub fn faults(h: &History) -> Vec<FaultApplied> {
    let ms = |t: u64| t as f64 / 1e6;
    let mut out: Vec<FaultApplied> = Vec::new();
    for n in h.nemesis() {
        match n.phase {
            NemesisPhase::Start => out.push(FaultApplied {
                fault: n.fault.clone(),
                start_ms: ms(n.time),
                heal_ms: None,
                errors: n.error.iter().cloned().collect(),
            }),
            NemesisPhase::Heal => {
                if let Some(f) = out.iter_mut().rev().find(|f| f.fault == n.fault && f.heal_ms.is_none()) {
                    f.heal_ms = Some(ms(n.time));
                    f.errors.extend(n.error.iter().cloned());
                }
            }
        }
    }
    out
}

fn op_text(op: &Op) -> String {
    match op {
        Op::SetRead { elements } => format!("set read ({} elements)", elements.len()),
        Op::SetAdd { element } => format!("add {element}"),
        Op::Write { key, value } => format!("write {key} = {value}"),
        Op::Read { key, value: Some(v) } => format!("read {key} -> {v}"),
        Op::Read { key, value: None } => format!("read {key} -> (absent)"),
        Op::BlockWrite { block, seq, fua, .. } => {
            format!("write block {block} seq {seq}{}", if *fua { " FUA" } else { "" })
        }
        Op::BlockFlush { session } => format!("flush (connection {session})"),
        Op::BlockRead { block, source, found } => format!("read block {block} from {source}: {found:?}"),
    }
}

fn outcome_text(o: &Operation) -> String {
    let word = match o.outcome {
        Outcome::Ok => "ok",
        Outcome::Failed => "failed",
        Outcome::Indeterminate => "indeterminate",
    };
    match &o.error {
        Some(e) => format!("{word} ({e})"),
        None => word.into(),
    }
}

/// Most operations of one window shown in `check.md` (check.json has all).
const WINDOW_ROWS: usize = 30;

/// `check.md`.
pub fn markdown(r: &Report) -> String {
    let mut s = String::from("# bench check\n\n");
    for w in &r.workloads {
        let _ = writeln!(s, "## {}: {}\n", w.workload, w.validity.as_str());
        let keys = if w.keys > 0 { format!(", {} keys", w.keys) } else { String::new() };
        let _ = writeln!(
            s,
            "Target: {}. Seed {}, {:.0} s, {} clients{keys}, nemesis {}.\n",
            w.target,
            w.seed,
            w.duration_s,
            w.clients,
            if w.nemesis.is_empty() { "none".into() } else { w.nemesis.join(",") }
        );
        let _ = writeln!(s, "Replay: `{}`\n", w.replay);
        let _ = writeln!(
            s,
            "| ops ok | failed | indeterminate | faults applied | availability |\n|---:|---:|---:|---:|---:|\n| {} | {} | {} | {} | {:.0}% of {} windows of {} ms |\n",
            w.ops.ok,
            w.ops.failed,
            w.ops.indeterminate,
            w.faults_applied,
            w.availability.fraction * 100.0,
            w.availability.windows,
            w.availability.window_ns / 1_000_000
        );
        if !w.faults.is_empty() {
            s.push_str("| fault | start (ms) | healed (ms) | errors |\n|---|---:|---:|---|\n");
            for f in &w.faults {
                let heal = f.heal_ms.map_or("-".into(), |h| format!("{h:.0}"));
                let _ = writeln!(s, "| {} | {:.0} | {heal} | {} |", f.fault, f.start_ms, f.errors.join("; "));
            }
            s.push('\n');
        }
        s.push_str("| checker | verdict | anomalies | detail |\n|---|---|---:|---|\n");
        for v in &w.verdicts {
            let _ = writeln!(s, "| {} | {} | {} | {} |", v.checker, v.validity.as_str(), v.anomaly_count, v.detail);
        }
        s.push('\n');
        for n in &w.notes {
            let _ = writeln!(s, "- {n}");
        }
        if !w.notes.is_empty() {
            s.push('\n');
        }
        for v in w.verdicts.iter().filter(|v| !v.anomalies.is_empty()) {
            let _ = writeln!(s, "### {} anomalies ({} of {} shown)\n", v.checker, v.anomalies.len(), v.anomaly_count);
            for a in &v.anomalies {
                let subject = a.subject.as_deref().map(|x| format!(" ({x})")).unwrap_or_default();
                let _ = writeln!(s, "**{}**{subject}: {}\n", a.kind, a.explanation);
                s.push_str("| process | endpoint | invoke (ms) | complete (ms) | operation | outcome |\n|---:|---|---:|---:|---|---|\n");
                for o in a.window.iter().take(WINDOW_ROWS) {
                    let _ = writeln!(
                        s,
                        "| {} | {} | {:.3} | {:.3} | {} | {} |",
                        o.process,
                        o.endpoint,
                        o.invoke as f64 / 1e6,
                        o.complete as f64 / 1e6,
                        op_text(&o.op),
                        outcome_text(o)
                    );
                }
                if a.window.len() > WINDOW_ROWS {
                    let _ = writeln!(s, "\n({} more operations in check.json)", a.window.len() - WINDOW_ROWS);
                }
                s.push('\n');
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::history::{Entry, NemesisEvent};
    use crate::check::verdict::Anomaly;

    fn sample(validity: Validity) -> WorkloadReport {
        let stale = Operation {
            process: 1,
            endpoint: "n2".into(),
            invoke: 5_000_000,
            complete: 6_000_000,
            op: Op::Read { key: "r0".into(), value: Some("0-1".into()) },
            outcome: Outcome::Ok,
            error: None,
        };
        let v = Verdict::from_anomalies(
            "read-your-writes",
            Validity::Holds,
            "1 ok reads".into(),
            if validity == Validity::Violated {
                vec![Anomaly::new("stale-read", Some("r0".into()), "stale".into(), vec![stale])]
            } else {
                vec![]
            },
        );
        WorkloadReport {
            workload: "s3-register".into(),
            target: "embedded".into(),
            seed: 3,
            duration_s: 20.0,
            clients: 2,
            keys: 1,
            nemesis: vec!["kill".into()],
            ops: OpCounts { ok: 1, failed: 0, indeterminate: 0 },
            faults_applied: 1,
            faults: vec![],
            verdicts: vec![v],
            availability: Availability { window_ns: 1_000_000_000, windows: 1, with_write: 1, fraction: 1.0 },
            validity,
            replay: "bench check s3-register --seed 3".into(),
            notes: vec![],
        }
    }

    #[test]
    fn the_exit_code_follows_the_worst_verdict() {
        let r = |v: Vec<Validity>| Report { workloads: v.into_iter().map(sample).collect() };
        assert_eq!(r(vec![Validity::Holds]).exit_code(), 0);
        assert_eq!(r(vec![Validity::Holds, Validity::Unknown]).exit_code(), 2);
        assert_eq!(r(vec![Validity::Unknown, Validity::Violated]).exit_code(), 1);
    }

    #[test]
    fn the_markdown_shows_verdicts_anomalies_and_the_replay() {
        let md = markdown(&Report { workloads: vec![sample(Validity::Violated)] });
        assert!(md.contains("## s3-register: violated"), "{md}");
        assert!(md.contains("| read-your-writes | violated | 1 |"), "{md}");
        assert!(md.contains("**stale-read** (r0)"), "{md}");
        assert!(md.contains("| 1 | n2 | 5.000 | 6.000 | read r0 -> 0-1 | ok |"), "{md}");
        assert!(md.contains("Replay: `bench check s3-register --seed 3`"), "{md}");
    }

    #[test]
    fn faults_pair_each_start_with_its_heal() {
        let ev = |t, phase| {
            Entry::Nemesis(NemesisEvent { time: t, fault: "kill:lightningstor@n1".into(), phase, error: None })
        };
        let h = History {
            entries: vec![
                ev(1_000_000, NemesisPhase::Start),
                ev(3_000_000, NemesisPhase::Heal),
                ev(5_000_000, NemesisPhase::Start),
            ],
        };
        let f = faults(&h);
        assert_eq!(f.len(), 2);
        assert_eq!((f[0].start_ms, f[0].heal_ms), (1.0, Some(3.0)));
        assert_eq!(f[1].heal_ms, None);
    }
}
