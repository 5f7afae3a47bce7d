"""The two replica roles: ``PrefillWorker`` computes the uncached suffix of a prompt and
publishes its blocks (request flow step 2 of docs/design.md §4); ``DecodeWorker`` fetches a
prompt's blocks and generates (step 3). Plain classes: in-process as they are, on Ray through
``kvstore.workers.replicas.replica.replica_actor``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.api import TokenIds
from kvstore.workers.engine.results import DecodeResult, PrefillResult, TailKV
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.replica import Replica


class PrefillWorker(Replica):
    """Computes only the uncached suffix of a prompt, publishes it, returns the first token."""

    def prefill(self, token_ids: TokenIds, request_id: str,
                sampling: SamplingParams | None = None, use_cache: bool = True,
                return_logits: bool = False, cache_salt: str | None = None,
                wait_published: bool = True) -> PrefillResult:
        """Prefill ``token_ids`` reusing every cached block (see ``Engine.prefill``).

        The result's ``ttft_s`` never includes publishing. ``wait_published`` (the default)
        returns only once this prompt's new blocks are in the store, so whoever is handed the
        result (a decode replica elsewhere, the next job) finds them; a caller that streams
        the first token at once passes False and has the decode wait for the blocks instead
        (``DecodeWorker.decode(wait_for_blocks=result.num_prefix_blocks)``).
        """
        result = self.engine.prefill(token_ids, request_id=request_id, sampling=sampling,
                                     use_cache=use_cache, return_logits=return_logits,
                                     cache_salt=cache_salt)
        if wait_published:
            self.engine.wait_published(request_id)
        return result


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
