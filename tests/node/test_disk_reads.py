"""BlockFileReader: both read paths bitwise, short and missing files, the pipelined batch in
order, the fallback where O_DIRECT is refused, and an early close that waits for its reads."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.errors import BlockCorrupted, BlockNotFound
from kvstore.node.disk_reads import READ_PATHS, BlockFileReader


def make_file(directory: Path, name: str, nbytes: int, seed: int) -> tuple[str, bytes]:
    """A block-sized file whose length is not a multiple of 4 KiB (O_DIRECT's tail case)."""
    data = bytes((i * 31 + seed) % 251 for i in range(nbytes))
    path = directory / name
    path.write_bytes(data)
    return str(path), data


@pytest.fixture(params=READ_PATHS)
def reader(request: pytest.FixtureRequest) -> Iterator[BlockFileReader]:
    r = BlockFileReader(request.param, num_threads=2)
    yield r
    r.close()


@pytest.mark.parametrize("nbytes", [100, 4096, 3 * 4096 + 320])
def test_read_into_is_bitwise(tmp_path: Path, reader: BlockFileReader, nbytes: int) -> None:
    path, data = make_file(tmp_path, "a", nbytes, 1)
    dest = bytearray(nbytes + 64)  # a destination not aligned to anything, as an arena extent
    view = memoryview(dest)[32:32 + nbytes]
    assert reader.read_into(path, view) == nbytes
    assert bytes(view) == data
    assert dest[:32] == bytes(32) and dest[32 + nbytes:] == bytes(32)  # nothing past it


def test_short_and_missing_files(tmp_path: Path, reader: BlockFileReader) -> None:
    path, _ = make_file(tmp_path, "a", 5000, 2)
    with pytest.raises(BlockCorrupted):
        reader.read_into(path, memoryview(bytearray(9000)))
    with pytest.raises(BlockNotFound):
        reader.read_into(str(tmp_path / "gone"), memoryview(bytearray(10)))


def test_read_many_yields_in_order_with_errors_in_place(tmp_path: Path,
                                                       reader: BlockFileReader) -> None:
    files = [make_file(tmp_path, f"f{i}", 9000, i) for i in range(6)]
    os.unlink(files[2][0])
    Path(files[4][0]).write_bytes(files[4][1][:100])
    dests = [memoryview(bytearray(9000)) for _ in files]
    got = list(reader.read_many([(p, d) for (p, _), d in zip(files, dests, strict=True)]))
    assert isinstance(got[2], BlockNotFound) and isinstance(got[4], BlockCorrupted)
    for i in (0, 1, 3, 5):
        assert got[i] == 9000 and bytes(dests[i]) == files[i][1]


def test_a_filesystem_refusing_o_direct_falls_back_to_buffered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, data = make_file(tmp_path, "a", 5000, 3)
    real_open = os.open

    def no_direct(p: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused")  # as tmpfs answers
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    reader = BlockFileReader("direct")
    dest = memoryview(bytearray(5000))
    assert reader.read_into(path, dest) == 5000 and bytes(dest) == data
    assert reader.read_path == "buffered"


def test_closing_read_many_early_waits_for_reads_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [make_file(tmp_path, f"f{i}", 5000, i) for i in range(3)]
    reader = BlockFileReader("buffered", num_threads=2)
    release = threading.Event()
    real = reader._read_buffered

    def slow(path: str, dest: memoryview) -> int:
        if path == files[1][0]:
            release.wait(10)  # the second read is still going when the caller gives up
        return real(path, dest)

    monkeypatch.setattr(reader, "_read_buffered", slow)
    dests = [memoryview(bytearray(5000)) for _ in files]
    reads = reader.read_many([(p, d) for (p, _), d in zip(files, dests, strict=True)])
    assert next(reads) == 5000
    threading.Timer(0.05, release.set).start()
    reads.close()
    assert bytes(dests[1]) == files[1][1]  # written before close returned, never after
    reader.close()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockFileReader("mmap")
    with pytest.raises(ValueError):
        BlockFileReader("direct", num_threads=0)
