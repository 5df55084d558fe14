//! The one verification step of the layer: the HMAC of
//! [`SignatureCheck`](super::SignatureCheck) and/or a payment
//! [`Provider`](super::providers::Provider)'s own scheme, over the raw
//! bytes received, before any dedup work.

use axum::http::{HeaderMap, StatusCode};

use super::config::Settings;
use super::signature::SignatureError;

/// Why a callback was refused before anything was claimed: `401` (`413`
/// for [`TooManyFields`](Self::TooManyFields)) with a problem document
/// whose `type` ends in [`code`](Self::code) and whose detail is
/// [`public_detail`](Self::public_detail) (the caller is not authenticated:
/// nothing about the server's clock or keys).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A header or field the scheme requires is absent (`missing-signature`).
    #[error("missing {0}")]
    Missing(String),
    /// A signature, timestamp or envelope does not have the scheme's form
    /// (`malformed-signature`).
    #[error("malformed {0}")]
    Malformed(String),
    /// The signature does not match the bytes received (`bad-signature`).
    #[error("signature does not match")]
    BadSignature,
    /// The signed timestamp is this many seconds away from now, outside
    /// the tolerance (`stale-timestamp`).
    #[error("signature timestamp is {0} s away from now, outside the tolerance")]
    StaleTimestamp(u64),
    /// No key is configured for the certificate serial the callback names
    /// (`unknown-serial`).
    #[error("no platform key configured for serial {0:?}")]
    UnknownSerial(String),
    /// The signed, encrypted resource does not decrypt with the configured
    /// key (`undecryptable-resource`).
    #[error("resource could not be decrypted: {0}")]
    Undecryptable(String),
    /// A variant of the scheme this crate does not verify, e.g. Alipay's
    /// SHA-1 `sign_type=RSA` (`unsupported-signature`).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A signed event time (Alipay's `notify_time`) older than the layer
    /// replays callbacks for: this many seconds old (`expired-callback`).
    /// Its record may have been purged, so it is refused rather than
    /// processed again.
    #[error("the signed event time is {0} s old, older than the layer's retention allows")]
    Expired(u64),
    /// A form with more fields than
    /// 256, refused before
    /// anything was decoded or verified (`too-many-fields`, `413`).
    #[error("more than {0} fields")]
    TooManyFields(usize),
}

impl VerifyError {
    /// The problem code (`urn:onceonly:problem:<code>`).
    pub fn code(&self) -> &'static str {
        match self {
            Self::Missing(_) => "missing-signature",
            Self::Malformed(_) => "malformed-signature",
            Self::BadSignature => "bad-signature",
            Self::StaleTimestamp(_) => "stale-timestamp",
            Self::UnknownSerial(_) => "unknown-serial",
            Self::Undecryptable(_) => "undecryptable-resource",
            Self::Unsupported(_) => "unsupported-signature",
            Self::Expired(_) => "expired-callback",
            Self::TooManyFields(_) => "too-many-fields",
        }
    }

    /// The status it is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::TooManyFields(_) => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::UNAUTHORIZED,
        }
    }

    /// What the unauthenticated caller is told: the reason without the
    /// server's clock skew or the serials it knows (those go to the log).
    pub fn public_detail(&self) -> String {
        match self {
            Self::StaleTimestamp(_) => "the signed timestamp is outside the accepted window".into(),
            Self::UnknownSerial(_) => "no platform key is configured for the serial sent".into(),
            Self::Undecryptable(_) => "the resource could not be decrypted".into(),
            Self::Expired(_) => {
                "the signed event time is older than callbacks are accepted for".into()
            }
            other => other.to_string(),
        }
    }
}

impl From<SignatureError> for VerifyError {
    fn from(e: SignatureError) -> Self {
        match e {
            SignatureError::Missing(header) => Self::Missing(format!("header {header}")),
            SignatureError::Malformed => Self::Malformed("signature header".into()),
            SignatureError::Stale(skew) => Self::StaleTimestamp(skew),
            SignatureError::Mismatch => Self::BadSignature,
        }
    }
}

/// Checks the request's signature(s) at `now_secs`. `Ok(Some(payload))`:
/// the provider turned the callback into this JSON payload (decrypted or
/// decoded), which replaces the body for the key, the fingerprint and the
/// handler; `Ok(None)`: the body stays as received.
pub(super) fn verify(
    http: &Settings,
    headers: &HeaderMap,
    body: &[u8],
    now_secs: u64,
) -> Result<Option<Vec<u8>>, VerifyError> {
    if let Some(check) = &http.signature {
        check.verify(headers, body, now_secs)?;
    }
    #[cfg(feature = "providers")]
    if let Some(provider) = &http.provider {
        return provider.verify(headers, body, now_secs);
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unauthenticated_caller_learns_no_clock_skew_and_no_serial() {
        let stale = VerifyError::StaleTimestamp(4_321).public_detail();
        assert!(
            !stale.contains("4321") && !stale.contains("4_321"),
            "{stale}"
        );
        let serial = VerifyError::UnknownSerial("5157F09E".into()).public_detail();
        assert!(!serial.contains("5157F09E"), "{serial}");
        assert_eq!(
            VerifyError::TooManyFields(256).status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(VerifyError::BadSignature.status(), StatusCode::UNAUTHORIZED);
    }
}
