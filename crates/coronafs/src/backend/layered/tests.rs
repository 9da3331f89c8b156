//! Layering against models: random operations on a clone compared with a
//! `Vec<u8>`, and randomized crash points checked against what was
//! acknowledged.

use super::map::{self, GRANULE, GranuleMap};
use super::*;
use crate::backend::crash::{CrashBackend, CrashClock};
use crate::backend::memory::MemBackend;
use proptest::prelude::*;

const SIZE: u64 = 1 << 20;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// A clone of `parent` (a base layer) with an empty map.
pub(crate) async fn clone_of<B: BlockBackend>(
    parent: Arc<Layer<B>>,
    data: B,
    map_file: B,
    size: u64,
) -> io::Result<Layer<B>> {
    let (r, _) = map_file.write_at(map::header(2, map::count(size)), 0, false).await;
    r?;
    map_file.flush().await?;
    let parent_limit = parent.size;
    Ok(Layer {
        id: 2,
        size,
        data,
        cow: Some(Cow { map: GranuleMap::empty(map::count(size)), map_file, parent, parent_limit }),
    })
}

fn mem_parent(image: &[u8]) -> Arc<Layer<MemBackend>> {
    let m = MemBackend::new(image.len() as u64);
    rt_block(async {
        for (i, chunk) in image.chunks(4096).enumerate() {
            if chunk.iter().any(|&b| b != 0) {
                m.write_at(chunk.to_vec(), i as u64 * 4096, false).await.0.expect("fill parent");
            }
        }
    });
    Arc::new(Layer::base(1, image.len() as u64, m))
}

fn rt_block<F: std::future::Future>(f: F) -> F::Output {
    rt().block_on(f)
}

fn parent_image(seed: u64) -> Vec<u8> {
    let mut img = vec![0u8; SIZE as usize];
    let mut x = seed | 1;
    for (i, page) in img.chunks_mut(4096).enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if x % 3 != 0 {
            page.fill((i as u8).wrapping_mul(7) | 1);
        }
    }
    img
}

#[derive(Debug, Clone)]
enum Step {
    Write { off: u64, len: u64, fua: bool, seed: u8 },
    Zero { off: u64, len: u64, punch: bool },
    Trim { off: u64, len: u64 },
    Flush,
}

fn step() -> impl Strategy<Value = Step> {
    let range = (0..SIZE - 1).prop_flat_map(|off| (Just(off), 1..=(SIZE - off).min(200_000)));
    prop_oneof![
        4 => (range.clone(), any::<bool>(), any::<u8>()).prop_map(|((off, len), fua, seed)| Step::Write { off, len, fua, seed }),
        1 => (range.clone(), any::<bool>()).prop_map(|((off, len), punch)| Step::Zero { off, len, punch }),
        1 => range.prop_map(|(off, len)| Step::Trim { off, len }),
        1 => Just(Step::Flush),
    ]
}

fn bytes(len: u64, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) | 0x80).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random writes, zeroes, trims and flushes on a clone read back like a
    /// `Vec<u8>` that started as the parent, and the parent never changes.
    #[test]
    fn a_clone_behaves_like_a_copy_of_its_parent(seed in any::<u64>(), steps in prop::collection::vec(step(), 1..40)) {
        let image = parent_image(seed);
        let parent = mem_parent(&image);
        let rt = rt();
        rt.block_on(async {
            let head = clone_of(parent.clone(), MemBackend::new(SIZE), MemBackend::new(map::file_len(16)), SIZE).await.expect("clone");
            let vol = Layered::new(head);
            let mut model = image.clone();
            for s in &steps {
                match *s {
                    Step::Write { off, len, fua, seed } => {
                        vol.write_at(bytes(len, seed), off, fua).await.0.expect("write");
                        model[off as usize..(off + len) as usize].copy_from_slice(&bytes(len, seed));
                    }
                    Step::Zero { off, len, punch } => {
                        vol.write_zeroes(off, len, punch, false).await.expect("zero");
                        model[off as usize..(off + len) as usize].fill(0);
                    }
                    Step::Trim { off, len } => {
                        vol.trim(off, len).await.expect("trim");
                        model[off as usize..(off + len) as usize].fill(0);
                    }
                    Step::Flush => vol.flush().await.expect("flush"),
                }
            }
            let (r, got) = vol.read_at(vec![0; SIZE as usize], 0).await;
            r.expect("read");
            assert!(got == model, "clone content differs from the model");
            let (r, p) = parent.data.read_at(vec![0; SIZE as usize], 0).await;
            r.expect("read parent");
            assert!(p == image, "the parent changed");
            // BLOCK_STATUS covers the whole range and data is never reported as a hole.
            let ext = vol.extents(0, SIZE, 4096).await.expect("extents");
            assert_eq!(ext.iter().map(|e| e.length).sum::<u64>(), SIZE);
            let mut pos = 0usize;
            for e in ext {
                if e.flags & crate::proto::state::ZERO != 0 {
                    assert!(model[pos..pos + e.length as usize].iter().all(|&b| b == 0), "non-zero data reported as zero at {pos}");
                }
                pos += e.length as usize;
            }
        });
    }
}

#[test]
fn unowned_granules_report_the_parents_allocation() {
    let mut image = vec![0u8; SIZE as usize];
    image[..GRANULE as usize].fill(9);
    let parent = mem_parent(&image);
    rt_block(async {
        let head =
            clone_of(parent, MemBackend::new(SIZE), MemBackend::new(map::file_len(16)), SIZE).await.expect("clone");
        let vol = Layered::new(head);
        let ext = vol.extents(0, SIZE, 16).await.expect("extents");
        assert_eq!(ext[0], Extent64 { length: GRANULE, flags: 0 }, "inherited data: {ext:?}");
        assert_eq!(ext[1].flags, crate::proto::state::HOLE | crate::proto::state::ZERO);
        // Trimming an inherited granule in the clone makes it read zero, not the parent.
        vol.trim(0, GRANULE).await.expect("trim");
        let (r, b) = vol.read_at(vec![1; 4096], 0).await;
        r.expect("read");
        assert!(b.iter().all(|&x| x == 0));
    });
}

/// Content tag of a page: 0 reads as zeroes.
fn page_bytes(tag: u64) -> Vec<u8> {
    if tag == 0 {
        return vec![0; 4096];
    }
    (0..4096u64).map(|i| (tag.wrapping_mul(0x9E37_79B9).wrapping_add(i * 31) >> 3) as u8 | 1).collect()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One crash case: random page-aligned operations on a clone whose devices
/// share a crash clock; after the crash, reopen from the durable images.
async fn crash_case(seed: u64) {
    let pages = (SIZE / 4096) as usize;
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    let parent_tags: Vec<u64> = (0..pages).map(|i| if rng.next() % 3 == 0 { 0 } else { 1000 + i as u64 }).collect();
    let parent_img: Vec<u8> = parent_tags.iter().flat_map(|&t| page_bytes(t)).collect();
    let clock = CrashClock::new(rng.next() % 14, rng.next());
    let parent = Arc::new(Layer::base(1, SIZE, CrashBackend::new(&clock, parent_img.clone())));
    let data = CrashBackend::new(&clock, vec![0; SIZE as usize]);
    let mut map_img = vec![0u8; map::file_len(16) as usize];
    map_img[..map::HEADER as usize].copy_from_slice(&map::header(2, 16));
    let map_file = CrashBackend::new(&clock, map_img);
    let head = Layer {
        id: 2,
        size: SIZE,
        data,
        cow: Some(Cow { map: GranuleMap::empty(16), map_file, parent: parent.clone(), parent_limit: SIZE }),
    };
    let vol = Layered::new(head);
    let mut durable = parent_tags.clone();
    let mut maybe: Vec<Vec<u64>> = vec![Vec::new(); pages];
    for n in 0..40u64 {
        let kind = rng.next() % 10;
        let p0 = (rng.next() % pages as u64) as usize;
        let np = (1 + rng.next() % 24).min((pages - p0) as u64) as usize;
        let (off, len) = (p0 as u64 * 4096, np as u64 * 4096);
        let tag = seed.wrapping_mul(1000).wrapping_add(n * 100 + 5000);
        let (r, new, fua) = match kind {
            0..=4 => {
                let fua = kind == 4;
                let buf: Vec<u8> = (0..np).flat_map(|i| page_bytes(tag + i as u64)).collect();
                (vol.write_at(buf, off, fua).await.0, Some(tag), fua)
            }
            5 => (vol.write_zeroes(off, len, rng.next() % 2 == 0, false).await, Some(0), false),
            6 => (vol.trim(off, len).await, Some(0), false),
            _ => (vol.flush().await, None, false),
        };
        let page_tag = |i: usize| match new {
            Some(0) => 0,
            Some(t) => t + (i - p0) as u64,
            None => 0,
        };
        match (r, new) {
            (Ok(()), None) => {
                for p in 0..pages {
                    if let Some(&last) = maybe[p].last() {
                        durable[p] = last;
                    }
                    maybe[p].clear();
                }
            }
            (Ok(()), Some(_)) if fua => {
                for p in p0..p0 + np {
                    durable[p] = page_tag(p);
                    maybe[p].clear();
                }
            }
            (Ok(()), Some(_)) | (Err(_), Some(_)) => {
                for p in p0..p0 + np {
                    maybe[p].push(page_tag(p));
                }
            }
            (Err(_), None) => {}
        }
        if clock.crashed() {
            break;
        }
    }
    clock.crash();
    let (data_img, map_img) = {
        let head = vol.head().await;
        let cow = head.cow.as_ref().expect("cow");
        (head.data.durable(), cow.map_file.durable())
    };
    // Restart: a fresh clock that never fires, the durable images reopened.
    let clock = CrashClock::new(u64::MAX, 1);
    let parent = Arc::new(Layer::base(1, SIZE, CrashBackend::new(&clock, parent_img)));
    let map_file = CrashBackend::new(&clock, map_img);
    let map = GranuleMap::load(&map_file, 16).await.expect("map loads after a crash");
    let head = Layer {
        id: 2,
        size: SIZE,
        data: CrashBackend::new(&clock, data_img),
        cow: Some(Cow { map, map_file, parent, parent_limit: SIZE }),
    };
    head.reclaim().await.expect("reclaim");
    let cow = head.cow.as_ref().expect("cow");
    for g in 0..16 {
        if !cow.map.owned(g) {
            let (r, b) = head.data.read_at(vec![1; GRANULE as usize], g * GRANULE).await;
            r.expect("read");
            assert!(b.iter().all(|&x| x == 0), "seed {seed}: unowned granule {g} still holds data after reclaim");
        }
    }
    let vol = Layered::new(head);
    for p in 0..pages {
        let (r, got) = vol.read_at(vec![0; 4096], p as u64 * 4096).await;
        r.expect("read after restart");
        let ok = got == page_bytes(durable[p]) || maybe[p].iter().any(|&t| got == page_bytes(t));
        assert!(
            ok,
            "seed {seed}: page {p} holds neither its durable value {} nor a later write {:?}",
            durable[p], maybe[p]
        );
    }
}

#[test]
fn every_crash_point_keeps_what_was_flushed_and_never_shows_torn_copies() {
    let rt = rt();
    for seed in 1..=400u64 {
        rt.block_on(crash_case(seed));
    }
}
