"""UnreachableNodes: a node that did not answer is skipped for a cooldown, then probed by one
read; and ClusterStore over a real node whose address stops answering (a listener that
accepts and stays silent, as a host behind a cut link does until the timeout)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvstore.api import MISS_NODE_UNAVAILABLE, FetchedBlock, Miss, NodeAddress, PrefixHit
from kvstore.client.cluster_store import ClusterStore
from kvstore.client.unreachable import UnreachableNodes, process_wide
from kvstore.config import ClientConfig
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from tests.client.test_cluster_store import cluster, make_puts  # noqa: F401 (fixture)
from tests.node.test_store_server import make_namespace
from tests.support.fake_clock import FakeClock
from tests.support.silent_listener import SilentListener


def test_a_node_that_answers_is_never_skipped() -> None:
    nodes = UnreachableNodes(5.0, 30.0, clock=FakeClock())
    hit = PrefixHit(2, [["a"], ["a", "b"]])
    assert not nodes.skip("a") and not nodes.cooling("a")
    assert nodes.reachable(hit) is hit and nodes.retry_in("a") == 0.0


def test_a_failed_node_is_skipped_then_probed_by_one_read() -> None:
    clock = FakeClock()
    nodes = UnreachableNodes(5.0, 30.0, clock=clock)
    nodes.failed("a", "timed out")
    assert nodes.cooling("a") and nodes.skip("a") and nodes.retry_in("a") == 5.0
    assert not nodes.cooling("b") and not nodes.skip("b")
    # Lookups stop at the first block no answering node holds; other holders stay.
    hit = nodes.reachable(PrefixHit(3, [["b", "a"], ["a"], ["b"]]))
    assert hit == PrefixHit(1, [["b"]])
    clock.now += 4.9
    assert nodes.skip("a")
    clock.now += 0.2
    assert not nodes.cooling("a")  # a lookup counts its blocks again ...
    assert not nodes.skip("a")  # ... the first read probes it ...
    assert nodes.skip("a") and nodes.cooling("a")  # ... and the others wait for that probe
    nodes.answered("a")
    assert not nodes.skip("a") and not nodes.cooling("a") and nodes.retry_in("a") == 0.0


def test_each_failed_probe_doubles_the_cooldown_up_to_the_max() -> None:
    clock = FakeClock()
    nodes = UnreachableNodes(5.0, 12.0, clock=clock)
    nodes.failed("a")
    for expected in (10.0, 12.0, 12.0):
        clock.now += nodes.retry_in("a")
        assert not nodes.skip("a")  # the probe
        nodes.failed("a")
        assert nodes.retry_in("a") == expected


def test_a_failure_inside_the_cooldown_does_not_extend_it() -> None:
    """Reads that started before the first failure time out a little later: the same fault."""
    clock = FakeClock()
    nodes = UnreachableNodes(5.0, 30.0, clock=clock)
    nodes.failed("a")
    clock.now += 1.0
    nodes.failed("a")
    assert nodes.retry_in("a") == 4.0


def test_a_probe_that_never_reports_lets_another_read_probe_later() -> None:
    clock = FakeClock()
    nodes = UnreachableNodes(5.0, 30.0, clock=clock)
    nodes.failed("a")
    clock.now += 5.0
    assert not nodes.skip("a") and nodes.skip("a")
    clock.now += 5.0
    assert not nodes.skip("a")


def test_a_node_the_directory_names_at_a_new_address_is_trusted_at_once() -> None:
    """A store node restarted on the same host (a new port) owes nothing to its predecessor."""
    clock = FakeClock()
    nodes = UnreachableNodes(5.0, 30.0, clock=clock)
    nodes.failed("a", "timed out", address="10.0.0.1:7000")
    nodes.failed("b", "not in the directory")  # where it failed is not known
    nodes.resolved("a", "10.0.0.1:7000")  # the directory still names the silent one
    nodes.resolved("b", "10.0.0.2:7000")
    assert nodes.cooling("a") and nodes.cooling("b")
    clock.now += 5.0
    assert not nodes.skip("a")  # the probe ...
    nodes.failed("a", "timed out")  # ... fails: the address it failed at is kept
    nodes.resolved("a", "10.0.0.1:7001")
    assert not nodes.cooling("a") and not nodes.skip("a") and nodes.retry_in("a") == 0.0


def test_a_zero_cooldown_never_skips() -> None:
    nodes = UnreachableNodes(0.0, 0.0, clock=FakeClock())
    nodes.failed("a")
    assert not nodes.skip("a") and not nodes.cooling("a")


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="cooldown_s"):
        UnreachableNodes(5.0, 1.0)
    with pytest.raises(ConfigError, match="unreachable_cooldown_s"):
        ClientConfig(unreachable_cooldown_s=-1)
    with pytest.raises(ConfigError, match="unreachable_max_cooldown_s"):
        ClientConfig(unreachable_cooldown_s=10, unreachable_max_cooldown_s=5)


def test_clients_of_one_process_share_their_breakers() -> None:
    """vLLM's scheduler-side and worker-side connectors are two clients in one process."""
    assert process_wide(5.0, 30.0) is process_wide(5.0, 30.0)
    assert process_wide(5.0, 30.0) is not process_wide(1.0, 30.0)


@dataclass
class SilencedNode:
    """node-a holds three blocks, and the directory now names a port that never answers."""

    ns: Namespace
    keys: list[bytes]
    tokens: list[list[int]]
    live: NodeAddress  # node-a's real address, for the directory to name again
    silent: SilentListener  # what the directory names now


@contextmanager
def node_a_silenced(nodes, *, bulk: bool = True  # noqa: ANN001 - the cluster fixture
                    ) -> Iterator[SilencedNode]:
    """``bulk``: the silent node offers a bulk channel too (else reads go over gRPC)."""
    index, _, directory = nodes
    ns = make_namespace()
    writer = ClusterStore("node-a", index, directory.__getitem__)
    puts, tokens = make_puts(ns, 3)
    writer.batch_put(ns, puts)
    silent = SilentListener()
    live = directory["node-a"]
    directory["node-a"] = NodeAddress("node-a", silent.address,
                                      silent.address if bulk else None)
    try:
        yield SilencedNode(ns, [p.key for p in puts], tokens, live, silent)
    finally:
        writer.close()
        silent.close()


CONFIG = ClientConfig(timeout_s=0.5, retries=0, index_view_ttl_s=0)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_a_silent_node_costs_one_timeout_then_is_skipped_until_it_answers(cluster, bulk: bool  # noqa: F811
                                                                          ) -> None:
    index, _, directory = cluster
    clock = FakeClock()
    breakers = UnreachableNodes(60.0, 60.0, clock=clock)
    with node_a_silenced(cluster, bulk=bulk) as a:
        ns, keys, tokens = a.ns, a.keys, a.tokens
        reader = ClusterStore("node-b", index, directory.__getitem__, CONFIG,
                              unreachable=breakers)
        try:
            assert reader.lookup_prefix(ns, keys).num_blocks == 3  # nothing known against it
            got = reader.batch_get(ns, keys, tokens)  # times out once
            assert all(isinstance(g, Miss) and g.reason == MISS_NODE_UNAVAILABLE for g in got)
            offered = len(a.silent.accepted)
            assert offered >= 1 and breakers.cooling("node-a")
            # Within the cooldown: lookups do not count node-a's blocks, reads do not wait.
            assert reader.lookup_prefix(ns, keys) == PrefixHit(0, [])
            got = reader.batch_get(ns, keys, tokens)
            assert all(isinstance(g, Miss) and g.reason == MISS_NODE_UNAVAILABLE
                       and "skipped" in g.detail for g in got), got
            assert len(a.silent.accepted) == offered  # no new connection
            # The node answers again: after the cooldown one read probes it, and it is back.
            directory["node-a"] = a.live
            clock.now += 60.0
            assert reader.lookup_prefix(ns, keys).num_blocks == 3
            got = reader.batch_get(ns, keys, tokens)
            assert all(isinstance(g, FetchedBlock) and g.node_id == "node-a" for g in got)
            assert not breakers.cooling("node-a")
        finally:
            reader.close()


@pytest.mark.parametrize("reader_node", ["node-a", "node-b"])  # its own host's node, another's
def test_a_failed_node_replaced_at_a_new_address_is_read_at_once(cluster, reader_node: str  # noqa: F811
                                                                 ) -> None:
    """The store node restarted (on a new port): no read waits out its predecessor's cooldown.
    A reader learns the new address when it resolves its own node for a lookup, and from the
    directory's periodic listing for the others."""
    index, _, directory = cluster
    breakers = UnreachableNodes(60.0, 60.0, clock=FakeClock())
    with node_a_silenced(cluster) as a:
        reader = ClusterStore(reader_node, index, lambda: dict(directory), CONFIG,
                              unreachable=breakers)
        try:
            got = reader.batch_get(a.ns, a.keys, a.tokens)
            assert all(isinstance(g, Miss) and g.reason == MISS_NODE_UNAVAILABLE for g in got)
            assert breakers.cooling("node-a")
            assert reader.lookup_prefix(a.ns, a.keys).num_blocks == 0
            directory["node-a"] = a.live  # the replacement registers; the clock does not move
            reader.sole.refresh(if_older=False)  # the next listing (every SoleNode.max_age_s)
            assert reader.lookup_prefix(a.ns, a.keys).num_blocks == 3
            got = reader.batch_get(a.ns, a.keys, a.tokens)
            assert all(isinstance(g, FetchedBlock) and g.node_id == "node-a" for g in got), got
            assert not breakers.cooling("node-a")
        finally:
            reader.close()
