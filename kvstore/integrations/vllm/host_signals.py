"""Joining Ray from inside vLLM's processes without taking over how they stop.

vLLM's engine and worker processes handle SIGTERM themselves: their handler raises
``SystemExit``, and the process shuts its engine down cleanly, the connector's ``shutdown``
(its queued saves) included. The connector joins the kvstore cluster over Ray from those same
processes, and ``ray.init`` makes itself the host of any process that calls it: it replaces
the Python SIGTERM handler with its driver's (``sys.exit``), and its core worker installs a
native one that prints a stack dump, ``*** SIGTERM received ...``, before passing the signal
on. Every stop of a vLLM instance with the connector then logged what looks like a crash, and
ran Ray's exit instead of vLLM's (which left vLLM's shared-memory queue to Python's resource
tracker, with a warning about a leak). A library does not change its host's signal handling:
``sigterm_kept`` puts back whatever handler the process had before it joined.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """Within the block, anything (``ray.init``) may install SIGTERM handlers; after it the
    handler from before is in place again, the native one as well (Python re-installs its own
    at the C level). Only the main thread can set handlers: elsewhere nothing is done, and
    neither can ``ray.init`` have set one there."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if before is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGTERM, before)
