"""Payload checksums on the device (``kvstore.client.device_checksum``) against python-xxhash,
and the same-node read that uses them (``device_reads._direct``).

The host half (the merge) runs everywhere; the kernel runs on a GPU (``gpu``) and, where Triton
is installed, in Triton's interpreter on the CPU; the read's use of it runs on the CPU with the
kernel replaced by python-xxhash over the same rows.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvstore.block import block_nbytes, payload_offset, payload_view
from kvstore.client import device_checksum, device_reads
from kvstore.client.device_copy import DeviceRows, StagingPool
from kvstore.client.shm_reader import ShmReader
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockPool
from tests.node.test_store_server import make_blocks
from tests.support.arena import corrupt_in_arena

ROOT = Path(__file__).resolve().parents[2]
LARGE = Namespace("test-model", "float16", 16, 24, 2, 128)  # 384 KiB payloads
#: Payload sizes: the shortest long input, whole and partial 1 KiB blocks, a last stripe that
#: overlaps the one before it, and a real block's 2 MiB.
SIZES = (248, 1024, 1088, 4096, 4992, 8128, 2 << 20)
M64 = (1 << 64) - 1


def reference_accumulators(data: bytes) -> list[int]:
    """XXH3-64's accumulators before the merge, straight from the specification's loops."""
    secret = device_checksum.SECRET
    p32, p64 = device_checksum.PRIME32, device_checksum.PRIME64
    acc = [p32[2], p64[0], p64[1], p64[2], p64[3], p32[1], p64[4], p32[0]]

    def word(buf: bytes, offset: int) -> int:
        return struct.unpack_from("<Q", buf, offset)[0]

    def stripe(offset: int, secret_offset: int) -> None:
        for i in range(8):
            value = word(data, offset + 8 * i)
            mixed = value ^ word(secret, secret_offset + 8 * i)
            acc[i ^ 1] = (acc[i ^ 1] + value) & M64
            acc[i] = (acc[i] + (mixed & 0xFFFFFFFF) * (mixed >> 32)) & M64

    n = len(data)
    blocks = (n - 1) // 1024
    for b in range(blocks):
        for s in range(16):
            stripe(b * 1024 + s * 64, s * 8)
        for i in range(8):
            a = acc[i] ^ (acc[i] >> 47) ^ word(secret, 128 + 8 * i)
            acc[i] = (a * p32[0]) & M64
    for s in range(((n - 1) - blocks * 1024) // 64):
        stripe(blocks * 1024 + s * 64, s * 8)
    stripe(n - 64, 121)
    return acc


@pytest.mark.parametrize("nbytes", [248, 1024, 1088, 4992])
def test_the_merge_of_the_specifications_accumulators_is_xxh3(nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    accs = np.array([reference_accumulators(data)], dtype=np.uint64).view(np.int64)
    assert int(device_checksum.digests(accs, nbytes)[0]) == xxhash.xxh3_64_intdigest(data)


def random_rows(device: torch.device, num: int, stride: int) -> torch.Tensor:
    rng = np.random.default_rng(stride)
    return torch.from_numpy(rng.integers(0, 256, (num, stride), dtype=np.uint8)).to(device)


def expected(rows: torch.Tensor, which: list[int], offset: int, nbytes: int) -> list[int]:
    host = rows.cpu().numpy()
    return [xxhash.xxh3_64_intdigest(host[r, offset:offset + nbytes].tobytes()) for r in which]


@pytest.mark.gpu
def test_the_kernel_on_cuda_is_xxh3() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert device_checksum.usable(device)
    rows = random_rows(device, 5, (2 << 20) + 128)
    for nbytes in SIZES:
        for offset in (0, 64, 120):
            got = device_checksum.checksums(rows, [4, 0, 2], offset, nbytes)
            assert got.tolist() == expected(rows, [4, 0, 2], offset, nbytes), (nbytes, offset)
    assert device_checksum.checksums(rows, [], 0, 4096).size == 0


INTERPRETED = """
import torch
from kvstore.client import device_checksum
from tests.client.test_device_checksum import expected, random_rows
rows = random_rows(torch.device("cpu"), 4, 8192)
assert device_checksum.usable(torch.device("cpu"))
for nbytes in (248, 1024, 1088, 4096, 4992, 8128):
    got = device_checksum.checksums(rows, [3, 1], 64 if nbytes < 8128 else 0, nbytes)
    assert got.tolist() == expected(rows, [3, 1], 64 if nbytes < 8128 else 0, nbytes), nbytes
print("same")
"""


def test_the_kernel_in_tritons_interpreter_is_xxh3() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with torch's CUDA builds)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "same" in out.stdout, out.stderr[-3000:]


def test_it_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_DEVICE_CHECKSUM", "0")
    assert not device_checksum.usable(torch.device("cuda"))
    monkeypatch.delenv("KVSTORE_DEVICE_CHECKSUM")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not device_checksum.usable(torch.device("cpu"))  # the host hashes CPU rows itself


# -- the same-node read that uses it -------------------------------------------------------------


@pytest.fixture
def leased():
    """Five LARGE blocks back to back in an arena, block 1 corrupted, all leased."""
    pool = BlockPool(16 << 20)
    reader = ShmReader(pool.path)
    keys, tokens, blocks = make_blocks(LARGE, 5, seed=3)
    for key, block in zip(keys, blocks, strict=True):
        pool.put(key, block)
    corrupt_in_arena(pool, keys[1])
    lease = pool.lease(keys, 30)
    yield reader, keys, tokens, blocks, {loc.key: loc for loc in lease.locations}
    pool.release(lease.lease_id)
    reader.close()
    pool.close()


def dma_rows(num: int) -> DeviceRows:
    """CPU rows that take the CUDA read plan (copies first, checks beside), as in
    test_device_reads: the plan is the same on any device."""
    sink = DeviceRows(torch.device("cpu"), num, block_nbytes(LARGE),
                      payload_offset=payload_offset(LARGE))
    sink.is_cuda = True
    return sink


def host_checksums(calls: list[list[int]]):
    def checksums(rows: torch.Tensor, which, offset: int, nbytes: int) -> np.ndarray:
        calls.append(list(which))
        return np.array(expected(rows, list(which), offset, nbytes), dtype=np.uint64)
    return checksums


def test_a_direct_read_checks_headers_on_the_host_and_payloads_on_the_device(
        leased, monkeypatch) -> None:
    reader, keys, tokens, blocks, where = leased
    calls: list[list[int]] = []
    monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: True)
    monkeypatch.setattr(device_checksum, "usable", lambda device: True)
    monkeypatch.setattr(device_checksum, "checksums", host_checksums(calls))
    hashed: list[bool] = []
    real_verify = device_reads.verify_block

    def verify(*args, verify_checksum: bool = True, **kwargs):
        hashed.append(verify_checksum)
        return real_verify(*args, verify_checksum=verify_checksum, **kwargs)

    monkeypatch.setattr(device_reads, "verify_block", verify)
    asked = [tokens[0], tokens[1], tokens[2], [t + 1 for t in tokens[3]], tokens[4]]
    sink = dma_rows(5)
    rows = [4, 3, 2, 1, 0]
    verdicts = device_reads.shm_into_device(reader, where, list(keys), asked, LARGE, sink, rows,
                                            lambda: None, StagingPool())
    assert hashed and not any(hashed), "the host checks headers only"
    assert calls == [[4, 3, 2, 0]], "every block whose header passed, hashed in one call"
    assert isinstance(verdicts[1], BlockCorrupted) and "checksum" in str(verdicts[1])
    assert isinstance(verdicts[3], BlockMismatch)  # other tokens: refused by its header
    assert not sink.dst[3].any() and not sink.dst[1].any(), "rejected rows are zeroed"
    got = sink.payloads(LARGE)
    for i in (0, 2, 4):
        assert verdicts[i] == len(blocks[i])
        assert torch.equal(got[rows[i]].view(torch.int16),
                           payload_view(blocks[i], LARGE).view(torch.int16))


def test_a_kernel_that_fails_leaves_the_checks_to_the_host(leased, monkeypatch) -> None:
    reader, keys, tokens, blocks, where = leased
    monkeypatch.setattr(device_reads, "reads_directly", lambda sink, reader: True)
    monkeypatch.setattr(device_checksum, "_broken", False)
    monkeypatch.setattr(device_checksum, "_load", lambda: object())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # "usable" on CPU rows

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(device_checksum, "checksums", fails)
    sink = dma_rows(5)
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            [0, 1, 2, 3, 4], lambda: None, StagingPool())
    assert isinstance(verdicts[1], BlockCorrupted) and not sink.dst[1].any()
    assert [verdicts[i] for i in (0, 2, 3, 4)] == [len(blocks[i]) for i in (0, 2, 3, 4)]
    assert not device_checksum.usable(torch.device("cpu")), "the host checks from now on"


@pytest.mark.gpu
def test_a_cuda_read_hashes_on_the_device(leased, monkeypatch) -> None:
    reader, keys, tokens, blocks, where = leased
    device = torch.device("cuda", torch.cuda.current_device())
    reader.pin_for_dma(device)  # page-locks the arena and compiles the kernel (a first call)
    calls: list[int] = []
    real = device_checksum.checksums
    monkeypatch.setattr(device_checksum, "checksums",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    sink = DeviceRows(device, 5, block_nbytes(LARGE), payload_offset=payload_offset(LARGE))
    verdicts = device_reads.shm_into_device(reader, where, list(keys), tokens, LARGE, sink,
                                            [0, 1, 2, 3, 4], lambda: None, StagingPool())
    assert calls == [1]
    assert isinstance(verdicts[1], BlockCorrupted) and not sink.dst[1].any()
    got = sink.payloads(LARGE)
    for i in (0, 2, 3, 4):
        assert torch.equal(got[i].cpu().view(torch.int16),
                           payload_view(blocks[i], LARGE).view(torch.int16))
