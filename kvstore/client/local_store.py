"""An in-process store with the full block contract: the embedded store for unit tests.

It keeps encoded blocks (header + checksum) in a dict and verifies every read exactly like a
remote store, so worker tests exercise the same rejection paths without Ray or gRPC. With a
``device``, verified payloads are staged in host rows and moved in one copy, as remote reads
of a ``ClusterStore`` are (``kvstore.client.device_copy``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvstore.api import (
    MISS_NOT_FOUND,
    BlockPut,
    FetchedBlock,
    Miss,
    PrefixHit,
    TokenIds,
)
from kvstore.block import block_nbytes, decode_block, encode_block, payload_offset
from kvstore.client.device_copy import DeviceRows, StagingPool, target_device
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace


class LocalStore:
    """Blocks in this process's memory, verified on every read."""

    def __init__(self, node_id: str = "local") -> None:
        self.node_id = node_id
        self.blocks: dict[bytes, bytearray] = {}
        self.num_gets = 0
        self._lock = threading.Lock()
        self._staging = StagingPool()

    def lookup_prefix(self, namespace: Namespace, keys: Sequence[bytes]) -> PrefixHit:
        with self._lock:
            n = 0
            for key in keys:
                if key not in self.blocks:
                    break
                n += 1
        return PrefixHit(n, [[self.node_id] for _ in range(n)])

    def batch_get(
        self, namespace: Namespace, keys: Sequence[bytes], token_ids: Sequence[TokenIds], *,
        device: torch.device | str | None = None,
    ) -> list[FetchedBlock | Miss]:
        target = target_device(device)
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
            results.append(FetchedBlock(key, view if target else view.clone(), self.node_id))
        if target is not None:
            self._to_device(namespace, results, target)
        return results

    def _to_device(self, namespace: Namespace, results: list[FetchedBlock | Miss],
                   target: torch.device) -> None:
        """Replace each verified payload (a view into the stored block) with a view into one
        buffer of block rows on ``target``, laid out as ``ClusterStore``'s device reads."""
        off, nbytes = payload_offset(namespace), block_nbytes(namespace)
        rows = DeviceRows(target, len(results), nbytes, payload_offset=off)
        good = [i for i, r in enumerate(results) if isinstance(r, FetchedBlock)]
        with self._staging.rows(len(results), nbytes, pinned=rows.is_cuda) as stage:
            stage[:, :off] = 0  # a reused buffer: no earlier request's bytes travel along
            for i, r in enumerate(results):
                if isinstance(r, FetchedBlock):
                    stage[i, off:].copy_(r.payload.reshape(-1).view(torch.uint8))
            rows.copy_rows(stage, good, good, slice(None))
            rows.wait()
        rows.zero([i for i, r in enumerate(results) if isinstance(r, Miss)])
        rows.wait()
        payloads = rows.payloads(namespace)
        for i, r in enumerate(results):
            if isinstance(r, FetchedBlock):
                r.payload = payloads[i]

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
        self._staging.close()
