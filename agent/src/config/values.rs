//! Value types of `KubeProxyConfiguration` written in Go's own syntax: durations
//! (`metav1.Duration`, Go's `time.ParseDuration` / `Duration.String`), the logging flush
//! frequency (a duration string or a number of nanoseconds) and resource quantities.
//! Parsing follows Go so that a file kube-proxy accepts is read the same way, and printing
//! follows Go so that the effective configuration reads like kube-proxy's.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A Go `time.Duration`: signed nanoseconds. Negative values parse (Go allows them) so that
/// validation can reject them with the field's name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct GoDuration(pub i64);

impl GoDuration {
    pub const ZERO: GoDuration = GoDuration(0);

    pub const fn from_secs(secs: i64) -> GoDuration {
        GoDuration(secs * NANOS_PER_SEC as i64)
    }

    pub fn is_zero(self) -> bool {
        self.0 == 0
    }

    /// The duration, or `None` when negative.
    pub fn to_std(self) -> Option<Duration> {
        u64::try_from(self.0).ok().map(Duration::from_nanos)
    }

    /// Whole seconds, truncated like Go's `d / time.Second`.
    pub fn whole_secs(self) -> i64 {
        self.0 / NANOS_PER_SEC as i64
    }

    /// Go's `time.ParseDuration`: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, or a bare `0`.
    pub fn parse(s: &str) -> Result<GoDuration, String> {
        let invalid = || format!("{s:?} is not a duration such as \"30s\", \"1m30s\" or \"500ms\"");
        let (negative, rest) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        if rest == "0" {
            return Ok(GoDuration::ZERO);
        }
        if rest.is_empty() {
            return Err(invalid());
        }
        let mut total: u128 = 0;
        let mut rest = rest;
        while !rest.is_empty() {
            let (nanos, tail) = parse_component(rest).ok_or_else(invalid)?;
            total = total.saturating_add(nanos);
            rest = tail;
            if total > 1u128 << 63 {
                return Err(format!("{s:?} is too long a duration"));
            }
        }
        let signed = if negative {
            -(total as i128)
        } else {
            total as i128
        };
        i64::try_from(signed)
            .map(GoDuration)
            .map_err(|_| format!("{s:?} is too long a duration"))
    }
}

/// One `<number><unit>` of a Go duration: its nanoseconds and the rest of the text.
fn parse_component(s: &str) -> Option<(u128, &str)> {
    let int_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (int_digits, mut rest) = s.split_at(int_end);
    let mut frac_digits = "";
    if let Some(after_dot) = rest.strip_prefix('.') {
        let end = after_dot
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after_dot.len());
        (frac_digits, rest) = after_dot.split_at(end);
    } else if int_digits.is_empty() {
        return None;
    }
    if int_digits.is_empty() && frac_digits.is_empty() {
        return None;
    }
    let unit_end = rest
        .find(|c: char| c.is_ascii_digit() || c == '.')
        .unwrap_or(rest.len());
    let (unit, rest) = rest.split_at(unit_end);
    let unit = unit_nanos(unit)?;
    let int: u128 = if int_digits.is_empty() {
        0
    } else {
        int_digits.parse().ok()?
    };
    let nanos = int
        .checked_mul(unit)?
        .checked_add(fraction_nanos(frac_digits, unit))?;
    Some((nanos, rest))
}

/// The nanoseconds of `0.<digits>` units, computed in floating point as Go does.
fn fraction_nanos(digits: &str, unit: u128) -> u128 {
    // Go stops accumulating digits once more would overflow; 18 digits always fit.
    let kept = &digits[..digits.len().min(18)];
    let Ok(value) = kept.parse::<u64>() else {
        return 0;
    };
    let scale = 10f64.powi(kept.len() as i32);
    (value as f64 * (unit as f64 / scale)) as u128
}

fn unit_nanos(unit: &str) -> Option<u128> {
    Some(match unit {
        "ns" => 1,
        "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return None,
    })
}

/// Go's `Duration.String()`: `0s`, `500ms`, `1.5s`, `1m30s`, `24h0m0s`.
impl fmt::Display for GoDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let nanos = self.0.unsigned_abs();
        if nanos == 0 {
            return f.write_str("0s");
        }
        if nanos < NANOS_PER_SEC {
            // Below a second Go switches to the largest unit that keeps an integer part.
            let (unit, digits) = match nanos {
                n if n < 1_000 => ("ns", 0),
                n if n < 1_000_000 => ("\u{b5}s", 3),
                _ => ("ms", 6),
            };
            let (whole, frac) = split_fraction(nanos, digits);
            return write!(f, "{sign}{whole}{frac}{unit}");
        }
        // Go prints minutes only from a minute on, and hours only from an hour on.
        let (total_secs, frac) = split_fraction(nanos, 9);
        let (secs, total_minutes) = (total_secs % 60, total_secs / 60);
        let (minutes, hours) = (total_minutes % 60, total_minutes / 60);
        match (hours, total_minutes) {
            (0, 0) => write!(f, "{sign}{secs}{frac}s"),
            (0, _) => write!(f, "{sign}{minutes}m{secs}{frac}s"),
            _ => write!(f, "{sign}{hours}h{minutes}m{secs}{frac}s"),
        }
    }
}

/// Splits `value` into its integer part above `digits` decimal places and the fraction,
/// printed as Go does: `.5`, `.25`, or nothing when the fraction is zero.
fn split_fraction(value: u64, digits: u32) -> (u64, String) {
    let scale = 10u64.pow(digits);
    let (whole, frac) = (value / scale, value % scale);
    if frac == 0 {
        return (whole, String::new());
    }
    let text = format!("{frac:0width$}", width = digits as usize);
    (whole, format!(".{}", text.trim_end_matches('0')))
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<GoDuration, D::Error> {
        d.deserialize_any(DurationVisitor {
            nanos_allowed: false,
        })
        .map(|f| f.duration)
    }
}

/// Reads a duration string, and a number of nanoseconds where Go's type accepts one.
struct DurationVisitor {
    nanos_allowed: bool,
}

impl DurationVisitor {
    fn nanos<E: de::Error>(&self, n: i128) -> Result<FlushFrequency, E> {
        if !self.nanos_allowed {
            return Err(E::custom(format!(
                "{n} is not a duration string such as \"30s\" (a unit is required)"
            )));
        }
        let nanos = i64::try_from(n).map_err(|_| E::custom(format!("{n} is out of range")))?;
        Ok(FlushFrequency {
            duration: GoDuration(nanos),
            as_string: false,
        })
    }
}

impl Visitor<'_> for DurationVisitor {
    type Value = FlushFrequency;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as \"30s\"")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<FlushFrequency, E> {
        let duration = GoDuration::parse(v).map_err(E::custom)?;
        Ok(FlushFrequency {
            duration,
            as_string: true,
        })
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<FlushFrequency, E> {
        self.nanos(v.into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<FlushFrequency, E> {
        self.nanos(v.into())
    }
}

/// `logging.flushFrequency`: a duration string, or a number of nanoseconds; printed back
/// the way it was given (Go keeps the form, and prints its own default as a string).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlushFrequency {
    pub duration: GoDuration,
    /// Written as a string (`"5s"`) rather than a number of nanoseconds.
    pub as_string: bool,
}

impl Default for FlushFrequency {
    fn default() -> FlushFrequency {
        FlushFrequency {
            duration: GoDuration::ZERO,
            as_string: true,
        }
    }
}

impl Serialize for FlushFrequency {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.as_string {
            s.collect_str(&self.duration)
        } else {
            s.serialize_i64(self.duration.0)
        }
    }
}

impl<'de> Deserialize<'de> for FlushFrequency {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<FlushFrequency, D::Error> {
        d.deserialize_any(DurationVisitor {
            nanos_allowed: true,
        })
    }
}

/// A Kubernetes resource quantity (`"0"`, `"512"`, `"1Ki"`, `"5M"`), as
/// `logging.options.*.infoBufferSize` takes. Kept as written; only zero-ness matters here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Quantity(pub String);

impl Quantity {
    /// Empty (unset) or a zero amount, whatever the suffix.
    pub fn is_zero(&self) -> bool {
        self.0
            .bytes()
            .take_while(|b| b.is_ascii_digit() || matches!(b, b'.' | b'+' | b'-'))
            .all(|b| !b.is_ascii_digit() || b == b'0')
    }

    /// The syntax of Kubernetes' `resource.ParseQuantity`: a signed decimal number and a
    /// binary (`Ki`..`Ei`), decimal (`n`, `u`, `m`, `k`, `M`..`E`) or exponent suffix.
    fn parse(text: &str) -> Result<Quantity, String> {
        let number_end = text
            .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '+' | '-')))
            .unwrap_or(text.len());
        let (number, suffix) = text.split_at(number_end);
        let digits = number.trim_start_matches(['+', '-']);
        let valid_number = number.len() - digits.len() <= 1
            && digits.bytes().any(|b| b.is_ascii_digit())
            && digits.bytes().filter(|&b| b == b'.').count() <= 1
            && digits.bytes().all(|b| b.is_ascii_digit() || b == b'.');
        if valid_number && valid_quantity_suffix(suffix) {
            Ok(Quantity(text.to_string()))
        } else {
            Err(format!(
                "{text:?} is not a quantity such as \"0\", \"512\", \"64Ki\" or \"1M\""
            ))
        }
    }
}

fn valid_quantity_suffix(suffix: &str) -> bool {
    const SUFFIXES: &[&str] = &[
        "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E",
    ];
    if SUFFIXES.contains(&suffix) {
        return true;
    }
    let Some(exponent) = suffix.strip_prefix(['e', 'E']) else {
        return false;
    };
    let digits = exponent.trim_start_matches(['+', '-']);
    exponent.len() - digits.len() <= 1
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Quantity, D::Error> {
        d.deserialize_any(QuantityVisitor)
    }
}

/// A quantity is a string, or a plain number (Go accepts both).
struct QuantityVisitor;

impl Visitor<'_> for QuantityVisitor {
    type Value = Quantity;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a quantity such as \"0\" or \"64Ki\"")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
        Quantity::parse(v).map_err(E::custom)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
        Ok(Quantity(v.to_string()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
        Ok(Quantity(v.to_string()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Quantity, E> {
        Quantity::parse(&v.to_string()).map_err(E::custom)
    }
}
