//! TLS of the client core: the cluster CA a job handle carries, verified on both of a server's
//! protocols (tonic's HTTP/2 channel with ALPN `h2`, direct sessions with ALPN
//! `pocketflow-direct`), and the errors that name why a TLS connection failed.

use std::error::Error as StdError;
use std::fmt;
use std::io;
use std::net::TcpStream;
use std::sync::Arc;

use pocketflow_protocol::direct::DIRECT_ALPN;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::error::ClientError;

/// Largest CA bundle accepted (a cluster CA is one certificate of about a KiB).
pub const CA_PEM_MAX_BYTES: usize = 256 * 1024;

/// Prefix of every TLS failure's message, after the error kind.
pub const TLS_ERROR_PREFIX: &str = "TLS: ";

/// Trust in one cluster CA; cheap to clone.
#[derive(Clone)]
pub struct ClientTls {
    ca_pem: Arc<[u8]>,
    direct: Arc<ClientConfig>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Trust the certificates of `ca_pem` (PEM, one or more) and nothing else.
    pub fn from_ca_pem(ca_pem: &[u8]) -> Result<Self, ClientError> {
        if ca_pem.len() > CA_PEM_MAX_BYTES {
            return Err(ClientError::InvalidArgument(format!(
                "the CA bundle is {} bytes, over the {CA_PEM_MAX_BYTES}-byte bound",
                ca_pem.len()
            )));
        }
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(ca_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| ClientError::InvalidArgument(format!("the CA is not PEM: {e}")))?;
        if certs.is_empty() {
            return Err(ClientError::InvalidArgument(
                "the CA bundle holds no certificate".into(),
            ));
        }
        let mut roots = RootCertStore::empty();
        for cert in certs {
            roots.add(cert).map_err(|e| {
                ClientError::InvalidArgument(format!("the CA certificate cannot be used: {e}"))
            })?;
        }
        let provider = Arc::new(pocketflow_protocol::tls::crypto_provider());
        let mut config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ClientError::InvalidArgument(format!("TLS setup: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![DIRECT_ALPN.to_vec()];
        Ok(ClientTls {
            ca_pem: Arc::from(ca_pem),
            direct: Arc::new(config),
        })
    }

    /// The CA as PEM (for tonic's channel).
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca_pem
    }

    /// A TLS client over `tcp` to the server at `address` (`host:port`), with its handshake
    /// done (within the socket's read and write timeouts).
    pub(crate) fn handshake(
        &self,
        address: &str,
        mut tcp: TcpStream,
    ) -> Result<DirectStream, ClientError> {
        let name = server_name(address)?;
        let mut connection = ClientConnection::new(self.direct.clone(), name)
            .map_err(|e| tls_error(address, &e.to_string()))?;
        while connection.is_handshaking() {
            if let Err(e) = connection.complete_io(&mut tcp) {
                return Err(match tls_cause(&e) {
                    Some(cause) => tls_error(address, &cause),
                    None if e.kind() == io::ErrorKind::UnexpectedEof => {
                        tls_error(address, PLAINTEXT_SERVER)
                    }
                    None => ClientError::Unavailable(format!(
                        "TLS handshake with {address} failed: {e}"
                    )),
                });
            }
        }
        Ok(DirectStream::Tls(Box::new(StreamOwned::new(
            connection, tcp,
        ))))
    }
}

/// The name a server's certificate must hold: its host (an IP address or a DNS name).
pub fn server_name(address: &str) -> Result<ServerName<'static>, ClientError> {
    let host = host_of(address);
    ServerName::try_from(host.to_owned())
        .map_err(|e| ClientError::InvalidArgument(format!("bad server name {host:?}: {e}")))
}

/// The host part of `host:port` (without the brackets of an IPv6 address).
pub fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A direct session's byte stream: plain TCP, or TLS over it.
pub(crate) enum DirectStream {
    Plain(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl DirectStream {
    /// The TCP socket (timeouts, peeks).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            DirectStream::Plain(s) => s,
            DirectStream::Tls(s) => s.get_ref(),
        }
    }

    /// Whether the TLS layer holds decrypted bytes not read yet.
    pub(crate) fn has_buffered_plaintext(&mut self) -> bool {
        match self {
            DirectStream::Plain(_) => false,
            DirectStream::Tls(s) => s
                .conn
                .process_new_packets()
                .map(|state| state.plaintext_bytes_to_read() > 0)
                .unwrap_or(true),
        }
    }
}

impl io::Read for DirectStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            DirectStream::Plain(s) => s.read(buf),
            DirectStream::Tls(s) => s.read(buf),
        }
    }
}

impl io::Write for DirectStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            DirectStream::Plain(s) => s.write(buf),
            DirectStream::Tls(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            DirectStream::Plain(s) => s.write_vectored(bufs),
            DirectStream::Tls(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            DirectStream::Plain(s) => s.flush(),
            DirectStream::Tls(s) => s.flush(),
        }
    }
}

/// A TLS failure talking to `address`, as a typed error naming the cause.
pub(crate) fn tls_error(address: &str, cause: &str) -> ClientError {
    ClientError::Server {
        code: tonic::Code::PermissionDenied as i32,
        message: format!("permission_denied: {TLS_ERROR_PREFIX}{address}: {cause}"),
    }
}

/// If `error` (or what caused it) is a TLS failure, why, in words a user can act on.
pub(crate) fn tls_cause(error: &(dyn StdError + 'static)) -> Option<String> {
    let mut next: Option<&(dyn StdError + 'static)> = Some(error);
    let mut depth = 0;
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(describe(tls));
        }
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(cause) = tls_cause(inner) {
                    return Some(cause);
                }
            }
        }
        let text = format!("{e} {e:?}");
        if text.contains("handshake eof") {
            return Some(PLAINTEXT_SERVER.into());
        }
        if text.contains("inadequate security") || text.contains("INADEQUATE_SECURITY") {
            return Some(PLAINTEXT_TO_TLS.into());
        }
        depth += 1;
        if depth > 16 {
            break;
        }
        next = e.source();
    }
    None
}

/// Why a TLS client of a plaintext server fails.
pub const PLAINTEXT_SERVER: &str = "the server closed the connection during the TLS handshake: \
     it does not speak TLS on this port (a plaintext server?)";

/// Why a plaintext client of a TLS server fails.
pub const PLAINTEXT_TO_TLS: &str = "the server accepts TLS connections only and this client \
     connected without TLS; connect with the cluster CA (the job handle's tls_ca)";

fn describe(error: &rustls::Error) -> String {
    use rustls::{CertificateError, Error};
    match error {
        Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
            "the server's certificate is not signed by the trusted CA (wrong cluster CA?)".into()
        }
        Error::InvalidCertificate(CertificateError::Expired)
        | Error::InvalidCertificate(CertificateError::ExpiredContext { .. }) => {
            "the server's certificate has expired".into()
        }
        Error::InvalidCertificate(CertificateError::NotValidYet)
        | Error::InvalidCertificate(CertificateError::NotValidYetContext { .. }) => {
            "the server's certificate is not valid yet".into()
        }
        Error::InvalidCertificate(CertificateError::NotValidForName)
        | Error::InvalidCertificate(CertificateError::NotValidForNameContext { .. }) => {
            "the server's certificate does not name this address".into()
        }
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => format!(
            "the TLS handshake failed ({error}): the server does not speak TLS on this port \
             (a plaintext server?)"
        ),
        other => format!("the TLS handshake failed: {other}"),
    }
}
