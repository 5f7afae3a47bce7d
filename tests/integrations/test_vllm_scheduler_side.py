"""The connector's scheduler side against a real LocalStore: what it tells vLLM it can load,
and which blocks each step loads and saves. vLLM's request and scheduler-output objects are
stood in for by plain objects with the fields the connector reads."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvstore.api import BlockPut
from kvstore.client.local_store import LocalStore
from kvstore.errors import NodeUnavailable
from kvstore.integrations.vllm.namespace import weights_fingerprint
from kvstore.integrations.vllm.scheduler_side import SchedulerSide
from kvstore.keys import BlockHasher, Namespace

BS = 4


def ns(salt: str, weights: str = "") -> Namespace:
    return Namespace(weights_fingerprint("f" * 64, weights), "float32", BS, 1, 1, 2, salt)


def publish(store: LocalStore, tokens: list[int], salt: str = "",
            space: Namespace | None = None) -> list[bytes]:
    """Put ``tokens``' full blocks in namespace ``space`` (default: ``ns(salt)``); their keys."""
    space = space or ns(salt)
    keys = [bytes(k) for k in BlockHasher(space).block_keys(tokens)]
    parents = [space.root, *keys[:-1]]
    store.batch_put(space, [BlockPut(k, p, tokens[i * BS:(i + 1) * BS],
                                     torch.zeros(1, 2, BS, 1, 2))
                            for i, (k, p) in enumerate(zip(keys, parents, strict=True))])
    return keys


def request(rid: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, cache_salt=salt)


def step(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[(ids,) if ids else None for _, ids, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=scheduled or {})


def test_a_cached_prefix_loads_to_its_last_full_block_and_the_rest_is_saved() -> None:
    store = LocalStore()
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    publish(store, prompt[:8])  # kvstore holds 2 blocks
    side = SchedulerSide(store, ns, BS)
    req = request("r", prompt)
    assert side.matched_tokens(req, 0) == (8, False)  # alone: loaded in its forward
    side.allocated(req, [10, 11, 12, 13], 8)
    plan = side.step_plan(step(new=[("r", [10, 11, 12, 13], 8)], scheduled={"r": 6}))
    [load] = plan.loads
    assert load.block_ids == [10, 11] and load.keys == [bytes(k) for k in
                                                        BlockHasher(ns("")).block_keys(prompt[:8])]
    assert load.tokens == [prompt[:4], prompt[4:8]]
    assert load.holders == [["local"], ["local"]]  # the lookup's: the worker skips a query
    [save] = plan.saves  # the forward computes tokens 8..13: block 2 completes
    assert save.block_ids == [12] and save.tokens == [prompt[8:12]]
    assert save.parents == [load.keys[-1]]
    again = side.step_plan(step(cached=[("r", None, 14)], scheduled={"r": 1}))
    assert again.loads == [] and again.saves == []  # nothing new completes, nothing twice


def test_a_whole_block_prompt_keeps_one_token_to_compute() -> None:
    store = LocalStore()
    prompt = list(range(8))
    publish(store, prompt)
    side = SchedulerSide(store, ns, BS)
    assert side.matched_tokens(request("r", prompt), 0) == (4, False)  # not 8: one to sample


def test_vllms_own_hit_is_not_loaded_again_and_salts_do_not_share() -> None:
    store = LocalStore()
    prompt = list(range(50, 63))
    publish(store, prompt[:12], salt="a")
    side = SchedulerSide(store, ns, BS)
    assert side.matched_tokens(request("x", prompt, "a"), 4) == (8, False)
    assert side.matched_tokens(request("y", prompt, "b"), 0) == (0, False)
    assert side.matched_tokens(request("z", prompt, "a"), 12) == (0, False)


def test_blocks_vllm_had_but_kvstore_lacks_are_saved() -> None:
    side = SchedulerSide(LocalStore(), ns, BS)
    prompt = list(range(9))
    req = request("r", prompt)
    assert side.matched_tokens(req, 8) == (0, False)  # vLLM's own cache held 2 blocks
    side.allocated(req, [3, 4, 5], 0)
    plan = side.step_plan(step(new=[("r", [3, 4, 5], 8)], scheduled={"r": 1}))
    assert [s.block_ids for s in plan.saves] == [[3, 4]]


def test_a_failed_lookup_is_a_miss_and_roles_switch_sides_off() -> None:
    class Down:
        def lookup_prefix(self, namespace, keys):
            raise NodeUnavailable("the cluster went away")

    side = SchedulerSide(Down(), ns, BS)
    assert side.matched_tokens(request("r", list(range(20))), 0) == (0, False)
    store = LocalStore()
    publish(store, list(range(8)))
    producer = SchedulerSide(store, ns, BS, load=False)
    assert producer.matched_tokens(request("p", list(range(9))), 0) == (0, False)
    consumer = SchedulerSide(store, ns, BS, save=False)
    req = request("c", list(range(13)))
    consumer.allocated(req, [0, 1, 2, 3], consumer.matched_tokens(req, 0)[0])
    plan = consumer.step_plan(step(new=[("c", [0, 1, 2, 3], 8)], scheduled={"c": 5}))
    assert len(plan.loads) == 1 and plan.saves == []


def test_auto_loads_a_lone_request_in_its_forward_and_others_asynchronously() -> None:
    store = LocalStore()
    prompt = list(range(100, 114))
    publish(store, prompt[:8])
    side = SchedulerSide(store, ns, BS)
    first, second = request("a", prompt), request("b", prompt)
    assert side.matched_tokens(first, 0) == (8, False)
    assert side.matched_tokens(second, 0) == (8, True)  # "a" is in flight: b must not stall it
    side.allocated(second, [5, 6, 7, 8], 8)
    [load] = side.step_plan(step()).loads
    assert load.request_id == "b" and load.asynchronous and load.block_ids == [5, 6]
    side.allocated(second, [5, 6, 7, 8], 0)  # vLLM's second call, once the load is over
    assert side.step_plan(step()).loads == []
    side.finished("a")
    side.finished("b")
    assert side.matched_tokens(request("c", prompt), 0) == (8, False)
    forced = SchedulerSide(store, ns, BS, load_mode="async")
    assert forced.matched_tokens(request("d", prompt), 0) == (8, True)
    assert SchedulerSide(store, ns, BS, load_mode="sync").matched_tokens(
        request("e", prompt), 0) == (8, False)


def test_an_unknown_load_mode_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="load_mode 'eager'"):
        SchedulerSide(LocalStore(), ns, BS, load_mode="eager")


def test_a_producer_saves_only_what_kvstore_lacks() -> None:
    store = LocalStore()
    prompt = list(range(12))  # 3 full blocks, the last one ending at the last token
    publish(store, prompt[:8])
    producer = SchedulerSide(store, ns, BS, load=False)
    req = request("p", prompt)
    assert producer.matched_tokens(req, 0) == (0, False)  # it never loads
    producer.allocated(req, [7, 8, 9], 0)
    plan = producer.step_plan(step(new=[("p", [7, 8, 9], 0)], scheduled={"p": 12}))
    assert plan.loads == [] and [s.block_ids for s in plan.saves] == [[9]]


def test_a_bypassing_request_neither_loads_nor_saves() -> None:
    store = LocalStore()
    prompt = list(range(13))
    publish(store, prompt[:8])
    side = SchedulerSide(store, ns, BS)
    req = request("b", prompt)
    req.kv_transfer_params = {"kvstore_bypass": True}
    assert side.matched_tokens(req, 0) == (0, False)
    side.allocated(req, [0, 1, 2, 3], 0)
    plan = side.step_plan(step(new=[("b", [0, 1, 2, 3], 0)], scheduled={"b": 13}))
    assert plan.loads == [] and plan.saves == []


class LeasingStore:
    """A LocalStore whose lookups lease, as ClusterStore's ``lease_prefix`` does on this
    host's node; it records which leases are released."""

    def __init__(self, store: LocalStore) -> None:
        self.store, self.leased, self.released = store, 0, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def lease_prefix(self, namespace, keys):  # noqa: ANN001, ANN201 - ClusterStore's
        hit = self.store.lookup_prefix(namespace, keys)
        self.leased += 1
        return hit, (f"lease-{self.leased}" if hit.num_blocks else None)

    def release_lease(self, lease: str) -> None:
        self.released.append(lease)


def test_a_loads_lookup_lease_goes_to_the_worker_and_every_other_one_is_released() -> None:
    store = LeasingStore(LocalStore())
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    publish(store.store, prompt[:8])
    side = SchedulerSide(store, ns, BS)
    loaded = request("loaded", prompt)
    assert side.matched_tokens(loaded, 0) == (8, False)
    side.allocated(loaded, [10, 11, 12, 13], 8)
    [load] = side.step_plan(step(new=[("loaded", [10, 11, 12, 13], 8)],
                                 scheduled={"loaded": 6})).loads
    assert load.lease == "lease-1"
    side.finished("loaded")
    assert store.released == []  # the worker reads under it and ends it
    local = request("local", prompt)  # vLLM's own hit covers what kvstore holds
    assert side.matched_tokens(local, 8) == (0, False)
    assert store.released == ["lease-2"]
    refused = request("refused", prompt)  # vLLM allocates it no external tokens after all
    side.matched_tokens(refused, 0)
    side.allocated(refused, [20, 21, 22, 23], 0)
    assert store.released == ["lease-2", "lease-3"]
    aborted = request("aborted", prompt)  # finished before its load was planned
    side.matched_tokens(aborted, 0)
    side.finished("aborted")
    assert store.released == ["lease-2", "lease-3", "lease-4"]
    saver = SchedulerSide(store, ns, BS, load=False)  # a save-only instance never leases
    saver.matched_tokens(request("saved", prompt), 0)
    assert store.leased == 4


def test_after_a_reset_nothing_made_before_is_found_and_tracked_requests_keep_their_keys(
        ) -> None:
    """vLLM resets the connector's cache after updating the weights in place: the old
    weights' blocks must never load into the new ones, and KV an in-flight request computed
    under the old weights is saved where only the old weights' requests look."""
    store = LocalStore()
    prompt = list(range(100, 114))
    publish(store, prompt[:8])
    side = SchedulerSide(store, ns, BS)
    old = request("old", prompt)
    assert side.matched_tokens(old, 0) == (8, False)
    side.reset()
    assert side.weights and ns("", side.weights).root != ns("").root
    new = request("new", prompt)
    assert side.matched_tokens(new, 0) == (0, False)  # the old weights' blocks: not found
    side.allocated(old, [1, 2, 3, 4], 8)
    side.allocated(new, [5, 6, 7, 8], 0)
    plan = side.step_plan(step(new=[("old", [1, 2, 3, 4], 8), ("new", [5, 6, 7, 8], 0)],
                               scheduled={"old": 6, "new": 14}))
    [load] = plan.loads
    assert load.request_id == "old" and load.weights == ""  # its keys: the old namespace's
    saves = {s.request_id: s for s in plan.saves}
    assert saves["old"].weights == "" and saves["new"].weights == side.weights
    want = BlockHasher(ns("", side.weights)).block_keys(prompt)
    assert saves["new"].keys == [bytes(k) for k in want[:3]]
    side.reset()
    assert side.matched_tokens(request("later", prompt), 0) == (0, False)  # a fresh version


def sliced(salt: str, weights: str = "", shard: int = 0) -> Namespace:
    """The namespace of KV-head slice ``shard`` of a two-rank instance."""
    return Namespace(weights_fingerprint("f" * 64, weights), "float32", BS, 1, 1, 2, salt,
                     numerics=f"tp 2: kv heads {shard}-{shard} of 2")


def test_under_tensor_parallelism_a_prefix_is_a_hit_as_far_as_every_slice_holds_it() -> None:
    """Each rank's KV-head slice has its own keys and lease; the load reaches the last block
    that both slices hold, each slice's transfer goes to the ranks holding it, and every
    slice saves the rest."""
    store = LeasingStore(LocalStore())
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    first = publish(store.store, prompt[:12], space=sliced("", shard=0))  # 3 blocks
    second = publish(store.store, prompt[:8], space=sliced("", shard=1))  # only 2
    side = SchedulerSide(store, sliced, BS, shards=2)
    req = request("r", prompt)
    assert side.matched_tokens(req, 0) == (8, False)
    side.allocated(req, [10, 11, 12, 13, 14], 8)
    plan = side.step_plan(step(new=[("r", [10, 11, 12, 13, 14], 8)], scheduled={"r": 10}))
    loads = {t.shard: t for t in plan.loads}
    assert loads[0].keys == first[:2] and loads[1].keys == second
    assert loads[0].block_ids == loads[1].block_ids == [10, 11]
    assert {loads[0].lease, loads[1].lease} == {"lease-1", "lease-2"}  # one per slice
    saves = {t.shard: t for t in plan.saves}
    assert [len(saves[s].keys) for s in (0, 1)] == [2, 2]  # blocks 2 and 3, in each slice
    assert saves[1].parents[0] == second[-1] and saves[0].parents[0] == first[1]
    mine = plan.for_shard(1)
    assert mine.loads == [loads[1]] and mine.saves == [saves[1]]
    assert plan.for_shard(1, saves=False).saves == []  # a rank another rank saves for
    assert store.released == []


def test_under_tensor_parallelism_a_slice_that_lacks_the_prefix_is_a_miss() -> None:
    """Slice 0 holds the prefix, slice 1 nothing: no load, and slice 0's lease is released."""
    store = LeasingStore(LocalStore())
    prompt = list(range(200, 214))
    publish(store.store, prompt[:8], space=sliced("", shard=0))
    side = SchedulerSide(store, sliced, BS, shards=2)
    assert side.matched_tokens(request("r", prompt), 0) == (0, False)
    assert store.leased == 2 and store.released == ["lease-1"]


def generating(rid: str, prompt: list[int], **params: object) -> SimpleNamespace:
    """A request whose ``all_token_ids`` grows as vLLM's does when it generates."""
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, cache_salt=None,
                           kv_transfer_params=params or None, all_token_ids=list(prompt))


def decode(side: SchedulerSide, req: SimpleNamespace, tokens: list[int], block_ids=None,
           drafts: int = 0):
    """vLLM samples ``tokens`` one step each (the last one not yet computed); each step's
    plan's saves. ``drafts``: speculative tokens scheduled beyond each step's one."""
    saves = []
    for n, token in enumerate(tokens):
        req.all_token_ids.append(token)
        computed = len(req.all_token_ids) - 1
        plan = side.step_plan(step(cached=[(req.request_id, block_ids if n == 0 else None,
                                            computed)],
                                   scheduled={req.request_id: 1 + drafts}))
        saves += plan.saves
    return saves


def test_generated_blocks_are_saved_as_they_fill_when_asked() -> None:
    """A conversation's next turn holds this answer: with ``save_generated`` each block its
    generated tokens fill is saved, keyed as the next turn's prompt keys it, once the forward
    has computed its last position; without it, nothing past the prompt."""
    prompt = list(range(100, 106))  # 1 full block and 2 tokens
    answer = list(range(300, 309))
    for default, params, saved in ((True, {}, True), (False, {}, False),
                                   (False, {"kvstore_save_generated": True}, True),
                                   (True, {"kvstore_save_generated": False}, False)):
        side = SchedulerSide(LocalStore(), ns, BS, save_generated=default)
        req = generating("r", prompt, **params)
        side.matched_tokens(req, 0)
        side.allocated(req, [10, 11], 0)
        [first] = side.step_plan(step(new=[("r", [10, 11], 0)], scheduled={"r": 6})).saves
        assert first.block_ids == [10]
        saves = decode(side, req, answer, block_ids=[12, 13])
        if not saved:
            assert saves == []
            continue
        want = [bytes(k) for k in BlockHasher(ns("")).block_keys(prompt + answer)]
        # blocks 1 (tokens 4-7) and 2 (8-11), each saved in the step that computes its end
        assert [s.keys for s in saves] == [want[1:2], want[2:3]]
        assert [s.parents for s in saves] == [want[0:1], want[1:2]]
        assert [s.tokens for s in saves] == [[[104, 105, 300, 301]], [[302, 303, 304, 305]]]
        assert [s.block_ids for s in saves] == [[11], [12]]


def test_speculative_positions_are_never_saved_before_their_tokens_are_accepted() -> None:
    side = SchedulerSide(LocalStore(), ns, BS, save_generated=True)
    req = generating("r", list(range(100, 106)))
    side.matched_tokens(req, 0)
    side.allocated(req, [10, 11, 12], 0)
    side.step_plan(step(new=[("r", [10, 11, 12], 0)], scheduled={"r": 6}))
    req.all_token_ids.append(300)  # position 6; drafts for 7-9 computed, not yet accepted
    plan = side.step_plan(step(cached=[("r", None, 6)], scheduled={"r": 4}))
    assert plan.saves == []
    req.all_token_ids += [301, 302]  # accepted: block 1 (positions 4-7) is whole
    [save] = side.step_plan(step(cached=[("r", None, 8)], scheduled={"r": 1})).saves
    assert save.tokens == [[104, 105, 300, 301]]
