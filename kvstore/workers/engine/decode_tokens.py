"""The decode loop: one token per step on top of a prompt's KV, until a stop.

A step runs the last token through the model, brings its logits to the host and picks the next
token there (``kvstore.workers.model.sampling``), so a token is known, and can be streamed, as
soon as its step ends. The loop stops at ``max_new_tokens`` tokens (the prefill's first token
counted) or after a stop token.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvstore.workers.model.causal_lm import CausalLM
from kvstore.workers.model.sampling import SamplingParams, pick_token


@dataclass(frozen=True, slots=True)
class TokenLoop:
    """Generates with ``model``, holding ``forward_lock`` around each step (see ``Engine``)."""

    model: CausalLM
    forward_lock: threading.Lock

    def run(self, cache: DynamicCache, first_token: int, sampling: SamplingParams,
            check: Callable[[], None], *, return_logits: bool,
            on_token: Callable[[int], None] | None = None
            ) -> tuple[list[int], list[torch.Tensor]]:
        """The tokens (``first_token`` first) and, with ``return_logits``, each step's logits.

        ``cache`` holds the prompt's KV; ``first_token`` has not run yet. ``max_new_tokens=0``
        (a warm-up) generates nothing, not even ``first_token``. ``check`` runs before each step
        and raises to stop the request; ``on_token`` sees each token after the first as soon as
        it is picked (streaming).
        """
        all_logits: list[torch.Tensor] = []
        if sampling.max_new_tokens == 0:
            return [], all_logits
        out = [first_token]
        while len(out) < sampling.max_new_tokens and out[-1] not in sampling.stop_token_ids:
            check()
            with self.forward_lock:
                logits = self.model.forward([out[-1]], cache)
            if return_logits:
                all_logits.append(logits)
            out.append(pick_token(logits, sampling, len(out)))
            if on_token is not None:
                on_token(out[-1])
        return out, all_logits
