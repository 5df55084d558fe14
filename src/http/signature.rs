//! Signed payment callbacks: HMAC-SHA256 over `"<timestamp>.<body>"`, sent
//! as `t=<unix seconds>,v1=<hex>` (several `v1` entries are accepted, for
//! secret rotation on the sender's side). Checked before any dedup work.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName};
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// The shortest shared secret a verifier accepts, in bytes: a secret
/// shorter than that (an unset variable, `--provider-secret ""`) would
/// build a verifier anyone can satisfy. Use 32 random bytes.
pub(crate) const MIN_SECRET_LEN: usize = 16;

/// The most signatures one header may carry (Stripe sends one per active
/// secret: two while a rotation overlaps): more is refused before any MAC
/// is computed.
pub(crate) const MAX_SIGNATURES: usize = 8;

/// The longest signature header read, in bytes.
const MAX_HEADER_LEN: usize = 2_048;

/// A shared secret a verifier refuses to be built with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// Shorter than 16 bytes (an empty one included).
    #[error(
        "a signing secret of {len} bytes is too short: at least {MIN_SECRET_LEN} (use 32 random bytes)"
    )]
    TooShort {
        /// Its length in bytes.
        len: usize,
    },
}

/// Why a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignatureError {
    /// The signature header is absent.
    #[error("missing signature header {0}")]
    Missing(String),
    /// The header is not `t=<unix seconds>,v1=<hex>`.
    #[error("malformed signature header")]
    Malformed,
    /// The timestamp is outside the tolerance window.
    #[error("signature timestamp is {0} s away from now, outside the tolerance")]
    Stale(u64),
    /// No `v1` value matches.
    #[error("signature does not match")]
    Mismatch,
}

/// A shared secret, the header carrying the signature and the tolerance.
#[derive(Clone)]
pub struct SignatureCheck {
    key: HmacSha256,
    header: HeaderName,
    tolerance: Duration,
}

impl std::fmt::Debug for SignatureCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignatureCheck")
            .field("header", &self.header)
            .field("tolerance", &self.tolerance)
            .finish_non_exhaustive()
    }
}

impl SignatureCheck {
    /// Checks header `X-Signature` with a five-minute tolerance; a secret
    /// shorter than 16 bytes is refused.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        Ok(Self {
            key: hmac_key(&secret.into())?,
            header: HeaderName::from_static("x-signature"),
            tolerance: Duration::from_secs(300),
        })
    }

    /// Reads the signature from another header.
    #[must_use]
    pub fn header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// How far the timestamp may be from now, either way.
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The header value a sender puts on `body` at `unix_secs`.
    pub fn sign(&self, unix_secs: u64, body: &[u8]) -> String {
        let mac = hex::encode(self.mac(unix_secs, body).finalize().into_bytes());
        format!("t={unix_secs},v1={mac}")
    }

    /// Verifies the signature of `body` in `headers` at `now_secs`; the
    /// comparison is constant-time. A header longer than 2 KiB or with
    /// more than 8 signatures is malformed, before any
    /// MAC is computed.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<(), SignatureError> {
        let value = headers
            .get(&self.header)
            .ok_or_else(|| SignatureError::Missing(self.header.to_string()))?;
        if value.len() > MAX_HEADER_LEN {
            return Err(SignatureError::Malformed);
        }
        let value = value.to_str().map_err(|_| SignatureError::Malformed)?;
        let mut t = None;
        let mut candidates = Vec::new();
        for part in value.split(',').map(str::trim) {
            match part.split_once('=') {
                Some(("t", v)) => {
                    t = Some(v.parse::<u64>().map_err(|_| SignatureError::Malformed)?)
                }
                Some(("v1", v)) => {
                    candidates.push(hex::decode(v).map_err(|_| SignatureError::Malformed)?)
                }
                _ => {}
            }
        }
        let t = t.ok_or(SignatureError::Malformed)?;
        if candidates.is_empty() || candidates.len() > MAX_SIGNATURES {
            return Err(SignatureError::Malformed);
        }
        let skew = now_secs.abs_diff(t);
        if skew > self.tolerance.as_secs() {
            return Err(SignatureError::Stale(skew));
        }
        let mac = self.mac(t, body);
        for candidate in candidates {
            if mac.clone().verify_slice(&candidate).is_ok() {
                return Ok(());
            }
        }
        Err(SignatureError::Mismatch)
    }

    fn mac(&self, t: u64, body: &[u8]) -> HmacSha256 {
        let mut mac = self.key.clone();
        mac.update(t.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }
}

/// An HMAC-SHA256 key from a shared secret of at least 16 bytes.
pub(crate) fn hmac_key(secret: &[u8]) -> Result<HmacSha256, SecretError> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(SecretError::TooShort { len: secret.len() });
    }
    // HMAC takes a key of any length.
    HmacSha256::new_from_slice(secret).map_err(|_| SecretError::TooShort { len: secret.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-signature", v.parse().unwrap());
        h
    }

    #[test]
    fn accepts_a_fresh_signature_and_refuses_the_rest() {
        let check = SignatureCheck::new("s3cret-0123456789").unwrap();
        let body = br#"{"out_trade_no":"T-1"}"#;
        let good = check.sign(1_000, body);
        assert_eq!(check.verify(&headers(&good), body, 1_100), Ok(()));
        assert_eq!(
            check.verify(&headers(&good), b"{}", 1_100),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            check.verify(&headers(&good), body, 1_400),
            Err(SignatureError::Stale(400))
        );
        let other = SignatureCheck::new("other-0123456789ab")
            .unwrap()
            .sign(1_000, body);
        assert_eq!(
            check.verify(&headers(&other), body, 1_000),
            Err(SignatureError::Mismatch)
        );
        let rotated = format!("{other},{}", &good[7..]);
        assert_eq!(check.verify(&headers(&rotated), body, 1_000), Ok(()));
        assert_eq!(
            check.verify(&headers("t=x,v1=00"), body, 0),
            Err(SignatureError::Malformed)
        );
        assert!(matches!(
            check.verify(&HeaderMap::new(), body, 0),
            Err(SignatureError::Missing(_))
        ));
    }

    #[test]
    fn empty_and_short_secrets_build_no_verifier() {
        assert_eq!(
            SignatureCheck::new("").err(),
            Some(SecretError::TooShort { len: 0 })
        );
        assert!(SignatureCheck::new("15 bytes secret").is_err());
        assert!(SignatureCheck::new("16 bytes secret!").is_ok());
    }

    #[test]
    fn a_header_with_too_many_signatures_is_refused_before_any_mac() {
        let check = SignatureCheck::new("s3cret-0123456789").unwrap();
        let body = b"{}";
        let good = check.sign(1_000, body);
        let v1 = &good[good.find("v1=").unwrap()..];
        // The valid one last, after eight bogus ones.
        let many = format!("t=1000,{},{v1}", ["v1=00"; 8].join(","));
        assert_eq!(
            check.verify(&headers(&many), body, 1_000),
            Err(SignatureError::Malformed)
        );
        let huge = format!("t=1000,{}", vec!["v1=00"; 100_000].join(","));
        let mut h = HeaderMap::new();
        h.insert("x-signature", huge.parse().unwrap());
        assert_eq!(
            check.verify(&h, body, 1_000),
            Err(SignatureError::Malformed)
        );
        let two = format!("t=1000,v1=00,{v1}");
        assert_eq!(check.verify(&headers(&two), body, 1_000), Ok(()));
    }
}
