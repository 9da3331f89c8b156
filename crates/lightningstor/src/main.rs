//! The `lightningstor` command.

use anyhow::Context;
use clap::{Parser, Subcommand};
use lightningstor::Config;
use std::net::SocketAddr;
use std::path::PathBuf;

/// LightningStor: an S3-compatible object store.
///
/// Objects are cut into ~1 MiB blocks stored by BLAKE3 hash and verified on
/// every read; metadata lives in a redb database beside them. Every client
/// request must be signed (SigV4 headers or presigned URLs) with the
/// configured admin key or a key made by `lightningstor key create`, unless
/// --anonymous is given.
#[derive(Parser, Debug)]
#[command(version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve the S3 API (and /metrics) from DATA_DIR.
    ///
    /// Settings come from --config (TOML, unknown fields rejected), then
    /// environment, then flags; a flag wins over the file.
    #[command(
        after_help = "Example:\n  LIGHTNINGSTOR_ACCESS_KEY=key LIGHTNINGSTOR_SECRET_KEY=secret \\\n    lightningstor serve --data-dir /srv/lightningstor --listen 127.0.0.1:9000"
    )]
    Serve {
        /// Directory for the metadata database and block files (created if missing).
        #[arg(long, value_name = "DIR")]
        data_dir: Option<PathBuf>,
        /// Address to listen on for S3 and /metrics [default: 127.0.0.1:9000].
        #[arg(long, value_name = "ADDR")]
        listen: Option<SocketAddr>,
        /// Access key id clients sign requests with.
        #[arg(long, env = "LIGHTNINGSTOR_ACCESS_KEY", value_name = "KEY", hide_env_values = true)]
        access_key: Option<String>,
        /// Secret key clients sign requests with.
        #[arg(long, env = "LIGHTNINGSTOR_SECRET_KEY", value_name = "SECRET", hide_env_values = true)]
        secret_key: Option<String>,
        /// Accept unsigned requests. Required to run without keys; with keys,
        /// signed requests are still verified.
        #[arg(long)]
        anonymous: bool,
        /// Base domain for virtual-hosted-style requests (BUCKET.DOMAIN);
        /// repeatable [default: localhost].
        #[arg(long = "domain", value_name = "DOMAIN")]
        domains: Vec<String>,
        /// Region reported to clients and used in signatures [default: us-east-1].
        #[arg(long, value_name = "REGION")]
        region: Option<String>,
        /// TOML configuration file (fields as in docs/lightningstor.md); with
        /// --node, the cluster file shared by every node.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Run as this node of the cluster described by --config (replicated
        /// mode). The node's S3 and node-to-node addresses, data directory,
        /// domains and region come from the cluster file, so --listen,
        /// --data-dir, --domain and --region are refused with it.
        #[arg(
            long,
            value_name = "NAME",
            requires = "config",
            conflicts_with_all = ["data_dir", "listen", "domains", "region"]
        )]
        node: Option<String>,
    },
    /// Set up and inspect a replicated cluster.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Create, list and delete access keys of a running server.
    ///
    /// A key is an access key id, a secret and a name; it may use a bucket
    /// only as `lightningstor bucket allow` grants (or as the creator of
    /// the bucket). The command asks the running server (any node of a
    /// cluster), signing its request with the admin key.
    #[command(subcommand)]
    Key(KeyCmd),
    /// Grant and revoke keys' permissions on buckets of a running server.
    #[command(subcommand)]
    Bucket(BucketCmd),
}

/// Which server an admin command asks, and the admin key it signs with.
#[derive(clap::Args, Debug)]
struct AdminTarget {
    /// The server's configuration file (single node), or the cluster file
    /// (with --node, or its first node): gives the address and admin key.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// With a cluster file: the node to ask.
    #[arg(long, value_name = "NAME", requires = "config")]
    node: Option<String>,
    /// The server's S3 address (HOST:PORT); overrides the file's.
    #[arg(long, value_name = "HOST:PORT")]
    endpoint: Option<String>,
    /// The admin key's access key id; overrides the file's.
    #[arg(long, env = "LIGHTNINGSTOR_ACCESS_KEY", value_name = "KEY", hide_env_values = true)]
    access_key: Option<String>,
    /// The admin key's secret; overrides the file's.
    #[arg(long, env = "LIGHTNINGSTOR_SECRET_KEY", value_name = "SECRET", hide_env_values = true)]
    secret_key: Option<String>,
}

#[derive(Subcommand, Debug)]
enum KeyCmd {
    /// Create a key called NAME and print its id and secret (shown only here).
    #[command(
        after_help = "Example:\n  lightningstor key create backup --config /etc/lightningstor.toml\n  lightningstor key create backup --config cluster.toml --node n2"
    )]
    Create {
        /// The key's name (letters, digits, '-', '_', '.'; unique).
        name: String,
        #[command(flatten)]
        target: AdminTarget,
    },
    /// List the keys: id, name, and the buckets each may use.
    List {
        #[command(flatten)]
        target: AdminTarget,
    },
    /// Delete a key (by id or name) and its grants; requests signed with it
    /// are refused with InvalidAccessKeyId from then on.
    Delete {
        /// The key's id or name.
        key: String,
        #[command(flatten)]
        target: AdminTarget,
    },
}

/// Permission flags of `bucket allow` and `bucket deny`.
#[derive(clap::Args, Debug)]
struct PermFlags {
    /// GET, HEAD and listings.
    #[arg(long)]
    read: bool,
    /// PUT, DELETE, copies into the bucket and multipart uploads.
    #[arg(long)]
    write: bool,
    /// Deleting the bucket and changing its configuration.
    #[arg(long)]
    owner: bool,
}

impl PermFlags {
    fn perms(&self) -> anyhow::Result<lightningstor::keys::Perms> {
        use lightningstor::keys::Perms;
        let mut p = Perms::NONE;
        for (set, flag) in [(self.read, Perms::READ), (self.write, Perms::WRITE), (self.owner, Perms::OWNER)] {
            if set {
                p = p.union(flag);
            }
        }
        anyhow::ensure!(!p.is_empty(), "give at least one of --read, --write, --owner");
        Ok(p)
    }
}

#[derive(Subcommand, Debug)]
enum BucketCmd {
    /// Let a key read, write or own a bucket (adds to what it has).
    #[command(
        after_help = "Example:\n  lightningstor bucket allow --read --write photos --key backup --config /etc/lightningstor.toml"
    )]
    Allow(Grant),
    /// Take permissions on a bucket away from a key.
    Deny(Grant),
}

/// Which permissions of which key on which bucket (`bucket allow|deny`).
#[derive(clap::Args, Debug)]
struct Grant {
    #[command(flatten)]
    perms: PermFlags,
    /// The bucket (it must exist).
    bucket: String,
    /// The key's id or name.
    #[arg(long, value_name = "KEY")]
    key: String,
    #[command(flatten)]
    target: AdminTarget,
}

impl AdminTarget {
    /// The admin client this target names.
    fn client(self) -> anyhow::Result<lightningstor::admin::Client> {
        let (mut addr, mut ak, mut sk) = (None, None, None);
        if let Some(path) = &self.config {
            match &self.node {
                Some(name) => {
                    let c = lightningstor::cluster::ClusterConfig::from_file(path)?;
                    addr = Some(c.node(name)?.s3.to_string());
                    (ak, sk) = (c.access_key, c.secret_key);
                }
                None => match lightningstor::cluster::ClusterConfig::from_file(path) {
                    Ok(c) => {
                        addr = c.nodes.first().map(|n| n.s3.to_string());
                        (ak, sk) = (c.access_key, c.secret_key);
                    }
                    Err(_) => {
                        let c = Config::from_file(path)?;
                        addr = Some(c.listen.to_string());
                        (ak, sk) = (c.access_key, c.secret_key);
                    }
                },
            }
        }
        let addr = self.endpoint.or(addr).unwrap_or_else(|| "127.0.0.1:9000".to_owned());
        let ak = self.access_key.or(ak);
        let sk = self.secret_key.or(sk);
        let (Some(ak), Some(sk)) = (ak, sk) else {
            anyhow::bail!(
                "no admin key: give --config FILE with access_key and secret_key, or --access-key and --secret-key \
                 (LIGHTNINGSTOR_ACCESS_KEY / LIGHTNINGSTOR_SECRET_KEY)"
            );
        };
        Ok(lightningstor::admin::Client::new(&addr, &ak, &sk))
    }
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Print a cluster file for N nodes on 127.0.0.1 (one data dir per node
    /// under DIR). Start each node with `lightningstor serve --config FILE --node nI`.
    #[command(
        after_help = "Example:\n  lightningstor cluster init --nodes 3 --base-dir /tmp/ls > cluster.toml\n  for n in n1 n2 n3; do lightningstor serve --config cluster.toml --node $n & done"
    )]
    Init {
        /// Number of nodes (replication factor is min(3, N)).
        #[arg(long, value_name = "N")]
        nodes: usize,
        /// Directory holding one data directory per node.
        #[arg(long, value_name = "DIR")]
        base_dir: PathBuf,
        /// S3 port of node 1; node i uses P+i-1 for S3 and P+100+i-1 for RPC.
        #[arg(long, value_name = "P", default_value_t = 3900)]
        base_port: u16,
        /// Accept unsigned requests (an open cluster: everyone may do
        /// everything). Without it, requests must be signed with the admin
        /// key the file holds (random, as is the rpc_secret) or a key made
        /// with `lightningstor key create`.
        #[arg(long)]
        anonymous: bool,
    },
    /// Show every node's health, layout version and repair backlog.
    ///
    /// Asks each node of the file over its RPC address; a node that does not
    /// answer is shown DOWN with the reason. Exits with an error when no node
    /// answers.
    Status {
        /// The cluster file.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Change the layout of a running cluster (add or remove nodes).
    #[command(subcommand)]
    Layout(LayoutCmd),
}

#[derive(Subcommand, Debug)]
enum LayoutCmd {
    /// Move a running cluster to a new cluster file.
    ///
    /// NEW must keep `partitions` and `replication_factor`, and carry a
    /// `layout_version` above the running one. Start added nodes first
    /// (`lightningstor serve --config NEW --node NAME`). The command tells
    /// every node of the old and new file to write to both replica sets,
    /// moves the data in rounds until nothing is left to move, then drops
    /// the old layout; reads and writes go on meanwhile. Afterwards stop the
    /// removed nodes and install NEW as every node's cluster file (a node
    /// restarted with the old file would run the old layout).
    #[command(
        after_help = "Example (add node n4):\n  lightningstor serve --config new.toml --node n4 &\n  lightningstor cluster layout apply --config new.toml"
    )]
    Apply {
        /// The new cluster file.
        #[arg(long, value_name = "NEW")]
        config: PathBuf,
        /// Seconds one node may take for one step (a rebalance round moves
        /// all of its rows).
        #[arg(long, value_name = "SECS", default_value_t = 3600)]
        timeout: u64,
    },
}

fn main() -> anyhow::Result<()> {
    limit_allocator_retention();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,s3s=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Key(cmd) => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(key(cmd))
        }
        Cmd::Bucket(cmd) => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(bucket(cmd))
        }
        Cmd::Cluster(ClusterCmd::Init { nodes, base_dir, base_port, anonymous }) => {
            let c = lightningstor::cluster::ClusterConfig::init(nodes, &base_dir, base_port, anonymous)?;
            print!("{}", c.to_toml());
            Ok(())
        }
        Cmd::Cluster(ClusterCmd::Status { config }) => {
            let c = lightningstor::cluster::ClusterConfig::from_file(&config)?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(status(c))
        }
        Cmd::Cluster(ClusterCmd::Layout(LayoutCmd::Apply { config, timeout })) => {
            let c = lightningstor::cluster::ClusterConfig::from_file(&config)?;
            let rt = tokio::runtime::Runtime::new()?;
            let moved = rt.block_on(lightningstor::cluster::admin::apply_layout(
                c,
                std::time::Duration::from_secs(timeout),
                |m| println!("{m}"),
            ))?;
            println!("done: {moved} rows moved");
            Ok(())
        }
        Cmd::Serve { node: Some(name), config: Some(path), access_key, secret_key, anonymous, .. } => {
            let mut c = lightningstor::cluster::ClusterConfig::from_file(&path)?;
            if access_key.is_some() {
                c.access_key = access_key;
            }
            if secret_key.is_some() {
                c.secret_key = secret_key;
            }
            c.anonymous |= anonymous;
            c.validate()?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(serve_node(c, name))
        }
        Cmd::Serve { data_dir, listen, access_key, secret_key, anonymous, domains, region, config, node: _ } => {
            let mut cfg = match &config {
                Some(path) => Config::from_file(path)?,
                None => Config::default(),
            };
            match data_dir {
                Some(d) => cfg.data_dir = d,
                None if config.is_none() => anyhow::bail!("--data-dir (or --config) is required"),
                None => {}
            }
            if let Some(l) = listen {
                cfg.listen = l;
            }
            if access_key.is_some() {
                cfg.access_key = access_key;
            }
            if secret_key.is_some() {
                cfg.secret_key = secret_key;
            }
            cfg.anonymous |= anonymous;
            if !domains.is_empty() {
                cfg.domains = domains;
            }
            if let Some(r) = region {
                cfg.region = r;
            }
            cfg.validate()?;
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(serve(cfg))
        }
    }
}

/// Block buffers (1 MiB) are allocated on many blocking threads and freed on
/// others; with glibc's default of 8 arenas per core each arena keeps its own
/// freed buffers. Fewer arenas means freed buffers are reused instead of
/// retained, which keeps RSS close to the working set.
fn limit_allocator_retention() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called first thing in main, before any other thread exists;
    // mallopt only adjusts allocator tuning parameters.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

async fn key(cmd: KeyCmd) -> anyhow::Result<()> {
    match cmd {
        KeyCmd::Create { name, target } => {
            let k = target.client()?.create_key(&name).await?;
            println!("key id:     {}\nsecret key: {}\nname:       {}", k.id, k.secret, k.name);
        }
        KeyCmd::List { target } => {
            println!("{:<28} {:<20} buckets", "key id", "name");
            for k in target.client()?.list_keys().await? {
                let g: Vec<String> = k.grants.iter().map(|(b, p)| format!("{b}({p})")).collect();
                println!("{:<28} {:<20} {}", k.id, k.name, g.join(" "));
            }
        }
        KeyCmd::Delete { key, target } => {
            let id = target.client()?.delete_key(&key).await?;
            println!("deleted key {id}");
        }
    }
    Ok(())
}

async fn bucket(cmd: BucketCmd) -> anyhow::Result<()> {
    use lightningstor::keys::Perms;
    let (bucket, key, allow, deny, target) = match cmd {
        BucketCmd::Allow(Grant { perms, bucket, key, target }) => (bucket, key, perms.perms()?, Perms::NONE, target),
        BucketCmd::Deny(Grant { perms, bucket, key, target }) => (bucket, key, Perms::NONE, perms.perms()?, target),
    };
    let now = target.client()?.change_grant(&bucket, &key, allow, deny).await?;
    println!("key {key} on bucket {bucket}: {now}");
    Ok(())
}

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let data_dir = cfg.data_dir.clone();
    let (running, _store) = lightningstor::server::start(cfg).await?;
    tracing::info!(addr = %running.addr, data_dir = %data_dir.display(), "lightningstor listening");
    // A line tests and scripts can wait for.
    println!("listening on {}", running.addr);
    wait_for_signal().await?;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

async fn serve_node(c: lightningstor::cluster::ClusterConfig, name: String) -> anyhow::Result<()> {
    let running = lightningstor::cluster::start(c, &name).await.with_context(|| format!("starting node {name}"))?;
    tracing::info!(addr = %running.s3.addr, node = %name, "lightningstor cluster node listening");
    println!("listening on {}", running.s3.addr);
    wait_for_signal().await?;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

async fn status(c: lightningstor::cluster::ClusterConfig) -> anyhow::Result<()> {
    let nodes = lightningstor::cluster::admin::status(&c, std::time::Duration::from_secs(5)).await?;
    println!(
        "cluster: {} node{}, replication factor {}, R={} W={}, {:?}, layout version {}, {} partitions",
        c.nodes.len(),
        if c.nodes.len() == 1 { "" } else { "s" },
        c.replication_factor,
        c.r(),
        c.w(),
        c.consistency,
        c.layout_version,
        c.partitions
    );
    let layout = lightningstor::cluster::placement::Layout::compute(&c);
    println!(
        "{:<8} {:<4} {:<8} {:<22} {:<6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "node", "id", "zone", "s3", "health", "layout", "parts", "objects", "blocks", "resync", "corrupt"
    );
    let mut backlog = 0;
    let mut moving = Vec::new();
    for (n, r) in &nodes {
        let parts = layout.partitions_of(n.id).len();
        let line = match r {
            Ok(s) => {
                backlog += s.resync_queue;
                if let Some(p) = s.previous_layout {
                    moving.push(format!("{} ({p} -> {})", n.name, s.layout_version));
                }
                format!(
                    "{:<6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8}",
                    "up", s.layout_version, parts, s.objects, s.blocks, s.resync_queue, s.corrupt_blocks
                )
            }
            Err(e) => format!("{:<6} {:>6} {:>8}  ({e})", "DOWN", "-", parts),
        };
        println!("{:<8} {:<4} {:<8} {:<22} {line}", n.name, n.id, n.zone, n.s3.to_string());
    }
    println!("repair backlog: {backlog} resync entries");
    if !moving.is_empty() {
        println!("layout change in progress on: {}", moving.join(", "));
    }
    // Conditions, one line per node that answered, below the table (the
    // table's columns are parsed by scripts and tests).
    println!("data dirs:");
    for (n, s) in nodes.iter().filter_map(|(n, r)| r.as_ref().ok().map(|s| (n, s))) {
        let writes = match (s.o_direct, s.o_direct_fell_back) {
            (true, _) => "O_DIRECT",
            (false, true) => "buffered (O_DIRECT refused by a write, fell back)",
            (false, false) => "buffered",
        };
        let fs = &s.data_dir_fs;
        println!(
            "  {}: {} on {} (mounted at {}), {}; block writes {writes}; host {}, {}, {} CPUs",
            n.name, fs.fs_type, fs.device, fs.mount_point, fs.path, s.host.hostname, s.host.kernel, s.host.cpus
        );
    }
    Ok(())
}
