//! The retry policy shared by every transport.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// How often and how soon a retryable failure is tried again.
///
/// Exponential backoff with full jitter: the delay before attempt `n + 1` is
/// `min(initial * factor^(n-1), max)` plus a random part of up to the same
/// amount. Only retryable failures are retried; permanent ones, rejections
/// and conflicts are final at once. In-process transports sleep between
/// attempts ([`Engine::process_with_retry`](crate::Engine::process_with_retry));
/// brokers may instead schedule the redelivery (AMQP retry queue) using
/// [`RetryPolicy::delay_after`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    max_attempts: u32,
    initial: Duration,
    max: Duration,
    factor: f32,
    jitter: bool,
}

impl Default for RetryPolicy {
    /// 5 attempts, 100 ms initial delay doubling up to 30 s, with jitter.
    fn default() -> Self {
        Self {
            max_attempts: 5,
            initial: Duration::from_millis(100),
            max: Duration::from_secs(30),
            factor: 2.0,
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Total attempts including the first (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// Delay before the second attempt.
    #[must_use]
    pub fn initial_delay(mut self, delay: Duration) -> Self {
        self.initial = delay;
        self
    }

    /// Upper bound of the delay (before jitter).
    #[must_use]
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max = delay;
        self
    }

    /// Growth factor between delays (at least 1).
    #[must_use]
    pub fn factor(mut self, factor: f32) -> Self {
        self.factor = factor.max(1.0);
        self
    }

    /// Turns jitter off (deterministic delays, for tests).
    #[must_use]
    pub fn without_jitter(mut self) -> Self {
        self.jitter = false;
        self
    }

    /// The configured number of attempts.
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The delay before the last attempt (the initial delay for a single
    /// attempt): how long a consumer that pauses on failures waits before
    /// trying a delivery again that ran out of attempts before its pause
    /// policy could judge (see [`PausePolicy`](crate::PausePolicy)).
    #[cfg(feature = "_broker")]
    pub(crate) fn final_delay(&self) -> Duration {
        self.delay_after(self.max_attempts.saturating_sub(1).max(1))
            .unwrap_or(self.initial)
    }

    /// The delay before the next attempt after `attempts_made` failed
    /// attempts, or `None` when the policy is exhausted.
    pub fn delay_after(&self, attempts_made: u32) -> Option<Duration> {
        if attempts_made == 0 || attempts_made >= self.max_attempts {
            return None;
        }
        let mut builder = ExponentialBuilder::new()
            .with_min_delay(self.initial)
            .with_max_delay(self.max)
            .with_factor(self.factor)
            .with_max_times(self.max_attempts as usize);
        if self.jitter {
            builder = builder.with_jitter();
        }
        builder
            .build()
            .nth(attempts_made as usize - 1)
            // Whole milliseconds: float growth leaves sub-millisecond noise.
            .map(|d| Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_delays_are_capped_and_exhausted() {
        let p = RetryPolicy::default()
            .max_attempts(5)
            .initial_delay(Duration::from_millis(100))
            .max_delay(Duration::from_millis(350))
            .without_jitter();
        let delays: Vec<_> = (1..=5).map(|n| p.delay_after(n)).collect();
        assert_eq!(
            delays,
            vec![
                Some(Duration::from_millis(100)),
                Some(Duration::from_millis(200)),
                Some(Duration::from_millis(350)),
                Some(Duration::from_millis(350)),
                None
            ]
        );
        assert_eq!(RetryPolicy::none().delay_after(1), None);
    }

    #[test]
    fn jitter_stays_within_twice_the_delay() {
        let p = RetryPolicy::default().initial_delay(Duration::from_millis(100));
        for _ in 0..100 {
            let d = p.delay_after(1).unwrap();
            assert!(
                d >= Duration::from_millis(100) && d <= Duration::from_millis(200),
                "{d:?}"
            );
        }
    }
}
