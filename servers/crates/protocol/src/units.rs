//! The one grammar of size and duration strings, for the server's flags and (through the client
//! core) every size and duration the Python package reads: config files, environment variables,
//! CLI flags and job hints. `tests/vectors/units.json` (at the repository root) holds the cases
//! both test suites check.
//!
//! A quantity is a non-negative decimal number (`64`, `1.5`, `.5`), optional blanks, and an
//! optional unit, case-insensitive:
//! - sizes: `B`, `kB` `MB` `GB` `TB` (powers of 1000), `KiB` `MiB` `GiB` `TiB` (powers of 1024);
//!   no unit is bytes. The value must come to a whole number of bytes (`1.5KiB` is 1536 bytes,
//!   `0.5B` is an error) and fit in 64 bits.
//! - durations: `us`, `ms`, `s`, `m` or `min`, `h`; no unit is seconds. The value must come to a
//!   whole number of nanoseconds and fit in 64 bits of them (about 584 years).
//!
//! The arithmetic is exact (integers, never floating point), so `0.1kB` is 100 bytes on every
//! platform. Range checks (a size above zero, a duration within a flag's bounds) are the
//! caller's.

use std::time::Duration;

use thiserror::Error;

/// Most digits after the decimal point a quantity may have.
pub const FRACTION_DIGITS_MAX: usize = 18;
/// Longest quantity text, in bytes.
pub const QUANTITY_MAX_BYTES: usize = 64;

const SIZE_UNITS: [(&str, u128); 10] = [
    ("", 1),
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

const NANOS_PER_SECOND: u128 = 1_000_000_000;
const DURATION_UNITS: [(&str, u128); 7] = [
    ("", NANOS_PER_SECOND),
    ("us", 1_000),
    ("ms", 1_000_000),
    ("s", NANOS_PER_SECOND),
    ("m", 60 * NANOS_PER_SECOND),
    ("min", 60 * NANOS_PER_SECOND),
    ("h", 3_600 * NANOS_PER_SECOND),
];

/// A size or duration string that does not follow the grammar, or whose value is out of range.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct UnitsError(pub String);

/// `text` as `(number scaled by 10^fraction digits, fraction digits, unit lower-cased)`.
fn split(text: &str) -> Option<(u128, u32, String)> {
    if text.len() > QUANTITY_MAX_BYTES {
        return None;
    }
    let text = text.trim();
    let number_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(number_end);
    let unit = unit.trim_start();
    if !unit.chars().all(|c| c.is_ascii_alphabetic()) {
        return None;
    }
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty())
        || fraction.contains('.')
        || fraction.len() > FRACTION_DIGITS_MAX
    {
        return None;
    }
    let mut scaled: u128 = 0;
    for digit in whole.bytes().chain(fraction.bytes()) {
        scaled = scaled
            .checked_mul(10)?
            .checked_add(u128::from(digit - b'0'))?;
    }
    Some((scaled, fraction.len() as u32, unit.to_ascii_lowercase()))
}

/// `scaled / 10^digits * per_unit`, when that is whole.
fn exact(scaled: u128, digits: u32, per_unit: u128) -> Option<u128> {
    let product = scaled.checked_mul(per_unit)?;
    let divisor = 10u128.pow(digits);
    (product % divisor == 0).then_some(product / divisor)
}

/// Parse a size in bytes (see the module doc): `"64MiB"`, `"1.5 GB"`, `"4096"`.
pub fn parse_size(text: &str) -> Result<u64, UnitsError> {
    let (scaled, digits, unit) = split(text).ok_or_else(|| {
        UnitsError(format!(
            "cannot parse size {:?}: expected a number and one of B, kB, MB, GB, TB, KiB, \
             MiB, GiB, TiB (e.g. 64MiB or 1.5 GB)",
            clipped(text)
        ))
    })?;
    let per_unit = SIZE_UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, bytes)| *bytes)
        .ok_or_else(|| {
            UnitsError(format!(
                "size {:?} has unknown unit {unit:?}; use B, kB, MB, GB, TB, KiB, MiB, GiB or TiB",
                clipped(text)
            ))
        })?;
    let bytes = exact(scaled, digits, per_unit).ok_or_else(|| {
        UnitsError(format!(
            "size {:?} is not a whole number of bytes",
            clipped(text)
        ))
    })?;
    u64::try_from(bytes).map_err(|_| UnitsError(format!("size {:?} is too large", clipped(text))))
}

/// Parse a duration (see the module doc): `"30s"`, `"500ms"`, `"1.5h"`, `"2"` (seconds).
pub fn parse_duration(text: &str) -> Result<Duration, UnitsError> {
    let (scaled, digits, unit) = split(text).ok_or_else(|| {
        UnitsError(format!(
            "cannot parse duration {:?}: expected a number and one of us, ms, s, m, min, h \
             (e.g. 30s or 500ms)",
            clipped(text)
        ))
    })?;
    let per_unit = DURATION_UNITS
        .iter()
        .find(|(name, _)| *name == unit)
        .map(|(_, nanos)| *nanos)
        .ok_or_else(|| {
            UnitsError(format!(
                "duration {:?} has unknown unit {unit:?}; use us, ms, s, m, min or h",
                clipped(text)
            ))
        })?;
    let nanos = exact(scaled, digits, per_unit).ok_or_else(|| {
        UnitsError(format!(
            "duration {:?} is not a whole number of nanoseconds",
            clipped(text)
        ))
    })?;
    u64::try_from(nanos)
        .map(Duration::from_nanos)
        .map_err(|_| UnitsError(format!("duration {:?} is too long", clipped(text))))
}

/// At most the first 64 characters of `text`, for an error message.
fn clipped(text: &str) -> &str {
    text.char_indices()
        .nth(QUANTITY_MAX_BYTES)
        .map_or(text, |(end, _)| &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse_exactly() {
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size(" 1.5 GB "), Ok(1_500_000_000));
        assert_eq!(parse_size("0.1kB"), Ok(100));
        assert_eq!(parse_size(".5KiB"), Ok(512));
        assert!(parse_size("0.5B").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("16EiB").is_err());
        assert!(parse_size("17179869184GiB").is_err());
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("1.5ns").is_err());
        assert!(parse_duration("1e3s").is_err());
        assert!(parse_duration(&"9".repeat(QUANTITY_MAX_BYTES + 1)).is_err());
    }
}
