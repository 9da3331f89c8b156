//! Server metrics, kept in atomics on the hot path and rendered in the
//! Prometheus text format at `/metrics`.

use crate::proto::request::Command;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;
use svc_kit::prom::{Buckets, Kind, Text};

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
    /// Connections upgraded to TLS with STARTTLS (the TLS handshake done).
    pub tls_sessions: AtomicU64,
    /// Connections that entered transmission with extended headers.
    pub extended_sessions: AtomicU64,
    /// Replicas a replicated volume dropped from its live set.
    pub replicas_dropped: AtomicU64,
    /// Bytes of regions a primary copied to replicas catching up (resync).
    pub resync_bytes: AtomicU64,
    /// Replicas that caught up and rejoined a live set.
    pub replicas_rejoined: AtomicU64,
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
        let mut t = Text::new();
        let per_op = |t: &mut Text, name: &str, help: &str, f: &dyn Fn(&OpMetrics) -> u64| {
            let mut family = t.family(name, Kind::Counter, help);
            for (op, m) in OPS.iter().zip(&self.ops) {
                family.sample(&[("op", op.name())], f(m));
            }
        };
        per_op(&mut t, "coronafs_nbd_requests_total", "NBD requests answered.", &|m| m.count.load(Relaxed));
        per_op(&mut t, "coronafs_nbd_bytes_total", "Payload bytes read or written.", &|m| m.bytes.load(Relaxed));
        per_op(&mut t, "coronafs_nbd_errors_total", "NBD requests answered with an error.", &|m| {
            m.errors.load(Relaxed)
        });
        let bounds = BUCKETS_US.map(|le| le as f64 / 1e6);
        let mut latency = t.family(
            "coronafs_nbd_request_duration_seconds",
            Kind::Histogram,
            "Time from request received to reply ready.",
        );
        for (op, m) in OPS.iter().zip(&self.ops) {
            let counts = m.buckets.each_ref().map(|b| b.load(Relaxed));
            let sum = m.sum_us.load(Relaxed) as f64 / 1e6;
            latency.histogram(&[("op", op.name())], &Buckets { bounds: &bounds, counts: &counts, sum });
        }
        t.gauge("coronafs_nbd_connections", "Open NBD connections.", self.connections.load(Relaxed));
        t.gauge("coronafs_nbd_inflight_requests", "Requests being served.", self.inflight.load(Relaxed));
        let counters = [
            ("coronafs_nbd_handshake_failures_total", "Negotiations that failed.", &self.handshake_failures),
            (
                "coronafs_nbd_protocol_errors_total",
                "Connections dropped for breaking the protocol.",
                &self.protocol_errors,
            ),
            (
                "coronafs_nbd_sendfile_reads_total",
                "READs sent from the page cache with sendfile, without a copy.",
                &self.sendfile_reads,
            ),
            (
                "coronafs_nbd_fenced_requests_total",
                "WRITE/TRIM/WRITE_ZEROES refused because a newer epoch fenced the connection.",
                &self.fenced_requests,
            ),
            ("coronafs_nbd_tls_sessions_total", "Connections upgraded to TLS with STARTTLS.", &self.tls_sessions),
            (
                "coronafs_nbd_extended_header_sessions_total",
                "Connections in transmission with extended (64-bit) headers.",
                &self.extended_sessions,
            ),
            (
                "coronafs_replica_dropped_total",
                "Replicas dropped from a replicated volume's live set (failed, gone or too slow).",
                &self.replicas_dropped,
            ),
            (
                "coronafs_replica_resync_bytes_total",
                "Bytes of dirty regions copied to replicas catching up (zero regions sent as WRITE_ZEROES count too).",
                &self.resync_bytes,
            ),
            (
                "coronafs_replica_rejoined_total",
                "Replicas that caught up and rejoined a replicated volume's live set.",
                &self.replicas_rejoined,
            ),
        ];
        for (name, help, c) in counters {
            t.counter(name, help, c.load(Relaxed));
        }
        t.finish()
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
        assert!(text.contains("coronafs_nbd_request_duration_seconds_sum{op=\"read\"} 0.00302\n"), "{text}");
        assert!(text.contains("coronafs_nbd_request_duration_seconds_count{op=\"read\"} 2\n"), "{text}");
        assert!(text.contains("coronafs_nbd_request_duration_seconds_bucket{op=\"write\",le=\"1\"} 0\n"), "{text}");
    }

    #[test]
    fn every_family_has_help_and_type_once() {
        let m = Metrics::default();
        m.connections.fetch_add(3, Relaxed);
        m.fenced_requests.fetch_add(1, Relaxed);
        let text = m.render();
        assert!(text.contains("# TYPE coronafs_nbd_connections gauge\ncoronafs_nbd_connections 3\n"), "{text}");
        assert!(
            text.contains("# TYPE coronafs_nbd_fenced_requests_total counter\ncoronafs_nbd_fenced_requests_total 1\n"),
            "{text}"
        );
        let types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let helps = text.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!((types.len(), helps), (15, 15), "{text}");
        assert!(text.contains("coronafs_replica_dropped_total 0\n"), "{text}");
        assert!(text.contains("coronafs_replica_resync_bytes_total 0\n"), "{text}");
        assert!(text.contains("coronafs_replica_rejoined_total 0\n"), "{text}");
        assert_eq!(types.iter().filter(|l| l.ends_with(" histogram")).count(), 1);
    }
}
