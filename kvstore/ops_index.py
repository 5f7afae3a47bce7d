"""The flat row indices of kvstore.ops, built where the metadata lives, without device syncs.

Host metadata (block tables and lengths built by the scheduler, the usual case) is checked and
expanded with numpy, which costs microseconds and reads no device memory; the one int64 index
per cache then travels to the cache's device in a single non-blocking copy from pinned memory.
So a call on a GPU queues one small copy and one ``index_select`` / ``index_copy_`` per cache
and returns at once: the host never waits for the device.

Metadata already on a device is read back in one copy when it is to be checked, or, unchecked,
expanded there with torch ops that need no host values (``repeat_interleave`` given its
``output_size``). An index counts ``unit`` consecutive rows per entry (see kvstore.ops).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

Ints = npt.NDArray[np.int64]
AnyInts = npt.NDArray[np.integer]


# ----------------------------------------------------------------------------- transfers


def host_arrays(*tensors: torch.Tensor) -> list[AnyInts]:
    """The tensors as numpy arrays; device ones come back in one copy (one sync in all)."""
    remote = [t for t in tensors if t.device.type != "cpu"]
    if not remote:
        return [t.numpy() for t in tensors]
    where = remote[0].device
    flat = torch.cat([t.reshape(-1).to(device=where, dtype=torch.int64) for t in remote])
    values = iter(np.split(flat.cpu().numpy(), np.cumsum([t.numel() for t in remote])[:-1]))
    return [t.numpy() if t.device.type == "cpu" else next(values).reshape(t.shape)
            for t in tensors]


def to_device(index: Ints, device: torch.device) -> torch.Tensor:
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
    first_bad("seq_len", lens, lens <= 0, "every seq_len must be > 0")
    total = int(lens.sum())
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


def host_scatter_rows(offs: Ints, lens: Ints, ratio: int, unit: int,
                      device: torch.device) -> torch.Tensor:
    """Destination row (in units) of each unit of ``new_kv``, on ``device``.

    Sequence ``i`` fills rows ``i * ratio + offs[i] - lens[i] + [0, lens[i])``.
    """
    lens_u = lens // unit
    base = (np.arange(lens.shape[0]) * ratio + offs - lens) // unit - (np.cumsum(lens_u) - lens_u)
    return to_device(np.arange(int(lens_u.sum())) + np.repeat(base, lens_u), device)


def host_load_rows(table: AnyInts, lens: Ints, starts: Ints, block_size: int,
                   unit: int, num_blocks: int, ratios: tuple[int, int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Source row ``block * ratio + slot`` (in units) of each output unit, per cache.

    Checks that every table entry a sequence uses names a block; one copy per distinct ratio.
    """
    lens_u, bs_u = lens // unit, block_size // unit
    out_start = np.cumsum(lens_u) - lens_u
    seq = np.repeat(np.arange(lens.shape[0]), lens_u)
    # Unit k of sequence i is position t = k - out_start[i] + starts[i] of that sequence.
    t = np.arange(seq.shape[0]) + np.repeat(starts // unit - out_start, lens_u)
    pos, slot = np.divmod(t, bs_u)
    block = table[seq, pos].astype(np.int64, copy=False)
    if block.min() < 0 or block.max() >= num_blocks:
        k = int(((block < 0) | (block >= num_blocks)).argmax())
        i, p = int(seq[k]), int(pos[k])
        raise ValueError(
            f"block_table[{i}][{p}] = {int(block[k])} is outside [0, num_blocks={num_blocks}) "
            f"but sequence {i} uses it (token {int(t[k]) * unit})"
        )
    rows = {r: to_device(block * (r // unit) + slot, device) for r in set(ratios)}
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
