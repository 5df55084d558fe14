//! Connecting to the broker, the one way the consumer, the outbox's
//! publisher and the dead-letter replay all do it: the URL, plus the TLS
//! settings of an `amqps://` URL that a URL cannot carry.

use std::fmt;
use std::path::Path;

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Connection, DefaultConnectionBuilder};

/// TLS settings of `amqps://` connections beyond the system's roots: a
/// private CA and a client certificate (for brokers that require one, as
/// with RabbitMQ's `ssl_options.fail_if_no_peer_cert` or the `EXTERNAL`
/// mechanism, `?auth_mechanism=external` in the URL).
///
/// Without it an `amqps://` connection trusts the system's roots, which
/// `SSL_CERT_FILE` / `SSL_CERT_DIR` replace. Needs feature `tls`; plain
/// `amqp://` URLs ignore it.
///
/// ```
/// # fn example(ca: String, cert: Vec<u8>, key: Vec<u8>) {
/// use onceonly::amqp::AmqpTls;
/// let tls = AmqpTls::new().ca_pem(ca).client_identity_pem(cert, key);
/// # }
/// ```
#[derive(Clone, Default, PartialEq)]
pub struct AmqpTls {
    ca_pem: Option<String>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl AmqpTls {
    /// The system's roots and no client certificate (what a URL alone gives).
    pub fn new() -> Self {
        Self::default()
    }

    /// Also trusts the certificates of `pem` (one or more, PEM).
    pub fn ca_pem(mut self, pem: impl Into<String>) -> Self {
        self.ca_pem = Some(pem.into());
        self
    }

    /// Presents a client certificate: `cert_pem` (the certificate, then
    /// any intermediates) and its private key `key_pem` (PKCS#8, PKCS#1 or
    /// SEC1 PEM, unencrypted).
    pub fn client_identity_pem(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.identity = Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Reads the PEM files given: a CA file, and a client certificate with
    /// its key (both or neither).
    pub fn from_files(
        ca: Option<&Path>,
        client_cert: Option<&Path>,
        client_key: Option<&Path>,
    ) -> std::io::Result<Self> {
        let read = |path: &Path| {
            std::fs::read(path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
        };
        let mut tls = Self::new();
        if let Some(ca) = ca {
            tls = tls.ca_pem(String::from_utf8_lossy(&read(ca)?).into_owned());
        }
        match (client_cert, client_key) {
            (Some(cert), Some(key)) => {
                tls = tls.client_identity_pem(read(cert)?, read(key)?);
            }
            (None, None) => {}
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a client certificate needs its key, and a key its certificate",
                ));
            }
        }
        Ok(tls)
    }

    fn owned(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|(pem, key)| OwnedIdentity::PKCS8 {
                    pem: pem.clone(),
                    key: key.clone(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }
}

impl fmt::Debug for AmqpTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpTls")
            .field("ca", &self.ca_pem.as_ref().map(|_| "<pem>"))
            .field(
                "client_identity",
                &self.identity.as_ref().map(|_| "<certificate and key>"),
            )
            .finish()
    }
}

/// Opens a connection to `url` with `tls`, as the consumer, the outbox
/// publisher and the replay do (for operations tools that talk to the same
/// broker, e.g. `onceonly doctor`). Not bounded: wrap it in a timeout.
pub async fn connect(url: &str, tls: &AmqpTls) -> Result<Connection, lapin::Error> {
    DefaultConnectionBuilder::new()?
        .with_uri_str(url.to_owned())
        .with_tls_config(tls.owned())
        .connect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_no_key_material() {
        let tls = AmqpTls::new()
            .ca_pem("-----BEGIN CERTIFICATE-----CA")
            .client_identity_pem(b"CERT".to_vec(), b"SECRET-KEY".to_vec());
        let shown = format!("{tls:?}");
        assert!(
            !shown.contains("SECRET-KEY") && !shown.contains("CERT"),
            "{shown}"
        );
        assert!(shown.contains("<certificate and key>"), "{shown}");
    }

    #[test]
    fn a_certificate_without_its_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("client.crt");
        std::fs::write(&cert, "pem").unwrap();
        let err = AmqpTls::from_files(None, Some(&cert), None).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        let missing = AmqpTls::from_files(Some(&dir.path().join("nope.crt")), None, None)
            .unwrap_err()
            .to_string();
        assert!(missing.contains("nope.crt"), "{missing}");
        let tls = AmqpTls::from_files(Some(&cert), None, None).unwrap();
        assert_eq!(tls, AmqpTls::new().ca_pem("pem"));
    }
}
