//! Counters exported at `/metrics` in the Prometheus text format.

use std::sync::atomic::{AtomicU64, Ordering};
use svc_kit::prom::Text;

/// Process-wide counters of one node.
#[derive(Debug, Default)]
pub struct Metrics {
    /// S3 requests handled.
    pub requests: AtomicU64,
    /// S3 requests answered with an error.
    pub request_errors: AtomicU64,
    /// Body bytes received.
    pub bytes_in: AtomicU64,
    /// Body bytes sent.
    pub bytes_out: AtomicU64,
    /// Blocks written (including deduplicated ones).
    pub blocks_written: AtomicU64,
    /// Blocks read and verified.
    pub blocks_read: AtomicU64,
    /// Blocks that failed verification on read.
    pub corrupt_blocks: AtomicU64,
    /// Unreferenced blocks deleted.
    pub gc_blocks_deleted: AtomicU64,
    /// Uploads rejected for a checksum or Content-MD5 mismatch.
    pub bad_digests: AtomicU64,
    /// Rounds of the lifecycle task.
    pub lifecycle_rounds: AtomicU64,
    /// Objects and uploads the lifecycle task looked at.
    pub lifecycle_examined: AtomicU64,
    /// Objects the lifecycle task deleted.
    pub lifecycle_expired: AtomicU64,
    /// Multipart uploads the lifecycle task aborted.
    pub lifecycle_aborted: AtomicU64,
    /// Lifecycle deletes and aborts that failed (retried next round).
    pub lifecycle_failed: AtomicU64,
}

impl Metrics {
    /// Adds one.
    pub fn inc(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds `n`.
    pub fn add(&self, c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Renders every counter; `gauges` adds point-in-time values.
    pub fn render(&self, gauges: &[(&str, &str, u64)]) -> String {
        let counters: [(&str, &str, &AtomicU64); 14] = [
            ("requests_total", "S3 requests handled", &self.requests),
            ("request_errors_total", "S3 requests answered with an error", &self.request_errors),
            ("bytes_in_total", "object bytes received", &self.bytes_in),
            ("bytes_out_total", "object bytes sent", &self.bytes_out),
            ("blocks_written_total", "blocks written", &self.blocks_written),
            ("blocks_read_total", "blocks read and verified", &self.blocks_read),
            ("corrupt_blocks_total", "blocks that failed verification", &self.corrupt_blocks),
            ("gc_blocks_deleted_total", "unreferenced blocks deleted", &self.gc_blocks_deleted),
            ("bad_digests_total", "uploads rejected for a digest mismatch", &self.bad_digests),
            ("lifecycle_rounds_total", "rounds of the lifecycle task", &self.lifecycle_rounds),
            ("lifecycle_examined_total", "objects and uploads the lifecycle task looked at", &self.lifecycle_examined),
            ("lifecycle_expired_total", "objects deleted by lifecycle expiration", &self.lifecycle_expired),
            ("lifecycle_aborted_total", "multipart uploads aborted by lifecycle", &self.lifecycle_aborted),
            ("lifecycle_failed_total", "lifecycle deletes and aborts that failed", &self.lifecycle_failed),
        ];
        let mut t = Text::new();
        for (name, help, c) in counters {
            t.counter(&format!("lightningstor_{name}"), help, c.load(Ordering::Relaxed));
        }
        for &(name, help, v) in gauges {
            t.gauge(&format!("lightningstor_{name}"), help, v);
        }
        t.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_metrics_are_prometheus_text() {
        let m = Metrics::default();
        m.inc(&m.requests);
        let text = m.render(&[("objects", "objects stored", 5)]);
        assert!(text.contains("lightningstor_requests_total 1\n"));
        assert!(text.contains("# TYPE lightningstor_objects gauge\nlightningstor_objects 5\n"));
        assert!(text.starts_with(
            "# HELP lightningstor_requests_total S3 requests handled\n\
             # TYPE lightningstor_requests_total counter\nlightningstor_requests_total 1\n"
        ));
        assert!(text.contains("# HELP lightningstor_objects objects stored\n"));
    }
}
