//! The instruction-count gate: `cargo bench -p bench --bench gate`.
//!
//! Runs the hot paths once each under Callgrind (gungraun), then compares
//! every benchmark's instruction count with its committed baseline in
//! `crates/bench/gate-baselines/` and exits non-zero when one grew by more
//! than 3 %, printing a table. `GATE_UPDATE_BASELINES=1` rewrites the
//! baselines from this run instead (for intended changes). See docs/bench.md.
//!
//! How it is put together: gungraun's generated `main` runs the benchmarks
//! through `gungraun-runner` (which starts this same binary under Valgrind
//! with `--gungraun-run ...`); around it this file asks gungraun for a JSON
//! summary per benchmark and does the comparison, so the gate is one command.

mod callgrind;
mod cases;
mod compare;
#[path = "../common/fixtures.rs"]
mod fixtures;

fn main() {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    // Under Valgrind, started by the runner: just the benchmark.
    if first.as_deref() == Some("--gungraun-run") {
        cases::run();
        return;
    }
    let all: Vec<String> = first.into_iter().chain(args).collect();
    let listing = all.iter().any(|a| a == "--list" || a.starts_with("--list="));
    let gate = compare::Gate::new(&all);
    if !listing {
        gate.prepare();
    }
    cases::run();
    if listing {
        return;
    }
    std::process::exit(gate.finish());
}
