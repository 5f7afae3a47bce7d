"""The engine's side of the store: lookups, fetches to the model's device, and publishing.

Kept apart from the engine's compute loop because all of it is about where blocks are, not what
the model does with them: a lookup or fetch also sees the blocks this engine computed and has
not finished publishing (they wait in ``kvstore.workers.engine.background_publisher`` on the
device, readable at once), a fetch lands straight on the model's device through the store's DMA
path, and a publish is queued behind the request (or, with ``worker.publish_backlog_blocks: 0``,
put here and now).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.api import MISS_NODE_UNAVAILABLE, BlockPut, FetchedBlock, KVStore, Miss
from kvstore.client.early_fetch import LayerFeed
from kvstore.config import WorkerConfig
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.workers.engine.background_publisher import BackgroundPublisher, PublishBatch


@dataclass(slots=True)
class Fetch:
    """The leading run of blocks fetched from the store, and where each came from.

    ``confirm`` is set when the payloads were handed over before their verification ended
    (``kvstore.client.early_fetch``): it waits for the verdicts and returns how many of the leading
    payloads are good; nothing computed from the others may leave the engine. ``feed`` is set
    when they are still arriving layer after layer: the payloads may then be read only through
    it (``kvstore.workers.model.layer_fed_cache``).
    """

    payloads: list[torch.Tensor] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    misses: list[str] = field(default_factory=list)
    confirm: Callable[[], int] | None = None
    feed: LayerFeed | None = None
    #: What ``fetch``'s ``prepare`` made while the read ran (a cache for the blocks, say).
    made: Any = None

    def keep(self, num_blocks: int) -> None:
        """Use only the first ``num_blocks`` (the rest cannot be resumed from)."""
        del self.payloads[num_blocks:]
        del self.nodes[num_blocks:]

    @property
    def sources(self) -> dict[str, int]:
        """Blocks used per node."""
        out: dict[str, int] = {}
        for node in self.nodes:
            out[node] = out.get(node, 0) + 1
        return out


class BlockIO:
    """One engine's lookups, fetches and publishes over ``store`` (``None``: no store)."""

    def __init__(self, store: KVStore | None, config: WorkerConfig, device: torch.device
                 ) -> None:
        self.store = store
        self.block_size = config.block_size
        self.device = device
        # Publishing runs behind the request (kvstore.workers.engine.background_publisher) unless
        # the backlog is 0.
        self.publisher = BackgroundPublisher(
            store, max_backlog_blocks=config.publish_backlog_blocks,
            max_backlog_bytes=config.publish_backlog_bytes,
            when_full=config.publish_when_full) \
            if store is not None and config.publish_backlog_blocks > 0 else None
        # Same-node reads into a GPU DMA from the page-locked arena: start the registration
        # now, in the background, rather than inside the first request's lease.
        prepare = getattr(store, "prepare_device_reads", None)
        if prepare is not None and device.type == "cuda":
            prepare(device)

    def block_tokens(self, tokens: list[int], i: int) -> list[int]:
        return tokens[i * self.block_size:(i + 1) * self.block_size]

    def lookup(self, namespace: Namespace, keys: Sequence[bytes]) -> int:
        """The leading blocks of ``keys`` in the store, or still queued by our publisher."""
        assert self.store is not None
        try:
            hit = self.store.lookup_prefix(namespace, keys).num_blocks
        except KVStoreError:  # an unreachable index is a cold start, not a failed request
            hit = 0
        if self.publisher is not None and hit < len(keys):
            base = hit
            pending = self.publisher.pending(namespace, list(keys[base:]))
            while hit < len(keys) and hit - base in pending:
                hit += 1
        return hit

    def fetch(self, namespace: Namespace, tokens: list[int], keys: Sequence[bytes],
              num_blocks: int, *, early: bool = False,
              prepare: Callable[[int], Any] | None = None) -> Fetch:
        """Fetch the first ``num_blocks`` blocks; keep the leading run of good ones.

        ``early``: where the store can (a same-node read into a GPU), hand the payloads over
        as soon as their copies are queued, before verification ends; the caller must then
        call ``Fetch.confirm`` before anything computed from them leaves it. ``prepare``
        (``num_blocks`` -> anything) runs on this thread while such a read leases and issues
        its copies on its own; its answer is ``Fetch.made``."""
        fetch = Fetch()
        if num_blocks == 0 or self.store is None:
            return fetch
        # Blocks this engine computed and has not finished publishing: already on the device.
        pending = self.publisher.pending(namespace, list(keys[:num_blocks])) \
            if self.publisher is not None else {}
        early_get = getattr(self.store, "batch_get_early", None)
        if early and not pending and early_get is not None and \
                self.device.type in ("cpu", "cuda"):
            return self._fetch_early(early_get, namespace, tokens, keys, num_blocks, prepare)
        wanted = [i for i in range(num_blocks) if i not in pending]
        fetched: dict[int, FetchedBlock | Miss] = {}
        if wanted:
            try:
                results = self.store.batch_get(
                    namespace, [keys[i] for i in wanted],
                    [self.block_tokens(tokens, i) for i in wanted],
                    # Straight to our device (the store's DMA path; "cpu" runs the same code
                    # in CI); a device the store cannot write (an NPU) gets host payloads.
                    **({"device": self.device} if self.device.type in ("cpu", "cuda")
                       else {}))
            except KVStoreError as exc:  # the store is a cache: losing it means recomputing
                fetch.misses.append(f"{MISS_NODE_UNAVAILABLE}: {exc}")
                results = []
            fetched = dict(zip(wanted, results, strict=False))
        for i in range(num_blocks):
            if i in pending:
                fetch.payloads.append(pending[i])
                fetch.nodes.append(self.store.node_id)
                continue
            r = fetched.get(i)
            if not isinstance(r, FetchedBlock):
                if r is not None:
                    fetch.misses.append(r.reason)
                break
            fetch.payloads.append(r.payload.to(self.device, non_blocking=True))
            fetch.nodes.append(r.node_id)
            fetch.bytes_fetched += r.payload.numel() * r.payload.element_size()
        return fetch

    def _fetch_early(self, early_get: Callable[..., Any], namespace: Namespace,
                     tokens: list[int], keys: Sequence[bytes], num_blocks: int,
                     prepare: Callable[[int], Any] | None = None) -> Fetch:
        """``fetch`` through the store's early path (``kvstore.client.early_fetch``)."""
        fetch = Fetch()
        assert self.store is not None
        try:
            handle = early_get(namespace, list(keys[:num_blocks]),
                               [self.block_tokens(tokens, i) for i in range(num_blocks)],
                               device=self.device)
        except KVStoreError as exc:
            fetch.misses.append(f"{MISS_NODE_UNAVAILABLE}: {exc}")
            return fetch
        if prepare is not None:
            fetch.made = prepare(num_blocks)
        payloads, verified = handle.leading(by_layer=True)
        fetch.payloads = payloads
        fetch.feed = getattr(handle, "feed", None)
        if fetch.feed is None:  # the read took another way: what was made for it goes now
            fetch.made = None
        fetch.nodes = [self.store.node_id] * len(payloads)

        def confirm() -> int:
            try:
                results = handle.result()
            except KVStoreError as exc:  # the store is a cache: losing it means recomputing
                fetch.misses.append(f"{MISS_NODE_UNAVAILABLE}: {exc}")
                return 0
            good = 0
            for r in results:
                if not isinstance(r, FetchedBlock):
                    fetch.misses.append(r.reason)
                    break
                if good == len(fetch.payloads):
                    break
                fetch.nodes[good] = r.node_id
                fetch.bytes_fetched += r.payload.numel() * r.payload.element_size()
                good += 1
            return good

        if verified:
            confirm()
        else:
            fetch.confirm = confirm
        return fetch

    def wait_visible(self, namespace: Namespace, keys: Sequence[bytes], deadline: float
                     ) -> None:
        """Wait (bounded) until the leading ``keys`` are all in the store: a prefill elsewhere
        said it queued them, and its background publish may still be running."""
        pause = 0.002
        while time.monotonic() < deadline:
            if self.lookup(namespace, keys) >= len(keys):
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def publish(self, request_id: str, namespace: Namespace, tokens: list[int],
                keys: Sequence[bytes], first: int, blocks: torch.Tensor | None) -> int:
        """Publish ``blocks`` (``[nb, L, 2, bs, H, D]`` on the model's device: the prompt's
        blocks ``first..first+nb-1``); returns how many were accepted.

        With a publisher they are queued behind a stream event and the request goes on at
        once; without one (``worker.publish_backlog_blocks: 0``) they are put here and now.
        """
        assert self.store is not None
        if blocks is None or not len(blocks):
            return 0
        end = first + len(blocks)
        batch = PublishBatch(
            request_id, namespace, [bytes(k) for k in keys[first:end]],
            [bytes(keys[i - 1]) if i else namespace.root for i in range(first, end)],
            [self.block_tokens(tokens, i) for i in range(first, end)], blocks)
        if self.publisher is None:
            self.store.batch_put(namespace, [
                BlockPut(k, p, t, blocks[i].to("cpu"))
                for i, (k, p, t) in enumerate(zip(batch.keys, batch.parents, batch.tokens,
                                                  strict=True))])
            return len(blocks)
        if blocks.device.type == "cuda":
            # After the copy that made ``blocks``: on *their* device's stream, not the current
            # device's (another GPU's stream would let the publisher read half-written bytes).
            batch.ready = torch.cuda.Event()
            batch.ready.record(torch.cuda.current_stream(blocks.device))
        return self.publisher.submit(batch)

    def wait_published(self, request_id: str | None = None, timeout: float | None = None
                       ) -> None:
        """Wait until a request's blocks (``None``: every queued block) are put in the store."""
        if self.publisher is None:
            return
        if request_id is None:
            if not self.publisher.flush(timeout):
                raise TimeoutError(f"the publish backlog did not drain in {timeout}s")
        else:
            self.publisher.wait(request_id, timeout)

    def close(self) -> None:
        """Publish what is queued, then stop the publisher (the store stays the caller's)."""
        if self.publisher is not None:
            self.publisher.close()
