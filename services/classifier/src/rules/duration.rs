//! Durations as rule files write them: `500ms`, `10s`, `3m`, `1h30m`, `7d`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A span of observation time, in microseconds (the engine's unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Interval(pub i64);

impl Interval {
    /// No time at all.
    pub const ZERO: Interval = Interval(0);

    /// The span in microseconds.
    pub fn micros(self) -> i64 {
        self.0
    }

    /// A span of whole seconds.
    pub fn from_secs(secs: i64) -> Interval {
        Interval(secs * 1_000_000)
    }
}

impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The largest unit that divides evenly keeps messages close to what the rule file said.
        let us = self.0;
        for (unit, size) in [("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000)] {
            if us != 0 && us % size == 0 {
                return write!(f, "{}{unit}", us / size);
            }
        }
        if us % 1000 == 0 { write!(f, "{}ms", us / 1000) } else { write!(f, "{us}us") }
    }
}

/// Why a duration could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Nothing was written.
    #[error("empty duration")]
    Empty,
    /// A number without a unit, or an unknown unit.
    #[error("invalid duration `{0}`: expected numbers with units (ms, s, m, h, d), e.g. `3m` or `1h30m`")]
    Invalid(String),
    /// The value does not fit.
    #[error("duration `{0}` is too long")]
    Overflow(String),
}

/// Reads a duration such as `3m`, `10s`, `1h30m` or `250ms`.
pub fn parse_duration(text: &str) -> Result<Interval, DurationError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let invalid = || DurationError::Invalid(s.to_owned());
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total: i64 = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if start == i {
            return Err(invalid());
        }
        let number: i64 = s[start..i].parse().map_err(|_| DurationError::Overflow(s.to_owned()))?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let size: i64 = match &s[unit_start..i] {
            "us" => 1,
            "ms" => 1_000,
            "s" => 1_000_000,
            "m" => 60_000_000,
            "h" => 3_600_000_000,
            "d" => 86_400_000_000,
            _ => return Err(invalid()),
        };
        total = number
            .checked_mul(size)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(|| DurationError::Overflow(s.to_owned()))?;
    }
    Ok(Interval(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_units_and_combinations() {
        assert_eq!(parse_duration("3m"), Ok(Interval::from_secs(180)));
        assert_eq!(parse_duration("10s"), Ok(Interval::from_secs(10)));
        assert_eq!(parse_duration("1h30m"), Ok(Interval::from_secs(5400)));
        assert_eq!(parse_duration("250ms"), Ok(Interval(250_000)));
        assert_eq!(parse_duration("2d"), Ok(Interval::from_secs(172_800)));
        assert_eq!(parse_duration("0s"), Ok(Interval::ZERO));
    }

    #[test]
    fn refuses_missing_or_unknown_units() {
        for bad in ["3", "3x", "m", "3 m", "-1s", "1.5h", "s3"] {
            assert!(matches!(parse_duration(bad), Err(DurationError::Invalid(_))), "{bad}");
        }
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(parse_duration("99999999999999999999d"), Err(DurationError::Overflow(_))));
    }

    #[test]
    fn displays_in_the_largest_even_unit() {
        assert_eq!(Interval::from_secs(180).to_string(), "3m");
        assert_eq!(Interval::from_secs(90).to_string(), "90s");
        assert_eq!(Interval(1500).to_string(), "1500us");
        assert_eq!(Interval(2000).to_string(), "2ms");
    }
}
