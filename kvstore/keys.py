"""Namespaces and chained block keys (docs/design.md §3.1).

A key names a block of ``block_size`` tokens *and everything before it*: it chains the parent
key with the block's token ids, starting from the namespace root. Two prompts share a key only
if they share the whole prefix, in the same model, dtype, layout and tenant. sha256 is used,
never Python's ``hash()``, so keys are the same on every machine and every run.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import msgpack
import numpy as np
import torch

from kvstore.constants import DTYPE_NAMES
from kvstore.errors import ConfigError
from kvstore.security import data_keys

BlockKey = NewType("BlockKey", bytes)

SCHEMA_VERSION = 1

#: dtype names as the namespace spells them (torch's names without the ``torch.`` prefix).
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    """The namespace spelling of a torch dtype (``torch.float16`` -> ``"float16"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
    return name


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that makes KV bytes incompatible; its (keyed) hash is the root of every key
    chain."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_salt: str = ""
    schema_version: int = SCHEMA_VERSION
    #: The writer's arithmetic (device kind and capability, torch version, attention
    #: implementation; ``kvstore.workers.model.device.numerics_tag``): KV is bitwise reusable only
    #: by a worker computing exactly as its writer did. ``""``: shared across hardware on purpose
    #: (``worker.numerics: portable``), or a writer that sets no tag.
    numerics: str = ""
    # Secrets, never encoded, sent or shown (docs/security.md): at most one. ``data_key``, the
    # cluster's data secret (security.data_key), is what the cluster's own workers and nodes
    # hold; ``tenant_key`` (kvstore.security.data_keys.tenant_key of this cache_salt) is what a
    # tenant's own client holds. Either gives the same tenant key, so the same root (a keyed
    # hash nobody outside can precompute) and the same block MAC key: equal namespaces.
    data_key: bytes | None = field(default=None, repr=False, compare=False)
    tenant_key: bytes | None = field(default=None, repr=False, compare=False)
    _root: bytes = field(init=False, repr=False, compare=False)
    # The tenant key both secrets lead to: part of equality and hashing, so a keyed and an
    # unkeyed namespace (different roots, tag widths) never share a cache entry.
    _secret: bytes | None = field(init=False, repr=False, compare=True)
    _mac_key: bytes | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"namespace dtype {self.dtype!r} is not supported; use one of {sorted(DTYPES)}"
            )
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"namespace {name} must be a positive int, got {value!r}")
        if not self.model_fingerprint:
            raise ConfigError("namespace model_fingerprint must not be empty")
        if not isinstance(self.cache_salt, str):
            raise ConfigError(f"namespace cache_salt must be a str, got {self.cache_salt!r}")
        if not isinstance(self.numerics, str):
            raise ConfigError(f"namespace numerics must be a str, got {self.numerics!r}")
        if self.data_key is not None and self.tenant_key is not None:
            raise ConfigError("give a namespace its data_key or its tenant_key, not both")
        if self.data_key is not None:
            secret: bytes | None = data_keys.tenant_key(self.data_key, self.cache_salt)
        elif self.tenant_key is not None:
            secret = data_keys.check_tenant_key(self.tenant_key)
        else:
            secret = None
        if secret is None:
            root, mac = hashlib.sha256(self.encode()).digest(), None
        else:
            root, mac = data_keys.keyed_root(secret, self.encode()), data_keys.mac_key(secret)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_secret", secret)
        object.__setattr__(self, "_mac_key", mac)

    def encode(self) -> bytes:
        """The canonical encoding: msgpack of the fields in the order docs/design.md §3.1 fixes;
        a numerics tag, when there is one, is appended as a ninth element (so a namespace
        without one encodes as the eight fields alone, and its root does not depend on the
        tag field existing)."""
        fields: list[object] = [
            self.schema_version,
            self.model_fingerprint,
            self.dtype,
            self.block_size,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.cache_salt,
        ]
        if self.numerics:
            fields.append(self.numerics)
        return msgpack.packb(fields)

    @property
    def root(self) -> bytes:
        """The parent of the first block's key: sha256 of the canonical encoding, or with a
        key its HMAC under the tenant's root key (kvstore.security.data_keys)."""
        return self._root

    @property
    def keyed(self) -> bool:
        """Whether blocks carry a MAC under the tenant's key (else an xxh3 checksum)."""
        return self._secret is not None

    @property
    def mac_key(self) -> bytes | None:
        """The tenant's block MAC key, or None for an unkeyed namespace."""
        return self._mac_key

    @property
    def tag_nbytes(self) -> int:
        """Width of the header's checksum field: 16 (MAC) keyed, 8 (xxh3-64) unkeyed."""
        return data_keys.TAG_NBYTES if self._secret is not None else data_keys.CHECKSUM_NBYTES

    def public(self) -> Namespace:
        """The same fields without a key: the unkeyed namespace (public sha256 root, xxh3)."""
        return Namespace(**self.to_dict())  # type: ignore[arg-type]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, block_size, num_kv_heads, head_dim]``: K then V for each layer."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        n = 1
        for d in self.payload_shape:
            n *= d
        return n * self.torch_dtype.itemsize

    def to_dict(self) -> dict[str, object]:
        """Plain fields, for messages and configs."""
        return {
            "model_fingerprint": self.model_fingerprint,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "cache_salt": self.cache_salt,
            "schema_version": self.schema_version,
            "numerics": self.numerics,
        }

    @classmethod
    def from_dict(cls, fields: dict[str, object]) -> Namespace:
        return cls(**fields)  # type: ignore[arg-type]


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Token ids as little-endian int64: the bytes every key hashes."""
    if type(token_ids) is list:  # vLLM's prompts: packed directly, several times faster
        try:
            return struct.pack(f"<{len(token_ids)}q", *token_ids)
        except struct.error:  # not all int64s: numpy's conversion says what is wrong
            pass
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False).tobytes()


def chain_keys(parent: bytes, token_bytes: bytes, block_size: int) -> list[BlockKey]:
    """Keys of the full blocks in ``token_bytes`` (int64 LE), chained from ``parent``."""
    stride = block_size * 8
    keys: list[BlockKey] = []
    sha256 = hashlib.sha256
    view = memoryview(token_bytes)
    for start in range(0, len(token_bytes) - stride + 1, stride):
        h = sha256(parent)
        h.update(view[start : start + stride])
        parent = h.digest()
        keys.append(BlockKey(parent))
    return keys


class BlockHasher:
    """Keys of a sequence's full blocks in one namespace, from scratch or incrementally."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray | torch.Tensor,
        parent: bytes | None = None,
    ) -> list[BlockKey]:
        """Keys of every full block of ``token_ids``; a partial tail block gets no key.

        ``parent`` continues a chain: pass the last key of the blocks before ``token_ids``
        (which must then start on a block boundary). ``None`` starts from the namespace root.
        """
        return chain_keys(
            self.namespace.root if parent is None else parent,
            tokens_to_bytes(token_ids),
            self.block_size,
        )

    def sequence(self) -> SequenceHasher:
        """An incremental hasher for a growing sequence (decode appends tokens one by one)."""
        return SequenceHasher(self.namespace)


class SequenceHasher:
    """Keys of a growing sequence: each full block is hashed once, when it fills."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.keys: list[BlockKey] = []
        self._pending: list[int] = []

    @property
    def parent(self) -> bytes:
        return self.keys[-1] if self.keys else self.namespace.root

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.namespace.block_size + len(self._pending)

    def extend(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[BlockKey]:
        """Append tokens; returns the keys of the blocks they completed (possibly none)."""
        bs = self.namespace.block_size
        pending = self._pending + [int(t) for t in np.asarray(token_ids).reshape(-1)]
        num_full = len(pending) // bs * bs
        new = chain_keys(self.parent, tokens_to_bytes(pending[:num_full]), bs)
        self.keys.extend(new)
        self._pending = pending[num_full:]
        return new
