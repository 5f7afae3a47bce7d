"""How a request picks its tokens: greedy, or seeded sampling that every replica repeats.

The seed of each step depends on the request's seed and the step number only, so a token is
the same whichever replica (prefill or decode, cached or not) picks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError


@dataclass(slots=True)
class SamplingParams:
    """How tokens are picked: greedy when ``temperature == 0``, else seeded sampling.

    ``max_new_tokens == 0`` is a cache warm-up: the prompt is prefilled and its blocks are
    published, and no token is returned.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    sampling_seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0 (0: prefill and publish only), "
                              f"got {self.max_new_tokens}")
        if self.temperature < 0 or self.top_k < 0:
            raise ConfigError("temperature and top_k must be >= 0")


def pick_token(logits: torch.Tensor, sampling: SamplingParams, step: int) -> int:
    """Greedy or seeded sampling; the seed depends on the step only, so any replica agrees."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.double() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    gen = torch.Generator().manual_seed(sampling.sampling_seed * 1_000_003 + step)
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen))
