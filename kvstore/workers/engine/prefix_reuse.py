"""Which cached prefix a request takes, and where its computing resumes (docs/design.md §4).

``kvstore.workers.engine.reuse_policy`` says which piece sizes are exact on this model; this
module turns a policy into one request's decisions. Resuming at token ``r`` means the KV of
``[0, r)`` comes from cached blocks and ``[r, n)`` is computed chunk by chunk
(``kvstore.workers.engine.prefill_chunks``) with the canonical numerics, so the invariant is:

- ``r`` is a block boundary, ``r <= n - 1`` when the last token's logits are needed, and the
  first piece ``[r, min(chunk_end, n))``, rounded up to its piece size, fits in its chunk
  (``resume_point``): then every computed row is the row a cold run computes;
- only blocks below ``publish_end`` are published: those are canonical in every prompt that
  shares them, so any later request may resume from them.

A fetch that comes back short (a rejected block, a holder gone) only moves ``r`` back.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.workers.engine.block_io import Fetch
from kvstore.workers.engine.reuse_policy import ReusePolicy


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    """The reuse decisions of one engine: its policy at its block size and chunk length."""

    policy: ReusePolicy
    block_size: int
    chunk_tokens: int

    def publish_end(self, num_tokens: int) -> int:
        """Where the published blocks of a prompt of ``num_tokens`` end."""
        unit = self.block_size if self.policy.publish == "block" else self.chunk_tokens
        return num_tokens // unit * unit

    def resume_point(self, cached: int, num_tokens: int) -> int:
        """Where computing starts when the KV of the first ``cached`` tokens (whole blocks) is at
        hand: ``cached`` itself, or earlier where the first piece's size reaches back (already
        cached rows are then recomputed, bitwise the same), or the chunk's start."""
        chunk, bs = self.chunk_tokens, self.block_size
        if cached >= num_tokens:
            return num_tokens
        if self.policy.mode == "chunk":
            return cached // chunk * chunk
        chunk_end = (cached // chunk + 1) * chunk
        start = cached
        while True:
            size = self.policy.piece_size(min(chunk_end, num_tokens) - start)
            if start <= chunk_end - size:
                return start
            start = (chunk_end - size) // bs * bs

    def prefill_fetch_blocks(self, hit: int, num_tokens: int) -> int:
        """Blocks a prefill fetches of the ``hit`` cached ones: never the block holding the last
        token, which always runs (its logits give the first token)."""
        return min(hit, (num_tokens - 1) // self.block_size)

    def keep_resumable(self, fetch: Fetch, num_tokens: int, num_good: int | None = None
                       ) -> None:
        """Cut ``fetch`` back to the blocks below the resume point of its leading ``num_good``
        blocks (``None``: all it holds)."""
        cached = len(fetch.payloads) if num_good is None else num_good
        fetch.keep(self.resume_point(cached * self.block_size, num_tokens) // self.block_size)

    def first_block_to_publish(self, resume: int, hit: int, num_tokens: int,
                               fetch_failed: bool) -> int:
        """The first block a prefill that resumed at ``resume`` publishes.

        Blocks already cached past the resume point (``hit``) are skipped, unless a fetch
        failed: then everything from the resume point is offered again to replace a bad copy.
        """
        first = resume // self.block_size
        if fetch_failed:
            return first
        return max(first, min(hit, self.publish_end(num_tokens) // self.block_size))

    def decode_prefix_end(self, num_tokens: int, prefilled: bool) -> int:
        """Where the blocks a decode fetches end: what the prefill published, and without a
        prefill in front (``prefilled=False``) never the block holding the last token, which
        must run to give the first token."""
        end = self.publish_end(num_tokens)
        if prefilled:
            return end
        return min(end, (num_tokens - 1) // self.block_size * self.block_size)
