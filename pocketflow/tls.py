"""TLS material of a cluster: a cluster CA, and one certificate per storage server with the
server's address as its subject alternative name. Keys are EC P-256.

A cluster keeps its CA in memory (:class:`ClusterCA`, made by :func:`new_cluster_ca`): the
process that starts the cluster and the controller hold its key, and nothing writes it to a file.
Each storage node makes its server's key itself and sends a certificate request
(:func:`server_key_and_request`); the CA holder signs it (:meth:`ClusterCA.sign`), and the node
hands the key and certificate to its server over stdin. Only the CA certificate (public) leaves:
clients trust it (``JobHandle.tls_ca``).

For manual use and tests, :func:`make_cluster_ca` and :func:`issue_server_cert` keep a CA and
server certificates in a directory (every file 0600, the directory 0700)::

    ca.pem, ca.key              the CA
    servers/<node_id>.pem/.key  a server's certificate (signed by the CA) and key
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pocketflow.errors import ConfigError

CA_VALIDITY = datetime.timedelta(days=365)
"""How long a cluster CA is valid."""

SERVER_VALIDITY = datetime.timedelta(days=30)
"""How long a server certificate is valid (a server is issued a new one at every start)."""

CA_PEM_MAX_BYTES = 256 * 1024
"""Largest CA bundle read (the client core's bound too)."""


@dataclass(frozen=True)
class ServerCert:
    """A server's certificate and key files."""

    cert: Path
    key: Path


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte on."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cluster_ca_name(cluster_id: str | None = None) -> str:
    """The subject name of a cluster's CA: ``pocketflow cluster CA <cluster_id>`` (a random id
    without one). Each cluster's CA has a name of its own, so that a client holding another
    cluster's CA is told the server's certificate is not signed by the CA it trusts (a TLS
    library looks the issuer up by name: two CAs of one name read as a bad signature)."""
    return f"pocketflow cluster CA {cluster_id or secrets.token_hex(8)}"


@dataclass(frozen=True)
class ClusterCA:
    """A cluster CA in memory: its certificate (public) and key (PEM). It signs the
    certificate requests of the cluster's storage nodes; its key is never written to a file."""

    cert_pem: str
    key_pem: str = field(repr=False)

    def sign(self, request_pem: str, node_id: str) -> str:
        """A certificate (PEM) for the server ``node_id``, for the key and the one address
        (subject alternative name) of ``request_pem``, signed by this CA. ``ConfigError`` for a
        request that is not one (bad PEM or signature, no single address)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization

        try:
            request = x509.load_pem_x509_csr(request_pem.encode())
            names = request.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        except (ValueError, x509.ExtensionNotFound) as exc:
            raise ConfigError(f"bad certificate request of {node_id}: {exc}") from exc
        if not request.is_signature_valid or len(names.value) != 1:
            raise ConfigError(f"bad certificate request of {node_id}: one signed address needed")
        ca_key = serialization.load_pem_private_key(self.key_pem.encode(), None)
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem.encode())
        cert = _server_cert(
            request.public_key(), ca_cert.subject, node_id, names.value[0],
        ).sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def new_cluster_ca(name: str | None = None) -> ClusterCA:
    """A new CA named ``name`` (default :func:`cluster_ca_name` with a random id), in memory."""
    from cryptography.hazmat.primitives import serialization

    key, cert = _new_ca(name)
    return ClusterCA(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
        key_pem=_key_pem(key).decode("ascii"),
    )


def server_key_and_request(node_id: str, host: str) -> tuple[str, str]:
    """A new key for the server ``node_id`` listening on ``host`` (an IP address or a DNS name)
    and a certificate request for it naming ``host``; both PEM. The key stays with the caller
    (the storage node, which gives it to its server over stdin); the request goes to the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .add_extension(x509.SubjectAlternativeName([_host_name(host)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return (_key_pem(key).decode("ascii"),
            request.public_bytes(serialization.Encoding.PEM).decode("ascii"))


def _host_name(host: str) -> object:
    """``host`` as a subject alternative name: an IP address, else a DNS name."""
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _server_cert(
    public_key: object,
    issuer: object,
    node_id: str,
    san: object,
    *,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> object:
    """The builder of a server certificate (to be signed by the CA)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(issuer)  # type: ignore[arg-type]
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + SERVER_VALIDITY)
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)  # type: ignore[list-item]
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    )


def make_cluster_ca(tls_dir: Path, *, name: str | None = None) -> Path:
    """Make a CA in ``tls_dir`` (``ca.pem``, ``ca.key``) named ``name`` (default
    :func:`cluster_ca_name` with a random id); returns the ``ca.pem`` path. For manual use and
    tests: a cluster keeps its CA in memory (:func:`new_cluster_ca`)."""
    from cryptography.hazmat.primitives import serialization

    tls_dir = Path(tls_dir)
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key, cert = _new_ca(name)
    _write_private(tls_dir / "ca.key", _key_pem(key))
    _write_private(tls_dir / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return tls_dir / "ca.pem"


def _new_ca(name: str | None) -> tuple[object, object]:
    """A new CA key and self-signed certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name or cluster_ca_name())])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue_server_cert(
    tls_dir: Path,
    node_id: str,
    host: str,
    *,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> ServerCert:
    """Sign a certificate for the server ``node_id`` listening on ``host`` (an IP address or a
    DNS name, its subject alternative name) with the CA of ``tls_dir``; returns its files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    tls_dir = Path(tls_dir)
    try:
        ca_key = serialization.load_pem_private_key((tls_dir / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((tls_dir / "ca.pem").read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cluster CA in {tls_dir}: {exc}") from exc
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _server_cert(
        key.public_key(), ca_cert.subject, node_id, _host_name(host),
        not_before=not_before, not_after=not_after,
    ).sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    out = ServerCert(
        cert=tls_dir / "servers" / f"{node_id}.pem", key=tls_dir / "servers" / f"{node_id}.key"
    )
    _write_private(out.key, _key_pem(key))
    _write_private(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    return out


def write_ca_cert(tls_dir: Path, cert_pem: str) -> Path:
    """Write a CA's certificate (public) as ``tls_dir/ca.pem`` (0600, like every file of a TLS
    directory), for clients and operators; returns its path."""
    path = Path(tls_dir) / "ca.pem"
    _write_private(path, cert_pem.encode("ascii"))
    return path


def read_ca(tls_dir: Path | str | None) -> str | None:
    """The CA certificate (PEM text) of ``tls_dir``, or ``None`` without TLS."""
    if tls_dir is None:
        return None
    path = Path(tls_dir) / "ca.pem"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster CA {path}: {exc}") from exc
    if len(data) > CA_PEM_MAX_BYTES:
        raise ConfigError(f"the cluster CA {path} is over {CA_PEM_MAX_BYTES} bytes")
    return data.decode("ascii")
