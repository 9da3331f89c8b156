//! Layered volumes: copy-on-write over a chain of read-only parent layers.
//!
//! A [`Layer`] is one data backend (a sparse file) plus, when it has a
//! parent, an ownership [`map::GranuleMap`]. [`Layered`] is the writable (or
//! read-only snapshot) head of a chain and is itself a [`BlockBackend`], so the
//! NBD server does not know about layering. A base layer (no parent) passes
//! every call straight to its data backend.
//!
//! Reads of a granule the head does not own fall through to the parent, up
//! to `parent_limit` bytes (what the parent showed when the child was made or
//! last shrunk); past it they read zero. The first write to an unowned granule
//! copies the parent's granule in (unless the write covers it) and then sets
//! the bit. FLUSH makes the data durable first and the bits second.

pub mod map;

use crate::backend::traits::{BlockBackend, BufResult, Extent64, SpliceSource};
use crate::proto::state;
use map::{GRANULE, GranuleMap};
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::sync::{Mutex, RwLock, RwLockWriteGuard};

/// Most layers in one chain (the head counts): bounds the work of a read.
pub const MAX_DEPTH: usize = 32;
/// Locks striped over granules, taken while a granule is copied in.
const STRIPES: usize = 256;

/// The copy-on-write part of a layer that has a parent.
#[derive(Debug)]
pub struct Cow<B> {
    pub map: GranuleMap,
    pub map_file: B,
    pub parent: Arc<Layer<B>>,
    /// Bytes of the parent visible through this layer.
    pub parent_limit: u64,
}

/// One layer: its data and, if it has a parent, its ownership map.
#[derive(Debug)]
pub struct Layer<B> {
    pub id: u64,
    /// Logical size in bytes.
    pub size: u64,
    pub data: B,
    pub cow: Option<Cow<B>>,
}

/// Where a piece of a read comes from.
#[derive(Debug)]
enum Src<'a, B> {
    Layer(&'a Layer<B>),
    Zero,
}

// Not derived: the derive would ask for `B: Copy`.
impl<B> Clone for Src<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Src<'_, B> {}

impl<B: BlockBackend> Layer<B> {
    /// A layer that owns all of its data.
    pub fn base(id: u64, size: u64, data: B) -> Self {
        Layer { id, size, data, cow: None }
    }

    /// Layers in the chain, this one included.
    pub fn depth(&self) -> usize {
        1 + self.cow.as_ref().map_or(0, |c| c.parent.depth())
    }

    /// Appends the sources of `[off, off+len)` as this layer shows it.
    fn resolve<'a>(&'a self, off: u64, len: u64, out: &mut Vec<(Src<'a, B>, u64, u64)>) {
        let Some(cow) = &self.cow else {
            push(out, Src::Layer(self), off, len);
            return;
        };
        let end = off + len;
        let mut pos = off;
        while pos < end {
            let g = pos / GRANULE;
            let owned = cow.map.owned(g);
            let mut next = ((g + 1) * GRANULE).min(end);
            while next < end && cow.map.owned(next / GRANULE) == owned {
                next = ((next / GRANULE + 1) * GRANULE).min(end);
            }
            if owned {
                push(out, Src::Layer(self), pos, next - pos);
            } else {
                cow.resolve_parent(pos, next - pos, out);
            }
            pos = next;
        }
    }

    /// Frees data in granules this layer does not own: the trace of a copy
    /// that a crash interrupted before its bit reached the map file.
    pub async fn reclaim(&self) -> io::Result<u64> {
        let Some(cow) = &self.cow else { return Ok(0) };
        let mut freed = 0;
        let mut pos = 0;
        while pos < self.size {
            let ext = self.data.extents(pos, self.size - pos, 1024).await?;
            if ext.is_empty() {
                break;
            }
            for e in ext {
                if e.flags & state::HOLE == 0 {
                    let (g0, g1) = map::granules(pos, e.length);
                    for g in g0..=g1 {
                        if !cow.map.owned(g) {
                            let s = g * GRANULE;
                            let l = GRANULE.min(self.size - s);
                            self.data.write_zeroes(s, l, true, false).await?;
                            freed += l;
                        }
                    }
                }
                pos += e.length;
            }
        }
        if freed > 0 {
            self.data.flush().await?;
        }
        Ok(freed)
    }
}

impl<B: BlockBackend> Cow<B> {
    /// Sources of an unowned range: the parent up to the limit, zero after.
    fn resolve_parent<'a>(&'a self, off: u64, len: u64, out: &mut Vec<(Src<'a, B>, u64, u64)>) {
        let end = off + len;
        let lim = self.parent_limit.min(self.parent.size);
        if off < lim {
            self.parent.resolve(off, end.min(lim) - off, out);
        }
        if end > lim {
            let z = off.max(lim);
            push(out, Src::Zero, z, end - z);
        }
    }
}

fn push<'a, B>(out: &mut Vec<(Src<'a, B>, u64, u64)>, src: Src<'a, B>, off: u64, len: u64) {
    if let Some(last) = out.last_mut() {
        let same = match (last.0, src) {
            (Src::Zero, Src::Zero) => true,
            (Src::Layer(a), Src::Layer(b)) => std::ptr::eq(a, b),
            _ => false,
        };
        if same && last.1 + last.2 == off {
            last.2 += len;
            return;
        }
    }
    out.push((src, off, len));
}

/// The head of a chain of layers, served as one block device.
#[derive(Debug)]
pub struct Layered<B> {
    head: RwLock<Arc<Layer<B>>>,
    size: AtomicU64,
    stripes: Vec<Mutex<()>>,
    flush_lock: Mutex<()>,
    /// Set when the volume is deleted under its connections.
    dead: AtomicBool,
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

/// Which change a copy-on-write operation makes.
enum Op {
    Write(Vec<u8>),
    Zeroes { punch: bool, fast_only: bool },
    Trim,
}

impl<B: BlockBackend> Layered<B> {
    pub fn new(head: Layer<B>) -> Self {
        Layered {
            size: AtomicU64::new(head.size),
            head: RwLock::new(Arc::new(head)),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            flush_lock: Mutex::new(()),
            dead: AtomicBool::new(false),
        }
    }

    /// The head layer as it is now.
    pub async fn head(&self) -> Arc<Layer<B>> {
        self.head.read().await.clone()
    }

    /// Waits for every request in flight and keeps new ones out until the
    /// guard is dropped: snapshot, resize and flatten swap the head under it.
    pub async fn exclusive(&self) -> RwLockWriteGuard<'_, Arc<Layer<B>>> {
        self.head.write().await
    }

    /// Replaces the head (call with the guard from [`Layered::exclusive`]).
    pub fn replace(&self, guard: &mut RwLockWriteGuard<'_, Arc<Layer<B>>>, head: Arc<Layer<B>>) {
        self.size.store(head.size, Ordering::Release);
        **guard = head;
    }

    /// Makes every later request fail: the volume was deleted.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::Release);
    }

    fn check(&self, off: u64, len: u64) -> io::Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return Err(io::Error::from_raw_os_error(libc::ESHUTDOWN));
        }
        match off.checked_add(len) {
            Some(end) if end <= self.size.load(Ordering::Acquire) => Ok(()),
            _ => Err(einval()),
        }
    }

    /// Makes the head's data durable, then its map (data before bits).
    pub async fn flush_layer(&self, head: &Layer<B>) -> io::Result<()> {
        let Some(cow) = &head.cow else { return head.data.flush().await };
        let _g = self.flush_lock.lock().await;
        let pages = cow.map.capture();
        let r = async {
            head.data.flush().await?;
            if pages.is_empty() {
                return Ok(());
            }
            for (off, bytes, _) in &pages {
                let (r, _) = cow.map_file.write_at(bytes.clone(), *off, false).await;
                r?;
            }
            cow.map_file.flush().await
        }
        .await;
        match r {
            Ok(()) => cow.map.mark_durable(&pages),
            Err(_) => cow.map.redirty(&pages),
        }
        r
    }

    /// Copies granule `g` of the parent into the head (it must be unowned and
    /// its stripe locked). A granule that reads as zero is punched instead.
    async fn copy_in(&self, head: &Layer<B>, cow: &Cow<B>, g: u64) -> io::Result<()> {
        let start = g * GRANULE;
        let len = GRANULE.min(head.size - start);
        let mut srcs = Vec::new();
        cow.resolve_parent(start, len, &mut srcs);
        let buf = read_sources(&srcs, vec![0; len as usize], start).await?;
        if buf.iter().all(|&b| b == 0) {
            head.data.write_zeroes(start, len, true, false).await
        } else {
            head.data.write_at(buf, start, false).await.0
        }
    }

    /// Makes the head own granule `g`, copying it in from the parents (flatten).
    pub async fn materialize(&self, g: u64) -> io::Result<()> {
        let head = self.head.read().await;
        let Some(cow) = &head.cow else { return Ok(()) };
        if g >= cow.map.granules() || cow.map.owned(g) {
            return Ok(());
        }
        let _s = self.stripes[(g % STRIPES as u64) as usize].lock().await;
        if !cow.map.owned(g) {
            self.copy_in(&head, cow, g).await?;
            cow.map.set(g);
        }
        Ok(())
    }

    /// The slow path: some granule of the range is not owned yet.
    async fn cow_op(&self, head: &Layer<B>, cow: &Cow<B>, off: u64, len: u64, op: Op) -> BufResult {
        let (g0, g1) = map::granules(off, len);
        let mut stripes: Vec<usize> =
            (g0..=g1).filter(|&g| !cow.map.owned(g)).map(|g| (g % STRIPES as u64) as usize).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let mut guards = Vec::with_capacity(stripes.len());
        for s in stripes {
            guards.push(self.stripes[s].lock().await);
        }
        let unowned: Vec<u64> = (g0..=g1).filter(|&g| !cow.map.owned(g)).collect();
        let end = off + len;
        for &g in &unowned {
            let (gs, ge) = (g * GRANULE, ((g + 1) * GRANULE).min(head.size));
            if (off > gs || end < ge)
                && let Err(e) = self.copy_in(head, cow, g).await
            {
                return (Err(e), op_buf(op));
            }
        }
        let (r, buf) = match op {
            Op::Write(buf) => head.data.write_at(buf, off, false).await,
            Op::Zeroes { punch, fast_only } => (head.data.write_zeroes(off, len, punch, fast_only).await, Vec::new()),
            Op::Trim => (head.data.trim(off, len).await, Vec::new()),
        };
        if r.is_ok() {
            for g in unowned {
                cow.map.set(g);
            }
        }
        (r, buf)
    }

    /// Runs a modifying operation on the head, copying in what it needs.
    async fn modify(&self, off: u64, len: u64, op: Op, fua: bool) -> BufResult {
        if let Err(e) = self.check(off, len) {
            return (Err(e), op_buf(op));
        }
        if len == 0 {
            return (Ok(()), op_buf(op));
        }
        let head = self.head.read().await;
        let Some(cow) = &head.cow else {
            return match op {
                Op::Write(buf) => head.data.write_at(buf, off, fua).await,
                Op::Zeroes { punch, fast_only } => {
                    let r = head.data.write_zeroes(off, len, punch, fast_only).await;
                    (if fua && r.is_ok() { head.data.flush().await } else { r }, Vec::new())
                }
                Op::Trim => (head.data.trim(off, len).await, Vec::new()),
            };
        };
        let (g0, g1) = map::granules(off, len);
        let (r, buf) = if cow.map.all_owned(g0, g1) {
            let durable = cow.map.all_durable(g0, g1);
            match op {
                // Owned and known to the map file: FUA on the data is enough.
                Op::Write(buf) if durable => return head.data.write_at(buf, off, fua).await,
                Op::Write(buf) => head.data.write_at(buf, off, false).await,
                Op::Zeroes { punch, fast_only } => {
                    (head.data.write_zeroes(off, len, punch, fast_only).await, Vec::new())
                }
                Op::Trim => (head.data.trim(off, len).await, Vec::new()),
            }
        } else {
            self.cow_op(&head, cow, off, len, op).await
        };
        if r.is_ok() && fua {
            return (self.flush_layer(&head).await, buf);
        }
        (r, buf)
    }
}

fn op_buf(op: Op) -> Vec<u8> {
    match op {
        Op::Write(b) => b,
        _ => Vec::new(),
    }
}

/// Fills `buf` (covering `[off, off+buf.len())`) from its sources.
async fn read_sources<B: BlockBackend>(
    srcs: &[(Src<'_, B>, u64, u64)],
    mut buf: Vec<u8>,
    off: u64,
) -> io::Result<Vec<u8>> {
    if let [(src, _, _)] = srcs {
        return match src {
            Src::Layer(l) => {
                let (r, buf) = l.data.read_at(buf, off).await;
                r.map(|()| buf)
            }
            Src::Zero => {
                buf.fill(0);
                Ok(buf)
            }
        };
    }
    for &(src, s, l) in srcs {
        let at = (s - off) as usize;
        match src {
            Src::Zero => buf[at..at + l as usize].fill(0),
            Src::Layer(layer) => {
                let (r, part) = layer.data.read_at(vec![0; l as usize], s).await;
                r?;
                buf[at..at + l as usize].copy_from_slice(&part);
            }
        }
    }
    Ok(buf)
}

impl<B: BlockBackend> BlockBackend for Layered<B> {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    // The synchronous fast paths give up (answer "no") whenever they would
    // have to wait: the head is being swapped, or a granule is not owned yet.

    fn try_read_now(&self, buf: &mut [u8], offset: u64) -> bool {
        let Ok(head) = self.head.try_read() else { return false };
        if self.check(offset, buf.len() as u64).is_err() {
            return false;
        }
        if head.cow.is_none() {
            return head.data.try_read_now(buf, offset);
        }
        let mut srcs = Vec::new();
        head.resolve(offset, buf.len() as u64, &mut srcs);
        srcs.iter().all(|&(src, s, l)| {
            let part = &mut buf[(s - offset) as usize..(s - offset + l) as usize];
            match src {
                Src::Zero => {
                    part.fill(0);
                    true
                }
                Src::Layer(layer) => layer.data.try_read_now(part, s),
            }
        })
    }

    fn try_write_now(&self, buf: &[u8], offset: u64) -> bool {
        let Ok(head) = self.head.try_read() else { return false };
        if buf.is_empty() || self.check(offset, buf.len() as u64).is_err() {
            return false;
        }
        match &head.cow {
            None => head.data.try_write_now(buf, offset),
            Some(cow) => {
                let (g0, g1) = map::granules(offset, buf.len() as u64);
                cow.map.all_owned(g0, g1) && head.data.try_write_now(buf, offset)
            }
        }
    }

    fn splice_source(&self, offset: u64, len: u64) -> Option<SpliceSource> {
        let head = self.head.try_read().ok()?;
        self.check(offset, len).ok()?;
        if head.cow.is_none() {
            return head.data.splice_source(offset, len);
        }
        let mut srcs = Vec::new();
        head.resolve(offset, len, &mut srcs);
        match srcs[..] {
            [(Src::Layer(layer), s, l)] => layer.data.splice_source(s, l),
            _ => None,
        }
    }

    async fn read_at(&self, buf: Vec<u8>, offset: u64) -> BufResult {
        if let Err(e) = self.check(offset, buf.len() as u64) {
            return (Err(e), buf);
        }
        let head = self.head.read().await;
        if head.cow.is_none() {
            return head.data.read_at(buf, offset).await;
        }
        let mut srcs = Vec::new();
        head.resolve(offset, buf.len() as u64, &mut srcs);
        let len = buf.len();
        match read_sources(&srcs, buf, offset).await {
            Ok(buf) => (Ok(()), buf),
            Err(e) => (Err(e), vec![0; len]),
        }
    }

    async fn write_at(&self, buf: Vec<u8>, offset: u64, fua: bool) -> BufResult {
        let len = buf.len() as u64;
        self.modify(offset, len, Op::Write(buf), fua).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, punch: bool, fast_only: bool) -> io::Result<()> {
        self.modify(offset, len, Op::Zeroes { punch, fast_only }, false).await.0
    }

    async fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.modify(offset, len, Op::Trim, false).await.0
    }

    async fn flush(&self) -> io::Result<()> {
        self.check(0, 0)?;
        let head = self.head.read().await;
        self.flush_layer(&head).await
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check(offset, len)?;
        let head = self.head.read().await;
        head.data.cache(offset, len).await
    }

    async fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent64>> {
        self.check(offset, len)?;
        let head = self.head.read().await;
        if head.cow.is_none() {
            return head.data.extents(offset, len, max).await;
        }
        let mut srcs = Vec::new();
        head.resolve(offset, len, &mut srcs);
        let mut out: Vec<Extent64> = Vec::new();
        let add = |out: &mut Vec<Extent64>, e: Extent64| match out.last_mut() {
            Some(last) if last.flags == e.flags => last.length += e.length,
            _ => out.push(e),
        };
        for (src, s, l) in srcs {
            match src {
                Src::Zero => add(&mut out, Extent64 { length: l, flags: state::HOLE | state::ZERO }),
                Src::Layer(layer) => {
                    let ext = layer.data.extents(s, l, max.saturating_sub(out.len()).max(1)).await?;
                    let covered: u64 = ext.iter().map(|e| e.length).sum();
                    for e in ext {
                        add(&mut out, e);
                    }
                    if covered < l {
                        break;
                    }
                }
            }
            if out.len() > max {
                break;
            }
        }
        out.truncate(max.max(1));
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests;
