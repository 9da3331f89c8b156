//! A pool of data buffers, so the READ/WRITE path does not allocate or zero
//! a buffer per request.
//!
//! Buffers are kept in power-of-two size classes from 4 KiB to 32 MiB. A
//! buffer is always fully initialised (zeroed once when first allocated), so
//! handing out a prefix of it is sound without zeroing again.

use std::sync::Mutex;

const MIN_SHIFT: u32 = 12;
const MAX_SHIFT: u32 = 25;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;
/// Bytes each size class may keep idle.
const IDLE_BYTES_PER_CLASS: usize = 32 << 20;

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
    /// A buffer of exactly `len` bytes with unspecified contents.
    pub fn get(&self, len: usize) -> Vec<u8> {
        let Some(c) = class_of(len) else {
            return vec![0; len];
        };
        let reused = self.classes[c].lock().ok().and_then(|mut v| v.pop());
        let mut buf = reused.unwrap_or_else(|| vec![0; 1 << (c as u32 + MIN_SHIFT)]);
        buf.truncate(len);
        buf
    }

    /// Returns a buffer obtained from [`BufPool::get`].
    pub fn put(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if !cap.is_power_of_two() {
            return;
        }
        let Some(c) = class_of(cap) else { return };
        if (1usize << (c as u32 + MIN_SHIFT)) != cap {
            return;
        }
        // SAFETY: every pooled buffer was created by `vec![0; cap]`, so all
        // `cap` bytes are initialised; truncation never de-initialises them.
        unsafe { buf.set_len(cap) };
        if let Ok(mut v) = self.classes[c].lock() {
            if v.len() * cap < IDLE_BYTES_PER_CLASS.max(2 * cap) {
                v.push(buf);
            }
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
        assert_eq!(b.capacity(), 8192);
        let ptr = b.as_ptr();
        p.put(b);
        let b = p.get(8000);
        assert_eq!(b.as_ptr(), ptr, "same buffer handed out again");
        assert_eq!(b.len(), 8000);
        let big = p.get(64 << 20);
        assert_eq!(big.len(), 64 << 20);
        p.put(big);
        assert!(p.get(1).capacity() >= 4096);
    }
}
