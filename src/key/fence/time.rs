//! Timestamps of `timestamp:` components: an instant read from RFC 3339,
//! a date-time without an offset, Unix seconds in a string, or a JSON
//! number in the unit its magnitude says; in milliseconds since the Unix
//! epoch, as orders hold them, and back to RFC 3339.

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The unit of a numeric timestamp, by its magnitude: a number carries
/// none, and Avro's `timestamp-millis`, `-micros` and `-nanos` (the value
/// tree keeps the number stored) are as common as JSON's seconds. Below
/// 10^11 it is seconds (until the year 5138), below 10^14 milliseconds,
/// below 10^17 microseconds, nanoseconds above: the same instant in any
/// unit gives the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EpochUnit {
    Seconds,
    Millis,
    Micros,
    Nanos,
}

pub(super) fn epoch_unit(n: &serde_json::Number) -> EpochUnit {
    let magnitude = n.as_f64().map_or(f64::INFINITY, f64::abs);
    if magnitude < 1e11 {
        EpochUnit::Seconds
    } else if magnitude < 1e14 {
        EpochUnit::Millis
    } else if magnitude < 1e17 {
        EpochUnit::Micros
    } else {
        EpochUnit::Nanos
    }
}

impl EpochUnit {
    /// `n`, in this unit, as milliseconds rounded down (`None` out of
    /// range); not for seconds.
    pub(super) fn millis(self, n: &serde_json::Number) -> Option<i64> {
        let per_milli: i64 = match self {
            Self::Seconds | Self::Millis => 1,
            Self::Micros => 1_000,
            Self::Nanos => 1_000_000,
        };
        if let Some(v) = n.as_i64() {
            return Some(v.div_euclid(per_milli));
        }
        if let Some(v) = n.as_u64() {
            return i64::try_from(v / per_milli.unsigned_abs()).ok();
        }
        // A fraction of the unit, or an exponent: through seconds.
        let per_second = 1_000.0 * per_milli as f64;
        float_millis(n.as_f64().map(|f| f / per_second))
    }
}

/// `text` as decimal Unix seconds (`1714528800`, `-1.5`,
/// `1714528800.123456`) in milliseconds, rounded down; `None` when it is
/// not such a number, `Some(Err)` when it is out of range.
pub(super) fn unix_millis(text: &str) -> Option<Result<i64, &'static str>> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = match digits.split_once('.') {
        Some((w, f)) => (w, f),
        None => (digits, ""),
    };
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if whole.is_empty()
        || !all_digits(whole)
        || !all_digits(fraction)
        || (digits.contains('.') && fraction.is_empty())
    {
        return None;
    }
    let mut millis_part: i64 = 0;
    for i in 0..3 {
        let digit = fraction.as_bytes().get(i).map_or(0, |b| b - b'0');
        millis_part = millis_part * 10 + i64::from(digit);
    }
    let finer = fraction.bytes().skip(3).any(|b| b != b'0');
    let range = "out of range";
    let Ok(seconds) = whole.parse::<i64>() else {
        return Some(Err(range));
    };
    let Some(abs) = seconds
        .checked_mul(1000)
        .and_then(|ms| ms.checked_add(millis_part))
    else {
        return Some(Err(range));
    };
    if !negative {
        return Some(Ok(abs));
    }
    // Rounded down: -1.0005 s is -1001 ms.
    Some(
        0i64.checked_sub(abs)
            .and_then(|v| v.checked_sub(i64::from(finer)))
            .ok_or(range),
    )
}

/// Unix seconds given as a float (with an exponent) in milliseconds,
/// rounded down; `None` out of range.
pub(super) fn float_millis(seconds: Option<f64>) -> Option<i64> {
    // i64::MAX is not a float; 2^63 is, and is out of range.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    let millis = (seconds? * 1000.0).floor();
    // In range and integral: the cast is exact.
    (millis.is_finite() && (-LIMIT..LIMIT).contains(&millis)).then_some(millis as i64)
}

/// An RFC 3339 date-time, or one without an offset read at `offset`
/// seconds east of UTC, in milliseconds since the epoch (rounded down).
pub(super) fn datetime_millis(text: &str, offset: i32) -> Option<i64> {
    // `time` takes any byte between date and time; only these are dates.
    let separator = *text.as_bytes().get(10)?;
    if !matches!(separator, b'T' | b't' | b' ') {
        return None;
    }
    let normalized = if separator == b' ' {
        format!("{}T{}", text.get(..10)?, text.get(11..)?)
    } else {
        text.to_owned()
    };
    if let Ok(at) = OffsetDateTime::parse(&normalized, &Rfc3339) {
        return millis_of(at);
    }
    let at = OffsetDateTime::parse(&format!("{normalized}Z"), &Rfc3339).ok()?;
    millis_of(at)?.checked_sub(i64::from(offset) * 1000)
}

fn millis_of(at: OffsetDateTime) -> Option<i64> {
    i64::try_from(at.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// Milliseconds since the epoch as RFC 3339 in UTC (`2024-05-01T02:00:00Z`,
/// `...00.320Z`), or `<n>ms` outside the years `time` represents.
pub(super) fn format_millis(millis: i64) -> String {
    let Ok(at) = OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis) * 1_000_000) else {
        return format!("{millis}ms");
    };
    let fraction = match millis.rem_euclid(1000) {
        0 => String::new(),
        ms => format!(".{ms:03}"),
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{fraction}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}
