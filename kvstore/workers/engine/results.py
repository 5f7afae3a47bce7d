"""What the engine hands back: a prefill's result, a decode's result, and the private tail.

Plain data, so the results cross a process boundary (a Ray call, a Serve deployment) as they
are; tensors in them are on the host unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class TailKV:
    """KV of the prompt past its last published block: handed from prefill to decode privately."""

    start: int
    kv: torch.Tensor  # [L, 2, T, H, D]


@dataclass(slots=True)
class PrefillResult:
    """What a prefill returns: the first token, where its KV came from, and the private tail."""

    request_id: str
    first_token: int
    num_prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    block_keys: list[bytes]
    num_published_blocks: int
    sources: dict[str, int]
    bytes_fetched: int
    ttft_s: float
    timings: dict[str, float]
    misses: list[str] = field(default_factory=list)
    tail: TailKV | None = None
    logits: torch.Tensor | None = None
    #: Prompt tokens in cached blocks that could not be reused (cut at a chunk boundary, the
    #: block holding the last token, a failed fetch): what finer reuse would still save.
    unreused_shared_tokens: int = 0
    #: Leading blocks of the prompt that are cached or queued for publishing when the result
    #: returns: a decode elsewhere waits for that many (``Engine.decode(wait_for_blocks=)``).
    #: The background publish may still be running (``Engine.wait_published``).
    num_prefix_blocks: int = 0


@dataclass(slots=True)
class DecodeResult:
    """Generated tokens (the prefill's first token first) and how the prompt KV was obtained."""

    request_id: str
    output_token_ids: list[int]
    fetched_tokens: int
    recomputed_tokens: int
    sources: dict[str, int]
    bytes_fetched: int
    decode_s: float
    timings: dict[str, float]
    misses: list[str] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second after the first (``inf`` when no time was measured)."""
        steps = max(0, len(self.output_token_ids) - 1)
        return steps / self.decode_s if self.decode_s > 0 else float("inf")
