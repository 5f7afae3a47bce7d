"""Router, replicas and the deployment: in-process first, then real Ray actors on the cluster,
counted on the store node's /metrics exactly as their outputs report it (cached and computed
prompt tokens, blocks fetched and where from)."""

from __future__ import annotations

import urllib.request
from collections import Counter

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstore import reader_metrics
from kvstore.api import PrefixHit
from kvstore.block import block_nbytes
from kvstore.config import KVStoreConfig, WorkerConfig
from kvstore.errors import ConfigError, NodeUnavailable
from kvstore.keys import BlockHasher
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.router import ReplicaSlot, Router
from tests.support.local_ray import init_local_ray

SAMPLING = SamplingParams(max_new_tokens=5)


def make_config() -> KVStoreConfig:
    return KVStoreConfig(worker=WorkerConfig(model="tiny", block_size=16,
                                             prefill_chunk_tokens=32))


def make_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


class FakeIndex:
    """An index that reports fixed holders per block (the router only reads lookups)."""

    node_id = "router"

    def __init__(self, holders: list[list[str]]) -> None:
        self.holders = holders

    def lookup_prefix(self, namespace, keys):
        n = min(len(keys), len(self.holders))
        return PrefixHit(n, self.holders[:n])


def make_router(holders, nodes) -> Router:
    hasher = BlockHasher(load_model("tiny").namespace(16))
    return Router(FakeIndex(holders), hasher, [ReplicaSlot(f"r{i}", n)
                                               for i, n in enumerate(nodes)])


def test_router_prefers_the_node_holding_the_prefix():
    router = make_router([["b"], ["b", "a"], ["b"]], ["a", "b", "c"])
    assert router.choose(make_prompt(64)) == 1


def test_router_weighs_load_against_overlap():
    router = make_router([["b"]] * 3, ["a", "b"])
    router.replicas[1].in_flight = 1  # 3 blocks of overlap < 8 blocks per queued request
    assert router.choose(make_prompt(64)) == 0
    router.done(0)
    router.replicas[1].in_flight = 0
    assert router.choose(make_prompt(64)) == 1


def test_router_spreads_equal_scores_round_robin():
    router = make_router([], ["a", "a", "a"])
    picks = []
    for _ in range(3):
        i = router.choose(make_prompt(20))
        router.done(i)
        picks.append(i)
    assert sorted(picks) == [0, 1, 2]


def test_router_treats_a_failed_lookup_as_a_cold_start():
    class DownIndex(FakeIndex):
        def lookup_prefix(self, namespace, keys):
            raise NodeUnavailable("index down")

    hasher = BlockHasher(load_model("tiny").namespace(16))
    router = Router(DownIndex([]), hasher, [ReplicaSlot("r0", "a"), ReplicaSlot("r1", "b")])
    router.replicas[0].in_flight = 1
    assert router.choose(make_prompt(64)) == 1


def test_inprocess_deployment_reuses_and_matches_no_cache():
    dep = Deployment(make_config(), num_prefill=2, num_decode=2)
    system = make_prompt(64, seed=1)
    outs = [dep.generate(f"r{i}", system + make_prompt(20, seed=10 + i), SAMPLING)
            for i in range(3)]
    assert [o.cached_tokens for o in outs] == [0, 64, 64]
    assert {o.prefill_replica for o in outs} == {"prefill-0", "prefill-1"}
    model = load_model("tiny")
    for i, o in enumerate(outs):
        _, ref = Engine(model, None, make_config().worker).generate(
            system + make_prompt(20, seed=10 + i), sampling=SAMPLING)
        assert o.output_token_ids == ref.output_token_ids
    dep.close()


def test_deployment_rejects_bad_settings():
    with pytest.raises(ConfigError, match="replicas"):
        Deployment(make_config(), num_prefill=0)
    with pytest.raises(ConfigError, match="mode"):
        Deployment(make_config(), mode="k8s")


@pytest.fixture(scope="module")
def ray_private():
    """A private local Ray (address="local"): never another engineer's running cluster. CPU-only
    whatever the machine has (``num_gpus=0``): replicas here ask Ray for no GPU."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    init_local_ray(num_cpus=2, num_gpus=0, include_dashboard=False,
                   namespace="kvstore", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_ray_actors_share_blocks_across_replicas(ray_private):
    from kvstore.cluster import lifecycle, operations

    config = make_config()
    lifecycle.start(config)  # ours, not the deployment's: its status outlives the replicas
    dep = Deployment(config, num_prefill=2, num_decode=1, mode="ray")
    try:
        assert dep.gpus_per_replica == 0  # worker.gpus_per_replica auto on a CPU-only cluster
        system = make_prompt(96, seed=2)
        outs = [dep.generate(f"r{i}", system + make_prompt(9, seed=20 + i), SAMPLING)
                for i in range(2)]
        refs = [dep.generate(f"n{i}", system + make_prompt(9, seed=20 + i), SAMPLING,
                             use_cache=False) for i in range(2)]
        # Each worker told the coordinator its reuse policy: kvstore status shows it.
        workers = operations.status()["workers"]
        assert sorted(w["replica"] for w in workers) == ["decode-0", "prefill-0", "prefill-1"]
        assert all(w["reuse"]["resume"] == "block" and w["reuse"]["exact"] for w in workers)
        assert all(o.resume == "block" for o in outs)
    finally:
        dep.close()
        closed = operations.status()["workers"]
        lifecycle.stop(config)
    assert closed == []  # a closed worker is forgotten
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens == 96
    assert outs[0].prefill_replica != outs[1].prefill_replica
    assert outs[1].bytes_fetched > 0 and sum(outs[1].sources.values()) > 0
    assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in refs]


@pytest.mark.ray
def test_ray_run_keeps_replicas_busy_in_input_order(ray_private):
    """Real actors and futures: order, spread over decode replicas, exactness, one prefill of
    the shared prefix, and ``--no-cache`` computing each prompt once on a decode replica."""
    from kvstore.cluster import lifecycle

    config = make_config()
    lifecycle.start(config)
    dep = Deployment(config, num_prefill=2, num_decode=2, mode="ray")
    try:
        system = make_prompt(64, seed=3)
        requests = [(f"q{i}", system + make_prompt(5 + 7 * i, seed=30 + i)) for i in range(6)]
        outs = dep.run("generate", requests, SAMPLING)
        refs = dep.run("reference", requests, SAMPLING)
        warm = dep.run("generate", [("w", make_prompt(50, seed=9))],
                       SamplingParams(max_new_tokens=0))
        after = dep.generate("w2", make_prompt(50, seed=9), SAMPLING)
    finally:
        dep.close()
        lifecycle.stop(config)
    model = load_model("tiny")
    want = [Engine(model, None, config.worker).generate(ids, sampling=SAMPLING)[1]
            .output_token_ids for _, ids in requests]
    assert [o.id for o in outs] == [rid for rid, _ in requests]
    assert [o.output_token_ids for o in outs] == want
    assert [o.output_token_ids for o in refs] == want
    assert [o.cached_tokens for o in outs] == [0] + [64] * 5
    assert {o.decode_replica for o in outs} == {"decode-0", "decode-1"}
    assert all(o.prefill_replica == o.decode_replica and o.cached_tokens == 0 for o in refs)
    assert warm[0].output_token_ids == [] and after.cached_tokens == 48


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the store node's /metrics count what a deployment's outputs report ------------------------

def scrape(address: str) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return out


@pytest.mark.ray
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


@pytest.mark.ray
def test_ray_job_submit_generate_on_a_local_head(tmp_path):
    """``ray job submit --working-dir . -- kvstore generate``, against a private Ray head."""
    import json
    import os
    import shutil
    import signal
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    gcs, dash = _free_port(), _free_port()
    # Short: Ray's unix socket paths under the temp dir must stay under 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="kvs-job-", dir="/tmp")
    # Head and client must agree on auth; a private loopback head needs no token.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": ""}
    # --block keeps the head in one process group that this test owns and ends by id.
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={gcs}", "--include-dashboard=true",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--num-cpus=2",
         # Every agent port explicit: the defaults (52365, ...) may be held by another Ray
         # instance on the machine (this session's own), and then no job agent ever registers.
         f"--dashboard-agent-listen-port={_free_port()}",
         f"--dashboard-agent-grpc-port={_free_port()}", f"--metrics-export-port={_free_port()}",
         f"--runtime-env-agent-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
         f"--temp-dir={ray_tmp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"q{i}", "token_ids": make_prompt(
            80, seed=1)[:70] + [i] * 5}) + "\n" for i in range(2)))
        # The head's job agent registers some seconds after the head (longer on a busy box).
        deadline = time.monotonic() + 180
        cmd = ["ray", "job", "submit", f"--address=http://127.0.0.1:{dash}",
               f"--working-dir={repo}", "--", "kvstore", "generate", "--prompts", str(prompts),
               "--model", "tiny", "--block-size", "16", "--chunk-tokens", "32",
               "--max-new-tokens", "3", "--json"]
        while True:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                                  env=env)
            if proc.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(3)  # the job server comes up a little after the head
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        rows = [json.loads(line) for line in proc.stdout.splitlines()
                if line.startswith('{"id"')]
        assert [r["cached_tokens"] for r in rows] == [0, 64]
        assert all(len(r["output_token_ids"]) == 3 for r in rows)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
