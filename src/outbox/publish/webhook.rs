use std::time::Duration;

use async_trait::async_trait;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::{Kind, Outgoing, PublishError, Publisher};
use crate::outbox::message::SIGNATURE_HEADER;

/// POSTs webhooks signed with HMAC-SHA256: header
/// [`SIGNATURE_HEADER`] is `t=<unix seconds>,v1=<hex>` over
/// `<t>.<body>` (the scheme [`SignatureCheck`](crate::http::SignatureCheck)
/// verifies, so a onceonly receiver can check it). A 2xx answer is
/// delivered; 5xx, 408, 429 and timeouts are retried; any other 4xx is
/// permanent.
///
/// Redirects are not followed: an HTTP client following a 301, 302 or
/// 303 turns the POST into a GET without body, and the 2xx at its end
/// would mark a notification delivered that never arrived. A 3xx
/// answer is a permanent failure naming the `Location`: configure the
/// final URL.
pub struct WebhookPublisher {
    client: reqwest::Client,
    secret: Vec<u8>,
}

impl WebhookPublisher {
    /// A publisher signing with `secret`, with a 10 s timeout.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        Self::with_timeout(secret, Duration::from_secs(10))
    }

    /// The same with another request timeout.
    pub fn with_timeout(secret: impl Into<Vec<u8>>, timeout: Duration) -> Self {
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
        Self {
            client,
            secret: secret.into(),
        }
    }

    /// The signature header value for `body` at `unix_secs`.
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
            .header("content-type", "application/json")
            .header(SIGNATURE_HEADER, self.sign(&row.payload, now));
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
