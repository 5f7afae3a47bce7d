"""The prefill loop: a prompt's tokens from the resume point on, chunk by chunk.

Each chunk is computed with the canonical numerics (docs/design.md §4): its rows attend over
keys padded to the chunk's end, and a piece of a chunk (the rest of it after a resume point,
or a prompt's last, partial chunk) runs with the policy's piece size, dummy rows filling it.
The chunk-only policy runs its partial last chunk as is, which is why it never publishes it.

Chunks are queued on the device back to back; only the last chunk's logits come to the host.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvstore.workers.engine.reuse_policy import ReusePolicy
from kvstore.workers.model.causal_lm import CausalLM


@dataclass(frozen=True, slots=True)
class ChunkLoop:
    """Runs prompt tokens through ``model`` in chunks of ``policy.chunk_tokens``.

    ``forward_lock`` is held around each forward: the engine's requests share the model one
    step at a time (see ``Engine``).
    """

    model: CausalLM
    policy: ReusePolicy
    forward_lock: threading.Lock

    def run(self, tokens: list[int], start: int, cache: DynamicCache,
            check: Callable[[], None]) -> torch.Tensor | None:
        """Tokens ``[start, n)`` on top of ``cache`` (which holds ``[0, start)``); the last
        token's logits on the host, or ``None`` when there was nothing to run.

        ``start`` comes from ``PrefixReuse.resume_point``. ``check`` runs before each chunk
        and raises to stop the request (``InFlightRequests.check``).
        """
        chunk_tokens = self.policy.chunk_tokens
        logits = None
        pos, n = start, len(tokens)
        while pos < n:
            check()
            chunk_end = (pos // chunk_tokens + 1) * chunk_tokens
            end = min(chunk_end, n)
            with self.forward_lock:
                if self.policy.pad_keys or end == chunk_end:
                    logits = self.model.forward(tokens[pos:end], cache, pad_keys_to=chunk_end,
                                                pad_rows_to=self.policy.piece_size(end - pos),
                                                to_host=False)
                else:  # the chunk-only policy's partial last chunk, as is (never published)
                    logits = self.model.forward(tokens[pos:end], cache, to_host=False)
            pos = end
        return None if logits is None else logits.to("cpu")
