"""Joining Ray from a process that has its own way to stop, without taking that over.

Three things stand between a process and its own stop once it joins Ray.

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

A private Ray (the embedded default) is started as this process's children: its GCS, raylet
and agents, in the caller's process group. A signal to the whole group (GNU ``timeout``, ``kill
-- -PGID``) then reached them at the moment it reached the caller: the GCS was gone before the
caller's handler could stop anything in order, the stop waited a minute for it, and the store
node's arena was left behind. ``own_process_groups`` starts each of them as the leader of a
group of its own, as Ray already does on Windows and with its workers; they still die with
the caller, by the kernel's parent-death signal Ray sets on each of them.

And Ray ends any process that joined it once the cluster's GCS has been unreachable for a
minute (``gcs_rpc_server_reconnect_timeout_s``: "The program will terminate"). For a process
kvstore is a guest in (vLLM's engine and workers, through the connector) that would turn a
kvstore cluster stopped or lost into a dead inference engine, when all it should cost is
recomputed prefixes. ``outlive_the_cluster`` lifts that limit for such a process before it
joins (an operator's own setting wins).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


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


@contextlib.contextmanager
def own_process_groups() -> Iterator[None]:
    """Within the block, every process Ray starts itself (``ray.init`` of a private instance:
    GCS, raylet, agents) leads a process group of its own. Only where the kernel kills them
    with their parent (Linux's parent-death signal, which Ray then sets): elsewhere Ray's
    reaper ends them by signalling the caller's group, so they must stay in it. Does nothing
    if Ray no longer starts its processes through ``ConsolePopen``."""
    import ray._private.utils as ray_utils

    services: Any = importlib.import_module("ray._private.services")  # its class is replaced

    original = getattr(services, "ConsolePopen", None)
    if (original is None or not sys.platform.startswith("linux")
            or not ray_utils.detect_fate_sharing_support()):
        yield
        return

    class OwnGroupPopen(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["preexec_fn"] = _leading_own_group(kwargs.get("preexec_fn"))
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = original


def _leading_own_group(then: Callable[[], Any] | None) -> Callable[[], None]:
    def preexec() -> None:  # in the child, between fork and exec
        os.setpgid(0, 0)
        if then is not None:
            then()
    return preexec


#: Ray's limit on a GCS outage before it ends a process that joined it, as Ray reads it from
#: the environment when it joins; and the value ``outlive_the_cluster`` gives it: ten years.
GCS_RECONNECT_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
OUTLIVE_S = 10 * 365 * 24 * 3600


def outlive_the_cluster() -> None:
    """Before this process joins Ray: never be ended by Ray because the cluster's GCS went
    away (a kvstore cluster stopped, its head lost). What kvstore then asks of the cluster
    fails as a node that does not answer does, which its clients turn into misses. Processes
    this one starts inherit it."""
    os.environ.setdefault(GCS_RECONNECT_TIMEOUT_ENV, str(OUTLIVE_S))
