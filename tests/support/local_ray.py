"""Private Ray starts in tests that survive one slow start.

Ray gives a new raylet 30 s to register with the GCS (``ray/_private/node.py``, not
configurable), and a new GCS 30 s to write its port file (``RAY_gcs_server_port_wait_time_s``,
which tests/conftest.py raises). On a loaded 2-core CI box a start can miss either and raise
"The current node timed out during startup" or "Timed out waiting for file .../gcs_server_port_..."
although nothing is wrong with the test. ``start_surviving_slow`` then stops what the
half-finished start spawned (its processes, found as new children of this process, killed by
PID; Ray forgets the failed node with them) and starts once more. Any other error is raised at
once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import ray

log = logging.getLogger(__name__)

#: Starts tried in all (the first and one retry).
LOCAL_RAY_STARTS = 2
#: What Ray's errors say when a start was only slow: the raylet, or the GCS's port file.
_SLOW_STARTS = ("timed out during startup", "Timed out waiting for file")
T = TypeVar("T")


def _descendants() -> set[int]:
    try:
        return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    except psutil.Error:
        return set()


def _kill(pids: set[int]) -> None:
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def start_surviving_slow(start: Callable[[], T], *, what: str = "local Ray") -> T:
    """``start()``; after one of Ray's start-up timeouts, clean up and call it once more."""
    for attempt in range(1, LOCAL_RAY_STARTS + 1):
        before = _descendants()
        try:
            return start()
        except Exception as exc:
            slow = any(sign in str(exc) for sign in _SLOW_STARTS)
            if not slow or attempt == LOCAL_RAY_STARTS:
                raise
            log.warning("%s start %d timed out (a busy machine); starting again", what, attempt)
            ray.shutdown()
            _kill(_descendants() - before)
    raise AssertionError("unreachable")


def init_local_ray(**kwargs: Any) -> None:
    """``ray.init(address="local", **kwargs)``: never another process's running cluster."""
    start_surviving_slow(lambda: ray.init(address="local", **kwargs))
