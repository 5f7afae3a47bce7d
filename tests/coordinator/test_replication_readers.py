"""Replication orders go only to registered, live nodes: a reader node id that no store node
registered (a tenant could name any id it likes, were it believed) earns no orders, however
often its reads are counted; the registered reader beside it still gets its copy."""

from __future__ import annotations

from tests.coordinator.test_core import make_chain, make_core, make_stats, register


def test_reads_counted_for_an_unregistered_node_order_nothing() -> None:
    core = make_core(hot_fetch_threshold=2)
    hot = make_chain(2, "hot")
    register(core, "a", [hot])
    register(core, "r", [])
    core.request_eviction("ghost", 0)  # known to the table (a call named it), never registered
    for _ in range(3):
        core.heartbeat("a", make_stats(1000, 200), [], {"ghost": hot, "nobody": hot, "r": hot})
    assert core.nodes.get("ghost") is not None and core.nodes.get("ghost").address is None
    assert core.heartbeat("ghost", make_stats(1000, 0), [], {}).replicate == []
    orders = core.heartbeat("r", make_stats(1000, 0), [], {}).replicate
    assert [(o.keys, o.source.node_id) for o in orders] == [(hot, "a")]
