//! A small qcow2 (version 3) writer for the VM image section's test images,
//! so `fresh-bench-storage` needs no `qemu-img`.
//!
//! It writes what a cloud image looks like to PlasmaVMC: 64 KiB clusters,
//! uncompressed data clusters holding pseudo-random bytes in 1 MiB extents
//! spread evenly over the virtual disk, and unallocated holes between them.
//! No snapshots, no backing file, no extensions; 16-bit refcounts, all 1, so
//! `qemu-img check` finds nothing to repair.
//!
//! File layout, in clusters: header, refcount table, refcount blocks, L1
//! table, the L2 tables that map something, then the data in guest order.

use crate::loadgen::fill;
use anyhow::{Context, bail};
use std::io::Write;
use std::path::Path;

/// log2 of the cluster size.
pub const CLUSTER_BITS: u32 = 16;
/// Bytes per cluster.
pub const CLUSTER: u64 = 1 << CLUSTER_BITS;
/// Bytes per allocated extent.
pub const EXTENT: u64 = 1 << 20;
const L2_ENTRIES: u64 = CLUSTER / 8;
/// 16-bit refcounts: entries per refcount block.
const RC_ENTRIES: u64 = CLUSTER * 8 / 16;
const COPIED: u64 = 1 << 63;

/// What to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Size of the disk the guest sees (a multiple of 1 MiB).
    pub virtual_size: u64,
    /// Allocated guest bytes (rounded down to whole 1 MiB extents, at least one).
    pub data_bytes: u64,
    /// Seeds the data bytes.
    pub seed: u64,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// Bytes of the qcow2 file.
    pub file_size: u64,
    /// Allocated guest bytes.
    pub data_bytes: u64,
    /// Guest offsets of the allocated extents (each [`EXTENT`] long).
    pub extents: Vec<u64>,
}

impl Spec {
    /// Guest offsets of the allocated extents: evenly spaced, the first at 0.
    pub fn extents(&self) -> anyhow::Result<Vec<u64>> {
        if self.virtual_size == 0 || !self.virtual_size.is_multiple_of(EXTENT) {
            bail!("virtual size {} is not a positive multiple of 1 MiB", self.virtual_size);
        }
        let n = (self.data_bytes / EXTENT).max(1);
        let slots = self.virtual_size / EXTENT;
        if n > slots {
            bail!("{} data bytes do not fit a {} byte disk", self.data_bytes, self.virtual_size);
        }
        Ok((0..n).map(|i| i * slots / n * EXTENT).collect())
    }

    /// The guest bytes of the 64 KiB cluster at guest offset `off` if it is
    /// allocated (holes read as zeros).
    pub fn cluster_data(&self, off: u64, buf: &mut [u8]) {
        fill(buf, self.seed ^ (off >> CLUSTER_BITS).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
}

fn clusters(bytes: u64) -> u64 {
    bytes.div_ceil(CLUSTER)
}

/// Writes the image to `path` (created or truncated).
pub fn write(spec: &Spec, path: &Path) -> anyhow::Result<Written> {
    let extents = spec.extents()?;
    let l1_size = spec.virtual_size.div_ceil(CLUSTER * L2_ENTRIES);
    let l1_clusters = clusters(l1_size * 8);
    // L1 indices that need an L2 table, in order.
    let mut l2_for: Vec<u64> = extents.iter().map(|e| e / (CLUSTER * L2_ENTRIES)).collect();
    l2_for.dedup();
    let data_clusters = extents.len() as u64 * (EXTENT / CLUSTER);
    let fixed = 1 + l1_clusters + l2_for.len() as u64 + data_clusters;
    let (mut rt, mut rb) = (1u64, 1u64);
    loop {
        let total = fixed + rt + rb;
        let rb2 = total.div_ceil(RC_ENTRIES);
        let rt2 = clusters(rb2 * 8);
        if (rb2, rt2) == (rb, rt) {
            break;
        }
        (rb, rt) = (rb2, rt2);
    }
    let total = fixed + rt + rb;
    let rt_off = CLUSTER;
    let rb_off = rt_off + rt * CLUSTER;
    let l1_off = rb_off + rb * CLUSTER;
    let l2_off = l1_off + l1_clusters * CLUSTER;
    let data_off = l2_off + l2_for.len() as u64 * CLUSTER;

    let f = std::fs::File::create(path).with_context(|| path.display().to_string())?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    let mut cl = vec![0u8; CLUSTER as usize];

    // Header (big-endian fields; the rest of the cluster is zero, which also
    // ends the header extension list).
    let mut h = Vec::with_capacity(104);
    h.extend_from_slice(b"QFI\xfb");
    h.extend_from_slice(&3u32.to_be_bytes()); // version
    h.extend_from_slice(&0u64.to_be_bytes()); // backing file offset
    h.extend_from_slice(&0u32.to_be_bytes()); // backing file size
    h.extend_from_slice(&CLUSTER_BITS.to_be_bytes());
    h.extend_from_slice(&spec.virtual_size.to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // no encryption
    h.extend_from_slice(&(l1_size as u32).to_be_bytes());
    h.extend_from_slice(&l1_off.to_be_bytes());
    h.extend_from_slice(&rt_off.to_be_bytes());
    h.extend_from_slice(&(rt as u32).to_be_bytes());
    h.extend_from_slice(&0u32.to_be_bytes()); // snapshots
    h.extend_from_slice(&0u64.to_be_bytes()); // snapshot table offset
    h.extend_from_slice(&0u64.to_be_bytes()); // incompatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // compatible features
    h.extend_from_slice(&0u64.to_be_bytes()); // autoclear features
    h.extend_from_slice(&4u32.to_be_bytes()); // refcount order: 16 bits
    h.extend_from_slice(&104u32.to_be_bytes()); // header length
    cl.fill(0);
    cl[..h.len()].copy_from_slice(&h);
    w.write_all(&cl)?;

    // Refcount table, then blocks: every cluster of the file is used once.
    let mut table = vec![0u8; (rt * CLUSTER) as usize];
    for i in 0..rb {
        table[(i * 8) as usize..][..8].copy_from_slice(&(rb_off + i * CLUSTER).to_be_bytes());
    }
    w.write_all(&table)?;
    for b in 0..rb {
        cl.fill(0);
        for e in 0..RC_ENTRIES {
            if b * RC_ENTRIES + e < total {
                cl[(e * 2) as usize..][..2].copy_from_slice(&1u16.to_be_bytes());
            }
        }
        w.write_all(&cl)?;
    }

    // L1.
    let mut l1 = vec![0u8; (l1_clusters * CLUSTER) as usize];
    for (k, idx) in l2_for.iter().enumerate() {
        let off = (l2_off + k as u64 * CLUSTER) | COPIED;
        l1[(idx * 8) as usize..][..8].copy_from_slice(&off.to_be_bytes());
    }
    w.write_all(&l1)?;

    // L2 tables: data clusters are laid out in guest order.
    let per_extent = EXTENT / CLUSTER;
    for idx in &l2_for {
        cl.fill(0);
        for (n, e) in extents.iter().enumerate() {
            if e / (CLUSTER * L2_ENTRIES) != *idx {
                continue;
            }
            for c in 0..per_extent {
                let guest = e + c * CLUSTER;
                let host = data_off + (n as u64 * per_extent + c) * CLUSTER;
                let slot = (guest / CLUSTER) % L2_ENTRIES;
                cl[(slot * 8) as usize..][..8].copy_from_slice(&(host | COPIED).to_be_bytes());
            }
        }
        w.write_all(&cl)?;
    }

    // Data.
    for e in &extents {
        for c in 0..per_extent {
            spec.cluster_data(e + c * CLUSTER, &mut cl);
            w.write_all(&cl)?;
        }
    }
    w.flush()?;
    let file_size = total * CLUSTER;
    debug_assert_eq!(w.get_ref().metadata().map(|m| m.len()).unwrap_or(file_size), file_size);
    Ok(Written { file_size, data_bytes: data_clusters * CLUSTER, extents })
}

/// Reads back the guest-to-file mapping of an image this module wrote:
/// `(guest offset, file offset)` of every allocated cluster. A small
/// independent walk of the tables, used by the tests.
pub fn mapping(file: &[u8]) -> anyhow::Result<Vec<(u64, u64)>> {
    let be64 = |o: u64| -> anyhow::Result<u64> {
        let s = file.get(o as usize..o as usize + 8).context("table past the end of the file")?;
        Ok(u64::from_be_bytes(s.try_into()?))
    };
    let be32 = |o: usize| -> anyhow::Result<u32> {
        Ok(u32::from_be_bytes(file.get(o..o + 4).context("short header")?.try_into()?))
    };
    if file.get(..4) != Some(b"QFI\xfb") {
        bail!("not qcow2");
    }
    let bits = be32(20)?;
    if bits != CLUSTER_BITS {
        bail!("cluster_bits {bits}");
    }
    let l1_size = u64::from(be32(36)?);
    let l1_off = be64(40)?;
    let mask = (1u64 << 56) - 1 - (CLUSTER - 1);
    let mut out = Vec::new();
    for i in 0..l1_size {
        let l2 = be64(l1_off + i * 8)? & mask;
        if l2 == 0 {
            continue;
        }
        for j in 0..L2_ENTRIES {
            let host = be64(l2 + j * 8)? & mask;
            if host != 0 {
                out.push(((i * L2_ENTRIES + j) * CLUSTER, host));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_spread_over_the_disk_and_refuse_bad_sizes() {
        let s = Spec { virtual_size: 1 << 30, data_bytes: 4 << 20, seed: 1 };
        assert_eq!(s.extents().unwrap(), vec![0, 256 << 20, 512 << 20, 768 << 20]);
        assert!(Spec { virtual_size: 1000, ..s }.extents().is_err());
        assert!(Spec { virtual_size: 2 << 20, data_bytes: 4 << 20, seed: 1 }.extents().is_err());
    }

    #[test]
    fn the_tables_map_every_extent_to_its_data() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.qcow2");
        // 5 GiB: more than one L1 entry, L2 tables for some of them only.
        let s = Spec { virtual_size: 5 << 30, data_bytes: 3 << 20, seed: 7 };
        let w = write(&s, &p).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(bytes.len() as u64, w.file_size);
        let map = mapping(&bytes).unwrap();
        assert_eq!(map.len() as u64, w.data_bytes / CLUSTER);
        let mut want = vec![0u8; CLUSTER as usize];
        for (guest, host) in &map {
            assert!(w.extents.iter().any(|e| (e..&(e + EXTENT)).contains(&guest)), "{guest} is not in an extent");
            s.cluster_data(*guest, &mut want);
            assert_eq!(&bytes[*host as usize..][..CLUSTER as usize], &want[..], "cluster at guest {guest}");
        }
    }
}
