//! Recording: one monotonic clock for every client and the nemesis, the
//! entries in the order they were made, and what an S3 error means for an
//! operation's outcome.

use crate::check::history::{Entry, History, Nanos, NemesisEvent, Operation, Outcome};
use aws_sdk_s3::error::SdkError;
use std::sync::Mutex;
use std::time::Instant;

/// Most entries a run keeps; clients stop once it is reached.
pub const MAX_ENTRIES: usize = 2_000_000;

/// The history being recorded.
#[derive(Debug)]
pub struct Recorder {
    /// Time zero of the history's clock.
    pub start: Instant,
    entries: Mutex<Vec<Entry>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Recorder {
        Recorder { start: Instant::now(), entries: Mutex::new(Vec::new()) }
    }

    /// Now, on the history's clock.
    pub fn now(&self) -> Nanos {
        self.start.elapsed().as_nanos() as Nanos
    }

    fn push(&self, e: Entry) -> bool {
        let mut v = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() >= MAX_ENTRIES {
            return false;
        }
        v.push(e);
        true
    }

    /// Records a finished operation; false once the history is full.
    pub fn op(&self, o: Operation) -> bool {
        self.push(Entry::Op(o))
    }

    /// Records a nemesis event.
    pub fn nemesis(&self, n: NemesisEvent) {
        self.push(Entry::Nemesis(n));
    }

    /// The history so far.
    pub fn history(&self) -> History {
        History { entries: self.entries.lock().unwrap_or_else(|p| p.into_inner()).clone() }
    }
}

/// The outcome of an HTTP error status: a 4xx was refused (nothing
/// happened), anything else may have happened.
pub fn outcome_of_status(status: u16) -> Outcome {
    if (400..500).contains(&status) { Outcome::Failed } else { Outcome::Indeterminate }
}

/// Whether an `io::Error` of kind `ConnectionRefused` is in the chain.
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    for _ in 0..32 {
        let Some(err) = cur else { return false };
        if err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        cur = err.source();
    }
    false
}

/// What an SDK error says of the request: (outcome, a few words why, the
/// HTTP status when there was an answer).
pub fn classify<E, R>(e: &SdkError<E, R>) -> (Outcome, String, Option<u16>)
where
    E: std::error::Error + 'static,
    R: std::fmt::Debug + HasStatus + 'static,
{
    match e {
        SdkError::ConstructionFailure(_) => (Outcome::Failed, "not sent".into(), None),
        SdkError::TimeoutError(_) => (Outcome::Indeterminate, "timeout".into(), None),
        SdkError::DispatchFailure(d) => {
            if refused(e) {
                (Outcome::Failed, "connection refused".into(), None)
            } else if d.is_timeout() {
                (Outcome::Indeterminate, "timeout".into(), None)
            } else {
                (Outcome::Indeterminate, format!("connection: {}", chain(e)), None)
            }
        }
        SdkError::ResponseError(_) => (Outcome::Indeterminate, format!("bad response: {}", chain(e)), None),
        SdkError::ServiceError(s) => {
            let status = s.raw().status_u16();
            (outcome_of_status(status), format!("HTTP {status}"), Some(status))
        }
        _ => (Outcome::Indeterminate, chain(e), None),
    }
}

/// The status of a raw response (a trait so [`classify`] stays generic).
pub trait HasStatus {
    fn status_u16(&self) -> u16;
}

impl HasStatus for aws_sdk_s3::config::http::HttpResponse {
    fn status_u16(&self) -> u16 {
        self.status().as_u16()
    }
}

/// An error and its sources on one line, shortened.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    for _ in 0..8 {
        let Some(err) = cur else { break };
        s.push_str(": ");
        s.push_str(&err.to_string());
        cur = err.source();
    }
    if s.len() > 200 {
        let mut end = 200;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_4xx_did_not_happen_and_a_5xx_may_have() {
        assert_eq!(outcome_of_status(403), Outcome::Failed);
        assert_eq!(outcome_of_status(404), Outcome::Failed);
        assert_eq!(outcome_of_status(500), Outcome::Indeterminate);
        assert_eq!(outcome_of_status(503), Outcome::Indeterminate);
    }

    #[test]
    fn a_refused_connection_is_found_down_the_chain() {
        #[derive(Debug)]
        struct Wrap(std::io::Error);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let refused_err = Wrap(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(refused(&refused_err));
        let reset = Wrap(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(!refused(&reset));
        assert!(chain(&reset).starts_with("wrapped: "));
    }

    #[test]
    fn the_clock_only_goes_forward_and_entries_keep_their_order() {
        let r = Recorder::new();
        let (a, b) = (r.now(), r.now());
        assert!(b >= a);
        for t in 0..3 {
            r.nemesis(NemesisEvent {
                time: t,
                fault: "kill:x@y".into(),
                phase: crate::check::history::NemesisPhase::Start,
                error: None,
            });
        }
        let times: Vec<Nanos> = r.history().nemesis().map(|n| n.time).collect();
        assert_eq!(times, [0, 1, 2]);
    }
}
