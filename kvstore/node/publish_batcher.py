"""Coalesced index publishes: concurrent Puts share one call to the index, none returns early.

A store node must make a Put's keys visible before the Put returns (design.md §4), and the
call that does it (a Ray actor call to the coordinator, a Redis pipeline) costs mostly per
call, hardly per entry. So Puts that finish while a publish is in flight do not each make
their own: they queue their entries, and the next publish carries all of them. There is no
background thread and no timer: the first Put to find no publish in flight makes the call
itself (a lone writer pays exactly one call), and the others wait for the call that
carries their entries. A Put returns only after a publish that included every one of its
entries returned, so "Put returns once every key is visible" holds for each Put; a failed
publish fails every Put it carried.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.index.base import IndexEntry


@dataclass(slots=True)
class _Waiter:
    """One Put's entries and what became of the publish that carried them."""

    entries: Sequence[IndexEntry]
    done: bool = False
    error: BaseException | None = field(default=None)


class CoalescingPublisher:
    """``publish(entries)`` that merges concurrent callers into one ``sink`` call."""

    def __init__(self, sink: Callable[[list[IndexEntry]], None]) -> None:
        self._sink = sink
        self._cond = threading.Condition()
        self._pending: list[_Waiter] = []
        self._busy = False
        #: Calls made to ``sink`` and entries they carried (tests and metrics read these).
        self.num_calls = 0
        self.num_entries = 0

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Return once a ``sink`` call that carried all of ``entries`` returned; re-raise its
        error otherwise."""
        if not entries:
            return
        me = _Waiter(entries)
        batch: list[_Waiter] = []
        with self._cond:
            self._pending.append(me)
            while self._busy and not me.done:
                self._cond.wait()
            if not me.done:
                # Nobody is publishing: lead, carrying every entry queued so far (ours too).
                self._busy = True
                batch, self._pending = self._pending, []
        if batch:
            self._lead(batch)
        if me.error is not None:
            raise me.error

    def _lead(self, batch: list[_Waiter]) -> None:
        merged = [e for w in batch for e in w.entries]
        error: BaseException | None = None
        try:
            self._sink(merged)
        except Exception as exc:  # every Put it carried fails with it
            error = exc
        with self._cond:
            self.num_calls += 1
            self.num_entries += len(merged)
            for w in batch:
                w.done, w.error = True, error
            self._busy = False
            self._cond.notify_all()
