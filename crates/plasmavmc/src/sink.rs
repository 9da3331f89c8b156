//! Writing converted pieces into a CoronaFS volume through our NBD client:
//! non-zero runs as WRITE, everything else as WRITE_ZEROES (which CoronaFS
//! turns into holes), many requests in flight on one connection.

use crate::convert::Piece;
use crate::error::{PlasmaError, Result};
use coronafs::client::NbdClient;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::sync::Arc;
use tokio::sync::mpsc;

/// Granularity of zero detection inside data.
pub const ZERO_GRAIN: usize = 4096;
/// Requests in flight on the connection.
const IN_FLIGHT: usize = 16;
/// Largest WRITE_ZEROES request (the length field is 32 bits).
const MAX_ZERO: u64 = 1 << 30;

/// Splits `buf` into maximal runs `(start, end, all_zero)` on
/// [`ZERO_GRAIN`] boundaries (the tail may be shorter). Pure.
pub fn runs(buf: &[u8]) -> Vec<(usize, usize, bool)> {
    let mut out: Vec<(usize, usize, bool)> = Vec::new();
    for (i, grain) in buf.chunks(ZERO_GRAIN).enumerate() {
        let zero = grain.iter().all(|b| *b == 0);
        let start = i * ZERO_GRAIN;
        let end = start + grain.len();
        match out.last_mut() {
            Some(last) if last.2 == zero => last.1 = end,
            _ => out.push((start, end, zero)),
        }
    }
    out
}

enum Op {
    Write(u64, bytes::Bytes),
    Zero(u64, u32),
}

fn ops(piece: Piece) -> Vec<Op> {
    match piece {
        Piece::Data { offset, data } => runs(&data)
            .into_iter()
            .map(|(s, e, zero)| {
                if zero {
                    Op::Zero(offset + s as u64, (e - s) as u32)
                } else {
                    Op::Write(offset + s as u64, data.slice(s..e))
                }
            })
            .collect(),
        Piece::Zero { offset, len } => {
            let mut v = Vec::new();
            let mut at = 0;
            while at < len {
                let n = (len - at).min(MAX_ZERO);
                v.push(Op::Zero(offset + at, n as u32));
                at += n;
            }
            v
        }
    }
}

/// Writes every piece from `rx` to `nbd`, then flushes. Returns bytes written
/// as data (zero ranges excluded).
pub async fn drain(nbd: Arc<NbdClient>, mut rx: mpsc::Receiver<Piece>) -> Result<u64> {
    let mut inflight = FuturesUnordered::new();
    let mut written = 0u64;
    let size = nbd.size();
    while let Some(piece) = rx.recv().await {
        for op in ops(piece) {
            while inflight.len() >= IN_FLIGHT {
                if let Some(r) = inflight.next().await {
                    r??;
                }
            }
            let nbd = nbd.clone();
            match op {
                Op::Write(off, data) => {
                    if off + data.len() as u64 > size {
                        return Err(PlasmaError::Corrupt(format!("data at {off} lies beyond the {size}-byte volume")));
                    }
                    written += data.len() as u64;
                    inflight.push(tokio::spawn(async move {
                        nbd.write(off, &data, false).await.map_err(PlasmaError::from)
                    }));
                }
                Op::Zero(off, len) => {
                    inflight.push(tokio::spawn(async move {
                        nbd.write_zeroes(off, len, 0).await.map_err(PlasmaError::from)
                    }));
                }
            }
        }
    }
    while let Some(r) = inflight.next().await {
        r??;
    }
    nbd.flush().await?;
    Ok(written)
}

impl From<tokio::task::JoinError> for PlasmaError {
    fn from(e: tokio::task::JoinError) -> Self {
        PlasmaError::Io(std::io::Error::other(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn runs_cover_the_buffer_and_classify_each_grain(blocks in proptest::collection::vec(any::<bool>(), 0..40), tail in 0usize..4096) {
            let mut buf = Vec::new();
            for nonzero in &blocks {
                let mut g = vec![0u8; ZERO_GRAIN];
                if *nonzero { g[ZERO_GRAIN / 2] = 1; }
                buf.extend_from_slice(&g);
            }
            buf.extend(std::iter::repeat_n(0u8, tail));
            let r = runs(&buf);
            let mut at = 0;
            for (i, (s, e, zero)) in r.iter().enumerate() {
                prop_assert_eq!(*s, at);
                prop_assert!(e > s);
                prop_assert_eq!(*zero, buf[*s..*e].iter().all(|b| *b == 0));
                if i > 0 { prop_assert_ne!(r[i - 1].2, *zero); }
                at = *e;
            }
            prop_assert_eq!(at, buf.len());
        }
    }
}
