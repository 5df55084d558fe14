//! GitHub-style webhooks: `X-Hub-Signature-256: sha256=<hex>`, the
//! HMAC-SHA256 of the raw body with the webhook's secret (GitHub's
//! "Validating webhook deliveries"). Only the body is signed: no header
//! (`X-GitHub-Delivery` included) and no timestamp. The key is therefore a
//! digest of the (canonical JSON) body and of nothing else (not the path
//! it was sent to), so a captured body resent under a fresh delivery id,
//! or to another path of the same route, is a duplicate; a replay after
//! the retention is not refused.

use axum::http::{HeaderMap, HeaderName};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::keys::ProviderKeyError;
use super::{VerifyError, header_str};

type HmacSha256 = Hmac<Sha256>;

/// GitHub-style verifier: `GitHub::new(secret)`; another header with
/// [`header`](Self::header) for senders that copied the scheme.
#[derive(Clone)]
pub struct GitHub {
    key: HmacSha256,
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
    /// The webhook's secret; an empty or short one (under
    /// 16 bytes) is refused.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, ProviderKeyError> {
        Ok(Self {
            key: crate::http::signature::hmac_key(&secret.into())
                .map_err(|e| ProviderKeyError::HmacKey(e.to_string()))?,
            header: HeaderName::from_static("x-hub-signature-256"),
        })
    }

    /// Reads `sha256=<hex>` from another header.
    #[must_use]
    pub fn header(mut self, header: HeaderName) -> Self {
        self.header = header;
        self
    }

    /// The header value a sender puts on `body`.
    pub fn sign(&self, body: &[u8]) -> String {
        let mac = hex::encode(self.mac(body).finalize().into_bytes());
        format!("sha256={mac}")
    }

    fn mac(&self, body: &[u8]) -> HmacSha256 {
        let mut mac = self.key.clone();
        mac.update(body);
        mac
    }

    /// Verifies a delivery; returns its JSON payload: the body, or the
    /// `payload` field of a delivery sent as a form (GitHub's
    /// `application/x-www-form-urlencoded` content type), read from the
    /// signed bytes whatever the content type says.
    pub(crate) fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<Vec<u8>, VerifyError> {
        self.check(headers, body)?;
        let json = match body.strip_prefix(b"payload=") {
            Some(_) => {
                let fields = crate::http::form::raw_pairs(body)
                    .map_err(|e| VerifyError::Malformed(format!("delivery ({e})")))?;
                match fields.as_slice() {
                    [(name, value)] if name == b"payload" => value.clone(),
                    _ => {
                        return Err(VerifyError::Malformed(
                            "delivery (a form of one `payload` field)".into(),
                        ));
                    }
                }
            }
            None => body.to_vec(),
        };
        super::json_payload(&json)
    }

    pub(super) fn check(&self, headers: &HeaderMap, body: &[u8]) -> Result<(), VerifyError> {
        let value = header_str(headers, self.header.as_str())?;
        // One SHA-256 in hex, and its prefix.
        if value.len() > 128 {
            return Err(VerifyError::Malformed(format!("header {}", self.header)));
        }
        let hex_sig = value
            .trim()
            .strip_prefix("sha256=")
            .ok_or_else(|| VerifyError::Malformed(format!("header {}", self.header)))?;
        let sig = hex::decode(hex_sig)
            .map_err(|_| VerifyError::Malformed(format!("header {}", self.header)))?;
        self.mac(body)
            .verify_slice(&sig)
            .map_err(|_| VerifyError::BadSignature)
    }
}
