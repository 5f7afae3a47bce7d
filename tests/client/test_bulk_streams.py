"""The bulk channel's client splitting a large read over several connections: every block in
its own buffer whatever the split, and one stream failing fails the whole read. The servers are
``tests/node/test_bulk.py``'s (a BulkServer over a real BlockPool on loopback)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvstore.config import ServerConfig
from kvstore.errors import NodeUnavailable
from tests.node.test_bulk import TOKEN, Node


@pytest.fixture
def node() -> Iterator[Node]:
    served = Node(ServerConfig(auth_token=TOKEN))
    yield served
    served.close()


@pytest.mark.parametrize("streams", [1, 2, 5])
def test_a_large_read_split_over_several_streams_returns_every_block_in_place(
        node: Node, streams: int) -> None:
    """Requests of one block each, split over up to ``streams`` connections: every block in
    its own buffer, absent keys as None, and ``on_batch`` sees each request's blocks once."""
    client = node.client(request_blocks=1, pipeline_depth=2, streams=streams)
    keys = [*node.keys_a, b"\x07" * 32, *node.keys_b, *node.keys_a]
    want = [*node.blocks_a, None, *node.blocks_b, *node.blocks_a]
    bufs = [bytearray(len(node.blocks_a[0])) for _ in keys]
    seen: list[tuple[int, list[int | None]]] = []
    lock = threading.Lock()

    def on_batch(lo: int, sizes: list[int | None]) -> None:
        with lock:
            seen.append((lo, sizes))

    sizes = client.fetch_into(keys, lambda i, n: memoryview(bufs[i]), on_batch)
    assert [None if s is None else bytes(bufs[i][:s]) for i, s in enumerate(sizes)] == want
    assert sorted(lo for lo, _ in seen) == list(range(len(keys)))
    client.close()


def test_a_stream_that_fails_fails_the_whole_read(node: Node) -> None:
    """One of several connections losing the node is a NodeUnavailable for the call, not a
    partial answer."""
    client = node.client(request_blocks=1, streams=3)
    keys = node.keys_a * 3

    def alloc(i: int, n: int) -> memoryview:
        if i == 7:
            node.server.stop()
            raise NodeUnavailable("the node went away")
        return memoryview(bytearray(n))

    with pytest.raises(NodeUnavailable):
        client.fetch_into(keys, alloc)
    client.close()
