"""The private redis-server launcher: starts, answers, restarts on its port, stops by PID."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

import pytest
import redis

import tests.support.redis_server as launcher
from kvstore.errors import NodeUnavailable
from tests.conftest import require_redis_server
from tests.support.redis_server import make_tls_files, start_redis_server


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.redis
def test_start_restart_stop() -> None:
    require_redis_server()
    server = start_redis_server()
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = server.client()
        assert client.ping()
        assert client.config_get("save")["save"] == ""  # keeps nothing on disk
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.set("k", "v")
        old_pid = server.pid
        server.restart()
        assert server.pid != old_pid and not pid_alive(old_pid)
        assert client.get("k") is None  # same URL, fresh (empty) server
    finally:
        pid, workdir = server.pid, server.workdir
        server.stop()
    assert not pid_alive(pid)
    assert not Path(workdir).exists()
    server.stop()  # stopping twice is harmless


@pytest.mark.redis
def test_busy_port_is_a_clear_error() -> None:
    require_redis_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(NodeUnavailable, match=f"port {port}"):
            start_redis_server(port=port)


@pytest.mark.redis
def test_password_and_tls(tmp_path: Path) -> None:
    require_redis_server()
    server = start_redis_server(password="pw-1", tls_dir=tmp_path)
    try:
        assert server.url == f"rediss://:pw-1@127.0.0.1:{server.port}/0"
        assert server.client().ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, ssl=True, ssl_ca_certs=server.ca_file, retry=None).ping()
        # The certificate verifies against the CA for 127.0.0.1 with hostname checking on.
        ctx = ssl.create_default_context(cafile=server.ca_file)
        with socket.create_connection(("127.0.0.1", server.port)) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.version() is not None
    finally:
        server.stop()


def test_tls_files_form_a_chain(tmp_path: Path) -> None:
    from cryptography import x509

    files = make_tls_files(tmp_path)
    ca = x509.load_pem_x509_certificate(Path(files.ca_file).read_bytes())
    cert = x509.load_pem_x509_certificate(Path(files.cert_file).read_bytes())
    cert.verify_directly_issued_by(ca)
    assert oct(os.stat(files.key_file).st_mode & 0o777) == "0o600"


def test_missing_redis_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher.shutil, "which", lambda name: None)
    with pytest.raises(NodeUnavailable, match="redis-server is not on PATH"):
        start_redis_server()


def test_fixture_skips_or_fails_without_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("KVSTORE_REQUIRE_REDIS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_redis_server()
    monkeypatch.setenv("KVSTORE_REQUIRE_REDIS", "1")
    with pytest.raises(pytest.fail.Exception, match="KVSTORE_REQUIRE_REDIS=1"):
        require_redis_server()
