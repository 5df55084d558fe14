//! Stripe webhooks: `Stripe-Signature: t=<unix>,v1=<hex>[,v1=..]`, the
//! HMAC-SHA256 of `"<t>.<raw body>"` with the endpoint's signing secret
//! (Stripe's "Verify webhook signatures with your own solution"). This is
//! [`SignatureCheck`](crate::http::SignatureCheck), reading Stripe's header.

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName};

use super::VerifyError;
use super::keys::ProviderKeyError;
use crate::http::SignatureCheck;

/// Stripe webhook verifier: `Stripe::new("whsec_...")`, five minutes of
/// tolerance (Stripe's libraries' default).
#[derive(Clone, Debug)]
pub struct Stripe {
    check: SignatureCheck,
}

impl Stripe {
    /// The endpoint's signing secret, as Stripe shows it (`whsec_...`,
    /// used as is); an empty or short one (under
    /// 16 bytes) is refused.
    pub fn new(signing_secret: impl Into<Vec<u8>>) -> Result<Self, ProviderKeyError> {
        let check = SignatureCheck::new(signing_secret)
            .map_err(|e| ProviderKeyError::HmacKey(e.to_string()))?;
        Ok(Self {
            check: check.header(HeaderName::from_static("stripe-signature")),
        })
    }

    /// How far `t` may be from now, either way (default five minutes).
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.check = self.check.tolerance(tolerance);
        self
    }

    /// The `Stripe-Signature` value Stripe would send for `body` at
    /// `unix_secs` (tests, local replays).
    pub fn sign(&self, unix_secs: u64, body: &[u8]) -> String {
        self.check.sign(unix_secs, body)
    }

    pub(crate) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<(), VerifyError> {
        Ok(self.check.verify(headers, body, now_secs)?)
    }
}
