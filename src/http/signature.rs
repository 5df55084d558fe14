//! Signed payment callbacks: HMAC-SHA256 over `"<timestamp>.<body>"`, sent
//! as `t=<unix seconds>,v1=<hex>` (several `v1` entries are accepted, for
//! secret rotation on the sender's side). Checked before any dedup work.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName};
use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

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
    /// `None` only if the MAC refused the key, which HMAC never does.
    key: Option<HmacSha256>,
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
    /// Checks header `X-Signature` with a five-minute tolerance.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self {
            key: HmacSha256::new_from_slice(&secret.into()).ok(),
            header: HeaderName::from_static("x-signature"),
            tolerance: Duration::from_secs(300),
        }
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
        let mac = self
            .mac(unix_secs, body)
            .map(|m| hex::encode(m.finalize().into_bytes()))
            .unwrap_or_default();
        format!("t={unix_secs},v1={mac}")
    }

    /// Verifies the signature of `body` in `headers` at `now_secs`; the
    /// comparison is constant-time.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<(), SignatureError> {
        let value = headers
            .get(&self.header)
            .ok_or_else(|| SignatureError::Missing(self.header.to_string()))?
            .to_str()
            .map_err(|_| SignatureError::Malformed)?;
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
        if candidates.is_empty() {
            return Err(SignatureError::Malformed);
        }
        let skew = now_secs.abs_diff(t);
        if skew > self.tolerance.as_secs() {
            return Err(SignatureError::Stale(skew));
        }
        let Some(mac) = self.mac(t, body) else {
            return Err(SignatureError::Mismatch);
        };
        for candidate in candidates {
            if mac.clone().verify_slice(&candidate).is_ok() {
                return Ok(());
            }
        }
        Err(SignatureError::Mismatch)
    }

    fn mac(&self, t: u64, body: &[u8]) -> Option<HmacSha256> {
        let mut mac = self.key.clone()?;
        mac.update(t.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        Some(mac)
    }
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
        let check = SignatureCheck::new("s3cret");
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
        let other = SignatureCheck::new("other").sign(1_000, body);
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
}
