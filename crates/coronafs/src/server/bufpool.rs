//! A pool of data buffers, so the READ/WRITE path does not allocate or zero
//! a buffer per request.
//!
//! Buffers are kept in power-of-two size classes from 4 KiB to 32 MiB. A
//! [`PooledBuf`] carries the invariant that makes reuse sound without unsafe
//! code: its `Vec` always has its length equal to its capacity (every byte
//! initialised, zeroed once when first allocated), and the buffer's visible
//! length is kept apart. Handing out a prefix of it never exposes memory the
//! program did not initialise, and a buffer comes back from the backend
//! through [`PooledBuf::from_vec`], which restores the invariant.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

const MIN_SHIFT: u32 = 12;
const MAX_SHIFT: u32 = 25;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;
/// Bytes each size class may keep idle.
const IDLE_BYTES_PER_CLASS: usize = 32 << 20;

/// A data buffer of `len` bytes over a fully initialised allocation.
#[derive(Debug)]
pub struct PooledBuf {
    /// Invariant: `vec.len() == vec.capacity()`.
    vec: Vec<u8>,
    len: usize,
}

impl PooledBuf {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> Self {
        PooledBuf { vec: vec![0; len], len }
    }

    /// The buffer as a `Vec` of exactly its length, for the backend's owned
    /// I/O (io_uring and the thread pool need `'static` buffers).
    pub fn into_vec(self) -> Vec<u8> {
        let mut v = self.vec;
        v.truncate(self.len);
        v
    }

    /// Takes back a buffer (from the backend): its length is what the
    /// buffer holds; the spare capacity is zeroed to restore the invariant.
    /// That costs nothing for a buffer of a whole size class, the usual case.
    pub fn from_vec(mut vec: Vec<u8>) -> Self {
        let len = vec.len();
        vec.resize(vec.capacity(), 0);
        PooledBuf { vec, len }
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.vec[..self.len]
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.vec[..self.len]
    }
}

#[derive(Debug)]
pub struct BufPool {
    classes: [Mutex<Vec<Vec<u8>>>; CLASSES],
}

impl Default for BufPool {
    fn default() -> Self {
        BufPool { classes: std::array::from_fn(|_| Mutex::new(Vec::new())) }
    }
}

fn class_of(len: usize) -> Option<usize> {
    let shift = len.max(1).next_power_of_two().trailing_zeros().max(MIN_SHIFT);
    (shift <= MAX_SHIFT).then(|| (shift - MIN_SHIFT) as usize)
}

impl BufPool {
    /// A buffer of exactly `len` bytes with unspecified (but initialised) contents.
    pub fn get(&self, len: usize) -> PooledBuf {
        let Some(c) = class_of(len) else {
            return PooledBuf::zeroed(len);
        };
        let reused = self.classes[c].lock().ok().and_then(|mut v| v.pop());
        let vec = reused.unwrap_or_else(|| vec![0; 1 << (c as u32 + MIN_SHIFT)]);
        PooledBuf { vec, len }
    }

    /// Returns a buffer to its size class (buffers of no class are dropped).
    pub fn put(&self, buf: PooledBuf) {
        let vec = buf.vec;
        let cap = vec.len();
        let Some(c) = class_of(cap) else { return };
        if (1usize << (c as u32 + MIN_SHIFT)) != cap || vec.capacity() != cap {
            return;
        }
        if let Ok(mut v) = self.classes[c].lock()
            && v.len() * cap < IDLE_BYTES_PER_CLASS.max(2 * cap)
        {
            v.push(vec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_by_size_class() {
        let p = BufPool::default();
        let b = p.get(5000);
        assert_eq!(b.len(), 5000);
        let ptr = b.as_ptr();
        p.put(b);
        let b = p.get(8000);
        assert_eq!(b.as_ptr(), ptr, "same buffer handed out again");
        assert_eq!(b.len(), 8000);
        let big = p.get(64 << 20);
        assert_eq!(big.len(), 64 << 20);
        p.put(big);
        assert_eq!(p.get(1).len(), 1);
    }

    #[test]
    fn a_buffer_given_back_never_shows_bytes_past_its_length() {
        let p = BufPool::default();
        // A buffer of one class whose length was cut to nothing: the bytes
        // past its length are not its contents (with `Vec::with_capacity`
        // they would not even be initialised) and must never be handed out.
        let mut v = vec![0xa5u8; 8192];
        v.truncate(0);
        p.put(PooledBuf::from_vec(v));
        let b = p.get(8192);
        assert_eq!(b.len(), 8192);
        assert!(b.iter().all(|&x| x == 0), "stale bytes past the length were handed out");
        p.put(b);
        p.put(PooledBuf::from_vec(Vec::with_capacity(8192)));
        for _ in 0..2 {
            assert!(p.get(8192).iter().all(|&x| x == 0), "a buffer with uninitialised capacity was handed out");
        }
    }

    #[test]
    fn a_round_trip_through_a_vec_keeps_the_bytes_and_the_buffer() {
        let p = BufPool::default();
        let mut b = p.get(6000);
        b.fill(3);
        let ptr = b.as_ptr();
        let v = b.into_vec();
        assert_eq!(v.len(), 6000);
        let b = PooledBuf::from_vec(v);
        assert_eq!((b.len(), b.as_ptr()), (6000, ptr));
        assert!(b.iter().all(|&x| x == 3));
        p.put(b);
        assert_eq!(p.get(8192).as_ptr(), ptr, "it went back to its class");
    }
}
