//! The network baseline: bulk TCP throughput from the bench to a sink on the
//! services' side of the (possibly emulated) link, and the sender's
//! retransmit count from `TCP_INFO`, like `iperf3`'s default test.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One probe's result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Probe {
    pub bytes_per_s: f64,
    pub retransmits: u32,
}

/// A sink on a free loopback port (see [`sink_on`]).
pub async fn sink() -> std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    sink_on(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await
}

/// A sink that reads and discards, replying with the byte count at EOF.
pub async fn sink_on(
    addr: std::net::SocketAddr,
) -> std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let l = TcpListener::bind(addr).await?;
    let addr = l.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 << 10];
                let mut total = 0u64;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => total += n as u64,
                    }
                }
                let _ = s.write_all(&total.to_le_bytes()).await;
            });
        }
    });
    Ok((addr, task))
}

/// Total retransmitted segments of a socket (`tcpi_total_retrans`).
pub fn retransmits(s: &TcpStream) -> std::io::Result<u32> {
    // SAFETY: tcp_info is plain old data; zeroed is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the pointers are valid for `len` bytes and the fd is open.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info.tcpi_total_retrans)
}

/// Sends for `duration` (or `max_bytes`, whichever first) to `addr`; the
/// throughput counts only bytes the sink confirms having received.
pub async fn run(addr: std::net::SocketAddr, duration: Duration, max_bytes: u64) -> anyhow::Result<Probe> {
    let mut s = TcpStream::connect(addr).await?;
    let buf = vec![0x5Au8; 128 << 10];
    let t = Instant::now();
    let mut sent = 0u64;
    while t.elapsed() < duration && sent < max_bytes {
        s.write_all(&buf).await?;
        sent += buf.len() as u64;
    }
    let retrans = retransmits(&s)?;
    s.shutdown().await?;
    let mut ack = [0u8; 8];
    tokio::time::timeout(Duration::from_secs(60), s.read_exact(&mut ack)).await??;
    let secs = t.elapsed().as_secs_f64();
    let got = u64::from_le_bytes(ack);
    anyhow::ensure!(got == sent, "sink received {got} of {sent} bytes");
    Ok(Probe { bytes_per_s: got as f64 / secs, retransmits: retrans })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shaper::{LinkSpec, Shaper};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_measures_the_emulated_link_rate() {
        let (sink_addr, task) = sink().await.unwrap();
        let sh =
            Shaper::start(sink_addr, LinkSpec { rate: Some(16 << 20), delay: Duration::from_millis(1) }).await.unwrap();
        let p = run(sh.addr, Duration::from_millis(700), 64 << 20).await.unwrap();
        let mib = p.bytes_per_s / 1048576.0;
        assert!((12.0..=18.0).contains(&mib), "{mib:.1} MiB/s through a 16 MiB/s link");
        let fast = run(sink_addr, Duration::from_millis(300), 1 << 30).await.unwrap();
        assert!(fast.bytes_per_s > 4.0 * p.bytes_per_s, "loopback is much faster than the emulated link");
        sh.shutdown().await;
        task.abort();
    }
}
