//! The volume map's state machine, pure: what the Raft group of a cluster
//! agrees on for each replicated volume, and the rules by which a command
//! changes it. Every node applies the same committed commands in the same
//! order, so every node's map is the same after the same log prefix; no
//! rule reads a clock (the lease's timing is checked by the leader before
//! it proposes a takeover, `super::Lessor`, and made safe here by the
//! `renewals` counter a takeover must match).
//!
//! docs/design/replication-volumes.md ("The volume map") gives the meaning
//! of each field and why the rules are safe.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// What the map holds for one replicated volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeState {
    /// The nodes holding a copy, the primary included, in placement order.
    pub copies: Vec<String>,
    /// The epoch the current primary took office at. Every primary change
    /// raises it; a primary's writes carry it (or a fence epoch above it).
    pub epoch: u64,
    /// The node serving the volume.
    pub primary: String,
    /// The copies holding every write a FLUSH or FUA answered: the primary,
    /// and the copies it forwards to that have not been dropped. Only these
    /// may take over.
    pub in_sync: BTreeSet<String>,
    /// Copies (the primary included) that must be in sync for the volume
    /// to take writes.
    pub quorum: usize,
    /// Renewals of the primary's lease (and takeovers), counted: a takeover
    /// names the count the leader saw when it found the lease run out, so a
    /// renewal committed in between makes the takeover fail.
    pub renewals: u64,
    /// The copies out of the in-sync set, with when they left it (Unix
    /// milliseconds on the clock of the node that proposed it: for `volume
    /// show` and `replace_after`, never for safety).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub out_since: BTreeMap<String, u64>,
}

/// The whole map: every replicated volume of the cluster by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMap {
    pub volumes: BTreeMap<String, VolumeState>,
}

/// A change to the map, proposed by a node and applied once committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// A replicated volume was made (`primary` among `copies`), at `epoch`
    /// (its fence epoch at the time; 0 for a new volume).
    Register { volume: String, copies: Vec<String>, primary: String, quorum: usize, epoch: u64 },
    /// The volume was deleted.
    Unregister { volume: String },
    /// The primary of `epoch` renews its lease.
    Renew { volume: String, node: String, epoch: u64 },
    /// An in-sync copy takes over: the leader found that the lease had not
    /// been renewed for a whole lease and saw `renewals` renewals so far.
    /// `seen` is the highest epoch the candidate knows (its fence), so the
    /// new epoch passes every epoch a client or a stream used.
    TakeOver {
        volume: String,
        node: String,
        renewals: u64,
        seen: u64,
        #[serde(default)]
        at_ms: u64,
    },
    /// The primary of `epoch` stops counting `copy` as in sync (it missed a
    /// frame, or its link broke): committed before a FLUSH that `copy`
    /// did not acknowledge is answered.
    Drop {
        volume: String,
        by: String,
        epoch: u64,
        copy: String,
        #[serde(default)]
        at_ms: u64,
    },
    /// The primary of `epoch` counts `copy` in sync again: it caught up and
    /// takes the write stream.
    Rejoin { volume: String, by: String, epoch: u64, copy: String },
    /// The primary of `epoch` gives `old`'s place among the copies to
    /// `new`, a node holding no copy, which starts out of sync (it is
    /// given a full copy). `old` must be out of the in-sync set, or the
    /// set must keep the write quorum without it.
    Replace { volume: String, by: String, epoch: u64, old: String, new: String, at_ms: u64 },
}

impl Command {
    /// The volume the command is about.
    pub fn volume(&self) -> &str {
        match self {
            Command::Register { volume, .. }
            | Command::Unregister { volume }
            | Command::Renew { volume, .. }
            | Command::TakeOver { volume, .. }
            | Command::Drop { volume, .. }
            | Command::Rejoin { volume, .. }
            | Command::Replace { volume, .. } => volume,
        }
    }
}

/// Why a command changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    #[error("volume {0:?} is not in the volume map")]
    Unknown(String),
    #[error("volume {0:?} is already in the volume map with other copies")]
    Exists(String),
    #[error("{0}")]
    Invalid(String),
    /// The node is not (or no longer) the volume's primary at that epoch.
    #[error("{node} is not the primary of {volume:?} at epoch {epoch}: {primary} is, at epoch {current}")]
    NotPrimary { volume: String, node: String, epoch: u64, primary: String, current: u64 },
    /// A takeover by a copy that may lack acknowledged writes.
    #[error(
        "{node} is not in sync for {volume:?} (in sync: {in_sync:?}); only an in-sync copy holds every flushed write"
    )]
    NotInSync { volume: String, node: String, in_sync: Vec<String> },
    /// The lease was renewed after the leader looked: the primary lives.
    #[error("the primary of {volume:?} renewed its lease meanwhile")]
    Renewed { volume: String },
}

/// What applying a command answers: the volume's state after it.
pub type Outcome = Result<VolumeState, Refusal>;

impl VolumeMap {
    /// The state of `volume`.
    pub fn get(&self, volume: &str) -> Option<&VolumeState> {
        self.volumes.get(volume)
    }

    /// Applies one committed command.
    pub fn apply(&mut self, cmd: &Command) -> Outcome {
        match cmd {
            Command::Register { volume, copies, primary, quorum, epoch } => {
                let distinct: BTreeSet<&String> = copies.iter().collect();
                if distinct.len() != copies.len() || !copies.contains(primary) {
                    return Err(Refusal::Invalid(format!(
                        "copies {copies:?} of {volume:?} must be distinct and include the primary {primary}"
                    )));
                }
                if *quorum == 0 || *quorum > copies.len() {
                    return Err(Refusal::Invalid(format!(
                        "write quorum {quorum} of {volume:?} must be between 1 and its {} copies",
                        copies.len()
                    )));
                }
                if let Some(have) = self.volumes.get(volume) {
                    // A retried registration of the same volume is answered
                    // with what stands.
                    return if have.copies == *copies {
                        Ok(have.clone())
                    } else {
                        Err(Refusal::Exists(volume.clone()))
                    };
                }
                let st = VolumeState {
                    copies: copies.clone(),
                    epoch: *epoch,
                    primary: primary.clone(),
                    in_sync: copies.iter().cloned().collect(),
                    quorum: *quorum,
                    renewals: 0,
                    out_since: BTreeMap::new(),
                };
                self.volumes.insert(volume.clone(), st.clone());
                Ok(st)
            }
            Command::Unregister { volume } => {
                self.volumes.remove(volume).ok_or_else(|| Refusal::Unknown(volume.clone()))
            }
            Command::Renew { volume, node, epoch } => {
                let st = self.known(volume)?;
                st.check_primary(volume, node, *epoch)?;
                st.renewals += 1;
                Ok(st.clone())
            }
            Command::TakeOver { volume, node, renewals, seen, at_ms } => {
                let st = self.known(volume)?;
                if st.primary == *node {
                    // A retry of a takeover that was granted: nothing changes.
                    return Ok(st.clone());
                }
                if !st.in_sync.contains(node) {
                    return Err(Refusal::NotInSync {
                        volume: volume.clone(),
                        node: node.clone(),
                        in_sync: st.in_sync.iter().cloned().collect(),
                    });
                }
                if st.renewals != *renewals {
                    return Err(Refusal::Renewed { volume: volume.clone() });
                }
                // The old primary may hold writes no FLUSH answered that the
                // new one lacks, and the other copies may differ from the new
                // one in the same way: only the new primary is in sync until
                // it has caught each one up (or found it at its own place)
                // and rejoined it.
                st.epoch = st.epoch.max(*seen) + 1;
                st.primary = node.clone();
                st.in_sync = BTreeSet::from([node.clone()]);
                st.renewals += 1;
                st.out_since.remove(node);
                for c in &st.copies {
                    if c != node {
                        st.out_since.entry(c.clone()).or_insert(*at_ms);
                    }
                }
                Ok(st.clone())
            }
            Command::Drop { volume, by, epoch, copy, at_ms } => {
                let st = self.known(volume)?;
                st.check_primary(volume, by, *epoch)?;
                if copy == by {
                    return Err(Refusal::Invalid(format!("the primary of {volume:?} cannot drop itself")));
                }
                // A copy replaced meanwhile holds no place to leave.
                if st.copies.contains(copy) {
                    st.in_sync.remove(copy);
                    st.out_since.entry(copy.clone()).or_insert(*at_ms);
                }
                Ok(st.clone())
            }
            Command::Rejoin { volume, by, epoch, copy } => {
                let st = self.known(volume)?;
                st.check_primary(volume, by, *epoch)?;
                if !st.copies.contains(copy) {
                    return Err(Refusal::Invalid(format!("{copy} holds no copy of {volume:?}")));
                }
                st.in_sync.insert(copy.clone());
                st.out_since.remove(copy);
                Ok(st.clone())
            }
            Command::Replace { volume, by, epoch, old, new, at_ms } => {
                let st = self.known(volume)?;
                st.check_primary(volume, by, *epoch)?;
                if old == by {
                    return Err(Refusal::Invalid(format!(
                        "{by} is the primary of {volume:?}: a primary's copy is not replaced (a takeover moves it)"
                    )));
                }
                let Some(at) = st.copies.iter().position(|c| c == old) else {
                    return Err(Refusal::Invalid(format!("{old} holds no copy of {volume:?}")));
                };
                if st.copies.contains(new) {
                    return Err(Refusal::Invalid(format!("{new} holds a copy of {volume:?} already")));
                }
                if st.in_sync.contains(old) && st.in_sync.len() <= st.quorum {
                    return Err(Refusal::Invalid(format!(
                        "{old} is in sync and {volume:?} would keep {} in-sync copies, below its write quorum of {}",
                        st.in_sync.len() - 1,
                        st.quorum
                    )));
                }
                st.copies[at] = new.clone();
                st.in_sync.remove(old);
                st.out_since.remove(old);
                st.out_since.insert(new.clone(), *at_ms);
                Ok(st.clone())
            }
        }
    }

    fn known(&mut self, volume: &str) -> Result<&mut VolumeState, Refusal> {
        self.volumes.get_mut(volume).ok_or_else(|| Refusal::Unknown(volume.to_owned()))
    }
}

impl VolumeState {
    fn check_primary(&self, volume: &str, node: &str, epoch: u64) -> Result<(), Refusal> {
        if self.primary == node && self.epoch == epoch {
            return Ok(());
        }
        Err(Refusal::NotPrimary {
            volume: volume.to_owned(),
            node: node.to_owned(),
            epoch,
            primary: self.primary.clone(),
            current: self.epoch,
        })
    }

    /// Whether the in-sync set reaches the write quorum.
    pub fn writable(&self) -> bool {
        self.in_sync.len() >= self.quorum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reg(map: &mut VolumeMap) -> VolumeState {
        map.apply(&Command::Register {
            volume: "v".into(),
            copies: vec!["a".into(), "b".into(), "c".into()],
            primary: "a".into(),
            quorum: 2,
            epoch: 1,
        })
        .expect("registered")
    }

    #[test]
    fn a_registered_volume_starts_with_every_copy_in_sync_and_a_retry_changes_nothing() {
        let mut map = VolumeMap::default();
        let st = reg(&mut map);
        assert_eq!(st.in_sync.len(), 3);
        assert_eq!((st.primary.as_str(), st.epoch), ("a", 1));
        assert_eq!(reg(&mut map), st);
        let other = Command::Register {
            volume: "v".into(),
            copies: vec!["a".into(), "d".into()],
            primary: "a".into(),
            quorum: 2,
            epoch: 1,
        };
        assert_eq!(map.apply(&other), Err(Refusal::Exists("v".into())));
    }

    #[test]
    fn registrations_that_break_the_copy_rules_are_refused() {
        let mut map = VolumeMap::default();
        for (copies, primary, quorum) in
            [(vec!["a", "a"], "a", 1), (vec!["a", "b"], "c", 1), (vec!["a", "b"], "a", 3), (vec!["a"], "a", 0)]
        {
            let cmd = Command::Register {
                volume: "v".into(),
                copies: copies.into_iter().map(String::from).collect(),
                primary: primary.into(),
                quorum,
                epoch: 1,
            };
            assert!(matches!(map.apply(&cmd), Err(Refusal::Invalid(_))), "{cmd:?}");
        }
        assert!(map.volumes.is_empty());
    }

    #[test]
    fn a_takeover_passes_every_seen_epoch_and_deposes_the_old_primary() {
        let mut map = VolumeMap::default();
        reg(&mut map);
        map.apply(&Command::Renew { volume: "v".into(), node: "a".into(), epoch: 1 }).expect("applied");
        // The leader saw 1 renewal; the copy's fence is at 7 (a client's fence).
        let st = map
            .apply(&Command::TakeOver { volume: "v".into(), node: "b".into(), renewals: 1, seen: 7, at_ms: 0 })
            .expect("applied");
        assert_eq!((st.primary.as_str(), st.epoch), ("b", 8));
        assert_eq!(st.in_sync, BTreeSet::from(["b".to_owned()]));
        let old = map.apply(&Command::Renew { volume: "v".into(), node: "a".into(), epoch: 1 });
        assert!(matches!(old, Err(Refusal::NotPrimary { current: 8, .. })), "{old:?}");
        let old =
            map.apply(&Command::Drop { volume: "v".into(), by: "a".into(), epoch: 1, copy: "c".into(), at_ms: 0 });
        assert!(matches!(old, Err(Refusal::NotPrimary { .. })), "{old:?}");
    }

    #[test]
    fn a_takeover_after_a_renewal_the_leader_did_not_see_is_refused() {
        let mut map = VolumeMap::default();
        reg(&mut map);
        map.apply(&Command::Renew { volume: "v".into(), node: "a".into(), epoch: 1 }).expect("applied");
        let late =
            map.apply(&Command::TakeOver { volume: "v".into(), node: "b".into(), renewals: 0, seen: 1, at_ms: 0 });
        assert_eq!(late, Err(Refusal::Renewed { volume: "v".into() }));
        assert_eq!(map.get("v").expect("registered").primary, "a");
    }

    #[test]
    fn a_dropped_copy_cannot_take_over_until_the_primary_rejoins_it() {
        let mut map = VolumeMap::default();
        reg(&mut map);
        map.apply(&Command::Drop { volume: "v".into(), by: "a".into(), epoch: 1, copy: "c".into(), at_ms: 0 })
            .expect("applied");
        let t = map.apply(&Command::TakeOver { volume: "v".into(), node: "c".into(), renewals: 0, seen: 1, at_ms: 0 });
        assert!(matches!(t, Err(Refusal::NotInSync { .. })), "{t:?}");
        assert!(map.get("v").expect("registered").writable());
        map.apply(&Command::Drop { volume: "v".into(), by: "a".into(), epoch: 1, copy: "b".into(), at_ms: 0 })
            .expect("applied");
        assert!(!map.get("v").expect("registered").writable());
        map.apply(&Command::Rejoin { volume: "v".into(), by: "a".into(), epoch: 1, copy: "c".into() })
            .expect("applied");
        let st = map
            .apply(&Command::TakeOver { volume: "v".into(), node: "c".into(), renewals: 0, seen: 1, at_ms: 0 })
            .expect("applied");
        assert_eq!(st.primary, "c");
    }

    #[test]
    fn a_lost_copy_is_replaced_by_a_node_without_one_which_starts_out_of_sync() {
        let mut map = VolumeMap::default();
        reg(&mut map);
        let replace = |old: &str, new: &str| Command::Replace {
            volume: "v".into(),
            by: "a".into(),
            epoch: 1,
            old: old.into(),
            new: new.into(),
            at_ms: 50,
        };
        // c is in sync and the set would keep 2 (the quorum): allowed; then
        // b in sync would leave 1: refused.
        map.apply(&Command::Drop { volume: "v".into(), by: "a".into(), epoch: 1, copy: "c".into(), at_ms: 10 })
            .expect("applied");
        assert_eq!(map.get("v").expect("v").out_since, BTreeMap::from([("c".to_owned(), 10)]));
        assert!(matches!(map.apply(&replace("b", "d")), Err(Refusal::Invalid(m)) if m.contains("quorum")));
        assert!(matches!(map.apply(&replace("a", "d")), Err(Refusal::Invalid(m)) if m.contains("primary")));
        assert!(matches!(map.apply(&replace("c", "b")), Err(Refusal::Invalid(m)) if m.contains("already")));
        assert!(matches!(map.apply(&replace("e", "d")), Err(Refusal::Invalid(m)) if m.contains("no copy")));
        let st = map.apply(&replace("c", "d")).expect("replaced");
        assert_eq!(st.copies, ["a", "b", "d"]);
        assert_eq!(st.out_since, BTreeMap::from([("d".to_owned(), 50)]));
        // A late drop of the replaced copy changes nothing; d rejoins once
        // it caught up.
        let late = Command::Drop { volume: "v".into(), by: "a".into(), epoch: 1, copy: "c".into(), at_ms: 60 };
        assert_eq!(map.apply(&late).expect("applied"), st);
        let st = map
            .apply(&Command::Rejoin { volume: "v".into(), by: "a".into(), epoch: 1, copy: "d".into() })
            .expect("applied");
        assert!(st.out_since.is_empty() && st.in_sync.len() == 3);
    }

    fn names() -> impl Strategy<Value = String> {
        prop::sample::select(vec!["a", "b", "c", "d"]).prop_map(String::from)
    }

    fn command() -> impl Strategy<Value = Command> {
        let v = || Just("v".to_owned());
        prop_oneof![
            (v(), names(), 0u64..6).prop_map(|(volume, node, epoch)| Command::Renew { volume, node, epoch }),
            (v(), names(), 0u64..8, 0u64..6).prop_map(|(volume, node, renewals, seen)| Command::TakeOver {
                volume,
                node,
                renewals,
                seen,
                at_ms: 7
            }),
            (v(), names(), 0u64..6, names()).prop_map(|(volume, by, epoch, copy)| Command::Drop {
                volume,
                by,
                epoch,
                copy,
                at_ms: 5
            }),
            (v(), names(), 0u64..6, names(), names()).prop_map(|(volume, by, epoch, old, new)| Command::Replace {
                volume,
                by,
                epoch,
                old,
                new,
                at_ms: 9
            }),
            (v(), names(), 0u64..6, names()).prop_map(|(volume, by, epoch, copy)| Command::Rejoin {
                volume,
                by,
                epoch,
                copy
            }),
        ]
    }

    proptest! {
        /// Whatever is proposed: the primary is always in sync, the in-sync
        /// set holds only copies and every other copy is out since a time,
        /// a replacement keeps the write quorum in sync, the epoch never falls, a new primary was
        /// in sync when it took over, and a refused command changes nothing.
        #[test]
        fn no_command_sequence_breaks_the_maps_invariants(cmds in prop::collection::vec(command(), 1..60)) {
            let mut map = VolumeMap::default();
            reg(&mut map);
            for cmd in &cmds {
                let before = map.clone();
                let r = map.apply(cmd);
                let st = map.get("v").expect("applied");
                prop_assert!(st.in_sync.contains(&st.primary));
                prop_assert!(st.in_sync.iter().all(|c| st.copies.contains(c)));
                // Every copy is either in sync or out since some time; the
                // copies stay distinct, and as many as registered.
                prop_assert!(st.out_since.keys().all(|c| st.copies.contains(c) && !st.in_sync.contains(c)));
                prop_assert_eq!(st.in_sync.len() + st.out_since.len(), st.copies.len());
                prop_assert_eq!(st.copies.iter().collect::<BTreeSet<_>>().len(), 3);
                let old = before.get("v").expect("applied");
                // A replacement never takes the in-sync set below the quorum
                // unless it was below it already.
                if old.in_sync.len() >= old.quorum {
                    prop_assert!(st.in_sync.len() >= st.quorum || st.copies == old.copies);
                }
                prop_assert!(st.epoch >= old.epoch);
                match r {
                    Err(_) => prop_assert_eq!(&map, &before),
                    Ok(_) => if st.primary != old.primary {
                        prop_assert!(old.in_sync.contains(&st.primary));
                        prop_assert!(st.epoch > old.epoch);
                    },
                }
            }
        }
    }
}
