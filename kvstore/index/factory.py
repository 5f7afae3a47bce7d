"""Builds the index a config asks for: the only module that names the backends.

The contract (``kvstore.index.base``) knows no backend, and each backend knows only the
contract, so adding one touches this file and no other.
"""

from __future__ import annotations

from kvstore.config import IndexConfig
from kvstore.index.base import Index
from kvstore.index.memory import InMemoryIndex


def make_index(config: IndexConfig) -> Index:
    """The index ``config`` asks for; Redis is imported only when used."""
    if config.backend == "redis":
        from kvstore.index.redis import RedisIndex

        assert config.redis_url is not None  # IndexConfig.__post_init__ guarantees it
        return RedisIndex(config.redis_url, key_prefix=config.key_prefix,
                          ssl_ca_certs=config.redis_ca_file)
    return InMemoryIndex()
