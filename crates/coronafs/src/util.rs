//! Small parsers shared by the CLI, the API and the bench, and the jitter
//! of retry pauses.

use crate::error::{CoronaError, Result};

/// Parses a size such as `4G`, `512M`, `4096`, `1.5G`, `16KiB` (binary units).
pub fn parse_size(input: &str) -> Result<u64> {
    let err = |reason| CoronaError::InvalidSize { input: input.to_owned(), reason };
    let s = input.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err("expected a number, optionally followed by K, M, G or T"));
    }
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => {
            return Err(err("unknown unit; use K, M, G or T (powers of 1024) or plain bytes"));
        }
    };
    let value = if num.contains('.') {
        let f: f64 = num.parse().map_err(|_| err("not a number"))?;
        let v = f * (1u64 << shift) as f64;
        if !v.is_finite() || v >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        v as u64
    } else {
        let n: u64 = num.parse().map_err(|_| err("not a number"))?;
        n.checked_mul(1u64 << shift).ok_or_else(|| err("too large"))?
    };
    Ok(value)
}

/// Longest volume name accepted.
pub const MAX_NAME: usize = 128;

/// Checks a volume name: 1 to 128 of `[A-Za-z0-9._-]`, not starting with a
/// dot or dash. That rules out path separators, `..`, hidden files and the
/// `@` that names snapshots.
pub fn validate_name(name: &str) -> Result<()> {
    let err = |reason| CoronaError::InvalidName { name: name.to_owned(), reason };
    if name.is_empty() {
        return Err(err("must not be empty"));
    }
    if name.len() > MAX_NAME {
        return Err(err("longer than 128 bytes"));
    }
    if name.starts_with('.') || name.starts_with('-') {
        return Err(err("must not start with '.' or '-'"));
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) {
        return Err(err("only letters, digits, '.', '_' and '-' are allowed"));
    }
    Ok(())
}

/// A pause in `[d/2, d)`, different on every call and every node, so tasks
/// whose attempts failed together (failover rounds, resync retries) do not
/// retry together.
pub fn jitter(d: std::time::Duration) -> std::time::Duration {
    use std::hash::BuildHasher;
    let r = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    let half = d / 2;
    half + std::time::Duration::from_nanos(r % (half.as_nanos().max(1) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("16KiB").unwrap(), 16 << 10);
        assert_eq!(parse_size("1T").unwrap(), 1 << 40);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        for bad in ["", "G", "4X", "-1", "99999999999999999999", "20000000T"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn names_reject_paths_and_dots() {
        for ok in ["vm1", "disk-0.raw", "A_b"] {
            validate_name(ok).unwrap();
        }
        for bad in ["", "..", "../x", "a/b", ".hidden", "-x", "a@b", &"x".repeat(129), "spa ce"] {
            assert!(validate_name(bad).is_err(), "{bad:?} should be refused");
        }
    }
}

/// Now as Unix milliseconds (0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
