//! TLS on a storage server's listener: the certificate and key files, and the rustls
//! configuration that offers both protocols of the port (ALPN `h2` for Arrow Flight,
//! `pocketflow-direct` for the direct exchange).

use std::path::Path;
use std::sync::Arc;

use pocketflow_protocol::direct::{DIRECT_ALPN, H2_ALPN};
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Largest certificate chain or key file read (a chain of a few certificates is a few KiB).
pub const TLS_FILE_MAX_BYTES: u64 = 1024 * 1024;

/// A TLS setting that cannot be used, with a message naming the file and the cause.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(pub String);

fn read_bounded(path: &Path, what: &str) -> Result<Vec<u8>, TlsError> {
    let meta = std::fs::metadata(path)
        .map_err(|e| TlsError(format!("cannot read the {what} {}: {e}", path.display())))?;
    if meta.len() > TLS_FILE_MAX_BYTES {
        return Err(TlsError(format!(
            "the {what} {} is {} bytes, over the {TLS_FILE_MAX_BYTES}-byte bound",
            path.display(),
            meta.len()
        )));
    }
    std::fs::read(path)
        .map_err(|e| TlsError(format!("cannot read the {what} {}: {e}", path.display())))
}

/// The server configuration from a PEM certificate chain file (server certificate first) and a
/// PEM private key file; see [`server_config_from_pem`].
pub fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let cert_pem = read_bounded(cert_file, "certificate file")?;
    let key_pem = read_bounded(key_file, "key file")?;
    server_config_from_pem(
        &cert_pem,
        &key_pem,
        &cert_file.display().to_string(),
        &key_file.display().to_string(),
    )
}

/// The server configuration from a PEM certificate chain (server certificate first) and a PEM
/// private key, named `cert_name` and `key_name` in error messages. TLS 1.2 and 1.3 with
/// rustls' ring provider; no session tickets, so a client never sees bytes it did not ask for
/// on an idle connection.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_name: &str,
    key_name: &str,
) -> Result<Arc<ServerConfig>, TlsError> {
    for (pem, name) in [(cert_pem, cert_name), (key_pem, key_name)] {
        if pem.len() as u64 > TLS_FILE_MAX_BYTES {
            return Err(TlsError(format!(
                "{name} is {} bytes, over the {TLS_FILE_MAX_BYTES}-byte bound",
                pem.len()
            )));
        }
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError(format!("{cert_name}: not a PEM certificate chain: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError(format!("{cert_name}: no certificate in it")));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| TlsError(format!("{key_name}: not a PEM private key: {e}")))?;
    let provider = Arc::new(pocketflow_protocol::tls::crypto_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(format!("TLS setup: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            TlsError(format!(
                "{cert_name} and {key_name} do not make a server identity: {e}"
            ))
        })?;
    config.alpn_protocols = vec![H2_ALPN.to_vec(), DIRECT_ALPN.to_vec()];
    config.send_tls13_tickets = 0;
    Ok(Arc::new(config))
}
