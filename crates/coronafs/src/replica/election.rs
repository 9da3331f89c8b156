//! Failover elections, sans-IO: how a copy answers a candidate's VOTE
//! ([`grant`]) and how a candidate counts the answers ([`decide`]).
//!
//! One decision per epoch, by a majority of the volume's copies: a copy
//! grants at most one vote per epoch (its [`VoteState`] is persisted before
//! it answers), so two candidates can never both gather a majority of the
//! same epoch, as any two majorities share a copy. A candidate wins only if
//! no voter is further in the write stream than itself: a voter further on
//! may hold flushed writes the candidate lacks. See
//! docs/design/replication-volumes.md.
//!
//! Automatic failover adds a step before the vote ([`stand`]): a copy that
//! stopped hearing its primary first probes the other copies, and stands
//! only if none still hears the primary, a majority answered, and no copy
//! is further in the stream (or as far and first by name), so of the copies
//! that see the same answers only the best-placed one stands.

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

/// The result of an election, as the candidate decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The candidate is the primary at the epoch: `live` are the other
    /// copies at exactly its position (they hold identical bytes), `stale`
    /// the rest.
    Won { live: Vec<String>, stale: Vec<String> },
    /// The candidate lost; why, for the operator.
    Lost(String),
}

/// Counts the ballots of an election at some epoch. `copies` are every copy
/// of the volume (the candidate included); `own` the candidate's position;
/// `ballots` the other copies' answers (a copy without one is silent). The
/// candidate's own vote is assumed granted (it persisted it first).
pub fn decide(copies: &[String], candidate: &str, own: Option<Position>, ballots: &[(String, Ballot)]) -> Outcome {
    if !copies.iter().any(|c| c == candidate) {
        return Outcome::Lost(format!("{candidate} holds no copy of the volume"));
    }
    let Some(own) = own else {
        return Outcome::Lost(format!(
            "{candidate} does not know its place in the write stream (it restarted since its primary last wrote)"
        ));
    };
    let ballot = |c: &str| ballots.iter().find(|(n, _)| n == c).map(|(_, b)| b);
    let mut votes = 1;
    let mut live = Vec::new();
    let mut stale = Vec::new();
    for c in copies.iter().filter(|c| *c != candidate) {
        match ballot(c) {
            Some(Ballot::Granted { position }) => {
                votes += 1;
                match position {
                    Some(p) if *p > own => {
                        return Outcome::Lost(format!(
                            "{c} is further in the write stream ({p:?}) than {candidate} ({own:?}): promote {c}"
                        ));
                    }
                    Some(p) if *p == own => live.push(c.clone()),
                    _ => stale.push(c.clone()),
                }
            }
            _ => stale.push(c.clone()),
        }
    }
    let majority = copies.len() / 2 + 1;
    if votes < majority {
        let higher = ballots.iter().filter_map(|(_, b)| match b {
            Ballot::Refused { epoch } => Some(*epoch),
            _ => None,
        });
        let hint = higher.max().map(|e| format!("; a copy is at epoch {e}")).unwrap_or_default();
        return Outcome::Lost(format!("{votes} votes of {} copies, a majority is {majority}{hint}", copies.len()));
    }
    Outcome::Won { live, stale }
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

/// One copy's answer to a probe, as the probing copy received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The copy no longer hears the primary either and is at `position`
    /// (`None`: it does not know).
    Willing { position: Option<Position> },
    /// The copy is the primary, or heard from it within the failover timeout.
    Busy,
    /// No answer (down, partitioned, timed out).
    Silent,
}

/// Whether copy `me`, at `own`, should stand for election after probing
/// the other copies of `copies`: `Ok(())` to stand, or why not.
pub fn stand(copies: &[String], me: &str, own: Option<Position>, probes: &[(String, Probe)]) -> Result<(), String> {
    let Some(own) = own else {
        return Err(format!("{me} does not know its place in the write stream"));
    };
    let mut willing = 1;
    for c in copies.iter().filter(|c| *c != me) {
        match probes.iter().find(|(n, _)| n == c).map(|(_, p)| p) {
            Some(Probe::Busy) => return Err(format!("{c} is the primary or still hears it")),
            Some(Probe::Willing { position }) => {
                willing += 1;
                match position {
                    Some(p) if *p > own => return Err(format!("{c} is further in the write stream")),
                    Some(p) if *p == own && c.as_str() < me => {
                        return Err(format!("{c} is as far in the write stream and comes first by name"));
                    }
                    _ => {}
                }
            }
            Some(Probe::Silent) | None => {}
        }
    }
    let majority = copies.len() / 2 + 1;
    if willing < majority {
        return Err(format!("{willing} of {} copies answered, a majority is {majority}", copies.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(at_position(at(10), &ballots), (vec!["b".to_owned()], vec!["c".into(), "d".into(), "e".into(), "f".into()]));
        let (live, stale) = at_position(None, &ballots);
        assert!(live.is_empty());
        assert_eq!(stale.len(), 5);
    }
    use proptest::prelude::*;

    fn pos(seq: u64) -> Option<Position> {
        Some(Position { epoch: 1, stream: 7, seq })
    }

    fn names(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("n{i}")).collect()
    }

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
    fn a_candidate_with_a_majority_at_the_highest_position_wins_with_the_equal_copies_live() {
        let ballots = [("n3".to_owned(), Ballot::Granted { position: pos(9) }), ("n1".to_owned(), Ballot::Silent)];
        assert_eq!(
            decide(&names(3), "n2", pos(9), &ballots),
            Outcome::Won { live: vec!["n3".into()], stale: vec!["n1".into()] }
        );
        let behind = [("n3".to_owned(), Ballot::Granted { position: pos(4) })];
        assert_eq!(
            decide(&names(3), "n2", pos(9), &behind),
            Outcome::Won { live: vec![], stale: vec!["n1".into(), "n3".into()] }
        );
        let unknown = [("n3".to_owned(), Ballot::Granted { position: None })];
        assert!(matches!(decide(&names(3), "n2", pos(9), &unknown), Outcome::Won { live, .. } if live.is_empty()));
    }

    #[test]
    fn a_candidate_behind_a_voter_or_without_a_majority_or_a_position_loses() {
        let ahead = [("n3".to_owned(), Ballot::Granted { position: pos(10) })];
        let Outcome::Lost(why) = decide(&names(3), "n2", pos(9), &ahead) else { panic!("won behind a voter") };
        assert!(why.contains("promote n3"), "{why}");
        let refused = [("n3".to_owned(), Ballot::Refused { epoch: 6 }), ("n1".to_owned(), Ballot::Silent)];
        let Outcome::Lost(why) = decide(&names(3), "n2", pos(9), &refused) else { panic!("won alone") };
        assert!(why.contains("epoch 6"), "{why}");
        let granted = [("n3".to_owned(), Ballot::Granted { position: pos(1) })];
        assert!(matches!(decide(&names(3), "n2", None, &granted), Outcome::Lost(_)));
        assert!(matches!(decide(&names(3), "n9", pos(9), &granted), Outcome::Lost(_)), "not a copy");
        // A ballot from a node that holds no copy counts for nothing.
        let outsider = [("n9".to_owned(), Ballot::Granted { position: pos(9) })];
        assert!(matches!(decide(&names(3), "n2", pos(9), &outsider), Outcome::Lost(_)));
    }

    #[test]
    fn only_the_best_placed_copy_that_a_majority_answered_stands() {
        let willing = |seq| Probe::Willing { position: pos(seq) };
        let all = |a, b| vec![("n1".to_owned(), Probe::Silent), ("n2".to_owned(), a), ("n3".to_owned(), b)];
        // n2 and n3 at the same place: n2 (first by name) stands, n3 does not.
        assert_eq!(stand(&names(3), "n2", pos(5), &all(Probe::Silent, willing(5))), Ok(()));
        let e = stand(&names(3), "n3", pos(5), &all(willing(5), Probe::Silent)).expect_err("n2 comes first");
        assert!(e.contains("first by name"), "{e}");
        // The copy further on stands, whatever its name.
        assert_eq!(stand(&names(3), "n3", pos(6), &all(willing(5), Probe::Silent)), Ok(()));
        assert!(stand(&names(3), "n2", pos(5), &all(Probe::Silent, willing(6))).is_err());
        // A copy that still hears the primary stops everyone.
        let e = stand(&names(3), "n2", pos(9), &all(Probe::Silent, Probe::Busy)).expect_err("busy");
        assert!(e.contains("still hears"), "{e}");
        // Alone, or without a position, no copy stands.
        let e = stand(&names(3), "n2", pos(9), &all(Probe::Silent, Probe::Silent)).expect_err("alone");
        assert!(e.contains("majority"), "{e}");
        assert!(stand(&names(3), "n2", None, &all(Probe::Silent, willing(1))).is_err());
        // A copy that does not know its place does not stop a copy that does.
        assert_eq!(stand(&names(3), "n3", pos(1), &all(Probe::Willing { position: None }, Probe::Silent)), Ok(()));
    }

    proptest! {
        /// Every copy probes every other one and all answers arrive: at most
        /// one copy stands, and it is at the highest position there is.
        #[test]
        fn of_copies_that_hear_each_other_at_most_one_stands_and_it_is_furthest(
            n in 1usize..7,
            seqs in proptest::collection::vec(proptest::option::of(0u64..4), 7),
        ) {
            let copies = names(n);
            let at = |i: usize| seqs[i].and_then(pos);
            let standing: Vec<usize> = (0..n)
                .filter(|&me| {
                    let probes: Vec<(String, Probe)> = (0..n)
                        .filter(|&o| o != me)
                        .map(|o| (copies[o].clone(), Probe::Willing { position: at(o) }))
                        .collect();
                    stand(&copies, &copies[me], at(me), &probes).is_ok()
                })
                .collect();
            prop_assert!(standing.len() <= 1, "{:?} stand", standing);
            let best = (0..n).map(at).max().flatten();
            if let Some(&w) = standing.first() {
                prop_assert_eq!(at(w), best);
            } else {
                prop_assert!(best.is_none(), "nobody stands though a copy knows its place");
            }
        }
    }

    proptest! {
        /// Copies answer the candidates' requests in any interleaving (some
        /// requests lost); each candidate counts what it got. At most one
        /// wins each epoch, and a winner is never behind one of its voters.
        #[test]
        fn no_two_candidates_win_the_same_epoch_and_a_winner_is_never_behind_its_voters(
            n in 1usize..6,
            seqs in proptest::collection::vec(0u64..4, 6),
            start in proptest::collection::vec(0u64..3, 6),
            requests in proptest::collection::vec((0usize..6, 0usize..6, 1u64..5, any::<bool>()), 0..60),
        ) {
            let copies = names(n);
            let mut states: Vec<VoteState> = start[..n].iter().map(|&e| VoteState { epoch: e, voted_for: None }).collect();
            // A candidate's campaign at an epoch: the ballots it received.
            let mut campaigns: std::collections::BTreeMap<(usize, u64), Vec<(String, Ballot)>> = Default::default();
            for (cand, voter, epoch, delivered) in requests {
                let (cand, voter) = (cand % n, voter % n);
                let key = (cand, epoch);
                if let std::collections::btree_map::Entry::Vacant(slot) = campaigns.entry(key) {
                    // The candidate votes for itself first; if it cannot, it
                    // does not campaign at this epoch.
                    match grant(&states[cand], epoch, &copies[cand]) {
                        Ok(s) => {
                            states[cand] = s;
                            slot.insert(Vec::new());
                        }
                        Err(_) => continue,
                    }
                }
                if voter == cand {
                    continue;
                }
                let answer = match grant(&states[voter], epoch, &copies[cand]) {
                    Ok(s) => { states[voter] = s; Ballot::Granted { position: pos(seqs[voter]) } }
                    Err(r) => Ballot::Refused { epoch: r.epoch },
                };
                if delivered && let Some(b) = campaigns.get_mut(&key) {
                    b.retain(|(v, _)| *v != copies[voter]);
                    b.push((copies[voter].clone(), answer));
                }
            }
            let mut winners: std::collections::BTreeMap<u64, usize> = Default::default();
            for ((cand, epoch), ballots) in &campaigns {
                if let Outcome::Won { live, .. } = decide(&copies, &copies[*cand], pos(seqs[*cand]), ballots) {
                    prop_assert!(winners.insert(*epoch, *cand).is_none(), "two winners at epoch {}", epoch);
                    for (_, b) in ballots {
                        if let Ballot::Granted { position } = b {
                            prop_assert!(*position <= pos(seqs[*cand]), "a winner behind its voter");
                        }
                    }
                    for l in live {
                        let i = copies.iter().position(|c| *c == l).expect("a copy");
                        prop_assert_eq!(seqs[i], seqs[*cand]);
                    }
                }
            }
        }
    }
}
