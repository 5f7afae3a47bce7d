"""When a reused bulk connection fails, the client tries once more on a fresh one only if the
node hung up (it closes idle connections); a connection that timed out means a silent node,
and a fresh one would only wait out the same timeout again."""

# ruff: noqa: F811  (the make_node fixture is imported, then named as a test argument)
from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvstore.client.bulk_client import BulkClient
from kvstore.errors import NodeUnavailable
from tests.node.test_bulk import TOKEN, Node, fetch, make_node  # noqa: F401 (fixture)
from tests.support.silent_listener import SilentListener


def idle_connection_to(silent: SilentListener, client: BulkClient) -> None:
    """Give ``client`` an idle connection whose far end is ``silent``."""
    before = len(silent.accepted)
    client._idle.append(BulkClient(silent.address, timeout_s=1)._connect())
    deadline = time.monotonic() + 5
    while len(silent.accepted) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(silent.accepted) == before + 1


def test_a_silent_node_is_not_dialled_again_after_a_timeout() -> None:
    silent = SilentListener()
    client = BulkClient(silent.address, auth_token=TOKEN, timeout_s=0.5)
    try:
        idle_connection_to(silent, client)
        with pytest.raises(NodeUnavailable, match="failed"):
            fetch(client, [b"\1" * 32])
        assert len(silent.accepted) == 1  # the timed-out connection, no fresh one
        idle_connection_to(silent, client)
        with pytest.raises(NodeUnavailable):
            client.call("Exists", b"")
        assert len(silent.accepted) == 2
    finally:
        client.close()
        silent.close()


def test_a_connection_the_node_closed_is_replaced_by_a_fresh_one(
        make_node: Callable[..., Node]) -> None:
    node = make_node()
    silent = SilentListener()
    client = node.client()
    try:
        idle_connection_to(silent, client)
        silent.hang_up()  # as a node closes a connection idle too long
        assert fetch(client, node.keys_a, node.ns_a) == node.blocks_a
    finally:
        client.close()
        silent.close()
