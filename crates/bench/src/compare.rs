//! `bench compare OLD.json NEW.json`: finds every figure (an object with a
//! `mean` and a `stddev`) in two result files, lines them up by path, and
//! flags a regression when a figure got worse by more than the bound *and*
//! by more than its own spread (the larger standard deviation of the two).
//!
//! Works on `bench run --json` files and on `fresh-bench-storage`'s
//! `results.json` alike. Latencies and durations (paths mentioning `lat`,
//! `latency` or ending in `_s`) are better when lower, the rest when higher.

use serde_json::Value;

/// One figure present in both files.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub path: String,
    pub old_mean: f64,
    pub old_sd: f64,
    pub new_mean: f64,
    pub new_sd: f64,
    /// Change in the bad direction, percent (negative: it improved).
    pub worse_pct: f64,
    pub regression: bool,
}

/// The whole comparison.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    pub rows: Vec<Row>,
    /// Figures in only one of the files.
    pub only_old: Vec<String>,
    pub only_new: Vec<String>,
}

impl Comparison {
    pub fn regressions(&self) -> usize {
        self.rows.iter().filter(|r| r.regression).count()
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

fn figure(v: &Value) -> Option<(f64, f64)> {
    Some((v.get("mean")?.as_f64()?, v.get("stddev")?.as_f64()?))
}

fn walk(v: &Value, path: String, out: &mut Vec<(String, f64, f64)>) {
    if let Some((m, sd)) = figure(v) {
        out.push((path, m, sd));
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

/// Every figure of a result file: (path, mean, stddev).
pub fn figures(v: &Value) -> Vec<(String, f64, f64)> {
    let mut out = Vec::new();
    walk(v, String::new(), &mut out);
    out
}

/// Whether a smaller value of this figure is better.
pub fn lower_is_better(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path);
    last.contains("lat") || last.ends_with("_s") || last.contains("latency") || last.contains("seconds")
}

/// Compares two result files with a bound in percent.
pub fn compare(old: &Value, new: &Value, max_regression_pct: f64) -> Comparison {
    let olds = figures(old);
    let news = figures(new);
    let mut c = Comparison::default();
    for (path, om, osd) in &olds {
        let Some((_, nm, nsd)) = news.iter().find(|(p, _, _)| p == path) else {
            c.only_old.push(path.clone());
            continue;
        };
        let (om, nm) = (*om, *nm);
        let delta = if lower_is_better(path) { nm - om } else { om - nm };
        let worse_pct = if om.abs() > f64::EPSILON { 100.0 * delta / om.abs() } else { 0.0 };
        let spread = osd.max(*nsd);
        let regression = worse_pct > max_regression_pct && delta > spread;
        c.rows.push(Row {
            path: path.clone(),
            old_mean: om,
            old_sd: *osd,
            new_mean: nm,
            new_sd: *nsd,
            worse_pct,
            regression,
        });
    }
    c.only_new = news.iter().filter(|(p, _, _)| !olds.iter().any(|(o, _, _)| o == p)).map(|x| x.0.clone()).collect();
    c
}

/// The comparison as a table.
pub fn table(c: &Comparison, bound: f64) -> String {
    let mut s =
        format!("| Figure | Old (mean ± sd) | New (mean ± sd) | Worse by | Verdict |\n|---|---:|---:|---:|---|\n");
    for r in &c.rows {
        let verdict = if r.regression {
            "REGRESSION"
        } else if r.worse_pct > bound {
            "worse, within spread"
        } else if r.worse_pct < -bound {
            "better"
        } else {
            "same"
        };
        s.push_str(&format!(
            "| {} | {:.4} ± {:.4} | {:.4} ± {:.4} | {:+.1}% | {verdict} |\n",
            r.path, r.old_mean, r.old_sd, r.new_mean, r.new_sd, r.worse_pct
        ));
    }
    for p in &c.only_old {
        s.push_str(&format!("| {p} | present | missing | | not compared |\n"));
    }
    for p in &c.only_new {
        s.push_str(&format!("| {p} | missing | present | | not compared |\n"));
    }
    s.push_str(&format!(
        "\n{} figures compared, {} regressions beyond {bound}% and their spread.\n",
        c.rows.len(),
        c.regressions()
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fig(mean: f64, sd: f64) -> Value {
        json!({"mean": mean, "stddev": sd, "median": mean, "min": mean, "max": mean, "n": 3})
    }

    fn report(iops: f64, iops_sd: f64, p99: f64) -> Value {
        json!({"profile": "p", "jobs": [
            {"name": "randread", "read": {"iops": fig(iops, iops_sd), "lat_p99_us": fig(p99, 1.0)}},
            {"name": "seqwrite", "write": {"bw_bytes": fig(1e8, 1e6)}}
        ]})
    }

    #[test]
    fn a_drop_beyond_bound_and_spread_is_a_regression() {
        let c = compare(&report(1000.0, 10.0, 100.0), &report(800.0, 10.0, 100.0), 10.0);
        assert_eq!(c.regressions(), 1);
        let r = c.rows.iter().find(|r| r.regression).unwrap();
        assert_eq!(r.path, "jobs.randread.read.iops");
        assert!((r.worse_pct - 20.0).abs() < 1e-9);
    }

    #[test]
    fn a_drop_within_the_spread_is_not_a_regression() {
        // 20 % worse, but the figure itself wanders by 300 IOPS.
        let c = compare(&report(1000.0, 300.0, 100.0), &report(800.0, 50.0, 100.0), 10.0);
        assert_eq!(c.regressions(), 0);
        assert!(table(&c, 10.0).contains("worse, within spread"));
    }

    #[test]
    fn higher_latency_is_worse_and_lower_is_better() {
        let c = compare(&report(1000.0, 1.0, 100.0), &report(1000.0, 1.0, 150.0), 10.0);
        assert_eq!(c.regressions(), 1);
        assert!(c.rows.iter().any(|r| r.regression && r.path.ends_with("lat_p99_us")));
        let c = compare(&report(1000.0, 1.0, 150.0), &report(2000.0, 1.0, 100.0), 10.0);
        assert_eq!(c.regressions(), 0);
    }

    #[test]
    fn jobs_are_matched_by_name_and_missing_ones_reported() {
        let old = report(1000.0, 1.0, 100.0);
        let mut new = report(1000.0, 1.0, 100.0);
        new["jobs"].as_array_mut().unwrap().swap(0, 1);
        new["jobs"][0]["name"] = json!("renamed");
        let c = compare(&old, &new, 10.0);
        assert_eq!(c.rows.len(), 2);
        assert_eq!(c.only_old, ["jobs.seqwrite.write.bw_bytes"]);
        assert_eq!(c.only_new, ["jobs.renamed.write.bw_bytes"]);
    }

    #[test]
    fn percentages_parse() {
        assert_eq!(parse_pct("10%").unwrap(), 10.0);
        assert_eq!(parse_pct("7.5").unwrap(), 7.5);
        assert!(parse_pct("ten").is_err());
        assert!(parse_pct("-5%").is_err());
    }
}
