//! Server metrics, kept in atomics on the hot path and rendered in the
//! Prometheus text format at `/metrics`.

use crate::proto::request::Command;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in microseconds.
const BUCKETS_US: [u64; 14] = [10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 50_000, 100_000, 1_000_000];

const OPS: [Command; 9] = [
    Command::Read,
    Command::Write,
    Command::Flush,
    Command::Trim,
    Command::WriteZeroes,
    Command::Cache,
    Command::BlockStatus,
    Command::Disc,
    Command::Unknown(0),
];

#[derive(Debug, Default)]
struct OpMetrics {
    count: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    sum_us: AtomicU64,
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
}

/// All counters of one server.
#[derive(Debug, Default)]
pub struct Metrics {
    ops: [OpMetrics; OPS.len()],
    /// Open NBD connections.
    pub connections: AtomicI64,
    /// Requests received and not yet answered.
    pub inflight: AtomicI64,
    /// Connections that ended during negotiation with an error.
    pub handshake_failures: AtomicU64,
    /// Connections that broke the protocol or vanished mid-request.
    pub protocol_errors: AtomicU64,
    /// READs sent straight from the page cache with `sendfile`.
    pub sendfile_reads: AtomicU64,
    /// Mutating requests refused because their connection's epoch was fenced.
    pub fenced_requests: AtomicU64,
}

fn index(c: Command) -> usize {
    OPS.iter().position(|o| std::mem::discriminant(o) == std::mem::discriminant(&c)).unwrap_or(OPS.len() - 1)
}

impl Metrics {
    /// Records one answered request.
    pub fn record(&self, cmd: Command, bytes: u64, ok: bool, elapsed: Duration) {
        let m = &self.ops[index(cmd)];
        let us = elapsed.as_micros() as u64;
        m.count.fetch_add(1, Relaxed);
        m.bytes.fetch_add(bytes, Relaxed);
        m.sum_us.fetch_add(us, Relaxed);
        if !ok {
            m.errors.fetch_add(1, Relaxed);
        }
        let b = BUCKETS_US.iter().position(|&le| us <= le).unwrap_or(BUCKETS_US.len());
        m.buckets[b].fetch_add(1, Relaxed);
    }

    /// Requests answered for a command so far.
    pub fn count(&self, cmd: Command) -> u64 {
        self.ops[index(cmd)].count.load(Relaxed)
    }

    /// Errors answered for a command so far.
    pub fn errors(&self, cmd: Command) -> u64 {
        self.ops[index(cmd)].errors.load(Relaxed)
    }

    /// Renders everything in the Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut s = String::with_capacity(8192);
        let mut family = |name: &str, kind: &str, help: &str, f: &dyn Fn(&OpMetrics) -> u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (op, m) in OPS.iter().zip(&self.ops) {
                let _ = writeln!(s, "{name}{{op=\"{}\"}} {}", op.name(), f(m));
            }
        };
        family("coronafs_nbd_requests_total", "counter", "NBD requests answered.", &|m| m.count.load(Relaxed));
        family("coronafs_nbd_bytes_total", "counter", "Payload bytes read or written.", &|m| m.bytes.load(Relaxed));
        family("coronafs_nbd_errors_total", "counter", "NBD requests answered with an error.", &|m| {
            m.errors.load(Relaxed)
        });
        let name = "coronafs_nbd_request_duration_seconds";
        let _ = writeln!(s, "# HELP {name} Time from request received to reply ready.\n# TYPE {name} histogram");
        for (op, m) in OPS.iter().zip(&self.ops) {
            let mut cum = 0;
            for (i, le) in BUCKETS_US.iter().enumerate() {
                cum += m.buckets[i].load(Relaxed);
                let _ = writeln!(s, "{name}_bucket{{op=\"{}\",le=\"{}\"}} {cum}", op.name(), *le as f64 / 1e6);
            }
            cum += m.buckets[BUCKETS_US.len()].load(Relaxed);
            let _ = writeln!(s, "{name}_bucket{{op=\"{}\",le=\"+Inf\"}} {cum}", op.name());
            let _ = writeln!(s, "{name}_sum{{op=\"{}\"}} {}", op.name(), m.sum_us.load(Relaxed) as f64 / 1e6);
            let _ = writeln!(s, "{name}_count{{op=\"{}\"}} {cum}", op.name());
        }
        let gauges: [(&str, &str, i64); 6] = [
            ("coronafs_nbd_connections", "Open NBD connections.", self.connections.load(Relaxed)),
            ("coronafs_nbd_inflight_requests", "Requests being served.", self.inflight.load(Relaxed)),
            (
                "coronafs_nbd_handshake_failures_total",
                "Negotiations that failed.",
                self.handshake_failures.load(Relaxed) as i64,
            ),
            (
                "coronafs_nbd_protocol_errors_total",
                "Connections dropped for breaking the protocol.",
                self.protocol_errors.load(Relaxed) as i64,
            ),
            (
                "coronafs_nbd_sendfile_reads_total",
                "READs sent from the page cache with sendfile, without a copy.",
                self.sendfile_reads.load(Relaxed) as i64,
            ),
            (
                "coronafs_nbd_fenced_requests_total",
                "WRITE/TRIM/WRITE_ZEROES refused because a newer epoch fenced the connection.",
                self.fenced_requests.load(Relaxed) as i64,
            ),
        ];
        for (name, help, v) in gauges {
            let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_counts_errors() {
        let m = Metrics::default();
        m.record(Command::Read, 4096, true, Duration::from_micros(20));
        m.record(Command::Read, 4096, false, Duration::from_millis(3));
        let text = m.render();
        assert!(text.contains("coronafs_nbd_requests_total{op=\"read\"} 2"));
        assert!(text.contains("coronafs_nbd_errors_total{op=\"read\"} 1"));
        assert!(text.contains("coronafs_nbd_bytes_total{op=\"read\"} 8192"));
        assert!(text.contains("coronafs_nbd_request_duration_seconds_bucket{op=\"read\",le=\"0.000025\"} 1"));
        assert!(text.contains("coronafs_nbd_request_duration_seconds_bucket{op=\"read\",le=\"+Inf\"} 2"));
    }
}
