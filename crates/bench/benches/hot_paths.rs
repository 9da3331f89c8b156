//! criterion benches of the hot paths, for wall-clock tuning on a quiet
//! machine. The groups and the work are those of the instruction-count gate
//! (`benches/gate`, the fixtures in `benches/common/fixtures.rs`): the NBD
//! codec, one NBD request through the server's path on a memory export, reads
//! through a 3-level copy-on-write chain, LightningStor's placement and block
//! hashing, an in-process S3 PUT/GET (aws-sdk-s3 plugged straight into the
//! s3s service, no sockets) and PlasmaVMC's qcow2 mapping walk. One group more
//! has no gate twin: an NBD round trip over loopback TCP, whose cost is
//! mostly syscalls and wake-ups, which Callgrind does not count.
//!
//! `cargo bench -p bench --bench hot_paths` measures (figures and the
//! baseline workflow in docs/bench.md); the test command (`cargo test
//! --workspace`) runs each benchmark once, untimed (`test = true` in
//! Cargo.toml).

#[path = "common/fixtures.rs"]
mod fixtures;

use coronafs::proto::request::Command;
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use fixtures::{Block, CowChain, NbdRequest, Placement, Qcow2, S3};
use std::sync::Arc;

fn nbd_codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("nbd_codec");
    let headers = fixtures::request_headers();
    g.bench_function("request_decode_validate/mixed", |b| b.iter(|| fixtures::decode_validate(&headers)));
    let mut out = Vec::with_capacity(256);
    g.bench_function("reply_encode/mixed", |b| b.iter(|| fixtures::reply_encode(&mut out)));
    g.finish();
}

fn nbd_server(c: &mut Criterion) {
    let mut g = c.benchmark_group("nbd_server");
    for (command, len, name) in [
        (Command::Read, 4096u32, "read_4k"),
        (Command::Read, 1 << 20, "read_1m"),
        (Command::Write, 4096, "write_4k"),
        (Command::Write, 1 << 20, "write_1m"),
    ] {
        let mut f = NbdRequest::new(command, len);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_function(format!("nbd_request/{name}"), |b| b.iter(|| f.run()));
    }
    g.finish();
}

fn coronafs_cow(c: &mut Criterion) {
    let mut g = c.benchmark_group("coronafs_cow");
    let mut f = CowChain::new();
    g.bench_function("cow_chain_3_levels/read_4k_x48", |b| b.iter(|| f.run()));
    g.finish();
}

fn lightningstor(c: &mut Criterion) {
    let mut g = c.benchmark_group("lightningstor");
    let p = Placement::new();
    g.bench_function("placement_key_to_replicas/keys_x64", |b| b.iter(|| p.run()));
    let block = Block::new();
    g.throughput(Throughput::Bytes(block.0.len() as u64));
    g.bench_function("blake3/block_1m", |b| b.iter(|| block.blake3()));
    g.bench_function("body_checksum/md5_crc32_1m", |b| b.iter(|| block.body_checksum()));
    g.finish();
}

fn s3_in_process(c: &mut Criterion) {
    let mut g = c.benchmark_group("s3_in_process");
    for len in [4096usize, 1 << 20] {
        let name = if len == 4096 { "4k" } else { "1m" };
        g.throughput(Throughput::Bytes(len as u64));
        let f = S3::new(len);
        g.bench_function(format!("s3_put_object/put_{name}"), |b| {
            b.iter_batched(|| f.next_put(), |(key, body)| f.put_prepared(&key, body), BatchSize::SmallInput)
        });
        g.bench_function(format!("s3_get_object/get_{name}"), |b| b.iter(|| f.get()));
    }
    g.finish();
}

fn plasmavmc(c: &mut Criterion) {
    let mut g = c.benchmark_group("plasmavmc");
    let image = Qcow2::new();
    g.throughput(Throughput::Bytes(Qcow2::VIRTUAL));
    g.bench_function("qcow2_mapping_walk/sparse_4g", |b| {
        b.iter_batched(|| image.prepare(), |walk| walk.run(), BatchSize::PerIteration)
    });
    g.finish();
}

/// Not in the gate: a real NBD connection over loopback TCP, QD1 and 32
/// pipelined reads.
fn nbd_round_trip(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = coronafs::config::ServerConfig::ephemeral(dir.path(), coronafs::backend::IoEngine::Threads);
    let srv = rt.block_on(coronafs::service::start(cfg)).expect("server");
    rt.block_on(srv.volumes.create("bench", 64 << 20)).expect("volume");
    let client = Arc::new(rt.block_on(coronafs::client::NbdClient::connect(srv.nbd_addr, "bench")).expect("connect"));
    let data = vec![0xA5u8; 4096];
    rt.block_on(client.write(0, &data, false)).expect("write");
    let mut g = c.benchmark_group("nbd_round_trip");
    g.throughput(Throughput::Bytes(4096));
    g.bench_function("write_4k", |b| b.iter(|| rt.block_on(client.write(4096, &data, false)).expect("write")));
    g.bench_function("read_4k", |b| {
        let mut buf = vec![0u8; 4096];
        b.iter(|| {
            buf = rt.block_on(client.read_into(std::mem::take(&mut buf), 0)).expect("read");
        })
    });
    g.throughput(Throughput::Bytes(32 * 4096));
    g.bench_function("read_4k_x32_pipelined", |b| {
        b.iter(|| {
            rt.block_on(async {
                let reads = (0..32u64).map(|i| client.read(i * 4096, 4096));
                for r in futures::future::join_all(reads).await {
                    r.expect("read");
                }
            })
        })
    });
    g.finish();
    drop(client);
    rt.block_on(srv.shutdown());
}

criterion_group!(benches, nbd_codec, nbd_server, coronafs_cow, lightningstor, s3_in_process, plasmavmc, nbd_round_trip);
criterion_main!(benches);
