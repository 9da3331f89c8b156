//! The `plasmavmc` binary: `serve`, and a client for every API call.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use plasmavmc::Config;
use plasmavmc::client::Client;
use plasmavmc::model::{CreateImage, CreateVm, CreateVolume, MigrateVm, S3Source};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "plasmavmc",
    version,
    about = "PlasmaVMC: VM images in LightningStor, volumes in CoronaFS, emulated VMs.\n\nRun `plasmavmc serve` next to a LightningStor and a CoronaFS, `plasmavmc agent` on each worker node, and `plasmavmc nbd-front` on a host whose NBD clients (fio, qemu-img) must ride out a replicated volume's failovers; every other command talks to a running server's REST API (--api)."
)]
struct Cli {
    /// URL of a running PlasmaVMC API (client commands).
    #[arg(long, global = true, env = "PLASMAVMC_API", default_value = "http://127.0.0.1:8080")]
    api: String,
    /// The REST API's token (client commands; shows in `ps`, prefer
    /// --token-file or the variable).
    #[arg(long, global = true, value_name = "TOKEN", env = "PLASMAVMC_API_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the REST API's token (client commands; used before
    /// --token and the variable).
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the control plane: the REST API over images, volumes and VMs
    /// (flags override the TOML config file). Stops on SIGTERM or ctrl-c.
    Serve(Serve),
    /// Run a worker: holds the NBD connections of the VMs placed on it and
    /// runs their guest I/O; the control plane lists it under [[workers]].
    /// Stops on SIGTERM or ctrl-c (its VMs' guests stop; CoronaFS keeps
    /// what they had written and acknowledged).
    Agent(AgentArgs),
    /// Serve one CoronaFS volume to local NBD clients (fio, qemu-img,
    /// nbdinfo, a hypervisor) over loopback TCP or a Unix socket, surviving
    /// the volume's failovers: the front reconnects to the new primary,
    /// follows its epoch, resends what was in flight and writes again the
    /// acknowledged writes no FLUSH had covered yet (kept up to
    /// --replay-budget bytes; at that much it FLUSHes). Prints `listening
    /// on ADDR`, then a line per reconnect and per I/O pause. Stops on
    /// SIGTERM or ctrl-c after a last FLUSH.
    NbdFront(FrontArgs),
    /// Images: upload, import, list, show, delete.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Volumes made from images.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Emulated VMs.
    #[command(subcommand)]
    Vm(VmCmd),
    /// Cache counters and cached bases.
    Cache,
}

#[derive(clap::Args)]
struct Serve {
    /// TOML config file (unknown keys are an error); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// REST API listen address.
    #[arg(long)]
    listen: Option<std::net::SocketAddr>,
    /// Directory for metadata and scratch files.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// LightningStor endpoint URL.
    #[arg(long)]
    s3_endpoint: Option<String>,
    /// Bucket for image artifacts.
    #[arg(long)]
    s3_bucket: Option<String>,
    /// S3 access key.
    #[arg(long, env = "PLASMAVMC_S3_ACCESS_KEY")]
    s3_access_key: Option<String>,
    /// S3 secret key.
    #[arg(long, env = "PLASMAVMC_S3_SECRET_KEY", hide_env_values = true)]
    s3_secret_key: Option<String>,
    /// CoronaFS control API URL.
    #[arg(long)]
    coronafs_api: Option<String>,
    /// CoronaFS NBD address (host:port).
    #[arg(long)]
    coronafs_nbd: Option<String>,
    /// Allow imports from loopback/private/link-local addresses.
    #[arg(long)]
    allow_private_urls: bool,
    /// A worker agent, NAME=URL (repeat for more); adds to the config's
    /// [[workers]]. Without any, VMs run on in-process workers.
    #[arg(long = "worker", value_name = "NAME=URL")]
    workers: Vec<String>,
    /// File holding this REST API's bearer token (every route but GET
    /// /healthz and GET /metrics needs it). Wins over PLASMAVMC_API_TOKEN
    /// and the config's api_token / api_token_file. Without any token the
    /// API may only listen on loopback.
    #[arg(long, value_name = "FILE")]
    api_token_file: Option<PathBuf>,
    /// File holding the CoronaFS control API's token. Wins over
    /// CORONAFS_API_TOKEN and the config's coronafs_api_token(_file).
    #[arg(long, value_name = "FILE")]
    coronafs_api_token_file: Option<PathBuf>,
    /// File holding the worker agents' token. Wins over PLASMAVMC_AGENT_TOKEN
    /// and the config's agent_token(_file).
    #[arg(long, value_name = "FILE")]
    agent_token_file: Option<PathBuf>,
    /// Serve the REST API without a token even off loopback. UNSAFE:
    /// anyone who reaches the port can create and delete images, volumes
    /// and VMs.
    #[arg(long)]
    no_api_token: bool,
}

#[derive(clap::Args)]
struct AgentArgs {
    /// TOML config file with `listen`, `name`, `coronafs_nbd`, `coronafs_nodes` (unknown keys
    /// are an error); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Agent API listen address (default 127.0.0.1:8090).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
    /// This worker's name, as the control plane's [[workers]] lists it.
    #[arg(long)]
    name: Option<String>,
    /// CoronaFS NBD address (host:port) the VMs' volumes are opened at.
    #[arg(long, value_name = "ADDR")]
    coronafs_nbd: Option<String>,
    /// The NBD addresses (host:port, comma-separated) of the other nodes of
    /// a CoronaFS cluster, where a replicated volume's primary is looked for
    /// after a failover.
    #[arg(long, value_name = "ADDR,...", value_delimiter = ',')]
    coronafs_nodes: Option<Vec<String>>,
    /// File holding the agent API's bearer token (the control plane's
    /// agent_token; every route but GET /healthz needs it). Wins over
    /// PLASMAVMC_AGENT_TOKEN and the config's api_token / api_token_file.
    /// Without any token the agent may only listen on loopback.
    #[arg(long, value_name = "FILE")]
    api_token_file: Option<PathBuf>,
    /// Serve the agent API without a token even off loopback. UNSAFE:
    /// anyone who reaches the port can attach, write to and detach volumes.
    #[arg(long)]
    no_api_token: bool,
}

#[derive(clap::Args)]
struct FrontArgs {
    /// Loopback TCP address local clients connect to (port 0 picks one).
    #[arg(long, value_name = "ADDR", conflicts_with = "socket", required_unless_present = "socket")]
    listen: Option<std::net::SocketAddr>,
    /// Unix socket local clients connect to (mode 0600), instead of --listen.
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// The CoronaFS nodes' NBD addresses (host:port, comma-separated).
    #[arg(long, value_name = "ADDR,...", value_delimiter = ',', required_unless_present = "cluster_file")]
    coronafs_nodes: Vec<String>,
    /// A CoronaFS cluster file: its nodes' NBD addresses are used (after
    /// --coronafs-nodes).
    #[arg(long, value_name = "FILE")]
    cluster_file: Option<PathBuf>,
    /// The volume.
    #[arg(long)]
    volume: String,
    /// The write epoch the volume was fenced at for this client
    /// (`VOL;epoch=N`); a failover's new epoch is followed from there.
    #[arg(long)]
    epoch: u64,
    /// Bytes of acknowledged, unflushed writes kept to write again after a
    /// failover (at least 32 MiB).
    #[arg(long, value_name = "BYTES", default_value_t = plasmavmc::front::REPLAY_BUDGET)]
    replay_budget: u64,
}

fn front_config(a: FrontArgs) -> Result<plasmavmc::front::FrontConfig> {
    use plasmavmc::front::{FrontConfig, Listen};
    let listen = match (a.listen, a.socket) {
        (Some(addr), None) => Listen::Tcp(addr),
        (None, Some(p)) => Listen::Unix(p),
        _ => bail!("give one of --listen and --socket"),
    };
    let mut nodes = a.coronafs_nodes;
    if let Some(p) = &a.cluster_file {
        let file = coronafs::cluster::ClusterFile::load(p)?;
        for n in file.nodes {
            let addr = n.nbd.to_string();
            if !nodes.contains(&addr) {
                nodes.push(addr);
            }
        }
    }
    let c =
        FrontConfig { listen, coronafs_nodes: nodes, volume: a.volume, epoch: a.epoch, replay_budget: a.replay_budget };
    c.validate()?;
    Ok(c)
}

/// One line on stdout, flushed at once (a reader may wait for it); a
/// closed stdout is not worth stopping the front for.
fn say(line: String) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Runs the front until SIGTERM or ctrl-c, printing what it lived through.
async fn run_front(a: FrontArgs) -> Result<()> {
    let srv = plasmavmc::front::FrontServer::start(front_config(a)?).await?;
    let d = srv.front.export();
    say(format!("listening on {} volume={} size={} read_only={}", srv.listening, d.name, d.size, d.read_only));
    let front = srv.front.clone();
    let report = tokio::spawn(async move {
        let (mut reconnects, mut pause) = (0, None);
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let s = front.stats();
            if s.reconnects != reconnects {
                reconnects = s.reconnects;
                say(format!(
                    "reconnected reconnects={} epoch={} reconnect_ms={} replayed_ops={} replayed_bytes={}",
                    s.reconnects,
                    s.epoch,
                    s.last_reconnect_ms.unwrap_or(0),
                    s.replayed_ops,
                    s.replayed_bytes
                ));
            }
            if s.last_io_pause_ms.is_some() && s.last_io_pause_ms != pause {
                pause = s.last_io_pause_ms;
                say(format!("resumed io_pause_ms={} writes={}", pause.unwrap_or(0), s.writes));
            }
        }
    });
    stop_signal().await;
    report.abort();
    let stats = srv.front.stats();
    let flushed = srv.shutdown().await;
    say(format!("stopped {}", serde_json::to_string(&stats)?));
    flushed?;
    Ok(())
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Create an image and upload a local file into it.
    Create {
        #[arg(long)]
        name: String,
        /// The artifact to upload.
        #[arg(long)]
        file: PathBuf,
        /// Expected sha256 (hex).
        #[arg(long)]
        sha256: Option<String>,
        /// raw, qcow2 or auto.
        #[arg(long, default_value = "auto")]
        format: String,
    },
    /// Create an image imported from an http(s) URL or an S3 object (s3://bucket/key).
    Import {
        #[arg(long)]
        name: String,
        #[arg(long)]
        from: String,
        #[arg(long)]
        sha256: Option<String>,
    },
    List,
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a volume from an image and wait until it is available.
    Create {
        #[arg(long)]
        image: String,
        /// Size in bytes (default: the image's virtual size).
        #[arg(long)]
        size: Option<u64>,
        /// Return at once instead of waiting.
        #[arg(long)]
        no_wait: bool,
    },
    List,
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
enum VmCmd {
    /// Attach a volume on a worker.
    Create {
        #[arg(long)]
        volume: String,
        #[arg(long)]
        worker: String,
    },
    /// Move a VM to another worker.
    Migrate {
        id: String,
        #[arg(long)]
        worker: String,
    },
    List,
    Show {
        id: String,
    },
    Delete {
        id: String,
    },
}

fn serve_config(s: Serve) -> Result<Config> {
    let mut c = match &s.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    macro_rules! set { ($($f:ident),*) => { $(if let Some(v) = s.$f { c.$f = v; })* } }
    set!(listen, data_dir, s3_endpoint, s3_bucket, s3_access_key, s3_secret_key, coronafs_api, coronafs_nbd);
    c.allow_private_urls |= s.allow_private_urls;
    override_token(&mut c.api_token, &mut c.api_token_file, s.api_token_file, "PLASMAVMC_API_TOKEN");
    override_token(
        &mut c.coronafs_api_token,
        &mut c.coronafs_api_token_file,
        s.coronafs_api_token_file,
        "CORONAFS_API_TOKEN",
    );
    override_token(&mut c.agent_token, &mut c.agent_token_file, s.agent_token_file, "PLASMAVMC_AGENT_TOKEN");
    c.no_api_token = s.no_api_token;
    for w in s.workers {
        let (name, url) = w.split_once('=').with_context(|| format!("--worker {w:?} must be NAME=URL"))?;
        c.workers.push(plasmavmc::config::WorkerConfig { name: name.into(), url: url.into() });
    }
    c.validate()?;
    Ok(c)
}

/// A token's flag (a file) wins over its environment variable, which wins
/// over the config's `NAME` / `NAME_file` pair.
fn override_token(text: &mut Option<String>, file: &mut Option<PathBuf>, flag: Option<PathBuf>, env: &str) {
    if flag.is_some() {
        (*text, *file) = (None, flag);
    } else if let Some(v) = std::env::var(env).ok().filter(|v| !v.is_empty()) {
        (*text, *file) = (Some(v), None);
    }
}

fn agent_config(a: AgentArgs) -> Result<plasmavmc::agent::AgentConfig> {
    let mut c = match &a.config {
        Some(p) => plasmavmc::agent::AgentConfig::from_file(p)?,
        None => plasmavmc::agent::AgentConfig::default(),
    };
    if let Some(v) = a.listen {
        c.listen = v;
    }
    if let Some(v) = a.name {
        c.name = v;
    }
    if let Some(v) = a.coronafs_nbd {
        c.coronafs_nbd = v;
    }
    if let Some(v) = a.coronafs_nodes {
        c.coronafs_nodes = v;
    }
    override_token(&mut c.api_token, &mut c.api_token_file, a.api_token_file, "PLASMAVMC_AGENT_TOKEN");
    c.no_api_token = a.no_api_token;
    c.validate()?;
    Ok(c)
}

/// Waits for ctrl-c or SIGTERM.
async fn stop_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

fn print<T: serde::Serialize>(v: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

async fn client(api: String, token: plasmavmc::client::Token, cmd: Cmd) -> Result<()> {
    let c = Client::new(&api).with_token(token);
    match cmd {
        Cmd::Serve(_) | Cmd::Agent(_) | Cmd::NbdFront(_) => bail!("serve, agent and nbd-front are not client commands"),
        Cmd::Image(ImageCmd::Create { name, file, sha256, format }) => {
            let img =
                c.create_image(&CreateImage { name, sha256, disk_format: Some(format), ..Default::default() }).await?;
            print(&c.upload_file(&img.id, &file, None).await?)
        }
        Cmd::Image(ImageCmd::Import { name, from, sha256 }) => {
            let mut req = CreateImage { name, sha256, ..Default::default() };
            if let Some(rest) = from.strip_prefix("s3://") {
                let (bucket, key) = rest.split_once('/').context("s3 source must be s3://bucket/key")?;
                req.import_s3 = Some(S3Source { bucket: bucket.into(), key: key.into() });
            } else {
                req.import_url = Some(from);
            }
            print(&c.create_image(&req).await?)
        }
        Cmd::Image(ImageCmd::List) => print(&c.images().await?),
        Cmd::Image(ImageCmd::Show { id }) => print(&c.image(&id).await?),
        Cmd::Image(ImageCmd::Delete { id }) => Ok(c.delete_image(&id).await?),
        Cmd::Volume(VolumeCmd::Create { image, size, no_wait }) => {
            let v = c.create_volume(&CreateVolume { image_id: image, size }).await?;
            if no_wait {
                return print(&v);
            }
            print(&c.wait_volume(&v.id, Duration::from_millis(200), Duration::MAX).await?)
        }
        Cmd::Volume(VolumeCmd::List) => print(&c.volumes().await?),
        Cmd::Volume(VolumeCmd::Show { id }) => print(&c.volume(&id).await?),
        Cmd::Volume(VolumeCmd::Delete { id }) => Ok(c.delete_volume(&id).await?),
        Cmd::Vm(VmCmd::Create { volume, worker }) => {
            print(&c.create_vm(&CreateVm { volume_id: volume, worker, io_ops: None }).await?)
        }
        Cmd::Vm(VmCmd::Migrate { id, worker }) => print(&c.migrate_vm(&id, &MigrateVm { worker }).await?),
        Cmd::Vm(VmCmd::List) => print(&c.vms().await?),
        Cmd::Vm(VmCmd::Show { id }) => print(&c.vm(&id).await?),
        Cmd::Vm(VmCmd::Delete { id }) => Ok(c.delete_vm(&id).await?),
        Cmd::Cache => print(&c.cache().await?),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Serve(_) | Cmd::Agent(_) | Cmd::NbdFront(_)) && cli.token_file.is_some() {
        bail!("--token-file is for the client commands; a server reads its own token from --api-token-file");
    }
    match cli.cmd {
        Cmd::Serve(s) => {
            let cfg = serve_config(s)?;
            let srv = plasmavmc::Server::start(cfg).await?;
            eprintln!("plasmavmc listening on {}", srv.url());
            stop_signal().await;
            srv.shutdown().await;
            eprintln!("plasmavmc stopped");
            Ok(())
        }
        Cmd::Agent(a) => {
            let cfg = agent_config(a)?;
            let srv = plasmavmc::agent::AgentServer::start(cfg).await?;
            eprintln!("plasmavmc agent {} listening on {}", srv.agent.name, srv.url());
            stop_signal().await;
            srv.shutdown().await;
            eprintln!("plasmavmc agent stopped");
            Ok(())
        }
        Cmd::NbdFront(a) => run_front(a).await,
        cmd => {
            let token = svc_kit::api_token::ApiToken::for_client(cli.token.as_deref(), cli.token_file.as_deref())?;
            client(cli.api, token, cmd).await
        }
    }
}
