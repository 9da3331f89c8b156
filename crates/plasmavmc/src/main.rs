//! The `plasmavmc` binary: `serve`, and a client for every API call.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use plasmavmc::Config;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "plasmavmc",
    version,
    about = "PlasmaVMC: VM images in LightningStor, volumes in CoronaFS, emulated VMs.\n\nRun `plasmavmc serve` next to a LightningStor and a CoronaFS, and `plasmavmc agent` on each worker node; every other command talks to a running server's REST API (--api)."
)]
struct Cli {
    /// URL of a running PlasmaVMC API (client commands).
    #[arg(long, global = true, env = "PLASMAVMC_API", default_value = "http://127.0.0.1:8080")]
    api: String,
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
}

#[derive(clap::Args)]
struct AgentArgs {
    /// TOML config file with `listen`, `name`, `coronafs_nbd` (unknown keys
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
    for w in s.workers {
        let (name, url) = w.split_once('=').with_context(|| format!("--worker {w:?} must be NAME=URL"))?;
        c.workers.push(plasmavmc::config::WorkerConfig { name: name.into(), url: url.into() });
    }
    c.validate()?;
    Ok(c)
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

struct Client {
    http: reqwest::Client,
    api: String,
}

impl Client {
    async fn send(&self, req: reqwest::RequestBuilder) -> Result<serde_json::Value> {
        let resp = req.send().await.with_context(|| format!("cannot reach {}", self.api))?;
        let status = resp.status();
        let text = resp.text().await?;
        let v: serde_json::Value = if text.is_empty() {
            serde_json::Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text))
        };
        if !status.is_success() {
            let msg = v.get("error").and_then(|e| e.as_str()).map(str::to_owned).unwrap_or_else(|| v.to_string());
            bail!("{status}: {msg}");
        }
        Ok(v)
    }
    fn url(&self, p: &str) -> String {
        format!("{}{p}", self.api.trim_end_matches('/'))
    }
    async fn get(&self, p: &str) -> Result<serde_json::Value> {
        self.send(self.http.get(self.url(p))).await
    }
    async fn post(&self, p: &str, body: serde_json::Value) -> Result<serde_json::Value> {
        self.send(self.http.post(self.url(p)).json(&body)).await
    }
    async fn delete(&self, p: &str) -> Result<serde_json::Value> {
        self.send(self.http.delete(self.url(p))).await
    }
}

fn print(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

async fn client(api: String, cmd: Cmd) -> Result<()> {
    let c = Client { http: reqwest::Client::new(), api };
    let out = match cmd {
        Cmd::Serve(_) | Cmd::Agent(_) => bail!("serve and agent are not client commands"),
        Cmd::Image(ImageCmd::Create { name, file, sha256, format }) => {
            let img = c
                .post("/v1/images", serde_json::json!({ "name": name, "sha256": sha256, "disk_format": format }))
                .await?;
            let id = img["id"].as_str().context("no id in reply")?.to_owned();
            let f = tokio::fs::File::open(&file).await.with_context(|| format!("cannot open {}", file.display()))?;
            let len = f.metadata().await?.len();
            let body = reqwest::Body::wrap_stream(tokio_util_stream(f));
            c.send(c.http.put(c.url(&format!("/v1/images/{id}/file"))).header("content-length", len).body(body)).await?
        }
        Cmd::Image(ImageCmd::Import { name, from, sha256 }) => {
            let mut body = serde_json::json!({ "name": name, "sha256": sha256 });
            if let Some(rest) = from.strip_prefix("s3://") {
                let (bucket, key) = rest.split_once('/').context("s3 source must be s3://bucket/key")?;
                body["import_s3"] = serde_json::json!({ "bucket": bucket, "key": key });
            } else {
                body["import_url"] = from.into();
            }
            c.post("/v1/images", body).await?
        }
        Cmd::Image(ImageCmd::List) => c.get("/v1/images").await?,
        Cmd::Image(ImageCmd::Show { id }) => c.get(&format!("/v1/images/{id}")).await?,
        Cmd::Image(ImageCmd::Delete { id }) => c.delete(&format!("/v1/images/{id}")).await?,
        Cmd::Volume(VolumeCmd::Create { image, size, no_wait }) => {
            let mut v = c.post("/v1/volumes", serde_json::json!({ "image_id": image, "size": size })).await?;
            let id = v["id"].as_str().context("no id in reply")?.to_owned();
            while !no_wait && matches!(v["status"].as_str(), Some("creating" | "downloading")) {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                v = c.get(&format!("/v1/volumes/{id}")).await?;
            }
            v
        }
        Cmd::Volume(VolumeCmd::List) => c.get("/v1/volumes").await?,
        Cmd::Volume(VolumeCmd::Show { id }) => c.get(&format!("/v1/volumes/{id}")).await?,
        Cmd::Volume(VolumeCmd::Delete { id }) => c.delete(&format!("/v1/volumes/{id}")).await?,
        Cmd::Vm(VmCmd::Create { volume, worker }) => {
            c.post("/v1/vms", serde_json::json!({ "volume_id": volume, "worker": worker })).await?
        }
        Cmd::Vm(VmCmd::Migrate { id, worker }) => {
            c.post(&format!("/v1/vms/{id}/migrate"), serde_json::json!({ "worker": worker })).await?
        }
        Cmd::Vm(VmCmd::List) => c.get("/v1/vms").await?,
        Cmd::Vm(VmCmd::Show { id }) => c.get(&format!("/v1/vms/{id}")).await?,
        Cmd::Vm(VmCmd::Delete { id }) => c.delete(&format!("/v1/vms/{id}")).await?,
        Cmd::Cache => c.get("/v1/cache").await?,
    };
    if !out.is_null() {
        print(&out);
    }
    Ok(())
}

/// A file as a stream of 1 MiB chunks.
fn tokio_util_stream(f: tokio::fs::File) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> {
    futures::stream::unfold(f, |mut f| async move {
        use tokio::io::AsyncReadExt;
        let mut buf = vec![0u8; 1 << 20];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(bytes::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
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
        cmd => client(cli.api, cmd).await,
    }
}
