//! The `coronafs` command: the server and a CLI over its control API.

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use coronafs::api_client::ApiClient;
use coronafs::backend::IoEngine;
use coronafs::config::ServeSettings;
use coronafs::dto::{CreateVolume, VolumeInfo};
use coronafs::proto::handshake::TlsMode;
use coronafs::service;
use std::net::SocketAddr;
use std::path::PathBuf;

/// CoronaFS: shared block volumes exported over NBD.
///
/// Run `coronafs serve` on the storage node, then create volumes through its
/// control API with `coronafs volume create`. Every volume is reachable as
/// nbd://HOST:PORT/NAME by qemu, libnbd tools, fio's nbd engine or the kernel
/// nbd client (nbds:// with `serve --tls`); every snapshot, read-only, as
/// nbd://HOST:PORT/NAME@SNAP.
/// Snapshots take O(1) time and space; so do clones of them
/// (`coronafs volume create NEW --from-snapshot NAME@SNAP`).
///
/// The control API needs a bearer token (`serve --api-token-file FILE`, or
/// CORONAFS_API_TOKEN); the volume and snapshot commands send it with
/// --token-file FILE, --token TEXT or CORONAFS_API_TOKEN.
#[derive(Parser, Debug)]
#[command(version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Serve every volume under DATA_DIR over NBD, with the control API beside it.
    ///
    /// Settings come from --config (TOML, unknown fields refused; see
    /// docs/deploy.md) and from flags; a flag wins over the file.
    #[command(
        after_help = "Examples:\n  coronafs serve --data-dir /var/lib/coronafs\n  coronafs serve --config /etc/photoncloud/coronafs.toml\n  coronafs serve --data-dir /var/lib/coronafs --tls require --tls-certificates /etc/pki/coronafs\n    (clients: nbdinfo 'nbds://HOST/NAME?tls-certificates=DIR', DIR holding ca-cert.pem)\n\nThe file's fields: data_dir, nbd, api, io_engine, read_only, tls, tls_certificates,\ntls_verify_peer, tls_psk, cluster, node (as the flags), api_token, api_token_file.\n\nAPI token: every control API call but GET /healthz and GET /metrics needs\n`Authorization: Bearer TOKEN` (401 otherwise). The token (16 characters or more)\ncomes from --api-token-file, else CORONAFS_API_TOKEN, else api_token_file or\napi_token in --config. The nodes of a cluster share one token. Without a token\nthe API may only listen on loopback (a warning is logged); elsewhere the server\nrefuses to start unless --no-api-token is given."
    )]
    Serve {
        /// TOML settings file with the same fields as the flags
        /// (data_dir, nbd, api, io_engine, read_only).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Directory holding the metadata store (meta.redb) and the layer files
        /// (created if missing). Raw files placed directly in it are adopted as
        /// volumes. Required here or in --config.
        #[arg(long, value_name = "DIR")]
        data_dir: Option<PathBuf>,
        /// NBD listen address [default: 127.0.0.1:10809].
        #[arg(long, value_name = "ADDR")]
        nbd: Option<SocketAddr>,
        /// Control API and /metrics listen address [default: 127.0.0.1:7070].
        #[arg(long, value_name = "ADDR")]
        api: Option<SocketAddr>,
        /// Data path engine [default: threads]. Both answer page-cache hits
        /// inline; they differ in what waits. `threads` is the default:
        /// buffered writes that io_uring punts to its io-wq workers cost about
        /// 1.6x the CPU (measured with `bench nbd-compare`). `uring` falls back
        /// to `threads` (with a warning) where io_uring is refused, e.g. under
        /// Docker's default seccomp.
        #[arg(long, value_enum)]
        io_engine: Option<IoEngine>,
        /// Export every volume read-only (writes are answered with EPERM).
        #[arg(long)]
        read_only: bool,
        /// NBD over TLS (STARTTLS), as nbdkit's --tls [default: off].
        /// `require`: every option before STARTTLS is refused with
        /// NBD_REP_ERR_TLS_REQD, so only nbds:// clients get in; `allow`
        /// (nbdkit's `on`): TLS at the client's choice, plain clients too;
        /// `off`: STARTTLS answers NBD_REP_ERR_UNSUP.
        #[arg(long, value_name = "require|allow|off")]
        tls: Option<TlsMode>,
        /// Directory with the X.509 files, named as nbdkit's:
        /// server-cert.pem (the chain, leaf first), server-key.pem, and
        /// ca-cert.pem (used with --tls-verify-peer). Required with --tls
        /// require or allow.
        #[arg(long, value_name = "DIR")]
        tls_certificates: Option<PathBuf>,
        /// Require client certificates signed by DIR/ca-cert.pem (and not
        /// revoked by DIR/ca-crl.pem if present), as nbdkit's
        /// --tls-verify-peer. Without it client certificates are not asked for.
        #[arg(long)]
        tls_verify_peer: bool,
        /// TLS with pre-shared keys from FILE (nbdkit's psktool format,
        /// username:hexkey). NOT IMPLEMENTED: refused at start, because
        /// rustls has no TLS-PSK; use --tls-certificates.
        #[arg(long, value_name = "FILE")]
        tls_psk: Option<PathBuf>,
        /// Cluster file naming every CoronaFS node (addresses, zone) and the
        /// replica RPC's rpc_secret: this server becomes node --node of it
        /// and takes replica connections (docs/design/replication-volumes.md).
        #[arg(long, value_name = "FILE")]
        cluster: Option<PathBuf>,
        /// This node's name in the cluster file.
        #[arg(long, value_name = "NAME")]
        node: Option<String>,
        /// File holding the control API's bearer token (a file, so the token
        /// does not show in `ps`). Wins over CORONAFS_API_TOKEN and the
        /// config file's api_token / api_token_file.
        #[arg(long, value_name = "FILE")]
        api_token_file: Option<PathBuf>,
        /// Serve the control API without a token even when it listens off
        /// loopback. UNSAFE: anyone who reaches the port can create, change
        /// and delete volumes.
        #[arg(long)]
        no_api_token: bool,
    },
    /// Manage volumes through a running server's control API.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
        /// Control API of the server.
        #[arg(long, global = true, value_name = "URL", default_value = "http://127.0.0.1:7070")]
        api: String,
        #[command(flatten)]
        token: TokenArgs,
    },
    /// The volume map's Raft group (the nodes of a cluster file), through
    /// any running node's control API.
    #[command(after_help = "Adding a node: add it to the cluster file (every node's copy), start it\n\
with that file (a node whose peers hold the map waits to be added; it\n\
founds nothing), then run `coronafs cluster add-node NAME --cluster FILE`.\n\
The other nodes place copies on it once they restart with the new file.\n\
Removing one: `coronafs cluster remove-node NAME`, then stop it; its\n\
copies stay copies until replaced (coronafs volume replace-copy).")]
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
        /// Control API of a node of the cluster.
        #[arg(long, global = true, value_name = "URL", default_value = "http://127.0.0.1:7070")]
        api: String,
        #[command(flatten)]
        token: TokenArgs,
    },
    /// Manage snapshots through a running server's control API.
    Snapshot {
        #[command(subcommand)]
        cmd: SnapshotCmd,
        /// Control API of the server.
        #[arg(long, global = true, value_name = "URL", default_value = "http://127.0.0.1:7070")]
        api: String,
        #[command(flatten)]
        token: TokenArgs,
    },
}

/// The control API's bearer token, for the client commands.
#[derive(clap::Args, Debug)]
struct TokenArgs {
    /// The API token (shows in `ps`; prefer --token-file or the variable).
    #[arg(long, global = true, value_name = "TOKEN", env = "CORONAFS_API_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the API token (used before --token and the variable).
    #[arg(long, global = true, value_name = "FILE")]
    token_file: Option<PathBuf>,
}

impl TokenArgs {
    fn client(&self, api: &str) -> anyhow::Result<ApiClient> {
        let token = svc_kit::api_token::ApiToken::for_client(self.token.as_deref(), self.token_file.as_deref())?;
        Ok(ApiClient::new(api).with_token(token))
    }
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// The map as the node asked has it: Raft leader, term, voters and
    /// every replicated volume's copies, primary, epoch and in-sync set.
    Status,
    /// Make the running node NAME a voter of the group. Its replica
    /// address comes from FILE, the cluster file that lists it.
    AddNode {
        name: String,
        /// The cluster file with NAME in it.
        #[arg(long, value_name = "FILE")]
        cluster: PathBuf,
    },
    /// Take node NAME out of the group. Refused while it is a volume's
    /// primary, holds a copy its volume cannot spare (fewer copies than the
    /// write quorum), or is the last voter.
    RemoveNode { name: String },
}

#[derive(Subcommand, Debug)]
enum VolumeCmd {
    /// Create a thin (sparse) volume, or a copy-on-write clone of a snapshot.
    Create {
        /// Volume name: letters, digits, '.', '_' and '-' (at most 128).
        name: String,
        /// Size: plain bytes or with a K, M, G or T suffix (powers of 1024).
        /// Required unless --from-snapshot (then it defaults to the snapshot's).
        #[arg(long)]
        size: Option<String>,
        /// Clone VOL@SNAP instead of starting empty (O(1), shares its data).
        #[arg(long, value_name = "VOL@SNAP")]
        from_snapshot: Option<String>,
        /// Copies on as many nodes of the server's cluster, different zones
        /// first; the server asked is the primary [default: 1]. With
        /// --from-snapshot: an O(1) clone on each node holding the
        /// snapshot (ask the source volume's primary; refused if fewer
        /// nodes hold it, see the snapshot's missing_on).
        #[arg(long, value_name = "N")]
        replicas: Option<usize>,
    },
    /// List volumes.
    List,
    /// Show one volume (size, allocation, parent, snapshots, connections).
    Show { name: String },
    /// Delete a volume and its snapshots (a replicated volume's on every
    /// copy: ask its primary; copies that are down are deleted when they
    /// can be reached again).
    Delete {
        name: String,
        /// Delete even with open NBD connections or clones (clones keep working).
        #[arg(long)]
        force: bool,
    },
    /// Grow a volume (shrink only with --allow-shrink; a replicated volume
    /// only grows, on every copy). Clients see it on reconnect.
    Resize {
        name: String,
        #[arg(long)]
        size: String,
        /// Allow a smaller size: the data past it is lost.
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Copy all inherited data into a clone and detach it from its snapshot
    /// (a replicated volume's primary, then each copy in the background).
    Flatten { name: String },
    /// Raise the volume's write epoch: connections opened with a lower one
    /// (export `NAME;epoch=N`) can no longer write. Returns once their writes
    /// in flight have finished.
    Fence {
        name: String,
        /// The new epoch (at least the current one; it never goes back).
        #[arg(long)]
        epoch: u64,
    },
    /// Make this node's copy of a replicated volume its primary (after the
    /// primary was lost): the volume map grants it only to a copy in sync,
    /// once the old primary's lease ran out (waits up to a lease for it).
    Promote { name: String },
    /// On a replicated volume's primary: replace the copy on NODE (lost, or
    /// to move it) by a new copy on another node of the cluster file,
    /// filled in the background at resync_bytes_per_sec; `volume show`
    /// tells when it is in sync. Refused if it would leave fewer copies in
    /// sync than the write quorum. The old copy is deleted when its node
    /// can be reached, or when it next starts.
    ReplaceCopy {
        name: String,
        /// The node whose copy goes.
        node: String,
        /// The node of the new copy [default: one holding no copy, in
        /// another zone than the remaining copies if there is one].
        #[arg(long, value_name = "NODE")]
        to: Option<String>,
    },
    /// Drop the volume's files (its layer and every parent's) from the
    /// server's page cache, syncing them first, so the next reads come
    /// from the disk. Prints how much was cached before and after.
    Evict { name: String },
}

#[derive(Subcommand, Debug)]
enum SnapshotCmd {
    /// Take a read-only snapshot VOL@SNAP (O(1)); exported over NBD as VOL@SNAP.
    Create {
        #[arg(value_name = "VOL@SNAP")]
        spec: String,
    },
    /// List the snapshots of a volume.
    List { volume: String },
    /// Delete a snapshot.
    Delete {
        #[arg(value_name = "VOL@SNAP")]
        spec: String,
        /// Delete even if it has clones (they keep working).
        #[arg(long)]
        force: bool,
    },
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
        Cmd::Serve {
            config,
            data_dir,
            nbd,
            api,
            io_engine,
            read_only,
            tls,
            tls_certificates,
            tls_verify_peer,
            tls_psk,
            cluster,
            node,
            api_token_file,
            no_api_token,
        } => {
            let file = match &config {
                Some(path) => ServeSettings::from_file(path)?,
                None => ServeSettings::default(),
            };
            let flags = ServeSettings {
                data_dir,
                nbd,
                api,
                io_engine,
                read_only: read_only.then_some(true),
                tls,
                tls_certificates,
                tls_psk,
                tls_verify_peer: tls_verify_peer.then_some(true),
                cluster,
                node,
                // The flag's file, else the environment, replaces the file's token.
                api_token: match api_token_file {
                    Some(_) => None,
                    None => std::env::var("CORONAFS_API_TOKEN").ok().filter(|t| !t.is_empty()),
                },
                api_token_file,
                no_api_token,
            };
            let cfg = file.overridden_by(flags).into_server_config()?;
            let srv = service::start(cfg).await.context("starting the server")?;
            srv.run_until_signal().await;
            Ok(())
        }
        Cmd::Volume { cmd, api, token } => volume(cmd, &token.client(&api)?).await,
        Cmd::Snapshot { cmd, api, token } => snapshot(cmd, &token.client(&api)?).await,
        Cmd::Cluster { cmd, api, token } => cluster(cmd, &token.client(&api)?).await,
    }
}

async fn cluster(cmd: ClusterCmd, api: &ApiClient) -> anyhow::Result<()> {
    let map = match cmd {
        ClusterCmd::Status => api.cluster_map().await?,
        ClusterCmd::AddNode { name, cluster } => {
            let file = coronafs::cluster::ClusterFile::load(&cluster)?;
            let node = file.node(&name)?;
            api.add_node(&name, &node.replica.to_string()).await?
        }
        ClusterCmd::RemoveNode { name } => api.remove_node(&name).await?,
    };
    let s = &map.status;
    println!(
        "asked {}: leader {}, term {}, voters {}",
        s.node,
        s.leader.as_deref().unwrap_or("none"),
        s.term,
        if s.voters.is_empty() { "none (not a member yet)".to_owned() } else { s.voters.join(", ") }
    );
    for (name, v) in &map.volumes {
        let in_sync: Vec<&str> = v.in_sync.iter().map(String::as_str).collect();
        println!(
            "  {name}: primary {} at epoch {}, copies {}, in sync {}, quorum {}",
            v.primary,
            v.epoch,
            v.copies.join(", "),
            in_sync.join(", "),
            v.quorum
        );
    }
    Ok(())
}

fn print_volumes(list: &[VolumeInfo]) {
    println!("{:<32} {:>16} {:>16} {:>5}  PARENT", "NAME", "SIZE", "ALLOCATED", "CONNS");
    for v in list {
        let parent = v.parent.as_deref().unwrap_or("-");
        println!("{:<32} {:>16} {:>16} {:>5}  {parent}", v.name, v.size, v.allocated_bytes, v.connections);
    }
}

async fn volume(cmd: VolumeCmd, api: &ApiClient) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Create { name, size, from_snapshot, replicas } => {
            let size = size.map(|s| coronafs::util::parse_size(&s)).transpose()?;
            if size.is_none() && from_snapshot.is_none() {
                bail!("--size is required unless --from-snapshot is given");
            }
            let v = api.create_volume(&CreateVolume { name, size, from_snapshot, replicas }).await?;
            if !v.replicas.is_empty() {
                println!("copies on this node (primary) and {}", v.replicas.join(", "));
            }
            match &v.parent {
                Some(p) => println!(
                    "created {} ({} bytes) as a clone of {p}, export nbd://<server>/{}",
                    v.name, v.size, v.nbd_export
                ),
                None => println!("created {} ({} bytes), export nbd://<server>/{}", v.name, v.size, v.nbd_export),
            }
        }
        VolumeCmd::List => print_volumes(&api.list().await?),
        VolumeCmd::Show { name } => println!("{}", serde_json::to_string_pretty(&api.get(&name).await?)?),
        VolumeCmd::Delete { name, force } => {
            api.delete(&name, force).await?;
            println!("deleted {name}");
        }
        VolumeCmd::Resize { name, size, allow_shrink } => {
            let size = coronafs::util::parse_size(&size)?;
            let v = api.resize(&name, size, allow_shrink).await?;
            println!("resized {} to {} bytes (clients see it when they reconnect)", v.name, v.size);
        }
        VolumeCmd::Fence { name, epoch } => {
            let v = api.fence(&name, epoch).await?;
            println!("{} is at epoch {}; no older write is in flight", v.name, v.epoch);
        }
        VolumeCmd::ReplaceCopy { name, node, to } => {
            let v = api.replace_copy(&name, &node, to.as_deref()).await?;
            println!(
                "{}: the copy on {node} is replaced; copies {:?} (the new one fills in the background: volume show {})",
                v.name, v.replicas, v.name
            );
        }
        VolumeCmd::Promote { name } => {
            let v = api.promote(&name).await?;
            println!(
                "{} is primary here at epoch {}; replicas {:?}, stale {:?}",
                v.name, v.epoch, v.replicas, v.stale_replicas
            );
        }
        VolumeCmd::Evict { name } => {
            let r = api.evict(&name).await?;
            println!(
                "evicted {}: {} files, {} bytes; {} bytes cached before, {} after",
                r.volume,
                r.files.len(),
                r.bytes,
                r.resident_before,
                r.resident_after
            );
        }
        VolumeCmd::Flatten { name } => {
            let v = api.flatten(&name).await?;
            println!("flattened {} ({} bytes allocated, no parent)", v.name, v.allocated_bytes);
        }
    }
    Ok(())
}

async fn snapshot(cmd: SnapshotCmd, api: &ApiClient) -> anyhow::Result<()> {
    match cmd {
        SnapshotCmd::Create { spec } => {
            let (vol, name) = coronafs::volume::parse_snap(&spec)?;
            let s = api.snapshot(vol, name).await?;
            println!(
                "snapshot {} taken ({} bytes), read-only export nbd://<server>/{}",
                s.nbd_export, s.size, s.nbd_export
            );
        }
        SnapshotCmd::List { volume } => {
            println!("{:<48} {:>16} {:>16}  CLONES", "SNAPSHOT", "SIZE", "ALLOCATED");
            for s in api.snapshots(&volume).await? {
                println!("{:<48} {:>16} {:>16}  {}", s.nbd_export, s.size, s.allocated_bytes, s.clones.join(","));
            }
        }
        SnapshotCmd::Delete { spec, force } => {
            let (vol, name) = coronafs::volume::parse_snap(&spec)?;
            api.delete_snapshot(vol, name, force).await?;
            println!("deleted {spec}");
        }
    }
    Ok(())
}
