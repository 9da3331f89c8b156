//! SVG bar charts (plotters) embedded in the storage report.

use plotters::prelude::*;
use std::path::Path;

/// Draws horizontal bars `(label, value)` with the value printed on each.
pub fn bars(path: &Path, title: &str, unit: &str, bars: &[(String, f64)]) -> anyhow::Result<()> {
    if bars.is_empty() {
        anyhow::bail!("no bars to draw");
    }
    let n = bars.len();
    let max = bars.iter().map(|b| b.1).fold(0.0f64, f64::max).max(1e-9);
    let height = 80 + 36 * n as u32;
    let root = SVGBackend::new(path, (860, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(260)
        .build_cartesian_2d(0f64..max * 1.25, (0..n).into_segmented())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .x_desc(unit)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let colour = RGBColor(46, 109, 164);
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            let mut r =
                Rectangle::new([(0.0, SegmentValue::Exact(i)), (*v, SegmentValue::Exact(i + 1))], colour.filled());
            r.set_margin(6, 6, 0, 0);
            r
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, v))| {
            Text::new(format!(" {v:.1}"), (*v, SegmentValue::CenterOf(i)), ("sans-serif", 14).into_font())
        }))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_chart_is_an_svg_with_every_label() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.svg");
        super::bars(&p, "T", "MiB/s", &[("alpha".into(), 3.0), ("beta".into(), 10.0)]).unwrap();
        let s = std::fs::read_to_string(&p).unwrap();
        assert!(s.starts_with("<svg") || s.contains("<svg"));
        assert!(s.contains("alpha") && s.contains("beta") && s.contains("10.0"));
        assert!(super::bars(&p, "T", "x", &[]).is_err());
    }
}

/// The report's charts, written into `dir`; returns (file name, alt text).
pub fn for_report(r: &crate::storage::Report, dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut draw = |file: &str, title: &str, unit: &str, bars: Vec<(String, f64)>| {
        if bars.is_empty() {
            return;
        }
        match self::bars(&dir.join(file), title, unit, &bars) {
            Ok(()) => out.push((file.to_owned(), title.to_owned())),
            Err(e) => eprintln!("bench: chart {file}: {e:#}"),
        }
    };
    let mut flow = Vec::new();
    if let Some(n) = r.network.get() {
        flow.push(("TCP baseline".to_owned(), n.tcp_mib_s.median));
    }
    if let Some(l) = r.local_disk.get() {
        flow.push(("Local disk seq read".to_owned(), l.seq_read_mib_s.median));
    }
    if let Some(c) = r.coronafs.get() {
        flow.push(("CoronaFS seq read".to_owned(), c.seq_read_mib_s.median));
        flow.push(("CoronaFS depth-32 read".to_owned(), c.depth32_read_mib_s.median));
    }
    if let Some(x) = r.cross_worker.get() {
        flow.push(("Cross-worker read".to_owned(), x.read_mib_s.median));
    }
    if let Some(o) = r.s3_large_object.get() {
        flow.push(("S3 large download".to_owned(), o.download_mib_s.median));
        flow.push(("S3 large upload".to_owned(), o.upload_mib_s.median));
    }
    draw("throughput.svg", "Where the throughput goes (MiB/s)", "MiB/s", flow);
    if let (Some(l), Some(c)) = (r.local_disk.get(), r.coronafs.get()) {
        let rows = [
            ("seq write", l.seq_write_mib_s.median, c.seq_write_mib_s.median),
            ("seq read", l.seq_read_mib_s.median, c.seq_read_mib_s.median),
            ("depth-32 write", l.depth32_write_mib_s.median, c.depth32_write_mib_s.median),
            ("depth-32 read", l.depth32_read_mib_s.median, c.depth32_read_mib_s.median),
        ];
        let bars =
            rows.iter().flat_map(|(n, lv, cv)| [(format!("local {n}"), *lv), (format!("CoronaFS {n}"), *cv)]).collect();
        draw("coronafs.svg", "CoronaFS vs local disk (MiB/s)", "MiB/s", bars);
    }
    let mut s3 = Vec::new();
    for (name, sec) in [("batch", &r.s3_small_batch), ("parallel batch", &r.s3_parallel_batch)] {
        if let Some(o) = sec.get() {
            s3.push((format!("{name} PUT/s"), o.put_per_s.median));
            s3.push((format!("{name} GET/s"), o.get_per_s.median));
        }
    }
    draw("lightningstor.svg", "LightningStor small objects (objects/s)", "objects/s", s3);
    out
}
