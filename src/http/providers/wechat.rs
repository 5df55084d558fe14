//! WeChat Pay API v3 notifications ("支付通知" / "签名验证" /
//! "证书和回调报文解密"): the platform signs `"<Wechatpay-Timestamp>\n
//! <Wechatpay-Nonce>\n<raw body>\n"` with SHA256withRSA (base64 in
//! `Wechatpay-Signature`), with the key named by `Wechatpay-Serial` (a
//! platform certificate's serial number, or a "微信支付公钥" id
//! `PUB_KEY_ID_...`); the body's `resource` is AEAD_AES_256_GCM-encrypted
//! with the merchant's APIv3 key, its `nonce` and `associated_data`.

use std::collections::HashMap;
use std::time::Duration;

use aes_gcm::aead::{Aead, Payload};
use aes_gcm::{Aes256Gcm, KeyInit, Nonce};
use axum::http::HeaderMap;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Deserialize;

use super::keys::{ProviderKeyError, RsaKey};
use super::{VerifyError, header_str};

/// WeChat Pay v3 verifier: `WeChatPay::new(api_v3_key)?` and one or more
/// platform keys ([`platform_certificate`](Self::platform_certificate),
/// [`platform_public_key`](Self::platform_public_key)): keep the old and
/// the new one while WeChat Pay rotates them.
///
/// The payload the key, the fingerprint and the handler see is the
/// decrypted `resource` (e.g. the transaction, with `out_trade_no`); the
/// envelope (`id`, `event_type`) is in [`RawCallback`](super::RawCallback).
#[derive(Clone)]
pub struct WeChatPay {
    api_v3_key: [u8; 32],
    keys: HashMap<String, RsaKey>,
    tolerance: Duration,
}

impl std::fmt::Debug for WeChatPay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut serials: Vec<&String> = self.keys.keys().collect();
        serials.sort();
        f.debug_struct("WeChatPay")
            .field("serials", &serials)
            .field("tolerance", &self.tolerance)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Envelope {
    resource: Resource,
}

#[derive(Deserialize)]
struct Resource {
    algorithm: String,
    ciphertext: String,
    nonce: String,
    #[serde(default)]
    associated_data: Option<String>,
}

impl WeChatPay {
    /// The merchant's APIv3 key (32 bytes, as set in the merchant
    /// platform), no platform keys yet, five minutes of tolerance (WeChat
    /// Pay's advice).
    pub fn new(api_v3_key: impl AsRef<[u8]>) -> Result<Self, ProviderKeyError> {
        let raw = api_v3_key.as_ref();
        let api_v3_key =
            <[u8; 32]>::try_from(raw).map_err(|_| ProviderKeyError::ApiV3Key(raw.len()))?;
        Ok(Self {
            api_v3_key,
            keys: HashMap::new(),
            tolerance: Duration::from_secs(300),
        })
    }

    /// Adds a platform certificate (PEM, as the certificate download API
    /// returns it once decrypted); its serial number is read from it.
    pub fn platform_certificate(mut self, pem: &str) -> Result<Self, ProviderKeyError> {
        let (serial, key) = RsaKey::from_certificate(pem)?;
        self.keys.insert(serial, key);
        Ok(self)
    }

    /// Adds a platform public key under `serial`: a "微信支付公钥" with its
    /// id (`PUB_KEY_ID_...`), or a certificate's key with its serial.
    pub fn platform_public_key(
        mut self,
        serial: impl Into<String>,
        pem: &str,
    ) -> Result<Self, ProviderKeyError> {
        let key = RsaKey::parse(pem)?;
        self.keys.insert(serial.into().to_ascii_uppercase(), key);
        Ok(self)
    }

    /// How far `Wechatpay-Timestamp` may be from now, either way.
    #[must_use]
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies a notification; returns the decrypted resource.
    pub(crate) fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: u64,
    ) -> Result<Vec<u8>, VerifyError> {
        let timestamp = header_str(headers, "wechatpay-timestamp")?;
        let nonce = header_str(headers, "wechatpay-nonce")?;
        let signature = header_str(headers, "wechatpay-signature")?;
        let serial = header_str(headers, "wechatpay-serial")?;
        let t = timestamp
            .trim()
            .parse::<u64>()
            .map_err(|_| VerifyError::Malformed("header Wechatpay-Timestamp".into()))?;
        let skew = now_secs.abs_diff(t);
        if skew > self.tolerance.as_secs() {
            return Err(VerifyError::StaleTimestamp(skew));
        }
        let key = self
            .keys
            .get(&serial.trim().to_ascii_uppercase())
            .ok_or_else(|| VerifyError::UnknownSerial(serial.to_owned()))?;
        let mut message = Vec::with_capacity(timestamp.len() + nonce.len() + body.len() + 3);
        for part in [timestamp.as_bytes(), nonce.as_bytes(), body] {
            message.extend_from_slice(part);
            message.push(b'\n');
        }
        // WeChat Pay's signature probes ("WECHATPAY/SIGNTEST/...") are not
        // base64 and fail here, as they should.
        key.verify(&message, signature)?;
        self.decrypt(body)
    }

    fn decrypt(&self, body: &[u8]) -> Result<Vec<u8>, VerifyError> {
        let envelope: Envelope = serde_json::from_slice(body)
            .map_err(|e| VerifyError::Malformed(format!("notification ({e})")))?;
        let r = envelope.resource;
        if r.algorithm != "AEAD_AES_256_GCM" {
            return Err(VerifyError::Unsupported(format!(
                "resource algorithm {:?}",
                r.algorithm
            )));
        }
        let ciphertext = STANDARD
            .decode(&r.ciphertext)
            .map_err(|_| VerifyError::Undecryptable("ciphertext is not base64".into()))?;
        if r.nonce.len() != 12 {
            return Err(VerifyError::Undecryptable(format!(
                "nonce of {} bytes, not 12",
                r.nonce.len()
            )));
        }
        let cipher = Aes256Gcm::new(&self.api_v3_key.into());
        let plain = cipher
            .decrypt(
                Nonce::from_slice(r.nonce.as_bytes()),
                Payload {
                    msg: &ciphertext,
                    aad: r.associated_data.as_deref().unwrap_or_default().as_bytes(),
                },
            )
            .map_err(|_| {
                VerifyError::Undecryptable(
                    "authentication failed (wrong APIv3 key, nonce or associated_data)".into(),
                )
            })?;
        serde_json::from_slice::<serde::de::IgnoredAny>(&plain)
            .map_err(|_| VerifyError::Undecryptable("the plaintext is not JSON".into()))?;
        Ok(plain)
    }
}
