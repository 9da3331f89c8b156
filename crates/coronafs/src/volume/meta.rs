//! The metadata store: the [`Catalog`] in redb (`meta.redb` in the data dir).
//!
//! Four tables: `volumes` (name -> JSON [`VolumeRec`]), `snapshots`
//! (`VOL@SNAP` -> JSON [`SnapRec`]), `layers` (id -> JSON [`LayerRec`]) and
//! `counters` (`next_layer`). A change is written as the difference between
//! two catalogs in one write transaction, so it is all there or none of it.
//!
//! `deletions` (name -> JSON [`Deletion`]) names the copies on other nodes a
//! deleted replicated volume still has; it is part of the catalog, so a
//! deletion and the record of what it still has to reach commit together.
//!
//! A further table, `replication` (name -> JSON [`DrlRecord`]), holds what a
//! replicated volume's primary keeps of its copies (the clean-shutdown mark
//! and the dirty-region log). It is written by transactions of its own, never
//! by a catalog commit, so the two never overwrite each other's changes.

use super::catalog::{Catalog, Deletion, LayerRec, SnapRec, VolumeRec};
use crate::backend::replicated::drl::DrlRecord;
use crate::error::{CoronaError, Result};
use redb::{Database, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::Path;

const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const LAYERS: TableDefinition<u64, &[u8]> = TableDefinition::new("layers");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
const REPLICATION: TableDefinition<&str, &[u8]> = TableDefinition::new("replication");
const DELETIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("deletions");

fn err(e: impl Into<redb::Error>) -> CoronaError {
    CoronaError::Meta(e.into().to_string())
}

fn decode<T: DeserializeOwned>(what: &str, b: &[u8]) -> Result<T> {
    serde_json::from_slice(b).map_err(|e| CoronaError::Meta(format!("corrupt {what} record: {e}")))
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| CoronaError::Meta(e.to_string()))
}

#[derive(Debug)]
pub struct Meta {
    db: Database,
}

impl Meta {
    /// Opens (or creates) the store and its tables.
    pub fn open(path: &Path) -> Result<Self> {
        let db = Database::create(path).map_err(err)?;
        let tx = db.begin_write().map_err(err)?;
        {
            tx.open_table(VOLUMES).map_err(err)?;
            tx.open_table(SNAPSHOTS).map_err(err)?;
            tx.open_table(LAYERS).map_err(err)?;
            tx.open_table(COUNTERS).map_err(err)?;
            tx.open_table(REPLICATION).map_err(err)?;
            tx.open_table(DELETIONS).map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(Meta { db })
    }

    /// Reads the whole catalog.
    pub fn load(&self) -> Result<Catalog> {
        let tx = self.db.begin_read().map_err(err)?;
        let mut c = Catalog::default();
        for r in tx.open_table(VOLUMES).map_err(err)?.iter().map_err(err)? {
            let (k, v) = r.map_err(err)?;
            c.volumes.insert(k.value().to_owned(), decode::<VolumeRec>("volume", v.value())?);
        }
        for r in tx.open_table(SNAPSHOTS).map_err(err)?.iter().map_err(err)? {
            let (k, v) = r.map_err(err)?;
            c.snapshots.insert(k.value().to_owned(), decode::<SnapRec>("snapshot", v.value())?);
        }
        for r in tx.open_table(LAYERS).map_err(err)?.iter().map_err(err)? {
            let (k, v) = r.map_err(err)?;
            c.layers.insert(k.value(), decode::<LayerRec>("layer", v.value())?);
        }
        for r in tx.open_table(DELETIONS).map_err(err)?.iter().map_err(err)? {
            let (k, v) = r.map_err(err)?;
            c.deletions.insert(k.value().to_owned(), decode::<Deletion>("deletion", v.value())?);
        }
        c.next_layer = tx.open_table(COUNTERS).map_err(err)?.get("next_layer").map_err(err)?.map_or(1, |v| v.value());
        Ok(c)
    }

    /// Writes `new` over `old` in one durable transaction.
    pub fn commit(&self, old: &Catalog, new: &Catalog) -> Result<()> {
        let tx = self.db.begin_write().map_err(err)?;
        {
            let mut t = tx.open_table(VOLUMES).map_err(err)?;
            diff(&old.volumes, &new.volumes, |k, v| match v {
                Some(v) => t.insert(k.as_str(), encode(v)?.as_slice()).map(drop).map_err(err),
                None => t.remove(k.as_str()).map(drop).map_err(err),
            })?;
            let mut t = tx.open_table(SNAPSHOTS).map_err(err)?;
            diff(&old.snapshots, &new.snapshots, |k, v| match v {
                Some(v) => t.insert(k.as_str(), encode(v)?.as_slice()).map(drop).map_err(err),
                None => t.remove(k.as_str()).map(drop).map_err(err),
            })?;
            let mut t = tx.open_table(LAYERS).map_err(err)?;
            diff(&old.layers, &new.layers, |k, v| match v {
                Some(v) => t.insert(*k, encode(v)?.as_slice()).map(drop).map_err(err),
                None => t.remove(*k).map(drop).map_err(err),
            })?;
            let mut t = tx.open_table(DELETIONS).map_err(err)?;
            diff(&old.deletions, &new.deletions, |k, v| match v {
                Some(v) => t.insert(k.as_str(), encode(v)?.as_slice()).map(drop).map_err(err),
                None => t.remove(k.as_str()).map(drop).map_err(err),
            })?;
            if old.next_layer != new.next_layer {
                tx.open_table(COUNTERS).map_err(err)?.insert("next_layer", new.next_layer).map_err(err)?;
            }
        }
        tx.commit().map_err(err)
    }
}

impl Meta {
    /// The replication record of volume `name`, if any.
    pub fn drl(&self, name: &str) -> Result<Option<DrlRecord>> {
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(REPLICATION).map_err(err)?;
        let v = t.get(name).map_err(err)?;
        v.map(|v| decode("replication", v.value())).transpose()
    }

    /// Replaces (`Some`) or removes (`None`) the replication record of
    /// `name`, durably, in a transaction of its own.
    pub fn put_drl(&self, name: &str, rec: Option<&DrlRecord>) -> Result<()> {
        let tx = self.db.begin_write().map_err(err)?;
        {
            let mut t = tx.open_table(REPLICATION).map_err(err)?;
            match rec {
                Some(r) => t.insert(name, encode(r)?.as_slice()).map(drop).map_err(err)?,
                None => t.remove(name).map(drop).map_err(err)?,
            }
        }
        tx.commit().map_err(err)
    }
}

/// Calls `f` for every key added, changed (`Some`) or removed (`None`).
fn diff<K: Ord, V: PartialEq>(
    old: &BTreeMap<K, V>,
    new: &BTreeMap<K, V>,
    mut f: impl FnMut(&K, Option<&V>) -> Result<()>,
) -> Result<()> {
    for (k, v) in new {
        if old.get(k) != Some(v) {
            f(k, Some(v))?;
        }
    }
    for k in old.keys() {
        if !new.contains_key(k) {
            f(k, None)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_committed_catalog_reads_back_after_reopening() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("meta.redb");
        let m = Meta::open(&path).expect("open");
        let empty = m.load().expect("load");
        let mut c = empty.clone();
        let id = c.alloc_layer();
        c.layers.insert(id, LayerRec { file: "layers/1.data".into(), size: 10, parent: None, parent_limit: 0 });
        c.volumes.insert("v".into(), VolumeRec { size: 10, head: id, epoch: 3, ..Default::default() });
        c.snapshots.insert("v@s".into(), SnapRec { layer: id, size: 10, missing: Vec::new() });
        c.deletions.insert("gone".into(), Deletion { nodes: vec!["n3".into()], epoch: 2 });
        m.commit(&empty, &c).expect("commit");
        let mut d = c.clone();
        d.snapshots.clear();
        m.commit(&c, &d).expect("commit removal");
        drop(m);
        let back = Meta::open(&path).expect("reopen").load().expect("load");
        assert_eq!(back, d);
    }
}
