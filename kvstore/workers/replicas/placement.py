"""How many GPUs a replica asks Ray for, decided on the driver before any replica starts.

A replica that asks Ray for GPUs gets devices of its own: Ray sets ``CUDA_VISIBLE_DEVICES`` in
the replica's process to the GPUs it assigned, so ``worker.device: auto`` (``cuda:0`` there,
``kvstore.workers.model.device``) is that replica's GPU, N replicas on an N-GPU node land on N
devices, and Ray never places more replicas on a node than its GPUs hold. A replica that asks for
none sees every GPU of its node (Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone) and uses the first.

``worker.gpus_per_replica: auto`` is resolved here from what the Ray cluster declares, never
from torch: the driver may run on a head without a GPU, and it decides for replicas elsewhere.
"""

from __future__ import annotations

import logging
import math

import ray

from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError

log = logging.getLogger(__name__)

#: ``worker.gpus_per_replica``'s default: 1 where the model runs on CUDA, else 0.
AUTO = "auto"

#: Ray accounts GPU shares in 1/10000 of a GPU: an ``auto`` share is rounded down to that, so
#: k shares of ``1/k`` still fit on one GPU (3 x 0.3333).
_SHARE_STEPS = 10_000


def declared_gpus() -> float:
    """The GPUs the Ray cluster this process is connected to declares, busy or not."""
    return float(ray.cluster_resources().get("GPU", 0.0))


def resolve_gpus_per_replica(worker: WorkerConfig, num_replicas: int,
                             cluster_gpus: float) -> float:
    """The GPUs each of ``num_replicas`` replicas asks Ray for, or ConfigError at once.

    ``auto``: 0 unless the replicas run on CUDA (``worker.device`` names ``cuda``, or says
    ``auto`` and the cluster declares GPUs); then 1, or an equal share of a GPU (``1/k``, k
    replicas per GPU) when there are more replicas than GPUs, as replicas shared the first GPU
    before they asked. A number is taken as given (``cpu`` with 1 is allowed: tests place by
    declared GPUs on a CPU machine) but refused when the cluster's GPUs cannot hold them all,
    since Ray would wait for them forever.
    """
    setting = worker.gpus_per_replica
    if setting == AUTO:
        gpus = _auto(worker.device, num_replicas, cluster_gpus)
    else:
        gpus = float(setting)
        need = num_replicas * gpus
        if gpus > 0 and need > cluster_gpus + 1e-9:
            raise ConfigError(
                f"{num_replicas} replicas x worker.gpus_per_replica {gpus:g} need {need:g} "
                f"GPUs, but the Ray cluster has {cluster_gpus:g} in all: start fewer replicas, "
                "lower worker.gpus_per_replica (--gpus-per-replica; 0.5 puts two replicas on "
                "a GPU, auto shares GPUs when replicas outnumber them), or add GPU nodes")
    _check_device_index(worker.device, gpus)
    return gpus


def _auto(device: str, num_replicas: int, cluster_gpus: float) -> float:
    on_cuda = device.split(":")[0] == "cuda" or (device == "auto" and cluster_gpus > 0)
    if not on_cuda:
        return 0.0
    whole = math.floor(cluster_gpus + 1e-9)
    if whole < 1:
        raise ConfigError(
            f"worker.device {device!r} runs replicas on a GPU, but the Ray cluster declares "
            f"{cluster_gpus:g} GPUs: start Ray on the GPU nodes (ray start --num-gpus N where "
            "Ray does not detect them), or set worker.gpus_per_replica: 0 to place replicas "
            "without asking Ray for GPUs")
    per_gpu = math.ceil(num_replicas / whole)
    return 1.0 if per_gpu == 1 else math.floor(_SHARE_STEPS / per_gpu) / _SHARE_STEPS


def _check_device_index(device: str, gpus: float) -> None:
    """Refuse ``cuda:N`` beyond the GPUs a replica will see: Ray renumbers them from 0."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit() or gpus <= 0:
        return
    visible = max(1, math.ceil(gpus))
    if int(index) >= visible:
        raise ConfigError(
            f"worker.device {device!r}: a replica that asks Ray for {gpus:g} GPU(s) sees only "
            f"the {visible} Ray gives it, from cuda:0; use worker.device cuda (or auto), or "
            "set worker.gpus_per_replica: 0 to choose the GPU by its host index yourself")


def replica_gpus(worker: WorkerConfig, num_replicas: int) -> float:
    """``resolve_gpus_per_replica`` against the connected Ray cluster, logged when > 0."""
    gpus = resolve_gpus_per_replica(worker, num_replicas, declared_gpus())
    if gpus > 0:
        log.info("kvstore: each of %d replicas asks Ray for %g GPU(s)", num_replicas, gpus)
    return gpus


def not_started_message(num_replicas: int, gpus: float, timeout_s: float,
                        resources: dict[str, dict[str, float] | None] | None = None) -> str:
    """Why replicas may still be missing after ``timeout_s``: what they ask for, what is free.

    ``resources``: the custom resources each kind of replica asks for (``{"prefill": {...}}``).
    """
    also = "".join(f"; {kind} replicas also ask for "
                   + ", ".join(f"{v:g} {k}" for k, v in asked.items())
                   for kind, asked in (resources or {}).items() if asked)
    free = ray.available_resources().get("GPU", 0.0)
    return (f"the {num_replicas} replicas did not all start within {timeout_s:.0f}s. Each asks "
            f"Ray for {gpus:g} GPU(s){also}; the cluster has {free:g} of {declared_gpus():g} "
            "GPUs free now (Ray waits while others hold them), or a replica is still loading "
            "its model: free GPUs, lower worker.gpus_per_replica (--gpus-per-replica), or "
            "start fewer replicas")
