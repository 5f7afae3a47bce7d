"""How much of a cached prefix a request may reuse, decided by measuring, not by assuming.

Exact reuse (docs/design.md §4) computes a prompt with the numerics of canonical chunks of
``prefill_chunk_tokens`` from token 0. Two facts decide how fine-grained the reuse can be:

* Every full block of a prompt can be published once the prompt's last, partial chunk gets the
  numerics of a whole chunk: its rows attend over keys padded to the chunk's end, or, on a
  backend where that is not enough, the chunk is padded with dummy rows.
* A request can resume at any block boundary (not only at a chunk boundary) only where a
  backend's per-row results do not depend on how many rows run together. CPU matmuls are row
  invariant; GPU GEMM libraries often pick other kernels for other row counts. So
  ``probe_min_rows`` checks it on the real model, device, dtype and attention before a
  worker relies on it, and the worker falls back to chunk boundaries (and dummy rows) where it
  fails.

``worker.reuse`` picks the policy: ``exact`` (the default: bitwise equal to ``--no-cache``,
as fine-grained as the probe allows), ``block`` (vLLM's semantics: resume at any block boundary
on any backend, numerically close where the probe fails, and then in a namespace of its own so
it never hands its KV to an exact worker) and ``chunk`` (the previous policy: resume and
publish at whole chunks only, no padding; kept as the benchmarks' baseline).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache

from kvstore.config import ReuseMode
from workers.model import CausalLM

log = logging.getLogger(__name__)

Granularity = Literal["block", "chunk"]
Padding = Literal["keys", "rows", "none"]

#: Verdicts already measured in this process, by everything that can change them.
_PROBED: dict[tuple[object, ...], int | None] = {}


@dataclass(frozen=True, slots=True)
class ReusePolicy:
    """What a worker does with a cached prefix, and why (for logs, job output and status)."""

    mode: ReuseMode
    resume: Granularity  # where a request may pick up from cached blocks
    padding: Padding  # how a partial chunk gets whole-chunk numerics
    publish: Granularity  # which full blocks are published: every one, or whole chunks only
    row_invariant: bool | None  # the probe's verdict (None: not probed)
    min_rows: int = 1  # a piece of a chunk with fewer rows runs with dummy rows up to this

    @property
    def exact(self) -> bool:
        """Whether a cached run is bitwise equal to ``--no-cache`` under this policy."""
        return self.mode != "block" or bool(self.row_invariant)

    def describe(self) -> str:
        """One line for logs and tables."""
        probe = {None: "not probed", True: f"rows invariant from {self.min_rows} rows",
                 False: "rows NOT invariant"}
        return (f"reuse={self.mode}: resume at {self.resume} boundaries, pad {self.padding}, "
                f"publish {'every full block' if self.publish == 'block' else 'whole chunks'} "
                f"({probe[self.row_invariant]}; {'bitwise' if self.exact else 'approximate'})")

    def as_dict(self) -> dict[str, object]:
        """The json-able form (job output, ``kvstore status``)."""
        return {"mode": self.mode, "resume": self.resume, "padding": self.padding,
                "publish": self.publish, "row_invariant": self.row_invariant,
                "min_rows": self.min_rows, "exact": self.exact}


def choose_policy(mode: ReuseMode, model: CausalLM, block_size: int, chunk_tokens: int
                  ) -> ReusePolicy:
    """The policy for ``mode`` on this model, probing row invariance where it matters."""
    if mode == "chunk":
        return ReusePolicy("chunk", "chunk", "none", "chunk", None)
    min_rows = probe_min_rows(model, block_size, chunk_tokens)
    if mode == "block" or min_rows is not None:
        policy = ReusePolicy(mode, "block", "keys", "block", min_rows is not None, min_rows or 1)
    else:
        policy = ReusePolicy(mode, "chunk", "rows", "block", False)
    log.info("kvstore worker %s on %s %s %s: %s", model.name, _device(model), model.dtype,
             model.attn_implementation, policy.describe())
    return policy


#: Candidates for the fewest rows a piece of a chunk runs with (dummy rows make up the rest):
#: matmul libraries often switch kernels for the smallest row counts (measured here: rows
#: computed 1-3 at a time differ from the same rows inside a chunk, 4 or more do not).
ROW_FLOORS = (1, 2, 4, 8, 16)


def probe_min_rows(model: CausalLM, block_size: int, chunk_tokens: int) -> int | None:
    """The fewest rows a piece of a chunk must run with for its rows to be the whole chunk's.

    ``None`` when no floor up to a block works: then only whole (row-padded) chunks are exact.
    One chunk of seeded random tokens runs whole; then pieces starting at block boundaries,
    from 1 row to the chunk's end, run on top of the whole run's KV with keys padded to the
    chunk's end, as the engine runs them. Every piece must give bitwise the whole chunk's KV for
    its rows, and the whole chunk's last logits where it ends there.
    """
    key = (model.fingerprint, _device(model), model.dtype, model.attn_implementation,
           block_size, chunk_tokens, torch.get_num_threads())
    if key not in _PROBED:
        _PROBED[key] = _probe(model, block_size, chunk_tokens)
    return _PROBED[key]


def _probe(model: CausalLM, block_size: int, chunk_tokens: int) -> int | None:
    generator = torch.Generator().manual_seed(20261122)
    tokens = torch.randint(0, model.shape.vocab_size, (chunk_tokens,),
                           generator=generator).tolist()
    whole = model.new_cache()
    whole_logits = model.forward(tokens, whole, pad_keys_to=chunk_tokens)
    whole_kv = model.export_kv(whole, 0, chunk_tokens)
    # Starts after the first block and at the last one (both ends of a chunk); the first start
    # begins at 0 when a chunk is a single block (then a piece can only start there).
    starts = sorted({min(block_size, chunk_tokens - block_size), chunk_tokens - block_size})
    cases = [(start, rows) for start in starts
             for rows in sorted({1, 2, 3, block_size - 1, block_size, chunk_tokens - start})
             if 0 < rows <= chunk_tokens - start]
    for floor in (f for f in ROW_FLOORS if f <= block_size):
        for start, rows in cases:
            cache = _prefix_cache(model, whole_kv, start)
            logits = model.forward(tokens[start:start + rows], cache, pad_keys_to=chunk_tokens,
                                   pad_rows_to=max(rows, floor))
            same = torch.equal(model.export_kv(cache, start, start + rows),
                               whole_kv[:, :, start:start + rows])
            if start + rows == chunk_tokens:
                same = same and torch.equal(logits, whole_logits)
            if not same:
                break
        else:
            return floor
    return None


def _prefix_cache(model: CausalLM, kv: torch.Tensor, end: int) -> DynamicCache:
    """A cache holding tokens ``[0, end)`` of ``kv`` (``[L, 2, T, H, D]``)."""
    if end == 0:
        return model.new_cache()
    return model.cache_from_kv([kv[layer, 0, :end] for layer in range(kv.shape[0])],
                               [kv[layer, 1, :end] for layer in range(kv.shape[0])])


def _device(model: CausalLM) -> str:
    return str(next(model.model.parameters()).device)
