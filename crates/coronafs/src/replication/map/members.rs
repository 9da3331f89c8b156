//! The map's own Raft group: how it is founded, and nodes joining and
//! leaving it (`coronafs cluster add-node` / `remove-node`).
//!
//! Founding: a node whose store is pristine asks the other nodes of its
//! cluster file whether they hold a map. If one does, the group exists and
//! this node waits: its leader reaches it if the node is a member, and
//! `add-node` makes it one if not. Otherwise, once a majority of the file
//! (this node included) answered that it holds none, it founds the group
//! with every node of the file as a voter; nodes that do so at the same
//! moment found it with the same membership, which openraft allows. A lone
//! new node whose peers are all down founds nothing.
//!
//! Joining: the leader adds the node as a learner, waits until it has the
//! log, then makes it a voter. Leaving: the leader refuses to remove the
//! last voter, a volume's primary, or a copy its volume cannot spare
//! ([`removal_refused`]); a removed node keeps its copies (the data path
//! does not go through the map) until they are replaced.

use super::net::{Answer, Conn, ProposeError, Request};
use super::state::VolumeMap;
use super::{Cfg, MapNode, NodeId, Peer, node_id};
use crate::replica::auth::RpcSecret;
use openraft::Raft;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// A change of the group's voters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemberChange {
    /// Make this node (its name and replica address) a voter.
    Add(Peer),
    /// Take the node of this name out of the group.
    Remove(String),
}

/// Why `node` may not leave a group of `voters` voters holding `map`, if
/// it may not.
pub fn removal_refused(map: &VolumeMap, node: &str, voters: usize) -> Option<String> {
    if voters <= 1 {
        return Some(format!("{node} is the volume map's last voter"));
    }
    for (name, st) in &map.volumes {
        if st.primary == node {
            return Some(format!(
                "{node} is the primary of volume {name}; promote another copy there first \
                 (coronafs volume promote {name} on that node)"
            ));
        }
        if st.copies.iter().any(|c| c == node) && st.copies.len() - 1 < st.quorum {
            return Some(format!(
                "volume {name} would keep {} of its copies, fewer than its write quorum of {}; \
                 replace the copy first (coronafs volume replace-copy {name} {node})",
                st.copies.len() - 1,
                st.quorum
            ));
        }
    }
    None
}

/// Founds the group if no other node of the file holds it and a majority
/// of the file holds none, retrying every `retry` until one of the two is
/// known (see the module doc).
pub(super) async fn found(
    raft: Raft<Cfg>,
    me: NodeId,
    peers: BTreeMap<NodeId, Peer>,
    secret: Arc<RpcSecret>,
    retry: Duration,
) {
    let majority = peers.len() / 2 + 1;
    let mut conns: BTreeMap<NodeId, Conn> = peers
        .iter()
        .filter(|(id, _)| **id != me)
        .map(|(id, p)| (*id, Conn::new(p.addr.clone(), secret.clone())))
        .collect();
    let mut said_waiting = false;
    loop {
        if raft.is_initialized().await.unwrap_or(true) {
            return;
        }
        let mut pristine = 1;
        for conn in conns.values_mut() {
            match conn.call(&Request::Standing, Duration::from_secs(1)).await {
                Ok(Answer::Standing { holds_map: true }) => {
                    tracing::info!(
                        "another node holds the volume map: this node waits for its leader \
                         (coronafs cluster add-node makes a new node a member)"
                    );
                    return;
                }
                Ok(Answer::Standing { holds_map: false }) => pristine += 1,
                _ => {}
            }
        }
        if pristine >= majority {
            match raft.initialize(peers.clone()).await {
                Ok(()) => tracing::info!(voters = peers.len(), "founded the volume map"),
                Err(e) => tracing::debug!(error = %e, "the volume map was founded meanwhile"),
            }
            return;
        }
        if !said_waiting {
            tracing::info!(
                answered = pristine,
                needed = majority,
                "waiting for a majority of the cluster file to found the volume map"
            );
            said_waiting = true;
        }
        tokio::time::sleep(retry).await;
    }
}

impl MapNode {
    /// The group's voters by name.
    pub fn voters(&self) -> Vec<String> {
        let m = self.raft.metrics().borrow().membership_config.clone();
        m.membership().voter_ids().map(|id| self.peer_name(id)).collect()
    }

    /// Applies `change` through the leader (forwarding it when this node is
    /// not the leader), for at most `deadline`; the voters after it.
    pub async fn change_members(&self, change: MemberChange, deadline: Duration) -> Result<Vec<String>, ProposeError> {
        let until = tokio::time::Instant::now() + deadline;
        let mut last = ProposeError::NotLeader(None);
        while tokio::time::Instant::now() < until {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let leader = self.raft.metrics().borrow().current_leader;
            let r = match leader {
                Some(l) if l == self.me => None,
                Some(l) => Some(l),
                None => {
                    tokio::time::sleep(self.timing.heartbeat.min(Duration::from_millis(100))).await;
                    continue;
                }
            };
            let r = match r {
                None => tokio::time::timeout(left, self.change_members_here(change.clone()))
                    .await
                    .unwrap_or_else(|_| Err(ProposeError::Failed("the change did not finish in time".into()))),
                Some(l) => {
                    let addr = self.peer(l).map(|p| p.addr).unwrap_or_default();
                    let mut conn = Conn::new(addr, self.secret.clone());
                    match conn.call(&Request::Members(change.clone()), left).await {
                        Ok(Answer::Members(r)) => r,
                        Ok(_) => Err(ProposeError::Failed("a map answer of the wrong kind".into())),
                        Err((_, e)) => {
                            // The leader may have changed: ask again.
                            last = ProposeError::Failed(format!("forwarding to the leader: {e}"));
                            tokio::time::sleep(self.timing.heartbeat.min(Duration::from_millis(100))).await;
                            continue;
                        }
                    }
                }
            };
            // Only a leader that turned out not to lead is asked again: a
            // change the leader tried and failed stays failed.
            match r {
                Err(e @ ProposeError::NotLeader(_)) => last = e,
                r => return r,
            }
            tokio::time::sleep(self.timing.heartbeat.min(Duration::from_millis(100))).await;
        }
        Err(last)
    }

    /// Applies `change` as the leader (the receiving end of a forward too).
    pub async fn change_members_here(&self, change: MemberChange) -> Result<Vec<String>, ProposeError> {
        if self.leading.lock().map_err(|_| ProposeError::Failed("poisoned".into()))?.is_none() {
            return Err(ProposeError::NotLeader(self.raft.metrics().borrow().current_leader));
        }
        let membership = self.raft.metrics().borrow().membership_config.membership().clone();
        let mut voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let failed = |e: &dyn std::fmt::Display| ProposeError::Failed(e.to_string());
        match change {
            MemberChange::Add(peer) => {
                let id = node_id(&peer.name);
                if let Some(known) = membership.get_node(&id).filter(|n| n.name != peer.name) {
                    return Err(ProposeError::Refused(format!(
                        "{} has the same map id as {}; rename one of them",
                        peer.name, known.name
                    )));
                }
                if voters.contains(&id) {
                    return Ok(self.voters());
                }
                let name = peer.name.clone();
                // The learner must hold the log up to its own addition
                // before it counts as a voter (openraft's blocking
                // add_learner gives up waiting after a while and still
                // answers Ok, so the wait is ours).
                let caught_up = async {
                    let resp = self.raft.add_learner(id, peer, false).await.map_err(|e| failed(&e))?;
                    let want = resp.log_id.index;
                    self.raft
                        .wait(Some(self.election_patience()))
                        .metrics(
                            |m| {
                                m.replication
                                    .as_ref()
                                    .and_then(|r| r.get(&id).cloned().flatten())
                                    .is_some_and(|l| l.index >= want)
                            },
                            "the new learner to take the log",
                        )
                        .await
                        .map_err(|_| {
                            ProposeError::Failed(format!(
                                "{name} did not take the map's log in time: is it running, with this cluster's secret?"
                            ))
                        })
                };
                if let Err(e) = caught_up.await {
                    // Nothing half-made: the learner goes again.
                    let _ = tokio::time::timeout(
                        self.election_patience(),
                        self.raft.change_membership(openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id])), false),
                    )
                    .await;
                    return Err(e);
                }
                voters.insert(id);
            }
            MemberChange::Remove(name) => {
                let id = node_id(&name);
                if !voters.contains(&id) {
                    return Err(ProposeError::Refused(format!("{name} is not a voter of the volume map")));
                }
                if let Some(why) = removal_refused(&self.machine.map(), &name, voters.len()) {
                    return Err(ProposeError::Refused(why));
                }
                voters.remove(&id);
            }
        }
        self.raft.change_membership(voters, false).await.map_err(|e| failed(&e))?;
        Ok(self.voters())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::map::state::VolumeState;

    fn map(copies: &[&str], quorum: usize) -> VolumeMap {
        let mut m = VolumeMap::default();
        m.volumes.insert(
            "vm1".into(),
            VolumeState {
                copies: copies.iter().map(|c| c.to_string()).collect(),
                epoch: 1,
                primary: copies[0].into(),
                in_sync: copies.iter().map(|c| c.to_string()).collect(),
                quorum,
                renewals: 0,
                out_since: Default::default(),
            },
        );
        m
    }

    #[test]
    fn a_node_may_leave_unless_it_is_a_primary_a_copy_its_volume_needs_or_the_last_voter() {
        let three = map(&["a", "b", "c"], 2);
        assert_eq!(removal_refused(&three, "c", 3), None, "a spare copy and a voter to spare");
        assert_eq!(removal_refused(&three, "d", 4), None, "a node with no copy");
        let why = removal_refused(&three, "a", 3).expect("the primary stays");
        assert!(why.contains("primary of volume vm1"), "{why}");
        let two = map(&["a", "b"], 2);
        let why = removal_refused(&two, "b", 3).expect("a copy the quorum needs stays");
        assert!(why.contains("would keep 1 of its copies, fewer than its write quorum of 2"), "{why}");
        let why = removal_refused(&VolumeMap::default(), "a", 1).expect("the last voter stays");
        assert!(why.contains("last voter"), "{why}");
    }
}
