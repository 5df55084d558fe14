//! Durations and timestamps on the command line.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use onceonly::{Clock as _, SystemClock};

/// Parses `7d`, `12h`, `90min`, `1w 2d` (humantime syntax).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 7d, 12h, 90min)"))
}

/// Now, in ms since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemClock.now_ms()
}

/// `now - age` in ms since the Unix epoch.
pub fn before_now(age: Duration) -> i64 {
    now_ms().saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX))
}

/// 10000-01-01T00:00:00Z: RFC 3339 has four-digit years.
const YEAR_10000_MS: i64 = 253_402_300_800_000;

/// An epoch-ms timestamp as RFC 3339 UTC with milliseconds; `never` from
/// the year 10000 on (a retention of `Duration::MAX`).
pub fn rfc3339(ms: i64) -> String {
    if ms >= YEAR_10000_MS {
        return "never".to_owned();
    }
    let t = UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_millis(t).to_string()
}

/// Like [`rfc3339`], to the second.
pub fn rfc3339_seconds(ms: i64) -> String {
    let mut s = rfc3339(ms);
    if s.len() == 24 {
        s.replace_range(19..23, "");
    }
    s
}

/// A short human age, e.g. `3d 4h`, of a timestamp relative to now.
pub fn age(ms: i64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    let ms = u128::try_from(ms).unwrap_or(0);
    let secs = u64::try_from(now.saturating_sub(ms) / 1000).unwrap_or(u64::MAX);
    let d = Duration::from_secs(secs);
    // Keep the two largest units: "3days 4h 12m 5s" -> "3days 4h".
    let full = humantime::format_duration(d).to_string();
    full.split(' ').take(2).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(parse_duration("seven days").is_err());
    }

    #[test]
    fn timestamps_format() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_seconds(1_000), "1970-01-01T00:00:01Z");
        assert_eq!(rfc3339(i64::MAX), "never");
    }
}
