"""The Ray Serve deployments behind the HTTP front end: prefill replicas and decode replicas.

Each replica wraps the same worker the jobs use (``PrefillWorker``, ``DecodeWorker``) with its
own store client, so a request served over HTTP publishes and reuses exactly the blocks a
``kvstore generate`` job does. The model runs in a thread of the replica's own pool; the
replica's event loop only hands tokens on. A request whose caller goes away (a client that
disconnects, a ``stop`` string reached) is cancelled by Serve, which raises ``CancelledError``
here: the engine is told to stop at its next step and releases the request's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ray import serve

from kvstore.config import KVStoreConfig
from kvstore.keys import Namespace
from kvstore.workers.engine.results import PrefillResult, TailKV
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.replica import Replica, cluster_store_factory
from kvstore.workers.replicas.roles import DecodeWorker, PrefillWorker

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Marks the end of a stream on a replica's token queue.
_END = object()


@dataclass(slots=True)
class EngineCall:
    """What the front end asks of a replica for one request."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    use_cache: bool = True
    #: Blocks of the prompt's cached prefix per store node, for ``kvstore.frontend.routing``.
    node_blocks: dict[str, int] = field(default_factory=dict)


def _replica_tag(kind: str) -> str:
    try:
        return f"serve-{kind}-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # outside Serve (tests that build a replica directly)
        return f"serve-{kind}"


class _ServeReplica:
    """What both kinds share: a worker, a thread pool for its model, cancellation."""

    worker: Replica

    def __init__(self, worker: Replica, threads: int) -> None:
        self.worker = worker
        self.pool = ThreadPoolExecutor(max_workers=threads,
                                       thread_name_prefix=worker.replica_id)
        #: Requests stopped because their caller went away (disconnect, stop string).
        self.cancelled = 0

    async def _run(self, request_id: str, fn: Callable[[], T]) -> T:
        """``fn`` on the pool; a cancelled caller cancels the request in the engine too."""
        future = asyncio.get_running_loop().run_in_executor(self.pool, fn)
        try:
            return await future
        except asyncio.CancelledError:
            self.cancelled += 1
            self.worker.cancel(request_id)
            raise

    async def stats(self) -> dict[str, Any]:
        """For ``/health``: this replica is up, and how many requests hold KV on it."""
        return {"replica": self.worker.replica_id, "node_id": self.worker.node_id(),
                "active_requests": self.worker.in_flight(), "cancelled": self.cancelled}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.worker.close()


@serve.deployment(name="prefill", ray_actor_options={"num_cpus": 0})
class PrefillServer(_ServeReplica):
    """Computes the uncached suffix, publishes its blocks, returns the first token."""

    def __init__(self, config: KVStoreConfig) -> None:
        worker = PrefillWorker(config, cluster_store_factory(config), _replica_tag("prefill"))
        super().__init__(worker, config.serve.max_ongoing_requests)
        self.prefill_worker = worker

    async def namespace(self, cache_salt: str | None) -> Namespace:
        """The namespace this replica publishes a tenant's blocks in (for routing lookups)."""
        return self.prefill_worker.engine.hasher_for(cache_salt).namespace

    async def prefill(self, call: EngineCall) -> PrefillResult:
        # The first token goes out at once: the blocks publish behind it, and the decode
        # replica waits for them by key (stream's wait_for_blocks), not this call.
        return await self._run(call.request_id, lambda: self.prefill_worker.prefill(
            call.token_ids, call.request_id, call.sampling, use_cache=call.use_cache,
            cache_salt=call.cache_salt, wait_published=False))


@serve.deployment(name="decode", ray_actor_options={"num_cpus": 0})
class DecodeServer(_ServeReplica):
    """Fetches the prompt's blocks (plus the prefill's private tail) and streams tokens."""

    def __init__(self, config: KVStoreConfig) -> None:
        worker = DecodeWorker(config, cluster_store_factory(config), _replica_tag("decode"))
        super().__init__(worker, config.serve.max_ongoing_requests)
        self.decode_worker = worker

    async def stream(self, call: EngineCall, first_token: int | None = None,
                     tail: TailKV | None = None, wait_for_blocks: int = 0
                     ) -> AsyncIterator[dict[str, Any]]:
        """``{"token_ids": [...]}`` as tokens come, then ``{"done": {...}}``.

        ``first_token=None`` generates here from scratch with the store bypassed (the
        ``bypass_cache`` reference): the first token is streamed too. Otherwise the prefill's
        first token is already out, and the stream carries the tokens after it.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def on_token(token: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, token)

        def work() -> dict[str, Any]:
            w = self.decode_worker
            if first_token is None:
                pre, dec = w.generate(call.token_ids, call.request_id, call.sampling,
                                      use_cache=call.use_cache, cache_salt=call.cache_salt,
                                      on_token=on_token)
                return {"prompt_tokens": pre.num_prompt_tokens, "cached_tokens": 0,
                        "num_tokens": len(dec.output_token_ids), "misses": pre.misses}
            dec = w.decode(call.token_ids, first_token, call.request_id, tail, call.sampling,
                           use_cache=call.use_cache, cache_salt=call.cache_salt,
                           on_token=on_token, wait_for_blocks=wait_for_blocks)
            return {"prompt_tokens": len(call.token_ids), "fetched_tokens": dec.fetched_tokens,
                    "num_tokens": len(dec.output_token_ids), "misses": dec.misses}

        future = loop.run_in_executor(self.pool, work)
        future.add_done_callback(lambda _f: queue.put_nowait(_END))
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                batch = [item]
                while not queue.empty():  # a slow reader gets the tokens in one message
                    nxt = queue.get_nowait()
                    if nxt is _END:
                        queue.put_nowait(_END)
                        break
                    batch.append(nxt)
                yield {"token_ids": batch}
            yield {"done": future.result()}
        finally:
            if not future.done():  # the caller went away: stop the engine, free the KV
                self.cancelled += 1
                self.worker.cancel(call.request_id)
