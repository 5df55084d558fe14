//! Adyen standard webhooks, HMAC-signed: for each `NotificationRequestItem`,
//! the HMAC-SHA256 (key: the hex string Adyen issues, decoded to bytes) of
//! `pspReference:originalReference:merchantAccountCode:merchantReference:
//! value:currency:eventCode:success` (absent fields empty), base64 in
//! `additionalData.hmacSignature` (Adyen's "Verify HMAC signatures", "Build
//! your own custom solution").

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

use super::VerifyError;
use super::keys::ProviderKeyError;

type HmacSha256 = Hmac<Sha256>;

/// Adyen verifier: `Adyen::new("<hex HMAC key>")`.
///
/// The body stays as received; every item must verify. One item per
/// request, as Adyen sends JSON webhooks: the key is its `pspReference`
/// with its `eventCode` (Adyen's own advice for spotting duplicates: one
/// payment's `AUTHORISATION` and `CAPTURE` share the `pspReference`); a
/// body with several items is refused (`unsupported-signature`), since one
/// key cannot stand for several events.
#[derive(Clone)]
pub struct Adyen {
    key: HmacSha256,
}

impl std::fmt::Debug for Adyen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adyen").finish_non_exhaustive()
    }
}

impl Adyen {
    /// The HMAC key as Adyen's Customer Area shows it (hex).
    pub fn new(hex_key: &str) -> Result<Self, ProviderKeyError> {
        let raw = hex::decode(hex_key.trim())
            .map_err(|e| ProviderKeyError::HmacKey(format!("not hex: {e}")))?;
        let key = HmacSha256::new_from_slice(&raw)
            .map_err(|e| ProviderKeyError::HmacKey(e.to_string()))?;
        Ok(Self { key })
    }

    /// The `hmacSignature` Adyen puts on `item` (a `NotificationRequestItem`).
    pub fn sign(&self, item: &Value) -> String {
        STANDARD.encode(self.mac(item).finalize().into_bytes())
    }

    fn mac(&self, item: &Value) -> HmacSha256 {
        let text = |pointer: &str| match item.pointer(pointer) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(Value::Bool(b)) => b.to_string(),
            _ => String::new(),
        };
        let payload = [
            "/pspReference",
            "/originalReference",
            "/merchantAccountCode",
            "/merchantReference",
            "/amount/value",
            "/amount/currency",
            "/eventCode",
            "/success",
        ]
        .map(text)
        .join(":");
        let mut mac = self.key.clone();
        mac.update(payload.as_bytes());
        mac
    }

    pub(crate) fn verify(&self, body: &[u8]) -> Result<(), VerifyError> {
        let envelope: Value = serde_json::from_slice(body)
            .map_err(|_| VerifyError::Malformed("notification (not JSON)".into()))?;
        let items = envelope
            .get("notificationItems")
            .and_then(Value::as_array)
            .ok_or_else(|| VerifyError::Malformed("notification (no notificationItems)".into()))?;
        let [wrapper] = items.as_slice() else {
            return Err(VerifyError::Unsupported(format!(
                "{} notification items in one request: one is verified and keyed",
                items.len()
            )));
        };
        let item = wrapper.get("NotificationRequestItem").ok_or_else(|| {
            VerifyError::Malformed("notification (no NotificationRequestItem)".into())
        })?;
        let sig = item
            .pointer("/additionalData/hmacSignature")
            .and_then(Value::as_str)
            .ok_or_else(|| VerifyError::Missing("additionalData.hmacSignature".into()))?;
        let sig = STANDARD
            .decode(sig)
            .map_err(|_| VerifyError::Malformed("hmacSignature (not base64)".into()))?;
        self.mac(item)
            .verify_slice(&sig)
            .map_err(|_| VerifyError::BadSignature)
    }
}
