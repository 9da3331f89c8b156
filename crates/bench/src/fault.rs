//! Faults applied part-way through a run (`--fault kill:lightningstor@node02`):
//! what a fault is (parsed and printed here, pure) and the trait of whatever
//! applies it. Two drivers implement [`FaultDriver`]: the embedded cluster's
//! child processes (in [`crate::cluster`]) and a Docker lab's containers
//! ([`DockerDriver`], in [`docker`]).
//!
//! The text form is `KIND:SERVICE@NODE`:
//!
//! - `kill:lightningstor@node02`: SIGKILL the service, healed by starting it;
//! - `pause:lightningstor@node02`: freeze it, healed by thawing it;
//! - `partition:node02`: cut the whole node off its network, healed by
//!   reconnecting it with the same address. `partition:lightningstor@node02`
//!   is accepted and means the same node (a partition cannot spare the
//!   node's other services), so it parses to the same [`Fault`].

pub mod docker;

pub use docker::DockerDriver;

use std::fmt;
use std::str::FromStr;

/// The `service` of every partition: the whole node, not one service on it.
pub const WHOLE_NODE: &str = "node";

/// Longest service or node name accepted.
pub const MAX_NAME: usize = 64;

/// What happens to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// SIGKILL the service; healed by starting it again.
    Kill,
    /// Freeze it (SIGSTOP, `docker pause`); healed by thawing it.
    Pause,
    /// Cut the whole node off its network; healed by reconnecting it.
    Partition,
}

impl FaultKind {
    /// Every kind, in the order the help text lists them.
    pub const ALL: [FaultKind; 3] = [FaultKind::Kill, FaultKind::Pause, FaultKind::Partition];

    /// The kind's word in the text form.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::Partition => "partition",
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fault on one service of one node. Build it with [`Fault::new`] or by
/// parsing, which validate the names and give a partition the service
/// [`WHOLE_NODE`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The service it happens to (`lightningstor`); [`WHOLE_NODE`] for a partition.
    pub service: String,
    /// The node it runs on (`node02`).
    pub node: String,
}

/// Why a fault's text was refused. The messages quote the text given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultParseError {
    /// No `KIND:` in front.
    #[error("{spec:?}: a fault is KIND:SERVICE@NODE or partition:NODE (kill:lightningstor@node02, partition:node02)")]
    Shape { spec: String },
    /// The kind is not one of kill, pause, partition.
    #[error("{spec:?}: unknown fault kind {kind:?} (kill, pause or partition)")]
    UnknownKind { spec: String, kind: String },
    /// kill or pause without `@NODE`.
    #[error("{spec:?}: {kind} needs the service and its node, e.g. {kind}:lightningstor@node02")]
    MissingNode { spec: String, kind: FaultKind },
    /// A part between the separators is empty.
    #[error("{spec:?}: the {part} is empty")]
    Empty { spec: String, part: &'static str },
    /// A name longer than [`MAX_NAME`].
    #[error("{spec:?}: the {part} is longer than {MAX_NAME} characters")]
    TooLong { spec: String, part: &'static str },
    /// A character outside `[A-Za-z0-9_-]` (a second `@` or `:` lands here too).
    #[error("{spec:?}: the {part} {value:?} has the character {bad:?}; names are letters, digits, '-' and '_'")]
    BadChar { spec: String, part: &'static str, value: String, bad: char },
}

/// Checks one name; `part` says which, for the message.
fn check_name(spec: &str, part: &'static str, value: &str) -> Result<(), FaultParseError> {
    let spec = || spec.to_owned();
    if value.is_empty() {
        return Err(FaultParseError::Empty { spec: spec(), part });
    }
    if let Some(bad) = value.chars().find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_')) {
        return Err(FaultParseError::BadChar { spec: spec(), part, value: value.to_owned(), bad });
    }
    if value.len() > MAX_NAME {
        return Err(FaultParseError::TooLong { spec: spec(), part });
    }
    Ok(())
}

impl Fault {
    /// A checked fault. A partition's service becomes [`WHOLE_NODE`] whatever is given.
    pub fn new(kind: FaultKind, service: &str, node: &str) -> Result<Fault, FaultParseError> {
        let spec = match kind {
            FaultKind::Partition => format!("{kind}:{node}"),
            _ => format!("{kind}:{service}@{node}"),
        };
        if kind != FaultKind::Partition {
            check_name(&spec, "service", service)?;
        }
        check_name(&spec, "node", node)?;
        let service = if kind == FaultKind::Partition { WHOLE_NODE } else { service };
        Ok(Fault { kind, service: service.to_owned(), node: node.to_owned() })
    }

    /// Whether the fault takes the whole node (a partition) rather than one service.
    pub fn whole_node(&self) -> bool {
        self.kind == FaultKind::Partition
    }

    /// The Compose service of the target in the Docker lab: `node02` for a
    /// partition (the container holding the node's network namespace),
    /// `node02-lightningstor` for a service on it.
    pub fn compose_service(&self) -> String {
        if self.whole_node() { self.node.clone() } else { format!("{}-{}", self.node, self.service) }
    }
}

impl FromStr for Fault {
    type Err = FaultParseError;

    fn from_str(s: &str) -> Result<Fault, FaultParseError> {
        let Some((kind, target)) = s.split_once(':') else {
            return Err(FaultParseError::Shape { spec: s.to_owned() });
        };
        let kind = match kind {
            "kill" => FaultKind::Kill,
            "pause" => FaultKind::Pause,
            "partition" => FaultKind::Partition,
            "" => return Err(FaultParseError::Empty { spec: s.to_owned(), part: "kind" }),
            other => return Err(FaultParseError::UnknownKind { spec: s.to_owned(), kind: other.to_owned() }),
        };
        let (service, node) = match (target.split_once('@'), kind) {
            (Some((service, node)), _) => (service, node),
            (None, FaultKind::Partition) => (WHOLE_NODE, target),
            (None, kind) => {
                // `kill:` alone is an empty part; `kill:node02` lacks the node.
                if target.is_empty() {
                    return Err(FaultParseError::Empty { spec: s.to_owned(), part: "service" });
                }
                return Err(FaultParseError::MissingNode { spec: s.to_owned(), kind });
            }
        };
        // The checks quote the text as given, not as normalised.
        check_name(s, "service", service)?;
        check_name(s, "node", node)?;
        Fault::new(kind, service, node)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.whole_node() {
            write!(f, "{}:{}", self.kind, self.node)
        } else {
            write!(f, "{}:{}@{}", self.kind, self.service, self.node)
        }
    }
}

/// Applies and undoes faults on a cluster. Every method answers within a
/// bounded time (the Docker driver gives each engine call 10 s).
#[async_trait::async_trait]
pub trait FaultDriver: Send + Sync {
    /// What applies the faults, for the report ("Docker engine at
    /// /var/run/docker.sock, Compose project lab").
    fn describe(&self) -> String;
    /// Applies the fault (kill: SIGKILL the service; pause: freeze it;
    /// partition: cut the node off its network).
    async fn inject(&self, f: &Fault) -> anyhow::Result<()>;
    /// Undoes it (kill: start the service again; pause: thaw; partition:
    /// reconnect with the same IP). Healing what is not faulted is a no-op.
    async fn heal(&self, f: &Fault) -> anyhow::Result<()>;
    /// Whether the fault's target is already down (not running, paused or
    /// disconnected): to report a cluster that was degraded before the run.
    async fn is_down(&self, f: &Fault) -> anyhow::Result<bool>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(s: &str) -> Result<Fault, FaultParseError> {
        s.parse()
    }

    #[test]
    fn kill_pause_and_partition_parse_into_their_parts() {
        let f = parse("kill:lightningstor@node02").expect("kill");
        assert_eq!((f.kind, f.service.as_str(), f.node.as_str()), (FaultKind::Kill, "lightningstor", "node02"));
        assert_eq!(f.compose_service(), "node02-lightningstor");
        let f = parse("pause:coronafs@node01").expect("pause");
        assert_eq!((f.kind, f.service.as_str(), f.node.as_str()), (FaultKind::Pause, "coronafs", "node01"));
        let f = parse("partition:node02").expect("partition");
        assert_eq!((f.kind, f.service.as_str(), f.node.as_str()), (FaultKind::Partition, WHOLE_NODE, "node02"));
        assert_eq!(f.compose_service(), "node02");
    }

    #[test]
    fn a_partition_naming_a_service_is_the_same_node() {
        assert_eq!(parse("partition:lightningstor@node02"), parse("partition:node02"));
        assert_eq!(parse("partition:lightningstor@node02").expect("parses").to_string(), "partition:node02");
        assert_eq!(Fault::new(FaultKind::Partition, "plasmavmc", "n1"), parse("partition:n1"));
    }

    #[test]
    fn display_gives_back_the_canonical_text() {
        for s in ["kill:lightningstor@node02", "pause:lightningstor@n3", "partition:node05", "kill:node02-agent_1@x"] {
            assert_eq!(parse(s).expect(s).to_string(), s);
        }
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        use FaultParseError as E;
        let err = |s: &str| parse(s).expect_err(s);
        assert!(matches!(err("lightningstor@node02"), E::Shape { .. }));
        assert!(matches!(err(""), E::Shape { .. }));
        assert!(matches!(err("crash:lightningstor@node02"), E::UnknownKind { kind, .. } if kind == "crash"));
        assert!(matches!(err("Kill:lightningstor@node02"), E::UnknownKind { .. }));
        assert!(matches!(err(":lightningstor@node02"), E::Empty { part: "kind", .. }));
        assert!(matches!(err("kill:lightningstor"), E::MissingNode { kind: FaultKind::Kill, .. }));
        assert!(matches!(err("pause:node02"), E::MissingNode { kind: FaultKind::Pause, .. }));
        assert!(matches!(err("kill:"), E::Empty { part: "service", .. }));
        assert!(matches!(err("kill:@node02"), E::Empty { part: "service", .. }));
        assert!(matches!(err("kill:lightningstor@"), E::Empty { part: "node", .. }));
        assert!(matches!(err("partition:"), E::Empty { part: "node", .. }));
        assert!(matches!(err("partition:@node02"), E::Empty { part: "service", .. }));
        assert!(matches!(err("kill:light ningstor@node02"), E::BadChar { bad: ' ', part: "service", .. }));
        assert!(matches!(err("kill:lightningstor@node02@x"), E::BadChar { bad: '@', part: "node", .. }));
        assert!(matches!(err("kill:a:b@node02"), E::BadChar { bad: ':', .. }));
        assert!(matches!(err("kill:ls@node/02"), E::BadChar { bad: '/', .. }));
        assert!(matches!(err("kill:ls@nöde"), E::BadChar { bad: 'ö', .. }));
        assert!(matches!(err(&format!("kill:ls@{}", "n".repeat(MAX_NAME + 1))), E::TooLong { part: "node", .. }));
        assert!(parse(&format!("kill:ls@{}", "n".repeat(MAX_NAME))).is_ok());
    }

    #[test]
    fn messages_quote_the_text_and_show_an_example() {
        let m = parse("kill:lightningstor").expect_err("no node").to_string();
        assert!(m.contains("\"kill:lightningstor\"") && m.contains("kill:lightningstor@node02"), "{m}");
        let m = parse("crash:x@y").expect_err("kind").to_string();
        assert!(m.contains("\"crash\"") && m.contains("kill, pause or partition"), "{m}");
        let m = parse("kill:x@y z").expect_err("space").to_string();
        assert!(m.contains("\"y z\"") && m.contains("' '"), "{m}");
    }

    fn name() -> impl Strategy<Value = String> {
        "[A-Za-z0-9_-]{1,64}"
    }

    fn fault() -> impl Strategy<Value = Fault> {
        (proptest::sample::select(FaultKind::ALL.to_vec()), name(), name())
            .prop_map(|(kind, service, node)| Fault::new(kind, &service, &node).expect("valid names"))
    }

    proptest! {
        #[test]
        fn display_then_parse_is_the_same_fault(f in fault()) {
            let text = f.to_string();
            prop_assert_eq!(text.parse::<Fault>(), Ok(f.clone()));
            prop_assert_eq!(text.parse::<Fault>().map(|g| g.to_string()), Ok(text));
        }

        #[test]
        fn parse_never_panics_and_accepts_only_canonicalisable_text(s in "[a-z:@ _0-9-]{0,24}") {
            if let Ok(f) = s.parse::<Fault>() {
                prop_assert_eq!(f.to_string().parse::<Fault>(), Ok(f));
            }
        }
    }
}
