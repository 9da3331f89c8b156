//! The gate's verdict: gungraun's per-benchmark JSON summaries against the
//! committed baselines (`crates/bench/gate-baselines/<function>.<id>.txt`,
//! one instruction count each).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Growth over the baseline that fails the gate, in percent.
pub const MAX_GROWTH_PCT: f64 = 3.0;
/// Set (to anything but `0`) to rewrite the baselines from this run.
pub const UPDATE_ENV: &str = "GATE_UPDATE_BASELINES";

#[derive(Debug)]
pub struct Gate {
    /// gungraun's output directory for this target (`GUNGRAUN_HOME`).
    home: PathBuf,
    baselines: PathBuf,
    update: bool,
    /// A benchmark filter was given: only some benchmarks run.
    filtered: bool,
    /// Started by `cargo bench` (gungraun runs Valgrind only then).
    bench_mode: bool,
}

impl Gate {
    pub fn new(args: &[String]) -> Self {
        // The executable is `<target>/<profile>/deps/gate-<hash>`.
        let exe = std::env::current_exe().expect("current exe");
        let target = exe.ancestors().nth(3).map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("target"));
        let update = std::env::var(UPDATE_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        Gate {
            home: target.join("gungraun-gate"),
            baselines: Path::new(env!("CARGO_MANIFEST_DIR")).join("gate-baselines"),
            update,
            filtered: args.iter().any(|a| !a.starts_with('-')) || std::env::var_os("GUNGRAUN_FILTER").is_some(),
            bench_mode: args.iter().any(|a| a == "--bench"),
        }
    }

    /// Asks gungraun for JSON summaries in our directory and removes the
    /// previous run's, so only this run's results are read afterwards.
    pub fn prepare(&self) {
        // SAFETY: called from `main` before anything else runs: no other
        // thread reads the environment concurrently.
        unsafe {
            std::env::set_var("GUNGRAUN_SAVE_SUMMARY", "json");
            std::env::set_var("GUNGRAUN_HOME", &self.home);
        }
        for f in summaries(&self.home) {
            let _ = std::fs::remove_file(f);
        }
    }

    /// Compares (or, when updating, writes) and returns the exit code.
    pub fn finish(&self) -> i32 {
        let mut now = BTreeMap::new();
        for f in summaries(&self.home) {
            match read_summary(&f) {
                Ok((name, ir)) => {
                    now.insert(name, ir);
                }
                Err(e) => {
                    eprintln!("gate: {}: {e}", f.display());
                    return 2;
                }
            }
        }
        if now.is_empty() {
            if self.bench_mode {
                eprintln!("gate: no benchmark results under {}", self.home.display());
                return 2;
            }
            // `cargo test --benches` and the like: gungraun's test mode, no Valgrind.
            return 0;
        }
        let base = self.read_baselines();
        if self.update {
            return self.write_baselines(&now, &base);
        }
        let mut failed = Vec::new();
        let mut rows = Vec::new();
        for (name, &ir) in &now {
            let (b, verdict) = match base.get(name) {
                None => {
                    failed.push(name.clone());
                    (None, "NO BASELINE".to_owned())
                }
                Some(&b) => {
                    let pct = change_pct(b, ir);
                    let v = if pct > MAX_GROWTH_PCT {
                        failed.push(name.clone());
                        "REGRESSION"
                    } else if pct < -MAX_GROWTH_PCT {
                        "improved (update the baseline)"
                    } else {
                        "ok"
                    };
                    (Some(b), v.to_owned())
                }
            };
            rows.push(Row { name: name.clone(), baseline: b, now: Some(ir), verdict });
        }
        if !self.filtered {
            for (name, &b) in &base {
                if !now.contains_key(name) {
                    failed.push(name.clone());
                    rows.push(Row { name: name.clone(), baseline: Some(b), now: None, verdict: "NOT RUN".into() });
                }
            }
        }
        print_table(&rows);
        if failed.is_empty() {
            println!("gate: {} benchmarks within {MAX_GROWTH_PCT} % of their baselines", now.len());
            0
        } else {
            println!("gate: FAILED: {}", failed.join(", "));
            println!(
                "gate: an intended change? rewrite the baselines with `{UPDATE_ENV}=1 cargo bench -p bench --bench gate` \
                 and commit crates/bench/gate-baselines/"
            );
            1
        }
    }

    fn read_baselines(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        let Ok(dir) = std::fs::read_dir(&self.baselines) else { return out };
        for e in dir.flatten() {
            let p = e.path();
            let Some(name) = p.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".txt")) else {
                continue;
            };
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            match text.lines().map(str::trim).rfind(|l| !l.is_empty() && !l.starts_with('#')) {
                Some(v) => match v.parse() {
                    Ok(v) => {
                        out.insert(name.to_owned(), v);
                    }
                    Err(_) => eprintln!("gate: {}: not an instruction count: {v:?}", p.display()),
                },
                None => eprintln!("gate: {}: empty", p.display()),
            }
        }
        out
    }

    fn write_baselines(&self, now: &BTreeMap<String, u64>, base: &BTreeMap<String, u64>) -> i32 {
        if let Err(e) = std::fs::create_dir_all(&self.baselines) {
            eprintln!("gate: {}: {e}", self.baselines.display());
            return 2;
        }
        let mut rows = Vec::new();
        for (name, &ir) in now {
            let text = format!(
                "# Callgrind instructions (Ir) of the gate benchmark {name} (crates/bench/benches/gate).\n\
                 # `cargo bench -p bench --bench gate` fails when a run counts more than {MAX_GROWTH_PCT} % above this;\n\
                 # `{UPDATE_ENV}=1 cargo bench -p bench --bench gate` rewrites it.\n{ir}\n"
            );
            if let Err(e) = std::fs::write(self.baselines.join(format!("{name}.txt")), text) {
                eprintln!("gate: writing the baseline of {name}: {e}");
                return 2;
            }
            rows.push(Row {
                name: name.clone(),
                baseline: base.get(name).copied(),
                now: Some(ir),
                verdict: "written".into(),
            });
        }
        if !self.filtered {
            for name in base.keys().filter(|n| !now.contains_key(*n)) {
                let _ = std::fs::remove_file(self.baselines.join(format!("{name}.txt")));
                rows.push(Row {
                    name: name.clone(),
                    baseline: base.get(name).copied(),
                    now: None,
                    verdict: "removed".into(),
                });
            }
        }
        print_table(&rows);
        println!("gate: baselines rewritten in {}", self.baselines.display());
        0
    }
}

fn change_pct(baseline: u64, now: u64) -> f64 {
    if baseline == 0 {
        return if now == 0 { 0.0 } else { f64::INFINITY };
    }
    (now as f64 - baseline as f64) / baseline as f64 * 100.0
}

struct Row {
    name: String,
    baseline: Option<u64>,
    now: Option<u64>,
    verdict: String,
}

fn print_table(rows: &[Row]) {
    let w = rows.iter().map(|r| r.name.len()).max().unwrap_or(9).max(9);
    let num = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    println!();
    println!("{:<w$}  {:>14}  {:>14}  {:>9}  verdict", "benchmark", "baseline", "now", "change");
    for r in rows {
        let change = match (r.baseline, r.now) {
            (Some(b), Some(n)) => format!("{:+.2} %", change_pct(b, n)),
            _ => "-".to_owned(),
        };
        println!("{:<w$}  {:>14}  {:>14}  {:>9}  {}", r.name, num(r.baseline), num(r.now), change, r.verdict);
    }
    println!();
}

/// Every `summary.json` under `dir`.
fn summaries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.file_name().is_some_and(|n| n == "summary.json") {
                out.push(p);
            }
        }
    }
    out
}

/// `(function.id, instructions)` of one gungraun summary: the Callgrind
/// profile's total `Ir` over every thread, as measured now.
fn read_summary(path: &Path) -> Result<(String, u64), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let function = v["function_name"].as_str().ok_or("no function_name")?;
    let name = match v["id"].as_str() {
        Some(id) => format!("{function}.{id}"),
        None => function.to_owned(),
    };
    let profiles = v["profiles"].as_array().ok_or("no profiles")?;
    let callgrind = profiles.iter().find(|p| p["tool"] == "Callgrind").ok_or("no Callgrind profile")?;
    let ir = new_ir(&callgrind["data"]["total"]["metrics"]).ok_or("no Ir in the Callgrind total")?;
    Ok((name, ir))
}

/// The new run's `Ir` in a gungraun (0.20) metrics object:
/// `{"Ir": {"values": {"new": N, "old": M}}}` (`old` when a previous local
/// run exists).
fn new_ir(metrics: &serde_json::Value) -> Option<u64> {
    first_int(&metrics["Ir"]["values"]["new"])
}

fn first_int(v: &serde_json::Value) -> Option<u64> {
    match v {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::Object(m) => m.values().find_map(first_int),
        serde_json::Value::Array(a) => a.first().and_then(first_int),
        _ => None,
    }
}
