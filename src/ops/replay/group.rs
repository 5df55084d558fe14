//! Failure groups: dead letters that failed the same way, whatever their
//! keys, ids and numbers.
//!
//! A letter's group is its reason plus a *pattern* of its error text: the
//! text with the letter's idempotency key replaced by `<key>` and every word
//! that contains a digit (amounts, ids, ports, timestamps, UUIDs) replaced by
//! `#`. The group id is the first 12 hex digits of a SHA-256 of both, stable
//! across runs, processes and transports, so `onceonly dlq groups` and
//! `onceonly replay --group ID` agree.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use super::report::Letter;
use super::screen::Verdict;

/// The error text with `key` and every word containing a digit masked, and
/// runs of whitespace collapsed.
pub(crate) fn error_pattern(error: &str, key: Option<&str>) -> String {
    let text = match key.filter(|k| !k.is_empty()) {
        Some(key) => error.replace(key, "<key>"),
        None => error.to_owned(),
    };
    let mut out = String::with_capacity(text.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.chars().any(|c| c.is_ascii_digit()) {
            out.push('#');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    let mut space = false;
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' || c == '-' {
            if space && !out.is_empty() {
                out.push(' ');
            }
            space = false;
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            if c.is_whitespace() {
                space = true;
            } else {
                if space && !out.is_empty() {
                    out.push(' ');
                }
                space = false;
                out.push(c);
            }
        }
    }
    flush(&mut word, &mut out);
    out
}

/// The group id of a letter with this reason and error pattern.
pub fn group_id(reason: Option<&str>, pattern: &str) -> String {
    let mut h = Sha256::new();
    h.update(reason.unwrap_or("").as_bytes());
    h.update([0]);
    h.update(pattern.as_bytes());
    let digest = h.finalize();
    hex::encode(&digest[..6])
}

/// One failure group of a run: the letters that matched the filters and
/// share a reason and an error pattern.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct FailureGroup {
    /// The group id (12 hex digits), for `replay --group`.
    pub id: String,
    /// The dead-letter reason, if the letters had one.
    pub reason: Option<String>,
    /// The error text with keys and numbers masked.
    pub pattern: String,
    /// Letters in the group.
    pub count: u64,
    /// Earliest first-seen time of its letters (ms since the Unix epoch).
    pub first_seen_ms: Option<i64>,
    /// Latest first-seen time of its letters (ms since the Unix epoch).
    pub last_seen_ms: Option<i64>,
    /// The first letter met: where it sits.
    pub example_position: String,
    /// The first letter met: its key.
    pub example_key: Option<String>,
    /// The first letter met: its error text, unmasked.
    pub example_error: Option<String>,
    /// Of its letters, how many would be new work (key not in the dedup table).
    pub new: u64,
    /// Of its letters, how many are already committed (answered as duplicates, no effect).
    pub duplicates: u64,
    /// Of its letters, how many reuse a committed key with another payload.
    pub conflicts: u64,
    /// Of its letters, how many could not be looked up (no key or scope, or
    /// no dedup table given).
    pub unknown: u64,
    /// Of its letters, how many were refused: older than their scope's
    /// dedup retention.
    pub refused: u64,
    /// Of its letters, how many were parked after too many replays.
    pub parked: u64,
}

/// The groups of a run, by id.
#[derive(Clone, Debug, Default)]
pub(crate) struct Groups(BTreeMap<String, FailureGroup>);

impl Groups {
    /// Counts `letter` into its group.
    pub(crate) fn add(&mut self, letter: &Letter, refused: bool, parked: bool) {
        let g = self
            .0
            .entry(letter.group.clone())
            .or_insert_with(|| FailureGroup {
                id: letter.group.clone(),
                reason: letter.reason.clone(),
                pattern: letter.pattern.clone(),
                example_position: letter.position.clone(),
                example_key: letter.key.clone(),
                example_error: letter.error.clone(),
                ..FailureGroup::default()
            });
        g.count += 1;
        if let Some(t) = letter.first_seen_ms {
            g.first_seen_ms = Some(g.first_seen_ms.map_or(t, |f| f.min(t)));
            g.last_seen_ms = Some(g.last_seen_ms.map_or(t, |l| l.max(t)));
        }
        if refused {
            g.refused += 1;
        } else if parked {
            g.parked += 1;
        } else {
            match letter.verdict {
                Some(Verdict::New) => g.new += 1,
                Some(Verdict::Duplicate) => g.duplicates += 1,
                Some(Verdict::Conflict) => g.conflicts += 1,
                Some(Verdict::Unknown) | None => g.unknown += 1,
            }
        }
    }

    /// The groups, largest first (then by id).
    pub(crate) fn sorted(&self) -> Vec<FailureGroup> {
        let mut v: Vec<FailureGroup> = self.0.values().cloned().collect();
        v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.id.cmp(&b.id)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_numbers_and_ids_are_masked() {
        assert_eq!(
            error_pattern(
                "order K-17 declined: amount 1250 over limit 1000",
                Some("K-17")
            ),
            "order <key> declined: amount # over limit #"
        );
        assert_eq!(
            error_pattern(
                "upstream 10.0.0.7:8443 timed out after 30s (request 5f3c9a2e-77b1)",
                None
            ),
            "upstream #.#.#.#:# timed out after # (request #)"
        );
        assert_eq!(
            error_pattern(
                "duplicate key value violates unique constraint \"ledger_pkey\"",
                None
            ),
            "duplicate key value violates unique constraint \"ledger_pkey\""
        );
        assert_eq!(error_pattern("  a\n\tb  ", None), "a b");
    }

    #[test]
    fn the_same_failure_of_other_letters_is_one_group() {
        let a = group_id(
            Some("handler_error"),
            &error_pattern("card 4111 of order P-1 declined", Some("P-1")),
        );
        let b = group_id(
            Some("handler_error"),
            &error_pattern("card 5500 of order P-22 declined", Some("P-22")),
        );
        assert_eq!(a, b);
        assert_eq!(a.len(), 12);
        let other_reason = group_id(
            Some("decode_error"),
            &error_pattern("card 5500 of order P-22 declined", Some("P-22")),
        );
        assert_ne!(a, other_reason);
    }
}
