"""A private Ray head for one test module, with this process connected to it as the driver.

The head is started as `kvstore start` starts its own (``kvstore.cluster.head``: every port
free, a private temp dir, stopped by its process group and the processes naming that dir, never
``ray stop``), with resources the machine may lack declared: ``--num-gpus=2`` on a CPU-only box
makes Ray place actors by GPU and set their ``CUDA_VISIBLE_DEVICES`` as on a GPU node.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import ray

from kvstore.cluster.address import RecordedCluster
from kvstore.cluster.head import start_head, stop_head
from kvstore.cluster.names import RAY_NAMESPACE


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
    try:
        ray.init(address=head.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        stop_head(head)
        if had_ray_local:
            ray.init(address="local", num_cpus=2, include_dashboard=False,
                     namespace="kvstore-tests")
