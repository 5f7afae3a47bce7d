"""Leased blocks used in place in this host's arena, their tags checked after the use.

A same-node read copies each block out of the node's arena into memory of its own and checks
the copy, before anything uses it. A load whose destination is another copy anyway (vLLM's
paged KV on a CPU) can skip the first one: it reads the payloads straight from the arena, under
the lease that keeps the node from reusing their memory, layer by layer while the forward that
needs them runs, and checks each block's tag over the same leased bytes once they are written.
A block whose tag fails is reported by ``verify`` in time for the caller to discard what it
computed from it (vLLM: a load error, recomputed, before any token of that step is sampled
into an output); a block whose header names another key or namespace is never used at all.
Before the use only those few header bytes are read: the node checked every header in full at
Put, the parent and tokens chaining to the key the reader made from its own tokens, and a
header that is not canonical gets the full check here too. A device read checks leased bytes
the same way, its headers in full (``device_reads``).

The lease stays held until ``close``, the tags being checked while it still pins the bytes.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.block import block_nbytes, payload_offset, tag_hasher
from kvstore.block_batch import named_tags, naming_columns
from kvstore.client.device_reads import check_headers
from kvstore.client.leased_reads import HeldLease
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockLocation


@dataclass
class ArenaBlocks:
    """The leading blocks of a handed-over lease whose headers match, viewed in the arena.

    ``segments``: ``(first block, payloads)`` per run of blocks adjacent in the arena, each
    ``payloads`` a read-only ``[k, *payload_shape]`` view (one strided view for the run, so a
    layer of it is written by one copy); together they cover blocks ``[0, len(self))``."""

    namespace: Namespace
    keys: list[bytes]
    locations: list[BlockLocation]
    checksums: list[bytes]
    segments: list[tuple[int, torch.Tensor]]
    _reader: Any
    _client: Any
    _lease: HeldLease
    _closed: bool = field(default=False)

    def __len__(self) -> int:
        return len(self.keys)

    def verify(self) -> int:
        """How many leading blocks carry the right tag over their leased bytes (constant time
        for a MAC); 0 when the lease may have ended before the check was done."""
        start = payload_offset(self.namespace)
        good = 0
        for key, loc, tag in zip(self.keys, self.locations, self.checksums, strict=True):
            hasher = tag_hasher(self.namespace, key)
            hasher.update(self._reader.view(loc.offset + start, self.namespace.payload_nbytes))
            if not hmac.compare_digest(hasher.digest(), tag):
                break
            good += 1
        if time.monotonic() - self._lease.granted_at >= self._lease.ttl_s:
            return 0  # the node may have reused the memory while it was read
        return good

    def close(self) -> None:
        """End the lease (without waiting); the views must not be read after this."""
        if not self._closed:
            self._closed = True
            self.segments = []
            self._client.release_nowait(self._lease.info.lease_id)


def arena_blocks(client: Any, namespace: Namespace, keys: Sequence[bytes],
                 token_ids: Sequence[Any], held: HeldLease) -> ArenaBlocks | None:
    """The leading run of ``keys`` that ``held`` (a lease on ``client``'s node, this host's)
    pins in the arena, each header naming ``namespace`` and its key (a header that is not
    canonical checked in full, against ``token_ids`` too: ``_named_tags``); None
    where it cannot be read in place (the lease not fresh, or no block of it in the arena: the
    caller reads the usual way, under the same lease). The lease is the caller's to ``close``
    from then on when this returns blocks, else still the caller's to use."""
    if not held.fresh() or not getattr(client, "same_node", False):
        return None
    where = {loc.key: loc for loc in held.info.locations if not loc.path}
    reader = client._reader()
    keys = [bytes(k) for k in keys]
    locs = [where.get(k) for k in keys]
    if None in locs:
        locs = locs[:locs.index(None)]
    try:
        checksums = _named_tags(reader, namespace, keys[:len(locs)], locs)  # type: ignore
        if checksums is None:  # not all canonical and named right: every header in full
            verdicts, digests = check_headers(reader, locs, keys[:len(locs)], token_ids,
                                              namespace)
            good = next((i for i, v in enumerate(verdicts) if not isinstance(v, int)),
                        len(verdicts))
            checksums = [digests[i] for i in range(good)]
    except ValueError:  # a location outside the arena: read the usual way, which says so
        return None
    usable = [loc for loc in locs[:len(checksums)] if loc is not None]
    if not usable:
        return None
    try:
        segments = _segments(reader, namespace, usable)
    except (ValueError, RuntimeError):  # payloads not aligned to their dtype in the arena
        return None
    return ArenaBlocks(namespace, keys[:len(usable)], usable, checksums, segments, reader,
                       client, held)


def _named_tags(reader: Any, namespace: Namespace, keys: list[bytes],
                locations: list[BlockLocation]) -> list[bytes] | None:
    """The blocks' tags when every one is of its namespace's size and its header names the
    namespace and its key (``block_batch.named_tags``: the node checked the rest at Put), read
    in one gather of those few bytes; None when any is not (the full check decides)."""
    nbytes = block_nbytes(namespace)
    if any(loc.nbytes != nbytes for loc in locations):
        return None
    fields = reader.columns(locations, naming_columns(namespace))
    return named_tags(fields, namespace, keys)


def _segments(reader: Any, namespace: Namespace, locations: list[BlockLocation]
              ) -> list[tuple[int, torch.Tensor]]:
    """Payload views over runs of blocks that lie one after another in the arena."""
    start, nbytes = payload_offset(namespace), namespace.payload_nbytes
    itemsize = namespace.torch_dtype.itemsize
    out: list[tuple[int, torch.Tensor]] = []
    first = 0
    for i in range(1, len(locations) + 1):
        if i < len(locations) and locations[i].offset == locations[i - 1].offset \
                + locations[i - 1].nbytes and locations[i].nbytes == locations[0].nbytes:
            continue
        run = locations[first:i]
        stride = run[0].nbytes
        base = run[0].offset + start
        if len(run) > 1 and (stride % itemsize or base % itemsize):
            for j, loc in enumerate(run):  # rows not aligned to the dtype: a view per block
                out.append((first + j, _payloads(reader, loc.offset + start, nbytes, 1, nbytes,
                                                 namespace)))
        else:
            out.append((first, _payloads(reader, base, nbytes, len(run), stride, namespace)))
        first = i
    return out


def _payloads(reader: Any, offset: int, nbytes: int, count: int, stride: int,
              namespace: Namespace) -> torch.Tensor:
    """``count`` payloads of ``nbytes`` every ``stride`` bytes from ``offset``, as one
    ``[count, *payload_shape]`` view of the arena."""
    span = reader.tensor(offset, stride * (count - 1) + nbytes)
    rows = span.as_strided((count, nbytes), (stride, 1))
    return rows.view(namespace.torch_dtype).unflatten(1, namespace.payload_shape)
