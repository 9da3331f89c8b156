//! Cluster listing: a [`Cursor`] that merges the raw rows (objects and
//! tombstones) of every node page by page, keeps the newest version of each
//! key, and drops deleted keys; the pure listing logic in
//! [`crate::listing`] runs on top unchanged.

use super::NodeId;
use super::coord::Coordinator;
use super::placement::Replication;
use super::rpc::{Msg, Req, Resp};
use crate::error::{LightningError, Result};
use crate::listing::{self, Cursor, ListPage, ListQuery};
use crate::meta::types::{ObjectSummary, RawEntry};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::Arc;

/// Rows fetched from each node per round.
const ROUND: u32 = 1000;

struct ClusterCursor {
    coord: Arc<Coordinator>,
    rt: tokio::runtime::Handle,
    bucket: String,
    prefix: Vec<u8>,
    buf: VecDeque<(Vec<u8>, ObjectSummary)>,
    next_from: Option<Vec<u8>>,
}

impl ClusterCursor {
    fn fetch(&mut self, from: Vec<u8>) -> Result<()> {
        let node = self.coord.node.clone();
        let (bucket, prefix) = (self.bucket.clone(), self.prefix.clone());
        let replies = self.rt.block_on(async move {
            let calls = node.all_nodes().into_iter().map(|n| {
                let node = node.clone();
                let req =
                    Req::ListRaw { bucket: bucket.clone(), from: from.clone(), prefix: prefix.clone(), limit: ROUND };
                async move { (n, node.call(n, Msg::new(req)).await) }
            });
            futures::future::join_all(calls).await
        });
        let mut answered: HashSet<NodeId> = HashSet::new();
        let mut merged: BTreeMap<Vec<u8>, RawEntry> = BTreeMap::new();
        let mut bound: Option<Vec<u8>> = None;
        for (n, r) in replies {
            let Ok(Msg { head: Resp::Raw(rows), .. }) = r else { continue };
            answered.insert(n);
            if rows.len() >= ROUND as usize
                && let Some((last, _)) = rows.last()
                && bound.as_ref().is_none_or(|b| last < b)
            {
                bound = Some(last.clone());
            }
            for (k, e) in rows {
                match merged.get(&k) {
                    Some(cur) if cur.version >= e.version => {}
                    _ => {
                        merged.insert(k, e);
                    }
                }
            }
        }
        self.coord.check_coverage(&answered, "listing")?;
        for (k, e) in merged {
            if bound.as_ref().is_some_and(|b| &k > b) {
                break;
            }
            if let Some(s) = e.summary {
                self.buf.push_back((k, s));
            }
        }
        self.next_from = bound.map(|mut b| {
            b.push(0);
            b
        });
        Ok(())
    }
}

impl Cursor for ClusterCursor {
    type Value = ObjectSummary;
    type Error = LightningError;

    fn seek(&mut self, from: &[u8]) -> Result<()> {
        self.buf.clear();
        self.next_from = Some(from.to_vec());
        Ok(())
    }

    fn next(&mut self) -> Result<Option<(Vec<u8>, ObjectSummary)>> {
        loop {
            if let Some(x) = self.buf.pop_front() {
                return Ok(Some(x));
            }
            let Some(from) = self.next_from.take() else { return Ok(None) };
            self.fetch(from)?;
        }
    }
}

impl Coordinator {
    /// Every partition must have a read quorum among the nodes that
    /// answered a request sent to every node (listings).
    pub fn check_coverage(&self, answered: &HashSet<NodeId>, what: &str) -> Result<()> {
        let l = self.node.layout();
        for p in 0..l.partitions() {
            let set = l.nodes_for(p);
            let got = set.iter().filter(|n| answered.contains(n)).count();
            let need = match self.node.consistency() {
                super::config::Consistency::Consistent => l.read_quorum().min(set.len()),
                super::config::Consistency::Degraded => 1,
            };
            if got < need {
                return Err(LightningError::Unavailable(format!(
                    "{what}: only {got} of {} replicas of partition {p} answered",
                    set.len()
                )));
            }
        }
        Ok(())
    }

    /// One listing page of a bucket across the cluster.
    pub async fn list(self: &Arc<Self>, bucket: &str, q: ListQuery) -> Result<ListPage<ObjectSummary>> {
        let mut cur = ClusterCursor {
            coord: self.clone(),
            rt: tokio::runtime::Handle::current(),
            bucket: bucket.to_owned(),
            prefix: q.prefix.clone(),
            buf: VecDeque::new(),
            next_from: None,
        };
        tokio::task::spawn_blocking(move || listing::list(&mut cur, &q))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }
}
