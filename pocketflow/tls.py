"""TLS material of a cluster: a cluster CA made by the launcher, and one certificate per storage
server with the server's address as its subject alternative name.

Layout of a cluster's TLS directory (every file 0600, the directory 0700)::

    ca.pem, ca.key              the cluster CA (the key never leaves the cluster's own files)
    servers/<node_id>.pem/.key  a server's certificate (signed by the CA) and key

The CA certificate (``ca.pem``, public) is what clients trust: it travels in every job handle
(``JobHandle.tls_ca``). Keys are EC P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
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


def make_cluster_ca(tls_dir: Path, *, name: str | None = None) -> Path:
    """Make a CA in ``tls_dir`` (``ca.pem``, ``ca.key``) named ``name`` (default
    :func:`cluster_ca_name` with a random id); returns the ``ca.pem`` path."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    tls_dir = Path(tls_dir)
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
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
    _write_private(tls_dir / "ca.key", _key_pem(key))
    _write_private(tls_dir / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return tls_dir / "ca.pem"


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
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    tls_dir = Path(tls_dir)
    try:
        ca_key = serialization.load_pem_private_key((tls_dir / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((tls_dir / "ca.pem").read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the cluster CA in {tls_dir}: {exc}") from exc
    try:
        san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        san = x509.DNSName(host)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + SERVER_VALIDITY)
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    out = ServerCert(
        cert=tls_dir / "servers" / f"{node_id}.pem", key=tls_dir / "servers" / f"{node_id}.key"
    )
    _write_private(out.key, _key_pem(key))
    _write_private(out.cert, cert.public_bytes(serialization.Encoding.PEM))
    return out


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
