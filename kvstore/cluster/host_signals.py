"""Joining Ray from a process that has its own way to stop, without taking that over.

``ray.init`` makes itself the host of any process that calls it: it replaces the Python
SIGTERM handler with its driver's (``sys.exit``), and its core worker installs a native one
beneath Python that prints a stack dump, ``*** SIGTERM received ... PC: @``, before passing
the signal on. kvstore joins Ray from processes that are not its own: vLLM's engine and worker
processes (the connector), whose handler shuts the engine down cleanly, and ``kvstore serve``,
whose handler stops the service in order; under Ray's, each would stop by Ray's exit instead,
after a dump that reads as a crash.

``sigterm_kept`` keeps the process's own handler where it had one, and otherwise Ray's
``sys.exit`` (a command with no handler of its own then still unwinds, and stops what it
started, on SIGTERM), in both cases without the native dump.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """Within the block, anything (``ray.init``) may install SIGTERM handlers; after it the
    process's own Python handler (or SIGTERM ignored) is in place again if it had one, else
    the one the block set from Python, each re-installed at the C level (over a native one set
    beneath Python). Only the main thread can set handlers: elsewhere nothing is done (nor can
    ``ray.init`` set a Python one there)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if main:
            own = before not in (signal.SIG_DFL, None)  # a handler, or SIGTERM ignored
            keep = before if own else signal.getsignal(signal.SIGTERM)
            if keep is not None:  # None: a handler not set from Python, not put back
                signal.signal(signal.SIGTERM, keep)
