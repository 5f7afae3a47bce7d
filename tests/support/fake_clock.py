"""A clock a test moves by hand (``clock.now += 5``), for code that takes ``clock=``."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.monotonic``; returns ``now``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
