//! One test suite, run against every backend.

use super::*;
use crate::proto::state;

const SIZE: u64 = 1 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

async fn read<B: BlockBackend>(b: &B, offset: u64, len: usize) -> Vec<u8> {
    let (r, buf) = b.read_at(vec![0xAA; len], offset).await;
    r.expect("read");
    buf
}

async fn write<B: BlockBackend>(b: &B, offset: u64, data: Vec<u8>) {
    let (r, _) = b.write_at(data, offset, false).await;
    r.expect("write");
}

async fn a_fresh_volume_reads_zero_and_is_one_hole<B: BlockBackend>(b: &B) {
    assert_eq!(b.size(), SIZE);
    assert!(read(b, 0, 8192).await.iter().all(|&x| x == 0));
    let e = b.extents(0, SIZE, 64).await.expect("extents");
    assert_eq!(e, vec![Extent64 { length: SIZE, flags: state::HOLE | state::ZERO }]);
}

async fn unaligned_writes_read_back<B: BlockBackend>(b: &B) {
    let data = pattern(10_000, 3);
    write(b, 12_345, data.clone()).await;
    assert_eq!(read(b, 12_345, 10_000).await, data);
    // The bytes around it are untouched.
    assert!(read(b, 12_000, 345).await.iter().all(|&x| x == 0));
    let (r, _) = b.write_at(pattern(100, 9), 40_000, true).await;
    r.expect("fua write");
    assert_eq!(read(b, 40_000, 100).await, pattern(100, 9));
    b.flush().await.expect("flush");
}

async fn zeroes_and_trim_read_as_zero_and_free_space<B: BlockBackend>(b: &B) {
    write(b, 0, pattern(256 * 1024, 1)).await;
    let e = b.extents(0, 256 * 1024, 64).await.expect("extents");
    assert_eq!(e, vec![Extent64 { length: 256 * 1024, flags: 0 }], "written range is data");
    b.write_zeroes(64 * 1024, 64 * 1024, true, false).await.expect("punch zeroes");
    b.write_zeroes(1000, 10, false, false).await.expect("zeroes no hole");
    b.trim(192 * 1024, 64 * 1024).await.expect("trim");
    let got = read(b, 0, 256 * 1024).await;
    let mut want = pattern(256 * 1024, 1);
    want[64 * 1024..128 * 1024].fill(0);
    want[1000..1010].fill(0);
    want[192 * 1024..].fill(0);
    assert_eq!(got, want);
    let e = b.extents(0, 256 * 1024, 64).await.expect("extents");
    let holes: u64 = e.iter().filter(|x| x.flags & state::HOLE != 0).map(|x| x.length).sum();
    assert_eq!(holes, 128 * 1024, "punched and trimmed ranges are holes: {e:?}");
    assert_eq!(e.iter().map(|x| x.length).sum::<u64>(), 256 * 1024);
}

async fn extents_respect_the_limit_and_cover_a_prefix<B: BlockBackend>(b: &B) {
    for i in 0..8u64 {
        write(b, i * 16384, vec![1; 4096]).await;
    }
    let e = b.extents(0, SIZE, 3).await.expect("extents");
    assert_eq!(e.len(), 3);
    assert_eq!(e[0], Extent64 { length: 4096, flags: 0 });
    assert_eq!(e[1].flags, state::HOLE | state::ZERO);
    let e = b.extents(4096 * 3 + 100, 50, 8).await.expect("extents");
    assert_eq!(e.iter().map(|x| x.length).sum::<u64>(), 50);
}

async fn concurrent_writers_are_all_visible<B: BlockBackend>(b: std::sync::Arc<B>) {
    let mut tasks = Vec::new();
    for i in 0..32u64 {
        let b = b.clone();
        tasks.push(tokio::spawn(async move {
            let (r, _) = b.write_at(pattern(4096, i as u8), i * 4096, false).await;
            r.expect("write");
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    for i in 0..32u64 {
        assert_eq!(read(&*b, i * 4096, 4096).await, pattern(4096, i as u8));
    }
}

async fn run_all<B: BlockBackend>(make: impl Fn() -> B) {
    a_fresh_volume_reads_zero_and_is_one_hole(&make()).await;
    unaligned_writes_read_back(&make()).await;
    zeroes_and_trim_read_as_zero_and_free_space(&make()).await;
    extents_respect_the_limit_and_cover_a_prefix(&make()).await;
    concurrent_writers_are_all_visible(std::sync::Arc::new(make())).await;
}

fn sparse_file(dir: &tempfile::TempDir) -> std::fs::File {
    let f = tempfile::tempfile_in(dir.path()).expect("tempfile");
    f.set_len(SIZE).expect("set_len");
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend_passes_the_suite() {
    run_all(|| memory::MemBackend::new(SIZE)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn threads_backend_passes_the_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    run_all(|| Opener::Threads.open(sparse_file(&dir)).expect("open")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_backend_passes_the_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let opener = Opener::start(IoEngine::Uring);
    assert_eq!(opener.engine(), IoEngine::Uring, "io_uring must work on the test host");
    run_all(|| opener.open(sparse_file(&dir)).expect("open")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layered_base_passes_the_suite() {
    run_all(|| layered::Layered::new(layered::Layer::base(1, SIZE, memory::MemBackend::new(SIZE)))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layered_clone_of_an_empty_parent_passes_the_suite() {
    let parent = std::sync::Arc::new(layered::Layer::base(1, SIZE, memory::MemBackend::new(SIZE)));
    let mut heads = Vec::new();
    for _ in 0..5 {
        let map = memory::MemBackend::new(layered::map::file_len(layered::map::count(SIZE)));
        heads.push(
            layered::tests::clone_of(parent.clone(), memory::MemBackend::new(SIZE), map, SIZE).await.expect("clone"),
        );
    }
    let heads = std::sync::Mutex::new(heads);
    run_all(|| layered::Layered::new(heads.lock().expect("lock").pop().expect("head"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layered_clone_over_files_passes_the_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let parent =
        std::sync::Arc::new(layered::Layer::base(1, SIZE, Opener::Threads.open(sparse_file(&dir)).expect("open")));
    let mut heads = Vec::new();
    for _ in 0..5 {
        let map = Opener::Threads.open(tempfile::tempfile_in(dir.path()).expect("map")).expect("open map");
        let data = Opener::Threads.open(sparse_file(&dir)).expect("open");
        heads.push(layered::tests::clone_of(parent.clone(), data, map, SIZE).await.expect("clone"));
    }
    let heads = std::sync::Mutex::new(heads);
    run_all(|| layered::Layered::new(heads.lock().expect("lock").pop().expect("head"))).await;
}
