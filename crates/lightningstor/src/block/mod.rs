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

/// What scrub makes of one local block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scrubbed {
    /// Present and whole.
    Good,
    /// Not there (any more): deleted since it was listed.
    Gone,
    /// Present, and its bytes do not hash to its name, twice in a row.
    Corrupt,
}

/// Re-hashes a local block for scrub. A read that fails verification is
/// read again before the block is called corrupt: a delete that runs while
/// the read does (the file store truncates a deleted block's file and may
/// reuse it for another block) leaves that read with short or foreign bytes
/// although nothing is damaged, and the second read then finds the block gone
/// (or whole again, if it was written anew). Only a block that is still there
/// and still bad is [`Scrubbed::Corrupt`].
pub fn scrub_one(store: &dyn BlockStore, hash: &BlockHash) -> Result<Scrubbed> {
    for attempt in 0..2 {
        match store.get(hash) {
            Ok(_) => return Ok(Scrubbed::Good),
            Err(LightningError::MissingBlock { .. }) => return Ok(Scrubbed::Gone),
            Err(LightningError::CorruptBlock { .. }) if attempt == 0 => {}
            Err(LightningError::CorruptBlock { .. }) => return Ok(Scrubbed::Corrupt),
            Err(e) => return Err(e),
        }
    }
    Ok(Scrubbed::Corrupt)
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

    /// A store whose first read of a block races a delete: it sees the
    /// file already truncated, and the block is gone afterwards (or, with
    /// `rewrite`, written again whole, as when the same data is uploaded anew).
    struct DeletedWhileRead {
        inner: memory::MemoryBlockStore,
        rewrite: bool,
        raced: std::sync::atomic::AtomicBool,
    }

    impl BlockStore for DeletedWhileRead {
        fn put_parts(&self, hash: &BlockHash, parts: &[Bytes]) -> Result<()> {
            self.inner.put_parts(hash, parts)
        }
        fn read_raw(&self, hash: &BlockHash) -> Result<Vec<u8>> {
            if self.raced.swap(true, std::sync::atomic::Ordering::SeqCst) {
                return self.inner.read_raw(hash);
            }
            let data = self.inner.read_raw(hash)?;
            self.inner.delete(hash)?;
            if self.rewrite {
                self.inner.put(hash, &data)?;
            }
            Ok(data[..data.len() / 2].to_vec())
        }
        fn delete(&self, hash: &BlockHash) -> Result<()> {
            self.inner.delete(hash)
        }
        fn contains(&self, hash: &BlockHash) -> Result<bool> {
            self.inner.contains(hash)
        }
        fn list(&self) -> Result<Vec<BlockHash>> {
            self.inner.list()
        }
        fn flush(&self) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn scrub_calls_a_block_deleted_under_its_read_gone_and_only_a_lasting_bad_copy_corrupt() {
        let data = b"block contents".to_vec();
        let h = BlockHash::of(&data);
        for rewrite in [false, true] {
            let s = DeletedWhileRead { inner: memory::MemoryBlockStore::new(), rewrite, raced: false.into() };
            s.put(&h, &data).unwrap();
            let want = if rewrite { Scrubbed::Good } else { Scrubbed::Gone };
            assert_eq!(scrub_one(&s, &h).unwrap(), want, "rewrite={rewrite}");
        }
        let m = memory::MemoryBlockStore::new();
        assert_eq!(scrub_one(&m, &h).unwrap(), Scrubbed::Gone);
        m.put(&h, &data).unwrap();
        assert_eq!(scrub_one(&m, &h).unwrap(), Scrubbed::Good);
        m.corrupt(&h, b"block contentS".to_vec());
        assert_eq!(scrub_one(&m, &h).unwrap(), Scrubbed::Corrupt);
    }
}
