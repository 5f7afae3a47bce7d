"""IndexView: positive answers trusted for ttl_s, absent keys always asked, stale promises
forgotten; compared against the index itself with a fake clock."""

from __future__ import annotations

from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.index.view import IndexView
from tests.support.fake_clock import FakeClock


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def publish(index: InMemoryIndex, keys: list[bytes], node: str) -> None:
    index.publish([IndexEntry(k, node, 10, b"\0" * 32, b"\1" * 32) for k in keys])


def make_view(ttl_s: float = 1.0) -> tuple[InMemoryIndex, IndexView, FakeClock]:
    index, clock = InMemoryIndex(), FakeClock(100.0)
    return index, IndexView(index, ttl_s, clock=clock), clock


def test_fresh_answers_come_from_memory_and_equal_the_index() -> None:
    index, view, _ = make_view()
    keys = keys_of(6)
    publish(index, keys[:4], "a")
    assert view.lookup_prefix(keys) == index.lookup_prefix(keys)
    assert view.num_remote == 1
    assert view.lookup_prefix(keys[:4]) == index.lookup_prefix(keys[:4])
    assert view.holders(keys[:4]) == index.holders(keys[:4])
    assert view.num_remote == 1 and view.num_local == 2


def test_absent_keys_are_never_remembered_so_a_put_is_visible_at_once() -> None:
    index, view, _ = make_view()
    keys = keys_of(4)
    assert view.lookup_prefix(keys).num_blocks == 0
    publish(index, keys, "b")  # another client's Put returned
    hit = view.lookup_prefix(keys)
    assert hit.num_blocks == 4 and hit.holders == [["b"]] * 4
    assert view.holders(keys_of(2, tag=9)) == [[], []]


def test_stale_promise_lasts_at_most_ttl_then_the_index_answers() -> None:
    index, view, clock = make_view(ttl_s=1.0)
    keys = keys_of(3)
    publish(index, keys, "a")
    view.lookup_prefix(keys)
    index.remove(keys[1:], "a")  # evicted on the node
    clock.now += 0.999
    assert view.lookup_prefix(keys).num_blocks == 3  # the stale promise (reads will miss)
    clock.now += 0.002
    assert view.lookup_prefix(keys) == index.lookup_prefix(keys)
    assert view.lookup_prefix(keys).num_blocks == 1


def test_forget_and_own_puts() -> None:
    index, view, _ = make_view()
    keys = keys_of(3)
    view.put(keys, "self")  # our own Put returned: known without asking
    assert view.lookup_prefix(keys).holders == [["self"]] * 3 and view.num_remote == 0
    view.forget(keys[1:2])  # a holder said "not found": ask the index next time
    publish(index, keys, "self")
    publish(index, keys[1:2], "other")
    assert view.holders(keys) == [["self"], ["other", "self"], ["self"]]
    assert view.num_remote == 1


def test_ttl_zero_always_asks() -> None:
    index, view, _ = make_view(ttl_s=0.0)
    keys = keys_of(2)
    publish(index, keys, "a")
    view.put(keys, "a")
    for _ in range(3):
        assert view.lookup_prefix(keys) == index.lookup_prefix(keys)
    assert view.num_remote == 3 and view.num_local == 0


def test_size_bound_drops_the_oldest() -> None:
    index = InMemoryIndex()
    view = IndexView(index, 10.0, clock=FakeClock(100.0), max_keys=8)
    view.put(keys_of(9), "a")
    assert len(view._known) <= 8
    assert view._get(keys_of(9)[-1], 100.0) == ["a"]


def test_holders_another_reader_was_told_are_trusted_for_ttl_only() -> None:
    index, view, clock = make_view()
    keys = keys_of(3)
    publish(index, keys, "a")
    view.remember(keys, index.lookup_prefix(keys).holders)  # e.g. vLLM's scheduler's lookup
    assert view.holders(keys) == [["a"]] * 3 and view.num_remote == 0
    clock.now += 2.0
    publish(index, keys, "b")
    assert view.holders(keys) == index.holders(keys) and view.num_remote == 1
