//! The gate's benchmarks: gungraun library benchmarks over the shared
//! fixtures. Setup runs in gungraun's `setup` functions with Callgrind's
//! instrumentation off (`--instr-atstart=no`); only the closure passed to
//! [`measure`] is counted, on every thread. One run each: Callgrind counts
//! are exact, repeating would only repeat the same number.

use super::callgrind::measure;
use super::fixtures::{self, Block, CowChain, NbdRequest, Placement, Qcow2, Qcow2Walk, S3};
use coronafs::proto::request::{Command, REQUEST_LEN};
use gungraun::{Callgrind, EntryPoint, LibraryBenchmarkConfig, library_benchmark, library_benchmark_group, main};
use std::hint::black_box;

// ---- NBD codec

#[library_benchmark]
#[bench::mixed(setup = fixtures::request_headers)]
fn nbd_request_decode_validate(headers: Vec<[u8; REQUEST_LEN]>) -> Vec<[u8; REQUEST_LEN]> {
    black_box(measure(|| fixtures::decode_validate(&headers)));
    headers
}

fn reply_buffer() -> Vec<u8> {
    Vec::with_capacity(256)
}

#[library_benchmark]
#[bench::mixed(setup = reply_buffer)]
fn nbd_reply_encode(mut out: Vec<u8>) -> Vec<u8> {
    black_box(measure(|| fixtures::reply_encode(&mut out)));
    out
}

// ---- NBD request path

fn nbd(command: Command, len: u32) -> NbdRequest {
    NbdRequest::new(command, len)
}

#[library_benchmark]
#[bench::read_4k(args = (Command::Read, 4096), setup = nbd)]
#[bench::read_1m(args = (Command::Read, 1 << 20), setup = nbd)]
#[bench::write_4k(args = (Command::Write, 4096), setup = nbd)]
#[bench::write_1m(args = (Command::Write, 1 << 20), setup = nbd)]
fn nbd_request(mut f: NbdRequest) -> NbdRequest {
    black_box(measure(|| f.run()));
    f
}

// ---- copy-on-write chain

#[library_benchmark]
#[bench::read_4k_x48(setup = CowChain::new)]
fn cow_chain_3_levels(mut f: CowChain) -> CowChain {
    black_box(measure(|| f.run()));
    f
}

// ---- LightningStor placement

#[library_benchmark]
#[bench::keys_x64(setup = Placement::new)]
fn placement_key_to_replicas(f: Placement) -> Placement {
    black_box(measure(|| f.run()));
    f
}

// ---- hashing

#[library_benchmark]
#[bench::block_1m(setup = Block::new)]
fn blake3(f: Block) -> Block {
    black_box(measure(|| f.blake3()));
    f
}

#[library_benchmark]
#[bench::md5_crc32_1m(setup = Block::new)]
fn body_checksum(f: Block) -> Block {
    black_box(measure(|| f.body_checksum()));
    f
}

// ---- S3 in process

fn s3_put(len: usize) -> (S3, String, bytes::Bytes) {
    let f = S3::new(len);
    // One PUT more to warm the PUT path, then the measured one's key and body.
    f.put();
    let (key, body) = f.next_put();
    (f, key, body)
}

#[library_benchmark]
#[bench::put_4k(args = (4096), setup = s3_put)]
#[bench::put_1m(args = (1 << 20), setup = s3_put)]
fn s3_put_object(f: (S3, String, bytes::Bytes)) -> S3 {
    let (s3, key, body) = f;
    black_box(measure(|| s3.put_prepared(&key, body)));
    s3
}

#[library_benchmark]
#[bench::get_4k(args = (4096), setup = S3::new)]
#[bench::get_1m(args = (1 << 20), setup = S3::new)]
fn s3_get_object(f: S3) -> S3 {
    black_box(measure(|| f.get()));
    f
}

// ---- PlasmaVMC qcow2

fn qcow2() -> (Qcow2, Qcow2Walk) {
    let image = Qcow2::new();
    // A first walk warms the page cache and imago's code paths.
    drop(image.prepare().run());
    let walk = image.prepare();
    (image, walk)
}

#[library_benchmark]
#[bench::sparse_4g(setup = qcow2)]
fn qcow2_mapping_walk(f: (Qcow2, Qcow2Walk)) -> (Qcow2, usize) {
    let (image, walk) = f;
    let pieces = measure(|| walk.run());
    (image, pieces.len())
}

fn config() -> LibraryBenchmarkConfig {
    let mut c = LibraryBenchmarkConfig::default();
    c.tool(
        // No toggle on the benchmark function: `measure` switches the
        // instrumentation (global, unlike --toggle-collect, which is per thread).
        Callgrind::with_args(["--instr-atstart=no", "--cache-sim=no"]).entry_point(EntryPoint::None),
    );
    c
}

library_benchmark_group!(
    name = nbd_codec;
    config = config();
    benchmarks = nbd_request_decode_validate, nbd_reply_encode
);
library_benchmark_group!(
    name = nbd_server;
    config = config();
    benchmarks = nbd_request
);
library_benchmark_group!(
    name = coronafs_cow;
    config = config();
    benchmarks = cow_chain_3_levels
);
library_benchmark_group!(
    name = lightningstor;
    config = config();
    benchmarks = placement_key_to_replicas, blake3, body_checksum
);
library_benchmark_group!(
    name = s3_in_process;
    config = config();
    benchmarks = s3_put_object, s3_get_object
);
library_benchmark_group!(
    name = plasmavmc;
    config = config();
    benchmarks = qcow2_mapping_walk
);

main!(library_benchmark_groups = nbd_codec, nbd_server, coronafs_cow, lightningstor, s3_in_process, plasmavmc);

/// gungraun's harness (the `main` its macro generates above).
pub fn run() {
    main();
}
