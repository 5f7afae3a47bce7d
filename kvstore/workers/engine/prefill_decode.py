"""Prefill and decode over any ``KVStore`` with exact KV reuse: the ``Engine`` (docs/design.md §4).

Exact reuse rests on one rule: every token's KV has the numerics of the canonical computation,
the prompt in chunks of ``prefill_chunk_tokens`` counted from token 0, each chunk's rows
attending over the keys up to the chunk's end. A prompt's last, partial chunk gets those
numerics by padding its keys to the chunk's end (``kvstore.workers.model.attention``) and its
rows to one of the piece sizes the probe verified (``kvstore.workers.engine.reuse_policy``), so
every full block of every prompt is canonical and is published:

    tokens  |--- chunk 0 ---|--- chunk 1 ---|--- chunk 2 ---|-- chunk 3 (partial) --|
    blocks  |b0 |b1 |b2 |b3 |b4 |b5 |b6 |b7 |b8 |b9 |b10|b11|b12|b13|  tail   (padded)
            <---------------- published: every full block ----------->  private

A hit is used up to the last block it covers where the probe found pieces smaller than a chunk
exact (cached rows are recomputed only where a passing piece size would cross the chunk's end),
else up to the last chunk boundary; the model resumes there with exactly the KV a cold run has
(``kvstore.workers.engine.prefix_reuse``). Hence a cached run and a ``use_cache=False`` run do
the same arithmetic and their logits and tokens are bitwise equal. A Miss (rejected block,
holder gone) only moves the resume point back: never a failure, never wrong KV. The tail (the
last, partial block) travels to decode privately (``TailKV``).

The engine composes one part per job: admission (``admission``), the store's side
(``block_io``), the reuse decisions (``prefix_reuse``), the chunk loop (``prefill_chunks``) and
the token loop (``decode_tokens``); what it returns is in ``results``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers import DynamicCache

from kvstore import metrics
from kvstore.api import KVStore, TokenIds
from kvstore.client import strided_copy
from kvstore.config import WorkerConfig
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHasher
from kvstore.workers.engine.admission import InFlightRequests, prompt_tokens
from kvstore.workers.engine.background_publisher import BackgroundPublisher
from kvstore.workers.engine.block_io import BlockIO, Fetch
from kvstore.workers.engine.decode_tokens import TokenLoop
from kvstore.workers.engine.paged_kv import decode_cache, prefill_cache
from kvstore.workers.engine.prefill_chunks import ChunkLoop
from kvstore.workers.engine.prefix_reuse import PrefixReuse
from kvstore.workers.engine.results import DecodeResult, PrefillResult, TailKV
from kvstore.workers.engine.reuse_policy import ReusePolicy, choose_policy
from kvstore.workers.engine.tenants import TenantHashers
from kvstore.workers.model.causal_lm import CausalLM
from kvstore.workers.model.layer_fed_cache import LayerFedCache
from kvstore.workers.model.sampling import SamplingParams, pick_token


class Engine:
    """Prefill and decode for one model over one store (``None``: no store at all).

    ``data_key`` is the cluster's data secret (``security.data_key``, bytes): every tenant's
    namespace is then keyed, so its keys cannot be precomputed from outside and a block is
    used only if its MAC shows a holder of that tenant's key wrote it (planted KV is a miss,
    recomputed). ``tenant_key`` instead (a tenant's own client, ``kvstore.security.data_keys.
    tenant_key``): the same keyed namespaces, for ``worker.cache_salt``'s tenant only. Neither
    (the embedded default): public roots and xxh3 checksums.

    Thread-safe: several requests may run at once, and take turns at the model one forward at a
    time (a replica serving several requests, a threaded actor, interleaves them step by step
    instead of splitting its torch threads between them).
    """

    def __init__(self, model: CausalLM, store: KVStore | None, config: WorkerConfig, *,
                 data_key: bytes | None = None, tenant_key: bytes | None = None) -> None:
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.chunk_tokens = config.prefill_chunk_tokens
        self._forward_lock = threading.Lock()
        self._token_loop = TokenLoop(model, self._forward_lock)
        self.policy = choose_policy(config.reuse, model, config.block_size,
                                    config.prefill_chunk_tokens)
        # KV of an approximate policy must never reach a worker that promises bitwise reuse.
        self._tenants = TenantHashers(model, config.block_size, config.cache_salt,
                                      "" if self.policy.exact else "\x00reuse=block",
                                      data_key=data_key, tenant_key=tenant_key)
        self.hasher = self._tenants.default
        self.namespace = self.hasher.namespace
        metrics.observe_reuse_policy(self.policy.as_dict())
        self._requests = InFlightRequests(config)
        self.device = model.device
        self.io = BlockIO(store, config, model.device)

    @property
    def policy(self) -> ReusePolicy:
        """The reuse policy this engine computes and resumes by."""
        return self.reuse.policy

    @policy.setter
    def policy(self, policy: ReusePolicy) -> None:
        # The reuse decisions and the chunk loop follow a replaced policy (a benchmark's
        # baseline); the namespace stays the one chosen for the policy at construction.
        self.reuse = PrefixReuse(policy, self.block_size, self.chunk_tokens)
        self._chunk_loop = ChunkLoop(self.model, policy, self._forward_lock)

    @property
    def store(self) -> KVStore | None:
        """The store this engine reads and writes (``None``: none at all)."""
        return self.io.store

    @store.setter
    def store(self, store: KVStore | None) -> None:
        self.io.store = store

    @property
    def publisher(self) -> BackgroundPublisher | None:
        """The background publisher (``None`` without a store, or with a backlog of 0)."""
        return self.io.publisher

    def wait_published(self, request_id: str | None = None, timeout: float | None = None
                       ) -> None:
        """Wait until a request's blocks (``None``: every queued block) are put in the store."""
        self.io.wait_published(request_id, timeout)

    def close(self) -> None:
        """Publish what is queued, then stop the publisher (the store stays the caller's)."""
        self.io.close()

    def hasher_for(self, cache_salt: str | None) -> BlockHasher:
        """The block hasher of a tenant: ``None`` is the configured ``worker.cache_salt``.

        A per-request salt (the HTTP API's ``cache_salt``) selects another namespace of the same
        model, so two tenants' prompts never share a block (docs/design.md §1). An engine
        holding one tenant's key only refuses another tenant's salt (PermissionDenied).
        """
        return self._tenants.get(cache_salt)

    @property
    def num_active(self) -> int:
        """Requests holding KV right now (0 after every request ends, cancelled or not)."""
        return self._requests.num_active

    def cancel(self, request_id: str) -> None:
        """Ask a running request to stop; it raises RequestCancelled and releases its KV."""
        self._requests.cancel(request_id)

    def publish_end(self, num_tokens: int) -> int:
        """Where the published blocks of a prompt of ``num_tokens`` end."""
        return self.reuse.publish_end(num_tokens)

    def resume_point(self, cached: int, num_tokens: int) -> int:
        """Where computing starts when the KV of the first ``cached`` tokens (whole blocks) is at
        hand (``PrefixReuse.resume_point``)."""
        return self.reuse.resume_point(cached, num_tokens)

    # -- prefill ----------------------------------------------------------------------------

    def _compute(self, fetch: Fetch, tokens: list[int], request_id: str,
                 check: Callable[[], None]) -> tuple[int, DynamicCache, torch.Tensor]:
        """The prompt's KV from the fetched blocks on, and its last logits (on the host: the
        device work is done when this returns)."""
        resume = len(fetch.payloads) * self.block_size
        made, fetch.made = fetch.made, None  # a computation (not its redo) takes it
        cache = prefill_cache(self.model, fetch.payloads, fetch.feed, made)
        self._requests.hold(request_id, cache)
        logits = self._chunk_loop.run(tokens, resume, cache, check)
        assert logits is not None
        if isinstance(cache, LayerFedCache):
            cache.fill_all()  # a forward fills every layer: this only guards the contract
        return resume, cache, logits

    def _fed_cache(self, num_tokens: int, num_blocks: int) -> LayerFedCache | None:
        """The cache a prefill of ``num_tokens`` that fetched ``num_blocks`` blocks computes
        on where they may come layer after layer (a GPU), made while the read leases them."""
        if self.model.device.type != "cuda" or not strided_copy.available():
            return None
        resume = self.reuse.resume_point(num_blocks * self.block_size, num_tokens)
        return LayerFedCache.for_model(self.model, resume) if resume else None

    def _prefill(self, token_ids: TokenIds, sampling: SamplingParams, request_id: str,
                 use_cache: bool, deadline: float, cache_salt: str | None = None
                 ) -> tuple[PrefillResult, DynamicCache]:
        """``prefill`` of an admitted request; also the prompt's cache, for a decode here."""
        t0 = time.perf_counter()
        check = partial(self._requests.check, request_id, deadline)
        tokens = prompt_tokens(token_ids, self.model.shape.vocab_size)
        n, bs = len(tokens), self.block_size
        hasher = self.hasher_for(cache_salt)
        namespace = hasher.namespace
        keys = hasher.block_keys(tokens)
        use_store = use_cache and self.store is not None
        hit = self.io.lookup(namespace, keys) if use_store else 0
        # Blocks may arrive before their verdicts (a same-node GPU read): compute at once,
        # and keep the result only if every block used was good.
        fetch = self.io.fetch(namespace, tokens, keys, self.reuse.prefill_fetch_blocks(hit, n),
                              early=True, prepare=partial(self._fed_cache, n))
        self.reuse.keep_resumable(fetch, n)
        t_fetch = time.perf_counter()
        resume, cache, logits = self._compute(fetch, tokens, request_id, check)
        t_verify = time.perf_counter()
        if fetch.confirm is not None:
            good = fetch.confirm()
            if good < len(fetch.payloads):  # a block used was rejected: redo without it
                self.reuse.keep_resumable(fetch, n, good)
                resume, cache, logits = self._compute(fetch, tokens, request_id, check)
        t_verify = time.perf_counter() - t_verify
        first = pick_token(logits, sampling, 0)
        ttft = time.perf_counter() - t0
        published_end = self.publish_end(n)
        num_new, prefix_blocks = 0, 0
        if use_store and self.store is not None:
            first_new = self.reuse.first_block_to_publish(resume, hit, n, bool(fetch.misses))
            try:
                end = published_end // bs
                num_new = self.io.publish(
                    request_id, namespace, tokens, keys, first_new,
                    self.model.export_block_major(cache, first_new * bs, end - first_new, bs)
                    if end > first_new else None)
                prefix_blocks = published_end // bs if num_new or first_new * bs == \
                    published_end else first_new
            except KVStoreError as exc:  # this request is served; later ones recompute
                fetch.misses.append(f"publish failed: {exc}")
                prefix_blocks = first_new
        # The private tail travels to decode on the host (it may be another process and device).
        tail = (TailKV(published_end, self.model.export_kv(cache, published_end, n).to("cpu"))
                if published_end < n else None)
        t_end = time.perf_counter()
        result = PrefillResult(
            request_id=request_id, first_token=first, num_prompt_tokens=n,
            cached_tokens=resume, computed_tokens=n - resume,
            block_keys=list(keys[:published_end // bs]), num_published_blocks=num_new,
            sources=fetch.sources, bytes_fetched=fetch.bytes_fetched, ttft_s=ttft,
            timings={"fetch_s": t_fetch - t0, "compute_s": ttft - (t_fetch - t0),
                     "verify_wait_s": t_verify, "publish_s": t_end - t0 - ttft},
            misses=fetch.misses, tail=tail, logits=logits,
            unreused_shared_tokens=max(0, hit * bs - resume), num_prefix_blocks=prefix_blocks)
        metrics.record_prefill_tokens(resume, result.unreused_shared_tokens, n - resume)
        return result, cache

    def prefill(self, token_ids: TokenIds, *, request_id: str = "prefill",
                sampling: SamplingParams | None = None, use_cache: bool = True,
                return_logits: bool = False, cache_salt: str | None = None) -> PrefillResult:
        """Compute the uncached part of the prompt, publish new blocks, return the first token.

        ``cache_salt`` selects the tenant's namespace (``None``: ``worker.cache_salt``).
        """
        deadline = self._requests.begin(request_id)
        try:
            sampling = sampling or SamplingParams()
            result, _ = self._prefill(token_ids, sampling, request_id, use_cache, deadline,
                                      cache_salt)
            if sampling.max_new_tokens == 0:  # a warm-up: publishing is its whole job
                self.wait_published(request_id)
        finally:
            self._requests.end(request_id)
        if not return_logits:
            result.logits = None
        return result

    # -- decode -----------------------------------------------------------------------------

    def decode(self, token_ids: TokenIds, first_token: int | None, *,
               tail: TailKV | None = None,
               request_id: str = "decode", sampling: SamplingParams | None = None,
               use_cache: bool = True, return_logits: bool = False,
               cache_salt: str | None = None,
               on_token: Callable[[int], None] | None = None,
               wait_for_blocks: int = 0) -> DecodeResult:
        """Fetch the prompt's KV, recompute what is missing, and generate after ``first_token``.

        ``wait_for_blocks``: the prefill's ``num_prefix_blocks``; its background publish may
        still be running, so the fetch first waits (up to ``worker.publish_wait_s``) for that
        many leading blocks to be visible, then recomputes whatever is still missing.

        ``first_token=None`` (a decode job without a prefill in front) recomputes the last
        chunk at least, and picks the first token from its logits. ``cache_salt`` is the
        tenant's (as in ``prefill``); ``on_token`` sees each later token as it is picked.
        """
        sampling = sampling or SamplingParams()
        deadline = self._requests.begin(request_id)
        check = partial(self._requests.check, request_id, deadline)
        try:
            t0 = time.perf_counter()
            tokens = prompt_tokens(token_ids, self.model.shape.vocab_size)
            n, bs = len(tokens), self.block_size
            whole = self.reuse.decode_prefix_end(n, prefilled=first_token is not None)
            hasher = self.hasher_for(cache_salt)
            keys = hasher.block_keys(tokens[:whole])
            if use_cache and wait_for_blocks and self.store is not None:
                self.io.wait_visible(hasher.namespace, keys[:wait_for_blocks],
                                     time.monotonic() + self.config.publish_wait_s)
            fetch = self.io.fetch(hasher.namespace, tokens, keys, len(keys) if use_cache else 0)
            # The prefill's tail continues exactly where the fetched blocks end: nothing runs.
            use_tail = tail is not None and len(fetch.payloads) * bs == whole == tail.start
            if not use_tail:
                self.reuse.keep_resumable(fetch, n)  # the rest must run
            resume = len(fetch.payloads) * bs
            if sampling.max_new_tokens == 0:  # a warm-up: fetching the blocks is the whole job
                setup_s = time.perf_counter() - t0
                return DecodeResult(
                    request_id=request_id, output_token_ids=[], fetched_tokens=resume,
                    recomputed_tokens=0, sources=fetch.sources,
                    bytes_fetched=fetch.bytes_fetched, decode_s=0.0,
                    timings={"setup_s": setup_s, "decode_s": 0.0}, misses=fetch.misses)
            cache = decode_cache(self.model, fetch.payloads,
                                 tail.kv if use_tail and tail is not None else None)
            self._requests.hold(request_id, cache)
            have = n if use_tail else resume
            last = self._chunk_loop.run(tokens, have, cache, check)
            if first_token is None:
                assert last is not None
                first_token = pick_token(last, sampling, 0)
            t_ready = time.perf_counter()
            out, logits = self._token_loop.run(cache, first_token, sampling, check,
                                           return_logits=return_logits, on_token=on_token)
            t_end = time.perf_counter()
        finally:
            self._requests.end(request_id)
        return DecodeResult(
            request_id=request_id, output_token_ids=out, fetched_tokens=resume,
            recomputed_tokens=n - have, sources=fetch.sources, bytes_fetched=fetch.bytes_fetched,
            decode_s=t_end - t_ready,
            timings={"setup_s": t_ready - t0, "decode_s": t_end - t_ready},
            misses=fetch.misses, logits=logits)

    # -- both in one place --------------------------------------------------------------------

    def generate(self, token_ids: TokenIds, *, request_id: str = "generate",
                 sampling: SamplingParams | None = None, use_cache: bool = True,
                 return_logits: bool = False, cache_salt: str | None = None,
                 on_token: Callable[[int], None] | None = None
                 ) -> tuple[PrefillResult, DecodeResult]:
        """Prefill then decode on the prefill's own KV (no fetch): the local-KV path."""
        sampling = sampling or SamplingParams()
        deadline = self._requests.begin(request_id)
        try:
            pre, cache = self._prefill(token_ids, sampling, request_id, use_cache, deadline,
                                       cache_salt)
            if sampling.max_new_tokens == 0:  # a warm-up: publishing is its whole job
                self.wait_published(request_id)
            if on_token is not None and sampling.max_new_tokens:
                on_token(pre.first_token)  # streamed at its time to first token
            t0 = time.perf_counter()
            out, logits = self._token_loop.run(
                cache, pre.first_token, sampling,
                partial(self._requests.check, request_id, deadline),
                return_logits=return_logits, on_token=on_token)
            decode_s = time.perf_counter() - t0
        finally:
            self._requests.end(request_id)
        if not return_logits:
            pre.logits = None
        dec = DecodeResult(request_id=request_id, output_token_ids=out,
                           fetched_tokens=0, recomputed_tokens=0, sources={}, bytes_fetched=0,
                           decode_s=decode_s, timings={"decode_s": decode_s}, logits=logits)
        return pre, dec
