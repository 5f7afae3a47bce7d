"""Disaggregated prefill behind vLLM's own P/D proxies, against a real LocalStore: a prefill
leg's answer says how many blocks it published, and a decode leg that carries it is held
(vLLM asks again) until kvstore holds them, or for ``publish_wait_s`` at most."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstore.client.local_store import LocalStore
from kvstore.integrations.vllm.handoff import (
    POLL_S,
    PublishWait,
    blocks_to_wait_for,
    prefill_answer,
)
from kvstore.integrations.vllm.scheduler_side import SchedulerSide
from tests.integrations.test_vllm_scheduler_side import BS, ns, publish, step

PROMPT = list(range(200, 214))  # 3 full blocks and 2 tokens


def leg(rid: str, params: dict | None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=PROMPT, cache_salt=None,
                           kv_transfer_params=params)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def decode_side(store: LocalStore, clock: Clock, wait_s: float = 2.0) -> SchedulerSide:
    side = SchedulerSide(store, ns, BS, save=False)
    side._publish_wait = PublishWait(wait_s, clock, sleep=clock.sleep)
    return side


def test_a_prefill_leg_answers_with_the_blocks_it_saves_and_others_answer_nothing() -> None:
    side = SchedulerSide(LocalStore(), ns, BS)
    prefill = leg("p", {"do_remote_decode": True})
    assert side.matched_tokens(prefill, 0) == (0, False)
    side.allocated(prefill, [1, 2, 3, 4], 0)
    plan = side.step_plan(step(new=[("p", [1, 2, 3, 4], 0)], scheduled={"p": 14}))
    assert len(plan.saves[0].block_ids) == 3
    assert side.finished("p", prefill.kv_transfer_params) == {
        "do_remote_prefill": True, "do_remote_decode": False, "kvstore_blocks": 3}
    plain = leg("q", None)
    side.matched_tokens(plain, 0)
    assert side.finished("q", None) is None  # not a prefill leg: nothing to tell
    loader = SchedulerSide(LocalStore(), ns, BS, save=False)
    loader.matched_tokens(leg("l", {"do_remote_decode": True}), 0)
    assert loader.finished("l", {"do_remote_decode": True}) is None  # it published nothing


def test_a_decode_leg_waits_until_its_prefills_blocks_are_in_then_loads_them() -> None:
    store, clock = LocalStore(), Clock()
    publish(store, PROMPT[:4])  # the prefill's first block is in; two are on their way
    side = decode_side(store, clock)
    side.matched_tokens(leg("running", None), 0)  # another request the engine runs meanwhile
    decode = leg("d", {"do_remote_prefill": True, "kvstore_blocks": 3})
    assert side.matched_tokens(decode, 0) == (None, False)  # held: vLLM asks again
    clock.now += POLL_S / 2
    lookups = []
    real = store.lookup_prefix
    store.lookup_prefix = lambda *a, **kw: lookups.append(1) or real(*a, **kw)
    assert side.matched_tokens(decode, 0) == (None, False)
    assert lookups == [] and clock.slept == []  # asked again within POLL_S: no lookup
    publish(store, PROMPT[:12])
    clock.now += POLL_S
    # all three: loaded (asynchronously, as another request runs)
    assert side.matched_tokens(decode, 0) == (12, True)
    assert len(side._publish_wait) == 0 and clock.slept == []


def test_a_decode_leg_alone_in_its_engine_sleeps_until_its_next_lookup_instead_of_spinning(
        ) -> None:
    store, clock = LocalStore(), Clock()
    side = decode_side(store, clock)
    decode = leg("d", {"kvstore_blocks": 3})
    assert side.matched_tokens(decode, 0) == (None, False)
    clock.now += POLL_S / 4  # vLLM's empty step came back at once: nothing else to run
    publish(store, PROMPT[:12])
    assert side.matched_tokens(decode, 0) == (12, False)  # slept the rest, then looked up
    assert clock.slept == [pytest.approx(3 * POLL_S / 4)]


def test_a_decode_leg_goes_on_with_what_is_there_after_publish_wait_s() -> None:
    store, clock = LocalStore(), Clock()
    publish(store, PROMPT[:4])
    side = decode_side(store, clock, wait_s=2.0)
    decode = leg("d", {"kvstore_blocks": 3})
    assert side.matched_tokens(decode, 0) == (None, False)
    clock.now += 2.0
    assert side.matched_tokens(decode, 0) == (4, False)  # the one block; vLLM computes the rest


def test_what_ends_a_wait_at_once() -> None:
    store, clock = LocalStore(), Clock()
    side = decode_side(store, clock)
    # vLLM's own prefix cache already holds them: nothing to wait for
    assert side.matched_tokens(leg("own", {"kvstore_blocks": 3}), 12) == (0, False)
    # bypassed: never looked up, never held
    bypass = leg("b", {"kvstore_blocks": 3, "kvstore_bypass": True})
    assert side.matched_tokens(bypass, 0) == (0, False)
    # a request that ends while it waits leaves nothing behind
    waiting = leg("w", {"kvstore_blocks": 3})
    assert side.matched_tokens(waiting, 0) == (None, False)
    side.finished("w", waiting.kv_transfer_params)
    assert len(side._publish_wait) == 0 and "w" not in side._requests
    # an instance that does not load never waits
    saver = SchedulerSide(store, ns, BS, load=False)
    assert saver.matched_tokens(leg("s", {"kvstore_blocks": 3}), 0) == (0, False)


@pytest.mark.parametrize(("params", "blocks"), [
    ({"kvstore_blocks": 3}, 3), ({"kvstore_blocks": 0}, 0), ({"kvstore_blocks": -2}, 0),
    ({"kvstore_blocks": "3"}, 0), ({"kvstore_blocks": True}, 0), ({}, 0), (None, 0),
    ("junk", 0)])
def test_only_a_whole_positive_count_is_waited_for(params, blocks) -> None:
    assert blocks_to_wait_for(params) == blocks


def test_the_answer_is_the_conventional_pd_one() -> None:
    assert prefill_answer({"do_remote_decode": False}, 3) is None
    assert prefill_answer({"do_remote_decode": True}, -1)["kvstore_blocks"] == 0
