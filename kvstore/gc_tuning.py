"""Garbage-collector settings for kvstore's long-running server processes.

A store node and the coordinator import torch, Ray, gRPC and protobuf: hundreds of thousands
of objects that live as long as the process. CPython's full collection walks every tracked
object, so each one paused the process for 80-90 ms (measured in a store node: the fourth
210-block Put after start took 88 ms, all of it inside ``commit_many``, where the allocation
that crossed the collector's threshold happened). Such a pause lands in whichever request is
running: it was the replay's p99.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now out of the collector's reach (``gc.freeze``), once the
    process has started: full collections then walk only what was created since. Objects
    created later are collected as before."""
    gc.collect()
    gc.freeze()
