//! Faults applied during a run (`--fault kill:lightningstor@node02`): what
//! they are and the trait of whatever applies them. The embedded cluster's
//! driver is in [`crate::cluster`].

use anyhow::bail;

/// What happens to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL the service; healed by starting it again.
    Kill,
    /// Freeze it (SIGSTOP / docker pause); healed by thawing.
    Pause,
    /// Cut the whole node off the network; healed by reconnecting it.
    Partition,
}

/// A fault on one service of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub service: String,
    pub node: String,
}

impl std::str::FromStr for Fault {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Fault> {
        let Some((kind, rest)) = s.split_once(':') else {
            bail!("{s:?}: a fault is KIND:SERVICE@NODE (kill:lightningstor@node02, pause:..., partition:node02)");
        };
        let kind = match kind {
            "kill" => FaultKind::Kill,
            "pause" => FaultKind::Pause,
            "partition" => FaultKind::Partition,
            other => bail!("{s:?}: unknown fault kind {other:?} (kill, pause or partition)"),
        };
        let (service, node) = match (kind, rest.split_once('@')) {
            (_, Some((svc, node))) => (svc, node),
            (FaultKind::Partition, None) => ("node", rest),
            (_, None) => bail!("{s:?}: name the service and the node, e.g. kill:lightningstor@node02"),
        };
        let ok = |x: &str| {
            !x.is_empty() && x.len() <= 64 && x.chars().all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
        };
        if !ok(service) || !ok(node) {
            bail!("{s:?}: service and node must be 1-64 of [A-Za-z0-9_-]");
        }
        Ok(Fault { kind, service: service.into(), node: node.into() })
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::Partition => "partition",
        };
        if self.kind == FaultKind::Partition && self.service == "node" {
            write!(f, "{kind}:{}", self.node)
        } else {
            write!(f, "{kind}:{}@{}", self.service, self.node)
        }
    }
}

/// Applies and undoes faults.
#[async_trait::async_trait]
pub trait FaultDriver: Send + Sync {
    /// What applies the faults, for the report.
    fn describe(&self) -> String;
    /// Applies the fault.
    async fn inject(&self, f: &Fault) -> anyhow::Result<()>;
    /// Undoes it.
    async fn heal(&self, f: &Fault) -> anyhow::Result<()>;
    /// Whether the fault's target is down already.
    async fn is_down(&self, f: &Fault) -> anyhow::Result<bool>;
}
