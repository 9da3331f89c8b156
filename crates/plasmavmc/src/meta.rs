//! Metadata in redb: images, volumes, VMs and the base cache, one table each,
//! keyed by id with JSON values (small records, rarely written).

use crate::error::{PlasmaError, Result};
use redb::{Database, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::path::Path;

pub const IMAGES: TableDefinition<&str, &[u8]> = TableDefinition::new("images");
pub const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
pub const VMS: TableDefinition<&str, &[u8]> = TableDefinition::new("vms");
pub const CACHE: TableDefinition<&str, &[u8]> = TableDefinition::new("cache");

pub type Table = TableDefinition<'static, &'static str, &'static [u8]>;

/// The metadata database.
#[derive(Debug)]
pub struct Meta {
    db: Database,
}

impl Meta {
    /// Opens (or creates) `dir/meta.redb` and makes sure every table exists.
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let db = Database::create(dir.join("meta.redb"))?;
        let tx = db.begin_write()?;
        for t in [IMAGES, VOLUMES, VMS, CACHE] {
            tx.open_table(t)?;
        }
        tx.commit()?;
        Ok(Meta { db })
    }

    pub fn get<T: DeserializeOwned>(&self, table: Table, id: &str) -> Result<Option<T>> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(table)?;
        match t.get(id)? {
            Some(v) => Ok(Some(serde_json::from_slice(v.value())?)),
            None => Ok(None),
        }
    }

    pub fn put<T: Serialize>(&self, table: Table, id: &str, value: &T) -> Result<()> {
        let bytes = serde_json::to_vec(value)?;
        let tx = self.db.begin_write()?;
        tx.open_table(table)?.insert(id, bytes.as_slice())?;
        tx.commit()?;
        Ok(())
    }

    /// Removes a row; true if it existed.
    pub fn delete(&self, table: Table, id: &str) -> Result<bool> {
        let tx = self.db.begin_write()?;
        let existed = tx.open_table(table)?.remove(id)?.is_some();
        tx.commit()?;
        Ok(existed)
    }

    /// Every row, in key order.
    pub fn list<T: DeserializeOwned>(&self, table: Table) -> Result<Vec<T>> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(table)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (_, v) = row?;
            out.push(serde_json::from_slice(v.value())?);
        }
        Ok(out)
    }

    /// Reads, changes and writes one row in one transaction.
    pub fn update<T: Serialize + DeserializeOwned>(
        &self,
        table: Table,
        kind: &'static str,
        id: &str,
        f: impl FnOnce(&mut T),
    ) -> Result<T> {
        let tx = self.db.begin_write()?;
        let value = {
            let mut t = tx.open_table(table)?;
            let mut value: T = match t.get(id)? {
                Some(v) => serde_json::from_slice(v.value())?,
                None => return Err(PlasmaError::not_found(kind, id)),
            };
            f(&mut value);
            let bytes = serde_json::to_vec(&value)?;
            t.insert(id, bytes.as_slice())?;
            value
        };
        tx.commit()?;
        Ok(value)
    }
}
