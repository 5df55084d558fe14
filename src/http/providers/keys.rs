//! Reading the keys providers hand out: RSA public keys as PEM or as the
//! bare base64 Alipay shows, X.509 platform certificates (WeChat Pay), and
//! SHA256withRSA verification.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use rsa::RsaPublicKey;
use rsa::pkcs1::DecodeRsaPublicKey;
use rsa::pkcs1v15::{Signature, VerifyingKey};
use rsa::pkcs8::DecodePublicKey;
use rsa::signature::Verifier as _;
use sha2::Sha256;
use x509_cert::der::{DecodePem, Encode};

use super::VerifyError;

/// A provider's key or certificate that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderKeyError {
    /// Not an RSA public key (PEM `PUBLIC KEY` / `RSA PUBLIC KEY`, or the
    /// bare base64 of its DER).
    #[error("invalid RSA public key: {0}")]
    PublicKey(String),
    /// Not a PEM X.509 certificate with an RSA key.
    #[error("invalid certificate: {0}")]
    Certificate(String),
    /// An HMAC key that is not what the provider issues (e.g. Adyen's hex).
    #[error("invalid HMAC key: {0}")]
    HmacKey(String),
    /// WeChat Pay's APIv3 key must be 32 bytes.
    #[error("the WeChat Pay APIv3 key must be 32 bytes, got {0}")]
    ApiV3Key(usize),
}

/// An RSA public key that verifies SHA256withRSA (PKCS #1 v1.5).
#[derive(Clone, Debug)]
pub(crate) struct RsaKey(VerifyingKey<Sha256>);

impl RsaKey {
    /// From PEM (`PUBLIC KEY` or `RSA PUBLIC KEY`) or the bare base64 of an
    /// SPKI (or PKCS #1) DER key, whitespace ignored.
    pub(crate) fn parse(text: &str) -> Result<Self, ProviderKeyError> {
        let text = text.trim();
        let key = if text.starts_with("-----BEGIN RSA PUBLIC KEY") {
            RsaPublicKey::from_pkcs1_pem(text).map_err(|e| e.to_string())
        } else if text.starts_with("-----BEGIN") {
            RsaPublicKey::from_public_key_pem(text).map_err(|e| e.to_string())
        } else {
            let bare: String = text.split_whitespace().collect();
            STANDARD
                .decode(bare)
                .map_err(|e| e.to_string())
                .and_then(|der| {
                    RsaPublicKey::from_public_key_der(&der)
                        .or_else(|_| RsaPublicKey::from_pkcs1_der(&der))
                        .map_err(|e| e.to_string())
                })
        };
        key.map(|k| Self(VerifyingKey::new(k)))
            .map_err(ProviderKeyError::PublicKey)
    }

    /// The key of a PEM X.509 certificate, and its serial number as
    /// uppercase hex without leading zero bytes (as WeChat Pay writes it).
    pub(crate) fn from_certificate(pem: &str) -> Result<(String, Self), ProviderKeyError> {
        let cert = x509_cert::Certificate::from_pem(pem.trim())
            .map_err(|e| ProviderKeyError::Certificate(e.to_string()))?;
        let serial = cert.tbs_certificate.serial_number.as_bytes();
        let first = serial.iter().position(|&b| b != 0).unwrap_or(serial.len());
        let serial = hex::encode_upper(&serial[first..]);
        let der = cert
            .tbs_certificate
            .subject_public_key_info
            .to_der()
            .map_err(|e| ProviderKeyError::Certificate(e.to_string()))?;
        let key = RsaPublicKey::from_public_key_der(&der)
            .map_err(|e| ProviderKeyError::Certificate(e.to_string()))?;
        Ok((serial, Self(VerifyingKey::new(key))))
    }

    /// Verifies a base64 SHA256withRSA `signature` of `message`.
    pub(crate) fn verify(&self, message: &[u8], signature: &str) -> Result<(), VerifyError> {
        let raw = STANDARD
            .decode(signature.trim())
            .map_err(|_| VerifyError::Malformed("signature (not base64)".into()))?;
        let signature = Signature::try_from(raw.as_slice())
            .map_err(|_| VerifyError::Malformed("signature".into()))?;
        self.0
            .verify(message, &signature)
            .map_err(|_| VerifyError::BadSignature)
    }
}
