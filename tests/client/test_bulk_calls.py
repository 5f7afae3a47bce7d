"""A same-node reader's calls on the bulk channel: a refusal there is asked again on gRPC,
which raises the typed error, and a node without calls is asked on gRPC from the start."""

# ruff: noqa: F811  (the server fixture is imported, then named as a test argument)
from __future__ import annotations

import pytest

from kvstore.client.node_client import StoreNodeClient
from kvstore.errors import InvalidRequest
from tests.client.test_node_client import FAST, server  # noqa: F401  - the fixture by name
from tests.node.test_grants import CountingCalls
from tests.node.test_store_server import make_blocks, make_namespace


def test_a_refused_bulk_lease_gets_grpcs_typed_error_and_the_channel_stays(server) -> None:
    """A lease the node refuses on the bulk channel (a malformed key) is asked again on gRPC,
    which raises the typed error; the bulk connection stays open for the next lease. A node
    whose bulk channel grants no leases is asked on gRPC, and the lease still works."""
    srv, pool = server
    grpc_addr, bulk_addr = srv.addresses
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    writer = StoreNodeClient(grpc_addr, config=FAST)
    writer.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    reader = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, shm_path=pool.path,
                             same_node=True, config=FAST)
    grpc = reader._stub = CountingCalls(reader._stub)
    try:
        with pytest.raises(InvalidRequest):
            reader.lease([b"short"], 5.0, namespace=ns)
        assert grpc.calls["Lease"] == 1
        lease = reader.lease(keys, 5.0, namespace=ns)
        assert [loc.key for loc in lease.locations] == keys and grpc.calls["Lease"] == 1
        assert len(reader._bulk._idle) == 1  # one connection, kept through the refusal
        reader.release(lease.lease_id)
        srv._bulk.calls = {}  # an older node: call frames are refused as bad requests
        lease = reader.lease(keys, 5.0, namespace=ns)
        assert len(lease.locations) == 3 and grpc.calls["Lease"] == 2
        reader.release(lease.lease_id)
        assert pool.stats().num_leased == 0
    finally:
        reader.close()
        writer.close()
