//! What a checker says: whether the promise held, and for each way it did
//! not, the few operations that show it.

use super::history::Operation;
use serde::{Deserialize, Serialize};

/// Whether a checker's property held over the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Validity {
    /// It held.
    Holds,
    /// It did not: see the anomalies.
    Violated,
    /// The checker could not decide (search effort exhausted, nothing to
    /// check against).
    Unknown,
}

impl Validity {
    /// The word used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Validity::Holds => "holds",
            Validity::Violated => "violated",
            Validity::Unknown => "unknown",
        }
    }

    /// The worse of two: a violation over unknown over holds.
    pub fn worst(self, other: Validity) -> Validity {
        use Validity::*;
        match (self, other) {
            (Violated, _) | (_, Violated) => Violated,
            (Unknown, _) | (_, Unknown) => Unknown,
            _ => Holds,
        }
    }
}

/// One way the promise was broken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anomaly {
    /// A short name for the kind (`stale-read`, `lost-element`, `torn-block`).
    pub kind: String,
    /// The key, element or block it is about, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// What is wrong, in a sentence.
    pub explanation: String,
    /// The smallest window of the history that shows it, by invoke time.
    pub window: Vec<Operation>,
}

impl Anomaly {
    /// An anomaly whose window is `ops`, sorted by invoke time.
    pub fn new(kind: &str, subject: Option<String>, explanation: String, ops: Vec<Operation>) -> Anomaly {
        let mut window = ops;
        window.sort_by_key(|o| (o.invoke, o.complete, o.process));
        Anomaly { kind: kind.to_string(), subject, explanation, window }
    }
}

/// At most this many anomalies are kept per checker; the count says how
/// many there were.
pub const MAX_ANOMALIES: usize = 20;

/// One checker's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// Which checker (`linearizable`, `read-your-writes`, `set`, `blocks`).
    pub checker: String,
    /// Whether its property held.
    pub validity: Validity,
    /// What was checked or why it is unknown, in a sentence.
    pub detail: String,
    /// How many anomalies were found (more than are kept).
    pub anomaly_count: usize,
    /// The first [`MAX_ANOMALIES`] anomalies.
    pub anomalies: Vec<Anomaly>,
}

impl Verdict {
    /// A verdict from the anomalies found: violated when there is one,
    /// otherwise `otherwise` (holds, or unknown when nothing could be checked).
    pub fn from_anomalies(checker: &str, otherwise: Validity, detail: String, mut anomalies: Vec<Anomaly>) -> Verdict {
        let anomaly_count = anomalies.len();
        anomalies.truncate(MAX_ANOMALIES);
        let validity = if anomaly_count > 0 { Validity::Violated } else { otherwise };
        Verdict { checker: checker.to_string(), validity, detail, anomaly_count, anomalies }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_violation_is_worse_than_unknown_which_is_worse_than_holding() {
        use Validity::*;
        assert_eq!(Holds.worst(Holds), Holds);
        assert_eq!(Holds.worst(Unknown), Unknown);
        assert_eq!(Violated.worst(Unknown), Violated);
        assert_eq!(Unknown.worst(Violated), Violated);
    }

    #[test]
    fn anomalies_make_a_violation_and_are_capped() {
        let a = Anomaly::new("x", None, "y".into(), vec![]);
        let v = Verdict::from_anomalies("c", Validity::Holds, String::new(), vec![a; MAX_ANOMALIES + 3]);
        assert_eq!(v.validity, Validity::Violated);
        assert_eq!(v.anomaly_count, MAX_ANOMALIES + 3);
        assert_eq!(v.anomalies.len(), MAX_ANOMALIES);
        let none = Verdict::from_anomalies("c", Validity::Unknown, String::new(), vec![]);
        assert_eq!(none.validity, Validity::Unknown);
    }
}
