//! Screening dead letters against the dedup table before a replay: what
//! each would do (new work, a duplicate, a conflict), and whether it is
//! older than its scope's dedup retention.
//!
//! A letter older than the retention of its scope may have outlived its
//! dedup record: if the key was processed meanwhile and the record was
//! purged, the replayed copy would run the handler a second time. A replay
//! refuses such letters unless told otherwise
//! ([`Screen::beyond_retention`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::delivery::Delivery;
use crate::fingerprint::{Fingerprint, FingerprintSpec};
use crate::store::admin::{AdminStore, RecordFilter};
use crate::store::{Record, StoreError};

/// What replaying a letter would do, by the dedup table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Verdict {
    /// Its key has no live record: the handler would run.
    New,
    /// Its key is committed with the same payload: answered as a
    /// duplicate, no effect.
    Duplicate,
    /// Its key is committed with another payload: dead-lettered again as
    /// `fingerprint_mismatch`.
    Conflict,
    /// It has no key or scope, or no dedup table was given, or it is a
    /// schema registry record (magic byte 0) whose consumer fingerprints
    /// the decoded record: not known.
    Unknown,
}

impl Verdict {
    /// `new`, `duplicate`, `conflict` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Duplicate => "duplicate",
            Self::Conflict => "conflict",
            Self::Unknown => "unknown",
        }
    }
}

/// The dedup table as a replay sees it: a record by scope and key, and the
/// retention a scope's records were written with. Implemented for every
/// SQL store.
#[async_trait]
pub trait DedupLookup: Send + Sync {
    /// The record of `key` in `scope`, expired or not.
    async fn record(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError>;
    /// The retention of `scope`'s newest record (its expiry minus its
    /// claim time), if the scope has any.
    async fn retention(&self, scope: &str) -> Result<Option<Duration>, StoreError>;
}

#[async_trait]
impl<S: AdminStore> DedupLookup for S {
    async fn record(&self, scope: &str, key: &str) -> Result<Option<Record>, StoreError> {
        let filter = RecordFilter::new(1).scope(scope).key(key);
        Ok(self.find(&filter).await?.into_iter().next())
    }

    async fn retention(&self, scope: &str) -> Result<Option<Duration>, StoreError> {
        let newest = self.find(&RecordFilter::new(1).scope(scope)).await?;
        Ok(newest.first().map(|r| {
            Duration::from_millis(u64::try_from(r.expires_at_ms - r.created_at_ms).unwrap_or(0))
        }))
    }
}

/// How a replay screens letters: against a dedup table (optional), and
/// against the dedup retention of their scope.
///
/// The retention of a scope is, in order: the one given with
/// [`retention`](Self::retention); the one its newest record in the dedup
/// table was written with. Nothing else is assumed: a dated letter of a
/// scope whose retention is unknown (no retention given, and no dedup
/// table or no live record of the scope in it) is refused like one older
/// than its retention, since its record may be gone (a consumer kept for
/// a day would otherwise apply again a letter aged two to seven days).
#[derive(Clone)]
pub struct Screen {
    lookup: Option<Arc<dyn DedupLookup>>,
    retention: Option<Duration>,
    beyond_retention: bool,
    clock: Arc<dyn Clock>,
    /// Retentions read from the table, by scope (read once per run).
    known: Arc<Mutex<HashMap<String, Duration>>>,
}

impl std::fmt::Debug for Screen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Screen")
            .field("lookup", &self.lookup.is_some())
            .field("retention", &self.retention)
            .field("beyond_retention", &self.beyond_retention)
            .finish_non_exhaustive()
    }
}

impl Default for Screen {
    fn default() -> Self {
        Self {
            lookup: None,
            retention: None,
            beyond_retention: false,
            clock: Arc::new(SystemClock),
            known: Arc::default(),
        }
    }
}

/// What the screen says of one letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Screening {
    pub(crate) verdict: Verdict,
    /// Older than its scope's retention, and not allowed.
    pub(crate) refused: bool,
}

impl Screen {
    /// No dedup table and no retention: every verdict is
    /// [`Verdict::Unknown`], and every dated letter is refused (its
    /// scope's retention is unknown) unless
    /// [`beyond_retention`](Self::beyond_retention). Give the
    /// [`retention`](Self::retention) or a [`lookup`](Self::lookup).
    pub fn new() -> Self {
        Self::default()
    }

    /// Looks each letter's key up in this dedup table.
    #[must_use]
    pub fn lookup(mut self, lookup: impl DedupLookup + 'static) -> Self {
        self.lookup = Some(Arc::new(lookup));
        self
    }

    /// The dedup retention of every scope, instead of reading it from the
    /// dedup table.
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Replay letters older than their scope's retention too (default
    /// `false`: they are refused and left where they are).
    #[must_use]
    pub fn beyond_retention(mut self, yes: bool) -> Self {
        self.beyond_retention = yes;
        self
    }

    /// The clock that says how old a letter is.
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Duration>> {
        crate::sync::lock(&self.known)
    }

    /// Whether the screen can tell a letter's age against its scope's
    /// retention, or need not: a retention given, a dedup table to read it
    /// from, or letters beyond it allowed.
    pub(crate) fn knows_retention(&self) -> bool {
        self.retention.is_some() || self.lookup.is_some() || self.beyond_retention
    }

    /// Whether a dedup table is looked up.
    pub fn has_lookup(&self) -> bool {
        self.lookup.is_some()
    }

    /// Screens a letter of `scope` with `key`, first seen at
    /// `first_seen_ms`, carrying `payload`. An undated letter is never
    /// refused: nothing says it is old.
    pub(crate) async fn check(
        &self,
        scope: Option<&str>,
        key: Option<&str>,
        first_seen_ms: Option<i64>,
        payload: &[u8],
    ) -> Result<Screening, StoreError> {
        let now = self.clock.now_ms();
        // Never assumed: unknown, a dated letter is refused.
        let retention = match (self.retention, &self.lookup, scope) {
            (Some(r), _, _) => Some(r),
            (None, Some(lookup), Some(scope)) => {
                let known = self.lock().get(scope).copied();
                match known {
                    Some(r) => Some(r),
                    None => {
                        let r = lookup.retention(scope).await?;
                        if let Some(r) = r {
                            self.lock().insert(scope.to_owned(), r);
                        }
                        r
                    }
                }
            }
            _ => None,
        };
        let old = first_seen_ms.is_some_and(|t| match retention {
            Some(r) => now.saturating_sub(t) > i64::try_from(r.as_millis()).unwrap_or(i64::MAX),
            None => true,
        });
        let refused = old && !self.beyond_retention;
        let verdict = match (&self.lookup, scope, key) {
            (Some(lookup), Some(scope), Some(key)) => match lookup.record(scope, key).await? {
                Some(record) if record.expires_at_ms > now => {
                    verdict_of(record.fingerprint.as_ref(), payload)
                }
                _ => Verdict::New,
            },
            _ => Verdict::Unknown,
        };
        Ok(Screening { verdict, refused })
    }
}

/// A live record with `stored` fingerprint, met again with `payload`: a
/// duplicate when the fingerprints agree under the consumers' default
/// ([`FingerprintSpec::Auto`]) or [`FingerprintSpec::Raw`], or when the
/// record has none (fingerprints disabled). A payload in the schema
/// registry wire format (magic byte 0) whose fingerprints disagree is not
/// known: its consumer fingerprints the decoded record, which the screen
/// does not decode.
fn verdict_of(stored: Option<&Fingerprint>, payload: &[u8]) -> Verdict {
    let Some(stored) = stored else {
        return Verdict::Duplicate;
    };
    let delivery = Delivery::new(payload.to_vec());
    let same = [FingerprintSpec::Auto, FingerprintSpec::Raw]
        .iter()
        .any(|spec| spec.compute(&delivery).as_ref() == Some(stored));
    if same {
        Verdict::Duplicate
    } else if payload.first() == Some(&0) {
        Verdict::Unknown
    } else {
        Verdict::Conflict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_and_conflicts_by_fingerprint() {
        let body = br#"{"out_trade_no":"K-1","amount":10}"#;
        let stored = FingerprintSpec::Auto
            .compute(&Delivery::new(
                &br#"{ "amount": 10, "out_trade_no": "K-1" }"#[..],
            ))
            .unwrap();
        assert_eq!(verdict_of(Some(&stored), body), Verdict::Duplicate);
        let raw = crate::fingerprint::raw(b"not json");
        assert_eq!(verdict_of(Some(&raw), b"not json"), Verdict::Duplicate);
        assert_eq!(
            verdict_of(Some(&stored), br#"{"out_trade_no":"K-1","amount":99}"#),
            Verdict::Conflict
        );
        assert_eq!(verdict_of(None, body), Verdict::Duplicate);
        // An Avro or Protobuf record is fingerprinted decoded by its consumer.
        assert_eq!(
            verdict_of(Some(&stored), b"\0\0\0\0\x01avro"),
            Verdict::Unknown
        );
    }

    #[tokio::test]
    async fn old_letters_are_refused_unless_allowed() {
        let clock = Arc::new(crate::clock::ManualClock::new(10 * 86_400_000));
        let screen = Screen::new()
            .retention(Duration::from_secs(86_400))
            .clock(clock.clone());
        let day = 86_400_000;
        let check = |screen: Screen, first_seen| async move {
            screen
                .check(Some("s"), Some("k"), first_seen, b"{}")
                .await
                .unwrap()
        };
        let young = check(screen.clone(), Some(10 * day - day / 2)).await;
        assert_eq!(
            young,
            Screening {
                verdict: Verdict::Unknown,
                refused: false
            }
        );
        assert!(check(screen.clone(), Some(8 * day)).await.refused);
        assert!(!check(screen.clone(), None).await.refused, "undated");
        assert!(
            !check(screen.beyond_retention(true), Some(8 * day))
                .await
                .refused
        );
        // Issue 44, defect 11: no retention and no dedup table: nothing is
        // assumed, a dated letter is refused (however young), an undated
        // one is not.
        let unknown = Screen::new().clock(clock);
        assert!(check(unknown.clone(), Some(10 * day - 1_000)).await.refused);
        assert!(!check(unknown.clone(), None).await.refused);
        assert!(
            !check(unknown.beyond_retention(true), Some(8 * day))
                .await
                .refused
        );
    }
}
