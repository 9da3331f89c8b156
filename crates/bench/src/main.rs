//! The `bench` command.

use anyhow::Context;
use bench::nbd_compare::{self, Options};
use bench::peers::{self, Peer};
use clap::{Parser, Subcommand};
use coronafs::backend::IoEngine;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Measures the storage stack side by side with reference peers run in the
/// same run, and reports medians and spreads.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The main job. Today it runs the NBD comparison (CoronaFS vs nbdkit vs
    /// qemu-nbd) and writes storage-benchmarks.md and results.json to
    /// --out-dir; the object store and VM image sections join as those
    /// services land.
    FreshBenchStorage {
        /// Small sizes and short runs (about a minute).
        #[arg(long)]
        quick: bool,
        /// Where the report goes.
        #[arg(long, default_value = "bench-out")]
        out_dir: PathBuf,
    },
    /// Serve one file through CoronaFS, nbdkit and qemu-nbd and run the same
    /// fio workloads (nbd engine) on each; print MiB/s, IOPS, p50/p99 and ratios.
    NbdCompare {
        /// Size of the test file (K/M/G suffixes).
        #[arg(long, default_value = "1G")]
        size: String,
        /// Iterations per workload and server.
        #[arg(long, default_value_t = 3)]
        iterations: usize,
        /// Seconds per fio run.
        #[arg(long, default_value_t = 5)]
        runtime: u32,
        /// CoronaFS engines to include (comma-separated: uring, threads).
        #[arg(long, value_delimiter = ',', default_value = "uring,threads")]
        engines: Vec<IoEngine>,
        /// Also write the report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Internal: run a CoronaFS server for the comparison.
    #[command(name = "__serve-coronafs", hide = true)]
    ServeCoronafs { dir: PathBuf, addr: SocketAddr, engine: IoEngine },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::ServeCoronafs { dir, addr, engine } => peers::serve_coronafs(&dir, addr, engine),
        Cmd::NbdCompare { size, iterations, runtime, engines, json } => {
            let size = coronafs::util::parse_size(&size)?;
            let opts =
                Options { size, iterations: iterations.max(1), runtime_s: runtime.max(1), peers: peer_list(&engines) };
            let work = tempfile::tempdir()?;
            let report = nbd_compare::run(&opts, work.path())?;
            println!("{}", nbd_compare::markdown(&report));
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| path.display().to_string())?;
            }
            Ok(())
        }
        Cmd::FreshBenchStorage { quick, out_dir } => {
            let opts = if quick {
                Options { size: 256 << 20, iterations: 1, runtime_s: 2, peers: peer_list(&[IoEngine::Uring]) }
            } else {
                Options {
                    size: 1 << 30,
                    iterations: 3,
                    runtime_s: 5,
                    peers: peer_list(&[IoEngine::Uring, IoEngine::Threads]),
                }
            };
            std::fs::create_dir_all(&out_dir).with_context(|| out_dir.display().to_string())?;
            let work = tempfile::tempdir()?;
            let report = nbd_compare::run(&opts, work.path())?;
            let md = format!("# Storage Benchmarks\n\n{}", nbd_compare::markdown(&report));
            std::fs::write(out_dir.join("storage-benchmarks.md"), &md)?;
            std::fs::write(out_dir.join("results.json"), serde_json::to_vec_pretty(&report)?)?;
            println!("{md}");
            eprintln!("bench: wrote {}/storage-benchmarks.md and results.json", out_dir.display());
            Ok(())
        }
    }
}

fn peer_list(engines: &[IoEngine]) -> Vec<Peer> {
    let mut v: Vec<Peer> = engines.iter().map(|&e| Peer::Coronafs(e)).collect();
    v.push(Peer::Nbdkit);
    v.push(Peer::QemuNbd);
    v
}
