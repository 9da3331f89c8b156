//! criterion benches for the hot paths: the NBD request/reply codec, an
//! in-process NBD read/write round trip over loopback, LightningStor's block
//! hashing and placement (key -> partition -> replicas, and computing a
//! layout), PlasmaVMC's qcow2 mapping walk (probe, L1 check and imago's
//! mapping of a sparse image into pieces), and an in-process S3 PUT/GET
//! (aws-sdk-s3 plugged straight into the s3s service, no sockets).
//!
//! `cargo bench --workspace --bench hot_paths` measures (figures in
//! docs/bench.md); the test command (`cargo test --workspace`) runs each
//! benchmark once, untimed (`test = true` in Cargo.toml).

use coronafs::proto::reply::{self, ReplyHeader};
use coronafs::proto::request::{Command, Request};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::sync::Arc;

fn codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("nbd_codec");
    let req = Request { flags: 0, command: Command::Read, cookie: 42, offset: 1 << 30, length: 4096 };
    g.bench_function("request_encode", |b| b.iter(|| black_box(black_box(&req).encode())));
    let bytes = req.encode();
    g.bench_function("request_decode", |b| b.iter(|| Request::decode(black_box(&bytes))));
    g.bench_function("request_validate", |b| b.iter(|| black_box(&req).validate(4 << 30, false, 32 << 20)));
    let head = reply::data_chunk(42, true, 1 << 30, 4096);
    g.bench_function("reply_data_chunk_encode", |b| b.iter(|| black_box(reply::data_chunk(42, true, 1 << 30, 4096))));
    let hb = head.as_bytes().to_vec();
    g.bench_function("reply_header_decode", |b| b.iter(|| ReplyHeader::decode(black_box(&hb))));
    g.finish();
}

fn nbd_round_trip(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = coronafs::server::ServerConfig::ephemeral(dir.path(), coronafs::backend::IoEngine::Threads);
    let srv = rt.block_on(coronafs::server::start(cfg)).expect("server");
    rt.block_on(srv.shared.exports.create("bench", 64 << 20)).expect("volume");
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

fn block_hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("lightningstor_block_hash");
    for size in [64 << 10, 1 << 20] {
        let data = vec![0x5Au8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("blake3_{}k", size >> 10), |b| {
            b.iter(|| lightningstor::block::BlockHash::of(black_box(&data)))
        });
    }
    g.finish();
}

fn placement(c: &mut Criterion) {
    use lightningstor::cluster::ClusterConfig;
    use lightningstor::cluster::placement::{Layout, Replication, partition_of};
    let mut g = c.benchmark_group("lightningstor_placement");
    let cfg = ClusterConfig::init(5, std::path::Path::new("/nonexistent"), 9000).expect("config");
    let layout = Layout::compute(&cfg);
    let parts = layout.partitions();
    g.bench_function("key_to_replicas", |b| {
        let mut i = 0u64;
        b.iter(|| {
            i += 1;
            let key = format!("images/img-{i:016x}/part-{}", i % 977);
            let p = partition_of(parts, "bench-bucket", key.as_bytes());
            black_box(layout.nodes_for(p).len())
        })
    });
    g.bench_function("compute_layout_5_nodes_256_partitions", |b| b.iter(|| Layout::compute(black_box(&cfg))));
    g.finish();
}

fn qcow2_walk(c: &mut Criterion) {
    use plasmavmc::convert::{Arrivals, Piece, Streamed, qcow2_to_pieces};
    use std::sync::atomic::AtomicU64;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut g = c.benchmark_group("qcow2_mapping_walk");
    // Sparse: 16 GiB virtual, 4 MiB allocated in 1 MiB extents; the walk
    // (tables, mapping, holes) dominates, not the data copy.
    for (virt, data) in [(16u64 << 30, 4u64 << 20), (1 << 30, 64 << 20)] {
        let path = dir.path().join(format!("{}-{}.qcow2", virt >> 30, data >> 20));
        let spec = bench::qcow2::Spec { virtual_size: virt, data_bytes: data, seed: 9 };
        let w = bench::qcow2::write(&spec, &path).expect("write qcow2");
        g.throughput(Throughput::Bytes(w.data_bytes));
        g.bench_function(format!("{}g_virtual_{}m_data", virt >> 30, data >> 20), |b| {
            b.iter(|| {
                let file = std::fs::File::open(&path).expect("open");
                let arrivals = std::sync::Arc::new(Arrivals::new(w.file_size, 1 << 20));
                for i in 0..w.file_size.div_ceil(1 << 20) {
                    arrivals.mark(i as usize);
                }
                let (tx, mut rx) = tokio::sync::mpsc::channel::<Piece>(64);
                let drain = std::thread::spawn(move || {
                    let mut n = 0u64;
                    while let Some(p) = rx.blocking_recv() {
                        n += match p {
                            Piece::Data { data, .. } => data.len() as u64,
                            Piece::Zero { len, .. } => len,
                        };
                    }
                    n
                });
                let done = AtomicU64::new(0);
                qcow2_to_pieces(Streamed::new(file, w.file_size, arrivals), tx, &done).expect("walk");
                assert_eq!(drain.join().expect("drain"), virt);
            })
        });
    }
    g.finish();
}

fn s3_put_get(c: &mut Criterion) {
    use aws_sdk_s3::config::{BehaviorVersion, Region};
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = lightningstor::Config::new(dir.path()).with_keys("ak", "sk-0123456789");
    // The bench measures the request path, not the disk's fsync latency.
    cfg.fsync = false;
    let store = lightningstor::Store::open(cfg).expect("store");
    let service = lightningstor::server::service(store);
    let conf = aws_sdk_s3::config::Builder::new()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(aws_credential_types::Credentials::new("ak", "sk-0123456789", None, None, "bench"))
        .endpoint_url("http://localhost:9000")
        .force_path_style(true)
        .http_client(s3s_aws::Client::from(service))
        .build();
    let client = aws_sdk_s3::Client::from_conf(conf);
    rt.block_on(client.create_bucket().bucket("hot-paths").send()).expect("bucket");
    let body = bytes::Bytes::from(vec![0x33u8; 256 << 10]);
    rt.block_on(client.put_object().bucket("hot-paths").key("get").body(body.clone().into()).send()).expect("put");
    let mut g = c.benchmark_group("s3_in_process");
    g.throughput(Throughput::Bytes(body.len() as u64));
    let mut i = 0u64;
    g.bench_function("put_256k", |b| {
        b.iter_batched(
            || {
                i += 1;
                format!("k{}", i % 64)
            },
            |k| {
                rt.block_on(client.put_object().bucket("hot-paths").key(k).body(body.clone().into()).send())
                    .expect("put")
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("get_256k", |b| {
        b.iter(|| {
            rt.block_on(async {
                let r = client.get_object().bucket("hot-paths").key("get").send().await.expect("get");
                r.body.collect().await.expect("body").into_bytes().len()
            })
        })
    });
    g.finish();
}

criterion_group!(benches, codec, nbd_round_trip, block_hashing, placement, qcow2_walk, s3_put_get);
criterion_main!(benches);
