//! TLS for the tests: a certificate authority made at run time with a server
//! certificate for `localhost` and `127.0.0.1`, and a TLS-terminating proxy
//! that puts TLS in front of a plain service (the way a TLS load balancer
//! fronts RabbitMQ, Redis or Kafka), counting the handshakes it completed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

/// A test CA and one server certificate it signed, written to a temporary
/// directory (removed on drop).
pub struct TestCa {
    dir: tempfile::TempDir,
    ca_pem: String,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    key_der: Vec<u8>,
    key_pem: String,
    client_cert_pem: String,
    client_key_pem: String,
}

impl TestCa {
    /// A new CA (`CN=onceonly test CA <name>`) and a server certificate for
    /// `localhost` and `127.0.0.1`.
    pub fn new(name: &str) -> Self {
        Self::with_names(name, &["localhost", "127.0.0.1"])
    }

    /// A new CA and a server certificate for `names` only (host names or IP
    /// addresses).
    pub fn with_names(name: &str, names: &[&str]) -> Self {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("onceonly test CA {name}"));
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");

        let key = KeyPair::generate().expect("server key");
        let mut server =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("server params");
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = server
            .signed_by(&key, &ca_cert, &ca_key)
            .expect("server certificate");

        let client_key = KeyPair::generate().expect("client key");
        let mut client = CertificateParams::new(Vec::<String>::new()).expect("client params");
        client
            .distinguished_name
            .push(DnType::CommonName, "onceonly-test-client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = client
            .signed_by(&client_key, &ca_cert, &ca_key)
            .expect("client certificate");

        let ca = Self {
            client_cert_pem: client_cert.pem(),
            client_key_pem: client_key.serialize_pem(),
            dir: tempfile::tempdir().expect("temporary directory"),
            ca_pem: ca_cert.pem(),
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            key_der: key.serialize_der(),
            key_pem: key.serialize_pem(),
        };
        std::fs::write(ca.ca_path(), &ca.ca_pem).expect("write ca.crt");
        std::fs::write(ca.dir().join("client.crt"), &ca.client_cert_pem).expect("client.crt");
        std::fs::write(ca.dir().join("client.key"), &ca.client_key_pem).expect("client.key");
        ca
    }

    /// A client certificate this CA signed (`CN=onceonly-test-client`,
    /// client auth): the certificate and its key, PEM.
    pub fn client_identity(&self) -> (&str, &str) {
        (&self.client_cert_pem, &self.client_key_pem)
    }

    /// [`client_identity`](Self::client_identity) as files: certificate, key.
    pub fn client_identity_paths(&self) -> (PathBuf, PathBuf) {
        (self.dir().join("client.crt"), self.dir().join("client.key"))
    }

    /// The CA certificate (PEM) as a file: give it to clients as
    /// `sslrootcert=`, `ssl.ca.location=` or `SSL_CERT_FILE=`.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// The CA certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The server certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The server key (PKCS#8), PEM.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A server configuration; with `client_auth`, clients must present a
    /// certificate this CA signed.
    fn server_config(&self, client_auth: bool) -> ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()));
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("TLS versions");
        let builder = if client_auth {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
                roots.add(cert.expect("CA pem")).expect("CA root");
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        builder
            .with_single_cert(vec![self.cert_der.clone()], key)
            .expect("server certificate and key")
    }
}

/// A TLS listener on 127.0.0.1 that forwards each connection, decrypted,
/// to a plain upstream. Stops on drop.
pub struct TlsProxy {
    port: u16,
    handshakes: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsProxy {
    /// Listens on a free port, with `ca`'s server certificate, in front of
    /// `upstream` (`host:port`).
    pub async fn start(ca: &TestCa, upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        Self::serve(listener, ca, upstream, false)
    }

    /// [`start`](Self::start), and clients must present a certificate `ca`
    /// signed (mutual TLS).
    pub async fn start_mutual(ca: &TestCa, upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        Self::serve(listener, ca, upstream, true)
    }

    /// Serves on `listener` (bound by the caller, for a port known in
    /// advance), asking for a client certificate if `client_auth`.
    pub fn serve(listener: TcpListener, ca: &TestCa, upstream: &str, client_auth: bool) -> Self {
        let port = listener.local_addr().expect("proxy address").port();
        let acceptor = TlsAcceptor::from(Arc::new(ca.server_config(client_auth)));
        let handshakes = Arc::new(AtomicUsize::new(0));
        let counted = handshakes.clone();
        let upstream = upstream.to_string();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let upstream = upstream.clone();
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return; // a client that refused our certificate
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut plain) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    }
                });
            }
        });
        Self {
            port,
            handshakes,
            task,
        }
    }

    /// The port clients connect to with TLS.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// TLS handshakes completed so far.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
