//! The `coronafs` command: the server and a CLI over its control API.

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use coronafs::api::{ApiError, CreateVolume};
use coronafs::backend::IoEngine;
use coronafs::server::{self, ServerConfig, exports::VolumeInfo};
use std::net::SocketAddr;
use std::path::PathBuf;

/// CoronaFS: shared block volumes exported over NBD.
///
/// Run `coronafs serve` on the storage node, then create volumes through its
/// control API with `coronafs volume create`. Every volume is reachable as
/// nbd://HOST:PORT/NAME by qemu, libnbd tools, fio's nbd engine or the kernel
/// nbd client.
#[derive(Parser, Debug)]
#[command(version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve every volume under DATA_DIR over NBD, with the control API beside it.
    Serve {
        /// Directory holding the volumes (created if missing).
        #[arg(long, value_name = "DIR")]
        data_dir: PathBuf,
        /// NBD listen address.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10809")]
        nbd: SocketAddr,
        /// Control API and /metrics listen address.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7070")]
        api: SocketAddr,
        /// Data path engine. `uring` falls back to `threads` (with a warning)
        /// where io_uring is refused, e.g. under Docker's default seccomp profile.
        #[arg(long, value_enum, default_value_t = IoEngine::Uring)]
        io_engine: IoEngine,
        /// Export every volume read-only (writes are answered with EPERM).
        #[arg(long)]
        read_only: bool,
    },
    /// Manage volumes through a running server's control API.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
        /// Control API of the server.
        #[arg(long, global = true, value_name = "URL", default_value = "http://127.0.0.1:7070")]
        api: String,
    },
}

#[derive(Subcommand, Debug)]
enum VolumeCmd {
    /// Create a thin (sparse) volume.
    Create {
        /// Volume name: letters, digits, '.', '_' and '-' (at most 128).
        name: String,
        /// Size: plain bytes or with a K, M, G or T suffix (powers of 1024).
        #[arg(long)]
        size: String,
    },
    /// List volumes.
    List,
    /// Show one volume.
    Show { name: String },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Serve { data_dir, nbd, api, io_engine, read_only } => {
            let cfg = ServerConfig { data_dir, nbd, api, engine: io_engine, read_only };
            let srv = server::start(cfg).await.context("starting the server")?;
            srv.run_until_signal().await;
            Ok(())
        }
        Cmd::Volume { cmd, api } => volume(cmd, api.trim_end_matches('/')).await,
    }
}

async fn volume(cmd: VolumeCmd, api: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    match cmd {
        VolumeCmd::Create { name, size } => {
            let size = coronafs::util::parse_size(&size)?;
            let resp = http
                .post(format!("{api}/v1/volumes"))
                .json(&CreateVolume { name, size })
                .send()
                .await
                .with_context(|| format!("cannot reach the control API at {api}"))?;
            let v: VolumeInfo = answer(resp).await?;
            println!("created {} ({} bytes), export nbd://<server>/{}", v.name, v.size, v.nbd_export);
        }
        VolumeCmd::List => {
            let resp = http
                .get(format!("{api}/v1/volumes"))
                .send()
                .await
                .with_context(|| format!("cannot reach the control API at {api}"))?;
            let list: Vec<VolumeInfo> = answer(resp).await?;
            println!("{:<32} {:>16} {:>16} {:>5}", "NAME", "SIZE", "ALLOCATED", "CONNS");
            for v in list {
                println!("{:<32} {:>16} {:>16} {:>5}", v.name, v.size, v.allocated_bytes, v.connections);
            }
        }
        VolumeCmd::Show { name } => {
            let resp = http
                .get(format!("{api}/v1/volumes/{name}"))
                .send()
                .await
                .with_context(|| format!("cannot reach the control API at {api}"))?;
            let v: VolumeInfo = answer(resp).await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
    }
    Ok(())
}

async fn answer<T: serde::de::DeserializeOwned>(resp: reqwest::Response) -> anyhow::Result<T> {
    let status = resp.status();
    let body = resp.bytes().await?;
    if !status.is_success() {
        let msg = serde_json::from_slice::<ApiError>(&body)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
        bail!("{msg} (HTTP {status})");
    }
    Ok(serde_json::from_slice(&body)?)
}
