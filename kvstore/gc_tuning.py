"""Garbage-collector settings for kvstore's long-running server processes.

A store node and the coordinator import torch, Ray, gRPC and protobuf: hundreds of thousands
of objects that live as long as the process. CPython's full collection walks every tracked
object, so without a freeze each full collection pauses the process long enough to land in
the tail latency of whichever request (a Put's commit, say) triggered it.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> None:
    """Move every object alive now out of the collector's reach (``gc.freeze``), once the
    process has started: full collections then walk only what was created since. Objects
    created later are collected normally."""
    gc.collect()
    gc.freeze()
