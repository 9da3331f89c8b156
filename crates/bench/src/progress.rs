//! Progress for long runs: an indicatif bar on a terminal, plain numbered
//! lines otherwise (CI logs, pipes).

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts steps of a known total.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    done: AtomicU64,
    total: u64,
}

impl Progress {
    /// A bar if stderr is a terminal, else plain lines.
    pub fn new(total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = ProgressBar::new(total);
            if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {wide_msg}") {
                b.set_style(style.progress_chars("=> "));
            }
            b.enable_steady_tick(std::time::Duration::from_millis(200));
            b
        });
        Progress { bar, done: AtomicU64::new(0), total }
    }

    /// Starts the next step.
    pub fn step(&self, msg: &str) {
        let n = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        match &self.bar {
            Some(b) => {
                b.set_position(n - 1);
                b.set_message(msg.to_owned());
            }
            None if !msg.is_empty() => eprintln!("bench: [{n}/{}] {msg}", self.total),
            None => {}
        }
    }

    /// A line that stays (above the bar on a terminal).
    pub fn note(&self, msg: &str) {
        match &self.bar {
            Some(b) => b.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
