"""How much of a cached prefix a request may reuse, decided by measuring, not by assuming.

Exact reuse (docs/design.md §4) computes a prompt with the numerics of canonical chunks of
``prefill_chunk_tokens`` from token 0: each chunk's rows attend over keys padded to the chunk's
end (``kvstore.workers.model.attention``), so every full block of every prompt is canonical and is
published.

Resuming in the middle of a chunk computes fewer rows than the whole chunk, and whether a row
comes out the same when computed with a different number of rows depends on the backend: matmul
libraries pick kernels, and split work over threads, by the row count, so a row count that is
exact with one thread count may not be with another. So the engine never runs a piece with an
arbitrary row count: it rounds the count up to a *piece size* (dummy rows fill the piece; where
a size would cross the chunk's end, cached rows before it are recomputed instead), and
``probe_piece_sizes`` checks each candidate size (powers of two below a block, then every
multiple of a block) on the real model's layers, device, dtype, attention and thread count
before the worker relies on it. The whole chunk is always a valid size, so where nothing smaller
passes a request resumes at chunk boundaries, still publishing every block.

``worker.reuse`` picks the policy: ``exact`` (the default: bitwise equal to ``--no-cache``, as
fine-grained as the probe allows), ``block`` (vLLM's semantics: resume at any block boundary
with rows as they come; numerically close where the probe found sizes that fail, and then in a
namespace of its own so it never hands its KV to an exact worker) and ``chunk`` (resume and
publish at whole chunks only, the last partial chunk unpadded: the baseline the benchmarks
compare against).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import DynamicCache

from kvstore.config import ReuseMode
from kvstore.workers.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

Granularity = Literal["block", "chunk"]

#: Verdicts already measured in this process, by everything that can change them.
_PROBED: dict[tuple[object, ...], tuple[int, ...]] = {}
#: Decoder layers the probe runs: every layer has the same shapes, so the same kernels; two
#: make one layer's whole output (attention and MLP) visible in the next one's K/V.
PROBE_LAYERS = 2
#: The longest prompt the probe tries its sizes at the end of, on an accelerator.
LONG_PROBE_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class ReusePolicy:
    """What a worker does with a cached prefix, and why (for logs, job output and status)."""

    mode: ReuseMode
    chunk_tokens: int
    #: Rows per forward of a piece of a chunk, ascending, ending with the whole chunk; a piece
    #: runs with the smallest size that holds it. Empty: rows as they come (no rounding).
    piece_sizes: tuple[int, ...]
    publish: Granularity  # every full block, or blocks of whole chunks only
    pad_keys: bool  # partial chunks attend over keys padded to the chunk's end
    probed_exact: bool | None  # whether the probe found every size it tried exact (None: no probe)

    @property
    def resume(self) -> Granularity:
        """Where a request may resume from cached blocks."""
        if self.mode == "chunk" or (self.piece_sizes and self.piece_sizes[0] >= self.chunk_tokens):
            return "chunk"
        return "block"

    @property
    def exact(self) -> bool:
        """Whether a cached run is bitwise equal to ``--no-cache`` under this policy."""
        return self.mode != "block" or bool(self.probed_exact)

    def piece_size(self, num_rows: int) -> int:
        """The rows a piece of ``num_rows`` real rows runs with."""
        if not self.piece_sizes:
            return num_rows
        return self.piece_sizes[bisect.bisect_left(self.piece_sizes, num_rows)]

    def describe(self) -> str:
        """One line for logs and tables."""
        sizes = ",".join(map(str, self.piece_sizes)) or "any"
        return (f"reuse={self.mode}: resume at {self.resume} boundaries, pieces of {sizes} "
                f"rows, publish {'every full block' if self.publish == 'block' else 'whole chunks'}"
                f" ({'bitwise' if self.exact else 'approximate'})")

    def as_dict(self) -> dict[str, object]:
        """The json-able form (job output, ``kvstore status``)."""
        return {"mode": self.mode, "resume": self.resume,
                "piece_sizes": list(self.piece_sizes), "publish": self.publish,
                "pad_keys": self.pad_keys, "exact": self.exact}


def choose_policy(mode: ReuseMode, model: CausalLM, block_size: int, chunk_tokens: int
                  ) -> ReusePolicy:
    """The policy for ``mode`` on this model, probing piece sizes where it matters."""
    if mode == "chunk":
        return ReusePolicy("chunk", chunk_tokens, (chunk_tokens,), "chunk", False, None)
    sizes = probe_piece_sizes(model, block_size, chunk_tokens)
    all_exact = sizes == candidate_sizes(block_size, chunk_tokens)
    if mode == "block":
        policy = ReusePolicy("block", chunk_tokens, () if not all_exact else sizes, "block",
                             True, all_exact)
    else:
        policy = ReusePolicy("exact", chunk_tokens, sizes, "block", True, all_exact)
    log.info("kvstore worker %s on %s %s %s: %s", model.name, _device(model), model.dtype,
             model.attn_implementation, policy.describe())
    return policy


def candidate_sizes(block_size: int, chunk_tokens: int) -> tuple[int, ...]:
    """Powers of two below a block, then every multiple of a block up to the chunk.

    A piece starts on a block boundary, so rounding its rows up to a multiple of a block never
    crosses its chunk's end: no cached row is recomputed, and at most a block's worth of dummy
    rows is added.
    """
    small = [1 << i for i in range(block_size.bit_length()) if 1 << i < block_size]
    return (*small, *range(block_size, chunk_tokens + 1, block_size))


def probe_piece_sizes(model: CausalLM, block_size: int, chunk_tokens: int) -> tuple[int, ...]:
    """The piece sizes whose rows come out bitwise as inside the whole chunk, ascending.

    One chunk of seeded random tokens runs whole; then, for each candidate size, pieces of that
    many rows at block-aligned offsets (the chunk's start, its end, one between) run on top of
    the whole run's KV with keys padded to the chunk's end, as the engine runs them. A size
    passes when every piece gives the whole chunk's KV for its rows (and its last logits where
    it ends there). The whole chunk always passes. It runs the model's first ``PROBE_LAYERS``
    decoder layers (shared weights): every layer runs the same kernels, so two settle it at a
    fraction of the model's cost.

    On an accelerator the sizes that pass are tried again at the end of a long prompt
    (``long_probe_tokens``): GPU libraries may pick kernels, or split the reduction, by the
    key length too, so a size exact over one chunk of keys must also be exact over many.
    """
    long_keys = long_probe_tokens(model, chunk_tokens)
    key = (model.fingerprint, _device(model), model.dtype, model.attn_implementation,
           block_size, chunk_tokens, torch.get_num_threads(), long_keys)
    if key not in _PROBED:
        _PROBED[key] = _probe(model, block_size, chunk_tokens, long_keys)
    return _PROBED[key]


def long_probe_tokens(model: CausalLM, chunk_tokens: int) -> int:
    """How long a prompt the probe tries its sizes at the end of: the model's longest, up to
    ``LONG_PROBE_TOKENS``, in whole chunks, on an accelerator; 0 on the CPU, whose rows do not
    depend on the key length (the tests check it at every length they use), so a long probe
    there would only slow the worker's start."""
    if next(model.model.parameters()).device.type == "cpu":
        return 0
    longest = min(int(getattr(model.config, "max_position_embeddings", 0) or 0),
                  LONG_PROBE_TOKENS)
    return longest // chunk_tokens * chunk_tokens if longest > chunk_tokens else 0


def _probe(model: CausalLM, block_size: int, chunk_tokens: int, long_keys: int = 0
           ) -> tuple[int, ...]:
    model = _first_layers(model, PROBE_LAYERS)
    tokens = _probe_tokens(model, chunk_tokens)
    whole_kv, whole_logits = _whole_run(model, tokens, chunk_tokens)
    passing = []
    for size in candidate_sizes(block_size, chunk_tokens)[:-1]:
        last = (chunk_tokens - size) // block_size * block_size  # the latest aligned start
        # Small pieces are cheap: several offsets; large ones end at the chunk's end, where
        # their last logits are checked too.
        offsets = sorted({0, last, last // 2 // block_size * block_size}) \
            if size <= 4 * block_size else [last]
        if all(_piece_matches(model, tokens, whole_kv, whole_logits, start, size, chunk_tokens)
               for start in offsets):
            passing.append(size)
    if long_keys > chunk_tokens and passing:
        tokens = _probe_tokens(model, long_keys)
        whole_kv, whole_logits = _whole_run(model, tokens, chunk_tokens)
        base = long_keys - chunk_tokens  # the last chunk's start
        passing = [size for size in passing if _piece_matches(
            model, tokens, whole_kv, whole_logits,
            base + (chunk_tokens - size) // block_size * block_size, size, long_keys)]
    return (*passing, chunk_tokens)


def _probe_tokens(model: CausalLM, num_tokens: int) -> list[int]:
    generator = torch.Generator().manual_seed(20261122)
    return torch.randint(0, model.shape.vocab_size, (num_tokens,),
                         generator=generator).tolist()


def _whole_run(model: CausalLM, tokens: list[int], chunk_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` run as the engine runs a cold prompt (whole chunks, keys padded to each
    chunk's end): their KV and the last logits."""
    cache = model.new_cache()
    logits = None
    for start in range(0, len(tokens), chunk_tokens):
        logits = model.forward(tokens[start:start + chunk_tokens], cache,
                               pad_keys_to=start + chunk_tokens)
    assert logits is not None
    return model.export_kv(cache, 0, len(tokens)), logits


def _piece_matches(model: CausalLM, tokens: list[int], whole_kv: torch.Tensor,
                   whole_logits: torch.Tensor, start: int, size: int, chunk_end: int) -> bool:
    """Rows ``[start, start + size)`` computed as one piece (keys padded to ``chunk_end``, the
    end of their chunk) equal the whole run's."""
    cache = _prefix_cache(model, whole_kv, start)
    logits = model.forward(tokens[start:start + size], cache, pad_keys_to=chunk_end)
    same = torch.equal(model.export_kv(cache, start, start + size),
                       whole_kv[:, :, start:start + size])
    if start + size == len(tokens):
        same = same and torch.equal(logits, whole_logits)
    return same


def _first_layers(model: CausalLM, num_layers: int) -> CausalLM:
    """A view of ``model`` that runs only its first ``num_layers`` decoder layers.

    Weights and modules are shared, nothing of ``model`` is changed: the view has its own
    config (``num_hidden_layers``, which transformers' Llama loop and caches follow) and its own
    module tables above the layers.
    """
    if model.shape.num_layers <= num_layers:
        return model
    config = copy.copy(model.config)
    config.num_hidden_layers = num_layers
    inner = copy.copy(model.model.model)
    inner._modules = dict(inner._modules)
    inner.config = config
    outer = copy.copy(model.model)
    outer._modules = dict(outer._modules)
    outer._modules["model"] = inner
    outer.config = config
    view = copy.copy(model)
    view.model, view.config = outer, config
    view.shape = dataclasses.replace(model.shape, num_layers=num_layers)
    return view


def _prefix_cache(model: CausalLM, kv: torch.Tensor, end: int) -> DynamicCache:
    """A cache holding tokens ``[0, end)`` of ``kv`` (``[L, 2, T, H, D]``)."""
    if end == 0:
        return model.new_cache()
    return model.cache_from_kv([kv[layer, 0, :end] for layer in range(kv.shape[0])],
                               [kv[layer, 1, :end] for layer in range(kv.shape[0])])


def _device(model: CausalLM) -> str:
    return str(next(model.model.parameters()).device)
