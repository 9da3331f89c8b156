//! Counters exported at `/metrics` (Prometheus text).

use std::sync::atomic::{AtomicU64, Ordering};
use svc_kit::prom::Text;

#[derive(Debug, Default)]
pub struct Metrics {
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Volume requests that waited for another request's fill of the same image.
    pub cache_coalesced: AtomicU64,
    pub cache_evictions: AtomicU64,
    pub images_created: AtomicU64,
    pub images_failed: AtomicU64,
    pub image_bytes: AtomicU64,
    pub volumes_created: AtomicU64,
    pub volumes_failed: AtomicU64,
    pub fill_bytes_fetched: AtomicU64,
    pub fill_bytes_written: AtomicU64,
    pub migrations: AtomicU64,
    /// Shared with the attachments, which count their own refusals.
    pub fenced_writes: std::sync::Arc<AtomicU64>,
}

impl Metrics {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Renders every counter; `gauges` (names without the `plasmavmc_`
    /// prefix) adds point-in-time values.
    pub fn render(&self, gauges: &[(&str, &str, u64)]) -> String {
        let counters: [(&str, &str, &AtomicU64); 13] = [
            ("plasmavmc_cache_hits_total", "volume creations served by cloning a cached base", &self.cache_hits),
            (
                "plasmavmc_cache_misses_total",
                "volume creations that had to fetch and convert the image",
                &self.cache_misses,
            ),
            (
                "plasmavmc_cache_coalesced_total",
                "volume creations that waited for another fill of the same image",
                &self.cache_coalesced,
            ),
            ("plasmavmc_cache_evictions_total", "cached bases evicted", &self.cache_evictions),
            ("plasmavmc_images_created_total", "images that became active", &self.images_created),
            ("plasmavmc_images_failed_total", "images that ended in error", &self.images_failed),
            ("plasmavmc_image_bytes_total", "artifact bytes stored", &self.image_bytes),
            ("plasmavmc_volumes_created_total", "volumes that became available", &self.volumes_created),
            ("plasmavmc_volumes_failed_total", "volumes that ended in error", &self.volumes_failed),
            ("plasmavmc_fill_bytes_fetched_total", "artifact bytes fetched for base fills", &self.fill_bytes_fetched),
            (
                "plasmavmc_fill_bytes_written_total",
                "data bytes written into bases (zeros excluded)",
                &self.fill_bytes_written,
            ),
            ("plasmavmc_migrations_total", "VM migrations completed", &self.migrations),
            ("plasmavmc_fenced_writes_total", "writes refused because their epoch was stale", &*self.fenced_writes),
        ];
        let mut t = Text::new();
        for (name, help, c) in counters {
            t.counter(name, help, c.load(Ordering::Relaxed));
        }
        for &(name, help, v) in gauges {
            t.gauge(&format!("plasmavmc_{name}"), help, v);
        }
        t.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges_render_with_help_and_type() {
        let m = Metrics::default();
        Metrics::inc(&m.cache_hits);
        m.fenced_writes.fetch_add(2, Ordering::Relaxed);
        let text = m.render(&[("images", "images by status", 4)]);
        assert!(text.starts_with(
            "# HELP plasmavmc_cache_hits_total volume creations served by cloning a cached base\n\
             # TYPE plasmavmc_cache_hits_total counter\nplasmavmc_cache_hits_total 1\n"
        ));
        assert!(text.contains("# TYPE plasmavmc_fenced_writes_total counter\nplasmavmc_fenced_writes_total 2\n"));
        assert!(text.ends_with(
            "# HELP plasmavmc_images images by status\n# TYPE plasmavmc_images gauge\nplasmavmc_images 4\n"
        ));
    }
}
