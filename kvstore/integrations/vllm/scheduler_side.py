"""The connector's scheduler side: how much of a prompt kvstore holds, and each step's plan.

vLLM asks, per new request, how many tokens beyond its own prefix-cache hit the connector can
supply; the answer is the request's longest prefix of full blocks in kvstore, up to the last
full block before the prompt's final token (vLLM must compute at least one token to sample
from), as its own prefix cache reuses. Once vLLM has allocated blocks, those tokens become a load
for the worker side; every full prompt block computed from then on (and any that vLLM had in
its own cache but kvstore lacks) becomes a save, planned in the step whose forward completes it.
A lookup that fails (a cluster gone) counts as no hit: the request computes its prompt. Under
tensor parallelism the prompt is looked up in each KV-head slice's namespace, a hit reaches as
far as every slice holds it, and each slice's blocks are planned on their own (``shards``).

A load is synchronous (fetched and written during the forward that needs it, layer by layer) or
asynchronous (the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` while others go on; the
worker reports it through ``get_finished``). ``load_mode`` ``auto`` picks per request: a request
alone gets the synchronous path, which adds no scheduler step to its time to first token; one
that arrives while others are in flight gets the asynchronous one, so its fetch never stalls
their decoding.

A save-only instance (``kv_producer``) still looks the prompt up, so it never gathers and puts
again the blocks kvstore already holds (a shared system prompt, every request). A request whose
``kv_transfer_params`` carry ``{"kvstore_bypass": true}`` neither loads nor saves: the
reference run of ``kvstore serve``'s ``bypass_cache`` through the same engine. Behind vLLM's
own P/D proxies a prefill leg's answer says how many blocks it published and the decode leg
waits for them (``handoff``).

With ``save_generated`` (the instance's default; a request's ``kv_transfer_params``
``{"kvstore_save_generated": true/false}`` overrides it) the blocks a request's generated tokens
fill are saved too, as each fills: a conversation's next turn, whose prompt holds this answer,
then loads it on any instance. Off by default, as in LMCache: those blocks' KV was computed a
token at a time, which on some devices differs in its last bits from the prefill that a run
with the cache bypassed computes (on vLLM's CPU backend it was measured bitwise equal).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.integrations.vllm.handoff import PublishWait, blocks_to_wait_for, prefill_answer
from kvstore.integrations.vllm.plans import BlockTransfer, StepPlan
from kvstore.keys import BlockHasher, Namespace

log = logging.getLogger(__name__)


@dataclass
class _Chain:
    """A request's blocks in one KV-head slice's namespace (the only one without tensor
    parallelism): their keys, and what the lookup said of them."""

    keys: list[bytes]
    parents: list[bytes]
    holders: list[list[str]] | None = None  # per hit block
    lease: Any = None  # the lookup's lease on this host's node, until a load takes it


@dataclass
class _Tracked:
    """A request the scheduler side follows until it finishes."""

    salt: str
    weights: str  # the instance's weights version when its keys were made
    tokens: list[int]
    chains: list[_Chain]  # one per KV-head slice (``SchedulerSide.shards``)
    hit_blocks: int  # kvstore's prefix, in blocks
    saved_blocks: int  # blocks [0, saved_blocks) are in kvstore or planned: kvstore's prefix
    # first, so blocks vLLM had in its own cache but kvstore lacks are saved too (resident)
    local_blocks: int = 0  # vLLM's own prefix-cache hit, in blocks
    load_blocks: int = 0  # blocks to load from kvstore past the local hit
    load_async: bool = False
    block_ids: list[int] | None = None
    sources: dict[str, int] | None = None  # the load's tokens by where they lie (hit_sources)
    request: Any = None  # vLLM's request, whose tokens grow as it generates (save_generated)

    @property
    def num_blocks(self) -> int:
        return len(self.chains[0].keys) if self.chains else 0


LOAD_MODES = ("auto", "sync", "async")


class SchedulerSide:
    """Lookups and step plans; ``namespace_of(salt, weights)`` makes a request's namespace
    (``namespace_of(salt, weights, shard)`` each KV-head slice's, with several)."""

    def __init__(self, store: Any, namespace_of: Any, block_size: int, save: bool = True,
                 load: bool = True, load_mode: str = "auto",
                 salt_for: Callable[[str | None], str | None] | None = None,
                 shards: int = 1, save_generated: bool = False,
                 publish_wait_s: float = 10.0) -> None:
        """``salt_for``: a request's namespace salt from its ``cache_salt``, None where the
        instance may not cache it (``tenancy.Tenancy.salt_for``; default: the salt itself).
        ``shards``: the KV-head slices the instance's tensor-parallel ranks hold
        (``namespace.ModelGeometry.num_shards``): a prefix is a hit only as far as every
        slice holds it, and each slice's blocks travel on their own. ``save_generated``: save
        the blocks generated tokens fill, unless a request says otherwise.
        ``publish_wait_s``: how long a decode leg waits for its prefill's blocks (``handoff``)."""
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode {load_mode!r}: expected one of {', '.join(LOAD_MODES)}")
        self.store = store
        self.namespace_of = namespace_of
        self.block_size = block_size
        self.save, self.load = save, load
        self.load_mode = load_mode
        self.salt_for = salt_for or (lambda salt: salt or "")
        self.shards = shards
        self.save_generated = save_generated
        self._uncached_salts: set[str] = set()
        self.weights = ""  # the weights version: "" until vLLM resets the cache (reset)
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: list[str] = []
        self._publish_wait = PublishWait(publish_wait_s)

    def reset(self) -> None:
        """vLLM reset its caches, as it does after updating the weights in place: from now
        on look up and save under a fresh weights version (``namespace.weights_fingerprint``).
        Requests already tracked keep the version their keys were made under, so KV computed
        before the reset is saved where only the old weights' requests find it."""
        self.weights = secrets.token_hex(8)
        log.info("kvstore: vLLM reset its caches (weights updated in place?): new requests "
                 "use weights version %s and share no block made before", self.weights)

    def warm_up(self) -> None:
        """One lookup now, so the first request does not pay for the index's connection."""
        try:
            self.store.lookup_prefix(self.namespace_of(""), [bytes(32)])
        except Exception as exc:  # the store's, Ray's or gRPC's: a miss, never a failure
            log.warning("kvstore lookup failed at start (requests compute their prompts until "
                        "it answers): %s", exc)

    # -- lookups -------------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int
                       ) -> tuple[int | None, bool]:
        """Tokens kvstore can supply beyond vLLM's own ``num_computed_tokens``, and whether
        they load asynchronously; None while a decode leg waits for its prefill's blocks
        (vLLM asks again at a later step)."""
        others = len(self._requests) - (request.request_id in self._requests)
        if not self._prefill_published(request, num_computed_tokens, alone=not others):
            return None, False
        tracked = self._track(request, num_computed_tokens)
        tracked.local_blocks = num_computed_tokens // self.block_size
        extra = max(0, tracked.hit_blocks * self.block_size - num_computed_tokens)
        if not self.load or not extra:
            return 0, False
        tracked.load_async = self.load_mode == "async" or (self.load_mode == "auto"
                                                           and others > 0)
        return extra, tracked.load_async

    def _prefill_published(self, request: Any, num_computed_tokens: int, *, alone: bool
                           ) -> bool:
        """False while a decode leg's prefill blocks are not all in kvstore yet (each look
        is a fresh lookup), up to ``publish_wait_s``; True for any other request. ``alone``:
        no other request is tracked (``PublishWait.due``)."""
        wanted = blocks_to_wait_for(getattr(request, "kv_transfer_params", None))
        if not (self.load and wanted):
            return True
        if not self._publish_wait.due(request.request_id, alone=alone):
            return False
        usable = (len(request.prompt_token_ids or []) - 1) // self.block_size
        tracked = self._track(request, num_computed_tokens)
        if not tracked.num_blocks:  # bypassed or another tenant's: nothing of it comes
            self._publish_wait.forget(request.request_id)
            return True
        held = max(tracked.hit_blocks, num_computed_tokens // self.block_size)
        if self._publish_wait.ready(request.request_id, held, min(wanted, usable)):
            return True
        self._release(self._requests.pop(request.request_id))  # looked up again next time
        return False

    def _track(self, request: Any, num_computed_tokens: int = 0) -> _Tracked:
        known = self._requests.get(request.request_id)
        if known is not None:
            return known
        prompt = request.prompt_token_ids or []
        # vLLM's is a list of ints: copied as it is (converting each token again is work on
        # every warm request's path before the forward); anything else token by token
        tokens = list(prompt) if type(prompt) is list else [int(t) for t in prompt]
        salt = self.salt_for(request.cache_salt)
        params = getattr(request, "kv_transfer_params", None)
        bypass = isinstance(params, dict) and bool(params.get("kvstore_bypass"))
        if bypass or salt is None:  # bypassed or another tenant's: never looked up or saved
            if not bypass and request.cache_salt not in self._uncached_salts:
                self._uncached_salts.add(request.cache_salt)
                log.warning("cache_salt %r is not this instance's tenant: its requests are "
                            "served without kvstore", request.cache_salt)
            tracked = _Tracked("", self.weights, tokens, [_Chain([], [])], hit_blocks=0,
                               saved_blocks=0)
            self._requests[request.request_id] = tracked
            return tracked
        usable = (len(tokens) - 1) // self.block_size  # one token is always computed
        local = num_computed_tokens // self.block_size
        # A load past vLLM's own hit asks this host's node for a lease, not a yes/no: the
        # same round trip, and the worker then reads under it without asking again.
        leasing = self.load and usable > local and hasattr(self.store, "lease_prefix")
        asking = (self.load and usable > 0) or (self.save and len(tokens) >= self.block_size)
        chains, held = [], None
        for namespace in self._namespaces(salt, self.weights):
            keys = [bytes(k) for k in BlockHasher(namespace).block_keys(tokens)]
            chain = _Chain(keys, [namespace.root, *keys[:-1]] if keys else [])
            chains.append(chain)
            if not asking or held == 0:
                held = 0
                continue
            wanted = keys if self.save else keys[:usable]  # a saver asks for every block
            try:
                if leasing:
                    found, chain.lease = self.store.lease_prefix(namespace, wanted)
                else:
                    found = self.store.lookup_prefix(namespace, wanted)
                chain.holders = found.holders
                held = found.num_blocks if held is None else min(held, found.num_blocks)
            except Exception as exc:  # the store's, Ray's or gRPC's: a miss, never a failure
                log.warning("kvstore lookup failed, computing the prompt: %s", exc)
                held = 0
        held = held or 0
        hit = min(held, usable) if self.load else 0
        for chain in chains:
            chain.holders = None if chain.holders is None else chain.holders[:hit]
        tracked = _Tracked(salt, self.weights, tokens, chains, hit_blocks=hit,
                           saved_blocks=max(held, hit))
        generated = params.get("kvstore_save_generated") if isinstance(params, dict) else None
        if self.save and (self.save_generated if generated is None else bool(generated)):
            tracked.request = request
        if hit <= local:
            self._release(tracked)  # nothing to load: no read will use it
        self._requests[request.request_id] = tracked
        return tracked

    def _namespaces(self, salt: str, weights: str) -> list[Namespace]:
        """A request's namespace, one per KV-head slice."""
        if self.shards == 1:
            return [self.namespace_of(salt, weights)]
        return [self.namespace_of(salt, weights, shard) for shard in range(self.shards)]

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks; ``num_external_tokens`` of them load from kvstore."""
        tracked = self._track(request)
        tracked.block_ids = list(block_ids)
        tracked.load_blocks = num_external_tokens // self.block_size
        if tracked.load_blocks:
            tracked.sources = self._sources(tracked)
            self._pending_loads.append(request.request_id)
        else:
            self._release(tracked)

    def hit_sources(self, request_id: str) -> dict[str, int]:
        """The tokens a request loads from kvstore, by where they lie (vLLM's cache-hit
        sources): ``disk`` (this host's node's disk tier), ``host`` (its memory), ``p2p``
        (another node). Empty when it loads nothing."""
        tracked = self._requests.get(request_id)
        return dict(tracked.sources or {}) if tracked is not None else {}

    def _sources(self, t: _Tracked) -> dict[str, int]:
        """Where the blocks to load lie, as the lookup and its lease said: the worker reads
        this host's node first, so a block held here and elsewhere counts as here."""
        first = t.chains[0]  # the slices' blocks lie alike: their saves went the same way
        info = getattr(first.lease, "info", None)  # a HeldLease's; the rest only passes it on
        on_disk = {loc.key for loc in getattr(info, "locations", ()) if loc.path}
        here = getattr(self.store, "local_node_id", None)  # None: an embedded LocalStore
        counts: dict[str, int] = {}
        for i in range(t.local_blocks, t.local_blocks + t.load_blocks):
            holders = first.holders[i] if first.holders is not None \
                and i < len(first.holders) else []
            source = "disk" if first.keys[i] in on_disk else (
                "host" if here is None or here in holders else "p2p")
            counts[source] = counts.get(source, 0) + self.block_size
        return counts

    # -- plans ---------------------------------------------------------------------------
    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """The loads planned since the last step, and the saves this step's forward allows."""
        plan = StepPlan()
        for rid in self._pending_loads:
            t = self._requests.get(rid)
            if t is None or t.block_ids is None:
                continue
            plan.loads.extend(self._loads(rid, t))
        self._pending_loads.clear()
        if not self.save:
            return plan
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._requests.get(new.req_id)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                self._plan_save(plan, new.req_id, t, new.num_computed_tokens
                                + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._requests.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if rid in cached.resumed_req_ids or t.block_ids is None:
                    t.block_ids = list(new_ids[0])
                else:
                    t.block_ids.extend(new_ids[0])
            self._plan_save(plan, rid, t, cached.num_computed_tokens[i] + scheduled.get(rid, 0))
        return plan

    def _plan_save(self, plan: StepPlan, rid: str, t: _Tracked, computed_after: int) -> None:
        if t.request is not None:
            self._extend(t, computed_after)
        done = min(computed_after // self.block_size, t.num_blocks)
        if t.block_ids is None or done <= t.saved_blocks:
            return
        done = min(done, len(t.block_ids))
        plan.saves.extend(self._transfers(rid, t, t.saved_blocks, done))
        t.saved_blocks = done

    def _extend(self, t: _Tracked, computed_after: int) -> None:
        """Keys for the blocks generated tokens filled, as far as this step's forward computes
        them. Only tokens vLLM has accepted count: a speculative step computes positions past
        them whose draft tokens may yet be rejected."""
        bs = self.block_size
        accepted = t.request.all_token_ids
        full = min(computed_after, len(accepted)) // bs
        if full <= t.num_blocks:
            return
        start = t.num_blocks
        tokens = [int(x) for x in accepted[start * bs:full * bs]]
        t.tokens = t.tokens[:start * bs] + tokens
        for chain, namespace in zip(t.chains, self._namespaces(t.salt, t.weights), strict=True):
            parent = chain.keys[-1] if chain.keys else namespace.root
            keys = [bytes(k) for k in BlockHasher(namespace).block_keys(tokens, parent=parent)]
            chain.parents += [parent, *keys[:-1]]
            chain.keys += keys

    def _transfers(self, rid: str, t: _Tracked, start: int, end: int) -> list[BlockTransfer]:
        """Blocks ``[start, end)`` of a request, one transfer per KV-head slice."""
        assert t.block_ids is not None
        bs = self.block_size
        tokens = [t.tokens[i * bs:(i + 1) * bs] for i in range(start, end)]
        return [BlockTransfer(rid, t.salt, chain.keys[start:end], chain.parents[start:end],
                              tokens, t.block_ids[start:end], weights=t.weights, shard=shard)
                for shard, chain in enumerate(t.chains)]

    def _loads(self, rid: str, t: _Tracked) -> list[BlockTransfer]:
        start, end = t.local_blocks, t.local_blocks + t.load_blocks
        transfers = self._transfers(rid, t, start, end)
        for transfer, chain in zip(transfers, t.chains, strict=True):
            transfer.asynchronous = t.load_async
            if chain.holders is not None and len(chain.holders) >= end:
                transfer.holders = chain.holders[start:end]
            transfer.lease, chain.lease = chain.lease, None  # the worker reads, then ends it
        return transfers

    def _release(self, t: _Tracked) -> None:
        """End a lookup's leases that no load will read under."""
        for chain in t.chains:
            lease, chain.lease = chain.lease, None
            if lease is not None:
                try:
                    self.store.release_lease(lease)
                except Exception as exc:  # it runs to its TTL: memory held a while
                    log.debug("releasing a lookup's lease failed: %s", exc)

    def finished(self, request_id: str, params: Any = None) -> dict[str, Any] | None:
        """The request ended; the ``kv_transfer_params`` its response carries: a prefill
        leg's (its ``params`` asked with ``do_remote_decode``) says how many of its prompt's
        blocks are in kvstore or on their way (``handoff.prefill_answer``)."""
        tracked = self._requests.pop(request_id, None)
        self._publish_wait.forget(request_id)
        if tracked is None:
            return None
        self._release(tracked)
        if not self.save:
            return None
        return prefill_answer(params, min(tracked.saved_blocks,
                                          len(tracked.tokens) // self.block_size))
