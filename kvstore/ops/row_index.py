"""The row geometry and flat row indices of kvstore.ops.operators, built without device syncs.

A row layout says how a cache's (block, slot) dims merge into one row axis (see
kvstore.ops.operators); an index counts ``unit`` consecutive rows per entry. Host metadata (block
tables and lengths built by the scheduler, the usual case) is checked and expanded with numpy,
which costs microseconds and reads no device memory; the index then travels to the cache's device
in a single non-blocking copy from pinned memory. So a call on a GPU queues one small copy and one
``index_select`` / ``index_copy_`` per cache and returns at once: the host never waits for the
device. A load of whole blocks, the usual one, needs no arithmetic at all: its index is the
used table entries (:func:`whole_blocks`).

Metadata already on a device is read back in one copy when it is to be checked, or, unchecked,
expanded there with torch ops that need no host values (``repeat_interleave`` given its
``output_size``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

Ints = npt.NDArray[np.int64]
AnyInts = npt.NDArray[np.integer]


# ----------------------------------------------------------------------------- row views


#: ``(ratio, row_stride, num_rows)``: how dims 0 and ``inner`` of a tensor merge into rows.
RowLayout = tuple[int, int, int]


def row_layout(x: torch.Tensor, inner: int) -> RowLayout | None:
    """How dims 0 and ``inner`` of ``x`` merge into one row axis, without copying.

    ``row = index_0 * ratio + index_inner``; ``None`` when the strides do not allow it (then
    the caller uses advanced indexing). Only numbers: :func:`runs_view` makes the one view.
    """
    n_o, n_i = x.shape[0], x.shape[inner]
    s_o, s_i = x.stride(0), x.stride(inner)
    if n_i == 1:
        return 1, s_o, n_o
    if n_o <= 1:
        return 0, s_i, n_i * n_o
    if s_i > 0 and s_o % s_i == 0:
        return s_o // s_i, s_i, (n_o - 1) * (s_o // s_i) + n_i
    return None


def runs_view(x: torch.Tensor, inner: int, rows: RowLayout, unit: int) -> torch.Tensor:
    """``x`` as rows (see :func:`row_layout`) in runs of ``unit`` rows, in one view:
    ``[num_rows // unit, unit, ...]``, or ``[num_rows, ...]`` when ``unit == 1``."""
    _, row_stride, num_rows = rows
    shape, strides = x.shape, x.stride()
    rest = (*shape[1:inner], *shape[inner + 1:])
    rest_strides = (*strides[1:inner], *strides[inner + 1:])
    if unit == 1:
        return x.as_strided((num_rows, *rest), (row_stride, *rest_strides), x.storage_offset())
    return x.as_strided((num_rows // unit, unit, *rest),
                        (row_stride * unit, row_stride, *rest_strides), x.storage_offset())


# ----------------------------------------------------------------------------- transfers


def host_arrays(*tensors: torch.Tensor) -> list[AnyInts]:
    """The tensors as numpy arrays; device ones come back in one copy (one sync in all)."""
    remote = [t for t in tensors if not t.is_cpu]
    if not remote:
        return [t.numpy() for t in tensors]
    where = remote[0].device
    flat = torch.cat([t.reshape(-1).to(device=where, dtype=torch.int64) for t in remote])
    values = iter(np.split(flat.cpu().numpy(), np.cumsum([t.numel() for t in remote])[:-1]))
    return [t.numpy() if t.is_cpu else next(values).reshape(t.shape)
            for t in tensors]


def to_device(index: AnyInts, device: torch.device) -> torch.Tensor:
    """``index`` as a tensor on ``device``: one non-blocking copy, from pinned memory on CUDA.

    The caching host allocator keeps the pinned block until the copy has run, so the
    temporary may be dropped at once.
    """
    t = torch.from_numpy(index)
    if device.type == "cpu":
        return t
    if device.type == "cuda":  # implies CUDA is available: pinning needs it
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class RecentIndices:
    """The device copies of the last few small indices, by content, for one device each.

    A paged load over a model's layers passes the same block table once per layer, and a decode
    step passes the table of the step before: copying it to the device every call puts a
    host-to-device copy, with its fixed latency, in the stream between the gathers. A copy is
    reused while it is among the ``capacity`` most recent. Used on another stream than the one
    that copied it, that stream first waits for the copy, and the copy is kept alive for it.
    """

    def __init__(self, capacity: int = 8, max_elements: int = 1 << 16) -> None:
        self.capacity = capacity
        self.max_elements = max_elements
        self._entries: dict[tuple[torch.device, str, bytes], tuple[torch.Tensor, Any, Any]] = {}
        self._lock = threading.Lock()

    def get(self, index: AnyInts, device: torch.device) -> torch.Tensor:
        """``to_device(index, device)``, or the copy a recent call made of the same values."""
        if device.type != "cuda" or index.size > self.max_elements:
            return to_device(index, device)
        key = (device, index.dtype.str, np.ascontiguousarray(index).tobytes())
        stream = torch.cuda.current_stream(device)
        with self._lock:
            hit = self._entries.pop(key, None)
            if hit is not None:
                self._entries[key] = hit  # most recent last
        if hit is not None:
            tensor, made_on, ready = hit
            if made_on != stream:
                stream.wait_event(ready)
                tensor.record_stream(stream)
            return tensor
        tensor = to_device(index, device)
        ready = torch.cuda.Event()
        ready.record(stream)
        with self._lock:
            self._entries[key] = (tensor, stream, ready)
            while len(self._entries) > self.capacity:
                del self._entries[next(iter(self._entries))]
        return tensor


#: Block tables of paged loads (``kvstore.ops.operators``).
recent_block_indices = RecentIndices()


# ----------------------------------------------------------------------------- checks


def first_bad(name: str, values: AnyInts, bad: npt.NDArray[np.bool_], rule: str) -> None:
    """Raise naming the first ``values[i]`` flagged in ``bad``, if any."""
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(f"{name}[{i}] = {int(values[i])} but {rule}")


def check_scatter(token_offset: AnyInts, seq_len: AnyInts, ntokens: int,
                  max_seq_len: int) -> tuple[Ints, Ints]:
    """The value rules of ``kv_cache_scatter``'s ``token_offset`` and ``seq_len``, as int64."""
    offs, lens = token_offset.astype(np.int64), seq_len.astype(np.int64)
    total = int(lens.sum())
    # Valid values, the usual case, pass in four reductions; the rules below name what is wrong.
    if total == ntokens and lens.size and lens.min() >= 0 and (offs - lens).min() >= 0 \
            and offs.max() <= max_seq_len:
        return offs, lens
    # A sequence with nothing new this call (0) writes nothing, as the spec's loop does; it lets
    # one call address a few of many sequences (a connector loading some of vLLM's blocks).
    first_bad("seq_len", lens, lens < 0, "every seq_len must be >= 0")
    if total != ntokens:
        raise ValueError(f"sum(seq_len) = {total} must equal new_kv's ntokens = {ntokens}")
    first_bad("token_offset", offs, offs < lens, "token_offset[i] must be >= seq_len[i]")
    first_bad("token_offset", offs, offs > max_seq_len,
              f"token_offset[i] must be <= max_seq_len = {max_seq_len} (past.shape[2])")
    return offs, lens


def check_load(context_lens: AnyInts, seq_starts: AnyInts | None, cumsum: bool, width: int,
               block_size: int) -> tuple[Ints, Ints]:
    """The value rules of ``paged_cache_load``'s lengths and starts: int64 ``(lens, starts)``."""
    cl = context_lens.astype(np.int64)
    if cumsum:
        if cl[0] != 0:
            raise ValueError(f"context_lens[0] = {int(cl[0])} but cumulative sums start at 0")
        lens = cl[1:] - cl[:-1]
        first_bad("context_lens", cl[1:], lens < 0,
                  "cumulative sums must not decrease (context_lens[i+1] < context_lens[i])")
    else:
        lens = cl
        first_bad("context_lens", cl, cl < 0, "context lengths must be >= 0")
    if seq_starts is None:
        starts = np.zeros_like(lens)
    else:
        starts = seq_starts.astype(np.int64)
        first_bad("seq_starts", starts, starts < 0, "seq_starts must be >= 0")
    # The last block position each non-empty sequence uses must lie inside the table.
    last_pos = (starts + lens - 1) // block_size
    first_bad("context_lens", lens, (lens > 0) & (last_pos >= width),
              f"with its seq_starts it needs a block_table position past the table's width "
              f"{width} (block_size {block_size})")
    return lens, starts


# ----------------------------------------------------------------------------- host indices


def whole_blocks(table: AnyInts, context_lens: AnyInts, cumsum: bool, block_size: int,
                 num_blocks: int) -> AnyInts | None:
    """The block ids a load of whole blocks reads, in output order; ``None`` if it is not one.

    The usual load (every length a multiple of ``block_size``, no starts) needs no per-token
    arithmetic: its index is the used prefix of each table row, bounds-checked in one
    reduction. Anything else, invalid values included, gets ``None`` and goes through
    :func:`check_load` and :func:`host_load_rows`, the one source of the error messages.
    """
    batch, width = table.shape
    if batch == 1 and not cumsum:  # one sequence, the engine's case: plain Python ints
        num, rem = divmod(int(context_lens[0]), block_size)
        if num < 0 or rem or num > width:
            return None
        blocks = table[0, :num]
    else:
        if batch == 0 or (cumsum and context_lens[0] != 0):
            return None
        # int64 first: a difference of int32 cumulative sums may wrap around
        lens = np.diff(context_lens.astype(np.int64)) if cumsum else context_lens
        nums, rems = np.divmod(lens, block_size)
        if rems.any() or lens.min() < 0 or nums.max() > width:
            return None
        blocks = table[np.arange(width) < nums[:, None]]  # row-major: sequence by sequence
    # One reduction checks both bounds: read as unsigned, a negative id is huge.
    if blocks.size and blocks.view(np.uint32 if blocks.itemsize == 4 else np.uint64).max() \
            >= num_blocks:
        return None
    return np.ascontiguousarray(blocks)  # a copy only for a strided table


def host_scatter_rows(offs: Ints, lens: Ints, ratio: int, unit: int,
                      device: torch.device) -> torch.Tensor:
    """Destination row (in units) of each unit of ``new_kv``, on ``device``.

    Sequence ``i`` fills rows ``i * ratio + offs[i] - lens[i] + [0, lens[i])``.
    """
    if lens.shape[0] == 1:  # one sequence, the engine's case: one range, from Python ints
        first, num = (int(offs[0]) - int(lens[0])) // unit, int(lens[0]) // unit
        return to_device(np.arange(first, first + num), device)
    lens_u = lens // unit
    base = (np.arange(lens.shape[0]) * ratio + offs - lens) // unit - (np.cumsum(lens_u) - lens_u)
    return to_device(np.arange(int(lens_u.sum())) + np.repeat(base, lens_u), device)


def host_load_rows(table: AnyInts, lens: Ints, starts: Ints, block_size: int,
                   unit: int, num_blocks: int, ratios: tuple[int, int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Source row ``block * ratio + slot`` (in units) of each output unit, per cache.

    Built a block at a time, so few steps cost per unit: each used table entry (checked to
    name a block) gives its ``block_size // unit`` rows, less the units before a sequence's
    start and past its end. One copy per distinct ratio.
    """
    bs_u = block_size // unit
    first_u, end_u = starts // unit, (starts + lens) // unit  # the units each sequence reads
    first = first_u // bs_u  # its first block position, and one past its last
    end = np.where(lens > 0, (end_u + bs_u - 1) // bs_u, first)
    positions = np.arange(table.shape[1])
    used = (positions >= first[:, None]) & (positions < end[:, None])
    block = table[used].astype(np.int64)  # row-major: in output order
    if block.view(np.uint64).max() >= num_blocks:  # negative ids read as huge
        k = int(((block < 0) | (block >= num_blocks)).argmax())
        i, p = (int(x[k]) for x in np.nonzero(used))
        raise ValueError(
            f"block_table[{i}][{p}] = {int(block[k])} is outside [0, num_blocks={num_blocks}) "
            f"but sequence {i} uses it (token {max(int(first_u[i]), p * bs_u) * unit})"
        )
    # keep[j, s]: whether slot s of used block j is read; only a sequence's end blocks lose any.
    some = lens > 0
    last = (np.cumsum(end - first) - 1)[some]  # each sequence's last and first used block
    first_j = last - (end - first)[some] + 1
    slots = np.arange(bs_u)
    keep = np.ones((block.shape[0], bs_u), dtype=bool)
    keep[first_j] &= slots >= (first_u - first * bs_u)[some, None]
    keep[last] &= slots < (end_u - (end - 1) * bs_u)[some, None]
    rows = {r: to_device(((block * (r // unit))[:, None] + slots)[keep], device)
            for r in set(ratios)}
    return rows[ratios[0]], rows[ratios[1]]


# ----------------------------------------------------------------------------- device indices
# Unchecked (check=False) and in tokens: unit runs would need the lengths on the host.


def device_scatter_rows(offs: torch.Tensor, lens: torch.Tensor, ratio: int,
                        ntokens: int) -> torch.Tensor:
    """:func:`host_scatter_rows` with ``unit = 1`` from int64 tensors on the cache's device."""
    batch = torch.arange(lens.shape[0], device=lens.device)
    seq = torch.repeat_interleave(batch, lens, output_size=ntokens)
    base = batch * ratio + offs - lens - (torch.cumsum(lens, 0) - lens)
    return torch.arange(ntokens, device=lens.device) + base.index_select(0, seq)


def device_load_rows(table: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor | None,
                     block_size: int, num_tokens: int,
                     ratios: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`host_load_rows` with ``unit = 1`` from int64 tensors on the cache's device."""
    batch, width = table.shape
    device = table.device
    seq = torch.repeat_interleave(torch.arange(batch, device=device), lens,
                                  output_size=num_tokens)
    out_start = torch.cumsum(lens, 0) - lens
    shift = -out_start if starts is None else starts - out_start
    t = torch.arange(num_tokens, device=device) + shift.index_select(0, seq)
    pos = torch.div(t, block_size, rounding_mode="floor")
    slot = t - pos * block_size
    block = table.reshape(-1).index_select(0, seq * width + pos)
    if ratios[0] == ratios[1]:
        rows = block * ratios[0] + slot
        return rows, rows
    return block * ratios[0] + slot, block * ratios[1] + slot
