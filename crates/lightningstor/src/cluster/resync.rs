//! The persistent resync queue: replicas a write could not reach, to be
//! brought up to date later, with retry and exponential back-off.
//!
//! Entries live in their own redb file (`resync.redb` in the node's data
//! directory) and are committed with fsync before the write that missed a
//! replica is acknowledged, so a restart of the coordinator loses none.

use super::NodeId;
use crate::error::Result;
use redb::{Database, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};

/// (target node, bucket, key) -> [`Due`]. An empty key with `bucket_row`
/// set means the bucket row itself; an empty bucket too means the keyring
/// (keys and grants, see `buckets.rs`).
const QUEUE: TableDefinition<(u8, &str, &[u8]), &[u8]> = TableDefinition::new("resync");

/// Longest back-off between two attempts.
const MAX_BACKOFF_MS: i64 = 30_000;

/// Scheduling of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Due {
    /// Attempts made so far.
    pub attempts: u32,
    /// Unix milliseconds of the next attempt.
    pub at_ms: i64,
    /// The entry is a bucket row, not an object.
    pub bucket_row: bool,
}

/// One queued repair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Replica that missed the write.
    pub node: NodeId,
    /// Bucket.
    pub bucket: String,
    /// Key (empty for a bucket row).
    pub key: Vec<u8>,
    /// Schedule.
    pub due: Due,
}

/// The queue.
pub struct Resync {
    db: Database,
}

impl std::fmt::Debug for Resync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resync").finish_non_exhaustive()
    }
}

/// Back-off before attempt `attempts + 1`: 250 ms doubling, at most 30 s.
pub fn backoff_ms(attempts: u32) -> i64 {
    (250i64 << attempts.min(16)).min(MAX_BACKOFF_MS)
}

impl Resync {
    /// Opens (creating) the queue file.
    pub fn open(path: &std::path::Path) -> Result<Self> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let db = Database::create(path)?;
        let txn = db.begin_write()?;
        txn.open_table(QUEUE)?;
        txn.commit()?;
        Ok(Resync { db })
    }

    /// Queues entries (durably). Blocking.
    pub fn add(&self, items: &[(NodeId, String, Vec<u8>, bool)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let now = crate::meta::now_ms();
        let txn = self.db.begin_write()?;
        {
            let mut t = txn.open_table(QUEUE)?;
            for (node, bucket, key, bucket_row) in items {
                let due = Due { attempts: 0, at_ms: now + backoff_ms(0), bucket_row: *bucket_row };
                t.insert((*node, bucket.as_str(), key.as_slice()), postcard::to_allocvec(&due)?.as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Entries due now, at most `limit`. Blocking.
    pub fn due(&self, limit: usize) -> Result<Vec<Entry>> {
        let now = crate::meta::now_ms();
        let txn = self.db.begin_read()?;
        let t = txn.open_table(QUEUE)?;
        let mut out = Vec::new();
        for row in t.iter()? {
            let (k, v) = row?;
            let due: Due = postcard::from_bytes(v.value())?;
            if due.at_ms <= now {
                let (node, bucket, key) = k.value();
                out.push(Entry { node, bucket: bucket.to_owned(), key: key.to_vec(), due });
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Removes a finished entry (unless it was queued again meanwhile). Blocking.
    pub fn done(&self, e: &Entry) -> Result<()> {
        let txn = self.db.begin_write()?;
        {
            let mut t = txn.open_table(QUEUE)?;
            let k = (e.node, e.bucket.as_str(), e.key.as_slice());
            let same = match t.get(k)? {
                Some(v) => postcard::from_bytes::<Due>(v.value())? == e.due,
                None => false,
            };
            if same {
                t.remove(k)?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Reschedules a failed entry with back-off. Blocking.
    pub fn retry(&self, e: &Entry) -> Result<()> {
        let attempts = e.due.attempts.saturating_add(1);
        let due = Due { attempts, at_ms: crate::meta::now_ms() + backoff_ms(attempts), bucket_row: e.due.bucket_row };
        let txn = self.db.begin_write()?;
        {
            let mut t = txn.open_table(QUEUE)?;
            t.insert((e.node, e.bucket.as_str(), e.key.as_slice()), postcard::to_allocvec(&due)?.as_slice())?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Drops every entry (tests simulating a lost queue). Blocking.
    pub fn clear(&self) -> Result<()> {
        let txn = self.db.begin_write()?;
        {
            let mut t = txn.open_table(QUEUE)?;
            t.retain(|_, _| false)?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Entries queued.
    pub fn len(&self) -> u64 {
        self.db.begin_read().ok().and_then(|t| t.open_table(QUEUE).ok()).and_then(|t| t.len().ok()).unwrap_or(0)
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_reopening_and_back_off_when_retried() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("resync.redb");
        {
            let q = Resync::open(&path).expect("open");
            q.add(&[(2, "b".into(), b"k".to_vec(), false), (3, "b".into(), Vec::new(), true)]).expect("add");
        }
        let q = Resync::open(&path).expect("reopen");
        assert_eq!(q.len(), 2);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let due = q.due(10).expect("due");
        assert_eq!(due.len(), 2);
        q.retry(&due[0]).expect("retry");
        let again = q.due(10).expect("due");
        assert_eq!(again.len(), 1, "a retried entry waits for its back-off");
        q.done(&again[0]).expect("done");
        assert_eq!(q.len(), 1);
        assert!(backoff_ms(1) > backoff_ms(0));
        assert_eq!(backoff_ms(40), 30_000);
    }
}
