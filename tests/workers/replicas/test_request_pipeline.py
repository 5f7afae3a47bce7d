"""The request pipeline: several requests in flight, results in input order, each stage's replica
chosen per request; compared with sequential runs and the store-bypassing reference."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.request_pipeline import InlineCalls
from tests.workers.jobs.test_deployment import SAMPLING, make_config, make_prompt


def make_requests(num: int, system_tokens: int = 64) -> list[tuple[str, list[int]]]:
    """``num`` prompts sharing a system prompt, with suffixes of different lengths."""
    system = make_prompt(system_tokens, seed=1)
    return [(f"q{i}", system + make_prompt(7 + 5 * i, seed=10 + i)) for i in range(num)]


def reference_tokens(requests: list[tuple[str, list[int]]],
                     sampling: SamplingParams = SAMPLING) -> list[list[int]]:
    """Each prompt on one engine without a store: what every schedule must reproduce."""
    engine = Engine(load_model("tiny"), None, make_config().worker)
    return [engine.generate(ids, sampling=sampling)[1].output_token_ids for _, ids in requests]


@dataclass(eq=False)
class _Later:
    replica: Any
    method: str
    args: tuple[Any, ...]


@dataclass
class LastFirstCalls(InlineCalls):
    """Calls that run only when waited for, newest first: later requests finish first, as
    they may on Ray, and the peak number of calls in flight per replica is recorded."""

    in_flight: Counter[int] = field(default_factory=Counter)
    peak: Counter[int] = field(default_factory=Counter)
    submitted: list[str] = field(default_factory=list)  # request ids, in submission order

    def submit(self, replica: Any, method: str, *args: Any) -> Any:
        self.submitted.append(args[2] if method == "decode" else args[1])
        self.in_flight[id(replica)] += 1
        self.peak[id(replica)] = max(self.peak[id(replica)], self.in_flight[id(replica)])
        return _Later(replica, method, args)

    def wait(self, futures: list[Any]) -> list[Any]:
        return [futures[-1]]

    def result(self, future: Any) -> Any:
        self.in_flight[id(future.replica)] -= 1
        return getattr(future.replica, future.method)(*future.args)


def test_run_in_input_order_equals_sequential_and_reference():
    requests = make_requests(6)
    dep = Deployment(make_config(), num_prefill=2, num_decode=2)
    calls = LastFirstCalls()
    dep.pipeline.calls = calls
    try:
        outs = dep.run("generate", requests, SAMPLING)
    finally:
        dep.close()
    seq = Deployment(make_config(), num_prefill=2, num_decode=2)
    try:
        sequential = [seq.generate(rid, ids, SAMPLING) for rid, ids in requests]
    finally:
        seq.close()
    assert [o.id for o in outs] == [rid for rid, _ in requests]
    assert [o.output_token_ids for o in outs] == reference_tokens(requests)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in sequential]
    # The shared prefix is computed once although requests 1.. were ready to start with it.
    assert [o.cached_tokens for o in outs] == [0] + [64] * 5
    assert [o.num_prompt_tokens for o in outs] == [len(ids) for _, ids in requests]
    # Several calls were in flight per replica, never more than the bound.
    assert max(calls.peak.values()) == 2


def test_a_request_waiting_for_a_shared_prefix_does_not_hold_up_others():
    system = make_prompt(64, seed=1)
    requests = [("a", system + make_prompt(9, seed=2)), ("b", system + make_prompt(9, seed=3)),
                ("c", make_prompt(73, seed=4))]
    dep = Deployment(make_config(), num_prefill=2, num_decode=1)
    calls = LastFirstCalls()
    dep.pipeline.calls = calls
    try:
        outs = dep.run("generate", requests, SAMPLING)
    finally:
        dep.close()
    prefills = [rid for rid in calls.submitted if rid.endswith("-p")]
    assert prefills == ["a-0-p", "c-2-p", "b-1-p"]  # b waited for a's blocks, c did not
    assert [o.cached_tokens for o in outs] == [0, 64, 0]
    assert [o.output_token_ids for o in outs] == reference_tokens(requests)


def test_decodes_spread_over_decode_replicas():
    requests = make_requests(4)
    dep = Deployment(make_config(), num_prefill=2, num_decode=2)
    try:
        outs = dep.run("generate", requests, SAMPLING)
        refs = dep.run("reference", requests, SAMPLING)
    finally:
        dep.close()
    assert Counter(o.decode_replica for o in outs) == {"decode-0": 2, "decode-1": 2}
    assert Counter(o.decode_replica for o in refs) == {"decode-0": 2, "decode-1": 2}
    assert {o.prefill_replica for o in outs} == {"prefill-0", "prefill-1"}
    assert all(o.to_json()["decode_replica"].startswith("decode-") for o in outs)


def test_reference_computes_each_prompt_once(monkeypatch):
    prefills: list[str] = []
    original = Engine._prefill

    def counting(self, token_ids, sampling, request_id, use_cache, deadline, *rest):
        prefills.append(request_id)
        return original(self, token_ids, sampling, request_id, use_cache, deadline, *rest)

    monkeypatch.setattr(Engine, "_prefill", counting)
    requests = make_requests(3)
    dep = Deployment(make_config(), num_prefill=2, num_decode=2)
    try:
        refs = dep.run("reference", requests, SAMPLING)
    finally:
        dep.close()
    assert len(prefills) == len(requests)
    assert [o.output_token_ids for o in refs] == reference_tokens(requests)
    assert all(o.cached_tokens == 0 and o.bytes_fetched == 0 and o.ttft_s > 0 for o in refs)
    assert all(o.prefill_replica == o.decode_replica for o in refs)  # computed where decoded


def test_zero_new_tokens_is_a_warm_up_that_publishes():
    requests = make_requests(3)
    warm_up = SamplingParams(max_new_tokens=0)
    dep = Deployment(make_config(), num_prefill=2, num_decode=2)
    try:
        outs = dep.run("generate", requests, warm_up)
        prefilled = dep.run("prefill", requests, warm_up)
        decoded = dep.run("decode", requests, warm_up)
        after = dep.run("generate", requests, SAMPLING)
        refs = dep.run("reference", requests, warm_up)
    finally:
        dep.close()
    assert all(o.output_token_ids == [] for o in outs + prefilled + decoded + refs)
    assert all(o.decode_replica == "" for o in outs)  # no decode step at all
    # The warm-up published every full block: the next run resumes at the last one.
    assert [o.cached_tokens for o in after] == [(len(ids) - 1) // 16 * 16 for _, ids in requests]
    assert [o.cached_tokens for o in decoded] == [len(ids) // 16 * 16 for _, ids in requests]
    assert [o.output_token_ids for o in after] == reference_tokens(requests)


def test_zero_new_tokens_in_the_engine_and_config():
    engine = Engine(load_model("tiny"), None, make_config().worker)
    pre, dec = engine.generate(make_prompt(40), sampling=SamplingParams(max_new_tokens=0))
    assert dec.output_token_ids == [] and dec.decode_tokens_per_s == 0
    assert pre.num_prompt_tokens == 40
    assert WorkerConfig(max_new_tokens=0).max_new_tokens == 0
    with pytest.raises(ConfigError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        WorkerConfig(max_new_tokens=-1)


def test_a_failed_request_raises_its_error():
    dep = Deployment(make_config(), num_prefill=2, num_decode=1)
    try:
        with pytest.raises(ConfigError, match="vocabulary"):
            dep.run("generate", [("ok", make_prompt(20)), ("bad", [1, 10**6])], SAMPLING)
        with pytest.raises(ConfigError, match="max_in_flight"):
            Deployment(make_config(), max_in_flight=0)
    finally:
        dep.close()
