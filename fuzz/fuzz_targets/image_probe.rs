//! Feeds arbitrary artifacts to PlasmaVMC's image probe (one-shot and
//! streaming) and to the L1 table check: each must return a value or an
//! error, never panic, and what is accepted must respect the limits.
//!
//! The probe is sans-IO and needs only serde and thiserror, so its source is
//! compiled in directly: building the whole `plasmavmc` crate (aws-sdk,
//! axum, imago) with sanitizers would cost minutes for code never reached.
#![no_main]

#[path = "../../crates/plasmavmc/src/probe.rs"]
#[allow(dead_code)]
mod probe;

use libfuzzer_sys::fuzz_target;
use probe::{DiskFormat, Limits, PROBE_LEN, Prober};

const LIMITS: Limits = Limits { max_virtual_size: 1 << 44 };

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, bytes)) = data.split_first() else { return };
    let declared = match ctl % 3 {
        0 => None,
        1 => Some(DiskFormat::Raw),
        _ => Some(DiskFormat::Qcow2),
    };
    let head = &bytes[..bytes.len().min(PROBE_LEN)];
    // The file may be longer than what the fuzzer gave (only its head was read).
    let total = bytes.len() as u64 + if ctl & 0x80 != 0 { u64::from(ctl) << 24 } else { 0 };
    let one_shot = probe::probe(head, total, declared, LIMITS);
    if let Ok(r) = &one_shot {
        assert!(r.virtual_size <= LIMITS.max_virtual_size, "{r:?}");
        if r.format == DiskFormat::Qcow2 {
            assert!(r.cluster_size.is_power_of_two() && (512..=2 << 20).contains(&r.cluster_size), "{r:?}");
            if let Some((off, n)) = probe::l1_location(head) {
                let start = usize::try_from(off).unwrap_or(usize::MAX).min(bytes.len());
                let len = usize::try_from(n.saturating_mul(8)).unwrap_or(usize::MAX).min(bytes.len() - start);
                let _ = probe::check_l1_entries(&bytes[start..start + len - len % 8], 0, r.cluster_size, total);
            }
        }
    }
    // Streaming in uneven chunks gives the same answer when the stream is the whole file.
    if total == bytes.len() as u64 {
        let mut p = Prober::default();
        let step = usize::from(ctl % 61) * 1031 + 1;
        for chunk in bytes.chunks(step) {
            p.feed(chunk);
            if p.head_full() {
                let _ = p.early(declared, LIMITS);
            }
        }
        assert_eq!(p.total(), total);
        assert_eq!(p.finish(declared, LIMITS), one_shot);
    }
});
