//! Alipay asynchronous notifications (`notify_url`), `sign_type=RSA2`.
//!
//! As Alipay's "异步通知验签" (verifying asynchronous notifications)
//! specifies: take every parameter but `sign` and `sign_type`, drop the
//! empty ones, sort by name, join as `name=value` with `&` (values decoded
//! from the URL encoding, not re-encoded), and verify `sign` (base64)
//! as SHA256withRSA of those bytes, in the notification's `charset`, with
//! Alipay's public key.

use axum::http::{HeaderMap, header};

use super::VerifyError;
use super::keys::{ProviderKeyError, RsaKey};
use crate::http::form::{Charset, form_content_type, raw_pairs};

/// Alipay notification verifier: `Alipay::new(alipay_public_key)`.
///
/// The payload the key, the fingerprint and the handler see is a JSON
/// object of the notification's fields, decoded from its charset (UTF-8,
/// GBK or GB18030: the `charset` field, else the content type's, else
/// UTF-8). Alipay signs no timestamp: a replayed notification is a
/// duplicate, answered `success` without running the handler again.
#[derive(Clone)]
pub struct Alipay {
    key: RsaKey,
}

impl std::fmt::Debug for Alipay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alipay").finish_non_exhaustive()
    }
}

impl Alipay {
    /// Alipay's public key ("支付宝公钥", not the application's own), as PEM
    /// or as the bare base64 the open platform console shows.
    pub fn new(alipay_public_key: &str) -> Result<Self, ProviderKeyError> {
        Ok(Self {
            key: RsaKey::parse(alipay_public_key)?,
        })
    }

    /// Verifies a notification; returns its fields as a JSON object.
    pub(crate) fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<Vec<u8>, VerifyError> {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let Some(declared) = form_content_type(content_type) else {
            return Err(VerifyError::Malformed(
                "notification (not application/x-www-form-urlencoded)".into(),
            ));
        };
        let mut pairs = raw_pairs(body);
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        if pairs.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(VerifyError::Malformed(
                "notification (repeated field)".into(),
            ));
        }
        let field = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| k == name.as_bytes())
                .map(|(_, v)| v.as_slice())
        };
        match field("sign_type") {
            Some(b"RSA2") => {}
            Some(other) => {
                return Err(VerifyError::Unsupported(format!(
                    "sign_type {:?}: only RSA2 (SHA256withRSA) is verified",
                    String::from_utf8_lossy(other)
                )));
            }
            None => return Err(VerifyError::Missing("field sign_type".into())),
        }
        let sign = field("sign")
            .filter(|s| !s.is_empty())
            .ok_or_else(|| VerifyError::Missing("field sign".into()))?;
        let sign =
            std::str::from_utf8(sign).map_err(|_| VerifyError::Malformed("field sign".into()))?;
        let label = match field("charset") {
            Some(c) => String::from_utf8_lossy(c).into_owned(),
            None => declared.unwrap_or_else(|| "utf-8".into()),
        };
        let charset = Charset::from_label(&label)
            .map_err(|_| VerifyError::Unsupported(format!("charset {label:?}")))?;
        let mut content = Vec::with_capacity(body.len());
        for (k, v) in &pairs {
            if v.is_empty() || k == b"sign" || k == b"sign_type" {
                continue;
            }
            if !content.is_empty() {
                content.push(b'&');
            }
            content.extend_from_slice(k);
            content.push(b'=');
            content.extend_from_slice(v);
        }
        self.key.verify(&content, sign)?;
        let mut fields = serde_json::Map::new();
        for (k, v) in pairs {
            let bad = |_| VerifyError::Malformed(format!("notification (not {label})"));
            fields.insert(
                charset.decode(k).map_err(bad)?,
                serde_json::Value::String(charset.decode(v).map_err(bad)?),
            );
        }
        Ok(serde_json::Value::Object(fields).to_string().into_bytes())
    }
}
