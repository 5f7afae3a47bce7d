"""Each tenant's namespace and block hasher for one engine (docs/design.md §3.1).

A request's ``cache_salt`` selects its tenant's namespace of the engine's model. With the
cluster's data key every tenant's namespace is keyed; with one tenant's own key (a tenant's
client) only that tenant's namespaces can be built, and a request for another is refused
rather than answered from a public, plantable namespace.
"""

from __future__ import annotations

import threading

from kvstore.errors import PermissionDenied
from kvstore.keys import BlockHasher
from kvstore.security.data_keys import tenant_of
from kvstore.workers.model.causal_lm import CausalLM

#: Hashers remembered per engine: a bound on memory, not on tenants.
MAX_TENANTS = 4096


class TenantHashers:
    """The hasher of every tenant an engine serves, built once per salt."""

    def __init__(self, model: CausalLM, block_size: int, default_salt: str, suffix: str, *,
                 data_key: bytes | None = None, tenant_key: bytes | None = None) -> None:
        """``suffix`` is appended to every salt (the engine keeps approximate-reuse KV apart
        with one); ``data_key`` / ``tenant_key``: see
        ``kvstore.workers.engine.prefill_decode.Engine``."""
        self.model, self.block_size = model, block_size
        self.default_salt, self.suffix = default_salt, suffix
        self.data_key, self.tenant_key = data_key, tenant_key
        self.default = self._build(default_salt)
        self._hashers: dict[str, BlockHasher] = {default_salt: self.default}
        self._lock = threading.Lock()

    def _build(self, salt: str) -> BlockHasher:
        return BlockHasher(self.model.namespace(self.block_size, salt + self.suffix,
                                                data_key=self.data_key,
                                                tenant_key=self.tenant_key))

    def get(self, cache_salt: str | None) -> BlockHasher:
        """The hasher of ``cache_salt`` (None: the default salt)."""
        salt = self.default_salt if cache_salt is None else cache_salt
        if self.tenant_key is not None and tenant_of(salt) != tenant_of(self.default_salt):
            raise PermissionDenied(
                f"this worker holds the key of tenant {tenant_of(self.default_salt)!r} only; "
                "a request for another tenant's cache_salt needs that tenant's worker")
        with self._lock:
            hasher = self._hashers.get(salt)
            if hasher is None:
                if len(self._hashers) >= MAX_TENANTS:
                    self._hashers.clear()
                    self._hashers[self.default_salt] = self.default
                hasher = self._hashers[salt] = self._build(salt)
            return hasher
