//! `storage-benchmarks.md`: the report in the seed's shape, with the charts
//! embedded. Figures are medians; the ± is the standard deviation over the
//! iterations.

use super::{Block, Objects, Report, Section, VmImage};
use crate::stats::Summary;
use std::fmt::Write;

fn fig(s: &Summary, unit: &str, prec: usize) -> String {
    if s.n > 1 {
        format!("{:.prec$} {unit} ± {:.prec$}", s.median, s.stddev)
    } else {
        format!("{:.prec$} {unit}", s.median)
    }
}

fn na<T>(s: &Section<T>) -> String {
    match s {
        Section::NotAvailable { reason } => format!("_Not available: {reason}._\n\n"),
        Section::Measured(_) => String::new(),
    }
}

fn block_row(
    out: &mut String,
    name: &str,
    l: Option<&Block>,
    c: Option<&Block>,
    f: fn(&Block) -> (&Summary, &str, usize),
) {
    let cell = |b: Option<&Block>| {
        b.map_or("n/a".to_owned(), |b| {
            let (s, u, p) = f(b);
            fig(s, u, p)
        })
    };
    let _ = writeln!(out, "| {name} | {} | {} |", cell(l), cell(c));
}

fn objects_table(out: &mut String, o: &Objects, prefix: &str) {
    let _ = writeln!(out, "| Metric | Result |\n|---|---:|");
    let _ = writeln!(out, "| {prefix}upload throughput | {} |", fig(&o.upload_mib_s, "MiB/s", 2));
    let _ = writeln!(out, "| {prefix}download throughput | {} |", fig(&o.download_mib_s, "MiB/s", 2));
    if o.count > 1 {
        let _ = writeln!(out, "| {prefix}PUT rate | {} |", fig(&o.put_per_s, "objects/s", 2));
        let _ = writeln!(out, "| {prefix}GET rate | {} |", fig(&o.get_per_s, "objects/s", 2));
    }
    out.push('\n');
}

/// Why CoronaFS reads can beat the local disk in this report.
pub const PAGE_CACHE_NOTE: &str = "Reads are not like for like: the local-disk baseline uses `O_DIRECT`, so every read goes to the device, while CoronaFS serves reads of recently written data from the server's page cache. A CoronaFS read figure above the local disk's measures the network and NBD path plus memory, not a faster disk.";

fn vm_section(s: &mut String, v: &VmImage) {
    let _ = writeln!(
        s,
        "Measured through PlasmaVMC's REST API only (`POST /v1/images`, `PUT /v1/images/{{id}}/file`, `POST /v1/volumes` polled to `available`): PlasmaVMC -> LightningStor artifact -> CoronaFS-backed volume. Link: {}.\n",
        v.link_placement
    );
    let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
    let _ =
        writeln!(s, "| Guest image artifact size ({}) | {:.1} MiB |", v.format, v.artifact_bytes as f64 / 1048576.0);
    let _ = writeln!(s, "| Guest image virtual size | {} MiB |", v.virtual_size >> 20);
    let _ = writeln!(s, "| Allocated guest data | {} MiB |", v.data_bytes >> 20);
    let _ = writeln!(s, "| `CreateImage` latency | {} |", fig(&v.create_image_s, "s", 2));
    let _ = writeln!(s, "| `CreateImage` throughput | {} |", fig(&v.create_image_mib_s, "MiB/s", 2));
    let _ =
        writeln!(s, "| First image-backed `CreateVolume` latency (cold) | {} |", fig(&v.first_create_volume_s, "s", 2));
    let _ = writeln!(
        s,
        "| Second image-backed `CreateVolume` latency (warm) | {} |\n",
        fig(&v.second_create_volume_s, "s", 3)
    );
    let _ = writeln!(s, "Warm `CreateVolume` (an O(1) clone of the cached base) by virtual size:\n");
    let _ = writeln!(s, "| Virtual size | Artifact | Calls | p50 | p90 | max |\n|---:|---:|---:|---:|---:|---:|");
    for w in &v.warm {
        let _ = writeln!(
            s,
            "| {} GiB | {:.1} MiB | {} | {:.1} ms | {:.1} ms | {:.1} ms |",
            w.virtual_size >> 30,
            w.artifact_bytes as f64 / 1048576.0,
            w.n,
            w.p50_ms,
            w.p90_ms,
            w.max_ms
        );
    }
    let _ = writeln!(
        s,
        "\nVolumes read back over NBD and compared with the image: {}.\n",
        if v.verified { "yes" } else { "no (no CoronaFS endpoint to read from)" }
    );
    if !v.targets.is_empty() {
        let _ = writeln!(s, "Targets (issue 6); ratio = how far past the target, >= 1 is met:\n");
        let _ = writeln!(s, "| Figure | Target | Ratio | Met |\n|---|---|---:|---|");
        for t in &v.targets {
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} | {} |",
                t.what,
                t.target,
                t.ratio,
                if t.met { "yes" } else { "**no**" }
            );
        }
        s.push('\n');
    }
}

/// The whole report. `charts` are (file name, alt text) of SVGs written beside it.
pub fn render(r: &Report, charts: &[(String, String)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Storage Benchmarks\n");
    let _ = writeln!(s, "Generated at unix time {} with:\n\n```bash\n{}\n```\n", r.generated_unix, r.command);
    let _ = writeln!(
        s,
        "Cluster: {} ({}). {} iteration(s) per figure, interleaved; medians, ± is the standard deviation.{}\n",
        r.cluster,
        r.link,
        r.iterations,
        if r.quick { " Quick run: small sizes, short runs." } else { "" }
    );
    for (file, alt) in charts {
        let _ = writeln!(s, "![{alt}]({file})\n");
    }

    let _ = writeln!(s, "## CoronaFS\n");
    let _ = writeln!(
        s,
        "Cluster network baseline, measured from the bench client to the services' side of the link before the storage tests:\n"
    );
    s.push_str(&na(&r.network));
    if let Some(n) = r.network.get() {
        let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
        let _ = writeln!(s, "| TCP throughput | {} |", fig(&n.tcp_mib_s, "MiB/s", 2));
        let _ = writeln!(s, "| TCP retransmits | {} |\n", fig(&n.tcp_retransmits, "", 0));
        let _ = writeln!(s, "Method: {}.\n", n.method);
    }
    let (l, c) = (r.local_disk.get(), r.coronafs.get());
    let size = l.or(c).map_or(0, |b| b.size_bytes >> 20);
    let _ = writeln!(
        s,
        "Local disk (a file in the bench's temporary directory, `O_DIRECT`) is the baseline. CoronaFS is the shared block volume path, measured over NBD with the bench's own load generator (profile `seed-000`, {size} MiB volume).\n"
    );
    s.push_str(&na(&r.coronafs));
    let _ = writeln!(s, "| Metric | Local Disk | CoronaFS |\n|---|---:|---:|");
    block_row(&mut s, "Sequential write", l, c, |b| (&b.seq_write_mib_s, "MiB/s", 2));
    block_row(&mut s, "Sequential read", l, c, |b| (&b.seq_read_mib_s, "MiB/s", 2));
    block_row(&mut s, "4k random read", l, c, |b| (&b.rand_read_4k_iops, "IOPS", 0));
    let _ = writeln!(s, "\nQueue-depth profile (`iodepth=32`, 1 MiB) from the same client:\n");
    let _ = writeln!(s, "| Metric | Local Disk | CoronaFS |\n|---|---:|---:|");
    block_row(&mut s, "Depth-32 write", l, c, |b| (&b.depth32_write_mib_s, "MiB/s", 2));
    block_row(&mut s, "Depth-32 read", l, c, |b| (&b.depth32_read_mib_s, "MiB/s", 2));
    if l.is_some() && c.is_some() {
        let _ = writeln!(s, "\n{PAGE_CACHE_NOTE}");
    }
    let _ = writeln!(
        s,
        "\nCross-worker shared-volume visibility: worker A writes and flushes on one NBD connection, worker B reads the same bytes back on another and checks them:\n"
    );
    s.push_str(&na(&r.cross_worker));
    if let Some(x) = r.cross_worker.get() {
        let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
        let _ = writeln!(
            s,
            "| Cross-worker sequential read ({} MiB, verified) | {} |\n",
            x.size_bytes >> 20,
            fig(&x.read_mib_s, "MiB/s", 2)
        );
    }

    let _ = writeln!(s, "## LightningStor\n");
    let nodes = r.s3_large_object.get().map_or(0, |o| o.nodes);
    if nodes > 0 {
        let _ = writeln!(
            s,
            "Measured with aws-sdk-s3 against {nodes} LightningStor node(s){}.\n",
            if r.cluster == "embedded" && nodes > 1 {
                " (a cluster keeping every object on every node, write quorum 2; clients spread over the nodes)"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(s, "### Large-object path\n");
    s.push_str(&na(&r.s3_large_object));
    if let Some(o) = r.s3_large_object.get() {
        let _ = writeln!(s, "| Metric | Result |\n|---|---:|\n| Object size | {} MiB |", o.object_bytes >> 20);
        s.push_str(&objects_table_body(o));
    }
    let _ = writeln!(s, "### Small-object batch\n");
    s.push_str(&na(&r.s3_small_batch));
    if let Some(o) = r.s3_small_batch.get() {
        let _ = writeln!(
            s,
            "Measured as {} objects of {} KiB each ({} MiB total), one client.\n",
            o.count,
            o.object_bytes >> 10,
            (o.count * o.object_bytes) >> 20
        );
        objects_table(&mut s, o, "Batch ");
    }
    let _ = writeln!(s, "### Parallel small-object batch\n");
    s.push_str(&na(&r.s3_parallel_batch));
    if let Some(o) = r.s3_parallel_batch.get() {
        let _ = writeln!(
            s,
            "Measured as the same {} objects of {} KiB each, with {} concurrent client jobs.\n",
            o.count,
            o.object_bytes >> 10,
            o.jobs
        );
        objects_table(&mut s, o, "Parallel batch ");
    }

    let _ = writeln!(s, "## VM Image Path\n");
    s.push_str(&na(&r.vm_image));
    if let Some(v) = r.vm_image.get() {
        vm_section(&mut s, v);
    }

    if let Some(p) = r.nbd_peers.get() {
        s.push_str(&crate::nbd_compare::markdown(p).replacen("## ", "## Reference peers: ", 1));
        s.push('\n');
    } else {
        let _ = writeln!(s, "## Reference peers\n");
        s.push_str(&na(&r.nbd_peers));
    }

    let _ = writeln!(s, "## Assessment\n");
    if r.assessment.is_empty() {
        let _ = writeln!(s, "No ratio could be computed: the sections they need were not measured.");
    }
    for a in &r.assessment {
        let _ = writeln!(s, "- {}", a.text);
    }
    if let Some(b) = r.s3_small_batch.get() {
        let _ = writeln!(
            s,
            "- The small-object batch reaches {:.2} PUT/s and {:.2} GET/s from one client.",
            b.put_per_s.median, b.get_per_s.median
        );
    }
    if let Some(b) = r.s3_parallel_batch.get() {
        let _ = writeln!(
            s,
            "- With {} parallel jobs it reaches {:.2} PUT/s and {:.2} GET/s.",
            b.jobs, b.put_per_s.median, b.get_per_s.median
        );
    }
    if r.local_disk.get().is_some() && r.coronafs.get().is_some() {
        let _ = writeln!(s, "- {PAGE_CACHE_NOTE}");
    }
    if let Some(v) = r.vm_image.get() {
        let _ = writeln!(
            s,
            "- The VM image path is measured directly: the cold `CreateVolume` includes the artifact fetch from LightningStor and the qcow2 conversion into CoronaFS; the warm one is a clone of the cached base, so it does not grow with the virtual size."
        );
        if !v.targets.iter().any(|t| t.key == "create_image_vs_link") {
            let _ = writeln!(
                s,
                "- No link rate was emulated, so the CreateImage and cold CreateVolume targets (relative to the link rate) are not evaluated; run with `--link-rate 20MiB`."
            );
        }
    }
    if r.iterations < 2 {
        let _ = writeln!(s, "- One iteration only: no spread is known, so small differences mean nothing.");
    }
    s
}

fn objects_table_body(o: &Objects) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "| Upload throughput | {} |", fig(&o.upload_mib_s, "MiB/s", 2));
    let _ = writeln!(t, "| Download throughput | {} |\n", fig(&o.download_mib_s, "MiB/s", 2));
    t
}
