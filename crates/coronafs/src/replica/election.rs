//! The fencing vote, sans-IO: how a copy answers a new primary's VOTE
//! ([`grant`]), and which copies stay live after a takeover
//! ([`at_position`]).
//!
//! Who becomes primary is the volume map's decision (`replication/map`);
//! the copy a takeover made primary then sends VOTE at its new epoch to
//! every other copy, which fences the copy at that epoch (no frame of an
//! older primary lands after it), makes it durable and reports where it is
//! in the write stream. A copy grants at most one vote per epoch (its
//! [`VoteState`] is persisted before it answers). See
//! docs/design/replication-volumes.md ("The volume map").

use super::wire::Position;

/// What a copy remembers of its votes (in its catalog record).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VoteState {
    /// The highest epoch the copy has seen (voted at, or was fenced to).
    pub epoch: u64,
    /// Whom it voted for at `epoch`, if it voted at that epoch.
    pub voted_for: Option<String>,
}

/// Why a copy refused its vote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The copy's epoch: a candidate must ask for a higher one.
    pub epoch: u64,
}

/// A copy's answer to `candidate` asking for its vote at `epoch`: the state
/// to persist before answering, or a refusal. A copy grants when `epoch` is
/// above every epoch it has seen, or asks again for the vote it already gave
/// (a retry after a lost answer).
pub fn grant(state: &VoteState, epoch: u64, candidate: &str) -> Result<VoteState, Refused> {
    let again = epoch == state.epoch && state.voted_for.as_deref() == Some(candidate);
    if epoch > state.epoch || again {
        Ok(VoteState { epoch, voted_for: Some(candidate.to_owned()) })
    } else {
        Err(Refused { epoch: state.epoch })
    }
}

/// One copy's answer, as the candidate received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ballot {
    /// The copy voted for the candidate and is at `position` (`None`: it
    /// does not know where it is).
    Granted { position: Option<Position> },
    /// The copy refused: it is at `epoch`.
    Refused { epoch: u64 },
    /// No answer (down, partitioned, timed out).
    Silent,
}

/// After the volume map granted a takeover (the map, not the ballots,
/// decided who is primary): the copies that voted and are at exactly `own`
/// position hold the same bytes as the new primary and stay live; every
/// other copy (behind, ahead with writes no FLUSH answered, silent, or any
/// copy when `own` is unknown after a restart) is stale and catches up.
pub fn at_position(own: Option<Position>, ballots: &[(String, Ballot)]) -> (Vec<String>, Vec<String>) {
    let (mut live, mut stale) = (Vec::new(), Vec::new());
    for (c, b) in ballots {
        match (own, b) {
            (Some(o), Ballot::Granted { position: Some(p) }) if *p == o => live.push(c.clone()),
            _ => stale.push(c.clone()),
        }
    }
    (live, stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_votes_once_per_epoch_and_never_for_an_old_one() {
        let s = VoteState { epoch: 3, voted_for: None };
        assert_eq!(grant(&s, 3, "n2"), Err(Refused { epoch: 3 }), "a fenced epoch is spent");
        let s = grant(&s, 4, "n2").expect("a new epoch");
        assert_eq!(grant(&s, 4, "n2").as_ref(), Ok(&s), "the same vote again");
        assert_eq!(grant(&s, 4, "n3"), Err(Refused { epoch: 4 }), "a second candidate at the same epoch");
        assert_eq!(grant(&s, 2, "n3"), Err(Refused { epoch: 4 }));
        assert_eq!(grant(&s, 5, "n3").expect("later").voted_for.as_deref(), Some("n3"));
    }

    #[test]
    fn after_a_granted_takeover_only_copies_at_the_new_primarys_exact_position_stay_live() {
        let at = |seq| Some(Position { epoch: 2, stream: 7, seq });
        let ballots = vec![
            ("b".to_owned(), Ballot::Granted { position: at(10) }),
            ("c".to_owned(), Ballot::Granted { position: at(12) }),
            ("d".to_owned(), Ballot::Granted { position: None }),
            ("e".to_owned(), Ballot::Silent),
            ("f".to_owned(), Ballot::Refused { epoch: 9 }),
        ];
        let stale: Vec<String> = ["c", "d", "e", "f"].map(String::from).to_vec();
        assert_eq!(at_position(at(10), &ballots), (vec!["b".to_owned()], stale));
        let (live, stale) = at_position(None, &ballots);
        assert!(live.is_empty());
        assert_eq!(stale.len(), 5);
    }
}
