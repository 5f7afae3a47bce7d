"""``PrefillWorker``: computes the uncached suffix of a prompt and publishes its blocks.

Request flow step 2 of docs/design.md §4. A plain class: in-process as it is, on Ray through
``workers.replica.replica_actor``.
"""

from __future__ import annotations

from kvstore.api import TokenIds
from workers.engine import PrefillResult
from workers.replica import Replica
from workers.sampling import SamplingParams


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
