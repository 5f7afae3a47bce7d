"""A private Ray head for one test module, with this process connected to it as the driver.

The head is started as `kvstore start` starts its own (``kvstore.cluster.head``: every port
free, a private temp dir, stopped by its process group and the processes naming that dir, never
``ray stop``), with resources the machine may lack declared: ``--num-gpus=2`` on a CPU-only box
makes Ray place actors by GPU and set their ``CUDA_VISIBLE_DEVICES`` as on a GPU node.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray._private import ray_constants

from kvstore.cluster.address import RecordedCluster
from kvstore.cluster.head import LOOPBACK_ENV, keep_loopback_address, start_head, stop_head
from kvstore.cluster.names import RAY_NAMESPACE
from tests.support.local_ray import init_local_ray

(LOOPBACK_VARIABLE,) = LOOPBACK_ENV


@contextmanager
def connected_ray_head(*ray_start_args: str, num_cpus: int = 2) -> Iterator[RecordedCluster]:
    """A head of its own (``ray start --head --num-cpus N`` plus ``ray_start_args``), connected.

    tests/conftest.py's session ``ray_local`` is set aside while it runs (one Ray per process)
    and an equivalent one is brought back after, for the modules that follow.
    """
    had_ray_local = ray.is_initialized()
    if had_ray_local:
        ray.shutdown()
    head = start_head((f"--num-cpus={num_cpus}", *ray_start_args))
    loopback_before = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(LOOPBACK_VARIABLE)
    try:
        keep_loopback_address()  # the head listens on 127.0.0.1 only, as `kvstore start`'s
        ray.init(address=head.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        stop_head(head)
        # Later modules' Ray instances in this process are the usual ones again.
        ray_constants.ENABLE_RAY_CLUSTER = loopback_before[0]
        if loopback_before[1] is None:
            os.environ.pop(LOOPBACK_VARIABLE, None)
        else:
            os.environ[LOOPBACK_VARIABLE] = loopback_before[1]
        if had_ray_local:
            init_local_ray(num_cpus=2, include_dashboard=False,
                           namespace="kvstore-tests")
