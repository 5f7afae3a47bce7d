"""The prefill/decode engine: exact KV reuse over any ``KVStore`` (docs/design.md §4).

Exact reuse rests on one rule: every token's KV has the numerics of the canonical computation,
the prompt in chunks of ``prefill_chunk_tokens`` counted from token 0, each chunk's rows
attending over the keys up to the chunk's end. A prompt's last, partial chunk gets those
numerics by padding its keys to the chunk's end (``kvstore.workers.model.attention``) and its rows
to one of the piece sizes the probe verified (``kvstore.workers.engine.reuse_policy``), so every
full block of every prompt is
canonical and is published:

    tokens  |--- chunk 0 ---|--- chunk 1 ---|--- chunk 2 ---|-- chunk 3 (partial) --|
    blocks  |b0 |b1 |b2 |b3 |b4 |b5 |b6 |b7 |b8 |b9 |b10|b11|b12|b13|  tail   (padded)
            <---------------- published: every full block ----------->  private

A hit is used up to the last block it covers where the probe found pieces smaller than a chunk
exact (cached rows are recomputed only where a passing piece size would cross the chunk's end),
else up to the last chunk boundary; the model resumes there with exactly the KV a cold run has.
Hence a cached run and a ``use_cache=False`` run do the same arithmetic and their logits and
tokens are bitwise equal. A Miss (rejected block, holder gone) only moves the resume point back:
never a failure, never wrong KV. The tail (the last, partial block) travels to decode privately
(``TailKV``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvstore import metrics
from kvstore.api import KVStore, TokenIds
from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError, KVStoreError, RequestCancelled
from kvstore.keys import BlockHasher
from kvstore.workers.engine.background_publisher import BackgroundPublisher
from kvstore.workers.engine.block_io import BlockIO, Fetch
from kvstore.workers.engine.paged_kv import gather_blocks, scatter_blocks
from kvstore.workers.engine.results import DecodeResult, PrefillResult, TailKV
from kvstore.workers.engine.reuse_policy import ReusePolicy, choose_policy
from kvstore.workers.engine.tenants import TenantHashers
from kvstore.workers.model.causal_lm import CausalLM
from kvstore.workers.model.sampling import SamplingParams, pick_token


class Engine:
    """Prefill and decode for one model over one store (``None``: no store at all).

    ``data_key`` is the cluster's data secret (``security.data_key``, bytes): every tenant's
    namespace is then keyed, so its keys cannot be precomputed from outside and a block is
    used only if its MAC shows a holder of that tenant's key wrote it (planted KV is a miss,
    recomputed). ``tenant_key`` instead (a tenant's own client, ``kvstore.security.data_keys.
    tenant_key``): the same keyed namespaces, for ``worker.cache_salt``'s tenant only. Neither
    (the embedded default): public roots and xxh3 checksums.
    """

    def __init__(self, model: CausalLM, store: KVStore | None, config: WorkerConfig, *,
                 data_key: bytes | None = None, tenant_key: bytes | None = None) -> None:
        self.model = model
        self.config = config
        self.block_size = config.block_size
        self.chunk_tokens = config.prefill_chunk_tokens
        self.policy: ReusePolicy = choose_policy(config.reuse, model, config.block_size,
                                                 config.prefill_chunk_tokens)
        # KV of an approximate policy must never reach a worker that promises bitwise reuse.
        self._tenants = TenantHashers(model, config.block_size, config.cache_salt,
                                      "" if self.policy.exact else "\x00reuse=block",
                                      data_key=data_key, tenant_key=tenant_key)
        self.hasher = self._tenants.default
        self.namespace = self.hasher.namespace
        metrics.observe_reuse_policy(self.policy.as_dict())
        self._lock = threading.Lock()
        # One model forward at a time: a replica serving several requests (a threaded actor)
        # interleaves them step by step instead of splitting its torch threads between them.
        self._forward_lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._active: dict[str, DynamicCache | None] = {}
        self.device = model.device
        self.io = BlockIO(store, config, model.device)

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

    # -- request lifecycle ------------------------------------------------------------------

    @property
    def num_active(self) -> int:
        """Requests holding KV right now (0 after every request ends, cancelled or not)."""
        with self._lock:
            return len(self._active)

    def cancel(self, request_id: str) -> None:
        """Ask a running request to stop; it raises RequestCancelled and releases its KV."""
        with self._lock:
            self._cancelled.add(request_id)

    def _begin(self, request_id: str) -> float:
        with self._lock:
            if request_id in self._active:
                raise ConfigError(f"request id {request_id!r} is already running")
            self._active[request_id] = None
        return time.monotonic() + self.config.request_timeout_s

    def _end(self, request_id: str) -> None:
        with self._lock:
            self._active.pop(request_id, None)
            self._cancelled.discard(request_id)

    def _check(self, request_id: str, deadline: float) -> None:
        with self._lock:
            cancelled = request_id in self._cancelled
        if cancelled:
            raise RequestCancelled(f"request {request_id!r} was cancelled")
        if time.monotonic() > deadline:
            raise RequestCancelled(f"request {request_id!r} timed out after "
                                   f"{self.config.request_timeout_s}s (worker.request_timeout_s)")

    # -- shared steps -----------------------------------------------------------------------

    def _tokens(self, token_ids: TokenIds) -> list[int]:
        tokens = [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist")
                                   else token_ids)]
        if not tokens:
            raise ConfigError("the prompt is empty; give at least one token")
        vocab = self.model.shape.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        return tokens

    def publish_end(self, num_tokens: int) -> int:
        """Where the published blocks of a prompt of ``num_tokens`` end."""
        unit = self.block_size if self.policy.publish == "block" else self.chunk_tokens
        return num_tokens // unit * unit

    def resume_point(self, cached: int, num_tokens: int) -> int:
        """Where computing starts when the KV of the first ``cached`` tokens (whole blocks) is at
        hand: ``cached`` itself, or earlier where the first piece's size reaches back (already
        cached rows are then recomputed, bitwise the same), or the chunk's start."""
        chunk, bs = self.chunk_tokens, self.block_size
        if cached >= num_tokens:
            return num_tokens
        if self.policy.mode == "chunk":
            return cached // chunk * chunk
        chunk_end = (cached // chunk + 1) * chunk
        start = cached
        while True:
            size = self.policy.piece_size(min(chunk_end, num_tokens) - start)
            if start <= chunk_end - size:
                return start
            start = (chunk_end - size) // bs * bs

    def _run_chunks(self, tokens: list[int], start: int, cache: DynamicCache,
                    request_id: str, deadline: float) -> torch.Tensor | None:
        """Tokens ``[start, n)`` on top of ``cache``, chunk by chunk, with each chunk's numerics.

        ``start`` comes from ``resume_point``. Each piece (the rest of a chunk) attends over keys
        padded to its chunk's end and runs with the policy's piece size, dummy rows filling it.
        Only the last chunk's logits come to the host: chunks queue on the device back to back.
        """
        logits = None
        pos, n = start, len(tokens)
        while pos < n:
            self._check(request_id, deadline)
            chunk_end = (pos // self.chunk_tokens + 1) * self.chunk_tokens
            end = min(chunk_end, n)
            with self._forward_lock:
                if self.policy.pad_keys or end == chunk_end:
                    logits = self.model.forward(tokens[pos:end], cache, pad_keys_to=chunk_end,
                                                pad_rows_to=self.policy.piece_size(end - pos),
                                                to_host=False)
                else:  # the chunk-only policy's partial last chunk, as is (never published)
                    logits = self.model.forward(tokens[pos:end], cache, to_host=False)
            pos = end
        return None if logits is None else logits.to("cpu")

    def _continue(self, cache: DynamicCache, first_token: int, sampling: SamplingParams,
                  request_id: str, deadline: float, return_logits: bool,
                  on_token: Callable[[int], None] | None = None
                  ) -> tuple[list[int], list[torch.Tensor]]:
        """Generate after the first token, one token per step (none for a warm-up).

        ``on_token`` sees each token after the first as soon as it is picked (streaming).
        """
        all_logits: list[torch.Tensor] = []
        if sampling.max_new_tokens == 0:
            return [], all_logits
        out = [first_token]
        while len(out) < sampling.max_new_tokens and out[-1] not in sampling.stop_token_ids:
            self._check(request_id, deadline)
            with self._forward_lock:
                logits = self.model.forward([out[-1]], cache)
            if return_logits:
                all_logits.append(logits)
            out.append(pick_token(logits, sampling, len(out)))
            if on_token is not None:
                on_token(out[-1])
        return out, all_logits

    # -- prefill ----------------------------------------------------------------------------

    def _compute(self, fetch: Fetch, tokens: list[int], request_id: str, deadline: float
                 ) -> tuple[int, DynamicCache, torch.Tensor]:
        """The prompt's KV from the fetched blocks on, and its last logits (on the host: the
        device work is done when this returns)."""
        resume = len(fetch.payloads) * self.block_size
        cache = self.model.cache_from_kv(*scatter_blocks(fetch.payloads)) if fetch.payloads \
            else self.model.new_cache()
        with self._lock:
            self._active[request_id] = cache
        logits = self._run_chunks(tokens, resume, cache, request_id, deadline)
        assert logits is not None
        return resume, cache, logits

    def _prefill(self, token_ids: TokenIds, sampling: SamplingParams, request_id: str,
                 use_cache: bool, deadline: float, cache_salt: str | None = None
                 ) -> tuple[PrefillResult, DynamicCache]:
        t0 = time.perf_counter()
        tokens = self._tokens(token_ids)
        n, bs = len(tokens), self.block_size
        hasher = self.hasher_for(cache_salt)
        namespace = hasher.namespace
        keys = hasher.block_keys(tokens)
        use_store = use_cache and self.store is not None
        hit = self.io.lookup(namespace, keys) if use_store else 0
        # The last token always runs (its logits give the first token), so never resume at n.
        # Blocks may arrive before their verdicts (a same-node GPU read): compute at once,
        # and keep the result only if every block used was good.
        fetch = self.io.fetch(namespace, tokens, keys, min(hit, (n - 1) // bs), early=True)
        fetch.keep(self.resume_point(len(fetch.payloads) * bs, n) // bs)
        t_fetch = time.perf_counter()
        resume, cache, logits = self._compute(fetch, tokens, request_id, deadline)
        t_verify = time.perf_counter()
        if fetch.confirm is not None:
            good = fetch.confirm()
            if good < len(fetch.payloads):  # a block used was rejected: redo without it
                fetch.keep(self.resume_point(good * bs, n) // bs)
                resume, cache, logits = self._compute(fetch, tokens, request_id, deadline)
        t_verify = time.perf_counter() - t_verify
        first = pick_token(logits, sampling, 0)
        ttft = time.perf_counter() - t0
        published_end = self.publish_end(n)
        num_new, prefix_blocks = 0, 0
        if use_store and self.store is not None:
            # Blocks already cached past the resume point are skipped, unless a fetch failed:
            # then everything from the resume point is re-offered to replace the bad copy.
            first_new = resume // bs if fetch.misses else max(resume // bs,
                                                              min(hit, published_end // bs))
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
        deadline = self._begin(request_id)
        try:
            sampling = sampling or SamplingParams()
            result, _ = self._prefill(token_ids, sampling, request_id, use_cache, deadline,
                                      cache_salt)
            if sampling.max_new_tokens == 0:  # a warm-up: publishing is its whole job
                self.wait_published(request_id)
        finally:
            self._end(request_id)
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
        deadline = self._begin(request_id)
        try:
            t0 = time.perf_counter()
            tokens = self._tokens(token_ids)
            n, bs = len(tokens), self.block_size
            # What the prefill published; without a prefill in front the last token must run.
            whole = self.publish_end(n) if first_token is not None else \
                min(self.publish_end(n), (n - 1) // bs * bs)
            hasher = self.hasher_for(cache_salt)
            keys = hasher.block_keys(tokens[:whole])
            if use_cache and wait_for_blocks and self.store is not None:
                self.io.wait_visible(hasher.namespace, keys[:wait_for_blocks],
                                   time.monotonic() + self.config.publish_wait_s)
            fetch = self.io.fetch(hasher.namespace, tokens, keys, len(keys) if use_cache else 0)
            if not (tail is not None and len(fetch.payloads) * bs == whole == tail.start):
                fetch.keep(self.resume_point(len(fetch.payloads) * bs, n) // bs)  # must run
            resume = len(fetch.payloads) * bs
            if sampling.max_new_tokens == 0:  # a warm-up: fetching the blocks is the whole job
                setup_s = time.perf_counter() - t0
                return DecodeResult(
                    request_id=request_id, output_token_ids=[], fetched_tokens=resume,
                    recomputed_tokens=0, sources=fetch.sources,
                    bytes_fetched=fetch.bytes_fetched, decode_s=0.0,
                    timings={"setup_s": setup_s, "decode_s": 0.0}, misses=fetch.misses)
            keys_kv: list[torch.Tensor] = []
            values_kv: list[torch.Tensor] = []
            if fetch.payloads:
                keys_kv, values_kv = gather_blocks(fetch.payloads)
            use_tail = tail is not None and resume == whole and tail.start == whole
            if use_tail:
                assert tail is not None
                kv = tail.kv.to(self.device)
                tail_k = [kv[layer, 0] for layer in range(kv.shape[0])]
                tail_v = [kv[layer, 1] for layer in range(kv.shape[0])]
                keys_kv = [torch.cat(p) for p in zip(keys_kv, tail_k, strict=True)] \
                    if keys_kv else tail_k
                values_kv = [torch.cat(p) for p in zip(values_kv, tail_v, strict=True)] \
                    if values_kv else tail_v
            cache = self.model.cache_from_kv(keys_kv, values_kv) if keys_kv \
                else self.model.new_cache()
            with self._lock:
                self._active[request_id] = cache
            have = n if use_tail else resume
            last = self._run_chunks(tokens, have, cache, request_id, deadline)
            if first_token is None:
                assert last is not None
                first_token = pick_token(last, sampling, 0)
            t_ready = time.perf_counter()
            out, logits = self._continue(cache, first_token, sampling, request_id, deadline,
                                         return_logits, on_token)
            t_end = time.perf_counter()
        finally:
            self._end(request_id)
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
        deadline = self._begin(request_id)
        try:
            pre, cache = self._prefill(token_ids, sampling, request_id, use_cache, deadline,
                                       cache_salt)
            if sampling.max_new_tokens == 0:  # a warm-up: publishing is its whole job
                self.wait_published(request_id)
            if on_token is not None and sampling.max_new_tokens:
                on_token(pre.first_token)  # streamed at its time to first token
            t0 = time.perf_counter()
            out, logits = self._continue(cache, pre.first_token, sampling, request_id, deadline,
                                         return_logits, on_token)
            decode_s = time.perf_counter() - t0
        finally:
            self._end(request_id)
        if not return_logits:
            pre.logits = None
        dec = DecodeResult(request_id=request_id, output_token_ids=out,
                           fetched_tokens=0, recomputed_tokens=0, sources={}, bytes_fetched=0,
                           decode_s=decode_s, timings={"decode_s": decode_s}, logits=logits)
        return pre, dec
