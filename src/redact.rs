//! How business keys are shown in spans and logs: the one place that
//! decides it.
//!
//! Idempotency keys are business identifiers (order numbers, account
//! numbers, e-mail addresses) and often personal data. A [`KeyRedaction`]
//! says how a key appears outside the database:
//!
//! - [`KeyRedaction::plain`] (the default): the key itself.
//! - [`KeyRedaction::hmac`]: `hmac:` and the first 16 hex digits of
//!   HMAC-SHA256(secret, key). Without the secret the form cannot be
//!   reversed by hashing candidate keys (an unkeyed hash of an order number
//!   can: order numbers are few and guessable). With it, an operator
//!   computes the form of a known key to find its lines:
//!   [`KeyRedaction::show`], or `onceonly key-hash` (crate `onceonly-cli`).
//! - [`KeyRedaction::per_process`]: the same with a random secret drawn
//!   once per process. Lines of one process correlate; nobody, the operator
//!   included, can compute the form of a given key, and the forms differ
//!   between processes and restarts.
//!
//! # Where it applies
//!
//! - The `key` field of the `onceonly.delivery` span (see
//!   [`telemetry`](crate::telemetry)):
//!   [`EngineBuilder::key_redaction`](crate::EngineBuilder::key_redaction),
//!   on the engine builder every transport builder takes. Every event
//!   onceonly logs about a delivery (including the cache tier's) is emitted
//!   inside that span, so a log line and its span show the same form.
//! - The log lines of the standalone Redis claims, which run outside any
//!   delivery: `RedisStore::with_key_redaction` (feature `redis`).
//! - Your own logs: [`Engine::key_redaction`](crate::Engine::key_redaction)
//!   gives the engine's.
//!
//! Errors never carry the key: the texts of
//! [`StoreError`](crate::StoreError), [`KeyError`](crate::KeyError) and the
//! Redis tier's errors name no key, so there is nothing to redact in them;
//! the span around the line that logs one says which key it was.
//!
//! Not covered: a database server's own error message can quote a value
//! (MySQL's "Incorrect string value: '\xF0...'"), and the raw key is
//! returned where the API hands it to you ([`Report::key`](crate::Report),
//! [`IdemKey`](crate::IdemKey), `Session::key`, whose `Debug` prints it).

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, OnceLock};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix of a hashed key: `hmac:` and 16 hex digits follow.
pub(crate) const HMAC_PREFIX: &str = "hmac:";

/// The shortest secret [`KeyRedaction::hmac`] accepts, in bytes. Use 32
/// random bytes (e.g. `openssl rand -base64 32`, whose text is the secret).
pub(crate) const MIN_SECRET_LEN: usize = 16;

/// Hex digits of the HMAC kept: 64 bits, enough to tell the keys of a
/// dedup table apart in logs (a collision becomes likely around 4 billion
/// keys), short enough to read.
const HEX_DIGITS: usize = 16;

/// How keys are shown in spans and logs: the key itself (the default), or
/// a keyed hash of it. See the [module documentation](self).
///
/// Cheap to clone. `Debug` never prints the secret.
///
/// ```
/// use onceonly::KeyRedaction;
///
/// let redaction = KeyRedaction::hmac("0123456789abcdef0123456789abcdef")?;
/// let shown = redaction.show("ORDER-4711");
/// assert!(shown.starts_with("hmac:") && shown.len() == 21);
/// assert_eq!(KeyRedaction::plain().show("ORDER-4711"), "ORDER-4711");
/// # Ok::<(), onceonly::redact::KeyRedactionError>(())
/// ```
#[derive(Clone, Default)]
pub struct KeyRedaction {
    hmac: Option<Arc<Keyed>>,
}

/// An HMAC already keyed with the secret (the secret itself is not kept).
struct Keyed {
    mac: Hmac<Sha256>,
    per_process: bool,
}

/// Why a [`KeyRedaction`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRedactionError {
    /// The secret is shorter than 16 bytes.
    #[error(
        "the key redaction secret is {len} bytes long; it needs at least {MIN_SECRET_LEN} (32 random bytes recommended)"
    )]
    SecretTooShort {
        /// Its length in bytes.
        len: usize,
    },
    /// The operating system's random source failed (per-process secret).
    #[error("no random per-process secret: the operating system's random source failed: {0}")]
    Random(String),
}

impl KeyRedaction {
    /// Keys are shown as they are (the default).
    pub fn plain() -> Self {
        Self::default()
    }

    /// Keys are shown as `hmac:` and the first 16 hex digits of
    /// HMAC-SHA256(`secret`, key). The secret is at least
    /// 16 bytes; give every process of a deployment the
    /// same one (from your secret store) so that their lines correlate.
    pub fn hmac(secret: impl AsRef<[u8]>) -> Result<Self, KeyRedactionError> {
        let secret = secret.as_ref();
        if secret.len() < MIN_SECRET_LEN {
            return Err(KeyRedactionError::SecretTooShort { len: secret.len() });
        }
        Self::keyed(secret, false)
    }

    /// Keys are shown as with [`KeyRedaction::hmac`], under a random secret
    /// drawn from the operating system once per process: every engine,
    /// consumer, layer and Redis store of the process that uses it shows a
    /// key the same way, and no one can compute that form from a key.
    pub fn per_process() -> Result<Self, KeyRedactionError> {
        static PROCESS: OnceLock<KeyRedaction> = OnceLock::new();
        if let Some(redaction) = PROCESS.get() {
            return Ok(redaction.clone());
        }
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(|e| KeyRedactionError::Random(e.to_string()))?;
        let redaction = Self::keyed(&secret, true)?;
        // Two threads racing here both get the one that was stored first.
        Ok(PROCESS.get_or_init(|| redaction).clone())
    }

    fn keyed(secret: &[u8], per_process: bool) -> Result<Self, KeyRedactionError> {
        // HMAC takes keys of any length: this error does not happen.
        let mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
            .map_err(|_| KeyRedactionError::SecretTooShort { len: secret.len() })?;
        Ok(Self {
            hmac: Some(Arc::new(Keyed { mac, per_process })),
        })
    }

    /// Whether keys are shown as they are.
    pub fn is_plain(&self) -> bool {
        self.hmac.is_none()
    }

    /// How `key` appears in spans and logs: the key itself, or its
    /// `hmac:` form. Use it to find a known key's lines, or to log keys in
    /// your own code the way onceonly does.
    pub fn show<'k>(&self, key: &'k str) -> Cow<'k, str> {
        match &self.hmac {
            None => Cow::Borrowed(key),
            Some(keyed) => Cow::Owned(keyed.hash(key)),
        }
    }
}

impl Keyed {
    fn hash(&self, key: &str) -> String {
        let digest = self.mac.clone().chain_update(key.as_bytes()).finalize();
        let mut shown = String::with_capacity(HMAC_PREFIX.len() + HEX_DIGITS);
        shown.push_str(HMAC_PREFIX);
        shown.push_str(&hex::encode(&digest.into_bytes()[..HEX_DIGITS / 2]));
        shown
    }
}

impl fmt::Debug for KeyRedaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.hmac {
            None => f.write_str("KeyRedaction::Plain"),
            Some(keyed) => f
                .debug_struct("KeyRedaction::Hmac")
                .field("secret", &format_args!("<redacted>"))
                .field("per_process", &keyed.per_process)
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_form_matches_rfc_4231() {
        // RFC 4231, test case 1: key 0x0b x 20, data "Hi There",
        // HMAC-SHA256 = b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da7...
        let r = KeyRedaction::hmac([0x0b; 20]).unwrap();
        assert_eq!(r.show("Hi There"), "hmac:b0344c61d8db3853");
        // Test case 6: a key longer than the block size (0xaa x 131).
        let r = KeyRedaction::hmac([0xaa; 131]).unwrap();
        assert_eq!(
            r.show("Test Using Larger Than Block-Size Key - Hash Key First"),
            "hmac:60e431591ee0b67f"
        );
    }

    #[test]
    fn plain_shows_the_key_itself_without_allocating() {
        let r = KeyRedaction::plain();
        assert!(r.is_plain());
        assert!(matches!(r.show("ORDER-1"), Cow::Borrowed("ORDER-1")));
        assert_eq!(format!("{r:?}"), "KeyRedaction::Plain");
    }

    #[test]
    fn debug_never_prints_the_secret() {
        let secret = "s3cr3t-s3cr3t-s3cr3t";
        let r = KeyRedaction::hmac(secret).unwrap();
        let debug = format!("{r:?} {:?}", Some(r.clone()));
        assert!(!debug.contains(secret), "{debug}");
        assert!(!debug.contains(&hex::encode(secret)), "{debug}");
        assert!(debug.contains("<redacted>"), "{debug}");
        let err = KeyRedaction::hmac("short-secret").unwrap_err();
        assert_eq!(err, KeyRedactionError::SecretTooShort { len: 12 });
        assert!(!err.to_string().contains("short-secret"));
    }

    #[test]
    fn the_secret_and_the_key_both_change_the_form() {
        let a = KeyRedaction::hmac("0123456789abcdef").unwrap();
        let b = KeyRedaction::hmac("0123456789abcdeF").unwrap();
        assert_ne!(a.show("k-1"), b.show("k-1"));
        assert_ne!(a.show("k-1"), a.show("k-2"));
        assert_eq!(a.show("k-1"), a.clone().show("k-1"));
    }

    #[test]
    fn the_per_process_secret_is_one_per_process() {
        let a = KeyRedaction::per_process().unwrap();
        let b = KeyRedaction::per_process().unwrap();
        assert!(!a.is_plain());
        assert_eq!(a.show("k-1"), b.show("k-1"));
        assert!(a.show("k-1").starts_with(HMAC_PREFIX));
        assert!(format!("{a:?}").contains("per_process: true"));
    }
}
