use std::time::Duration;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{Kind, Outgoing, PublishError, Publisher};

/// How a [`WebhookPublisher`] signs its webhooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WebhookSigning {
    /// [Standard Webhooks](https://www.standardwebhooks.com/) (Svix and
    /// others; the default): `webhook-id` (the message id, the same on
    /// every retry), `webhook-timestamp` (Unix seconds) and
    /// `webhook-signature: v1,<base64 of HMAC-SHA256 of "<id>.<timestamp>.<body>">`.
    /// A secret given as `whsec_<base64>` is the base64-decoded key, as
    /// the spec's libraries read it; any other secret is the key's bytes
    /// (share it with receivers as [`WebhookPublisher::standard_secret`]).
    #[default]
    Standard,
    /// onceonly's own format: [`Header::Signature`](crate::Header::Signature) is
    /// `t=<unix seconds>,v1=<hex of HMAC-SHA256 of "<t>.<body>">`, the
    /// scheme [`SignatureCheck`](crate::http::SignatureCheck) verifies.
    Onceonly,
}

pub(crate) const WEBHOOK_ID_HEADER: &str = crate::Header::WebhookId.name();
pub(crate) const WEBHOOK_TIMESTAMP_HEADER: &str = crate::Header::WebhookTimestamp.name();
pub(crate) const WEBHOOK_SIGNATURE_HEADER: &str = crate::Header::WebhookSignature.name();

/// POSTs webhooks signed with HMAC-SHA256, as
/// [Standard Webhooks](https://www.standardwebhooks.com/) by default, or in
/// onceonly's own format ([`WebhookSigning`]). Every copy of a message
/// carries the same id ([`Header::MessageId`](crate::Header::MessageId),
/// and `webhook-id`). A 2xx
/// answer is delivered; 5xx, 408, 429 and timeouts are retried; any other
/// 4xx is permanent.
///
/// Redirects are not followed: an HTTP client following a 301, 302 or
/// 303 turns the POST into a GET without body, and the 2xx at its end
/// would mark a notification delivered that never arrived. A 3xx
/// answer is a permanent failure naming the `Location`: configure the
/// final URL.
pub struct WebhookPublisher {
    client: reqwest::Client,
    secret: Vec<u8>,
    signing: WebhookSigning,
}

impl WebhookPublisher {
    /// A publisher signing with `secret` as Standard Webhooks, with a 10 s
    /// timeout. A `whsec_<base64>` secret (padded or not, as Svix and the
    /// spec's libraries issue and accept it) is its decoded key; any
    /// other secret is the key's bytes. An empty secret, or a `whsec_`
    /// secret that is not base64, is refused: signing with it would fail
    /// every receiver's check.
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        Self::with_timeout(secret, Duration::from_secs(10))
    }

    /// A publisher signing with `secret` in onceonly's own format
    /// ([`WebhookSigning::Onceonly`]), for receivers set up before
    /// Standard Webhooks became the default.
    pub fn onceonly_signed(secret: impl Into<Vec<u8>>) -> Result<Self, WebhookSecretError> {
        Ok(Self::new(secret)?.signing(WebhookSigning::Onceonly))
    }

    /// The same publisher signing as `signing` says.
    #[must_use]
    pub fn signing(mut self, signing: WebhookSigning) -> Self {
        self.signing = signing;
        self
    }

    /// The key as Standard Webhooks receivers are given it:
    /// `whsec_<base64 of the key>`.
    pub fn standard_secret(&self) -> String {
        format!("whsec_{}", BASE64.encode(self.key()))
    }

    /// The HMAC key: a `whsec_<base64>` secret decoded, any other as it is.
    fn key(&self) -> &[u8] {
        &self.secret
    }

    /// [`new`](Self::new) with another request timeout.
    pub fn with_timeout(
        secret: impl Into<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Self, WebhookSecretError> {
        let secret = decode_secret(secret.into())?;
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_else(|e| {
                // Only a TLS backend that cannot start fails here; the
                // default client then follows redirects, which
                // `publish` detects and refuses.
                tracing::error!(error = %e, "webhook client setup failed; using the default client");
                reqwest::Client::default()
            });
        Ok(Self {
            client,
            secret,
            signing: WebhookSigning::default(),
        })
    }

    /// The Standard Webhooks signature header value of message `id` with
    /// `body` at `unix_secs`: `v1,<base64>`.
    pub fn sign_standard(&self, id: &str, unix_secs: u64, body: &[u8]) -> String {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(self.key()) else {
            // HMAC takes keys of any length.
            return String::new();
        };
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(unix_secs.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
    }

    /// onceonly's signature header value ([`WebhookSigning::Onceonly`])
    /// for `body` at `unix_secs`.
    pub fn sign(&self, body: &[u8], unix_secs: u64) -> String {
        let mut mac = match Hmac::<Sha256>::new_from_slice(&self.secret) {
            Ok(mac) => mac,
            // HMAC takes keys of any length.
            Err(_) => return String::new(),
        };
        mac.update(unix_secs.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!(
            "t={unix_secs},v1={}",
            hex::encode(mac.finalize().into_bytes())
        )
    }
}

/// Why [`WebhookPublisher::new`] refused a secret.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookSecretError {
    /// The secret (or the key a `whsec_` secret encodes) is empty.
    #[error("the webhook secret is empty")]
    Empty,
    /// A `whsec_` secret whose rest is not base64: Standard Webhooks
    /// receivers decode it as base64, so no signature made with its text
    /// would verify.
    #[error(
        "a whsec_ secret is the base64 of its key (Standard Webhooks), and this one is not: {0}"
    )]
    NotBase64(String),
}

/// The HMAC key of `secret`: a `whsec_` secret is the base64 of the key
/// (Standard Webhooks), with or without its padding as the spec's
/// libraries take it; any other secret is the key's bytes.
fn decode_secret(secret: Vec<u8>) -> Result<Vec<u8>, WebhookSecretError> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    const WHSEC: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let key = match secret.strip_prefix(b"whsec_") {
        Some(encoded) => WHSEC
            .decode(encoded)
            .map_err(|e| WebhookSecretError::NotBase64(e.to_string()))?,
        None => secret,
    };
    if key.is_empty() {
        return Err(WebhookSecretError::Empty);
    }
    Ok(key)
}

#[async_trait]
impl Publisher for WebhookPublisher {
    fn kind(&self) -> Kind {
        Kind::Webhook
    }

    async fn publish(&self, message: &Outgoing<'_>) -> Result<(), PublishError> {
        let row = message.row;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut request = self
            .client
            .post(&row.destination)
            .header("content-type", "application/json");
        request = match self.signing {
            WebhookSigning::Standard => request
                .header(WEBHOOK_ID_HEADER, &row.message_id)
                .header(WEBHOOK_TIMESTAMP_HEADER, now.to_string())
                .header(
                    WEBHOOK_SIGNATURE_HEADER,
                    self.sign_standard(&row.message_id, now, &row.payload),
                ),
            WebhookSigning::Onceonly => request.header(
                crate::Header::Signature.name(),
                self.sign(&row.payload, now),
            ),
        };
        for (name, value) in &message.headers {
            request = request.header(name, value);
        }
        let response = request
            .body(row.payload.clone())
            .send()
            .await
            .map_err(|e| {
                if e.is_builder() {
                    PublishError::permanent(format!("webhook {}: {e}", row.destination))
                } else {
                    PublishError::retryable(format!("webhook {}: {e}", row.destination))
                }
            })?;
        let status = response.status();
        if status.is_redirection() {
            let location = response
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .unwrap_or("no Location");
            return Err(PublishError::permanent(format!(
                "webhook {} answered {status} (redirect to {location}, not followed: a POST must reach its final URL)",
                row.destination
            )));
        }
        if reqwest::Url::parse(&row.destination).ok().as_ref() != Some(response.url()) {
            return Err(PublishError::permanent(format!(
                "webhook {} was redirected to {}: not delivered",
                row.destination,
                response.url()
            )));
        }
        if status.is_success() {
            return Ok(());
        }
        let text = format!("webhook {} answered {status}", row.destination);
        let retry = status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429;
        Err(if retry {
            PublishError::retryable(text)
        } else {
            PublishError::permanent(text)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector of the Standard Webhooks libraries
    /// (`test_sign_function`): secret, message id, timestamp, payload and
    /// the signature they expect.
    #[test]
    fn standard_webhooks_test_vector() {
        let publisher = WebhookPublisher::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            publisher.sign_standard(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        assert_eq!(
            publisher.standard_secret(),
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
        );
        // The raw key signs the same.
        let raw = BASE64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(
            WebhookPublisher::new(raw).unwrap().sign_standard(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        // Not that signature for another id, time or body.
        assert_ne!(
            publisher.sign_standard("msg_other", 1_614_265_330, br#"{"test": 2432232314}"#),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn the_default_is_standard_and_the_onceonly_format_stays() {
        assert_eq!(
            WebhookPublisher::new("k").unwrap().signing,
            WebhookSigning::Standard
        );
        let onceonly = WebhookPublisher::onceonly_signed("k").unwrap();
        assert_eq!(onceonly.signing, WebhookSigning::Onceonly);
        assert!(onceonly.sign(b"{}", 1).starts_with("t=1,v1="));
    }

    /// Secrets as the Standard Webhooks Python library (`standardwebhooks`
    /// 1.0) reads them, and the signature it makes with each for one
    /// message: padded and unpadded `whsec_` secrets are the same key.
    #[test]
    fn padded_and_unpadded_whsec_secrets_sign_as_the_spec_libraries_do() {
        let (id, ts, body) = (
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f1W",
            1_674_087_231,
            br#"{"type":"payment.settled","amount":500}"#,
        );
        let expected = "v1,Fom7oFMwmTh6hz6lngWwgrinz/iNUkpvxYNL+C9cdHY=";
        for secret in [
            "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
            "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8",
        ] {
            let publisher = WebhookPublisher::new(secret).unwrap();
            assert_eq!(publisher.sign_standard(id, ts, body), expected, "{secret}");
            assert_eq!(
                publisher.standard_secret(),
                "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8="
            );
        }
        // A bare secret is the key's bytes: shared as its `whsec_` form.
        let raw = WebhookPublisher::new((0u8..32).collect::<Vec<u8>>()).unwrap();
        assert_eq!(raw.sign_standard(id, ts, body), expected);
        // What the libraries cannot read is refused, not used as text.
        assert!(matches!(
            WebhookPublisher::new("whsec_not base64!"),
            Err(WebhookSecretError::NotBase64(_))
        ));
        assert!(matches!(
            WebhookPublisher::new("whsec_"),
            Err(WebhookSecretError::Empty)
        ));
        assert!(matches!(
            WebhookPublisher::new(""),
            Err(WebhookSecretError::Empty)
        ));
    }
}
