"""Where a cluster's secrets live between runs: one directory, one file per secret.

``kvstore start`` on a cluster loads them from here or makes them (``load_or_create``); ``kvstore
rotate-credentials`` and ``kvstore credentials ...`` read and update them. The directory is, in
order: ``security.secrets_dir`` (or ``KVSTORE_SECURITY_SECRETS_DIR``), else ``kvstore/`` beside
Ray's own token (the directory of ``RAY_AUTH_TOKEN_PATH``, default ``~/.ray``): whoever may read
Ray's token may run code on the cluster anyway, so this adds no new reader. A Kubernetes
Secret mounted as a directory has the same layout (one key per file) and is used read-only.

Files (PEM or text, no trailing newline needed)::

    cluster_token            the cluster token (server.auth_token): admin, signs credentials
    previous_cluster_token   the token before the last rotation, until `--finish` drops it
    data_key                 security.data_key (hex): keyed roots and block MACs; never rotated
    ca.pem, ca.key           the private CA that issues node certificates
    redis_password           the Redis index's password (`kvstore credentials redis-conf`)

Every file is written 0600 in a 0700 directory, atomically (a private temporary file, fsync,
rename), so a reader sees the old secret or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from kvstore.config import SecurityConfig
from kvstore.errors import ConfigError
from kvstore.security.ca import CertificateAuthority, new_ca
from kvstore.security.grants import new_cluster_token

log = logging.getLogger(__name__)

TOKEN_FILE = "cluster_token"
PREVIOUS_TOKEN_FILE = "previous_cluster_token"
DATA_KEY_FILE = "data_key"
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
REDIS_PASSWORD_FILE = "redis_password"
#: The files a complete set needs; the others are optional.
REQUIRED = (TOKEN_FILE, DATA_KEY_FILE, CA_CERT_FILE, CA_KEY_FILE)


@dataclass(frozen=True, slots=True)
class ClusterSecrets:
    """The cluster's secrets (never printed: ``repr`` names none of them)."""

    token: str
    data_key: str  # hex, as security.data_key takes it
    ca: CertificateAuthority
    previous_token: str | None = None
    redis_password: str | None = None

    def __repr__(self) -> str:
        return (f"ClusterSecrets(token=***, data_key=***, ca={self.ca!r}, previous_token="
                f"{'***' if self.previous_token else None}, redis_password="
                f"{'***' if self.redis_password else None})")


def new_data_key() -> str:
    """A fresh data secret: 256 random bits, hex."""
    return secrets.token_hex(32)


def new_redis_password() -> str:
    return secrets.token_urlsafe(32)


def generate() -> ClusterSecrets:
    """A complete new set: token, data key, CA (no Redis password until one is asked for)."""
    return ClusterSecrets(new_cluster_token(), new_data_key(), new_ca())


def default_secrets_dir(config: SecurityConfig | None = None,
                        env: Mapping[str, str] | None = None) -> Path:
    """``security.secrets_dir``, else ``kvstore/`` beside Ray's token (``~/.ray/kvstore``)."""
    env = os.environ if env is None else env
    if config is not None and config.secrets_dir:
        return Path(config.secrets_dir).expanduser()
    ray_token = env.get("RAY_AUTH_TOKEN_PATH")
    base = Path(ray_token).expanduser().parent if ray_token else Path.home() / ".ray"
    return base / "kvstore"


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, 0600 from the first byte."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


class SecretsStore:
    """One secrets directory: ``load``, ``save``, ``load_or_create``."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory).expanduser()

    @classmethod
    def for_config(cls, config: SecurityConfig | None = None,
                   env: Mapping[str, str] | None = None) -> SecretsStore:
        return cls(default_secrets_dir(config, env))

    def exists(self) -> bool:
        """Whether a (possibly incomplete) set is there: the token file decides."""
        return (self.path / TOKEN_FILE).is_file()

    def _read(self, name: str, *, required: bool) -> str | None:
        path = self.path / name
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            if required:
                raise ConfigError(
                    f"the secrets directory {self.path} lacks {name}: restore it, or move the "
                    "directory away and let `kvstore start` make a new set (blocks written "
                    "under the old data_key are then unreadable)") from None
            return None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
        self._check_mode(path)
        if required and not text:
            raise ConfigError(f"{path} is empty")
        return text or None

    def _check_mode(self, path: Path) -> None:
        try:
            mode = path.stat().st_mode  # follows a Kubernetes secret's symlinks
        except OSError:
            return
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("kvstore secret %s is readable or writable by others (mode %o): "
                        "chmod 600 it (a Kubernetes secret: defaultMode: 0400)", path,
                        stat.S_IMODE(mode))

    def load(self) -> ClusterSecrets:
        """The stored set; ConfigError naming the missing or unreadable file."""
        token = self._read(TOKEN_FILE, required=True)
        data_key = self._read(DATA_KEY_FILE, required=True)
        cert = self._read(CA_CERT_FILE, required=True)
        key = self._read(CA_KEY_FILE, required=True)
        assert token and data_key and cert and key  # required=True guarantees them
        SecurityConfig(data_key=data_key)  # the same check as the setting: hex, >= 16 bytes
        return ClusterSecrets(token, data_key, CertificateAuthority(cert + "\n", key + "\n"),
                              self._read(PREVIOUS_TOKEN_FILE, required=False),
                              self._read(REDIS_PASSWORD_FILE, required=False))

    def save(self, secrets_: ClusterSecrets) -> None:
        """Write every secret of the set (each file atomically); a stale previous token or
        Redis password file is removed when the set has none."""
        self._prepare_dir()
        # The previous token first: a node reloading half-way still accepts both.
        optional = {PREVIOUS_TOKEN_FILE: secrets_.previous_token,
                    REDIS_PASSWORD_FILE: secrets_.redis_password}
        for name, value in optional.items():
            if value:
                write_private(self.path / name, value)
        for name, value in ((DATA_KEY_FILE, secrets_.data_key),
                            (CA_CERT_FILE, secrets_.ca.cert_pem),
                            (CA_KEY_FILE, secrets_.ca.key_pem), (TOKEN_FILE, secrets_.token)):
            write_private(self.path / name, value)
        for name, value in optional.items():
            if not value:
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()

    def _prepare_dir(self) -> None:
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path, 0o700)
        except OSError as exc:
            raise ConfigError(
                f"cannot write the secrets directory {self.path} ({exc.strerror or exc}); a "
                "mounted Kubernetes secret is read-only: update the Secret instead (see "
                "docs/security.md, Rotation), or set security.secrets_dir") from None
        if not os.access(self.path, os.W_OK):
            raise ConfigError(f"the secrets directory {self.path} is read-only (a mounted "
                              "Kubernetes secret?): update the Secret instead (docs/security.md)")

    def load_or_create(self) -> tuple[ClusterSecrets, bool]:
        """The stored set, or a new one written here; ``(secrets, created)``."""
        if self.exists():
            return self.load(), False
        if any((self.path / name).exists() for name in REQUIRED):
            self.load()  # partial: raises naming the missing file, never overwrites the rest
        made = generate()
        self.save(made)
        log.info("kvstore made new cluster secrets in %s", self.path)
        return made, True

    def with_redis_password(self) -> ClusterSecrets:
        """The stored set with a Redis password, made (and saved) if there is none."""
        current = self.load()
        if current.redis_password:
            return current
        updated = replace(current, redis_password=new_redis_password())
        self._prepare_dir()
        write_private(self.path / REDIS_PASSWORD_FILE, str(updated.redis_password))
        return updated
