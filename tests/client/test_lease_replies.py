"""Lease replies: the node packs the arena's blocks into columns, and ``replies.lease_info``
reads packed, listed (a node that does not pack) and mixed replies."""

from __future__ import annotations

import pytest

from kvstore.client import node_client, replies
from kvstore.errors import NodeUnavailable
from kvstore.protos import kvstore_pb2 as pb
from tests.client.test_node_client import clients, server  # noqa: F401
from tests.node.test_store_server import make_blocks, make_namespace


def test_a_lease_reply_packs_the_arenas_blocks_for_every_client(server, monkeypatch) -> None:  # noqa: F811
    """Over gRPC and the bulk channel the node answers a lease with the arena's blocks packed
    into three columns; the client's locations point at exactly the blocks' bytes."""
    srv, pool = server
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 5)
    replies_seen: list[object] = []
    monkeypatch.setattr(node_client, "lease_info",
                        lambda resp: (replies_seen.append(resp), replies.lease_info(resp))[1])
    for kind, client in clients(srv, pool).items():
        client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
        absent = b"\1" * 32
        lease = client.lease([*keys[::-1], absent], 10)
        where = {loc.key: loc for loc in lease.locations}
        assert set(where) == set(keys) and lease.missing == [absent], kind
        for key, block in zip(keys, blocks, strict=True):
            assert bytes(pool.leased_bytes(where[key].offset, where[key].nbytes)) == \
                bytes(block), kind
        reply = replies_seen[-1]
        assert len(reply.offsets) == 5 and not reply.locations, kind  # type: ignore[attr-defined]
        client.release(lease.lease_id)
        client.close()


def test_lease_info_reads_listed_packed_and_mixed_replies() -> None:
    lease_info = replies.lease_info
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    listed = pb.LeaseResponse(lease_id="l", locations=[
        pb.BlockLocation(key=a, offset=64, nbytes=10)], missing=[c], expires_at=5.0,
        shm_path="/dev/shm/x")  # a node that does not pack
    got = lease_info(listed)
    assert [(loc.key, loc.offset, loc.nbytes, loc.path) for loc in got.locations] == \
        [(a, 64, 10, "")] and got.missing == [c] and got.shm_path == "/dev/shm/x"
    mixed = pb.LeaseResponse(lease_id="l", locations=[
        pb.BlockLocation(key=c, offset=0, nbytes=10, file="/disk/c")],
        held_keys=a + b, offsets=[128, 0], sizes=[10, 10])
    assert [(loc.key, loc.offset, loc.path) for loc in lease_info(mixed).locations] == \
        [(c, 0, "/disk/c"), (a, 128, ""), (b, 0, "")]
    for broken in (pb.LeaseResponse(held_keys=a, offsets=[0, 64], sizes=[10, 10]),
                   pb.LeaseResponse(held_keys=a + b, offsets=[0, 64], sizes=[10])):
        with pytest.raises(NodeUnavailable, match="line up"):
            lease_info(broken)
