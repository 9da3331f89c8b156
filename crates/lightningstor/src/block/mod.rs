//! Content-addressed block storage.
//!
//! Object data is cut into blocks of about 1 MiB; each block is stored under
//! the BLAKE3 hash of its content and verified against that hash on every
//! read, so a flipped bit on disk is an error, never wrong data. The store is
//! a small synchronous trait ([`BlockStore`]) so a replicated layer can wrap
//! it later; callers run it on blocking threads.

pub mod file;
pub mod memory;
#[cfg(test)]
pub(crate) mod suite;

use crate::error::{LightningError, Result};
use bytes::Bytes;
use std::fmt;

/// The BLAKE3 hash that names a block.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// Hashes `data`.
    pub fn of(data: &[u8]) -> Self {
        BlockHash(*blake3::hash(data).as_bytes())
    }

    /// Hashes the concatenation of `parts`.
    pub fn of_parts(parts: &[Bytes]) -> Self {
        let mut h = blake3::Hasher::new();
        for p in parts {
            h.update(p);
        }
        BlockHash(*h.finalize().as_bytes())
    }

    /// Lowercase hex, as used in file names.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(BlockHash(out))
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Checks that `data` hashes to `hash`.
pub fn verify(hash: &BlockHash, data: &[u8]) -> Result<()> {
    if BlockHash::of(data) == *hash { Ok(()) } else { Err(LightningError::CorruptBlock { hash: hash.to_hex() }) }
}

/// How a store writes block data: what `cluster status` reports, so a
/// measurement says whether writes went through the page cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DirectIo {
    /// Block files are written with `O_DIRECT` now.
    pub o_direct: bool,
    /// The store chose `O_DIRECT` when it opened, but a write was refused
    /// with EINVAL, so it writes through the page cache since.
    pub o_direct_fell_back: bool,
}

/// A store of immutable blocks keyed by their content hash.
///
/// Implementations must be safe to call from many threads at once. A block
/// written by [`put`](BlockStore::put) is durable once a later
/// [`flush`](BlockStore::flush) returns.
pub trait BlockStore: Send + Sync + 'static {
    /// Stores the concatenation of `parts` under `hash` (which the caller
    /// computed). Storing a block that is already present is a cheap no-op.
    /// Taking parts lets uploads write the body's chunks without copying them
    /// into one buffer first.
    fn put_parts(&self, hash: &BlockHash, parts: &[Bytes]) -> Result<()>;
    /// Reads a block's bytes without verifying them.
    fn read_raw(&self, hash: &BlockHash) -> Result<Vec<u8>>;
    /// Removes a block; removing a missing block is not an error.
    fn delete(&self, hash: &BlockHash) -> Result<()>;
    /// Whether a block is present.
    fn contains(&self, hash: &BlockHash) -> Result<bool>;
    /// Every stored block, for garbage collection.
    fn list(&self) -> Result<Vec<BlockHash>>;
    /// Makes every earlier `put` durable (deletes need not be: a block that
    /// reappears after a crash is garbage the next collection removes).
    fn flush(&self) -> Result<()>;

    /// How block data is written (stores without files: neither).
    fn direct_io(&self) -> DirectIo {
        DirectIo::default()
    }

    /// Stores `data` under `hash`.
    fn put(&self, hash: &BlockHash, data: &[u8]) -> Result<()> {
        self.put_parts(hash, &[Bytes::copy_from_slice(data)])
    }

    /// Reads a block and verifies it against its hash.
    fn get(&self, hash: &BlockHash) -> Result<Bytes> {
        let data = self.read_raw(hash)?;
        verify(hash, &data)?;
        Ok(Bytes::from(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_round_trip_through_hex() {
        let h = BlockHash::of(b"hello");
        assert_eq!(BlockHash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(BlockHash::from_hex("zz"), None);
    }

    #[test]
    fn verification_rejects_changed_bytes() {
        let h = BlockHash::of(b"hello");
        assert!(verify(&h, b"hello").is_ok());
        assert!(matches!(verify(&h, b"hellO"), Err(LightningError::CorruptBlock { .. })));
    }
}
