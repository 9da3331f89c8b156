//! The Prometheus text exposition format (version 0.0.4), which every
//! service's `/metrics` answers with.
//!
//! A [`Text`] is written one metric family at a time: the family's `# HELP`
//! and `# TYPE` lines, then its samples. Label values and help texts are
//! escaped as the format requires; a histogram is given per-bucket counts
//! and written with cumulative `_bucket` lines, the `+Inf` bucket, `_sum`
//! and `_count`.
//!
//! ```
//! use svc_kit::prom::{Buckets, Kind, Text};
//!
//! let mut t = Text::new();
//! t.counter("demo_requests_total", "Requests answered.", 3u64);
//! t.family("demo_bytes_total", Kind::Counter, "Bytes moved.")
//!     .sample(&[("op", "read")], 4096u64)
//!     .sample(&[("op", "write")], 0u64);
//! let b = Buckets { bounds: &[0.001, 0.01], counts: &[2, 0, 1], sum: 0.5 };
//! t.family("demo_seconds", Kind::Histogram, "Latency.").histogram(&[("op", "read")], &b);
//! let text = t.finish();
//! assert!(text.contains("demo_bytes_total{op=\"read\"} 4096\n"));
//! assert!(text.contains("demo_seconds_bucket{op=\"read\",le=\"+Inf\"} 3\n"));
//! ```

use std::fmt::{self, Write as _};

/// A family's `# TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (names end in `_total`).
    Counter,
    /// A value at this moment.
    Gauge,
    /// Observations counted into buckets.
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A sample's value, written exactly: integers as integers, floats in
/// Rust's shortest round-trip form, infinities as `+Inf`/`-Inf`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// A count or size.
    U64(u64),
    /// A gauge that may go below zero.
    I64(i64),
    /// Seconds, ratios.
    F64(f64),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}

impl From<u32> for Value {
    fn from(v: u32) -> Self {
        Value::U64(v.into())
    }
}

impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::U64(v as u64)
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::I64(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::F64(v)
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) if v.is_nan() => f.write_str("NaN"),
            Value::F64(v) if v == f64::INFINITY => f.write_str("+Inf"),
            Value::F64(v) if v == f64::NEG_INFINITY => f.write_str("-Inf"),
            Value::F64(v) => write!(f, "{v}"),
        }
    }
}

/// One histogram's observations: `counts[i]` fell at or below `bounds[i]`
/// (and above the bound before), `counts[bounds.len()]` above every bound.
/// The counts are per bucket; the renderer makes them cumulative.
#[derive(Debug, Clone, Copy)]
pub struct Buckets<'a> {
    /// Upper bounds (`le`), ascending, without `+Inf`.
    pub bounds: &'a [f64],
    /// Observations per bucket: `bounds.len() + 1` entries, the last above every bound.
    pub counts: &'a [u64],
    /// The sum of every observation.
    pub sum: f64,
}

/// A `/metrics` page being written.
#[derive(Debug, Default)]
pub struct Text {
    out: String,
}

impl Text {
    /// An empty page.
    pub fn new() -> Self {
        Text::default()
    }

    /// Starts a family: writes its `# HELP` and `# TYPE` lines. Its samples
    /// follow through the returned [`Family`].
    pub fn family<'t>(&'t mut self, name: &'t str, kind: Kind, help: &str) -> Family<'t> {
        debug_assert!(is_metric_name(name), "bad metric name {name:?}");
        let _ = writeln!(self.out, "# HELP {name} {}", Escaped { text: help, quotes: false });
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.as_str());
        Family { out: &mut self.out, name }
    }

    /// A counter family with one unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: impl Into<Value>) {
        self.family(name, Kind::Counter, help).sample(&[], value);
    }

    /// A gauge family with one unlabelled sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: impl Into<Value>) {
        self.family(name, Kind::Gauge, help).sample(&[], value);
    }

    /// The page.
    pub fn finish(self) -> String {
        self.out
    }
}

/// The samples of one family, written as they are given.
#[derive(Debug)]
pub struct Family<'t> {
    out: &'t mut String,
    name: &'t str,
}

impl Family<'_> {
    /// One sample: `name{labels} value`.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl Into<Value>) -> &mut Self {
        write_sample(self.out, self.name, "", labels, None, value.into());
        self
    }

    /// One histogram (of a [`Kind::Histogram`] family): a cumulative
    /// `_bucket` line per bound, the `+Inf` bucket, `_sum` and `_count`.
    pub fn histogram(&mut self, labels: &[(&str, &str)], b: &Buckets<'_>) -> &mut Self {
        debug_assert_eq!(b.counts.len(), b.bounds.len() + 1, "one count per bound and one above them");
        let mut cumulative = 0u64;
        for (i, le) in b.bounds.iter().enumerate() {
            cumulative += b.counts.get(i).copied().unwrap_or(0);
            let le = Value::F64(*le).to_string();
            write_sample(self.out, self.name, "_bucket", labels, Some(&le), cumulative.into());
        }
        cumulative += b.counts.get(b.bounds.len()..).map_or(0, |rest| rest.iter().sum());
        write_sample(self.out, self.name, "_bucket", labels, Some("+Inf"), cumulative.into());
        write_sample(self.out, self.name, "_sum", labels, None, b.sum.into());
        write_sample(self.out, self.name, "_count", labels, None, cumulative.into());
        self
    }
}

fn write_sample(out: &mut String, name: &str, suffix: &str, labels: &[(&str, &str)], le: Option<&str>, v: Value) {
    let _ = write!(out, "{name}{suffix}");
    let le = le.map(|le| ("le", le));
    let mut all = labels.iter().copied().chain(le).peekable();
    if all.peek().is_some() {
        out.push('{');
        for (i, (k, v)) in all.enumerate() {
            debug_assert!(is_label_name(k), "bad label name {k:?}");
            let sep = if i == 0 { "" } else { "," };
            let _ = write!(out, "{sep}{k}=\"{}\"", Escaped { text: v, quotes: true });
        }
        out.push('}');
    }
    let _ = writeln!(out, " {v}");
}

/// A help text (`\` and newline escaped) or label value (`"` too).
struct Escaped<'a> {
    text: &'a str,
    quotes: bool,
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.text.chars() {
            match c {
                '\\' => f.write_str("\\\\")?,
                '\n' => f.write_str("\\n")?,
                '"' if self.quotes => f.write_str("\\\"")?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
fn is_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`
fn is_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_and_a_gauge_have_help_type_and_value() {
        let mut t = Text::new();
        t.counter("x_requests_total", "Requests answered.", 7u64);
        t.gauge("x_connections", "Open connections.", -1i64);
        assert_eq!(
            t.finish(),
            "# HELP x_requests_total Requests answered.\n# TYPE x_requests_total counter\nx_requests_total 7\n\
             # HELP x_connections Open connections.\n# TYPE x_connections gauge\nx_connections -1\n"
        );
    }

    #[test]
    fn label_values_and_help_texts_are_escaped() {
        let mut t = Text::new();
        t.family("x_total", Kind::Counter, "a \\ b\nc \"q\"").sample(&[("path", "a\\b\"c\nd"), ("op", "r")], 1u64);
        let text = t.finish();
        // In help, only backslash and newline are escaped; quotes stay.
        assert!(text.starts_with("# HELP x_total a \\\\ b\\nc \"q\"\n"), "{text}");
        assert!(text.ends_with("x_total{path=\"a\\\\b\\\"c\\nd\",op=\"r\"} 1\n"), "{text}");
        assert_eq!(text.lines().count(), 3, "no raw newline leaks into the page: {text}");
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_end_with_inf_sum_and_count() {
        let mut t = Text::new();
        let b = Buckets { bounds: &[0.000025, 0.5, 1.0], counts: &[1, 0, 2, 4], sum: 12.25 };
        t.family("x_seconds", Kind::Histogram, "Latency.").histogram(&[("op", "read")], &b);
        let text = t.finish();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "# HELP x_seconds Latency.",
                "# TYPE x_seconds histogram",
                "x_seconds_bucket{op=\"read\",le=\"0.000025\"} 1",
                "x_seconds_bucket{op=\"read\",le=\"0.5\"} 1",
                "x_seconds_bucket{op=\"read\",le=\"1\"} 3",
                "x_seconds_bucket{op=\"read\",le=\"+Inf\"} 7",
                "x_seconds_sum{op=\"read\"} 12.25",
                "x_seconds_count{op=\"read\"} 7",
            ]
        );
    }

    #[test]
    fn an_unlabelled_histogram_has_only_le() {
        let mut t = Text::new();
        t.family("y_seconds", Kind::Histogram, "h")
            .histogram(&[], &Buckets { bounds: &[1.0], counts: &[0, 0], sum: 0.0 });
        let text = t.finish();
        assert!(text.contains("\ny_seconds_bucket{le=\"1\"} 0\ny_seconds_bucket{le=\"+Inf\"} 0\n"), "{text}");
        assert!(text.ends_with("y_seconds_sum 0\ny_seconds_count 0\n"), "{text}");
    }

    #[test]
    fn values_are_written_exactly() {
        assert_eq!(Value::from(u64::MAX).to_string(), "18446744073709551615");
        assert_eq!(Value::from(i64::MIN).to_string(), "-9223372036854775808");
        assert_eq!(Value::from(0.00001).to_string(), "0.00001");
        assert_eq!(Value::from(2.0).to_string(), "2");
        assert_eq!(Value::from(f64::INFINITY).to_string(), "+Inf");
        assert_eq!(Value::from(f64::NEG_INFINITY).to_string(), "-Inf");
        assert_eq!(Value::from(f64::NAN).to_string(), "NaN");
    }

    #[test]
    fn names_follow_the_format() {
        assert!(is_metric_name("coronafs_nbd_requests_total"));
        assert!(is_metric_name("job:rate5m"));
        assert!(!is_metric_name("9lives"));
        assert!(!is_metric_name("a-b"));
        assert!(!is_metric_name(""));
        assert!(is_label_name("op") && is_label_name("_x1"));
        assert!(!is_label_name("a:b") && !is_label_name("1a"));
    }
}
