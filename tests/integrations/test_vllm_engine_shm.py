"""A replica finds the shared-memory segments its child processes map, and removes them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.integrations.vllm.engine_shm import SHM_DIR, engine_segments, remove_segments

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists() or not SHM_DIR.is_dir(),
                                reason="needs Linux's /proc and /dev/shm")

#: A child that creates a segment, says its name, and keeps it mapped until killed; its
#: resource tracker is told to forget it, as a killed replica's tracker dies with it.
CHILD = ("import time\nfrom multiprocessing import resource_tracker, shared_memory\n"
         "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
         "resource_tracker.unregister(shm._name, 'shared_memory')\n"
         "print(shm.name, flush=True)\ntime.sleep(120)\n")


def test_a_childs_segment_is_found_and_removed_after_it_dies() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip()
        assert name.startswith("psm_")
        deadline = time.monotonic() + 10
        while name not in (found := engine_segments()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert name in found
    finally:
        child.kill()  # as Ray kills a replica: nobody unlinks the segment
        child.wait(10)
    assert (SHM_DIR / name).exists()
    assert remove_segments({name, "psm_not-there"}) == 1
    assert not (SHM_DIR / name).exists()
    assert remove_segments({"../etc", "other"}) == 0  # only psm_ names, never a path
