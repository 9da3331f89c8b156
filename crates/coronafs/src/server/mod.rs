//! The NBD server: the accept loop and one task per connection ([`conn`]),
//! over the exports the volume manager opens ([`crate::volume::export`]),
//! with a pool of request buffers ([`bufpool`]) and the TLS credentials of
//! STARTTLS ([`tls`]); the replica listener ([`replica`]) applies a
//! primary's forwarded writes to this node's copies. Start-up (binding the
//! listeners, loading the volumes, the control API beside it) is
//! [`crate::service`]'s.

pub mod bufpool;
pub mod conn;
pub mod replica;
pub mod shared;
pub mod tls;

#[cfg(test)]
mod tests;

pub use shared::Shared;

use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Accepts NBD connections on `listener` until `stopped` turns true, then
/// drops every connection.
pub async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    conns.spawn(conn::serve(stream, shared.clone()));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = async { let _ = stopped.wait_for(|s| *s).await; } => break,
        }
    }
    conns.shutdown().await;
}

#[cfg(test)]
mod replica_tests;

#[cfg(test)]
mod test_cluster;

#[cfg(test)]
mod failover_tests;

#[cfg(test)]
mod resync_tests;

#[cfg(test)]
mod snapshot_tests;

#[cfg(test)]
mod copies_tests;

#[cfg(test)]
mod map_tests;

#[cfg(test)]
mod repeated_failover_tests;

#[cfg(test)]
mod members_tests;
#[cfg(test)]
mod replace_tests;
