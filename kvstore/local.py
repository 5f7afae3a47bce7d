"""An in-process store with the full block contract: the embedded store for unit tests.

It keeps encoded blocks (header + checksum) in a dict and verifies every read exactly like a
remote store, so worker tests exercise the same rejection paths without Ray or gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.api import (
    MISS_NOT_FOUND,
    BlockPut,
    FetchedBlock,
    Miss,
    PrefixHit,
    TokenIds,
)
from kvstore.block import decode_block, encode_block
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace


class LocalStore:
    """Blocks in this process's memory, verified on every read."""

    def __init__(self, node_id: str = "local") -> None:
        self.node_id = node_id
        self.blocks: dict[bytes, bytearray] = {}
        self.num_gets = 0
        self._lock = threading.Lock()

    def lookup_prefix(self, namespace: Namespace, keys: Sequence[bytes]) -> PrefixHit:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self.blocks:
                    break
                n += 1
        return PrefixHit(n, [[self.node_id] for _ in range(n)])

    def batch_get(
        self, namespace: Namespace, keys: Sequence[bytes], token_ids: Sequence[TokenIds]
    ) -> list[FetchedBlock | Miss]:
        results: list[FetchedBlock | Miss] = []
        for key, tokens in zip(keys, token_ids, strict=True):
            with self._lock:
                raw = self.blocks.get(key)
                self.num_gets += 1
            if raw is None:
                results.append(Miss(key, MISS_NOT_FOUND))
                continue
            try:
                view = decode_block(raw, namespace, key, tokens)
            except (BlockCorrupted, BlockMismatch) as exc:
                results.append(Miss.rejected(key, exc))
                continue
            results.append(FetchedBlock(key, view.clone(), self.node_id))
        return results

    def batch_put(self, namespace: Namespace, blocks: Sequence[BlockPut]) -> None:
        encoded = [
            (b.key, encode_block(namespace, b.key, b.parent_key, b.token_ids, b.payload))
            for b in blocks
        ]
        with self._lock:
            for key, raw in encoded:
                self.blocks.setdefault(key, raw)  # immutable once published

    def corrupt(self, key: bytes, offset: int = -1) -> None:
        """Flip one payload byte (tests use this to check that readers reject it)."""
        with self._lock:
            self.blocks[key][offset] ^= 0xFF

    def close(self) -> None:
        self.blocks.clear()
