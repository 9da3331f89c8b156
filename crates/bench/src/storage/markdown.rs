//! `storage-benchmarks.md`: the report in the seed's shape, with the charts
//! embedded. Figures are medians with `[min..max, n=N]` over the
//! iterations; with one iteration the spread is `n/a`.

use super::{Block, Network, Objects, Report, Section, VmImage};
use crate::stats::Summary;
use std::fmt::Write;

fn fig(s: &Summary, unit: &str, prec: usize) -> String {
    let unit = if unit.is_empty() { String::new() } else { format!(" {unit}") };
    if s.n > 1 {
        format!("{:.prec$}{unit} [{:.prec$}..{:.prec$}, n={}]", s.median, s.min, s.max, s.n)
    } else {
        format!("{:.prec$}{unit} [spread n/a, n={}]", s.median, s.n)
    }
}

fn na<T>(s: &Section<T>) -> String {
    match s {
        Section::NotAvailable { reason } => format!("_Not available: {reason}._\n\n"),
        Section::Measured(_) => String::new(),
    }
}

fn block_row(out: &mut String, name: &str, cols: &[Option<&Block>], f: fn(&Block) -> (&Summary, &str, usize)) {
    let cell = |b: &Option<&Block>| {
        b.map_or("n/a".to_owned(), |b| {
            let (s, u, p) = f(b);
            fig(s, u, p)
        })
    };
    let cells: Vec<String> = cols.iter().map(cell).collect();
    let _ = writeln!(out, "| {name} | {} |", cells.join(" | "));
}

fn latency_table(out: &mut String, cols: &[(&str, Option<&Block>)]) {
    let _ =
        writeln!(out, "Completion latency, p50 / p99 over every operation of every iteration (histograms merged):\n");
    let _ = writeln!(
        out,
        "| Job | {} |\n|---|{}",
        cols.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" | "),
        "---:|".repeat(cols.len())
    );
    let mut rows: Vec<(String, String)> = Vec::new();
    for (_, b) in cols {
        for l in b.map_or(&[][..], |b| &b.latency[..]) {
            let k = (l.job.clone(), l.side.clone());
            if !rows.contains(&k) {
                rows.push(k);
            }
        }
    }
    for (job, side) in rows {
        let cells: Vec<String> = cols
            .iter()
            .map(|(_, b)| {
                b.and_then(|b| b.latency.iter().find(|l| l.job == job && l.side == side))
                    .map_or("n/a".into(), |l| format!("{:.0} / {:.0} µs", l.p50_us, l.p99_us))
            })
            .collect();
        let _ = writeln!(out, "| {job} ({side}) | {} |", cells.join(" | "));
    }
    out.push('\n');
}

/// The seed-000 figures: key in [`super::replicated::CopyRatio`], name, unit, precision.
const JOB_NAMES: [(&str, &str, &str, usize); 5] = [
    ("seq_write_mib_s", "Sequential write", "MiB/s", 2),
    ("seq_read_mib_s", "Sequential read", "MiB/s", 2),
    ("rand_read_4k_iops", "4k random read", "IOPS", 0),
    ("depth32_write_mib_s", "Depth-32 write", "MiB/s", 2),
    ("depth32_read_mib_s", "Depth-32 read", "MiB/s", 2),
];

/// The "CoronaFS, N copies" row: each job beside the single-copy CoronaFS
/// figure, with their ratio.
fn replicated_table(s: &mut String, r: &Report) {
    let title = r.coronafs_replicated.get().map_or("several copies".to_owned(), |x| format!("{} copies", x.copies));
    let _ = writeln!(s, "Replicated volume (CoronaFS, {title}):\n");
    s.push_str(&na(&r.coronafs_replicated));
    let (Some(x), Some(c)) = (r.coronafs_replicated.get(), r.coronafs.get()) else {
        return;
    };
    let _ = writeln!(
        s,
        "The same jobs from the same worker, in every iteration right after the single-copy row, on a volume made with `--replicas {}` (write quorum {}): the NBD client talks to the primary, which forwards every write to the other copies and acknowledges a FLUSH once the write quorum has it. Measured by {}. **Conditions:** {}. So this row measures the CPU and protocol cost of the replication path, not replication across a network. The ratio is the median over iterations of each iteration's figure with {} copies over its single-copy figure.\n",
        x.copies, x.write_quorum, x.block.measured_by, x.placement, x.copies
    );
    let _ = writeln!(
        s,
        "| Metric | CoronaFS | CoronaFS, {} copies | {} copies / 1 copy |\n|---|---:|---:|---:|",
        x.copies, x.copies
    );
    let cols = [Some(c), Some(&x.block)];
    let getters: [fn(&Block) -> &Summary; 5] = [
        |b| &b.seq_write_mib_s,
        |b| &b.seq_read_mib_s,
        |b| &b.rand_read_4k_iops,
        |b| &b.depth32_write_mib_s,
        |b| &b.depth32_read_mib_s,
    ];
    for ((key, name, unit, prec), get) in JOB_NAMES.iter().zip(getters) {
        let cells: Vec<String> = cols.iter().map(|b| b.map_or("n/a".into(), |b| fig(get(b), unit, *prec))).collect();
        let ratio = x.ratios.iter().find(|r| r.figure == *key).map_or("n/a".into(), |r| format!("{:.2}", r.ratio));
        let _ = writeln!(s, "| {name} | {} | {ratio} |", cells.join(" | "));
    }
    s.push('\n');
}

fn network_table(s: &mut String, n: &Network) {
    let _ = writeln!(s, "Measured from agent `{}` to agent `{}`:\n", n.from, n.to);
    let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
    let _ = writeln!(s, "| TCP throughput (bench probe) | {} |", fig(&n.tcp_mib_s, "MiB/s", 2));
    let _ = writeln!(s, "| TCP retransmits (bench probe) | {} |", fig(&n.tcp_retransmits, "", 0));
    if let (Some(i), Some(r)) = (&n.iperf3_mib_s, &n.iperf3_retransmits) {
        let _ = writeln!(s, "| TCP throughput (iperf3) | {} |", fig(i, "MiB/s", 2));
        let _ = writeln!(s, "| TCP retransmits (iperf3) | {} |", fig(r, "", 0));
    }
    if let Some(x) = n.probe_vs_iperf3 {
        let _ = writeln!(s, "| Probe / iperf3 | {x:.3} |");
    }
    let _ = writeln!(s, "\nMethod: {}.\n", n.method);
}

fn conditions(s: &mut String, r: &Report) {
    let c = &r.conditions;
    let _ = writeln!(s, "## Conditions\n");
    let _ = writeln!(s, "| Condition | Value |\n|---|---|");
    let _ = writeln!(s, "| Started / finished | {} / {} |", c.started_at, r.generated_at);
    let _ = writeln!(s, "| Bench commit | `{}` |", c.commit);
    let h = &c.coordinator;
    let _ = writeln!(
        s,
        "| Coordinator | {} — {}, {} × {}, {:.1} GiB; scratch {} on {} ({}) |",
        h.hostname,
        h.kernel,
        h.cpus,
        h.cpu_model,
        h.memory_bytes as f64 / (1u64 << 30) as f64,
        c.coordinator_scratch.path,
        c.coordinator_scratch.device,
        c.coordinator_scratch.fs_type
    );
    let _ = writeln!(s, "| Link | {} |", c.link);
    let _ = writeln!(s, "| Agents | {} |", c.agents_origin);
    match &c.coronafs {
        Some(v) if v.get("error").is_none() => {
            let get =
                |k: &str| v.pointer(k).map_or("?".to_owned(), |x| x.as_str().map_or(x.to_string(), str::to_owned));
            let _ = writeln!(
                s,
                "| CoronaFS | engine {}, data dir {} on {} ({}), O_DIRECT {} |",
                get("/engine"),
                get("/data_dir"),
                get("/fs/device"),
                get("/fs/fs_type"),
                get("/o_direct")
            );
        }
        Some(v) => {
            let _ = writeln!(s, "| CoronaFS | unknown: {} |", v["error"].as_str().unwrap_or("?"));
        }
        None => {}
    }
    match &c.lightningstor {
        Some(Ok(l)) => {
            let _ = writeln!(
                s,
                "| LightningStor | {}, replication factor {}, read quorum {}, write quorum {}, {} (read from the running cluster) |",
                crate::text::count(l.nodes.len(), "node"),
                l.replication_factor,
                l.read_quorum,
                l.write_quorum,
                l.consistency
            );
            for n in &l.nodes {
                let st = match (&n.status, &n.down) {
                    (Some(v), _) => {
                        let fs = v.get("data_dir_fs").or_else(|| v.get("fs"));
                        let fs = fs.map_or("file system not reported".to_owned(), |f| {
                            format!(
                                "data on {} ({})",
                                f.get("device").and_then(|x| x.as_str()).unwrap_or("?"),
                                f.get("fs_type").and_then(|x| x.as_str()).unwrap_or("?")
                            )
                        });
                        let od =
                            v.get("o_direct").map_or("O_DIRECT not reported".to_owned(), |x| format!("O_DIRECT {x}"));
                        format!("up, {fs}, {od}")
                    }
                    (None, Some(why)) => format!("DOWN at the start: {why}"),
                    _ => "?".into(),
                };
                let _ = writeln!(s, "| LightningStor {} ({}) | {st} |", n.name, n.s3);
            }
        }
        Some(Err(why)) => {
            let _ = writeln!(s, "| LightningStor | replication and quorums unknown: {why} |");
        }
        None => {}
    }
    if let Some(d) = &c.fault_driver {
        let _ = writeln!(s, "| Faults applied by | {d} |");
    }
    let _ = writeln!(s, "| Reference peers | {} |", c.peers);
    let _ =
        writeln!(s, "\n| Agent | Roles | Host | Kernel | CPU | Scratch (local disk) | O_DIRECT | iperf3 | Commit |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for a in &c.agents {
        match &a.info {
            Some(i) => {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} ({}) | {} | {} × {} | {} on {} ({}) | {} | {} | `{}` |",
                    a.name,
                    if a.roles.is_empty() { "-" } else { &a.roles },
                    i.host.hostname,
                    a.addr,
                    i.host.kernel,
                    i.host.cpus,
                    i.host.cpu_model,
                    i.scratch.path,
                    i.scratch.device,
                    i.scratch.fs_type,
                    if i.o_direct { "yes" } else { "refused" },
                    i.iperf3.as_deref().unwrap_or("not installed"),
                    i.commit
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | did not answer: {} | | | | | |",
                    a.name,
                    a.roles,
                    a.addr,
                    a.error.as_deref().unwrap_or("?")
                );
            }
        }
    }
    s.push('\n');
    if !r.events.is_empty() {
        let _ = writeln!(s, "Events during the run:\n");
        for e in &r.events {
            let _ = writeln!(s, "- {e}");
        }
        s.push('\n');
    }
}

fn degraded(s: &mut String, d: &super::degraded::Degraded) {
    let _ = writeln!(
        s,
        "A steady load from agent `{}` ({}, each PUTting a new {} KiB object and GETting an acknowledged one, checked) for {:.0} s. Fault `{}`, applied by: {}.\n",
        d.measured_by,
        crate::text::count(d.jobs, "client"),
        d.object_bytes >> 10,
        d.duration_s,
        d.fault,
        d.driver
    );
    if d.already_down {
        let _ = writeln!(
            s,
            "The target was already down when the run started: the fault was not applied and the whole load ran degraded.\n"
        );
    }
    let _ =
        writeln!(s, "| Phase | Window | Ops/s | MiB/s | Failed requests | Failovers |\n|---|---|---:|---:|---:|---:|");
    let row = |s: &mut String, name: &str, p: &super::degraded::Phase| {
        let _ = writeln!(
            s,
            "| {name} | {:.1}..{:.1} s | {:.1} | {:.2} | {} | {} |",
            p.from_s, p.to_s, p.ops_per_s, p.mib_s, p.errors, p.failovers
        );
    };
    if let Some(b) = &d.before {
        row(s, "before", b);
    }
    row(s, if d.already_down { "degraded (whole load)" } else { "during" }, &d.during);
    if let Some(a) = &d.after {
        row(s, "after", a);
    }
    let _ = writeln!(
        s,
        "\nPUT p50/p99 {:.1} / {:.1} ms, GET p50/p99 {:.1} / {:.1} ms over the whole load. Acknowledged objects: {}; read back intact at the end: {}{}.\n",
        d.put_p50_ms,
        d.put_p99_ms,
        d.get_p50_ms,
        d.get_p99_ms,
        d.acked,
        d.verified,
        if d.lost.is_empty() { String::new() } else { format!("; **lost: {}**", d.lost.join("; ")) }
    );
    match d.time_to_full_redundancy_s {
        Some(t) => {
            let _ = writeln!(s, "Back at full redundancy {t:.1} s after the heal ({}).\n", d.redundancy);
        }
        None => {
            let _ = writeln!(s, "Time back to full redundancy: {}.\n", d.redundancy);
        }
    }
    for e in &d.driver_errors {
        let _ = writeln!(s, "- fault driver: {e}");
    }
    for e in &d.events {
        let _ = writeln!(s, "- at {:.1} s: {}", e.t_s, e.what);
    }
    s.push('\n');
}

fn objects_table(out: &mut String, o: &Objects, prefix: &str) {
    let _ = writeln!(out, "| Metric | Result |\n|---|---:|");
    let _ = writeln!(out, "| {prefix}upload throughput | {} |", fig(&o.upload_mib_s, "MiB/s", 2));
    let _ = writeln!(out, "| {prefix}download throughput | {} |", fig(&o.download_mib_s, "MiB/s", 2));
    if o.count > 1 {
        let _ = writeln!(out, "| {prefix}PUT rate | {} |", fig(&o.put_per_s, "objects/s", 2));
        let _ = writeln!(out, "| {prefix}GET rate | {} |", fig(&o.get_per_s, "objects/s", 2));
    }
    let _ = writeln!(out, "| PUT latency p50 / p99 | {:.1} / {:.1} ms |", o.put_p50_ms, o.put_p99_ms);
    let _ = writeln!(out, "| GET latency p50 / p99 | {:.1} / {:.1} ms |", o.get_p50_ms, o.get_p99_ms);
    out.push('\n');
}

/// Why CoronaFS reads can beat the local disk in this report.
pub const PAGE_CACHE_NOTE: &str = "Compare like with like: the `O_DIRECT` column reads the device, while CoronaFS serves reads of recently written data from its server's page cache, so CoronaFS's reads compare with the buffered column. A CoronaFS read figure above the `O_DIRECT` one measures the network and NBD path plus memory, not a faster disk.";

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
    let _ = writeln!(s, "Generated at {} with:\n\n```bash\n{}\n```\n", r.generated_at, r.command);
    let _ = writeln!(
        s,
        "Cluster: {}. {} per figure, interleaved; figures are medians with [min..max, n] over the iterations.{}\n",
        r.cluster,
        crate::text::count(r.iterations, "iteration"),
        if r.quick { " Quick run: small sizes, short runs." } else { "" }
    );
    for (file, alt) in charts {
        let _ = writeln!(s, "![{alt}]({file})\n");
    }

    conditions(&mut s, r);

    let _ = writeln!(s, "## CoronaFS\n");
    let _ = writeln!(s, "Cluster network baseline to CoronaFS's node, before the storage tests:\n");
    s.push_str(&na(&r.network));
    if let Some(n) = r.network.get() {
        network_table(&mut s, n);
    }
    let (l, lb, c) = (r.local_disk.get(), r.local_disk_buffered.get(), r.coronafs.get());
    let size = l.or(c).map_or(0, |b| b.size_bytes >> 20);
    let _ = writeln!(
        s,
        "Local worker disk is the baseline: {}, with `O_DIRECT`{} and through the page cache. CoronaFS is the shared block volume path: {}, with the bench's own load generator (profile `seed-000`, {size} MiB).\n",
        l.map_or("not measured".to_owned(), |b| b.measured_by.clone()),
        match l.and_then(|b| b.o_direct) {
            Some(false) => " asked but **refused by the file system, so that column ran buffered too**",
            _ => "",
        },
        c.map_or("not measured".to_owned(), |b| b.measured_by.clone())
    );
    s.push_str(&na(&r.coronafs));
    let _ = writeln!(s, "| Metric | Local Disk (O_DIRECT) | Local Disk (buffered) | CoronaFS |\n|---|---:|---:|---:|");
    let cols = [l, lb, c];
    block_row(&mut s, "Sequential write", &cols, |b| (&b.seq_write_mib_s, "MiB/s", 2));
    block_row(&mut s, "Sequential read", &cols, |b| (&b.seq_read_mib_s, "MiB/s", 2));
    block_row(&mut s, "4k random read", &cols, |b| (&b.rand_read_4k_iops, "IOPS", 0));
    let _ = writeln!(s, "\nQueue-depth profile (`iodepth=32`, 1 MiB) from the same worker:\n");
    let _ = writeln!(s, "| Metric | Local Disk (O_DIRECT) | Local Disk (buffered) | CoronaFS |\n|---|---:|---:|---:|");
    block_row(&mut s, "Depth-32 write", &cols, |b| (&b.depth32_write_mib_s, "MiB/s", 2));
    block_row(&mut s, "Depth-32 read", &cols, |b| (&b.depth32_read_mib_s, "MiB/s", 2));
    s.push('\n');
    replicated_table(&mut s, r);
    let rep = r.coronafs_replicated.get();
    if l.is_some() || c.is_some() {
        let copies = rep.map_or("CoronaFS, copies".to_owned(), |x| format!("CoronaFS, {} copies", x.copies));
        latency_table(
            &mut s,
            &[("Local (O_DIRECT)", l), ("Local (buffered)", lb), ("CoronaFS", c), (&copies, rep.map(|x| &x.block))],
        );
    }
    if l.is_some() && c.is_some() {
        let _ = writeln!(s, "{PAGE_CACHE_NOTE}");
    }
    s.push('\n');
    super::failover::markdown(&mut s, &r.coronafs_failover);
    let _ = writeln!(s, "\nCross-worker shared-volume visibility:\n");
    s.push_str(&na(&r.cross_worker));
    if let Some(x) = r.cross_worker.get() {
        let evicted: Vec<String> = x
            .eviction
            .iter()
            .map(|e| match e {
                Ok(v) => format!(
                    "{} of {} bytes of the volume's files were in the server's page cache before, {} after",
                    v["resident_before"], v["bytes"], v["resident_after"]
                ),
                Err(why) => format!("not evicted ({why}), so the read may come from the server's page cache"),
            })
            .collect();
        let _ = writeln!(
            s,
            "Agent `{}` writes {} MiB and flushes; the CoronaFS server drops the volume's files from its page cache (POSIX_FADV_DONTNEED); agent `{}`, on another node, reads them back and checks every byte. Eviction: {}.\n",
            x.writer,
            x.size_bytes >> 20,
            x.reader,
            evicted.join("; ")
        );
        let _ = writeln!(s, "| Metric | Result |\n|---|---:|");
        let _ = writeln!(s, "| Cross-worker write + flush ({}) | {} |", x.writer, fig(&x.write_mib_s, "MiB/s", 2));
        let _ = writeln!(
            s,
            "| Cross-worker sequential read ({}, {} MiB, verified) | {} |\n",
            x.reader,
            x.size_bytes >> 20,
            fig(&x.read_mib_s, "MiB/s", 2)
        );
    }

    let _ = writeln!(s, "## LightningStor\n");
    if let Some(o) = r.s3_large_object.get() {
        let repl = match &r.conditions.lightningstor {
            Some(Ok(l)) => format!(
                ", replication factor {}, write quorum {}, read quorum {}",
                l.replication_factor, l.write_quorum, l.read_quorum
            ),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "Measured from agent `{}` with aws-sdk-s3 against {}{repl}; clients spread over the nodes and move to another node when one fails ({} in these sections).\n",
            o.measured_by,
            crate::text::count(o.nodes, "LightningStor node"),
            crate::text::count(
                [&r.s3_large_object, &r.s3_small_batch, &r.s3_parallel_batch]
                    .iter()
                    .filter_map(|x| x.get())
                    .map(|x| x.failovers)
                    .sum::<u64>(),
                "failover"
            )
        );
    }
    let _ = writeln!(s, "Cluster network baseline for this client, to an S3 node:\n");
    s.push_str(&na(&r.s3_network));
    if let Some(n) = r.s3_network.get() {
        network_table(&mut s, n);
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
            "Measured as {} of {} KiB each ({} MiB total), one client.\n",
            crate::text::count(o.count, "object"),
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
            "Measured as the same {} of {} KiB each, with {}.\n",
            crate::text::count(o.count, "object"),
            o.object_bytes >> 10,
            crate::text::count(o.jobs, "concurrent client job")
        );
        objects_table(&mut s, o, "Parallel batch ");
    }

    if let Section::Measured(d) = &r.s3_degraded {
        let _ = writeln!(s, "### Degraded cluster\n");
        degraded(&mut s, d);
    } else if let Section::NotAvailable { reason } = &r.s3_degraded
        && reason != "no --fault given"
    {
        let _ = writeln!(s, "### Degraded cluster\n\n_Not available: {reason}._\n");
    }

    let _ = writeln!(s, "## VM Image Path\n\nMeasured from the coordinator.\n");
    s.push_str(&na(&r.vm_image));
    if let Some(v) = r.vm_image.get() {
        vm_section(&mut s, v);
    }

    if let Some(p) = r.nbd_peers.get() {
        s.push_str(&crate::nbd_compare::markdown(p).replacen("## ", "## Reference peers: ", 1));
        let _ = writeln!(s, "\nConditions: {} (no emulated link).\n", r.conditions.peers);
    } else {
        let _ = writeln!(s, "## Reference peers\n");
        s.push_str(&na(&r.nbd_peers));
    }

    if let Some(c) = r.ceph.get() {
        ceph_section(&mut s, c);
    } else if let Section::NotAvailable { reason } = &r.ceph
        && !reason.starts_with("not asked for")
    {
        let _ = writeln!(s, "## Ceph beside the stack\n\n_Not available: {reason}._\n");
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
            "- With {} it reaches {:.2} PUT/s and {:.2} GET/s.",
            crate::text::count(b.jobs, "parallel job"),
            b.put_per_s.median,
            b.get_per_s.median
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

fn ceph_section(s: &mut String, c: &super::ceph::CephPeer) {
    let _ = writeln!(s, "## Ceph beside the stack\n\n{}.\n\nHow: {}.\n", c.ceph, c.method);
    let _ = writeln!(s, "| Metric | Ceph RBD size 3 | Ceph RBD size 1 |\n|---|---:|---:|");
    let cols = [Some(&c.rbd_3x), Some(&c.rbd_1x)];
    block_row(s, "1M sequential write", &cols, |b| (&b.seq_write_mib_s, "MiB/s", 1));
    block_row(s, "1M sequential read", &cols, |b| (&b.seq_read_mib_s, "MiB/s", 1));
    block_row(s, "4k random read", &cols, |b| (&b.rand_read_4k_iops, "IOPS", 0));
    block_row(s, "QD32 write", &cols, |b| (&b.depth32_write_mib_s, "MiB/s", 1));
    block_row(s, "QD32 read", &cols, |b| (&b.depth32_read_mib_s, "MiB/s", 1));
    let _ = writeln!(s, "\n| radosgw (size 3) | Upload | Download |\n|---|---:|---:|");
    for (name, o) in [
        ("Large object", &c.rgw_large_object),
        ("Small-object batch", &c.rgw_small_batch),
        ("Parallel batch", &c.rgw_parallel_batch),
    ] {
        let _ =
            writeln!(s, "| {name} | {} | {} |", fig(&o.upload_mib_s, "MiB/s", 1), fig(&o.download_mib_s, "MiB/s", 1));
    }
    let _ = writeln!(s, "\n| Figure | Ours | Ceph | Ours / Ceph |\n|---|---|---|---:|");
    for x in &c.comparisons {
        let _ = writeln!(
            s,
            "| {} | {}: {:.1} | {}: {:.1} | {:.2} |",
            x.figure, x.ours, x.ours_value, x.theirs, x.theirs_value, x.ratio
        );
    }
    let ahead = super::ceph::ceph_ahead(&c.comparisons);
    if ahead.is_empty() {
        let _ = writeln!(s, "\nCeph is not ahead on any figure of this run.\n");
    } else {
        let _ = writeln!(s, "\nWhere Ceph is ahead in this run:\n");
        for a in ahead {
            let _ = writeln!(s, "- {a}");
        }
        s.push('\n');
    }
}

fn objects_table_body(o: &Objects) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "| Upload throughput | {} |", fig(&o.upload_mib_s, "MiB/s", 2));
    let _ = writeln!(t, "| Download throughput | {} |", fig(&o.download_mib_s, "MiB/s", 2));
    let _ = writeln!(t, "| PUT latency | {:.1} ms |", o.put_p50_ms);
    let _ = writeln!(t, "| GET latency | {:.1} ms |\n", o.get_p50_ms);
    t
}
