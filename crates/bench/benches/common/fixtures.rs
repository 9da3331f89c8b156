//! The hot paths both bench targets measure: `gate` (instruction counts
//! under Callgrind, CI) and `hot_paths` (wall clock under criterion, tuning).
//! Each fixture does its setup in `new` and the measured operation in `run`,
//! so the two targets time exactly the same work.
//!
//! Included by path from each target (`#[path = "common/fixtures.rs"]`).

#![allow(dead_code)]

use aws_sdk_s3::config::{BehaviorVersion, Region};
use coronafs::backend::layered::map::{self, GRANULE, GranuleMap};
use coronafs::backend::layered::{Cow, Layer, Layered};
use coronafs::backend::memory::MemBackend;
use coronafs::backend::{AnyBackend, BlockBackend, Opener};
use coronafs::proto::NbdErrno;
use coronafs::proto::reply;
use coronafs::proto::request::{Command, REQUEST_LEN, Request};
use coronafs::server::Shared;
use coronafs::server::conn::Loopback;
use coronafs::volume::Volumes;
use std::hint::black_box;
use std::sync::Arc;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Bytes that differ per `seed`, so content-addressed stores see new blocks.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

// ---- NBD codec -------------------------------------------------------------

/// Request headers as a VM sends them: reads and writes of 4 KiB and 1 MiB,
/// FUA, flush, trim, block status; and one that fails validation.
pub fn request_headers() -> Vec<[u8; REQUEST_LEN]> {
    use coronafs::proto::cmd_flags::{FUA, REQ_ONE};
    let r = |command, flags, offset, length| Request::new(command, flags, offset ^ 0x5eed, offset, length).encode();
    vec![
        r(Command::Read, 0, 1 << 30, 4096),
        r(Command::Read, 0, 7 << 20, 1 << 20),
        r(Command::Write, 0, 4096, 4096),
        r(Command::Write, FUA, 3 << 20, 1 << 20),
        r(Command::Flush, 0, 0, 0),
        r(Command::Trim, 0, 1 << 31, 64 << 10),
        r(Command::BlockStatus, REQ_ONE, 0, 1 << 30),
        r(Command::Read, 0, (4 << 30) - 512, 4096),
    ]
}

/// Decodes and validates every header against a 4 GiB export; returns how many passed.
pub fn decode_validate(headers: &[[u8; REQUEST_LEN]]) -> usize {
    let mut ok = 0;
    for h in headers {
        let req = Request::decode(black_box(h)).expect("request magic");
        if req.validate(black_box(4 << 30), false, 32 << 20).is_ok() {
            ok += 1;
        }
    }
    ok
}

/// Encodes the replies of one request of each kind into `out`.
pub fn reply_encode(out: &mut Vec<u8>) -> usize {
    out.clear();
    out.extend_from_slice(reply::simple(black_box(7), 0).as_bytes());
    out.extend_from_slice(reply::data_chunk(black_box(8), true, 1 << 30, 4096).as_bytes());
    reply::hole_chunk(black_box(9), true, 2 << 30, 1 << 20, out);
    reply::error_chunk(black_box(10), NbdErrno::NoSpc, "write of 4096 bytes at offset 4294967296 refused", out);
    out.len()
}

// ---- NBD request through the server's path --------------------------------

/// One connection of the server to a memory-backed export: a request header
/// goes through decode, validate, the inline answer or `execute`, and the
/// reply's parts come back as the writer would send them (no socket).
pub struct NbdRequest {
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
    conn: Loopback,
    header: [u8; REQUEST_LEN],
    payload: Vec<u8>,
}

impl NbdRequest {
    pub fn new(command: Command, len: u32) -> Self {
        let rt = runtime();
        let dir = tempfile::tempdir().expect("tempdir");
        let volumes = Volumes::load(dir.path().to_path_buf(), Opener::Threads, false).expect("volumes");
        let shared = Arc::new(Shared::new(Arc::new(volumes), Default::default()));
        let backend = AnyBackend::Memory(MemBackend::new(64 << 20));
        let volume = shared.volumes.insert("gate", backend, false).expect("volume");
        let conn = Loopback::new(shared, volume, true);
        let header = Request::new(command, 0, 42, 8 << 20, len as u64).encode();
        let payload = if command == Command::Write { pattern(len as usize, 1) } else { Vec::new() };
        let mut f = NbdRequest { rt, _dir: dir, conn, header, payload };
        // Warm: the range is written once and the buffer pool holds a buffer.
        let write = Request::new(Command::Write, 0, 1, 8 << 20, len as u64).encode();
        let data = pattern(len as usize, 2);
        f.rt.block_on(f.conn.request(&write, &data, |_| {})).expect("warm write");
        f.run();
        f
    }

    /// Serves the request once; returns the reply's length.
    pub fn run(&mut self) -> usize {
        let mut n = 0;
        self.rt
            .block_on(self.conn.request(&self.header, &self.payload, |part| n += black_box(part).len()))
            .expect("request");
        n
    }
}

// ---- copy-on-write chain ---------------------------------------------------

/// A volume cloned twice (base <- clone <- clone of the clone), each layer
/// owning a third of the granules; reads of 4 KiB spread so that a third
/// resolve in the head, a third one level down and a third in the base.
pub struct CowChain {
    rt: tokio::runtime::Runtime,
    volume: Layered<AnyBackend>,
    bufs: Vec<Vec<u8>>,
}

const CHAIN_SIZE: u64 = 64 << 20;
const CHAIN_READS: u64 = 48;

fn mem(size: u64) -> AnyBackend {
    AnyBackend::Memory(MemBackend::new(size))
}

fn clone_layer(id: u64, parent: Layer<AnyBackend>, owned: impl Fn(u64) -> bool) -> Layer<AnyBackend> {
    let granules = map::count(CHAIN_SIZE);
    let cow = Cow {
        map: GranuleMap::empty(granules),
        map_file: mem(map::file_len(granules)),
        parent: Arc::new(parent),
        parent_limit: CHAIN_SIZE,
    };
    for g in (0..granules).filter(|&g| owned(g)) {
        cow.map.set(g);
    }
    Layer { id, size: CHAIN_SIZE, data: mem(CHAIN_SIZE), cow: Some(cow) }
}

impl CowChain {
    pub fn new() -> Self {
        let base = Layer::base(1, CHAIN_SIZE, mem(CHAIN_SIZE));
        let clone = clone_layer(2, base, |g| g % 3 == 1);
        let head = clone_layer(3, clone, |g| g % 3 == 2);
        assert_eq!(head.depth(), 3);
        let mut f =
            CowChain { rt: runtime(), volume: Layered::new(head), bufs: vec![vec![0u8; 4096]; CHAIN_READS as usize] };
        f.run();
        f
    }

    fn offset(i: u64) -> u64 {
        // Granules 0, 7, 14, ... cycle through the owners (g % 3).
        (i * 7 % map::count(CHAIN_SIZE)) * GRANULE + 512
    }

    /// Reads 48 blocks of 4 KiB through the chain; returns the bytes read.
    pub fn run(&mut self) -> usize {
        let volume = &self.volume;
        let bufs = &mut self.bufs;
        self.rt.block_on(async {
            let mut n = 0;
            for (i, slot) in bufs.iter_mut().enumerate() {
                let (r, buf) = volume.read_at(std::mem::take(slot), Self::offset(i as u64)).await;
                r.expect("read");
                n += buf.len();
                *slot = buf;
            }
            n
        })
    }
}

// ---- LightningStor placement ----------------------------------------------

/// Object keys to place on a 5-node cluster's layout.
pub struct Placement {
    layout: lightningstor::cluster::placement::Layout,
    keys: Vec<String>,
}

impl Placement {
    pub fn new() -> Self {
        use lightningstor::cluster::ClusterConfig;
        use lightningstor::cluster::placement::Layout;
        let cfg = ClusterConfig::init(5, std::path::Path::new("/nonexistent"), 9000, false).expect("config");
        let keys = (0..64u64).map(|i| format!("images/img-{:016x}/part-{}", i * 0x9E37_79B9, i % 977)).collect();
        Placement { layout: Layout::compute(&cfg), keys }
    }

    /// Key -> partition -> replica set for 64 keys; returns the replicas found.
    pub fn run(&self) -> usize {
        use lightningstor::cluster::placement::{Replication, partition_of};
        let parts = self.layout.partitions();
        self.keys
            .iter()
            .map(|k| {
                let p = partition_of(parts, black_box("gate-bucket"), k.as_bytes());
                self.layout.nodes_for(p).len()
            })
            .sum()
    }
}

// ---- hashing ---------------------------------------------------------------

/// One block of 1 MiB.
pub struct Block(pub Vec<u8>);

impl Block {
    pub fn new() -> Self {
        Block(pattern(1 << 20, 3))
    }

    /// The BLAKE3 that names a LightningStor block.
    pub fn blake3(&self) -> lightningstor::block::BlockHash {
        lightningstor::block::BlockHash::of(black_box(&self.0))
    }

    /// What an upload computes over its body: MD5 (the ETag) and the CRC32
    /// aws-sdk-s3 sends by default.
    pub fn body_checksum(&self) -> [u8; 16] {
        use lightningstor::checksum::{BodyHasher, ChecksumAlgo};
        let mut h = BodyHasher::new(Some(ChecksumAlgo::Crc32));
        h.update(black_box(&self.0));
        h.finalize().0
    }
}

// ---- S3 in process ---------------------------------------------------------

/// aws-sdk-s3 with the s3s service as its HTTP client, in front of a
/// single-node LightningStor on a temporary directory: request signing,
/// SigV4 checking, checksums, the engine and its block store, no sockets.
pub struct S3 {
    rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
    client: aws_sdk_s3::Client,
    body: bytes::Bytes,
    puts: std::cell::Cell<u64>,
}

const BUCKET: &str = "gate";

impl S3 {
    pub fn new(len: usize) -> Self {
        // One blocking thread that never idles out: the engine's block work
        // always runs on the same thread, started during setup, so a run
        // neither starts a thread nor spreads its work differently.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .max_blocking_threads(1)
            .thread_keep_alive(std::time::Duration::from_secs(24 * 3600))
            .build()
            .expect("runtime");
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = lightningstor::Config::new(dir.path()).with_keys("gate-ak", "gate-sk-0123456789");
        // The request path, not the disk's flush latency.
        cfg.fsync = false;
        let store = lightningstor::Store::open(cfg).expect("store");
        let service = lightningstor::server::service(store);
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .credentials_provider(aws_credential_types::Credentials::new(
                "gate-ak",
                "gate-sk-0123456789",
                None,
                None,
                "gate",
            ))
            .endpoint_url("http://localhost:9000")
            .force_path_style(true)
            // Its throughput checks poll the clock and the timer wheel: work
            // of the client that varies with wall time, not of the server.
            .stalled_stream_protection(aws_sdk_s3::config::StalledStreamProtectionConfig::disabled())
            .http_client(testkit::sdk::InProcess::from(service))
            .build();
        let client = aws_sdk_s3::Client::from_conf(conf);
        let body = bytes::Bytes::from(pattern(len, 4));
        let f = S3 { rt, _dir: dir, client, body, puts: Default::default() };
        f.rt.block_on(f.client.create_bucket().bucket(BUCKET).send()).expect("bucket");
        // Warm: one PUT and GET of the object GETs read, so connection-free
        // caches (identity, endpoint, blocking threads) are filled.
        f.rt.block_on(f.client.put_object().bucket(BUCKET).key("get").body(f.body.clone().into()).send()).expect("put");
        f.get();
        f
    }

    /// PUTs a new object of fresh content (a new block, not a deduplicated one).
    pub fn put(&self) -> usize {
        let (key, body) = self.next_put();
        self.put_prepared(&key, body)
    }

    /// PUTs `body` at `key`; the measured part of [`S3::put`].
    pub fn put_prepared(&self, key: &str, body: bytes::Bytes) -> usize {
        let n = body.len();
        self.rt.block_on(self.client.put_object().bucket(BUCKET).key(key).body(body.into()).send()).expect("put");
        n
    }

    /// A fresh (key, body) for [`S3::put_prepared`].
    pub fn next_put(&self) -> (String, bytes::Bytes) {
        let n = self.puts.get() + 1;
        self.puts.set(n);
        let mut data = self.body.to_vec();
        data[..8].copy_from_slice(&n.to_le_bytes());
        (format!("put-{n}"), bytes::Bytes::from(data))
    }

    /// GETs the object and collects its body; returns its length.
    pub fn get(&self) -> usize {
        self.rt.block_on(async {
            let r = self.client.get_object().bucket(BUCKET).key("get").send().await.expect("get");
            r.body.collect().await.expect("body").into_bytes().len()
        })
    }
}

// ---- PlasmaVMC qcow2 --------------------------------------------------------

/// A sparse qcow2 image of 4 GiB virtual size with 4 MiB of data in 1 MiB
/// extents spread over it, and its conversion into pieces: the header
/// probe, the L1 check and imago's mapping walk over every cluster.
pub struct Qcow2 {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    written: bench::qcow2::Written,
}

/// One walk ready to run: the file opened, every chunk marked arrived and a
/// channel large enough for every piece, so nothing waits.
pub struct Qcow2Walk {
    storage: plasmavmc::convert::Streamed,
    tx: tokio::sync::mpsc::Sender<plasmavmc::convert::Piece>,
    rx: tokio::sync::mpsc::Receiver<plasmavmc::convert::Piece>,
}

impl Qcow2 {
    pub const VIRTUAL: u64 = 4 << 30;

    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sparse.qcow2");
        let spec = bench::qcow2::Spec { virtual_size: Self::VIRTUAL, data_bytes: 4 << 20, seed: 9 };
        let written = bench::qcow2::write(&spec, &path).expect("write qcow2");
        Qcow2 { _dir: dir, path, written }
    }

    pub fn prepare(&self) -> Qcow2Walk {
        use plasmavmc::convert::{Arrivals, Streamed};
        let file = std::fs::File::open(&self.path).expect("open");
        let arrivals = Arc::new(Arrivals::new(self.written.file_size, 1 << 20));
        for i in 0..self.written.file_size.div_ceil(1 << 20) {
            arrivals.mark(i as usize);
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4096);
        Qcow2Walk { storage: Streamed::new(file, self.written.file_size, arrivals), tx, rx }
    }
}

impl Qcow2Walk {
    /// Walks the image; hands back the receiver holding the pieces.
    pub fn run(self) -> tokio::sync::mpsc::Receiver<plasmavmc::convert::Piece> {
        let done = std::sync::atomic::AtomicU64::new(0);
        plasmavmc::convert::qcow2_to_pieces(self.storage, self.tx, &done).expect("walk");
        assert_eq!(done.into_inner(), Qcow2::VIRTUAL);
        self.rx
    }
}
