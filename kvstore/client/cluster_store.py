"""The KVStore facade over a cluster: the index says where blocks are, clients move them.

``batch_get`` groups keys by holder (the reader's own node first, then any other holder),
copies each block once into a buffer the caller will own (same node: from the holder's shared
memory under a lease, each block's copy hashed while it is cache-hot, the batch's blocks
spread over a few threads; other nodes: the bulk channel or gRPC, then verification), and
returns a view into that buffer: one ``[n, block_nbytes]`` tensor per batch, or the caller's
own (``batch_get_into``). With a ``device``, the payloads are views into one
``[n, *payload_shape]`` tensor on it instead (``kvstore.client.device_reads``).
Whatever goes wrong with a block or a node becomes a ``Miss`` with a reason: a worker
recomputes, it never fails or uses wrong KV; a node that did not answer is skipped for a
while (``kvstore.client.unreachable``) rather than waited for again by every request. Same
node is decided by node id (the Ray node), not by whether ``/dev/shm`` happens to be shared.

Hits, misses, fetched blocks per path and fetch latency are tallied here, in the reader's
process, and pushed to the reader's own store node every ``FLUSH_INTERVAL_S`` and on ``close``
(``kvstore.reader_metrics``): the node serves them on its ``/metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvstore import reader_metrics
from kvstore.api import (
    MISS_LEASE_EXPIRED,
    MISS_NODE_UNAVAILABLE,
    MISS_NOT_FOUND,
    BlockPut,
    FetchedBlock,
    Miss,
    PrefixHit,
    TokenIds,
)
from kvstore.block import block_nbytes, payload_offset
from kvstore.block_batch import encode_blocks_into
from kvstore.client.arena_blocks import ArenaBlocks, arena_blocks
from kvstore.client.arena_populate import Populator
from kvstore.client.block_buffers import check_block_buffer, new_block_buffer
from kvstore.client.device_copy import DeviceRows, dma_path, target_device
from kvstore.client.directory import Directory, lister
from kvstore.client.early_fetch import EarlyFetch
from kvstore.client.leased_reads import HeldLease
from kvstore.client.node_client import StoreNodeClient
from kvstore.client.node_clients import NodeClients
from kvstore.client.sole_node import SoleNode
from kvstore.client.unreachable import UnreachableNodes
from kvstore.config import ClientConfig
from kvstore.errors import (
    BlockCorrupted,
    BlockMismatch,
    KVStoreError,
    LeaseExpired,
    NodeUnavailable,
)
from kvstore.index.base import Index
from kvstore.index.view import IndexView
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

class ClusterStore:
    """A worker's view of the cluster's store nodes (implements ``kvstore.api.KVStore``)."""

    def __init__(self, node_id: str, index: Index, directory: Directory,
                 config: ClientConfig | None = None, *, local_node_id: str | None = None,
                 lease_ttl_s: float = 30.0, owns_index: bool = False,
                 unreachable: UnreachableNodes | None = None) -> None:
        """``node_id``: the store node this worker writes to; ``local_node_id``: the Ray
        node the worker runs on (defaults to ``node_id``), whose arena it may map;
        ``owns_index``: ``close`` closes the index too (it was made for this store);
        ``unreachable``: breakers shared with other clients (else this store's own)."""
        self.node_id = node_id
        self._owns_index = owns_index
        self.local_node_id = local_node_id or node_id
        self.index = index
        self.config = config or ClientConfig()
        # Lookups and holder queries go through a view that trusts recent positive answers
        # for config.index_view_ttl_s (kvstore.index.view: staleness is a miss, never wrong KV).
        self.view = IndexView(index, self.config.index_view_ttl_s)
        self.lease_ttl_s = lease_ttl_s
        # Nodes that just failed to answer, skipped for a while (kvstore.client.unreachable).
        self.unreachable = unreachable or UnreachableNodes(
            self.config.unreachable_cooldown_s, self.config.unreachable_max_cooldown_s)
        self.clients = NodeClients(directory, self.config, local_node_id=self.local_node_id,
                                   lease_ttl_s=lease_ttl_s, unreachable=self.unreachable)
        self.sole = SoleNode(self.local_node_id, lister(directory),
                             on_listing=self.clients.saw_directory)
        self._no_local_calls = False  # set once this host's node cannot answer lookups
        self._closed = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, daemon=True,
                                        name="kvstore-metrics-push")
        self._pusher.start()

    # -- the facade -------------------------------------------------------------------------
    def lookup_prefix(self, namespace: Namespace, keys: Sequence[bytes]) -> PrefixHit:
        """The longest cached prefix of ``keys``: what the view knows, then the leading run
        this host's store node holds (asked on its bulk channel: a fraction of the index's
        Ray round trip, and the node is the authority on what it holds), then the index
        for the rest."""
        keys = [bytes(k) for k in keys]
        known = self.view.fresh_count(keys)
        answered = self._held_here(namespace, keys[known:]) if known < len(keys) else 0
        here = answered or 0
        if here:
            self.view.remember(keys[known:known + here], [[self.local_node_id]] * here)
        if answered is not None and self.sole.alone_now():  # no other node the index could name
            if self.view.ttl_s > 0:
                return self.unreachable.reachable(self.view.lookup_prefix(keys[:known + here]))
            return PrefixHit(here, [[self.local_node_id]] * here)
        if self.view.ttl_s > 0:  # the view knows this node's run now
            return self.unreachable.reachable(self.view.lookup_prefix(keys))
        # a view that remembers nothing: this node's run, then the index's for the rest
        rest = self.view.lookup_prefix(keys[here:]) if here < len(keys) else PrefixHit(0, [])
        rest = self.unreachable.reachable(rest)
        return PrefixHit(here + rest.num_blocks, [[self.local_node_id]] * here + rest.holders)

    def _held_here(self, namespace: Namespace, keys: list[bytes]) -> int | None:
        """How many leading ``keys`` this host's store node holds, when it answers on its
        bulk channel (None when there is none, or it fails: the index is asked then)."""
        if self._no_local_calls or self.unreachable.cooling(self.local_node_id):
            return None
        try:
            client = self._client(self.local_node_id)
        except KVStoreError:  # no store node on this host: ask the index from now on
            self._no_local_calls = True
            return None
        if not (client.same_node and client.has_bulk):
            self._no_local_calls = True
            return None
        held = client.held_here(keys, namespace)
        return None if held is None else (held.index(False) if False in held else len(held))

    def lease_prefix(self, namespace: Namespace, keys: Sequence[bytes]
                     ) -> tuple[PrefixHit, HeldLease | None]:
        """``lookup_prefix`` whose question to this host's node is a lease on the blocks it
        holds (one round trip either way): the lease goes to whoever reads them next
        (``batch_get``'s ``held``: vLLM's worker, after its scheduler looked the prompt up),
        which then takes none. No lease where the node cannot be asked so, or holds none."""
        keys = [bytes(k) for k in keys]
        client = None if self._no_local_calls or self.unreachable.cooling(self.local_node_id) \
            else self.clients.get_or_none(self.local_node_id)
        if client is None or not (client.same_node and client.has_bulk):
            return self.lookup_prefix(namespace, keys), None
        granted = time.monotonic()
        info = client.lease_here(keys, self.lease_ttl_s, namespace=namespace, files=True)
        if info is None:  # refused or failed: the yes/no lookup, which never waits either
            return self.lookup_prefix(namespace, keys), None
        held = {loc.key for loc in info.locations}
        here = next((i for i, k in enumerate(keys) if k not in held), len(keys))
        lease = HeldLease(self.local_node_id, info, granted, self.lease_ttl_s) if held else None
        if lease is None:
            client.release_nowait(info.lease_id)
        if here:
            self.view.remember(keys[:here], [[self.local_node_id]] * here)
        rest = PrefixHit(0, [])
        if here < len(keys) and not self.sole.alone_now():
            with contextlib.suppress(Exception):  # the index down: this node's run only
                rest = self.unreachable.reachable(self.view.lookup_prefix(keys[here:]))
        return PrefixHit(here + rest.num_blocks,
                         [[self.local_node_id]] * here + rest.holders), lease

    def arena_blocks(self, namespace: Namespace, keys: Sequence[bytes],
                     token_ids: Sequence[TokenIds], held: HeldLease) -> ArenaBlocks | None:
        """The leading blocks ``held`` pins in this host's arena, for use in place
        (``kvstore.client.arena_blocks``); None where they must be read the usual way."""
        client = self.clients.get_or_none(held.node_id)
        return None if client is None else arena_blocks(client, namespace, keys, token_ids,
                                                         held)

    def release_lease(self, lease: HeldLease) -> None:
        """End a lease from ``lease_prefix`` that no read will use (without waiting)."""
        client = self.clients.get_or_none(lease.node_id)
        if client is not None:
            client.release_nowait(lease.info.lease_id)

    def batch_get(self, namespace: Namespace, keys: Sequence[bytes],
                  token_ids: Sequence[TokenIds], *, device: torch.device | str | None = None,
                  held: HeldLease | None = None) -> list[FetchedBlock | Miss]:
        if len(keys) != len(token_ids):
            raise ValueError(f"{len(keys)} keys but {len(token_ids)} token lists")
        target = target_device(device)
        if target is None:
            # One allocation for the batch, not one per block: the payloads are views into
            # it, so the batch's memory lives as long as any of them.
            return self.batch_get_into(namespace, keys, token_ids,
                                       new_block_buffer(namespace, len(keys)), held=held)
        # Rows of whole blocks: a run of blocks adjacent in a same-node arena is one copy.
        return self._batch_get(namespace, [bytes(k) for k in keys], token_ids,
                               DeviceRows(target, len(keys), block_nbytes(namespace),
                                          payload_offset=payload_offset(namespace)), held)

    def batch_get_early(self, namespace: Namespace, keys: Sequence[bytes],
                        token_ids: Sequence[TokenIds], *, device: torch.device | str
                        ) -> EarlyFetch:
        """``batch_get`` into ``device`` whose blocks the caller may compute on before they
        are verified (``kvstore.client.early_fetch``; only same-node reads into a GPU offer blocks
        early, elsewhere they come verified): the read runs on a thread of its own."""
        if len(keys) != len(token_ids):
            raise ValueError(f"{len(keys)} keys but {len(token_ids)} token lists")
        target = target_device(device)
        if target is None:
            raise ValueError("an early fetch needs a device (cpu or cuda)")
        sink = DeviceRows(target, len(keys), block_nbytes(namespace),
                          payload_offset=payload_offset(namespace))
        return EarlyFetch(self._batch_get, namespace, [bytes(k) for k in keys], token_ids,
                          sink)

    def prepare_device_reads(self, device: torch.device | str, *, wait: bool = False) -> str:
        """Get same-node reads into ``device`` ready before the first request: page-lock this
        node's arena in the background (seconds for a large arena, far too long inside a
        lease; reads stage until it is done; ``wait``: until it is done). Returns the path
        such reads take (``kvstore.client.device_copy.dma_path``: direct, staged or host)."""
        target = target_device(device)
        path = dma_path(target)
        if target is None or path != "direct":
            return path
        try:
            client = self._client(self.local_node_id)
        except KVStoreError:  # no store node on this host: every read is remote
            return path
        locked = client.prepare_device_reads(target, wait=wait)
        return "staged" if wait and not locked else path

    def warm_up(self) -> bool:
        """Connect to this host's store node now: its address, the channel and the arena's
        mapping, which a fresh process (a new vLLM instance) would otherwise pay inside its
        first request. Whether it worked; a node that cannot be reached is left for the first
        read to report and route around."""
        self.sole.refresh()  # the first lookup then knows whether to ask the index
        try:
            self._client(self.local_node_id).warm_up()
        except (KVStoreError, OSError) as exc:
            log.debug("warming up the client of %s failed: %s", self.local_node_id[:12], exc)
            return False
        return True

    def populate_arena(self, cores: set[int] | None = None) -> Populator | None:
        """Start mapping this host's node's arena into this process in the background, so a
        fresh reader's first reads take no page faults (``ShmReader.populate``); None where
        there is no such node or arena."""
        client = self.clients.get_or_none(self.local_node_id)
        try:
            return None if client is None else client.populate_arena(cores)
        except OSError as exc:  # the arena cannot be mapped: reads go the usual way
            log.debug("populating the arena of %s failed: %s", self.local_node_id[:12], exc)
            return None

    def batch_get_into(self, namespace: Namespace, keys: Sequence[bytes],
                       token_ids: Sequence[TokenIds], out: torch.Tensor, *,
                       held: HeldLease | None = None) -> list[FetchedBlock | Miss]:
        """``batch_get`` into a caller-owned ``[n, block_nbytes]`` uint8 CPU tensor.

        Block ``i`` lands in row ``i`` and its payload is a view into that row, so reusing
        ``out`` across requests skips the page faults of fresh memory; the caller must not
        overwrite a row while the payload viewing it is still in use. ``held``: a lease from
        ``lease_prefix`` that this host's blocks are read under (released after).
        """
        if len(keys) != len(token_ids):
            raise ValueError(f"{len(keys)} keys but {len(token_ids)} token lists")
        check_block_buffer(out, len(keys), block_nbytes(namespace))
        return self._batch_get(namespace, [bytes(k) for k in keys], token_ids, out, held)

    def _batch_get(self, namespace: Namespace, keys: list[bytes],
                   token_ids: Sequence[TokenIds], out: torch.Tensor | DeviceRows,
                   held: HeldLease | None = None) -> list[FetchedBlock | Miss]:
        """Fetch into ``out``: CPU rows of whole blocks, or payload rows on a device."""
        results: list[str | None] = [None] * len(keys)  # the node that served each block
        try:
            holders = self.view.holders(keys)
        except Exception as exc:  # the index being down is a miss for everyone, not a crash
            if held is not None:
                self.release_lease(held)
            return [Miss(k, MISS_NODE_UNAVAILABLE, f"index: {exc}") for k in keys]
        lease: list[HeldLease | None] = [held]  # used by the first read from its node
        # Candidates per key, own node first; a node that fails is dropped for the next round.
        candidates = [self._order(h) for h in holders]
        tried: list[set[str]] = [set() for _ in keys]
        last_miss: dict[int, Miss] = {}
        try:
            self._fetch_rounds(namespace, keys, token_ids, out, candidates, tried, results,
                               last_miss, lease)
            # Holders that turned out not to hold a key (or failed) were dropped from the view
            # by _fetch_group: if the view answered from memory, its promise may have been
            # stale, so ask the index once for those keys and try any holder not tried yet.
            again = [i for i in last_miss if results[i] is None and self.view.ttl_s > 0]
            if again:
                with contextlib.suppress(Exception):  # the index is down: they stay misses
                    fresh = self.view.holders([keys[i] for i in again])
                    for i, h in zip(again, fresh, strict=True):
                        candidates[i] = [n for n in self._order(h) if n not in tried[i]]
                    self._fetch_rounds(namespace, keys, token_ids, out, candidates, tried,
                                       results, last_miss)
        finally:
            if lease[0] is not None:  # no read went to its node
                self.release_lease(lease[0])
            if isinstance(out, DeviceRows):
                out.wait()  # no copy may still write the rows once they can be freed
        if isinstance(out, DeviceRows):
            # A device row of a miss may hold a rejected block's bytes: none may stay there.
            out.zero([i for i, r in enumerate(results) if r is None])
            out.wait()
            payloads = out.payloads(namespace)
        else:  # every row's payload view in one go (unbind is one C call, indexing is not)
            start = payload_offset(namespace)
            payloads = out[: len(keys), start : start + namespace.payload_nbytes] \
                .view(namespace.torch_dtype).unflatten(1, namespace.payload_shape).unbind(0)
        fetched: list[FetchedBlock | Miss] = []
        for i, r in enumerate(results):
            if isinstance(r, str):
                fetched.append(FetchedBlock(keys[i], payloads[i], r))
                continue
            miss = last_miss.get(i) or Miss(keys[i], MISS_NOT_FOUND, "no node holds it")
            reader_metrics.record_miss(miss.reason)
            fetched.append(miss)
        reader_metrics.record_hits(sum(isinstance(r, FetchedBlock) for r in fetched))
        return fetched

    def batch_put(self, namespace: Namespace, blocks: Sequence[BlockPut]) -> None:
        if not blocks:
            return
        # One [n, block_nbytes] array for the batch, encoded column-wise (kvstore.block).
        rows = np.empty((len(blocks), block_nbytes(namespace)), dtype=np.uint8)
        keys = [bytes(b.key) for b in blocks]
        encode_blocks_into(rows, namespace, keys, [b.parent_key for b in blocks],
                           [b.token_ids for b in blocks], [b.payload for b in blocks])
        self._client(self.node_id).put_rows(namespace, keys, rows)
        self.view.put(keys, self.node_id)

    def flush_metrics(self, *, resolve: bool = True) -> bool:
        """Push this process's reader metrics to our store node now; False if it failed (they
        stay pending for the next push).

        ``resolve=False`` (the background pusher) only uses a connection this store already
        has: resolving a node goes through the directory, which on Ray is an actor call, and an
        actor call from a thread that outlives ``ray.shutdown()`` would start a new Ray
        instance of its own. The caller's ``close()`` resolves."""
        tally = reader_metrics.take_pending()
        if tally.empty():
            return True
        try:
            if resolve:
                client: StoreNodeClient | None = self._client(self.node_id)
            else:
                client = self.clients.cached(self.node_id)
            if client is None:
                reader_metrics.restore_pending(tally)
                return False
            client.report_reads(tally)
        except (KVStoreError, OSError) as exc:
            if isinstance(exc, NodeUnavailable):
                self.clients.drop(self.node_id)
            reader_metrics.restore_pending(tally)
            return False
        return True

    def close(self) -> None:
        """Push the last metrics (a short job's figures count too), then close connections."""
        self._closed.set()
        self.flush_metrics()
        self.clients.close()
        if self._owns_index:
            self.index.close()

    # -- internals --------------------------------------------------------------------------
    def _push_loop(self) -> None:
        while not self._closed.wait(reader_metrics.FLUSH_INTERVAL_S):
            self.flush_metrics(resolve=False)

    def _fetch_rounds(self, namespace: Namespace, keys: list[bytes],
                      token_ids: Sequence[TokenIds], out: torch.Tensor | DeviceRows,
                      candidates: list[list[str]], tried: list[set[str]],
                      results: list[str | None], last_miss: dict[int, Miss],
                      lease: list[HeldLease | None] | None = None) -> None:
        """Fetch each unserved key from its next candidate, grouped by node, until every key
        is served or out of candidates (``lease``: a held lease, for its node's first read)."""
        while True:
            groups: dict[str, list[int]] = {}
            skipping: dict[str, bool] = {}  # asked once a round: a node's probe is one read
            for i, cands in enumerate(candidates):
                while results[i] is None and cands:
                    node = cands.pop(0)
                    tried[i].add(node)
                    if node not in skipping:
                        skipping[node] = self.unreachable.skip(node)
                    if not skipping[node]:
                        groups.setdefault(node, []).append(i)
                        break
                    last_miss[i] = Miss(keys[i], MISS_NODE_UNAVAILABLE,
                                        f"{node[:12]} did not answer lately; skipped for "
                                        f"{self.unreachable.retry_in(node):.1f} s more")
            if not groups:
                return
            for node, idxs in groups.items():
                held = None
                if lease and lease[0] is not None and lease[0].node_id == node:
                    held, lease[0] = lease[0], None
                self._fetch_group(namespace, node, idxs, keys, token_ids, out, results,
                                  last_miss, held)

    def _order(self, holders: Sequence[str]) -> list[str]:
        own = [h for h in holders if h == self.local_node_id]
        return own + [h for h in holders if h != self.local_node_id]

    def _client(self, node: str) -> StoreNodeClient:
        return self.clients.get(node)

    def _fetch_group(self, namespace: Namespace, node: str, idxs: list[int], keys: list[bytes],
                     token_ids: Sequence[TokenIds], out: torch.Tensor | DeviceRows,
                     results: list[str | None], last_miss: dict[int, Miss],
                     held: HeldLease | None = None) -> None:
        nbytes = block_nbytes(namespace)
        t0 = time.perf_counter()
        client = None
        try:
            client = self._client(node)
            group_keys, group_tokens = [keys[i] for i in idxs], [token_ids[i] for i in idxs]
            if isinstance(out, DeviceRows):  # verified, then on the device
                got = client.get_verified_into_device(namespace, group_keys, group_tokens, out,
                                                      idxs, held=held)
            else:  # numpy row views: the byte paths take them without a per-block conversion
                rows = out.numpy()
                got = client.get_verified_into(namespace, group_keys, group_tokens,
                                               [rows[i, :nbytes] for i in idxs], held=held)
        except LeaseExpired as exc:
            self.unreachable.answered(node)
            for i in idxs:
                last_miss[i] = Miss(keys[i], MISS_LEASE_EXPIRED, str(exc))
            return
        except (KVStoreError, OSError, ValueError) as exc:
            if isinstance(exc, NodeUnavailable):
                self.clients.drop(node)  # reconnect (or re-resolve) next time
                self.unreachable.failed(node, exc,
                                        address=None if client is None else client.address)
            self.view.forget([keys[i] for i in idxs])
            for i in idxs:
                last_miss[i] = Miss(keys[i], MISS_NODE_UNAVAILABLE, f"{node[:12]}: {exc}")
            return
        seconds = time.perf_counter() - t0
        self.unreachable.answered(node)
        num_ok = nbytes_ok = 0
        for i, outcome in zip(idxs, got, strict=True):
            if outcome is None:
                last_miss[i] = Miss(keys[i], MISS_NOT_FOUND, f"{node[:12]} no longer holds it")
                self.view.forget([keys[i]])  # a stale promise: ask the index next time
            elif isinstance(outcome, (BlockCorrupted, BlockMismatch)):
                miss = last_miss[i] = Miss.rejected(keys[i], outcome, node[:12])
                reader_metrics.record_rejected(miss.reason)
            else:
                results[i] = node  # the FetchedBlock is made once the whole batch is in
                num_ok += 1
                nbytes_ok += outcome if isinstance(outcome, int) else 0
        path = "shm" if client.same_node else ("bulk" if client.has_bulk else "grpc")
        reader_metrics.record_fetch(path, num_ok, nbytes_ok, seconds)
