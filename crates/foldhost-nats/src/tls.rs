//! The one TLS client configuration a connection's options make ([`client_config`]), shared by
//! the client library's connection and the lean delivery connection (`lean.rs`).
//!
//! Invariants:
//! - **One trust, both paths**: the roots (the `--tls-ca` certificates instead of the system's,
//!   or the system's as the client library loads them) and the client certificate are the same
//!   for the client's connection and every lean one: neither path trusts a server the other
//!   would refuse, nor presents another identity.
//! - **No secret in an error**: a key that does not parse is reported by its kind, never its
//!   text.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use foldhost_core::bucket::TlsOptions;

/// The TLS client configuration for `tls`: its CA's certificates as the only roots, else the
/// system's (`SSL_CERT_FILE` and `SSL_CERT_DIR` honoured); its client certificate, if any.
pub(crate) fn client_config(tls: &TlsOptions) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca_pem {
        Some(pem) => {
            let certs = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("the CA certificates: {e}"))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err("the CA file holds no usable certificate".into());
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(format!(
                    "no root certificate could be loaded ({} errors)",
                    found.errors.len()
                ));
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let config = match &tls.client {
        Some(c) => {
            let chain = CertificateDer::pem_slice_iter(&c.cert_pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("the client certificate: {e}"))?;
            if chain.is_empty() {
                return Err("the client certificate file holds no certificate".into());
            }
            let key = PrivateKeyDer::from_pem_slice(c.key_pem.expose().as_bytes())
                .map_err(|_| "the client key holds no PEM private key".to_string())?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("the client certificate and key: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// Whether `tls` makes a configuration: the CA holds a certificate, the client certificate and
/// key are PEM and belong together (what a command checks before it starts anything); the error
/// says which, never quoting the key.
pub fn check_tls(tls: &TlsOptions) -> Result<(), String> {
    client_config(tls).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use foldhost_core::bucket::{ClientCertificate, Secret};

    #[test]
    fn a_ca_or_a_client_certificate_that_is_not_pem_is_refused_without_echoing_the_key() {
        let bad_ca = TlsOptions {
            ca_pem: Some(b"not a certificate".to_vec()),
            ..TlsOptions::default()
        };
        assert!(client_config(&bad_ca).is_err());
        let bad_key = TlsOptions {
            ca_pem: None,
            client: Some(ClientCertificate {
                cert_pem: b"no cert".to_vec(),
                key_pem: Secret::new("SECRET-KEY-TEXT"),
            }),
            first: false,
        };
        match client_config(&bad_key) {
            Err(e) => assert!(!e.contains("SECRET-KEY-TEXT"), "{e}"),
            Ok(_) => panic!("a certificate file without a certificate"),
        }
    }
}
