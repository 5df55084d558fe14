//! Adyen standard webhooks, HMAC-signed: for each `NotificationRequestItem`,
//! the HMAC-SHA256 (key: the hex string Adyen issues, decoded to bytes) of
//! `pspReference:originalReference:merchantAccountCode:merchantReference:
//! value:currency:eventCode:success` (absent fields empty), base64 in
//! `additionalData.hmacSignature` (Adyen's "Verify HMAC signatures", "Build
//! your own custom solution").
//!
//! The `:`-joined string is ambiguous as such: a `:` inside one field
//! could move text into the next one and still give the same string,
//! under a new key. So every field but `merchantReference` is checked
//! against the form Adyen gives it, none of which holds a `:`
//! (`pspReference` 16 letters and digits, `originalReference` empty or the
//! same, `merchantAccountCode` without `:`, an integer `value`, a
//! three-letter `currency`, an `eventCode` of capitals and `_`, `success`
//! `true` or `false`): the one field that may hold `:` then has only one
//! place left. Everything else in the item is **not signed**:
//! `additionalData` (but its `hmacSignature`), `eventDate`, `reason`,
//! `paymentMethod`, `operations`, and the envelope's `live`.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use serde_json::Value;
use sha2::Sha256;

use super::VerifyError;
use super::keys::ProviderKeyError;

type HmacSha256 = Hmac<Sha256>;

/// Refuses an item whose signed fields do not have the form Adyen gives
/// them (see the [module](self)): none but `merchantReference` may hold a
/// `:`.
fn check_forms(item: &Value) -> Result<(), VerifyError> {
    let text = |pointer: &str| item.pointer(pointer).and_then(Value::as_str);
    let bad = |field: &str| VerifyError::Malformed(format!("notification ({field})"));
    let reference = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_alphanumeric());
    if !text("/pspReference").is_some_and(reference) {
        return Err(bad("pspReference: 16 letters and digits"));
    }
    match item.pointer("/originalReference") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() || reference(s) => {}
        Some(_) => return Err(bad("originalReference: 16 letters and digits")),
    }
    if !text("/merchantAccountCode").is_some_and(|s| !s.is_empty() && !s.contains(':')) {
        return Err(bad("merchantAccountCode"));
    }
    match item.pointer("/merchantReference") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => return Err(bad("merchantReference: a string")),
    }
    match item.get("amount") {
        None | Some(Value::Null | Value::Object(_)) => {}
        Some(_) => return Err(bad("amount: an object")),
    }
    match item.pointer("/amount/value") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {}
        Some(_) => return Err(bad("amount.value: an integer")),
    }
    match item.pointer("/amount/currency") {
        None | Some(Value::Null) => {}
        Some(Value::String(c)) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => {}
        Some(_) => return Err(bad("amount.currency: three capital letters")),
    }
    let event = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
    if !text("/eventCode").is_some_and(event) {
        return Err(bad("eventCode: capitals and _"));
    }
    // A string, as Adyen sends it: a JSON `true` signs the same text and
    // would read differently.
    match item.pointer("/success") {
        Some(Value::String(s)) if s == "true" || s == "false" => Ok(()),
        _ => Err(bad("success: \"true\" or \"false\"")),
    }
}

/// Adyen verifier: `Adyen::new("<hex HMAC key>")`.
///
/// The payload the key, the fingerprint and the handler see is the
/// notification with its item's **signed** fields only (`pspReference`,
/// `originalReference`, `merchantAccountCode`, `merchantReference`,
/// `amount.value`, `amount.currency`, `eventCode`, `success`), in Adyen's
/// envelope; the body as received, unsigned fields included, is in
/// [`RawCallback`](super::RawCallback). One item per
/// request, as Adyen sends JSON webhooks: the key is its `pspReference`,
/// `eventCode` and `success` (Adyen's advice for spotting duplicates is
/// the first two: one payment's `AUTHORISATION` and `CAPTURE` share the
/// `pspReference`; `success` keeps a failed and a later successful event
/// apart); a body with several items is refused (`unsupported-signature`),
/// since one key cannot stand for several events. Adyen signs no time
/// (`eventDate` is not signed): a replay after the retention is not
/// refused, so keep the layer's retention at Adyen's retry horizon (30
/// days, the floor the layer enforces) or longer.
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
    /// The HMAC key as Adyen's Customer Area shows it: 64 hex digits (32
    /// bytes). Anything else, an empty key included, is refused.
    pub fn new(hex_key: &str) -> Result<Self, ProviderKeyError> {
        let raw = hex::decode(hex_key.trim())
            .map_err(|e| ProviderKeyError::HmacKey(format!("not hex: {e}")))?;
        if raw.len() != 32 {
            return Err(ProviderKeyError::HmacKey(format!(
                "{} bytes: Adyen's HMAC keys are 32 bytes (64 hex digits)",
                raw.len()
            )));
        }
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

    /// Verifies a notification; returns it with its item's signed fields
    /// only.
    pub(crate) fn verify(&self, body: &[u8]) -> Result<Vec<u8>, VerifyError> {
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
        check_forms(item)?;
        let sig = item
            .pointer("/additionalData/hmacSignature")
            .and_then(Value::as_str)
            .ok_or_else(|| VerifyError::Missing("additionalData.hmacSignature".into()))?;
        let sig = STANDARD
            .decode(sig)
            .map_err(|_| VerifyError::Malformed("hmacSignature (not base64)".into()))?;
        self.mac(item)
            .verify_slice(&sig)
            .map_err(|_| VerifyError::BadSignature)?;
        Ok(signed_only(item))
    }
}

/// A payload as [`signed_only`] makes it, every signed field present.
pub(super) fn signed_sample() -> Vec<u8> {
    signed_only(&serde_json::json!({
        "pspReference": "8816178952380553",
        "originalReference": "8816178952380552",
        "merchantAccountCode": "Merchant",
        "merchantReference": "order-1",
        "eventCode": "AUTHORISATION",
        "success": "true",
        "amount": {"value": 1000, "currency": "EUR"},
    }))
}

/// The notification with the signed fields of its item only, in Adyen's
/// own envelope (so the same JSON pointers reach them): what a handler may
/// trust. The unsigned rest (`additionalData`, `eventDate`, `reason`, ...)
/// is in the raw body ([`RawCallback`](super::RawCallback)).
fn signed_only(item: &Value) -> Vec<u8> {
    // Built from what the signature covers, as it covers it: a field
    // signed as empty (absent, `null` or `""`) is left out, whichever of
    // the three was sent, so no unsigned difference reaches the payload.
    let mut signed = serde_json::Map::new();
    for field in [
        "pspReference",
        "originalReference",
        "merchantAccountCode",
        "merchantReference",
        "eventCode",
        "success",
    ] {
        if let Some(Value::String(text)) = item.get(field).filter(|v| v.as_str() != Some("")) {
            signed.insert(field.to_owned(), Value::String(text.clone()));
        }
    }
    let mut amount = serde_json::Map::new();
    if let Some(value @ Value::Number(_)) = item.pointer("/amount/value") {
        amount.insert("value".to_owned(), value.clone());
    }
    if let Some(currency @ Value::String(_)) = item.pointer("/amount/currency") {
        amount.insert("currency".to_owned(), currency.clone());
    }
    if !amount.is_empty() {
        signed.insert("amount".to_owned(), Value::Object(amount));
    }
    serde_json::json!({"notificationItems": [{"NotificationRequestItem": signed}]})
        .to_string()
        .into_bytes()
}
