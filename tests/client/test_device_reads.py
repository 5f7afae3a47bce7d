"""The device read path's parts: the verify pool, device rows, staging, and same-node reads into
device rows against a pool arena (CPU here; the ``gpu`` tests run the CUDA branches).

End to end through store nodes: ``tests/client/test_cluster_store_device.py``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvstore.block import block_nbytes, payload_offset, payload_view
from kvstore.client import device_reads, verify_pool
from kvstore.client.device_copy import DeviceRows, StagingPool, register_host, target_device
from kvstore.client.shm_reader import ShmReader
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockLocation, BlockPool
from tests.node.test_store_server import make_blocks
from tests.support.arena import corrupt_in_arena

LARGE = Namespace("test-model", "float16", 16, 24, 2, 128)  # 384 KiB payloads: block by block
SMALL = Namespace("test-model", "float16", 16, 2, 2, 8)  # 2 KiB payloads: a batch at a time


# -- the verify pool ----------------------------------------------------------------------------


def test_parallel_map_keeps_order_and_uses_threads() -> None:
    seen: set[str] = set()

    def work(i: int) -> int:
        seen.add(threading.current_thread().name)
        time.sleep(0.002)  # the GIL is free: others take items meanwhile
        return i * i

    assert verify_pool.parallel_map(work, 50) == [i * i for i in range(50)]
    assert verify_pool.parallel_map(work, 0) == []
    if verify_pool.num_threads() > 1:
        assert len(seen) > 1
    seen.clear()
    verify_pool.parallel_map(work, 8, nbytes=1000)  # too few bytes to be worth a thread
    assert seen == {threading.current_thread().name}
    seen.clear()
    assert verify_pool.parallel_map(work, 30, max_threads=2) == [i * i for i in range(30)]
    assert len(seen) <= 2


def test_parallel_map_raises_after_every_started_item_finished() -> None:
    done: list[int] = []

    def work(i: int) -> int:
        if i == 3:
            raise KeyError(i)
        time.sleep(0.005)
        done.append(i)
        return i

    with pytest.raises(KeyError):
        verify_pool.parallel_map(work, 40)
    count = len(done)
    time.sleep(0.05)
    assert len(done) == count  # nothing still running once it raised
    assert count < 39  # items not started when it failed were skipped


def test_parallel_map_nested_in_a_busy_pool_does_not_deadlock() -> None:
    def outer(i: int) -> int:
        return sum(verify_pool.parallel_map(lambda j: i + j, 20))

    result: list[list[int]] = []
    n = 4 * verify_pool.num_threads()
    thread = threading.Thread(target=lambda: result.append(verify_pool.parallel_map(outer, n)))
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "nested parallel_map deadlocked"
    assert result[0] == [sum(i + j for j in range(20)) for i in range(n)]


# -- targets, rows, staging ---------------------------------------------------------------------


def test_target_device() -> None:
    assert target_device(None) is None
    assert target_device("cpu") == torch.device("cpu")
    assert target_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        target_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            target_device("cuda")


def test_device_rows_copy_place_and_zero_on_cpu() -> None:
    sink = DeviceRows(torch.device("cpu"), 4, 8)
    sink.dst.fill_(0xAB)
    sink.copy(1, torch.arange(8, dtype=torch.uint8))
    stage = torch.arange(30, dtype=torch.uint8).view(3, 10)
    sink.copy_rows(stage, [0, 1], [2, 3], slice(1, 9))  # a run: one slice copy
    sink.wait()
    assert sink.dst[1].tolist() == list(range(8))
    assert sink.dst[2].tolist() == list(range(1, 9))
    assert sink.dst[3].tolist() == list(range(11, 19))
    sink.copy_rows(stage, [2, 0], [0, 1], slice(2, 10))  # scattered rows
    assert sink.dst[0].tolist() == list(range(22, 30))
    assert sink.dst[1].tolist() == list(range(2, 10))
    sink.zero([0, 3])
    assert not sink.dst[0].any() and not sink.dst[3].any() and sink.dst[2].any()
    ns = Namespace("m", "float16", 1, 1, 1, 2)  # 2 x 1 x 1 x 2 halves = 8 bytes
    views = sink.payloads(ns)
    assert len(views) == 4 and views[2].shape == ns.payload_shape
    assert views[2].data_ptr() == sink.dst.data_ptr() + 16


def test_staging_pool_reuses_buffers_and_keeps_few() -> None:
    pool = StagingPool(max_idle=2)
    with pool.rows(3, 1000, pinned=False) as a:
        ptr = a.data_ptr()
        assert a.shape == (3, 1000) and a.dtype == torch.uint8
    with pool.rows(2, 1500, pinned=False) as b:  # fits the same buffer
        assert b.data_ptr() == ptr
        with pool.rows(1, 10, pinned=False) as c:  # the first is busy: another one
            assert c.data_ptr() != ptr
    with pool.rows(4, 3 << 20, pinned=False), pool.rows(1, 1, pinned=False), \
            pool.rows(1, 1, pinned=False):
        pass
    assert len(pool._idle) == 2  # the smallest were dropped
    pool.close()
    assert not pool._idle


def test_register_host_refusal_is_logged_not_raised(caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("registers for real with CUDA")
    buf = np.zeros(4096, dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvstore.client.device_copy"):
        assert register_host(buf.ctypes.data, buf.size, "a test buffer") is False
    assert "staging" in caplog.text


# -- same-node reads into device rows ------------------------------------------------------------


@pytest.fixture
def arena() -> Iterator[tuple[BlockPool, ShmReader]]:
    pool = BlockPool(16 << 20)
    reader = ShmReader(pool.path)
    yield pool, reader
    reader.close()  # after tensor views were handed out: the mapping still closes
    pool.close()
    assert not os.path.exists(pool.path)


def block_rows(device: torch.device, num_rows: int, ns: Namespace) -> DeviceRows:
    """Rows of whole blocks, as ``ClusterStore`` reads into."""
    return DeviceRows(device, num_rows, block_nbytes(ns), payload_offset=payload_offset(ns))


@pytest.mark.parametrize("layout", ["payloads", "blocks"])
@pytest.mark.parametrize("way", ["direct", "staged"])
@pytest.mark.parametrize("ns", [LARGE, SMALL], ids=["large", "small"])
def test_shm_into_device_rows(arena, monkeypatch, ns: Namespace, way: str, layout: str) -> None:
    pool, reader = arena
    keys, tokens, blocks = make_blocks(ns, 4, seed=5)
    for key, block in zip(keys, blocks, strict=True):
        pool.put(key, block)
    corrupt_in_arena(pool, keys[1])
    asked = [tokens[0], tokens[1], [t + 1 for t in tokens[2]], tokens[3]]
    lease = pool.lease(keys[:3], 30)  # keys[3] is "not held": left out of the lease
    where = {loc.key: loc for loc in lease.locations}
    if way == "staged":
        monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: False)
    sink = DeviceRows(torch.device("cpu"), 6, ns.payload_nbytes) if layout == "payloads" \
        else block_rows(torch.device("cpu"), 6, ns)
    sink.dst.fill_(0xAB)
    renewals: list[int] = []
    rows = [5, 0, 2, 3]  # any row order
    verdicts = device_reads.shm_into_device(reader, where, list(keys), asked, ns, sink, rows,
                                            lambda: renewals.append(1), StagingPool())
    assert verdicts[0] == len(blocks[0]) and verdicts[3] is None
    assert isinstance(verdicts[1], BlockCorrupted) and isinstance(verdicts[2], BlockMismatch)
    assert verdicts[1].__traceback__ is None  # detached: no frame keeps the arena mapped
    assert renewals, "keep_alive runs while blocks are copied"
    got = sink.payloads(ns)[5]
    assert torch.equal(got.view(torch.int16), payload_view(blocks[0], ns).view(torch.int16))
    for row in (0, 2, 3):  # rejected and absent blocks never reach their rows on the CPU
        assert bool((sink.dst[row] == 0xAB).all())
    pool.release(lease.lease_id)


def test_runs_join_blocks_adjacent_in_the_arena_and_in_the_rows() -> None:
    loc = [BlockLocation(b"", off, 100) for off in (0, 128, 256, 512, 640)]
    # 0-1-2 adjacent (stride 128), 3-4 adjacent; a gap between 2 and 3.
    assert device_reads._runs(loc, [0, 1, 2, 3, 4], 100, 128) == [(0, 3), (3, 2)]
    # Rows out of order break a run; absent and wrong-sized blocks are left out.
    assert device_reads._runs(loc, [0, 2, 1, 3, 4], 100, 128) == [(0, 1), (1, 1), (2, 1),
                                                                  (3, 2)]
    odd = [loc[0], None, loc[2], BlockLocation(b"", 384, 99), loc[4]]
    assert device_reads._runs(odd, [0, 1, 2, 3, 4], 100, 128) == [(0, 1), (2, 1), (4, 1)]


def leased_blocks(pool: BlockPool, num: int, seed: int, bad: int):
    """``num`` LARGE blocks stored in ``pool`` (block ``bad`` corrupted in the arena) and a
    lease on all of them: keys, tokens, blocks, the lease and its locations by key."""
    keys, tokens, blocks = make_blocks(LARGE, num, seed=seed)
    for key, block in zip(keys, blocks, strict=True):
        pool.put(key, block)
    corrupt_in_arena(pool, keys[bad])
    lease = pool.lease(keys, 30)
    return keys, tokens, blocks, lease, {loc.key: loc for loc in lease.locations}


def test_the_dma_path_copies_each_run_of_adjacent_blocks_once(arena, monkeypatch) -> None:
    """The CUDA direct path's copy plan, on the CPU: blocks stored back to back move as one
    copy per run, the copies land before the verdicts are returned, and a rejected block's
    row is zeroed after its run was copied."""
    pool, reader = arena
    keys, tokens, blocks, lease, where = leased_blocks(pool, 6, seed=9, bad=2)
    offsets = sorted(loc.offset for loc in lease.locations)
    assert offsets == [offsets[0] + i * offsets[1] - i * offsets[0] for i in range(6)], \
        "a fresh pool stores blocks back to back"
    monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: True)
    sink = block_rows(torch.device("cpu"), 6, LARGE)
    sink.is_cuda = True  # the DMA plan: every run issued up front, verified beside
    runs: list[int] = []
    real = sink.copy_run
    monkeypatch.setattr(sink, "copy_run", lambda row, src: (runs.append(row), real(row, src)))
    rows = [0, 1, 2, 3, 5, 4]  # the last two swap rows: their run splits
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            rows, lambda: None, StagingPool())
    assert runs == [0, 5, 4]  # blocks 0-3 in one copy, then 4 and 5 apart
    assert isinstance(verdicts[2], BlockCorrupted) and not sink.dst[2].any()
    got = sink.payloads(LARGE)
    for i in (0, 1, 3, 4, 5):
        assert verdicts[i] == len(blocks[i])
        assert torch.equal(got[rows[i]].view(torch.int16),
                           payload_view(blocks[i], LARGE).view(torch.int16))
    pool.release(lease.lease_id)


def test_staged_parts_alternate_between_two_buffers(monkeypatch) -> None:
    """A batch larger than the staging size lands part by part in two alternating buffers
    (one being copied while the next lands), every block in its row."""
    monkeypatch.setattr(device_reads, "STAGING_BYTES", 2 * block_nbytes(SMALL))
    keys, tokens, blocks = make_blocks(SMALL, 7, seed=4)
    staging = StagingPool()
    seen: list[int] = []

    def land(lo: int, hi: int, stage: torch.Tensor) -> tuple[list[int], range]:
        seen.append(stage.data_ptr())
        for j in range(hi - lo):
            stage[j].copy_(torch.frombuffer(bytearray(blocks[lo + j]), dtype=torch.uint8))
        return [len(blocks[lo + j]) for j in range(hi - lo)], range(hi - lo)

    sink = block_rows(torch.device("cpu"), 7, SMALL)
    rows = [6, 5, 4, 3, 2, 1, 0]
    verdicts = device_reads.staged_into_device(land, 7, SMALL, sink, rows, staging)
    assert verdicts == [len(b) for b in blocks]
    assert len(seen) == 4 and seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
    for i, block in enumerate(blocks):
        assert bytes(sink.dst[rows[i], :len(block)].numpy()) == bytes(block)


def test_shm_reader_tensor_is_a_bounded_view(arena) -> None:
    pool, reader = arena
    keys, _, blocks = make_blocks(SMALL, 1)
    pool.put(keys[0], blocks[0])
    loc = pool.lease(keys, 5).locations[0]
    view = reader.tensor(loc.offset, loc.nbytes)
    assert view.dtype == torch.uint8 and bytes(view.numpy()) == bytes(blocks[0])
    with pytest.raises(ValueError, match="outside"):
        reader.tensor(reader.size - 8, 64)
    del view


# -- on a CUDA device (skipped without one) ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("way", ["direct", "staged"])
def test_cuda_shm_into_device_rows(arena, monkeypatch, way: str) -> None:
    pool, reader = arena
    keys, tokens, blocks, lease, where = leased_blocks(pool, 3, seed=6, bad=1)
    if way == "staged":
        monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: False)
    sink = block_rows(torch.device("cuda", torch.cuda.current_device()), 3, LARGE)
    reader.pin_for_dma(sink.device)  # registered before the read: the direct way is taken
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            [0, 1, 2], lambda: None, StagingPool())
    assert isinstance(verdicts[1], BlockCorrupted)
    assert not sink.dst[1].any(), "a rejected block's DMA'd bytes are zeroed"
    for i in (0, 2):
        want = payload_view(blocks[i], LARGE).view(torch.int16)
        assert torch.equal(sink.payloads(LARGE)[i].view(torch.int16).cpu(), want)
    pool.release(lease.lease_id)
