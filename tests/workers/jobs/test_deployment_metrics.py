"""A real deployment (--model tiny, Ray actors) is counted on the store node's /metrics exactly
as its outputs report it: cached and computed prompt tokens, blocks fetched and where from."""

from __future__ import annotations

import os
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import reader_metrics
from kvstore.block import block_nbytes
from kvstore.keys import BlockHasher
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.model.causal_lm import load_model
from tests.support.local_ray import init_local_ray
from tests.workers.jobs.test_deployment import SAMPLING, make_config, make_prompt

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def ray_private() -> Iterator[None]:
    """A private local Ray (address="local"): never another engineer's running cluster."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    init_local_ray(num_cpus=2, include_dashboard=False, namespace="kvstore",
                   log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def scrape(address: str) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return out


def test_a_cold_and_a_warm_request_are_counted_as_their_outputs_say(ray_private: None) -> None:
    import ray

    from kvstore.cluster import lifecycle, operations
    from kvstore.cluster.names import RAY_NAMESPACE, store_actor_name

    config = make_config()
    lifecycle.start(config)
    try:
        status = operations.status()
        (node,) = status["nodes"]
        store = ray.get_actor(store_actor_name(node["node_id"]), namespace=RAY_NAMESPACE)
        ray.get(store.heartbeat_now.remote())
        hits0 = operations.status()["totals"]["hits"]
        # This process's unpushed tallies (earlier tests' engines and stores) would go to this
        # node with the driver's store: they are not this test's.
        reader_metrics.take_pending()
        before = scrape(node["metrics_address"])
        dep = Deployment(config, num_prefill=1, num_decode=1, mode="ray")
        system = make_prompt(96, seed=2)
        prompts = [system + make_prompt(9, seed=20 + i) for i in range(2)]
        try:
            outs = [dep.generate(f"r{i}", p, SAMPLING) for i, p in enumerate(prompts)]
        finally:
            dep.close()  # the workers close their stores: their last tallies are pushed
        after = scrape(node["metrics_address"])
        ray.get(store.heartbeat_now.remote())
        hits1 = operations.status()["totals"]["hits"]
    finally:
        lifecycle.stop(config)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before[key]

    ns = load_model("tiny").namespace(config.worker.block_size)
    hasher = BlockHasher(ns)
    fetched = sum(sum(o.sources.values()) for o in outs)
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens == 96  # cold, then warm
    assert moved("kvstore_prefill_tokens_total", kind="cached") == \
        sum(o.cached_tokens for o in outs)
    assert sum(moved("kvstore_prefill_tokens_total", kind=k)
               for k in ("cached", "unreused_shared", "computed")) == \
        sum(o.num_prompt_tokens for o in outs)
    assert fetched > 0 and moved("kvstore_hits_total") == fetched
    assert moved("kvstore_fetched_blocks_total", path="shm") == fetched  # one node: same node
    assert moved("kvstore_fetched_bytes_total", path="shm") == fetched * block_nbytes(ns)
    assert sum(o.bytes_fetched for o in outs) == fetched * ns.payload_nbytes
    assert moved("kvstore_served_blocks_total", path="shm") == fetched == hits1 - hits0
    distinct = {k for p in prompts for k in hasher.block_keys(p)}
    assert moved("kvstore_stored_blocks_total", source="put") == len(distinct)
