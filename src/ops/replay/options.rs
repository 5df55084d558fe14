//! What to replay and how fast: filters, limit, rate, dry run.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::ReplayError;
use super::screen::Screen;

/// Settings shared by the AMQP and Kafka replays. All filters must match
/// for a dead letter to be replayed; repeated values of one filter are
/// alternatives (`reason A or B`).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct ReplayOptions {
    pub(crate) reasons: Vec<String>,
    pub(crate) keys: Vec<String>,
    pub(crate) since: Option<SystemTime>,
    pub(crate) limit: Option<u64>,
    pub(crate) rate: Option<f64>,
    pub(crate) dry_run: bool,
    pub(crate) publish_timeout: Option<Duration>,
    pub(crate) groups: Vec<String>,
    pub(crate) screen: Screen,
    pub(crate) max_replays: Option<u32>,
}

/// Replays after which a letter that failed again is parked instead of
/// replayed (see [`ReplayOptions::max_replays`]).
pub const DEFAULT_MAX_REPLAYS: u32 = 5;

impl ReplayOptions {
    /// Replays everything, as fast as the broker confirms.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only dead letters with this `x-onceonly-reason` (call again to allow
    /// several), e.g. `handler_error`.
    #[must_use]
    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reasons.push(reason.into());
        self
    }

    /// Only dead letters with this `x-onceonly-idempotency-key` (call again
    /// to allow several).
    #[must_use]
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.keys.push(key.into());
        self
    }

    /// Only dead letters first seen at or after `since`: by the
    /// `x-onceonly-first-seen` header, else the message timestamp. A dead
    /// letter with neither does not match.
    #[must_use]
    pub fn since(mut self, since: SystemTime) -> Self {
        self.since = Some(since);
        self
    }

    /// Only dead letters of this failure group (call again to allow
    /// several); ids come from `onceonly dlq groups` or
    /// [`ReplayReport::groups`](super::ReplayReport::groups).
    #[must_use]
    pub fn group(mut self, id: impl Into<String>) -> Self {
        self.groups.push(id.into());
        self
    }

    /// How matching letters are screened: looked up in the dedup table
    /// (verdicts) and refused when older than their scope's retention.
    /// Required: no retention is assumed, so a replay is built only with a
    /// screen that has a [`retention`](Screen::retention), a
    /// [`lookup`](Screen::lookup) (the dedup table tells it), or
    /// [`beyond_retention`](Screen::beyond_retention).
    #[must_use]
    pub fn screen(mut self, screen: Screen) -> Self {
        self.screen = screen;
        self
    }

    /// A letter already replayed `n` times (`x-onceonly-replays`) is moved
    /// to the parking queue or topic (`<source>.parked`) instead of being
    /// replayed again (default [`DEFAULT_MAX_REPLAYS`]).
    #[must_use]
    pub fn max_replays(mut self, n: u32) -> Self {
        self.max_replays = Some(n);
        self
    }

    /// Whether a letter replayed `replays` times before is to be parked.
    pub(crate) fn park(&self, replays: u32) -> bool {
        replays >= self.max_replays.unwrap_or(DEFAULT_MAX_REPLAYS)
    }

    /// Acts on at most `n` matching dead letters (replayed or failed), then
    /// stops reading.
    #[must_use]
    pub fn limit(mut self, n: u64) -> Self {
        self.limit = Some(n);
        self
    }

    /// At most `per_second` republishes per second (evenly spaced).
    #[must_use]
    pub fn rate(mut self, per_second: f64) -> Self {
        self.rate = Some(per_second);
        self
    }

    /// Reads and filters, reports what would be replayed, and leaves every
    /// dead letter where it is (nothing published, acked or committed).
    #[must_use]
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }

    /// How long one republish may wait for the broker's confirmation
    /// (default 30 s); past it, the dead letter counts as failed.
    #[must_use]
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = Some(timeout);
        self
    }

    pub(crate) fn timeout(&self) -> Duration {
        self.publish_timeout.unwrap_or(Duration::from_secs(30))
    }

    pub(crate) fn validate(&self) -> Result<(), ReplayError> {
        if let Some(rate) = self.rate {
            // Between one a day and a million a second: the pacing
            // interval stays a representable, non-zero duration.
            if !(rate.is_finite() && (1.0 / 86_400.0..=1_000_000.0).contains(&rate)) {
                return Err(ReplayError::Config(format!(
                    "rate must be a positive number of messages per second, at most 1000000 \
                     and at least one a day, got {rate}"
                )));
            }
        }
        if self.publish_timeout == Some(Duration::ZERO) {
            return Err(ReplayError::Config(
                "publish timeout must not be zero".into(),
            ));
        }
        if !self.screen.knows_retention() {
            return Err(ReplayError::Config(
                "the dedup retention is unknown: give the screen the consumers' retention \
                 (Screen::retention) or their dedup table (Screen::lookup); a letter older than \
                 it may be applied again, and none is assumed"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Whether a dead letter with these attributes is selected.
    pub(crate) fn matches(
        &self,
        reason: Option<&str>,
        key: Option<&str>,
        first_seen_ms: Option<i64>,
        group: &str,
    ) -> bool {
        if !self.reasons.is_empty() && !reason.is_some_and(|r| self.reasons.iter().any(|x| x == r))
        {
            return false;
        }
        if !self.groups.is_empty() && !self.groups.iter().any(|g| g == group) {
            return false;
        }
        if !self.keys.is_empty() && !key.is_some_and(|k| self.keys.iter().any(|x| x == k)) {
            return false;
        }
        if let Some(since) = self.since {
            let since_ms = since
                .duration_since(UNIX_EPOCH)
                .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                .unwrap_or(0);
            if first_seen_ms.is_none_or(|t| t < since_ms) {
                return false;
            }
        }
        true
    }

    /// Whether `acted` matching letters reach the limit.
    pub(crate) fn limit_reached(&self, acted: u64) -> bool {
        self.limit.is_some_and(|n| acted >= n)
    }

    pub(crate) fn pacer(&self) -> Pacer {
        Pacer {
            interval: self.rate.filter(|_| !self.dry_run).map(|r| {
                let mut i = tokio::time::interval(Duration::from_secs_f64(1.0 / r));
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                i
            }),
        }
    }
}

/// Spaces republishes evenly when a rate is set.
pub(crate) struct Pacer {
    interval: Option<tokio::time::Interval>,
}

impl Pacer {
    /// Waits for the next slot (the first is immediate).
    pub(crate) async fn wait(&mut self) {
        if let Some(i) = &mut self.interval {
            i.tick().await;
        }
    }
}

/// A required, non-empty builder setting.
pub(crate) fn required(value: Option<String>, what: &str) -> Result<String, ReplayError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| ReplayError::Config(format!("{what} is required")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_combine_with_and_values_with_or() {
        let o = ReplayOptions::new()
            .reason("handler_error")
            .reason("decode_error");
        assert!(o.matches(Some("decode_error"), None, None, "g"));
        assert!(!o.matches(Some("fingerprint_mismatch"), None, None, "g"));
        assert!(
            !o.matches(None, None, None, "g"),
            "no reason header: no match"
        );
        let o = o.key("K-1");
        assert!(o.matches(Some("handler_error"), Some("K-1"), None, "g"));
        assert!(!o.matches(Some("handler_error"), Some("K-2"), None, "g"));
        let since = UNIX_EPOCH + Duration::from_millis(10_000);
        let o = ReplayOptions::new().since(since);
        assert!(o.matches(None, None, Some(10_000), "g"));
        assert!(!o.matches(None, None, Some(9_999), "g"));
        assert!(!o.matches(None, None, None, "g"), "undated: no match");
        assert!(ReplayOptions::new().matches(None, None, None, "g"));
        let o = ReplayOptions::new().group("abc");
        assert!(o.matches(None, None, None, "abc"));
        assert!(!o.matches(None, None, None, "abd"));
    }

    #[test]
    fn bad_rate_is_a_config_error() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-20, 1e10] {
            assert!(matches!(
                ReplayOptions::new().rate(rate).validate(),
                Err(ReplayError::Config(_))
            ));
        }
        let known = Screen::new().retention(std::time::Duration::from_secs(86_400));
        assert!(
            ReplayOptions::new()
                .rate(0.5)
                .screen(known)
                .validate()
                .is_ok()
        );
        // No retention is assumed: a screen that cannot tell a letter's
        // age against it is refused.
        assert!(matches!(
            ReplayOptions::new().validate(),
            Err(ReplayError::Config(why)) if why.contains("retention")
        ));
        assert!(ReplayOptions::new().limit(0).limit_reached(0));
    }
}
