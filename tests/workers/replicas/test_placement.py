"""Replicas placed by GPU: the resolution of ``worker.gpus_per_replica``, then real replicas.

The resolution is a pure function of the settings and the cluster's GPU count. The replicas run
on a private Ray head of this module that declares 2 GPUs on this CPU-only machine: Ray places
and accounts by what is declared and sets each replica's ``CUDA_VISIBLE_DEVICES`` as on a GPU
node, while the model runs on ``cpu`` (``worker.device: auto`` resolves to it: torch sees no
CUDA here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray

from kvstore.config import KVStoreConfig, WorkerConfig
from kvstore.config_loader import load_config
from kvstore.errors import ClusterUnavailable, ConfigError
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.replicas.placement import resolve_gpus_per_replica
from tests.support.ray_cluster import wait_for
from tests.support.ray_head import connected_ray_head

pytestmark = pytest.mark.timeout(240)


def make_worker(device: str = "auto", gpus: str | float = "auto") -> WorkerConfig:
    return WorkerConfig(model="tiny", block_size=16, prefill_chunk_tokens=32, device=device,
                        gpus_per_replica=gpus)


# -- the setting and its resolution (no Ray) ---------------------------------------------------

@pytest.mark.parametrize("device, replicas, cluster, want", [
    ("auto", 2, 0.0, 0.0),     # a CPU-only cluster: unchanged, no GPU asked for
    ("cpu", 2, 2.0, 0.0),      # the model on the CPU: no GPU, whatever the cluster has
    ("auto", 2, 2.0, 1.0),     # a GPU each
    ("cuda", 1, 4.0, 1.0),
    ("cuda:0", 3, 8.0, 1.0),
    ("auto", 3, 2.0, 0.5),     # more replicas than GPUs: two to a GPU
    ("auto", 3, 1.0, 0.3333),  # three on one GPU (3 x 0.3333 fits)
    ("auto", 8, 3.0, 0.3333),
])
def test_auto_asks_for_a_gpu_where_the_model_runs_on_cuda(
        device: str, replicas: int, cluster: float, want: float) -> None:
    assert resolve_gpus_per_replica(make_worker(device), replicas, cluster) == want


@pytest.mark.parametrize("gpus, replicas, cluster", [
    (1, 2, 2.0), (0.5, 4, 2.0), (2, 1, 2.0), (0, 5, 0.0), (0.25, 4, 1.0)])
def test_a_number_is_taken_as_given_when_the_cluster_holds_it(
        gpus: float, replicas: int, cluster: float) -> None:
    # device cpu with GPUs asked for is allowed: it is how placement is tested on a CPU box
    assert resolve_gpus_per_replica(make_worker("cpu", gpus), replicas, cluster) == gpus


def test_more_gpus_than_the_cluster_has_are_refused_with_what_to_change() -> None:
    with pytest.raises(ConfigError, match=r"^3 replicas x worker.gpus_per_replica 1 need 3 "
                       r"GPUs, but the Ray cluster has 2 in all: start fewer replicas, lower "
                       r"worker.gpus_per_replica \(--gpus-per-replica"):
        resolve_gpus_per_replica(make_worker("cpu", 1), 3, 2.0)
    with pytest.raises(ConfigError, match="need 2.5 GPUs"):
        resolve_gpus_per_replica(make_worker("auto", 0.5), 5, 2.0)
    with pytest.raises(ConfigError, match="declares 0 GPUs.*worker.gpus_per_replica: 0"):
        resolve_gpus_per_replica(make_worker("cuda"), 1, 0.0)


def test_a_host_gpu_index_beyond_what_a_replica_sees_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'cuda:1'.*sees only the 1 Ray gives it"):
        resolve_gpus_per_replica(make_worker("cuda:1"), 2, 2.0)
    assert resolve_gpus_per_replica(make_worker("cuda:1", 2), 1, 2.0) == 2.0
    assert resolve_gpus_per_replica(make_worker("cuda:1", 0), 4, 2.0) == 0.0  # by hand


@pytest.mark.parametrize("value", ["1.5", "-1", "nan", "inf", "lots", "", "true"])
def test_bad_values_are_refused_when_the_settings_load(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^worker.gpus_per_replica must be auto, a share of "
                       r"one GPU \(0 to 1, e\.g\. 0\.5\) or a whole number of GPUs"):
        load_config(env={"KVSTORE_WORKER_GPUS_PER_REPLICA": value})


def test_the_setting_from_yaml_environment_and_flags(tmp_path) -> None:
    from kvstore.cli.main import build_parser
    from kvstore.workers.jobs.commands import make_config

    assert WorkerConfig().gpus_per_replica == "auto"
    path = tmp_path / "kvstore.yaml"
    path.write_text("worker:\n  gpus_per_replica: 0.5\n")
    assert load_config(path, env={}).worker.gpus_per_replica == 0.5
    assert load_config(env={"KVSTORE_WORKER_GPUS_PER_REPLICA": "2"}).worker.gpus_per_replica == 2
    path.write_text("worker:\n  gpus_per_replica: 1.5\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: worker.gpus_per_replica must be"):
        load_config(path, env={})
    args = build_parser().parse_args(["generate", "--prompts", "p.jsonl",
                                      "--gpus-per-replica", "0.25"])
    assert make_config(args).worker.gpus_per_replica == 0.25


def test_serve_replicas_ask_ray_for_their_gpus() -> None:
    from kvstore.frontend.launch import build_app

    app = build_app(KVStoreConfig(worker=make_worker()), None, gpus_per_replica=0.5)
    ingress = app._bound_deployment
    kinds = {arg._bound_deployment.name: arg._bound_deployment for arg in ingress.init_args
             if hasattr(arg, "_bound_deployment")}
    assert set(kinds) == {"prefill", "decode"}
    for d in kinds.values():
        assert d.ray_actor_options == {"num_cpus": 0, "num_gpus": 0.5}
    assert not ingress.ray_actor_options.get("num_gpus")  # the HTTP front end needs none


# -- real replicas on a Ray head that declares 2 GPUs ------------------------------------------

@pytest.fixture(scope="module")
def two_gpus() -> Iterator[None]:
    """This module's Ray head (2 declared GPUs) with kvstore running on it."""
    from kvstore.cluster import lifecycle

    config = KVStoreConfig(worker=make_worker())
    with connected_ray_head("--num-gpus=2"):
        lifecycle.start(config)
        try:
            yield
        finally:
            lifecycle.stop(config)


def visible_gpus(dep: Deployment) -> list[str | None]:
    return [dep._call(r, "visible_gpus") for r in dep.prefills + dep.decodes]


def free_gpus() -> float:
    return ray.available_resources().get("GPU", 0.0)


@pytest.mark.ray
@pytest.mark.parametrize("device, gpus", [("cpu", "1"), ("auto", "auto")])
def test_two_replicas_get_a_gpu_each(two_gpus: None, device: str, gpus: str) -> None:
    dep = Deployment(KVStoreConfig(worker=make_worker(device, gpus)), mode="ray")
    try:
        assert dep.gpus_per_replica == 1.0
        assert sorted(visible_gpus(dep)) == ["0", "1"]
        assert free_gpus() == 0
    finally:
        dep.close()
    wait_for(lambda: free_gpus() == 2, what="the replicas' GPUs to be released")


@pytest.mark.ray
def test_a_third_replica_is_refused_before_anything_starts(two_gpus: None) -> None:
    with pytest.raises(ConfigError, match="3 replicas x worker.gpus_per_replica 1 need 3 GPUs, "
                       "but the Ray cluster has 2 in all"):
        Deployment(KVStoreConfig(worker=make_worker("cpu", 1)), num_prefill=2, mode="ray")
    assert free_gpus() == 2


@pytest.mark.ray
def test_half_a_gpu_puts_two_replicas_on_one(two_gpus: None) -> None:
    dep = Deployment(KVStoreConfig(worker=make_worker("cpu", 0.5)), mode="ray")
    try:
        assert dep.gpus_per_replica == 0.5
        seen = visible_gpus(dep)
        assert len(seen) == 2 and len(set(seen)) == 1 and seen[0] in ("0", "1")
        assert free_gpus() == 1
    finally:
        dep.close()
    wait_for(lambda: free_gpus() == 2, what="the replicas' GPUs to be released")


@pytest.mark.ray
def test_busy_gpus_end_the_wait_with_what_was_asked_and_what_is_free(two_gpus: None) -> None:
    holder = ray.remote(num_cpus=0, num_gpus=2)(_Holder).remote()
    ray.get(holder.ready.remote())
    try:
        with pytest.raises(ClusterUnavailable, match=r"the 2 replicas did not all start within "
                           r"2s\. Each asks Ray for 1 GPU\(s\); the cluster has 0 of 2 GPUs "
                           r"free now"):
            Deployment(KVStoreConfig(worker=make_worker("cpu", 1)), mode="ray",
                       start_timeout_s=2)
    finally:
        ray.kill(holder)
    # The replicas that waited were killed: they do not take the GPUs once they are free.
    wait_for(lambda: free_gpus() == 2, what="the GPUs to come back")
    time.sleep(1.0)
    assert free_gpus() == 2


class _Holder:
    """Another user's actor holding the cluster's GPUs."""

    def ready(self) -> bool:
        return True
