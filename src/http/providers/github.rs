//! GitHub-style webhooks: `X-Hub-Signature-256: sha256=<hex>`, the
//! HMAC-SHA256 of the raw body with the webhook's secret (GitHub's
//! "Validating webhook deliveries"). No timestamp is signed: a replay is a
//! duplicate of its `X-GitHub-Delivery`.

use axum::http::{HeaderMap, HeaderName};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{VerifyError, header_str};

type HmacSha256 = Hmac<Sha256>;

/// GitHub-style verifier: `GitHub::new(secret)`; another header with
/// [`header`](Self::header) for senders that copied the scheme.
#[derive(Clone)]
pub struct GitHub {
    /// `None` only if the MAC refused the key, which HMAC never does.
    key: Option<HmacSha256>,
    header: HeaderName,
}

impl std::fmt::Debug for GitHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitHub")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl GitHub {
    /// The webhook's secret.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self {
            key: HmacSha256::new_from_slice(&secret.into()).ok(),
            header: HeaderName::from_static("x-hub-signature-256"),
        }
    }

    /// Reads `sha256=<hex>` from another header.
    #[must_use]
    pub fn header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// The header value a sender puts on `body`.
    pub fn sign(&self, body: &[u8]) -> String {
        let mac = self
            .mac(body)
            .map(|m| hex::encode(m.finalize().into_bytes()))
            .unwrap_or_default();
        format!("sha256={mac}")
    }

    fn mac(&self, body: &[u8]) -> Option<HmacSha256> {
        let mut mac = self.key.clone()?;
        mac.update(body);
        Some(mac)
    }

    pub(crate) fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), VerifyError> {
        let value = header_str(headers, self.header.as_str())?;
        let hex_sig = value
            .trim()
            .strip_prefix("sha256=")
            .ok_or_else(|| VerifyError::Malformed(format!("header {}", self.header)))?;
        let sig = hex::decode(hex_sig)
            .map_err(|_| VerifyError::Malformed(format!("header {}", self.header)))?;
        self.mac(body)
            .ok_or(VerifyError::BadSignature)?
            .verify_slice(&sig)
            .map_err(|_| VerifyError::BadSignature)
    }
}
