"""Disaggregated prefill through vLLM's own P/D proxies: the prefill says what it published, the
decode waits for it.

vLLM's disaggregated-serving proxies (its examples' ``toy_proxy_server``, llm-d's sidecar) send
a request first to a prefill instance with ``max_tokens=1`` and ``kv_transfer_params``
``{"do_remote_decode": true}``, then to a decode instance with the ``kv_transfer_params`` the
prefill's response carried. With kvstore between them nothing moves point to point: the
prefill's connector publishes the prompt's full blocks and answers ``{"do_remote_prefill":
true, "kvstore_blocks": n}`` (``prefill_answer``); the decode's connector, seeing
``kvstore_blocks``, holds the request (vLLM asks again next step: ``None`` from
``get_num_new_matched_tokens``) until kvstore holds those ``n`` blocks, then loads them. The
prefill publishes off its forward path, so its response can reach the decode before its last
blocks are in; waiting for them is what turns that race into a full hit instead of a recompute.
The wait is bounded (``publish_wait_s``): blocks still missing then are computed by vLLM, which
costs time, never correctness. Lookups while waiting are spaced (``POLL_S``): vLLM's scheduler
may ask every step; an engine with nothing else to do sleeps between them instead of spinning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The ``kv_transfer_params`` key of a prefill's answer: the prompt's blocks it published.
BLOCKS_PARAM = "kvstore_blocks"
#: Seconds between two lookups of a request that waits for a prefill's blocks.
POLL_S = 0.005


def prefill_answer(params: Any, published_blocks: int) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill leg's response carries to the decode leg (None
    for any other request: a request whose ``kv_transfer_params`` did not ask with
    ``do_remote_decode``)."""
    if not (isinstance(params, dict) and params.get("do_remote_decode")):
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False,
            BLOCKS_PARAM: max(0, int(published_blocks))}


def blocks_to_wait_for(params: Any) -> int:
    """The blocks a decode leg's prefill published (0: not a decode leg, or nothing to wait
    for; a value that is not a whole number is ignored)."""
    if not isinstance(params, dict):
        return 0
    value = params.get(BLOCKS_PARAM)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass
class _Waiting:
    since: float
    last_poll: float


class PublishWait:
    """Requests held until kvstore holds the blocks their prefill published."""

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.wait_s = wait_s
        self.clock = clock
        self.sleep = sleep
        self._waiting: dict[str, _Waiting] = {}

    def due(self, request_id: str, *, alone: bool = False) -> bool:
        """Whether to look the request up now: at once the first time, then every ``POLL_S``.
        ``alone`` (the engine has no other request): sleeps until it is due instead of
        answering not yet, which has vLLM run an empty step and ask again at once, an idle
        engine spinning through its steps (and its worker's) for as long as the wait lasts."""
        now = self.clock()
        waiting = self._waiting.get(request_id)
        if waiting is None:
            self._waiting[request_id] = _Waiting(now, now)
            return True
        early = POLL_S - (now - waiting.last_poll)
        if early > 0:
            if not alone:
                return False
            self.sleep(early)
            now = self.clock()
        waiting.last_poll = now
        return True

    def ready(self, request_id: str, held_blocks: int, wanted_blocks: int) -> bool:
        """After a lookup found ``held_blocks`` of the ``wanted_blocks``: whether the request
        goes on (all there, or waited ``wait_s``: vLLM computes the rest)."""
        waiting = self._waiting.get(request_id)
        waited = self.clock() - waiting.since if waiting is not None else 0.0
        if held_blocks < wanted_blocks and waited < self.wait_s:
            return False
        if held_blocks < wanted_blocks:
            log.warning("kvstore: request %s waited %.1f s for its prefill's %d blocks and goes "
                        "on with %d (vLLM computes the rest)", request_id, waited,
                        wanted_blocks, held_blocks)
        self.forget(request_id)
        return True

    def forget(self, request_id: str) -> None:
        """The request goes on, or ended while it waited."""
        self._waiting.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._waiting)
