"""Builds the index a config asks for: the only module that names the backends.

The contract (``kvstore.index.base``) knows no backend, and each backend knows only the
contract, so adding one touches this file and no other.
"""

from __future__ import annotations

import os

from kvstore.config import IndexConfig
from kvstore.errors import ConfigError
from kvstore.index.base import Index
from kvstore.index.memory import InMemoryIndex


def redis_password(config: IndexConfig) -> str | None:
    """The Redis password kept out of the URL (and so out of argv): ``index.redis_password``
    (which ``KVSTORE_INDEX_REDIS_PASSWORD`` sets), else the first line of
    ``index.redis_password_file``; None: the URL's own password, if any, is used."""
    if config.redis_password:
        return config.redis_password
    if not config.redis_password_file:
        return None
    try:
        with open(os.path.expanduser(config.redis_password_file)) as f:
            password = f.readline().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read index.redis_password_file {config.redis_password_file}: "
                          f"{exc.strerror or exc}") from None
    if not password:
        raise ConfigError(f"index.redis_password_file {config.redis_password_file} is empty")
    return password


def make_index(config: IndexConfig) -> Index:
    """The index ``config`` asks for; Redis is imported only when used."""
    if config.backend == "redis":
        from kvstore.index.redis import RedisIndex

        assert config.redis_url is not None  # IndexConfig.__post_init__ guarantees it
        return RedisIndex(config.redis_url, key_prefix=config.key_prefix,
                          ssl_ca_certs=config.redis_ca_file, ssl_ca_data=config.redis_ca_pem,
                          password=redis_password(config))
    return InMemoryIndex()
