"""Same-node reads that copy layer after layer (``DeviceRows.copy_runs_by_layer``,
``kvstore.client.strided_copy``): the bytes land where block-by-block copies put them, the
direct read path offers a mark per layer to an early reader, and it falls back to block-by-block
copies where 2-D copies cannot run. CPU here; the ``gpu`` tests run the CUDA 2-D copies.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvstore.block import payload_view
from kvstore.client import device_reads, strided_copy
from kvstore.client.device_copy import DeviceRows, EarlyRows, StagingPool
from kvstore.client.shm_reader import ShmReader
from kvstore.errors import BlockCorrupted
from kvstore.node.block_pool import BlockPool
from tests.client.test_device_reads import LARGE, block_rows, leased_blocks


@pytest.fixture
def arena() -> Iterator[tuple[BlockPool, ShmReader]]:
    pool = BlockPool(16 << 20)
    reader = ShmReader(pool.path)
    yield pool, reader
    reader.close()
    pool.close()


def _runs_of(reader: ShmReader, where: dict, keys: list[bytes], sink: DeviceRows,
             rows: list[int]) -> list[tuple[int, torch.Tensor, int]]:
    locs = [where[k] for k in keys]
    plan = device_reads._runs(locs, rows, sink.row_nbytes, sink.row_stride)
    return [(rows[first], reader.tensor(locs[first].offset,
                                        (count - 1) * sink.row_stride + sink.row_nbytes), count)
            for first, count in plan]


DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_copies_by_layer_land_the_bytes_block_copies_would(arena, device: str) -> None:
    pool, reader = arena
    keys, _, _, lease, where = leased_blocks(pool, 6, seed=3, bad=0)
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        assert reader.pin_for_dma(dev), "the arena is page-locked for the 2-D copies"
    rows = [0, 1, 2, 4, 3, 5]  # two runs and two single blocks
    by_block, by_layer = block_rows(dev, 6, LARGE), block_rows(dev, 6, LARGE)
    by_block.dst.fill_(0x5A)
    by_layer.dst.fill_(0x5A)
    runs = _runs_of(reader, where, list(keys), by_block, rows)
    assert len(runs) == 4
    for row, src, _ in runs:
        by_block.copy_run(row, src)
    marks = by_layer.copy_runs_by_layer(runs, by_layer.payload_offset,
                                        LARGE.payload_nbytes // LARGE.num_layers,
                                        LARGE.num_layers)
    assert marks is not None and len(marks) == LARGE.num_layers
    by_block.wait()
    by_layer.wait()
    # The headers are not copied by layer (only the payloads): compare from the payload on.
    start = by_layer.payload_offset
    assert torch.equal(by_layer.dst[:, start:].cpu(), by_block.dst[:, start:].cpu())
    pool.release(lease.lease_id)


def test_a_run_that_does_not_fit_is_refused(arena) -> None:
    pool, reader = arena
    keys, _, _, lease, where = leased_blocks(pool, 2, seed=4, bad=0)
    sink = block_rows(torch.device("cpu"), 2, LARGE)
    runs = _runs_of(reader, where, list(keys), sink, [0, 1])
    row, src, count = runs[0]
    with pytest.raises(ValueError, match="does not fit"):
        sink.copy_runs_by_layer([(1, src, count)], sink.payload_offset,
                                LARGE.payload_nbytes // LARGE.num_layers, LARGE.num_layers)
    pool.release(lease.lease_id)


@pytest.mark.parametrize("early", [True, False])
def test_the_dma_path_goes_by_layer_for_an_early_reader(arena, monkeypatch, early: bool
                                                        ) -> None:
    """The CUDA direct path's plan, on the CPU: an early reader (one that computes as layers
    land) is offered a mark per layer and gets the same bytes; a plain read copies block
    after block. A rejected block's row is zeroed either way."""
    pool, reader = arena
    keys, tokens, blocks, lease, where = leased_blocks(pool, 5, seed=8, bad=3)
    monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: True)
    sink = block_rows(torch.device("cpu"), 5, LARGE)
    sink.is_cuda = True  # the DMA plan: every copy issued up front, verified beside
    offers: list[tuple] = []
    if early:
        sink.early = EarlyRows()
        real_offer = sink.early.offer
        monkeypatch.setattr(sink.early, "offer", lambda rows, mark, layer_marks=None: (
            offers.append((sorted(rows), layer_marks)), real_offer(rows, mark, layer_marks)))
        monkeypatch.setattr(EarlyRows, "TAKE_WAIT_S", 0.0)
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            list(range(5)), lambda: None, StagingPool())
    if early:
        assert offers == [([0, 1, 2, 3, 4], [None] * LARGE.num_layers)]
    assert isinstance(verdicts[3], BlockCorrupted) and not sink.dst[3].any()
    got = sink.payloads(LARGE)
    for i in (0, 1, 2, 4):
        assert verdicts[i] == len(blocks[i])
        assert torch.equal(got[i].view(torch.int16),
                           payload_view(blocks[i], LARGE).view(torch.int16))
    pool.release(lease.lease_id)


def test_strided_copies_are_off_without_cuda_or_when_asked(monkeypatch) -> None:
    if not torch.cuda.is_available():
        assert not strided_copy.available()
    monkeypatch.setenv("KVSTORE_LAYERED_COPIES", "0")
    assert not strided_copy.available()


@pytest.mark.gpu
def test_a_refused_2d_copy_falls_back_to_block_copies(arena, monkeypatch) -> None:
    pool, reader = arena
    keys, tokens, blocks, lease, where = leased_blocks(pool, 4, seed=2, bad=1)
    dev = torch.device("cuda", 0)
    assert reader.pin_for_dma(dev)

    def refuse(*args, **kwargs) -> None:
        raise RuntimeError("cudaMemcpy2DAsync failed (cudaError 1)")

    monkeypatch.setattr(strided_copy, "copy_2d", refuse)
    sink = block_rows(dev, 4, LARGE)
    sink.early = EarlyRows()
    monkeypatch.setattr(EarlyRows, "TAKE_WAIT_S", 0.0)
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            list(range(4)), lambda: None, StagingPool())
    assert sink.early.layer_marks is None, "no layer marks where no layer copy was issued"
    assert isinstance(verdicts[1], BlockCorrupted)
    for i in (0, 2, 3):
        assert torch.equal(sink.payloads(LARGE)[i].view(torch.int16).cpu(),
                           payload_view(blocks[i], LARGE).view(torch.int16))
    pool.release(lease.lease_id)
