//! Loading a service's TOML config file, the same way for every service.
//!
//! A config struct is a serde type with `deny_unknown_fields`. This module
//! reads the file, parses it, and reports every failure with the file's
//! path; a parse error also gets the line and column, toml's message
//! (which for an unknown field names the field) and the line it is on
//! (which names the key of a bad value):
//!
//! ```text
//! cannot read /etc/coronafs.toml: No such file or directory (os error 2)
//! /etc/coronafs.toml:3:1: unknown field `data-dir`, expected one of `data_dir`, ... (in `data-dir = "/srv"`)
//! /etc/coronafs.toml:2:7: invalid socket address syntax (in `nbd = "10.0.0.1"`)
//! cluster.toml: invalid configuration: a cluster needs at least one node
//! ```
//!
//! [`load`] is for a file that flags may override: the service validates the
//! merged settings, since a flag (or the environment) may supply what the
//! file lacks. [`load_validated`] is for a file that is the whole
//! configuration: it runs the struct's `validate()` and names the file in
//! the error. Each service crate converts [`ConfigError`] into its own error
//! enum.

use serde::de::DeserializeOwned;
use std::fmt;
use std::path::Path;

/// Why a config file (or text) could not be used.
#[derive(Debug)]
pub enum ConfigError {
    /// The file could not be read.
    Read {
        /// The file's path as given.
        file: String,
        /// What the OS said.
        error: std::io::Error,
    },
    /// The text is not TOML or does not fit the struct (unknown field,
    /// missing field, wrong type, bad value).
    Parse {
        /// The file's path, or the name of a built-in text; `None` for text
        /// of no particular origin.
        file: Option<String>,
        /// 1-based line and column (in characters) where toml located the error.
        at: Option<(usize, usize)>,
        /// toml's message, on one line.
        message: String,
        /// The line the error is on, trimmed (and cut at 80 characters): it
        /// names the key when toml's message only says what is wrong with a value.
        excerpt: Option<String>,
    },
    /// The file parsed but breaks a rule of the struct's `validate()`.
    Invalid {
        /// The file's path as given.
        file: String,
        /// What `validate()` said.
        message: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { file, error } => write!(f, "cannot read {file}: {error}"),
            ConfigError::Parse { file, at, message, excerpt } => {
                match (file, at) {
                    (Some(file), Some((line, col))) => write!(f, "{file}:{line}:{col}: ")?,
                    (Some(file), None) => write!(f, "{file}: ")?,
                    (None, Some((line, col))) => write!(f, "TOML line {line}, column {col}: ")?,
                    (None, None) => write!(f, "TOML: ")?,
                }
                f.write_str(message)?;
                match excerpt {
                    Some(excerpt) => write!(f, " (in `{excerpt}`)"),
                    None => Ok(()),
                }
            }
            ConfigError::Invalid { file, message } => write!(f, "{file}: {message}"),
        }
    }
}

// The OS error is part of the message, not a `source()`: a caller printing
// the chain (anyhow's `{:?}`) would otherwise show it twice.
impl std::error::Error for ConfigError {}

/// Reads a config file to a string.
pub fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|error| ConfigError::Read { file: path.display().to_string(), error })
}

/// Parses TOML text of no particular origin (tests, text received over RPC).
pub fn parse<T: DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    parse_from(None, text)
}

/// Parses TOML text that came from `file` (a path, or the name of a built-in
/// text), naming it in the error.
pub fn parse_named<T: DeserializeOwned>(file: &str, text: &str) -> Result<T, ConfigError> {
    parse_from(Some(file), text)
}

fn parse_from<T: DeserializeOwned>(file: Option<&str>, text: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.map(str::to_owned),
        at: e.span().map(|span| line_col(text, span.start)),
        message: e.message().trim_end().replace('\n', "; "),
        excerpt: e.span().and_then(|span| excerpt(text, span.start)),
    })
}

/// The line holding byte `offset`, trimmed and cut to 80 characters; `None` if blank.
fn excerpt(text: &str, offset: usize) -> Option<String> {
    let (line, _) = line_col(text, offset);
    let whole = text.lines().nth(line - 1)?.trim();
    let mut cut: String = whole.chars().take(80).collect();
    if cut.len() < whole.len() {
        cut.push_str("...");
    }
    (!cut.is_empty()).then_some(cut)
}

/// Reads and parses a config file whose settings flags may still override
/// (the caller validates the merged result).
pub fn load<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    parse_named(&path.display().to_string(), &read(path)?)
}

/// Reads, parses and validates a config file that is the whole
/// configuration; `validate` is the struct's `validate()`.
pub fn load_validated<T, E>(path: &Path, validate: impl FnOnce(&T) -> Result<(), E>) -> Result<T, ConfigError>
where
    T: DeserializeOwned,
    E: fmt::Display,
{
    let value = load(path)?;
    // `{:#}` keeps the whole chain of an anyhow error (the bench's validators).
    validate(&value)
        .map_err(|e| ConfigError::Invalid { file: path.display().to_string(), message: format!("{e:#}") })?;
    Ok(value)
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (before.matches('\n').count() + 1, before[line_start..].chars().count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Settings {
        name: String,
        #[serde(default)]
        port: u16,
    }

    fn no_empty_name(s: &Settings) -> Result<(), String> {
        if s.name.is_empty() { Err("name must not be empty".into()) } else { Ok(()) }
    }

    fn file_with(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("svc.toml");
        std::fs::write(&path, text).expect("write");
        (dir, path)
    }

    #[test]
    fn a_good_file_loads_and_validates() {
        let (_dir, path) = file_with("name = \"a\"\nport = 7\n");
        let s: Settings = load_validated(&path, no_empty_name).expect("valid");
        assert_eq!(s, Settings { name: "a".into(), port: 7 });
    }

    #[test]
    fn a_missing_file_names_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("nowhere.toml");
        let e = load::<Settings>(&path).expect_err("refused");
        assert!(matches!(e, ConfigError::Read { .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with(&format!("cannot read {}: ", path.display())), "{text}");
        assert!(text.contains("No such file"), "{text}");
    }

    #[test]
    fn a_syntax_error_names_the_path_line_and_column() {
        let (_dir, path) = file_with("name = \"a\"\n\nport = = 3\n");
        let e = load::<Settings>(&path).expect_err("refused");
        let text = e.to_string();
        assert!(text.starts_with(&format!("{}:3:", path.display())), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
    }

    #[test]
    fn an_unknown_field_names_the_field_the_path_and_where_it_is() {
        let (_dir, path) = file_with("name = \"a\"\n  bogus = 1\n");
        let text = load::<Settings>(&path).expect_err("refused").to_string();
        assert!(text.starts_with(&format!("{}:2:3: ", path.display())), "{text}");
        assert!(text.contains("unknown field `bogus`"), "{text}");
        assert!(text.ends_with(" (in `bogus = 1`)"), "{text}");
    }

    #[test]
    fn a_bad_value_is_shown_with_its_line_so_the_key_is_named() {
        let e = parse::<Settings>("name = \"a\"\nport = 70000\n").expect_err("refused").to_string();
        assert!(e.starts_with("TOML line 2, column 8: "), "{e}");
        assert!(e.ends_with(" (in `port = 70000`)"), "{e}");
        let long = format!("name = \"{}\"\nport = \"x\"\n", "n".repeat(200));
        let e = parse::<Settings>(&long).expect_err("refused").to_string();
        assert!(e.contains("(in `port = \"x\"`)"), "{e}");
        assert_eq!(excerpt(&long, 3).map(|x| x.chars().count()), Some(83), "cut at 80 characters and ...");
        assert_eq!(excerpt("a = 1\n\n", 6), None);
    }

    #[test]
    fn a_wrong_type_and_a_missing_field_are_parse_errors() {
        let e = parse::<Settings>("name = \"a\"\nport = \"x\"\n").expect_err("refused");
        assert!(e.to_string().starts_with("TOML line 2, column 8: "), "{e}");
        let e = parse_named::<Settings>("seed-000", "port = 1\n").expect_err("refused");
        assert!(e.to_string().starts_with("seed-000"), "{e}");
        assert!(e.to_string().contains("name"), "{e}");
    }

    #[test]
    fn a_validation_failure_names_the_path() {
        let (_dir, path) = file_with("name = \"\"\n");
        let e = load_validated(&path, no_empty_name).expect_err("refused");
        assert!(matches!(e, ConfigError::Invalid { .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("{}: name must not be empty", path.display()));
        // Only `load_validated` validates: `load` leaves it to the caller.
        assert_eq!(load::<Settings>(&path).expect("parses").name, "");
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        assert_eq!(line_col("a = \"é\"\nb", 9), (2, 1));
        assert_eq!(line_col("ééx", 4), (1, 3));
        assert_eq!(line_col("ééx", 3), (1, 2), "inside a character: the character's column");
        assert_eq!(line_col("ab", 99), (1, 3));
    }
}
