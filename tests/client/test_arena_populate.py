"""The arena mapped ahead of reads: after ``ShmReader.populate`` a pass over every page takes
no page faults, where a fresh mapping takes one every few pages; unmapping stops it."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import arena_populate
from kvstore.client.shm_reader import ShmReader
from kvstore.node.arena import Arena

SIZE = 32 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or tuple(int(x) for x in os.uname().release.split(".")[:2]) < (5, 14),
    reason="MADV_POPULATE_READ is Linux 5.14's")


@pytest.fixture
def arena() -> Iterator[str]:
    """A store node's arena (a file in /dev/shm, every page allocated), bytes 0..255 over."""
    pool = Arena(SIZE)
    try:
        pool.view[:] = np.arange(SIZE, dtype=np.uint8).tobytes()
        yield pool.path
    finally:
        pool.close()


def faults_reading_every_page(reader: ShmReader) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(reader.view(0, SIZE), dtype=np.uint8)[::PAGE].max()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_populated_arena_reads_without_page_faults(arena: str) -> None:
    with ShmReader(arena) as fresh:
        # The kernel maps at most 16 pages of a tmpfs file per fault.
        assert faults_reading_every_page(fresh) >= SIZE // PAGE // 16 // 2
    with ShmReader(arena) as reader:
        populator = reader.populate()
        populator.join(timeout=60)
        assert populator.done and populator.mapped == SIZE
        assert reader.populate() is populator  # once per reader
        assert faults_reading_every_page(reader) < SIZE // PAGE // 64


def test_unmapping_stops_the_populator_first(arena: str, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    monkeypatch.setattr(arena_populate, "STEP", 1 << 20)  # 32 steps to stop between
    reader = ShmReader(arena)
    populator = reader.populate()
    reader.close()  # never unmaps under the kernel's feet: waits for the current step
    assert not populator._thread.is_alive()
    assert populator.mapped % (1 << 20) == 0 and populator.mapped <= SIZE


def test_a_kernel_that_refuses_leaves_reads_as_they_were(arena: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_populate, "MADV_POPULATE_READ", 0x7FFF)  # EINVAL, as before 5.14
    with ShmReader(arena) as reader:
        populator = reader.populate()
        populator.join(timeout=60)
        assert not populator.done and populator.mapped == 0
        assert np.frombuffer(reader.view(0, SIZE), dtype=np.uint8)[PAGE * 3] == (PAGE * 3) % 256
