//! Blocks in memory, for tests and as the model the file store is held to.

use super::{BlockHash, BlockStore};
use crate::error::{LightningError, Result};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Mutex;

/// A [`BlockStore`] in a `HashMap`.
#[derive(Debug, Default)]
pub struct MemoryBlockStore {
    blocks: Mutex<HashMap<BlockHash, Vec<u8>>>,
}

impl MemoryBlockStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Overwrites a stored block's bytes (fault injection for tests).
    pub fn corrupt(&self, hash: &BlockHash, data: Vec<u8>) {
        if let Ok(mut b) = self.blocks.lock() {
            b.insert(*hash, data);
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<BlockHash, Vec<u8>>>> {
        self.blocks.lock().map_err(|_| LightningError::Io(std::io::Error::other("poisoned block map")))
    }
}

impl BlockStore for MemoryBlockStore {
    fn put_parts(&self, hash: &BlockHash, parts: &[Bytes]) -> Result<()> {
        self.lock()?.entry(*hash).or_insert_with(|| parts.concat());
        Ok(())
    }

    fn read_raw(&self, hash: &BlockHash) -> Result<Vec<u8>> {
        self.lock()?.get(hash).cloned().ok_or_else(|| LightningError::MissingBlock { hash: hash.to_hex() })
    }

    fn delete(&self, hash: &BlockHash) -> Result<()> {
        self.lock()?.remove(hash);
        Ok(())
    }

    fn contains(&self, hash: &BlockHash) -> Result<bool> {
        Ok(self.lock()?.contains_key(hash))
    }

    fn list(&self) -> Result<Vec<BlockHash>> {
        Ok(self.lock()?.keys().copied().collect())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_store_passes_the_block_store_suite() {
        super::super::suite::run(&MemoryBlockStore::new());
    }

    #[test]
    fn corrupted_memory_blocks_fail_verification() {
        let s = MemoryBlockStore::new();
        let h = BlockHash::of(b"abc");
        s.put(&h, b"abc").expect("put");
        s.corrupt(&h, b"abd".to_vec());
        assert!(s.get(&h).is_err());
    }
}
