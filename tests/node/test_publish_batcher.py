"""CoalescingPublisher: concurrent publishes share calls, and none returns before its own
entries were published (the "Put returns once visible" rule)."""

from __future__ import annotations

import threading
import time

from kvstore.index.base import IndexEntry
from kvstore.node.publish_batcher import CoalescingPublisher


def make_entries(tag: int, n: int) -> list[IndexEntry]:
    return [IndexEntry(bytes([tag, i]) * 16, "node", 10, b"\0" * 32, b"\1" * 32)
            for i in range(n)]


def wait_until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


class GatedSink:
    """An index whose publish blocks until released; records what each call carried."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []
        self.visible: set[bytes] = set()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def __call__(self, entries: list[IndexEntry]) -> None:
        self.entered.set()
        self.gate.wait()
        if self.fail:
            raise ConnectionError("index down")
        self.calls.append([e.key for e in entries])
        self.visible.update(e.key for e in entries)


def test_concurrent_publishes_coalesce_and_each_waits_for_its_own() -> None:
    sink = GatedSink()
    pub = CoalescingPublisher(sink)
    returned: dict[int, set[bytes]] = {}  # what was visible when each publish returned

    def put(tag: int) -> None:
        entries = make_entries(tag, 3)
        pub.publish(entries)
        returned[tag] = set(sink.visible)
        assert {e.key for e in entries} <= returned[tag]

    first = threading.Thread(target=put, args=(0,))
    first.start()
    assert sink.entered.wait(5)  # 0 is inside the sink call; 1..4 queue behind it
    others = [threading.Thread(target=put, args=(t,)) for t in range(1, 5)]
    for t in others:
        t.start()
    wait_until(lambda: len(pub._pending) == 4)
    assert not returned  # nobody returns while the call carrying its entries is open
    sink.gate.set()
    for t in [first, *others]:
        t.join(5)
    assert sorted(returned) == [0, 1, 2, 3, 4]
    assert len(sink.calls) == 2 and pub.num_calls == 2  # 5 publishes, 2 index calls
    assert len(sink.calls[1]) == 12 and pub.num_entries == 15


def test_a_failed_publish_fails_every_put_it_carried() -> None:
    sink = GatedSink()
    sink.fail = True
    pub = CoalescingPublisher(sink)
    errors: list[BaseException] = []

    def put(tag: int) -> None:
        try:
            pub.publish(make_entries(tag, 2))
        except ConnectionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(t,)) for t in range(3)]
    threads[0].start()
    assert sink.entered.wait(5)
    for t in threads[1:]:
        t.start()
    wait_until(lambda: len(pub._pending) == 2)
    sink.gate.set()
    for t in threads:
        t.join(5)
    assert len(errors) == 3 and not sink.visible
    sink.fail = False
    pub.publish(make_entries(9, 1))  # and the publisher is usable afterwards
    assert len(sink.visible) == 1


def test_lone_publish_is_one_call_and_empty_is_none() -> None:
    sink = GatedSink()
    sink.gate.set()
    pub = CoalescingPublisher(sink)
    pub.publish([])
    pub.publish(make_entries(1, 4))
    assert sink.calls == [[e.key for e in make_entries(1, 4)]]
