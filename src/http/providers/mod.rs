//! Payment providers' callback schemes (feature `providers`): each
//! verifies a callback as its provider specifies, over the raw bytes
//! received and before any dedup work, turns it into the payload the
//! engine and the handler see, names the business field the key comes
//! from, and answers as the provider expects. The guide below has the one
//! table of what each provider signs, its payload, key, retry horizon
//! (with the provider's own words as the source) and how long a replay is
//! refused.
//!
#![doc = include_str!("../../../docs/providers.md")]

mod adyen;
mod alipay;
mod fence;
mod github;
mod keys;
mod stripe;
mod wechat;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use bytes::Bytes;

pub use adyen::Adyen;
pub use alipay::Alipay;
pub use github::GitHub;
pub use keys::ProviderKeyError;
pub use stripe::Stripe;
pub use wechat::WeChatPay;

use std::time::Duration;

use super::VerifyError;
use super::config::Ack;
use crate::delivery::Delivery;
use crate::key::{KeyError, KeySpec};

/// How much longer than a provider's retry horizon its records are kept at
/// least, and how much younger than the retention a signed event time must
/// be (clock skew, delivery delays).
pub(crate) const REPLAY_MARGIN: Duration = Duration::from_secs(3600);

const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;

/// One payment provider's callback scheme, for
/// [`IdempotencyLayer::provider`](super::IdempotencyLayer::provider).
/// Made from one of the verifiers with `Provider::from` (or `.into()`).
#[derive(Clone, Debug)]
pub struct Provider {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    Alipay(Alipay),
    WeChatPay(WeChatPay),
    Stripe(Stripe),
    GitHub(GitHub),
    Adyen(Adyen),
}

macro_rules! from_verifier {
    ($($variant:ident),*) => {$(
        impl From<$variant> for Provider {
            fn from(v: $variant) -> Self {
                Self { kind: Kind::$variant(v) }
            }
        }
    )*};
}
from_verifier!(Alipay, WeChatPay, Stripe, GitHub, Adyen);

/// The body of a verified callback as it was received, before the provider
/// decoded (Alipay) or decrypted (WeChat Pay) it: a request extension the
/// handler may extract (`Extension<RawCallback>`), e.g. for WeChat Pay's
/// `event_type`, which lives outside the encrypted resource.
#[derive(Clone, Debug)]
pub struct RawCallback(pub Bytes);

impl Provider {
    /// `alipay`, `wechatpay`, `stripe`, `github` or `adyen`.
    pub fn name(&self) -> &'static str {
        match &self.kind {
            Kind::Alipay(_) => "alipay",
            Kind::WeChatPay(_) => "wechatpay",
            Kind::Stripe(_) => "stripe",
            Kind::GitHub(_) => "github",
            Kind::Adyen(_) => "adyen",
        }
    }

    /// The key of a callback unless the layer's engine builder names
    /// another ([`key_expr`](crate::EngineBuilder::key_expr)): see the
    /// [module documentation](self). Composite keys are the canonical JSON
    /// array of their fields, an absent optional field empty; GitHub's is
    /// the SHA-256 of the canonical JSON body alone.
    pub fn default_key(&self) -> KeySpec {
        match &self.kind {
            Kind::Alipay(_) => fields_key(&["/out_trade_no", "/trade_status"], &["/out_biz_no"]),
            Kind::WeChatPay(_) => fields_key(
                &["/out_trade_no"],
                &["/out_refund_no", "/refund_status", "/trade_state"],
            ),
            Kind::Stripe(_) => KeySpec::json_field("/id"),
            Kind::GitHub(_) => body_digest_key(),
            Kind::Adyen(_) => KeySpec::json_fields([
                "/notificationItems/0/NotificationRequestItem/pspReference",
                "/notificationItems/0/NotificationRequestItem/eventCode",
                "/notificationItems/0/NotificationRequestItem/success",
            ]),
        }
    }

    /// A payload with every field the provider signs, as its route hands
    /// it to the handler, for providers whose route keeps the signed
    /// fields only (Adyen); `None` for the others, whose payload is the
    /// whole verified body. The layer checks a fence against it at build.
    pub(crate) fn signed_payload_sample(&self) -> Option<Vec<u8>> {
        match &self.kind {
            Kind::Adyen(_) => Some(adyen::signed_sample()),
            _ => None,
        }
    }

    /// How long the provider keeps redelivering a callback it got no
    /// success answer for (see the [module documentation](self) for the
    /// sources): Alipay 25 h, WeChat Pay 24 h 4 min, Stripe 3 days,
    /// GitHub 3 days (manual redelivery), Adyen 30 days.
    pub fn retry_horizon(&self) -> Duration {
        Duration::from_secs(match &self.kind {
            Kind::Alipay(_) => 25 * HOUR,
            Kind::WeChatPay(_) => 24 * HOUR + 4 * 60,
            Kind::Stripe(_) | Kind::GitHub(_) => 3 * DAY,
            Kind::Adyen(_) => 30 * DAY,
        })
    }

    /// The shortest retention a layer for this provider may keep: its
    /// [retry horizon](Self::retry_horizon) and one hour (clock skew,
    /// delivery delays).
    pub fn min_retention(&self) -> Duration {
        self.retry_horizon() + REPLAY_MARGIN
    }

    /// The retention of a layer for this provider unless it sets one:
    /// Alipay and WeChat Pay 2 days, Stripe 4 days, GitHub 8 days (covers
    /// Enterprise Server's 7 days of redelivery), Adyen 31 days.
    pub fn default_retention(&self) -> Duration {
        Duration::from_secs(match &self.kind {
            Kind::Alipay(_) | Kind::WeChatPay(_) => 2 * DAY,
            Kind::Stripe(_) => 4 * DAY,
            Kind::GitHub(_) => 8 * DAY,
            Kind::Adyen(_) => 31 * DAY,
        })
    }

    /// The provider for a layer that keeps its records for `retention`:
    /// signed event times older than that less one hour are
    /// refused (Alipay's `notify_time`).
    pub(crate) fn with_retention(self, retention: Duration) -> Self {
        let max_age = retention.saturating_sub(REPLAY_MARGIN);
        let kind = match self.kind {
            Kind::Alipay(v) => Kind::Alipay(v.max_age(max_age)),
            other => other,
        };
        Self { kind }
    }

    /// What a processed or duplicate callback gets.
    pub fn success(&self) -> Ack {
        match &self.kind {
            Kind::Alipay(_) => Ack::plain_success(),
            Kind::WeChatPay(_) | Kind::GitHub(_) => Ack::new(StatusCode::NO_CONTENT, "", ""),
            Kind::Stripe(_) => Ack::new(StatusCode::OK, "application/json", r#"{"received":true}"#),
            Kind::Adyen(_) => Ack::new(StatusCode::OK, "text/plain; charset=utf-8", "[accepted]"),
        }
    }

    /// Verifies `body` as received with `headers` at `now_secs`; the
    /// payload that replaces the body (see [`verify`](super::verify)). It
    /// is always the provider's reading of the signed bytes, never one the
    /// (unsigned) content type chose: a JSON body sent as a form would
    /// otherwise be read as another payload, under another key.
    pub(crate) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<Option<Vec<u8>>, VerifyError> {
        match &self.kind {
            Kind::Alipay(v) => v.verify(headers, body, now_secs).map(Some),
            Kind::WeChatPay(v) => v.verify(headers, body, now_secs).map(Some),
            Kind::Stripe(v) => {
                v.verify(headers, body, now_secs)?;
                json_payload(body).map(Some)
            }
            Kind::GitHub(v) => v.verify(headers, body).map(Some),
            Kind::Adyen(v) => v.verify(body).map(Some),
        }
    }

    /// The handler's response in the provider's format: a 2xx becomes the
    /// [success](Self::success) answer; a 4xx or 5xx keeps its status
    /// (which the provider retries) with the provider's failure body, if it
    /// has one; anything else (a redirect) is a `500` failure.
    pub(crate) fn answer(&self, mut response: Response<Body>) -> Response<Body> {
        let status = response.status();
        if status.is_success() {
            return self.success().response();
        }
        if !status.is_client_error() && !status.is_server_error() {
            // A redirect or an informational status tells a provider
            // nothing: a failure, rolled back, retried.
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            return self.answer(response);
        }
        let failure = match &self.kind {
            Kind::Alipay(_) => ("text/plain; charset=utf-8", "fail".to_owned()),
            Kind::WeChatPay(_) => (
                "application/json",
                serde_json::json!({
                    "code": "FAIL",
                    "message": status.canonical_reason().unwrap_or("failed"),
                })
                .to_string(),
            ),
            Kind::Stripe(_) | Kind::GitHub(_) | Kind::Adyen(_) => return response,
        };
        let (mut head, _) = response.into_parts();
        head.headers.remove(header::CONTENT_LENGTH);
        head.headers
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(failure.0));
        Response::from_parts(head, Body::from(failure.1))
    }
}

/// A key of the payload's canonical-JSON fingerprint (hex), and of
/// nothing else: not the request's path or principal, which nobody signs.
fn body_digest_key() -> KeySpec {
    KeySpec::custom(|d: &Delivery| {
        let json = d.json().map_err(|e| KeyError::NotJson(e.to_owned()))?;
        Ok(crate::fingerprint::canonical_json(json).to_hex())
    })
}

/// `body` as the JSON payload it must be.
fn json_payload(body: &[u8]) -> Result<Vec<u8>, VerifyError> {
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|_| VerifyError::Malformed("callback (not JSON)".into()))?;
    Ok(body.to_vec())
}

/// A key of the canonical JSON array of the JSON fields at `required`
/// (absent: the key is missing) and at `optional` (absent: empty).
fn fields_key(required: &'static [&'static str], optional: &'static [&'static str]) -> KeySpec {
    KeySpec::custom(move |d: &Delivery| {
        let json = d.json().map_err(|e| KeyError::NotJson(e.to_owned()))?;
        let text = |pointer: &str| match json.pointer(pointer) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(serde_json::Value::Number(n)) => Ok(Some(n.to_string())),
            Some(_) => Err(KeyError::NotScalar {
                pointer: pointer.to_owned(),
            }),
        };
        let mut values = Vec::with_capacity(required.len() + optional.len());
        for pointer in required {
            values.push(text(pointer)?.ok_or_else(|| KeyError::MissingField {
                pointer: (*pointer).to_owned(),
            })?);
        }
        for pointer in optional {
            values.push(text(pointer)?.unwrap_or_default());
        }
        Ok(String::from_utf8_lossy(&crate::fingerprint::canonical_bytes(&values)).into_owned())
    })
}

/// The value of header `name` as text, or [`VerifyError::Missing`].
fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, VerifyError> {
    headers
        .get(name)
        .ok_or_else(|| VerifyError::Missing(format!("header {name}")))?
        .to_str()
        .map_err(|_| VerifyError::Malformed(format!("header {name}")))
}

#[cfg(test)]
mod tests;
