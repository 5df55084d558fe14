//! Alipay asynchronous notifications (`notify_url`), `sign_type=RSA2`.
//!
//! As Alipay's "异步通知验签" (verifying asynchronous notifications)
//! specifies: take every parameter but `sign` and `sign_type`, drop the
//! empty ones, sort by name, join as `name=value` with `&` (values decoded
//! from the URL encoding, not re-encoded), and verify `sign` (base64)
//! as SHA256withRSA of those bytes, in the notification's `charset`, with
//! Alipay's public key.

use std::time::Duration;

use axum::http::{HeaderMap, header};

use super::VerifyError;
use super::keys::{ProviderKeyError, RsaKey};
use crate::http::form::{Charset, FormError, form_content_type, raw_pairs};

/// Beijing time, the zone Alipay's `yyyy-MM-dd HH:mm:ss` times are in.
const BEIJING: i64 = 8 * 3600;

/// Alipay notification verifier: `Alipay::new(alipay_public_key)`.
///
/// The payload the key, the fingerprint and the handler see is a JSON
/// object of the notification's **signed** fields (every non-empty field
/// but `sign` and `sign_type`), decoded in the charset the signed
/// `charset` field names (UTF-8, GBK or GB18030; UTF-8 without one: the
/// content type's charset is not signed and is not read).
///
/// Alipay joins the decoded fields with bare `&` and `=`, so a field
/// holding those could stand for several: `out_trade_no=A&point_amount=0`
/// signs the same bytes as the two fields it looks like. A notification is
/// accepted only if its signed string splits back into exactly the fields
/// received: no name holds `&` or `=`, and no `&` in a value is followed
/// by a `=` before the next `&`.
///
/// Alipay signs no timestamp but its `notify_time`: the layer refuses a
/// notification whose `notify_time` (Beijing time unless
/// [`notify_time_utc_offset`](Self::notify_time_utc_offset) says
/// otherwise) is older than its retention less an hour
/// (`expired-callback`), so a callback captured or retried after its record
/// was purged is not processed again.
#[derive(Clone)]
pub struct Alipay {
    key: RsaKey,
    /// Notifications older than this are refused (the layer's retention
    /// less a margin); `None` until a layer sets it.
    max_age: Option<Duration>,
    /// The zone of `notify_time`, in seconds east of UTC.
    utc_offset: i64,
}

impl std::fmt::Debug for Alipay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alipay")
            .field("max_age", &self.max_age)
            .finish_non_exhaustive()
    }
}

impl Alipay {
    /// Alipay's public key ("支付宝公钥", not the application's own), as PEM
    /// or as the bare base64 the open platform console shows.
    pub fn new(alipay_public_key: &str) -> Result<Self, ProviderKeyError> {
        Ok(Self {
            key: RsaKey::parse(alipay_public_key)?,
            max_age: None,
            utc_offset: BEIJING,
        })
    }

    /// The zone `notify_time` is written in, in seconds east of UTC
    /// (default Beijing time, `8 * 3600`).
    #[must_use]
    pub fn notify_time_utc_offset(mut self, seconds_east: i32) -> Self {
        self.utc_offset = i64::from(seconds_east);
        self
    }

    /// Refuses notifications whose `notify_time` is older than `max_age`.
    pub(crate) fn max_age(mut self, max_age: Duration) -> Self {
        self.max_age = Some(max_age);
        self
    }

    /// Verifies a notification at `now_secs`; returns its signed fields as
    /// a JSON object.
    pub(crate) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<Vec<u8>, VerifyError> {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if form_content_type(content_type).is_none() {
            return Err(VerifyError::Malformed(
                "notification (not application/x-www-form-urlencoded)".into(),
            ));
        }
        let mut pairs = raw_pairs(body).map_err(|e| match e {
            FormError::TooManyFields => {
                VerifyError::TooManyFields(crate::http::form::MAX_FORM_FIELDS)
            }
            e => VerifyError::Malformed(format!("notification ({e})")),
        })?;
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
        // The signed fields: every non-empty one but the signature's own.
        let signed: Vec<&(Vec<u8>, Vec<u8>)> = pairs
            .iter()
            .filter(|(k, v)| !v.is_empty() && k != b"sign" && k != b"sign_type")
            .collect();
        if let Some(name) = signed.iter().find(|(k, v)| !splits_back(k, v)) {
            return Err(VerifyError::Malformed(format!(
                "notification (field {:?} holds a separator of the signed string: it could stand for other fields)",
                String::from_utf8_lossy(&name.0)
            )));
        }
        let mut content = Vec::with_capacity(body.len());
        for (k, v) in &signed {
            if !content.is_empty() {
                content.push(b'&');
            }
            content.extend_from_slice(k);
            content.push(b'=');
            content.extend_from_slice(v);
        }
        self.key.verify(&content, sign)?;
        // Only the signed `charset` says how to read the signed bytes.
        let label = match field("charset").filter(|c| !c.is_empty()) {
            Some(c) => String::from_utf8_lossy(c).into_owned(),
            None => "utf-8".into(),
        };
        let charset = Charset::from_label(&label)
            .map_err(|_| VerifyError::Unsupported(format!("charset {label:?}")))?;
        if let Some(max_age) = self.max_age {
            let at = field("notify_time")
                .filter(|t| !t.is_empty())
                .ok_or_else(|| VerifyError::Missing("field notify_time".into()))?;
            let at = std::str::from_utf8(at)
                .ok()
                .and_then(|t| unix_secs(t, self.utc_offset))
                .ok_or_else(|| VerifyError::Malformed("field notify_time".into()))?;
            let age = i64::try_from(now_secs)
                .unwrap_or(i64::MAX)
                .saturating_sub(at);
            if age > i64::try_from(max_age.as_secs()).unwrap_or(i64::MAX) {
                return Err(VerifyError::Expired(u64::try_from(age).unwrap_or(0)));
            }
        }
        let mut fields = serde_json::Map::new();
        for (k, v) in signed {
            let bad = |_| VerifyError::Malformed(format!("notification (not {label})"));
            fields.insert(
                charset.decode(k.clone()).map_err(bad)?,
                serde_json::Value::String(charset.decode(v.clone()).map_err(bad)?),
            );
        }
        Ok(serde_json::Value::Object(fields).to_string().into_bytes())
    }
}

/// Whether the signed string's `name=value` splits back into this very
/// field: the name holds no `&` or `=`, and no `&` in the value is followed
/// by a `=` before the next `&` (which would read as another field).
fn splits_back(name: &[u8], value: &[u8]) -> bool {
    !name.contains(&b'&')
        && !name.contains(&b'=')
        && value
            .split(|&b| b == b'&')
            .skip(1)
            .all(|part| !part.contains(&b'='))
}

/// `yyyy-MM-dd HH:mm:ss` at `utc_offset` seconds east of UTC, as Unix
/// seconds.
fn unix_secs(text: &str, utc_offset: i64) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() != 19
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b' '
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = text.get(r)?;
        s.bytes()
            .all(|c| c.is_ascii_digit())
            .then(|| s.parse().ok())?
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss - utc_offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notify_times_read_in_beijing_time() {
        assert_eq!(unix_secs("1970-01-01 08:00:00", BEIJING), Some(0));
        // 2026-12-01 20:00:00 +08:00 is 12:00 UTC.
        assert_eq!(
            unix_secs("2026-12-01 20:00:00", BEIJING),
            Some(1_796_126_400)
        );
        assert_eq!(unix_secs("2024-02-29 00:00:00", 0), Some(1_709_164_800));
        for bad in [
            "2026-13-01 00:00:00",
            "2026-12-01T20:00:00",
            "2026-12-01 20:00",
            "２０２６-12-01 20:00:00",
        ] {
            assert_eq!(unix_secs(bad, BEIJING), None, "{bad}");
        }
    }

    #[test]
    fn only_fields_that_split_back_are_signed_unambiguously() {
        assert!(splits_back(b"subject", b"Tom & Jerry"));
        assert!(splits_back(b"body", b"a=b"));
        assert!(!splits_back(b"out_trade_no", b"ALI-1&point_amount=0.00"));
        assert!(!splits_back(b"a&b", b"1"));
        assert!(!splits_back(b"a=b", b"1"));
    }
}
