//! Where a node keeps its part of the volume map's Raft group: the log, the
//! vote and the commit index in `.volume-map/raft.redb` in the data dir (a
//! name no volume can have, so it is never taken for a raw volume file) (every change one
//! durable redb commit, so a vote or an appended entry survives a power
//! loss before it is answered), and the state machine in memory, rebuilt at
//! start from the last snapshot (kept in the same file) and the committed
//! log after it.

// openraft's traits fix these error types (StorageError, RPCError), large as they are.
#![allow(clippy::result_large_err)]

use super::state::{Command, Outcome, VolumeMap};
use super::{Cfg, NodeId, Peer};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership, Vote,
};
use redb::{Database, ReadableTable, TableDefinition};

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

type SErr = StorageError<NodeId>;

fn rd(e: impl std::fmt::Display) -> SErr {
    StorageIOError::read(&std::io::Error::other(e.to_string())).into()
}

fn wr(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write(&std::io::Error::other(e.to_string())).into()
}

fn json<T: Serialize>(v: &T) -> Result<Vec<u8>, SErr> {
    serde_json::to_vec(v).map_err(wr)
}

fn unjson<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, SErr> {
    serde_json::from_slice(b).map_err(rd)
}

/// The directory of the map's store in a data dir.
pub const DIR: &str = ".volume-map";

/// The store, shared by the log and the machine, closed at the member's
/// shutdown whoever still holds a handle (a restarted server opens the
/// same file again at once).
#[derive(Debug, Clone)]
pub struct Db(Arc<std::sync::RwLock<Option<Arc<Database>>>>);

impl Db {
    fn get(&self) -> Result<Arc<Database>, SErr> {
        self.0.read().ok().and_then(|d| d.clone()).ok_or_else(|| rd("the volume map's store is closed"))
    }

    /// Closes the store (its file lock goes with the last transaction).
    pub fn close(&self) {
        if let Ok(mut d) = self.0.write() {
            d.take();
        }
    }
}

/// Opens (creates) the map's store in data dir `dir`.
pub fn open(dir: &Path) -> crate::Result<Db> {
    let dir = dir.join(DIR);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("raft.redb");
    let db = Database::create(&path).map_err(|e| crate::CoronaError::Meta(format!("{}: {e}", path.display())))?;
    let tx = db.begin_write().map_err(|e| crate::CoronaError::Meta(e.to_string()))?;
    {
        tx.open_table(LOG).map_err(|e| crate::CoronaError::Meta(e.to_string()))?;
        tx.open_table(META).map_err(|e| crate::CoronaError::Meta(e.to_string()))?;
    }
    tx.commit().map_err(|e| crate::CoronaError::Meta(e.to_string()))?;
    Ok(Db(Arc::new(std::sync::RwLock::new(Some(Arc::new(db))))))
}

fn get_meta<T: for<'de> Deserialize<'de>>(db: &Db, key: &str) -> Result<Option<T>, SErr> {
    let tx = db.get()?.begin_read().map_err(rd)?;
    let t = tx.open_table(META).map_err(rd)?;
    let v = t.get(key).map_err(rd)?;
    v.map(|v| unjson(v.value())).transpose()
}

fn put_meta<T: Serialize>(db: &Db, key: &str, v: &T) -> Result<(), SErr> {
    let bytes = json(v)?;
    let tx = db.get()?.begin_write().map_err(wr)?;
    {
        let mut t = tx.open_table(META).map_err(wr)?;
        t.insert(key, bytes.as_slice()).map_err(wr)?;
    }
    tx.commit().map_err(wr)
}

/// The log, vote and commit index.
#[derive(Debug, Clone)]
pub struct LogStore {
    db: Db,
}

impl LogStore {
    pub fn new(db: Db) -> Self {
        LogStore { db }
    }
}

impl RaftLogReader<Cfg> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<Cfg>>, SErr> {
        let tx = self.db.get()?.begin_read().map_err(rd)?;
        let t = tx.open_table(LOG).map_err(rd)?;
        let mut out = Vec::new();
        for row in t.range(range).map_err(rd)? {
            let (_, v) = row.map_err(rd)?;
            out.push(unjson(v.value())?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<Cfg> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<Cfg>, SErr> {
        let purged: Option<LogId<NodeId>> = get_meta(&self.db, "purged")?;
        let tx = self.db.get()?.begin_read().map_err(rd)?;
        let t = tx.open_table(LOG).map_err(rd)?;
        let last = match t.last().map_err(rd)? {
            Some((_, v)) => Some(unjson::<Entry<Cfg>>(v.value())?.log_id),
            None => purged,
        };
        Ok(LogState { last_purged_log_id: purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), SErr> {
        put_meta(&self.db, "vote", vote)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, SErr> {
        get_meta(&self.db, "vote")
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), SErr> {
        put_meta(&self.db, "committed", &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, SErr> {
        Ok(get_meta::<Option<LogId<NodeId>>>(&self.db, "committed")?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<Cfg>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<Cfg>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let tx = self.db.get()?.begin_write().map_err(wr)?;
        {
            let mut t = tx.open_table(LOG).map_err(wr)?;
            for e in entries {
                let bytes = json(&e)?;
                t.insert(e.log_id.index, bytes.as_slice()).map_err(wr)?;
            }
        }
        tx.commit().map_err(wr)?;
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        let tx = self.db.get()?.begin_write().map_err(wr)?;
        {
            let mut t = tx.open_table(LOG).map_err(wr)?;
            t.retain_in(log_id.index.., |_, _| false).map_err(wr)?;
        }
        tx.commit().map_err(wr)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        put_meta(&self.db, "purged", &Some(log_id))?;
        let tx = self.db.get()?.begin_write().map_err(wr)?;
        {
            let mut t = tx.open_table(LOG).map_err(wr)?;
            t.retain_in(..=log_id.index, |_, _| false).map_err(wr)?;
        }
        tx.commit().map_err(wr)
    }
}

/// What a snapshot holds, and what the state machine is.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Applied {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, Peer>,
    map: VolumeMap,
}

#[derive(Debug, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, Peer>,
    data: Vec<u8>,
}

/// The state machine: the map as of the last applied entry. Shared with the
/// node, which reads the map and when each lease was last renewed here.
#[derive(Debug)]
pub struct Machine {
    db: Db,
    state: Mutex<Applied>,
    /// When a renewal (or takeover) of each volume was last applied on this
    /// node: the leader's lease check reads it (`super::MapNode`).
    renewed: Mutex<HashMap<String, Instant>>,
    published: watch::Sender<Arc<VolumeMap>>,
    snapshots: Mutex<u64>,
}

impl Machine {
    /// The machine as of the snapshot stored in `db` (empty without one).
    pub fn load(db: Db) -> crate::Result<Arc<Self>> {
        let snap: Option<StoredSnapshot> =
            get_meta(&db, "snapshot").map_err(|e| crate::CoronaError::Meta(format!("the volume map's store: {e}")))?;
        let state = match snap {
            Some(s) => serde_json::from_slice(&s.data).map_err(|e| {
                crate::CoronaError::Meta(format!("the volume map's store holds a corrupt snapshot: {e}"))
            })?,
            None => Applied::default(),
        };
        let (published, _) = watch::channel(Arc::new(state.map.clone()));
        Ok(Arc::new(Machine {
            db,
            state: Mutex::new(state),
            renewed: Mutex::default(),
            published,
            snapshots: Mutex::new(0),
        }))
    }

    /// The map as this node has applied it (it may lag the leader's).
    pub fn map(&self) -> Arc<VolumeMap> {
        self.published.borrow().clone()
    }

    /// Waits at most `within` until the map applied here satisfies `done`;
    /// whether it did.
    pub async fn until(&self, within: Duration, done: impl Fn(&VolumeMap) -> bool) -> bool {
        let mut rx = self.published.subscribe();
        tokio::time::timeout(within, rx.wait_for(|m| done(m))).await.is_ok_and(|r| r.is_ok())
    }

    /// When a renewal or takeover of `volume` was last applied here.
    pub fn renewed_at(&self, volume: &str) -> Option<Instant> {
        self.renewed.lock().ok().and_then(|r| r.get(volume).copied())
    }

    fn locked(&self) -> Result<std::sync::MutexGuard<'_, Applied>, SErr> {
        self.state.lock().map_err(|_| rd("the map's state lock is poisoned"))
    }
}

/// The handle openraft drives the machine through.
#[derive(Debug, Clone)]
pub struct MachineStore(pub Arc<Machine>);

impl RaftSnapshotBuilder<Cfg> for MachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot<Cfg>, SErr> {
        let (data, last, membership) = {
            let st = self.0.locked()?;
            (json(&*st)?, st.last_applied, st.membership.clone())
        };
        let n = {
            let mut n = self.0.snapshots.lock().map_err(|_| rd("poisoned"))?;
            *n += 1;
            *n
        };
        let id = match last {
            Some(l) => format!("{}-{}-{n}", l.leader_id, l.index),
            None => format!("none-{n}"),
        };
        let meta = SnapshotMeta { last_log_id: last, last_membership: membership, snapshot_id: id };
        put_meta(&self.0.db, "snapshot", &StoredSnapshot { meta: meta.clone(), data: data.clone() })?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStateMachine<Cfg> for MachineStore {
    type SnapshotBuilder = MachineStore;

    async fn applied_state(&mut self) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Peer>), SErr> {
        let st = self.0.locked()?;
        Ok((st.last_applied, st.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Option<Outcome>>, SErr>
    where
        I: IntoIterator<Item = Entry<Cfg>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut out = Vec::new();
        let map = {
            let mut st = self.0.locked()?;
            for e in entries {
                st.last_applied = Some(e.log_id);
                match e.payload {
                    EntryPayload::Blank => out.push(None),
                    EntryPayload::Membership(m) => {
                        st.membership = StoredMembership::new(Some(e.log_id), m);
                        out.push(None);
                    }
                    EntryPayload::Normal(cmd) => {
                        let r = st.map.apply(&cmd);
                        if r.is_ok()
                            && matches!(cmd, Command::Renew { .. } | Command::TakeOver { .. })
                            && let Ok(mut renewed) = self.0.renewed.lock()
                        {
                            renewed.insert(cmd.volume().to_owned(), Instant::now());
                        }
                        out.push(Some(r));
                    }
                }
            }
            Arc::new(st.map.clone())
        };
        self.0.published.send_replace(map);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Peer>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let data = snapshot.into_inner();
        let applied: Applied = unjson(&data)?;
        put_meta(&self.0.db, "snapshot", &StoredSnapshot { meta: meta.clone(), data })?;
        let map = Arc::new(applied.map.clone());
        *self.0.locked()? = applied;
        self.0.published.send_replace(map);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<Cfg>>, SErr> {
        let snap: Option<StoredSnapshot> = get_meta(&self.0.db, "snapshot")?;
        Ok(snap.map(|s| Snapshot { meta: s.meta, snapshot: Box::new(Cursor::new(s.data)) }))
    }
}
