//! The one verification step of the layer: the HMAC of
//! [`SignatureCheck`](super::SignatureCheck) and/or a payment
//! [`Provider`](super::providers::Provider)'s own scheme, over the raw
//! bytes received, before any dedup work.

use axum::http::HeaderMap;

use super::config::Settings;
use super::signature::SignatureError;

/// Why a callback was refused before anything was claimed: always `401`
/// with a problem document whose `type` ends in [`code`](Self::code).
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
