//! Refused callbacks in the log: a flood of bad signatures must not flood
//! it at `WARN`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::VerifyError;

/// Logs refused callbacks at `WARN` at most once per [`REFUSALS_EVERY`],
/// with how many were refused since; the others at `DEBUG`: a flood of
/// bad signatures does not flood the log.
#[derive(Default)]
pub(crate) struct Refusals {
    last: Mutex<Option<Instant>>,
    unlogged: AtomicU64,
}

/// The shortest time between two `WARN` lines about refused callbacks.
pub(crate) const REFUSALS_EVERY: Duration = Duration::from_secs(10);

impl Refusals {
    /// Logs the refusal of a callback to `path` for `error`; whether at
    /// `WARN`.
    pub(crate) fn note(&self, path: &str, error: &VerifyError) -> bool {
        let now = Instant::now();
        let warn = {
            let mut last = crate::sync::lock(&self.last);
            let due = last.is_none_or(|at| now.duration_since(at) >= REFUSALS_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        if warn {
            let since = self.unlogged.swap(0, Ordering::Relaxed);
            tracing::warn!(path, error = %error, refused_unlogged = since, "callback verification refused");
        } else {
            self.unlogged.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(path, error = %error, "callback verification refused");
        }
        warn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_refusals_makes_one_warning() {
        let refusals = Refusals::default();
        let warned = (0..10_000)
            .filter(|_| refusals.note("/cb", &VerifyError::BadSignature))
            .count();
        assert_eq!(warned, 1);
        assert_eq!(refusals.unlogged.load(Ordering::Relaxed), 9_999);
    }
}
