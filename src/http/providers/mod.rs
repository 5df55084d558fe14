//! Payment providers' callback schemes (feature `providers`): each
//! verifies a callback as its provider specifies, over the raw bytes
//! received and before any dedup work, turns it into the payload the
//! engine and the handler see, names the business field the key comes
//! from, and answers as the provider expects.
//!
//! | provider | verifies | key (default) | answers |
//! |---|---|---|---|
//! | [`Alipay`] | RSA2 (SHA256withRSA) over the sorted, non-empty form fields but `sign`, `sign_type`; UTF-8, GBK, GB18030 | `out_trade_no` | `200 success` |
//! | [`WeChatPay`] | SHA256withRSA over `timestamp\nnonce\nbody\n` with the platform key of `Wechatpay-Serial`, timestamp tolerance; decrypts `resource` (AEAD_AES_256_GCM) | `out_trade_no` of the decrypted resource | `204` |
//! | [`Stripe`] | `Stripe-Signature` `t=..,v1=..` HMAC-SHA256 over `t.body`, several `v1`, tolerance | event `id` | `200 {"received":true}` |
//! | [`GitHub`] | `X-Hub-Signature-256: sha256=<hex>` HMAC-SHA256 over the body | header `X-GitHub-Delivery` | `204` |
//! | [`Adyen`] | HMAC-SHA256 (hex key) over the notification item's fields, base64 in `additionalData.hmacSignature` | `pspReference` + `eventCode` | `200 [accepted]` |
//!
//! A callback that fails verification gets `401` with a problem document
//! naming the reason ([`VerifyError`]), and nothing is
//! claimed. A duplicate gets the same success answer as the first
//! delivery. A handler's non-2xx answer is rolled back and keeps its status
//! (every provider retries a non-2xx answer); Alipay's body becomes `fail`,
//! WeChat Pay's `{"code":"FAIL","message":..}`.

mod adyen;
mod alipay;
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

use super::VerifyError;
use super::config::Ack;
use crate::key::KeySpec;

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

    /// The key of a callback unless the layer is given another
    /// ([`key_expr`](super::IdempotencyLayerBuilder::key_expr)): see the
    /// [module documentation](self).
    pub fn default_key(&self) -> KeySpec {
        match &self.kind {
            Kind::Alipay(_) | Kind::WeChatPay(_) => KeySpec::json_field("/out_trade_no"),
            Kind::Stripe(_) => KeySpec::json_field("/id"),
            Kind::GitHub(_) => KeySpec::header("X-GitHub-Delivery"),
            Kind::Adyen(_) => KeySpec::json_fields([
                "/notificationItems/0/NotificationRequestItem/pspReference",
                "/notificationItems/0/NotificationRequestItem/eventCode",
            ]),
        }
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

    /// Verifies `body` as received with `headers` at `now_secs`;
    /// `Some(payload)` replaces the body (see [`verify`](super::verify)).
    pub(crate) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<Option<Vec<u8>>, VerifyError> {
        match &self.kind {
            Kind::Alipay(v) => v.verify(headers, body).map(Some),
            Kind::WeChatPay(v) => v.verify(headers, body, now_secs).map(Some),
            Kind::Stripe(v) => v.verify(headers, body, now_secs).map(|()| None),
            Kind::GitHub(v) => v.verify(headers, body).map(|()| None),
            Kind::Adyen(v) => v.verify(body).map(|()| None),
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
