//! The "CoronaFS failover" row: a volume with several copies, a client
//! writing and FLUSHing through PlasmaVMC's reconnecting attachment, the
//! primary stopped abruptly under it. Reported: the I/O pause, the time
//! until the client reconnected, the new primary and its epoch, the writes
//! flushed before and after the stop, and flushed writes lost (any makes
//! the row FAILED).
//!
//! - [`writer`]: the client (each block carries its write's sequence number);
//! - [`measure`]: where the cluster comes from, the stop, the read-back;
//! - here: the row's types, the pure arithmetic on the client's record, and
//!   the markdown.

pub mod measure;
pub mod writer;

use crate::stats::Summary;
use serde::Serialize;
use std::fmt::Write;
use writer::{Ack, FlushMark};

/// One failover: a primary stopped under the writing client.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Trial {
    pub volume: String,
    /// The node that was stopped.
    pub old_primary: String,
    /// The node that serves the volume afterwards (None: not found).
    pub new_primary: Option<String>,
    /// The epoch the client attached with, and the one it ended at.
    pub epoch_before: u64,
    pub epoch_after: u64,
    /// From the last write acknowledged on the connection to the old
    /// primary to the first acknowledged on the new connection.
    pub io_pause_s: Option<f64>,
    /// From the stop to the attachment's reconnect (polled every 5 ms).
    pub reconnect_s: Option<f64>,
    /// From the stop to the first write acknowledged on the new connection.
    pub stop_to_first_write_s: Option<f64>,
    /// How long the stop itself took (the kill call returning).
    pub stop_call_s: f64,
    pub writes_acked: u64,
    /// Writes acknowledged and then covered by a FLUSH that succeeded on
    /// the connection to the old primary.
    pub writes_flushed_before: u64,
    /// The same on the new connection.
    pub writes_flushed_after: u64,
    /// Blocks read back (each holding the last flushed write to it).
    pub blocks_checked: u64,
    /// Blocks whose flushed write (or a later one) was not found.
    pub lost_flushed_writes: u64,
    /// The first few of them.
    pub lost: Vec<String>,
    pub reconnects: u64,
    /// FLUSHes answered EIO (retried until one succeeded).
    pub flush_eio: u64,
    /// Why the trial did not complete (the client stopped, did not resume,
    /// the read-back failed).
    pub error: Option<String>,
    /// What happened around it (the restart of the stopped node, clean-up).
    pub notes: Vec<String>,
}

impl Trial {
    /// Completed, with nothing flushed lost.
    pub fn passed(&self) -> bool {
        self.error.is_none() && self.lost_flushed_writes == 0 && self.new_primary.is_some()
    }
}

/// The row.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// Every trial passed: resumed, a new primary, no flushed write lost.
    pub passed: bool,
    pub copies: usize,
    pub write_quorum: usize,
    pub heartbeat_ms: u64,
    pub failover_after_ms: u64,
    /// How the primary was stopped.
    pub stopped_by: String,
    /// What links the nodes and the client (loopback or a network).
    pub path: String,
    /// What the nodes are (child processes, containers).
    pub nodes: String,
    /// What the client does.
    pub client: String,
    /// Over the trials that resumed.
    pub io_pause_s: Option<Summary>,
    pub reconnect_s: Option<Summary>,
    pub trials: Vec<Trial>,
}

impl Failover {
    /// The row from its trials; the figures summarise the trials that resumed.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        copies: usize,
        write_quorum: usize,
        heartbeat_ms: u64,
        failover_after_ms: u64,
        stopped_by: String,
        path: String,
        nodes: String,
        trials: Vec<Trial>,
    ) -> Failover {
        let sum = |f: fn(&Trial) -> Option<f64>| {
            let v: Vec<f64> = trials.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| Summary::of(&v))
        };
        Failover {
            passed: !trials.is_empty() && trials.iter().all(Trial::passed),
            copies,
            write_quorum,
            heartbeat_ms,
            failover_after_ms,
            stopped_by,
            path,
            nodes,
            client: writer::describe(),
            io_pause_s: sum(|t| t.io_pause_s),
            reconnect_s: sum(|t| t.reconnect_s),
            trials,
        }
    }

    /// `ok` or `FAILED` with the reason, for the report.
    pub fn verdict(&self) -> String {
        let lost: u64 = self.trials.iter().map(|t| t.lost_flushed_writes).sum();
        let n = crate::text::count(self.trials.len(), "failover");
        if self.passed {
            return format!("ok: 0 flushed writes lost in {n}");
        }
        let mut why = Vec::new();
        if self.trials.is_empty() {
            why.push("no failover was run".to_owned());
        }
        if lost > 0 {
            why.push(format!("{} lost", crate::text::count(lost as usize, "flushed write")));
        }
        for (i, t) in self.trials.iter().enumerate() {
            if let Some(e) = &t.error {
                why.push(format!("failover {}: {e}", i + 1));
            } else if t.new_primary.is_none() {
                why.push(format!("failover {}: no node serves the volume as its primary", i + 1));
            }
        }
        format!("**FAILED** ({n}): {}", why.join("; "))
    }
}

/// The I/O pause around a stop at `stop_s`, from the client's acks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pause {
    /// Last ack on the connection the client had at the stop.
    pub last_before_s: f64,
    /// First ack on a later connection.
    pub first_after_s: f64,
}

impl Pause {
    pub fn io_pause_s(&self) -> f64 {
        self.first_after_s - self.last_before_s
    }
}

/// The connection (count of reconnects) the client had at `stop_s`: that
/// of the last ack at or before it.
pub fn conn_at(acks: &[Ack], stop_s: f64) -> u64 {
    acks.iter().take_while(|a| a.t_s <= stop_s).last().map_or(0, |a| a.conn)
}

/// From the last ack on the connection the client had at the stop to the
/// first ack on a later one; None when no write was acknowledged on a
/// later connection. Acks on the old connection after `stop_s` (answers
/// already under way when the stop was issued) count as before. Pure.
pub fn pause(acks: &[Ack], stop_s: f64) -> Option<Pause> {
    let c0 = conn_at(acks, stop_s);
    let first = acks.iter().find(|a| a.conn > c0)?;
    let last = acks.iter().take_while(|a| a.conn <= c0).last()?;
    Some(Pause { last_before_s: last.t_s, first_after_s: first.t_s })
}

/// Writes flushed on connection `c0` (or earlier), and after it. Pure.
pub fn flushed_split(flushes: &[FlushMark], c0: u64) -> (u64, u64) {
    let before = flushes.iter().filter(|f| f.conn <= c0).map(|f| f.durable).max().unwrap_or(0);
    let total = flushes.iter().map(|f| f.durable).max().unwrap_or(0);
    (before, total - before)
}

fn secs(x: Option<f64>) -> String {
    x.map_or("n/a".into(), |s| format!("{s:.2} s"))
}

fn fig(s: &Option<Summary>) -> String {
    match s {
        None => "n/a".into(),
        Some(s) if s.n > 1 => format!("{:.2} s [{:.2}..{:.2}, n={}]", s.median, s.min, s.max, s.n),
        Some(s) => format!("{:.2} s [spread n/a, n=1]", s.median),
    }
}

/// The row's markdown: a heading, the conditions, the figures and a line per failover.
pub fn markdown(s: &mut String, sec: &super::Section<Failover>) {
    let _ = writeln!(s, "Failover of a replicated volume (CoronaFS):\n");
    let f = match sec {
        super::Section::NotAvailable { reason } => {
            let _ = writeln!(s, "_Not measured: {reason}._\n");
            return;
        }
        super::Section::Measured(f) => f,
    };
    let _ = writeln!(
        s,
        "A volume with {} copies (write quorum {}); {}. The primary is stopped by {}. After the client stops, every block a successful FLUSH covered is read back through the new primary: each must hold its flushed write or a later one. **Conditions:** heartbeat_ms {}, failover_after_ms {}; {}; {}.\n",
        f.copies, f.write_quorum, f.client, f.stopped_by, f.heartbeat_ms, f.failover_after_ms, f.nodes, f.path
    );
    let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
    let _ = writeln!(s, "| Verdict | {} |", f.verdict());
    let _ = writeln!(
        s,
        "| I/O pause (last write acknowledged by the old primary to the first by the new) | {} |",
        fig(&f.io_pause_s)
    );
    let _ = writeln!(s, "| Stop to the client's reconnect (polled every 5 ms) | {} |\n", fig(&f.reconnect_s));
    let _ = writeln!(
        s,
        "| Failover | Stopped | New primary (epoch) | I/O pause | Reconnect | Writes flushed before / after | Blocks read back | Lost flushed writes |\n|---|---|---|---:|---:|---:|---:|---:|"
    );
    for (i, t) in f.trials.iter().enumerate() {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} / {} | {} | {} |",
            i + 1,
            t.old_primary,
            t.new_primary
                .as_ref()
                .map_or("none found".to_owned(), |p| format!("{p} ({} -> {})", t.epoch_before, t.epoch_after)),
            secs(t.io_pause_s),
            secs(t.reconnect_s),
            t.writes_flushed_before,
            t.writes_flushed_after,
            t.blocks_checked,
            if t.lost_flushed_writes == 0 { "0".to_owned() } else { format!("**{}**", t.lost_flushed_writes) }
        );
    }
    s.push('\n');
    for (i, t) in f.trials.iter().enumerate() {
        for l in &t.lost {
            let _ = writeln!(s, "- failover {}: lost: {l}", i + 1);
        }
        if let Some(e) = &t.error {
            let _ = writeln!(s, "- failover {}: {e}", i + 1);
        }
        for n in &t.notes {
            let _ = writeln!(s, "- failover {}: {n}", i + 1);
        }
    }
    if f.trials.iter().any(|t| !t.lost.is_empty() || t.error.is_some() || !t.notes.is_empty()) {
        s.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acks(v: &[(f64, u64)]) -> Vec<Ack> {
        v.iter().map(|&(t_s, conn)| Ack { t_s, conn }).collect()
    }

    #[test]
    fn the_pause_runs_from_the_last_ack_on_the_old_connection_to_the_first_on_the_new() {
        let a = acks(&[(0.1, 0), (0.2, 0), (0.95, 0), (2.6, 1), (2.7, 1)]);
        let p = pause(&a, 1.0).expect("resumed");
        assert_eq!((p.last_before_s, p.first_after_s), (0.95, 2.6));
        assert!((p.io_pause_s() - 1.65).abs() < 1e-12);
    }

    #[test]
    fn an_answer_already_under_way_at_the_stop_counts_as_before_it() {
        // Acked on the old connection 10 ms after the stop was issued.
        let a = acks(&[(0.9, 0), (1.01, 0), (3.0, 1)]);
        assert_eq!(pause(&a, 1.0).expect("resumed").last_before_s, 1.01);
    }

    #[test]
    fn no_ack_on_a_new_connection_is_no_pause_at_all() {
        assert_eq!(pause(&acks(&[(0.5, 0), (0.9, 0)]), 1.0), None);
        assert_eq!(pause(&[], 1.0), None);
    }

    #[test]
    fn an_earlier_reconnect_does_not_count_as_the_failover() {
        // A reconnect at 0.4 s, before the stop, then the failover's at 3 s.
        let a = acks(&[(0.1, 0), (0.5, 1), (0.9, 1), (3.0, 2)]);
        assert_eq!(conn_at(&a, 1.0), 1);
        let p = pause(&a, 1.0).expect("resumed");
        assert_eq!((p.last_before_s, p.first_after_s), (0.9, 3.0));
    }

    #[test]
    fn flushed_writes_split_at_the_connection_of_the_stop() {
        let m = |t_s, conn, durable| FlushMark { t_s, conn, durable };
        let marks = [m(0.1, 0, 16), m(0.2, 0, 32), m(2.0, 1, 32), m(2.1, 1, 48), m(2.2, 1, 64)];
        assert_eq!(flushed_split(&marks, 0), (32, 32));
        assert_eq!(flushed_split(&[], 0), (0, 0));
    }

    fn trial(lost: u64, error: Option<&str>, pause: f64) -> Trial {
        Trial {
            volume: "v".into(),
            old_primary: "f1".into(),
            new_primary: Some("f2".into()),
            epoch_before: 1,
            epoch_after: 2,
            io_pause_s: Some(pause),
            reconnect_s: Some(pause - 0.1),
            lost_flushed_writes: lost,
            error: error.map(str::to_owned),
            ..Trial::default()
        }
    }

    fn row(trials: Vec<Trial>) -> Failover {
        Failover::new(3, 2, 250, 1500, "SIGKILL".into(), "loopback".into(), "child processes".into(), trials)
    }

    #[test]
    fn a_lost_flushed_write_makes_the_row_fail() {
        let ok = row(vec![trial(0, None, 1.8), trial(0, None, 2.0), trial(0, None, 1.9)]);
        assert!(ok.passed, "{ok:?}");
        assert_eq!(ok.verdict(), "ok: 0 flushed writes lost in 3 failovers");
        let pause = ok.io_pause_s.expect("pauses");
        assert_eq!((pause.median, pause.min, pause.max, pause.n), (1.9, 1.8, 2.0, 3));
        let bad = row(vec![trial(0, None, 1.8), trial(2, None, 2.0)]);
        assert!(!bad.passed);
        assert!(
            bad.verdict().starts_with("**FAILED**") && bad.verdict().contains("2 flushed writes lost"),
            "{}",
            bad.verdict()
        );
    }

    #[test]
    fn a_client_that_never_resumed_fails_the_row_and_says_why() {
        let mut t = trial(0, Some("no write acknowledged within 30 s of the stop"), 0.0);
        t.io_pause_s = None;
        t.reconnect_s = None;
        let r = row(vec![t]);
        assert!(!r.passed);
        assert!(r.io_pause_s.is_none());
        assert!(r.verdict().contains("failover 1: no write acknowledged within 30 s"), "{}", r.verdict());
        assert!(!row(Vec::new()).passed, "no trial is no pass");
        let mut gone = trial(0, None, 1.0);
        gone.new_primary = None;
        assert!(row(vec![gone]).verdict().contains("no node serves the volume"));
    }

    #[test]
    fn the_markdown_gives_conditions_verdict_and_a_line_per_failover() {
        let mut s = String::new();
        let mut t = trial(1, None, 2.0);
        t.lost = vec!["block 7 should hold write 90 or later, but holds write 74".into()];
        markdown(&mut s, &super::super::Section::Measured(row(vec![trial(0, None, 1.5), t])));
        assert!(s.contains("heartbeat_ms 250, failover_after_ms 1500"), "{s}");
        assert!(s.contains("| Verdict | **FAILED**"), "{s}");
        assert!(s.contains("| 2 | f1 | f2 (1 -> 2) | 2.00 s | 1.90 s |"), "{s}");
        assert!(s.contains("**1** |"), "{s}");
        assert!(s.contains("- failover 2: lost: block 7"), "{s}");
        assert!(s.contains("1.75 s [1.50..2.00, n=2]"), "{s}");
        let mut s = String::new();
        markdown(&mut s, &super::super::Section::na("no [faults]"));
        assert!(s.contains("_Not measured: no [faults]._"), "{s}");
    }
}
