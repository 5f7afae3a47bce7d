"""The secrets directory and the cluster CA, without Ray.

The secrets store is checked for what an attacker or a crash would exploit: modes (0700 dir,
0600 files from the first byte), atomic replacement (a failed write leaves the old secret and
no stray file), refusing a partial set instead of overwriting it, and secrets never in a repr.
The CA is checked against real TLS stacks: a store node's gRPC server with a certificate the
CA issued for 127.0.0.1 is reachable by a client trusting the CA and refused by one trusting
another CA; the bulk channel's contexts (kvstore.security.tls) behave the same.
"""

from __future__ import annotations

import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest

from kvstore.config import ClientConfig, SecurityConfig, ServerConfig
from kvstore.errors import ConfigError, KVStoreError
from kvstore.security import secrets_store
from kvstore.security.ca import cert_info, issue_server_cert, new_ca
from kvstore.security.secrets_store import (
    CA_KEY_FILE,
    TOKEN_FILE,
    SecretsStore,
    default_secrets_dir,
)
from kvstore.security.tls import client_ssl_context, server_ssl_context


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the secrets directory ----------------------------------------------------------------------

def test_made_once_private_and_reloaded_equal(tmp_path: Path) -> None:
    store = SecretsStore(tmp_path / "secrets")
    made, created = store.load_or_create()
    assert created
    assert mode(store.path) == 0o700
    files = sorted(p.name for p in store.path.iterdir())
    assert files == ["ca.key", "ca.pem", "cluster_token", "data_key"]
    assert all(mode(store.path / f) == 0o600 for f in files)
    again, created_again = SecretsStore(store.path).load_or_create()
    assert not created_again
    assert (again.token, again.data_key, again.ca.cert_pem.strip(), again.ca.key_pem.strip()) \
        == (made.token, made.data_key, made.ca.cert_pem.strip(), made.ca.key_pem.strip())
    assert len(bytes.fromhex(again.data_key)) == 32
    SecurityConfig(data_key=again.data_key)  # a valid security.data_key


def test_repr_names_no_secret(tmp_path: Path) -> None:
    made, _ = SecretsStore(tmp_path).load_or_create()
    text = repr(made)
    for secret in (made.token, made.data_key, made.ca.key_pem.splitlines()[1]):
        assert secret not in text
    assert "kvstore cluster CA" in text


def test_a_failed_write_keeps_the_old_secret_and_leaves_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SecretsStore(tmp_path)
    made, _ = store.load_or_create()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(secrets_store.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        store.save(secrets_store.generate())
    monkeypatch.undo()
    assert store.load().token == made.token
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.key", "ca.pem", "cluster_token", "data_key"]


def test_rotation_fields_round_trip_and_previous_is_removed_when_dropped(tmp_path: Path) -> None:
    import dataclasses

    store = SecretsStore(tmp_path)
    made, _ = store.load_or_create()
    rotated = dataclasses.replace(made, token="new-token-" + "x" * 30, previous_token=made.token)
    store.save(rotated)
    loaded = store.load()
    assert (loaded.token, loaded.previous_token) == (rotated.token, made.token)
    assert loaded.data_key == made.data_key  # the data key survives a rotation
    store.save(dataclasses.replace(loaded, previous_token=None))
    assert store.load().previous_token is None
    assert not (tmp_path / "previous_cluster_token").exists()


def test_a_partial_set_is_refused_never_overwritten(tmp_path: Path) -> None:
    store = SecretsStore(tmp_path)
    made, _ = store.load_or_create()
    (tmp_path / CA_KEY_FILE).unlink()
    with pytest.raises(ConfigError, match="lacks ca.key"):
        store.load_or_create()
    assert (tmp_path / TOKEN_FILE).read_text() == made.token
    (tmp_path / TOKEN_FILE).unlink()  # no token, but other files: still refused
    with pytest.raises(ConfigError, match="lacks"):
        store.load_or_create()


def test_a_read_only_directory_says_what_to_do(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A mounted Kubernetes secret is read-only (root would write past a mode, so the check
    is played by ``os.access``)."""
    ro = tmp_path / "mounted"
    ro.mkdir(mode=0o700)
    monkeypatch.setattr(secrets_store.os, "access", lambda path, how: False)
    with pytest.raises(ConfigError, match="read-only.*Kubernetes"):
        SecretsStore(ro).load_or_create()
    assert list(ro.iterdir()) == []


def test_a_bad_data_key_file_is_refused(tmp_path: Path) -> None:
    store = SecretsStore(tmp_path)
    store.load_or_create()
    (tmp_path / "data_key").write_text("not hex")
    with pytest.raises(ConfigError, match="data_key"):
        store.load()


def test_default_dir_is_beside_rays_token(tmp_path: Path) -> None:
    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "ray" / "auth_token")}
    assert default_secrets_dir(None, env) == tmp_path / "ray" / "kvstore"
    assert default_secrets_dir(SecurityConfig(secrets_dir=str(tmp_path / "s")), env) \
        == tmp_path / "s"
    assert default_secrets_dir(None, {}) == Path.home() / ".ray" / "kvstore"


def test_redis_password_is_made_once(tmp_path: Path) -> None:
    store = SecretsStore(tmp_path)
    store.load_or_create()
    first = store.with_redis_password().redis_password
    assert first and store.with_redis_password().redis_password == first
    assert mode(tmp_path / "redis_password") == 0o600


# -- the CA and its certificates ------------------------------------------------------------------

def test_node_certificate_names_ip_and_host_and_is_not_a_ca() -> None:
    ca = new_ca()
    cert, key = issue_server_cert(ca, ["10.1.2.3", "node-a", "10.1.2.3"])
    info = cert_info(cert)
    assert set(info.hosts) == {"10.1.2.3", "node-a"} and not info.is_ca
    assert 80 < info.days_left() <= 90
    assert cert_info(ca.cert_pem).is_ca
    assert "PRIVATE KEY" in key and "PRIVATE KEY" not in cert
    with pytest.raises(ConfigError, match="private key"):
        issue_server_cert(type(ca)(ca.cert_pem), ["10.1.2.3"])


@pytest.fixture()
def node_server(tmp_path: Path):  # noqa: ANN201 - (server, ca, token)
    from kvstore.node.block_pool import BlockPool
    from kvstore.node.store_server import StoreServer

    ca = new_ca()
    cert, key = issue_server_cert(ca, ["127.0.0.1"])
    token = "t" * 43
    pool = BlockPool(1 << 20, shm_dir=str(tmp_path), name="kvs-ca-test")
    server = StoreServer(pool, "node-ca", ServerConfig(auth_token=token, tls_cert_pem=cert,
                                                       tls_key_pem=key))
    server.start()
    yield server, ca, token
    server.stop(grace=0)
    pool.close()


def test_grpc_with_a_node_certificate_trusts_only_its_ca(node_server) -> None:
    from kvstore.client.node_client import StoreNodeClient

    server, ca, token = node_server
    grpc_address, _ = server.addresses
    good = StoreNodeClient(grpc_address, config=ClientConfig(
        auth_token=token, tls_ca_pem=ca.cert_pem, timeout_s=10, retries=0))
    try:
        assert good.health() is not None
    finally:
        good.close()
    other = StoreNodeClient(grpc_address, config=ClientConfig(
        auth_token=token, tls_ca_pem=new_ca().cert_pem, timeout_s=5, retries=0))
    try:
        with pytest.raises(KVStoreError):
            other.health()
    finally:
        other.close()
    plain = StoreNodeClient(grpc_address, config=ClientConfig(auth_token=token, timeout_s=5,
                                                              retries=0))
    try:
        with pytest.raises(KVStoreError):
            plain.health()  # a plaintext client gets no answer from a TLS port
    finally:
        plain.close()


def _tls_round_trip(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> bytes:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(tls.recv(5))
        except (OSError, ssl.SSLError) as exc:
            errors.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"hello")
            return tls.recv(5)
    finally:
        t.join(timeout=10)
        listener.close()


def test_bulk_channel_contexts_trust_only_the_cluster_ca() -> None:
    ca = new_ca()
    cert, key = issue_server_cert(ca, ["127.0.0.1"])
    server_ctx = server_ssl_context(ServerConfig(tls_cert_pem=cert, tls_key_pem=key))
    good = client_ssl_context(ClientConfig(tls_ca_pem=ca.cert_pem))
    assert server_ctx is not None and good is not None
    assert _tls_round_trip(server_ctx, good) == b"hello"
    bad = client_ssl_context(ClientConfig(tls_ca_pem=new_ca().cert_pem))
    assert bad is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_round_trip(server_ctx, bad)
    # A certificate for another address is refused too (the IP is checked, not just the CA).
    elsewhere, elsewhere_key = issue_server_cert(ca, ["10.9.9.9"])
    wrong_host = server_ssl_context(ServerConfig(tls_cert_pem=elsewhere,
                                                 tls_key_pem=elsewhere_key))
    assert wrong_host is not None
    with pytest.raises(ssl.SSLCertVerificationError):
        _tls_round_trip(wrong_host, good)
