"""TLS material from either files or PEM text, for gRPC and for the bulk channel alike.

``kvstore start`` hands each store node its certificate as PEM text (issued by the cluster's
private CA for that node's address) and every client the CA as PEM text, so nothing has to be
copied onto hosts by hand; operators who bring their own files set the ``*_file`` settings.
Python's ``ssl`` loads a certificate chain only from a file, so PEM text is written to a
private (0600) temporary file for the load and removed at once.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator

from kvstore.config import ClientConfig, ServerConfig


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_cert_and_key(config: ServerConfig) -> tuple[bytes, bytes] | None:
    """The server's (certificate chain, private key) as PEM bytes, or None: TLS off."""
    if config.tls_cert_file and config.tls_key_file:
        return _read(config.tls_cert_file), _read(config.tls_key_file)
    if config.tls_cert_pem and config.tls_key_pem:
        return config.tls_cert_pem.encode(), config.tls_key_pem.encode()
    return None


def client_ca(config: ClientConfig) -> bytes | None:
    """The CA bundle a client verifies servers with, as PEM bytes, or None: plaintext."""
    if config.tls_ca_file:
        return _read(config.tls_ca_file)
    if config.tls_ca_pem:
        return config.tls_ca_pem.encode()
    return None


@contextlib.contextmanager
def _private_files(*blobs: bytes) -> Iterator[list[str]]:
    with tempfile.TemporaryDirectory(prefix="kvstore-tls-") as tmp:
        os.chmod(tmp, 0o700)
        paths = []
        for i, blob in enumerate(blobs):
            path = os.path.join(tmp, f"{i}.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            paths.append(path)
        yield paths


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The bulk channel's server context (TLS 1.2+), or None when TLS is off."""
    pair = server_cert_and_key(config)
    if pair is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with _private_files(*pair) as (cert, key):
        ctx.load_cert_chain(cert, key)
    return ctx


def client_ssl_context(config: ClientConfig) -> ssl.SSLContext | None:
    """The bulk channel's client context verifying the server against the CA, or None."""
    ca = client_ca(config)
    if ca is None:
        return None
    ctx = ssl.create_default_context(cadata=ca.decode())
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
