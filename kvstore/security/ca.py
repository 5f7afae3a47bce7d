"""The cluster's private certificate authority and the certificates it issues (docs/security.md).

Why a private CA: a store node's gRPC and bulk channels need TLS wherever they leave loopback,
and no public CA will certify a node's private IP. ``kvstore start`` makes one CA per cluster
(kept by ``kvstore.security.secrets_store``), issues every store node (and the coordinator's
index service) a certificate naming its IP and host name as subjectAltName, and hands clients
the CA certificate only. A client that trusts this CA reaches exactly this cluster's nodes.

Keys are EC P-256: gRPC's TLS (BoringSSL), Python's ``ssl`` (OpenSSL) and Redis all accept it,
which Ed25519 certificates are not everywhere. Node certificates are short-lived
(``NODE_CERT_DAYS``): ``kvstore rotate-credentials`` issues new ones, the CA itself lasts years.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.errors import ConfigError

#: Lifetime of the CA; rotating it means handing every client a new trust root.
CA_DAYS = 3650
#: Lifetime of a node (or Redis) certificate: `kvstore rotate-credentials` renews them.
NODE_CERT_DAYS = 90
#: Clock skew tolerated between the issuing host and the verifying one.
_BACKDATE = datetime.timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA certificate and its private key, both PEM text."""

    cert_pem: str
    key_pem: str = ""

    def __repr__(self) -> str:  # never the key, in logs or tracebacks
        return f"CertificateAuthority({subject_of(self.cert_pem)!r})"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def new_ca(name: str = "kvstore cluster CA", days: int = CA_DAYS) -> CertificateAuthority:
    """A fresh self-signed CA (EC P-256) that may only sign end-entity certificates."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    return CertificateAuthority(_cert_pem(cert), _key_pem(key))


def _load_ca(ca: CertificateAuthority) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    if not ca.key_pem:
        raise ConfigError("issuing a certificate needs the CA's private key (ca.key in the "
                          "secrets directory); this copy of the CA has the certificate only")
    try:
        cert = x509.load_pem_x509_certificate(ca.cert_pem.encode())
        key = serialization.load_pem_private_key(ca.key_pem.encode(), password=None)
    except ValueError as exc:
        raise ConfigError(f"the cluster CA is not valid PEM: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ConfigError("the cluster CA key is not an EC key")
    return cert, key


def _san(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for host in hosts:
        host = host.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue_server_cert(ca: CertificateAuthority, hosts: Iterable[str], *,
                      days: int = NODE_CERT_DAYS, name: str | None = None) -> tuple[str, str]:
    """A server certificate for ``hosts`` (IPs and DNS names, all as subjectAltName) signed
    by ``ca``: returns ``(cert_pem, key_pem)``; the key is new and never leaves the caller."""
    sans = _san(hosts)
    if not sans:
        raise ConfigError("a server certificate needs at least one IP address or host name")
    ca_cert, ca_key = _load_ca(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    first = sans[0].value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                    name or str(first))]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=True, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What ``kvstore status`` and the rotation say about a certificate."""

    subject: str
    hosts: tuple[str, ...]
    not_after: datetime.datetime
    is_ca: bool

    def days_left(self) -> float:
        return (self.not_after - _now()).total_seconds() / 86400


def cert_info(cert_pem: str) -> CertInfo:
    """Subject, subjectAltNames and expiry of a PEM certificate."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError as exc:
        raise ConfigError(f"not a PEM certificate: {exc}") from None
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = tuple(str(v) for v in san.get_values_for_type(x509.IPAddress)) + tuple(
            san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        hosts = ()
    try:
        is_ca = bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        is_ca = False
    return CertInfo(cert.subject.rfc4514_string(), hosts, cert.not_valid_after_utc, is_ca)


def subject_of(cert_pem: str) -> str:
    try:
        return cert_info(cert_pem).subject
    except ConfigError:
        return "unreadable"
