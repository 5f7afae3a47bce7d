"""SoleNode: whether this host's store node is the directory's only one, refreshed in the
background, and "not alone" whenever the answer is unknown, stale or failed."""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.client.sole_node import SoleNode
from tests.support.fake_clock import FakeClock


def test_alone_only_while_the_directory_lists_this_node_alone_and_the_answer_is_fresh() -> None:
    clock, listed = FakeClock(100.0), {"a": 1}
    calls: list[int] = []

    def nodes() -> Mapping[str, int]:
        calls.append(1)
        return dict(listed)

    sole = SoleNode("a", nodes, max_age_s=5.0, clock=clock)
    assert not sole.alone()  # never asked yet
    sole.refresh()
    assert sole.alone() and len(calls) == 1
    clock.now += 1.0
    sole.refresh()  # younger than max_age_s: not asked again
    assert len(calls) == 1
    listed["b"] = 2
    clock.now += 5.0
    sole.refresh()
    assert not sole.alone() and len(calls) == 2
    del listed["b"]
    sole.refresh(if_older=False)
    assert sole.alone()
    clock.now += 10.1  # no refresh for over twice max_age_s (a stalled thread): unknown
    assert not sole.alone()


def test_a_failing_or_per_id_directory_is_never_alone() -> None:
    def broken() -> Mapping[str, int]:
        raise RuntimeError("the coordinator is away")

    sole = SoleNode("a", broken)
    sole.refresh()
    assert not sole.alone()
    per_id = SoleNode("a", None)
    per_id.refresh()
    assert not per_id.alone()
    other = SoleNode("a", lambda: {"b": 1})
    other.refresh()
    assert not other.alone()


def test_each_listing_is_passed_on() -> None:
    """ClusterStore learns from it which failed nodes were replaced (kvstore.client.unreachable)."""
    seen: list[Mapping[str, int]] = []
    sole = SoleNode("a", lambda: {"a": 1, "b": 2}, on_listing=seen.append)
    sole.refresh()
    sole.refresh()  # younger than max_age_s: not asked, not passed on again
    assert seen == [{"a": 1, "b": 2}]
