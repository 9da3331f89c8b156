//! Link emulation: a TCP proxy on loopback that forwards to a service
//! through a token bucket per direction (shared by every connection, as one
//! physical link would be) and adds a fixed one-way delay.
//!
//! Bytes are timestamped when read from one side and written to the other
//! no sooner than `delay` later, so the delay adds to each round trip
//! without capping throughput the way a sleep-per-chunk would.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How the emulated link behaves. `rate` is bytes per second per
/// direction; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkSpec {
    pub rate: Option<u64>,
    pub delay: Duration,
}

impl LinkSpec {
    /// No emulation: traffic goes over whatever path joins the two ends
    /// (loopback on one host, the real network between hosts).
    pub fn is_unshaped(&self) -> bool {
        self.rate.is_none() && self.delay.is_zero()
    }

    pub fn describe(&self) -> String {
        match (self.rate, self.delay.is_zero()) {
            (None, true) => "no link emulation".into(),
            (rate, _) => format!(
                "emulated link: {} per direction, {} ms added one-way delay",
                rate.map_or("unlimited".to_owned(), |r| format!("{:.1} MiB/s", r as f64 / 1048576.0)),
                self.delay.as_secs_f64() * 1000.0
            ),
        }
    }
}

/// A token bucket: `rate` bytes per second, bursts up to `burst` bytes.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub fn new(rate: u64) -> Self {
        // A burst of ~10 ms of traffic (at least 16 KiB) keeps the rate smooth.
        let burst = (rate as f64 / 100.0).max(16384.0);
        TokenBucket { rate: rate as f64, burst, state: Mutex::new((burst, Instant::now())) }
    }

    /// Takes `n` tokens, returning how long the caller must wait first.
    /// Debt is allowed, so large chunks are paced rather than refused.
    pub fn take(&self, n: usize) -> Duration {
        let Ok(mut s) = self.state.lock() else { return Duration::ZERO };
        let now = Instant::now();
        let (tokens, last) = *s;
        let tokens = (tokens + now.duration_since(last).as_secs_f64() * self.rate).min(self.burst) - n as f64;
        *s = (tokens, now);
        if tokens >= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(-tokens / self.rate) }
    }
}

/// One host's network interface on the emulated link: a bucket for what
/// it receives and one for what it sends, shared by every proxy in front of
/// or behind that host.
#[derive(Debug, Clone)]
pub struct Nic {
    pub rx: Option<Arc<TokenBucket>>,
    pub tx: Option<Arc<TokenBucket>>,
    pub delay: Duration,
}

impl Nic {
    pub fn new(spec: LinkSpec) -> Nic {
        Nic {
            rx: spec.rate.map(|r| Arc::new(TokenBucket::new(r))),
            tx: spec.rate.map(|r| Arc::new(TokenBucket::new(r))),
            delay: spec.delay,
        }
    }

    /// A proxy in front of a service on this host (clients send into it).
    pub async fn inbound(&self, service: SocketAddr) -> std::io::Result<Shaper> {
        Shaper::start_with(service, self.delay, self.rx.clone(), self.tx.clone()).await
    }

    /// A proxy this host's processes use to reach `remote` (they send out).
    pub async fn outbound(&self, remote: SocketAddr) -> std::io::Result<Shaper> {
        Shaper::start_with(remote, self.delay, self.tx.clone(), self.rx.clone()).await
    }
}

/// A running proxy.
#[derive(Debug)]
pub struct Shaper {
    pub addr: SocketAddr,
    pub upstream: SocketAddr,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Shaper {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr, spec: LinkSpec) -> std::io::Result<Shaper> {
        let up = spec.rate.map(|r| Arc::new(TokenBucket::new(r)));
        let down = spec.rate.map(|r| Arc::new(TokenBucket::new(r)));
        Self::start_with(upstream, spec.delay, up, down).await
    }

    /// Like [`Shaper::start`], with the buckets given: `up` paces bytes from
    /// clients to `upstream`, `down` the replies. Proxies that share a
    /// bucket share its rate, as connections through one NIC do.
    pub async fn start_with(
        upstream: SocketAddr,
        delay: Duration,
        up: Option<Arc<TokenBucket>>,
        down: Option<Arc<TokenBucket>>,
    ) -> std::io::Result<Shaper> {
        let spec = LinkSpec { rate: None, delay };
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let (stop, mut stopped) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    r = listener.accept() => {
                        let Ok((client, _)) = r else { continue };
                        let (up, down) = (up.clone(), down.clone());
                        conns.spawn(async move {
                            let Ok(server) = TcpStream::connect(upstream).await else { return };
                            let _ = client.set_nodelay(true);
                            let _ = server.set_nodelay(true);
                            let (cr, cw) = client.into_split();
                            let (sr, sw) = server.into_split();
                            let a = pump(cr, sw, up, spec.delay);
                            let b = pump(sr, cw, down, spec.delay);
                            let _ = tokio::join!(a, b);
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                    _ = stopped.changed() => break,
                }
            }
            conns.shutdown().await;
        });
        Ok(Shaper { addr, upstream, stop, task })
    }

    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Copies one direction: read, pay tokens, hand to a writer that releases
/// each chunk `delay` after it was read.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    bucket: Option<Arc<TokenBucket>>,
    delay: Duration,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(256);
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at.into()).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    let reader = async move {
        // Small reads keep pacing fine-grained when a rate is set.
        let size = if bucket.is_some() { 16 << 10 } else { 256 << 10 };
        let mut buf = vec![0u8; size];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(b) = &bucket {
                let wait = b.take(n);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
            }
            if tx.send((Instant::now() + delay, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(reader, writer);
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn sink_server() -> SocketAddr {
        let l = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut b = vec![0u8; 1 << 16];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 {
                            break;
                        }
                    }
                    let _ = s.write_all(b"done").await;
                });
            }
        });
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_rate_is_enforced_within_fifteen_percent() {
        let rate = 8u64 << 20;
        let sh =
            Shaper::start(sink_server().await, LinkSpec { rate: Some(rate), delay: Duration::ZERO }).await.unwrap();
        let mut c = TcpStream::connect(sh.addr).await.unwrap();
        let total = 6usize << 20;
        let t = Instant::now();
        c.write_all(&vec![7u8; total]).await.unwrap();
        c.shutdown().await.unwrap();
        let mut ack = Vec::new();
        c.read_to_end(&mut ack).await.unwrap();
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(ack, b"done");
        let got = total as f64 / secs;
        let ratio = got / rate as f64;
        assert!((0.85..=1.15).contains(&ratio), "measured {:.2} MiB/s for 8 MiB/s", got / 1048576.0);
        sh.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_delay_adds_to_each_round_trip() {
        let sh = Shaper::start(echo_server().await, LinkSpec { rate: None, delay: Duration::from_millis(20) })
            .await
            .unwrap();
        let mut c = TcpStream::connect(sh.addr).await.unwrap();
        c.set_nodelay(true).unwrap();
        let mut rtts = Vec::new();
        for i in 0..5u8 {
            let t = Instant::now();
            c.write_all(&[i]).await.unwrap();
            let mut b = [0u8; 1];
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], i, "bytes pass unchanged");
            rtts.push(t.elapsed());
        }
        rtts.sort();
        let median = rtts[2];
        assert!(median >= Duration::from_millis(40), "two delays per round trip, got {median:?}");
        assert!(median < Duration::from_millis(120), "not much more than the delay, got {median:?}");
        sh.shutdown().await;
    }

    #[test]
    fn the_bucket_charges_debt_at_the_rate() {
        let b = TokenBucket::new(1 << 20);
        let burst = b.burst as usize;
        assert_eq!(b.take(burst), Duration::ZERO);
        let w = b.take(1 << 20);
        assert!(w > Duration::from_millis(950) && w <= Duration::from_millis(1001), "{w:?}");
    }
}
