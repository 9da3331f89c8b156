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
/// configured key, unless --anonymous is given.
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
        /// TOML configuration file (fields as in docs/lightningstor.md).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
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
        Cmd::Serve { data_dir, listen, access_key, secret_key, anonymous, domains, region, config } => {
            let mut cfg = match &config {
                Some(path) => Config::from_file(path).with_context(|| format!("reading {}", path.display()))?,
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

async fn serve(cfg: Config) -> anyhow::Result<()> {
    let data_dir = cfg.data_dir.clone();
    let (running, _store) = lightningstor::server::start(cfg).await?;
    tracing::info!(addr = %running.addr, data_dir = %data_dir.display(), "lightningstor listening");
    // A line tests and scripts can wait for.
    println!("listening on {}", running.addr);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}
