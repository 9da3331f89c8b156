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

/// Entries fetched from each node per round (rows here, version
/// summaries in [`super::versions`]).
pub(super) const ROUND: u32 = 1000;

/// A listing across nodes in rounds: the merged entries of the last round
/// still to hand out, and the key the next round starts from. Shared by
/// the listing of rows and the listing of versions.
pub(super) struct Rounds<T> {
    buf: VecDeque<(Vec<u8>, T)>,
    next_from: Option<Vec<u8>>,
}

impl<T> Rounds<T> {
    pub(super) fn new() -> Self {
        Rounds { buf: VecDeque::new(), next_from: None }
    }

    pub(super) fn seek(&mut self, from: &[u8]) {
        self.buf.clear();
        self.next_from = Some(from.to_vec());
    }

    /// The next entry; `fetch(from)` runs a round: the entries merged from
    /// every node in key order, and the last key all their answers cover
    /// (`None` when no answer was cut short; see [`lower_bound`]).
    pub(super) fn next(
        &mut self,
        mut fetch: impl FnMut(Vec<u8>) -> Result<(Vec<(Vec<u8>, T)>, Option<Vec<u8>>)>,
    ) -> Result<Option<(Vec<u8>, T)>> {
        loop {
            if let Some(x) = self.buf.pop_front() {
                return Ok(Some(x));
            }
            let Some(from) = self.next_from.take() else { return Ok(None) };
            let (entries, bound) = fetch(from)?;
            for (k, v) in entries {
                if bound.as_ref().is_some_and(|b| &k > b) {
                    break;
                }
                self.buf.push_back((k, v));
            }
            self.next_from = bound.map(|mut b| {
                b.push(0);
                b
            });
        }
    }
}

/// A node's answer of `len` entries ending at key `last` was cut short
/// (it holds [`ROUND`]): later keys wait for the next round.
pub(super) fn lower_bound(bound: &mut Option<Vec<u8>>, len: usize, last: Option<&Vec<u8>>) {
    if len >= ROUND as usize
        && let Some(last) = last
        && bound.as_ref().is_none_or(|b| last < b)
    {
        *bound = Some(last.clone());
    }
}

/// Sends `req` to every node, from a cursor on the blocking pool.
pub(super) fn ask_every_node(
    coord: &Coordinator,
    rt: &tokio::runtime::Handle,
    req: Req,
) -> Vec<(NodeId, Result<Msg<Resp>>)> {
    let node = coord.node.clone();
    rt.block_on(async move {
        let calls = node.all_nodes().into_iter().map(|n| {
            let (node, req) = (node.clone(), req.clone());
            async move { (n, node.call(n, Msg::new(req)).await) }
        });
        futures::future::join_all(calls).await
    })
}

struct ClusterCursor {
    coord: Arc<Coordinator>,
    rt: tokio::runtime::Handle,
    bucket: String,
    prefix: Vec<u8>,
    rounds: Rounds<ObjectSummary>,
}

/// One round of [`ClusterCursor`]: every node's rows of `bucket` from
/// `from`, the newest of each key, deleted keys left out.
fn fetch_rows(
    coord: &Coordinator,
    rt: &tokio::runtime::Handle,
    bucket: &str,
    prefix: &[u8],
    from: Vec<u8>,
) -> Result<(Vec<(Vec<u8>, ObjectSummary)>, Option<Vec<u8>>)> {
    let req = Req::ListRaw { bucket: bucket.to_owned(), from, prefix: prefix.to_vec(), limit: ROUND };
    let mut answered: HashSet<NodeId> = HashSet::new();
    let mut merged: BTreeMap<Vec<u8>, RawEntry> = BTreeMap::new();
    let mut bound: Option<Vec<u8>> = None;
    for (n, r) in ask_every_node(coord, rt, req) {
        let Ok(Msg { head: Resp::Raw(rows), .. }) = r else { continue };
        answered.insert(n);
        lower_bound(&mut bound, rows.len(), rows.last().map(|(k, _)| k));
        for (k, e) in rows {
            match merged.get(&k) {
                Some(cur) if cur.version >= e.version => {}
                _ => {
                    merged.insert(k, e);
                }
            }
        }
    }
    coord.check_coverage(&answered, "listing")?;
    let live = merged.into_iter().filter_map(|(k, e)| e.summary.map(|s| (k, s))).collect();
    Ok((live, bound))
}

impl Cursor for ClusterCursor {
    type Value = ObjectSummary;
    type Error = LightningError;

    fn seek(&mut self, from: &[u8]) -> Result<()> {
        self.rounds.seek(from);
        Ok(())
    }

    fn next(&mut self) -> Result<Option<(Vec<u8>, ObjectSummary)>> {
        let (coord, rt, bucket, prefix) = (&self.coord, &self.rt, &self.bucket, &self.prefix);
        self.rounds.next(|from| fetch_rows(coord, rt, bucket, prefix, from))
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
            rounds: Rounds::new(),
        };
        tokio::task::spawn_blocking(move || listing::list(&mut cur, &q))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))?
    }
}
