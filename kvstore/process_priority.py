"""Servers on the data path run at normal priority, not at the niceness Ray gives its workers.

Ray starts every worker process, each actor's among them, at nice 15 (``RAY_worker_niceness``),
so that a busy task never starves its own control plane. A kvstore server inside an actor is on
its readers' path, though: the store node answers leases and fetches, the coordinator's index
service answers lookups and publishes. At nice 15, any process of normal priority on the
same core (a vLLM engine polling for its worker, a model's forward) gets nearly all of that
core while a reader waits (``benchmarks/bench_node_priority.py`` measures it).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def serve_at_normal_priority(role: str) -> bool:
    """Undo Ray's worker niceness for this process, every thread of it, whose later threads
    then start at normal priority too; whether it runs at 0 or better. ``role`` names the
    server in the warning given where it may not (raising a priority needs root or
    CAP_SYS_NICE): it then stays as Ray started it and says how to start it at normal
    priority."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
            return True
        # Linux: each thread has a niceness of its own; elsewhere the process has one
        tasks = "/proc/self/task"
        for tid in os.listdir(tasks) if os.path.isdir(tasks) else ["0"]:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
            except ProcessLookupError:  # a thread that has ended since
                continue
    except (OSError, AttributeError) as exc:  # no right to (or no priorities here)
        log.warning("%s runs at Ray's worker niceness, behind every process of normal "
                    "priority on its cores (%s): start Ray with RAY_worker_niceness=0 or give "
                    "it CAP_SYS_NICE", role, exc)
        return False
    return True
