"""``kvstore credentials ...``, the Redis password off argv, and the security line of status.

In-process (``kvstore.cli.main.main``) against a secrets directory of the test's own. References:
the secrets files (a credential must verify under the stored token with the grants asked for,
and under no other), H3's ``tenant_key`` for the tenant key, a real redis-server started with
the include ``redis-conf`` wrote.
"""

from __future__ import annotations

import io
import json
import stat
import subprocess
from pathlib import Path

import pytest

from kvstore.cli.credentials import parse_ttl
from kvstore.cli.main import main, warn_argv_password
from kvstore.cli.status import security_line
from kvstore.config_loader import load_config
from kvstore.errors import ConfigError, IndexAuthError, Unauthenticated
from kvstore.security.data_keys import tenant_key
from kvstore.security.grants import Authenticator
from kvstore.security.secrets_store import SecretsStore


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def secrets_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    d = tmp_path / "secrets"
    code, out, err = run(capsys, "credentials", "init", "--secrets-dir", str(d))
    assert code == 0, err
    stored = SecretsStore(d).load()
    assert "made cluster secrets" in out
    assert stored.token not in out + err and stored.data_key not in out + err
    return d


def test_init_twice_keeps_the_secrets(secrets_dir: Path, capsys) -> None:  # noqa: ANN001
    before = SecretsStore(secrets_dir).load().token
    code, out, _ = run(capsys, "credentials", "init", "--secrets-dir", str(secrets_dir))
    assert code == 0 and "found cluster secrets" in out
    assert SecretsStore(secrets_dir).load().token == before


def test_issue_prints_a_credential_that_verifies_with_exactly_its_grants(
        secrets_dir: Path, capsys) -> None:  # noqa: ANN001
    code, out, err = run(capsys, "credentials", "issue", "--secrets-dir", str(secrets_dir),
                         "--subject", "team-a", "--write", "tenant-a", "--read", "shared",
                         "--ttl", "12h")
    assert code == 0 and err == ""
    cred = out.strip()
    assert cred.startswith("kvs1.") and "\n" not in cred
    grant = Authenticator([SecretsStore(secrets_dir).load().token]).authenticate(cred)
    assert grant.subject == "team-a" and not grant.admin
    assert grant.may_write("tenant-a") and grant.may_read("shared")
    assert not grant.may_write("shared") and not grant.may_read("tenant-b")
    assert grant.expires_at is not None
    with pytest.raises(Unauthenticated):  # another cluster's token does not accept it
        Authenticator(["x" * 43]).authenticate(cred)


def test_issue_with_tenant_key_matches_the_data_key_derivation(
        secrets_dir: Path, capsys) -> None:  # noqa: ANN001
    code, out, _ = run(capsys, "credentials", "issue", "--secrets-dir", str(secrets_dir),
                       "--subject", "team-a", "--write", "tenant-a", "--tenant-key")
    assert code == 0
    got = json.loads(out)
    data_key = bytes.fromhex(SecretsStore(secrets_dir).load().data_key)
    assert got["tenant_keys"] == {"tenant-a": tenant_key(data_key, "tenant-a").hex()}
    assert got["credential"].startswith("kvs1.")


def test_issue_refuses_nothing_granted_and_a_bad_ttl(secrets_dir: Path, capsys) -> None:  # noqa: ANN001
    code, _, err = run(capsys, "credentials", "issue", "--secrets-dir", str(secrets_dir),
                       "--subject", "nobody")
    assert code == 2 and "must grant something" in err
    code, _, err = run(capsys, "credentials", "issue", "--secrets-dir", str(secrets_dir),
                       "--subject", "a", "--read", "t", "--ttl", "soon")
    assert code == 2 and "--ttl" in err


def test_show_reads_stdin_and_checks_the_signature(
        secrets_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:  # noqa: ANN001
    _, cred, _ = run(capsys, "credentials", "issue", "--secrets-dir", str(secrets_dir),
                     "--subject", "reader", "--read", "tenant-a", "--ttl", "never")
    monkeypatch.setattr("sys.stdin", io.StringIO(cred))
    code, out, _ = run(capsys, "credentials", "show", "-", "--json",
                       "--secrets-dir", str(secrets_dir))
    assert code == 0
    assert json.loads(out) == {"subject": "reader", "read": ["tenant-a"], "write": [],
                               "admin": False, "expires": "never", "valid_here": True}
    other = tmp_path / "other"
    SecretsStore(other).load_or_create()
    code, out, _ = run(capsys, "credentials", "show", cred.strip(), "--secrets-dir", str(other))
    assert code == 0 and "valid:   NO" in out


def test_ttl_parsing() -> None:
    assert parse_ttl("30d") == 30 * 86400 and parse_ttl("90m") == 5400
    assert parse_ttl("never") is None
    with pytest.raises(ConfigError):
        parse_ttl("-1d")


def test_a_password_in_the_redis_url_is_warned_about(capsys) -> None:  # noqa: ANN001
    warn_argv_password("redis://:hunter2@10.0.0.1:6379/0")
    err = capsys.readouterr().err
    assert "visible to every local user" in err and "--redis-password-file" in err
    warn_argv_password("redis://10.0.0.1:6379/0")
    assert capsys.readouterr().err == ""


@pytest.mark.redis
def test_redis_conf_password_reaches_kvstore_by_file_not_argv(
        secrets_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """redis-server runs the include `redis-conf` wrote; kvstore reads the password from the
    file (index.redis_password_file) and from KVSTORE_INDEX_REDIS_PASSWORD; without it, or
    with a wrong one, the index refuses with the error that says so."""
    import shutil

    from kvstore.index.factory import make_index
    from tests.support.redis_server import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    conf = tmp_path / "redis.conf"
    code, out, _ = run(capsys, "credentials", "redis-conf", "--secrets-dir", str(secrets_dir),
                       "--out", str(conf))
    assert code == 0 and stat.S_IMODE(conf.stat().st_mode) == 0o600
    password = SecretsStore(secrets_dir).load().redis_password
    assert password and password not in out
    port = free_port()
    proc = subprocess.Popen(["redis-server", str(conf), "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        pw_file = secrets_dir / "redis_password"
        by_file = load_config(env={}, overrides={"index": {
            "backend": "redis", "redis_url": url, "redis_password_file": str(pw_file)}})
        import time

        deadline = time.monotonic() + 10
        while True:
            try:
                index = make_index(by_file.index)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        index.close()
        by_env = load_config(env={"KVSTORE_INDEX_BACKEND": "redis",
                                   "KVSTORE_INDEX_REDIS_URL": url,
                                   "KVSTORE_INDEX_REDIS_PASSWORD": password})
        make_index(by_env.index).close()
        for wrong in ({}, {"redis_password": "not-the-password"}):
            cfg = load_config(env={}, overrides={"index": {"backend": "redis",
                                                           "redis_url": url, **wrong}})
            with pytest.raises(IndexAuthError):
                make_index(cfg.index)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_status_security_line() -> None:
    secure = {"auth": True, "tls": True, "tenant_enforcement": True, "keyed_namespaces": True,
              "insecure": False, "rotation_in_progress": True, "cert_days_left": 42.0}
    line = security_line(secure)
    assert line.startswith("security: auth on, TLS on, tenant checks on, keyed namespaces on")
    assert "rotation in progress" in line and "42 days" in line
    insecure = security_line({"auth": False, "tls": False, "insecure": True})
    assert "WARNING: INSECURE" in insecure and "auth off, TLS off" in insecure
    assert "loopback" in security_line({"auth": False, "tls": False})


@pytest.mark.redis
def test_redis_tls_with_a_certificate_from_the_cluster_ca(
        secrets_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """`redis-conf --tls-host` turns TLS on with a certificate from the cluster CA; a rediss://
    index trusts the cluster CA from the secrets directory with nothing else named, and a
    client that trusts only the system CAs is refused."""
    import shutil
    import time

    from kvstore.cluster.credentials import with_redis_password
    from kvstore.errors import IndexBackendError
    from kvstore.index.factory import make_index
    from tests.support.redis_server import free_port

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    conf = tmp_path / "redis.conf"
    port = free_port()
    code, _, err = run(capsys, "credentials", "redis-conf", "--secrets-dir", str(secrets_dir),
                       "--out", str(conf), "--tls-host", "127.0.0.1", "--port", str(port))
    assert code == 0, err
    proc = subprocess.Popen(["redis-server", str(conf), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        overrides = {"index": {"backend": "redis", "redis_url": f"rediss://127.0.0.1:{port}/0",
                               "redis_password_file": str(secrets_dir / "redis_password")},
                     "security": {"secrets_dir": str(secrets_dir)}}
        config = with_redis_password(load_config(env={}, overrides=overrides))
        assert config.index.redis_ca_pem and not config.index.redis_password_file
        deadline = time.monotonic() + 10
        while True:
            try:
                make_index(config.index).close()
                break
            except IndexBackendError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        untrusted = load_config(env={}, overrides={**overrides, "security": {
            "secrets_dir": str(tmp_path / "none")}})
        with pytest.raises(IndexBackendError):
            make_index(with_redis_password(untrusted).index)
    finally:
        proc.kill()
        proc.wait(timeout=10)
