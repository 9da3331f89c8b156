//! `bench compare OLD.json NEW.json`: finds every figure (an object with a
//! `median`, a `min` and a `max`, as [`crate::stats::Summary`] writes them)
//! in two result files, lines them up by path, and judges each one.
//!
//! The rule: a figure regresses when its median got worse by more than the
//! bound **and** the two runs' `min..max` ranges do not overlap (the new
//! run's best iteration is worse than the old run's worst). Both runs need
//! at least [`MIN_ITERATIONS`] iterations; with fewer there is no range to
//! speak of and the figure is shown but not judged.
//!
//! Why ranges and not standard deviations: with 3-5 iterations a standard
//! deviation is itself a noisy estimate, and "worse by more than one
//! standard deviation" happens by chance to a good share of the figures of
//! two runs of the same build. Two ranges that do not overlap are the
//! extreme of a rank test: for one direction, the chance that two runs of
//! the same build come out that way is `n!·m! / (n+m)!`, 1 in 20 with 3 and
//! 3 iterations and 1 in 252 with 5 and 5, whatever the shape of the noise.
//! The median bound on top keeps a real but tiny shift from failing a gate.
//!
//! Works on `bench run --json` files and on `fresh-bench-storage`'s
//! `results.json` alike. Arrays of named things (`name`, `label`, `peer`,
//! `workload`) are matched by name. Objects with only a `mean` and a
//! `stddev` (older files) are shown, not judged.

use serde_json::Value;

/// Iterations each run needs before its figures are judged.
pub const MIN_ITERATIONS: usize = 3;
/// Iterations we recommend for a regression gate.
pub const RECOMMENDED_ITERATIONS: usize = 5;

/// One figure as a result file gives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figure {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Iterations behind the figure (`None` when the file does not say).
    pub n: Option<usize>,
    /// False for a `{mean, stddev}` object: `median`, `min` and `max` are
    /// then all the mean, and there is no range to judge.
    pub ranged: bool,
}

impl Figure {
    /// Reads a figure object; `None` when `v` is not one.
    pub fn read(v: &Value) -> Option<Figure> {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let n = v.get("n").and_then(Value::as_u64).map(|n| n as usize);
        if let (Some(median), Some(min), Some(max)) = (num("median"), num("min"), num("max")) {
            return Some(Figure { median, min, max, n, ranged: true });
        }
        let (mean, _) = (num("mean")?, num("stddev")?);
        Some(Figure { median: mean, min: mean, max: mean, n, ranged: false })
    }
}

/// What the rule says about one figure.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Median worse by more than the bound and the ranges apart.
    Regression,
    /// Median worse by more than the bound, but the ranges overlap, so the
    /// runs' own noise can explain it.
    WorseOverlapping,
    /// Median better by more than the bound.
    Better,
    /// Median within the bound either way.
    Same,
    /// Not judged, and why (`n=1`, `no min/max`).
    NotJudged(String),
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verdict::Regression => f.write_str("REGRESSION"),
            Verdict::WorseOverlapping => f.write_str("worse, ranges overlap"),
            Verdict::Better => f.write_str("better"),
            Verdict::Same => f.write_str("same"),
            Verdict::NotJudged(why) => write!(f, "not judged ({why})"),
        }
    }
}

/// One figure present in both files.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub path: String,
    pub old: Figure,
    pub new: Figure,
    pub lower_is_better: bool,
    /// How much the median changed, percent of the old one (`None` when
    /// the old median is 0).
    pub change_pct: Option<f64>,
    /// Change of the median in the bad direction, percent (negative: it
    /// improved; infinite when a figure that was 0 got worse).
    pub worse_pct: f64,
    pub verdict: Verdict,
}

/// The whole comparison.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    pub bound_pct: f64,
    pub rows: Vec<Row>,
    /// Figures in only one of the files.
    pub only_old: Vec<String>,
    pub only_new: Vec<String>,
    /// Top-level settings (`target`, `link`, `profile`, ...) that differ
    /// between the files: (key, old, new).
    pub differences: Vec<(String, String, String)>,
}

impl Comparison {
    pub fn regressions(&self) -> usize {
        self.rows.iter().filter(|r| r.verdict == Verdict::Regression).count()
    }

    pub fn not_judged(&self) -> usize {
        self.rows.iter().filter(|r| matches!(r.verdict, Verdict::NotJudged(_))).count()
    }

    /// Figures the rule could judge.
    pub fn judged(&self) -> usize {
        self.rows.len() - self.not_judged()
    }
}

/// Parses `10%`, `10` or `7.5%` as a percentage.
pub fn parse_pct(s: &str) -> anyhow::Result<f64> {
    let v: f64 =
        s.trim().trim_end_matches('%').parse().map_err(|_| anyhow::anyhow!("{s:?} is not a percentage (try 10%)"))?;
    if !(0.0..=1000.0).contains(&v) {
        anyhow::bail!("{s:?} must be between 0% and 1000%");
    }
    Ok(v)
}

fn walk(v: &Value, path: String, out: &mut Vec<(String, Figure)>) {
    if let Some(f) = Figure::read(v) {
        out.push((path, f));
        return;
    }
    let join = |k: &str| if path.is_empty() { k.to_owned() } else { format!("{path}.{k}") };
    match v {
        Value::Object(map) => {
            for (k, x) in map {
                walk(x, join(k), out);
            }
        }
        Value::Array(items) => {
            for (i, x) in items.iter().enumerate() {
                // Arrays of named things are matched by name, not position.
                let key = ["name", "label", "peer", "workload"]
                    .iter()
                    .find_map(|k| x.get(k).and_then(Value::as_str).map(str::to_owned))
                    .unwrap_or_else(|| i.to_string());
                walk(x, join(&key), out);
            }
        }
        _ => {}
    }
}

/// Every figure of a result file, by path.
pub fn figures(v: &Value) -> Vec<(String, Figure)> {
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

/// Whether a smaller value of this figure is better: latencies (`lat`),
/// durations (`_s`, `_ms`, `_us`, `_ns`, `seconds`; rates such as `_mib_s`
/// or `_per_s` are not durations), retransmits, errors and CPU per
/// operation. Everything else (bandwidth, IOPS, rates) is better higher.
pub fn lower_is_better(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path).to_ascii_lowercase();
    if last.contains("lat") || last.contains("retransmit") || last.contains("error") || last.contains("_per_op") {
        return true;
    }
    if last.contains("iops") || last.contains("bw") || last.contains("per_s") {
        return false;
    }
    let rate_units = ["b_s", "kib_s", "mib_s", "gib_s", "kb_s", "mb_s", "gb_s", "bytes_s"];
    if rate_units.iter().any(|u| last == *u || last.ends_with(&format!("_{u}"))) {
        return false;
    }
    last.contains("seconds") || ["_s", "_ms", "_us", "_ns"].iter().any(|u| last.ends_with(u))
}

/// Judges one figure against the bound (percent).
pub fn judge(path: &str, old: Figure, new: Figure, bound_pct: f64) -> Row {
    let lower = lower_is_better(path);
    let delta = if lower { new.median - old.median } else { old.median - new.median };
    let base = old.median.abs();
    let worse_pct = if base > f64::EPSILON {
        100.0 * delta / base
    } else if delta > 0.0 {
        f64::INFINITY
    } else {
        0.0
    };
    let change_pct = (base > f64::EPSILON).then(|| 100.0 * (new.median - old.median) / base);
    let few = |f: &Figure| f.n.is_none_or(|n| n < MIN_ITERATIONS);
    let verdict = if !old.ranged || !new.ranged {
        Verdict::NotJudged("no min/max".into())
    } else if few(&old) || few(&new) {
        let n = |f: &Figure| f.n.map_or("?".to_owned(), |n| n.to_string());
        let why = if n(&old) == n(&new) { format!("n={}", n(&old)) } else { format!("n={}/{}", n(&old), n(&new)) };
        Verdict::NotJudged(why)
    } else if worse_pct > bound_pct {
        // The new run's best iteration is worse than the old run's worst.
        let apart = if lower { new.min > old.max } else { new.max < old.min };
        if apart { Verdict::Regression } else { Verdict::WorseOverlapping }
    } else if -worse_pct > bound_pct {
        Verdict::Better
    } else {
        Verdict::Same
    };
    Row { path: path.to_owned(), old, new, lower_is_better: lower, change_pct, worse_pct, verdict }
}

/// Compares two result files with a bound in percent.
pub fn compare(old: &Value, new: &Value, bound_pct: f64) -> Comparison {
    let olds = figures(old);
    let news = figures(new);
    let mut c = Comparison { bound_pct, ..Comparison::default() };
    for (path, o) in &olds {
        match news.iter().find(|(p, _)| p == path) {
            Some((_, n)) => c.rows.push(judge(path, *o, *n, bound_pct)),
            None => c.only_old.push(path.clone()),
        }
    }
    c.only_new = news.iter().filter(|(p, _)| !olds.iter().any(|(o, _)| o == p)).map(|x| x.0.clone()).collect();
    for k in SETTINGS {
        if let (Some(a), Some(b)) = (setting(&old[k]), setting(&new[k]))
            && a != b
        {
            c.differences.push((k.to_owned(), a, b));
        }
    }
    c
}

/// Top-level keys that say how a result was measured; a comparison notes
/// when they differ.
const SETTINGS: [&str; 6] = ["profile", "target", "link", "cluster", "quick", "iterations"];

fn setting(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(_) | Value::Bool(_) => Some(v.to_string()),
        _ => None,
    }
}

/// How a figure is shown: the factor its value is divided by, the unit,
/// and the decimals.
fn unit(path: &str) -> (f64, &'static str, usize) {
    let last = path.rsplit('.').next().unwrap_or(path);
    if last.ends_with("bw_bytes") {
        (1048576.0, "MiB/s", 1)
    } else if last.ends_with("mib_s") {
        (1.0, "MiB/s", 1)
    } else if last.contains("iops") {
        (1.0, "IOPS", 0)
    } else if last.ends_with("per_s") {
        (1.0, "/s", 1)
    } else if last.ends_with("_us") {
        (1.0, "µs", 1)
    } else if last.ends_with("_ms") {
        (1.0, "ms", 2)
    } else if last.ends_with("_s") || last.contains("seconds") {
        (1.0, "s", 3)
    } else {
        (1.0, "", 3)
    }
}

fn cell(f: &Figure, scale: f64, prec: usize) -> String {
    let v = |x: f64| format!("{:.*}", prec, x / scale);
    let n = f.n.map_or("?".to_owned(), |n| n.to_string());
    if f.ranged {
        format!("{} [{}..{}] n={n}", v(f.median), v(f.min), v(f.max))
    } else {
        format!("{} (mean) n={n}", v(f.median))
    }
}

/// The comparison as a Markdown table, then a summary and any warnings.
pub fn table(c: &Comparison) -> String {
    let bound = c.bound_pct;
    let mut s = String::new();
    for (k, a, b) in &c.differences {
        s.push_str(&format!("note: {k} differs: old {a:?}, new {b:?}\n"));
    }
    if !c.differences.is_empty() {
        s.push('\n');
    }
    s.push_str("| Figure | Old: median [min..max] n | New: median [min..max] n | Change | Verdict |\n");
    s.push_str("|---|---:|---:|---:|---|\n");
    for r in &c.rows {
        let (scale, u, prec) = unit(&r.path);
        let name = if u.is_empty() { r.path.clone() } else { format!("{} ({u})", r.path) };
        let change = match r.change_pct {
            Some(p) => format!("{p:+.1}%"),
            None if r.new.median == r.old.median => "0".to_owned(),
            None => "from 0".to_owned(),
        };
        s.push_str(&format!(
            "| {name} | {} | {} | {change} | {} |\n",
            cell(&r.old, scale, prec),
            cell(&r.new, scale, prec),
            r.verdict
        ));
    }
    for p in &c.only_old {
        s.push_str(&format!("| {p} | present | missing | | not compared |\n"));
    }
    for p in &c.only_new {
        s.push_str(&format!("| {p} | missing | present | | not compared |\n"));
    }
    let worse = c.rows.iter().filter(|r| r.verdict == Verdict::WorseOverlapping).count();
    s.push_str(&format!(
        "\n{} compared: {} (median worse by more than {bound}% and min..max ranges apart), \
         {worse} worse within the runs' spread, {} not judged.\n",
        crate::text::count(c.rows.len(), "figure"),
        crate::text::count(c.regressions(), "regression"),
        c.not_judged()
    ));
    if c.not_judged() > 0 {
        s.push_str(&format!(
            "warning: {} not judged: the regression gate needs at least {MIN_ITERATIONS} \
             iterations in each run ({RECOMMENDED_ITERATIONS} recommended, e.g. bench run --iterations \
             {RECOMMENDED_ITERATIONS}) and min/max per figure.\n",
            if c.not_judged() == 1 { "1 figure was".to_owned() } else { format!("{} figures were", c.not_judged()) }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;
    use serde_json::json;

    fn fig(values: &[f64]) -> Value {
        serde_json::to_value(Summary::of(values)).unwrap()
    }

    fn report(iops: &[f64], p99: &[f64]) -> Value {
        json!({"profile": "p", "jobs": [
            {"name": "randread", "read": {"iops": fig(iops), "lat_p99_us": fig(p99)}},
            {"name": "seqwrite", "write": {"bw_bytes": fig(&[1e8, 1.01e8, 0.99e8])}}
        ]})
    }

    fn verdict(c: &Comparison, path: &str) -> Verdict {
        c.rows.iter().find(|r| r.path == path).unwrap_or_else(|| panic!("no {path}")).verdict.clone()
    }

    #[test]
    fn two_noisy_runs_of_the_same_build_pass() {
        // The shape that failed before: medians a few percent apart, one
        // run's spread wider than its stddev suggests, a p99 that jumps.
        let old = report(&[41000.0, 45000.0, 38000.0, 44000.0, 43000.0], &[900.0, 1400.0, 1000.0, 950.0, 2100.0]);
        let new = report(&[39000.0, 36000.0, 40500.0, 38500.0, 41000.0], &[1500.0, 1100.0, 1200.0, 2400.0, 1300.0]);
        let c = compare(&old, &new, 10.0);
        assert_eq!(c.regressions(), 0, "{}", table(&c));
        assert_eq!(c.judged(), 3);
        // 20 % worse p99 by median, but the ranges overlap.
        assert_eq!(verdict(&c, "jobs.randread.read.lat_p99_us"), Verdict::WorseOverlapping);
    }

    #[test]
    fn a_quarter_slower_with_ranges_apart_is_a_regression() {
        let old = report(&[40000.0, 40400.0, 39800.0, 40100.0, 39700.0], &[1000.0; 5]);
        let new = report(&[30000.0, 30300.0, 29800.0, 30100.0, 29900.0], &[1000.0; 5]);
        let c = compare(&old, &new, 10.0);
        assert_eq!(c.regressions(), 1, "{}", table(&c));
        let r = c.rows.iter().find(|r| r.verdict == Verdict::Regression).unwrap();
        assert_eq!(r.path, "jobs.randread.read.iops");
        assert!((r.worse_pct - 25.0).abs() < 0.5, "{}", r.worse_pct);
        assert!(table(&c).contains("| -25.0% | REGRESSION |"), "{}", table(&c));
        // The same drop within a 30 % bound passes.
        assert_eq!(compare(&old, &new, 30.0).regressions(), 0);
    }

    #[test]
    fn ranges_that_touch_or_overlap_are_not_a_regression() {
        // 25 % worse by median, but the new run's best equals the old run's worst.
        let old = report(&[40000.0, 40000.0, 30500.0], &[1000.0; 3]);
        let new = report(&[30000.0, 30500.0, 29000.0], &[1000.0; 3]);
        let c = compare(&old, &new, 10.0);
        assert_eq!(verdict(&c, "jobs.randread.read.iops"), Verdict::WorseOverlapping);
        assert_eq!(c.regressions(), 0);
    }

    #[test]
    fn one_iteration_is_shown_but_not_judged() {
        let c = compare(&report(&[1000.0], &[100.0]), &report(&[500.0], &[300.0]), 10.0);
        assert_eq!(c.regressions(), 0);
        assert_eq!(verdict(&c, "jobs.randread.read.iops"), Verdict::NotJudged("n=1".into()));
        // bw_bytes has n=3 on both sides and is judged.
        assert_eq!((c.not_judged(), c.judged()), (2, 1));
        let t = table(&c);
        assert!(t.contains("not judged (n=1)") && t.contains("warning: 2 figures were not judged"), "{t}");
        assert!(t.contains("5 recommended"), "{t}");
        // Mixed: 3 iterations against 2.
        let c = compare(&report(&[1000.0, 1001.0, 999.0], &[100.0; 3]), &report(&[500.0, 501.0], &[100.0; 2]), 10.0);
        assert_eq!(verdict(&c, "jobs.randread.read.iops"), Verdict::NotJudged("n=3/2".into()));
    }

    #[test]
    fn mean_and_stddev_files_are_read_but_not_judged() {
        let doc = |m: f64| json!({"jobs": [{"name": "j", "read": {"iops": {"mean": m, "stddev": 1.0}}}]});
        let c = compare(&doc(1000.0), &doc(100.0), 10.0);
        assert_eq!(c.rows.len(), 1);
        assert_eq!(c.rows[0].verdict, Verdict::NotJudged("no min/max".into()));
        assert_eq!(c.rows[0].change_pct.map(f64::round), Some(-90.0));
    }

    #[test]
    fn directions_follow_the_figure_name() {
        for p in [
            "jobs.j.read.lat_p99_us",
            "jobs.j.read.lat_mean_us",
            "vm_image.first_create_volume_s",
            "vm_image.create_image_s",
            "x.warm.p50_ms",
            "x.elapsed_seconds",
            "network.tcp_retransmits",
            "x.errors",
            "workloads.w.peers.coronafs.server_cpu_us_per_op",
            "coronafs_failover.io_pause_s",
            "coronafs_failover.reconnect_s",
        ] {
            assert!(lower_is_better(p), "{p} should be better lower");
        }
        for p in [
            "jobs.j.read.iops",
            "jobs.j.write.bw_bytes",
            "coronafs.seq_read_mib_s",
            "vm_image.create_image_mib_s",
            "s3_small_batch.put_per_s",
            "workloads.w.peers.coronafs.mib_s",
            "coronafs.rand_read_4k_iops",
        ] {
            assert!(!lower_is_better(p), "{p} should be better higher");
        }
        // Latency up by half with ranges apart is a regression; down is better.
        let old = report(&[1000.0; 3], &[100.0, 101.0, 99.0]);
        let new = report(&[1000.0; 3], &[150.0, 151.0, 149.0]);
        assert_eq!(verdict(&compare(&old, &new, 10.0), "jobs.randread.read.lat_p99_us"), Verdict::Regression);
        assert_eq!(verdict(&compare(&new, &old, 10.0), "jobs.randread.read.lat_p99_us"), Verdict::Better);
    }

    #[test]
    fn a_count_that_was_zero_regresses_when_it_grows_apart() {
        let doc = |v: &[f64]| json!({"network": {"tcp_retransmits": fig(v)}});
        let c = compare(&doc(&[0.0; 5]), &doc(&[40.0, 50.0, 45.0, 60.0, 41.0]), 10.0);
        assert_eq!(c.rows[0].verdict, Verdict::Regression);
        assert!(table(&c).contains("from 0"));
        let c = compare(&doc(&[0.0; 5]), &doc(&[0.0, 0.0, 3.0, 0.0, 0.0]), 10.0);
        assert_eq!(c.rows[0].verdict, Verdict::Same);
    }

    #[test]
    fn bandwidth_is_shown_in_mib_per_second() {
        let c = compare(&report(&[1000.0; 3], &[1.0; 3]), &report(&[1000.0; 3], &[1.0; 3]), 10.0);
        let t = table(&c);
        assert!(t.contains("jobs.seqwrite.write.bw_bytes (MiB/s) | 95.4 [94.4..96.3] n=3"), "{t}");
        assert!(t.contains("jobs.randread.read.iops (IOPS) | 1000 [1000..1000] n=3"), "{t}");
    }

    #[test]
    fn jobs_are_matched_by_name_and_missing_ones_reported() {
        let old = report(&[1000.0; 3], &[100.0; 3]);
        let mut new = old.clone();
        new["jobs"].as_array_mut().unwrap().swap(0, 1);
        new["jobs"][0]["name"] = json!("renamed");
        let c = compare(&old, &new, 10.0);
        assert_eq!(c.rows.len(), 2);
        assert_eq!(c.only_old, ["jobs.seqwrite.write.bw_bytes"]);
        assert_eq!(c.only_new, ["jobs.renamed.write.bw_bytes"]);
    }

    #[test]
    fn differing_settings_are_noted() {
        let mut old = report(&[1000.0; 3], &[100.0; 3]);
        let mut new = old.clone();
        old["link"] = json!("40.0 MiB/s");
        new["link"] = json!("30.0 MiB/s");
        new["profile"] = json!("q");
        let c = compare(&old, &new, 10.0);
        let t = table(&c);
        assert!(t.contains("note: link differs: old \"40.0 MiB/s\", new \"30.0 MiB/s\""), "{t}");
        assert!(t.contains("note: profile differs"), "{t}");
    }

    #[test]
    fn percentages_parse() {
        assert_eq!(parse_pct("10%").unwrap(), 10.0);
        assert_eq!(parse_pct("7.5").unwrap(), 7.5);
        assert!(parse_pct("ten").is_err());
        assert!(parse_pct("-5%").is_err());
    }
}
