//! TLS credentials for NBD's STARTTLS: an X.509 certificate directory laid
//! out as nbdkit's `--tls-certificates` (`ca-cert.pem`, `server-cert.pem`,
//! `server-key.pem`, and for `--tls-verify-peer` an optional `ca-crl.pem`),
//! turned into a rustls acceptor. The handshake itself runs in
//! [`super::conn`] once the negotiator says [`crate::proto::handshake::Step::StartTls`].
//!
//! TLS-PSK (nbdkit's `--tls-psk`) is not here: rustls implements no external
//! pre-shared keys (rustls/rustls#174), see [`psk_unsupported`].

use crate::error::{CoronaError, Result};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use std::path::Path;
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// The CA certificate: checks client certificates under `--tls-verify-peer`.
pub const CA_CERT: &str = "ca-cert.pem";
/// The server's certificate (chain), leaf first.
pub const SERVER_CERT: &str = "server-cert.pem";
/// The server's private key (PKCS#8, PKCS#1 or SEC1 PEM).
pub const SERVER_KEY: &str = "server-key.pem";
/// Optional revocation list for client certificates.
pub const CA_CRL: &str = "ca-crl.pem";

/// Builds the acceptor from a certificate directory. With `verify_peer`,
/// clients must present a certificate signed by `ca-cert.pem` (and not
/// revoked by `ca-crl.pem` when that file exists); without it, client
/// certificates are not asked for, as with nbdkit.
pub fn acceptor(dir: &Path, verify_peer: bool) -> Result<TlsAcceptor> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let chain = certificates(&dir.join(SERVER_CERT))?;
    let key_path = dir.join(SERVER_KEY);
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| pem_error(&key_path, e))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| CoronaError::Tls(e.to_string()))?;
    let builder = if verify_peer {
        builder.with_client_cert_verifier(client_verifier(dir, provider)?)
    } else {
        builder.with_no_client_auth()
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| CoronaError::Tls(format!("{} and {} do not make a usable pair: {e}", SERVER_CERT, SERVER_KEY)))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn client_verifier(
    dir: &Path,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>> {
    let mut roots = RootCertStore::empty();
    let ca = dir.join(CA_CERT);
    for c in certificates(&ca)? {
        roots.add(c).map_err(|e| CoronaError::Tls(format!("{}: not a usable CA certificate: {e}", ca.display())))?;
    }
    let mut builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
    let crl = dir.join(CA_CRL);
    if crl.exists() {
        let crls = CertificateRevocationListDer::pem_file_iter(&crl)
            .map_err(|e| pem_error(&crl, e))?
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| pem_error(&crl, e))?;
        builder = builder.with_crls(crls);
    }
    builder.build().map_err(|e| CoronaError::Tls(format!("client certificate verification: {e}")))
}

/// Every certificate in a PEM file; none is an error.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(path, e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(CoronaError::Tls(format!("{}: no CERTIFICATE in the file", path.display())));
    }
    Ok(certs)
}

fn pem_error(path: &Path, e: rustls::pki_types::pem::Error) -> CoronaError {
    match e {
        rustls::pki_types::pem::Error::Io(io) => CoronaError::Tls(format!("cannot read {}: {io}", path.display())),
        rustls::pki_types::pem::Error::NoItemsFound => {
            CoronaError::Tls(format!("{}: no PEM item of the expected kind", path.display()))
        }
        other => CoronaError::Tls(format!("{}: {other}", path.display())),
    }
}

/// The error for `--tls-psk`: it is not served, and why.
pub fn psk_unsupported(file: &Path) -> CoronaError {
    CoronaError::Tls(format!(
        "--tls-psk {} is not implemented: CoronaFS's TLS is rustls, which has no external pre-shared \
         keys (TLS-PSK) support (rustls issue #174); use X.509 certificates with --tls-certificates DIR",
        file.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_directory_names_the_file() {
        let dir = tempfile::tempdir().expect("tmp");
        let e = acceptor(dir.path(), false).err().expect("no files").to_string();
        assert!(e.contains("server-cert.pem") && e.contains("cannot read"), "{e}");
        std::fs::write(dir.path().join(SERVER_CERT), "not pem\n").expect("write");
        let e = acceptor(dir.path(), false).err().expect("no cert").to_string();
        assert!(e.contains("server-cert.pem") && e.contains("no "), "{e}");
    }

    #[test]
    fn psk_is_refused_with_the_reason() {
        let e = psk_unsupported(Path::new("/k/keys.psk")).to_string();
        assert!(e.contains("/k/keys.psk") && e.contains("not implemented") && e.contains("rustls"), "{e}");
    }
}
