"""``DecodeWorker``: fetches a prompt's blocks and generates.

Request flow step 3 of docs/design.md §4. A plain class: in-process as it is, on Ray through
``workers.replica.replica_actor``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.api import TokenIds
from workers.engine import DecodeResult, PrefillResult, TailKV
from workers.replica import Replica
from workers.sampling import SamplingParams


class DecodeWorker(Replica):
    """Reassembles the prompt's KV from the store (plus the prefill's private tail), generates."""

    def decode(self, token_ids: TokenIds, first_token: int, request_id: str,
               tail: TailKV | None = None, sampling: SamplingParams | None = None,
               use_cache: bool = True, return_logits: bool = False,
               cache_salt: str | None = None,
               on_token: Callable[[int], None] | None = None,
               wait_for_blocks: int = 0) -> DecodeResult:
        """Fetch the prompt's blocks and generate (see ``Engine.decode``)."""
        return self.engine.decode(token_ids, first_token, tail=tail, request_id=request_id,
                                  sampling=sampling, use_cache=use_cache,
                                  return_logits=return_logits, cache_salt=cache_salt,
                                  on_token=on_token, wait_for_blocks=wait_for_blocks)

    def generate(self, token_ids: TokenIds, request_id: str,
                 sampling: SamplingParams | None = None, use_cache: bool = True,
                 cache_salt: str | None = None, on_token: Callable[[int], None] | None = None
                 ) -> tuple[PrefillResult, DecodeResult]:
        """Prefill and decode here, on local KV: the ``--no-cache`` reference computes each
        prompt once, and its TTFT is the prefill's here."""
        pre, dec = self.engine.generate(token_ids, request_id=request_id, sampling=sampling,
                                        use_cache=use_cache, cache_salt=cache_salt,
                                        on_token=on_token)
        pre.tail = None  # the KV stayed here; do not ship it back
        return pre, dec
