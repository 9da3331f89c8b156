//! Wording shared by every report: a count with its noun in the right number.

use std::fmt::Display;

/// `n` followed by `noun`, plural unless `n` is 1: `count(1, "iteration")` is
/// "1 iteration", `count(3, "iteration")` "3 iterations". Only for nouns
/// whose plural adds an `s` (every noun the reports count).
pub fn count<N: Display + PartialEq + From<u8>>(n: N, noun: &str) -> String {
    if n == N::from(1) { format!("{n} {noun}") } else { format!("{n} {noun}s") }
}

#[cfg(test)]
mod tests {
    use super::count;

    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(count(1usize, "iteration"), "1 iteration");
        assert_eq!(count(0u64, "regression"), "0 regressions");
        assert_eq!(count(3u32, "figure"), "3 figures");
    }
}
