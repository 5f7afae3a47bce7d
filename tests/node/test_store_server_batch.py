"""Batch Put messages (``PutChunk.keys``) and the unary ``PutBatch``: the same verdicts, errors
and visibility as one message per block, against that path as the reference."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from kvstore.config import ServerConfig
from kvstore.constants import align_up
from kvstore.index.memory import InMemoryIndex
from kvstore.node.block_pool import BlockPool
from kvstore.node.grpc_setup import grpc_options
from kvstore.node.proto_forms import spec_from_namespace
from kvstore.node.store_server import StoreServer
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from tests.node.test_store_server import make_blocks, make_namespace, put_messages


@pytest.fixture
def make_node() -> Iterator:
    """A factory of fresh nodes (server, stub, index, pool), all stopped at the end."""
    made = []

    def make(capacity: int = 8 << 20
             ) -> tuple[StoreServer, pb_grpc.StoreNodeStub, InMemoryIndex, BlockPool]:
        pool, index = BlockPool(capacity), InMemoryIndex()
        server = StoreServer(pool, "node-a", ServerConfig(max_message_bytes=4 << 20),
                             on_publish=index.publish)
        server.start()
        channel = grpc.insecure_channel(server.addresses[0], options=grpc_options(16 << 20))
        made.append((server, channel, pool))
        return server, pb_grpc.StoreNodeStub(channel), index, pool

    yield make
    for server, channel, pool in made:
        channel.close()
        server.stop(0)
        pool.close()


def batch_request(ns, keys: list[bytes], blocks: list[bytearray]) -> pb.PutBatchRequest:
    msg = pb.PutChunk(keys=keys, total_nbytes=len(blocks[0]), data=b"".join(blocks))
    msg.namespace.CopyFrom(spec_from_namespace(ns))
    return pb.PutBatchRequest(chunks=[msg])


def outcome(call) -> tuple[object, ...]:
    try:
        resp = call()
    except grpc.RpcError as exc:
        return (exc.code(), exc.details())
    return (resp.num_stored, resp.num_existing)


@pytest.mark.parametrize("damage", ["none", "payload", "header", "key", "short_key"])
def test_put_batch_matches_one_message_per_block(make_node, damage: str) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 6)
    asked = list(keys)
    if damage == "payload":
        blocks[3][-1] ^= 0xFF
    elif damage == "header":
        blocks[3][40] ^= 0x01
    elif damage == "key":
        asked[3] = keys[5]
    elif damage == "short_key":
        asked[3] = keys[3][:31]
    results = []
    for via_batch in (False, True):
        _, stub, index, pool = make_node()
        if via_batch:
            got = outcome(lambda s=stub: s.PutBatch(batch_request(ns, asked, blocks)))
        else:
            got = outcome(lambda s=stub: s.Put(put_messages(ns, asked, blocks)))
        held = [pool.contains(k) for k in keys]
        visible = index.lookup_prefix(keys).num_blocks
        results.append((got, held, visible, pool.stats().used_bytes))
    assert results[0] == results[1]
    if damage != "none":
        assert results[1][0][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert results[1][1] == [True] * 3 + [False] * 3  # the good blocks before it are kept


@pytest.mark.parametrize("room_for", [0, 1, 3, 6])
def test_a_pool_that_fills_part_way_keeps_what_fit_as_per_block(make_node, room_for: int
                                                                 ) -> None:
    """A batch is stored a run at a time (``reserve_many``): a pool with room for only some
    blocks keeps and publishes those, as one message per block does, and refuses the rest."""
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 6)
    capacity = max(1, room_for) * align_up(len(blocks[0]))
    results = []
    for via_batch in (False, True):
        _, stub, index, pool = make_node(capacity)
        if room_for == 0:  # full of another block
            assert pool.put(bytes(32), bytes(capacity))
        if via_batch:
            got = outcome(lambda s=stub: s.PutBatch(batch_request(ns, keys, blocks)))
        else:
            got = outcome(lambda s=stub: s.Put(put_messages(ns, keys, blocks)))
        held = [pool.contains(k) for k in keys]
        results.append((got, held, index.lookup_prefix(keys).num_blocks))
    assert results[0] == results[1]
    assert results[1][1] == [True] * room_for + [False] * (6 - room_for)
    assert results[1][2] == room_for
    if room_for < 6:
        assert results[1][0][0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_held_blocks_are_drained_in_a_batch_as_per_block(make_node) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 4)
    _, stub, index, pool = make_node()
    assert stub.PutBatch(batch_request(ns, keys[:2], blocks[:2])).num_stored == 2
    blocks[1][-1] ^= 0xFF  # a held key's bytes are not read again: blocks are immutable
    resp = stub.PutBatch(batch_request(ns, keys, blocks))
    assert (resp.num_stored, resp.num_existing) == (2, 2)
    assert index.lookup_prefix(keys).num_blocks == 4


@pytest.mark.parametrize("num_blocks", [1, 7, 300])
def test_hand_encoded_put_batch_parses_as_the_protobuf_message(num_blocks: int) -> None:
    from kvstore.node.put_wire import encode_put_batch

    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, num_blocks)
    want = batch_request(ns, keys, blocks)
    spec, size = spec_from_namespace(ns), len(blocks[0])
    # one buffer per block (put_blocks) and the batch back to back in one (put_rows)
    for data in ([memoryview(b) for b in blocks], [b"".join(blocks)]):
        assert pb.PutBatchRequest.FromString(encode_put_batch(spec, keys, size, data)) == want
    with pytest.raises(ValueError, match="are not"):
        encode_put_batch(spec, keys, size + 1, [b"".join(blocks)])
