"""The two KV operators of docs/design.md §3.3: ``kv_cache_scatter`` and ``paged_cache_load``.

Both are one flat index computation plus one ``index_copy_`` / ``index_select`` over a
row view of the cache, so the cost is the bytes moved, not Python. The row view merges the
(block, slot) pair of a cache into one row axis without copying::

    cache [num_blocks, block_size, ...]  strides (s_block, s_slot, ...)
    row(b, s) = b * (s_block // s_slot) + s          row stride s_slot

When ``s_block`` is a multiple of ``s_slot`` (always true for contiguous caches and for
per-layer views of a block-major pool such as ``pool[:, layer, 0]``) the rows in between belong
to other layers and are simply never indexed. Otherwise the operators fall back to advanced
indexing, which handles any strides. A load of whole blocks (ND, every length a multiple of
``block_size``, no starts: the usual one) needs neither: it selects blocks, along dim 0.

Every violated constraint is a ``ValueError`` naming the argument and the bad value. Checks
and index are built where the metadata lives (``kvstore.ops.row_index``): host metadata, the
usual case, is always checked and never waits for the device. Device metadata is read back
once to be checked, unless ``check=False`` (for callers that checked it themselves) builds the
index there without a sync, save the output size of ``paged_cache_load`` when no ``out`` gives
it and a ``layer_id`` tensor's value. Unchecked bad values are undefined behaviour (an index
error, or a device-side assert on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.constants import DTYPE_NAMES
from kvstore.ops.row_index import (
    AnyInts,
    RowLayout,
    check_load,
    check_scatter,
    device_load_rows,
    device_scatter_rows,
    host_arrays,
    host_load_rows,
    host_scatter_rows,
    recent_block_indices,
    row_layout,
    runs_view,
    whole_blocks,
)

__all__ = ["kv_cache_scatter", "paged_cache_load", "nz_align", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in DTYPE_NAMES)
_INDEX_DTYPES = (torch.int32, torch.int64)
_NZ_ROW_BYTES = 32
# The dims key and value caches share, with their names for the error message.
_ND_SAME: tuple[tuple[int, str], ...] = ((0, "num_blocks"), (1, "block_size"), (2, "num_heads"))
_NZ_SAME: tuple[tuple[int, str], ...] = ((0, "num_blocks"), (2, "block_size"))


def nz_align(dtype: torch.dtype) -> int:
    """Elements per 32-byte NZ fragment: int8/uint8 32, float16/bfloat16 16, float32 8."""
    return _NZ_ROW_BYTES // dtype.itemsize


# ----------------------------------------------------------------------------- validation


def _check_cache(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name} dtype {x.dtype} is not supported; use float16, bfloat16, float32, int8 or "
            "uint8 (a quantized cache's bytes)"
        )
    return x


def _index(name: str, x: object, ndim: int) -> torch.Tensor:
    """``x`` checked to be an int32/int64 index tensor of rank ``ndim`` (values unread)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be an int32 or int64 torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not an index dtype; use int32 or int64")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x


def _on_host(device: torch.device, *meta: torch.Tensor | None) -> bool:
    """Whether the index is built on the host: the cache or all its metadata lives there."""
    return device.type == "cpu" or all(t is None or t.is_cpu for t in meta)


def _on_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int64, non_blocking=True)


def _layer_index(layer_id: object, num_layers: int) -> int:
    if isinstance(layer_id, torch.Tensor):
        if layer_id.dtype not in _INDEX_DTYPES or layer_id.numel() != 1 or layer_id.dim() > 1:
            raise ValueError(
                f"layer_id must be an int or a [1] int32 tensor, got a {layer_id.dtype} tensor "
                f"of shape {tuple(layer_id.shape)}"
            )
        layer = int(layer_id.reshape(()).item())
    elif isinstance(layer_id, int) and not isinstance(layer_id, bool):
        layer = layer_id
    else:
        raise ValueError(f"layer_id must be an int or a [1] int32 tensor, got {layer_id!r}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer_id = {layer} is outside [0, {num_layers}) (past.shape[0])")
    return layer


# ----------------------------------------------------------------------------- scatter


def kv_cache_scatter(
    past: torch.Tensor,
    new_kv: torch.Tensor,
    layer_id: int | torch.Tensor,
    token_offset: torch.Tensor,
    seq_len: torch.Tensor,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Write each sequence's new K or V rows into layer ``layer_id`` of ``past``, in place.

    ``past`` is ``[layers, batch, max_seq_len, hidden]``; ``new_kv`` is ``[ntokens, hidden]``
    or ``[batch, seq, heads, head_size]`` (read as packed ``[batch*seq, hidden]``). Sequence
    ``i`` fills positions ``[token_offset[i] - seq_len[i], token_offset[i])``. Returns ``past``.
    ``check=False`` skips the value checks that would read device memory (see module doc).
    """
    _check_cache("past", past, 4)
    if not isinstance(new_kv, torch.Tensor):
        raise ValueError(f"new_kv must be a torch.Tensor, got {type(new_kv).__name__}")
    num_layers, batch, max_seq_len, hidden = past.shape
    if new_kv.dtype != past.dtype:
        raise ValueError(f"new_kv dtype {new_kv.dtype} must equal past dtype {past.dtype}")
    if new_kv.device != past.device:
        raise ValueError(f"new_kv is on {new_kv.device} but past is on {past.device}")
    if new_kv.dim() == 4:
        if new_kv.shape[2] * new_kv.shape[3] != hidden:
            raise ValueError(
                f"new_kv shape {tuple(new_kv.shape)}: heads*head_size = "
                f"{new_kv.shape[2] * new_kv.shape[3]} must equal past hidden size {hidden}"
            )
        new_kv = new_kv.reshape(-1, hidden)
    elif new_kv.dim() != 2:
        raise ValueError(
            f"new_kv must be [ntokens, hidden] or [batch, seq, heads, head_size], "
            f"got shape {tuple(new_kv.shape)}"
        )
    elif new_kv.shape[1] != hidden:
        raise ValueError(f"new_kv hidden size {new_kv.shape[1]} must equal past's {hidden}")
    strides = past.stride()
    if 0 in strides and any(st == 0 and n > 1 for st, n in zip(strides, past.shape, strict=True)):
        raise ValueError("past must not be an expanded tensor (stride 0): rows would alias")
    layer = _layer_index(layer_id, num_layers)
    offs = _index("token_offset", token_offset, 1)
    lens = _index("seq_len", seq_len, 1)
    if offs.shape[0] != batch or lens.shape[0] != batch:
        raise ValueError(
            f"token_offset and seq_len must be [batch={batch}] (past.shape[1]), got "
            f"{tuple(offs.shape)} and {tuple(lens.shape)}"
        )
    ntokens = new_kv.shape[0]
    dst = past[layer]  # [batch, max_seq_len, hidden], a view
    rows = row_layout(dst, 1)
    # Without a row view, an index is sequence * max_seq_len + position, split up below.
    ratio = rows[0] if rows is not None else max_seq_len
    unit = 1
    if check or _on_host(past.device, offs, lens):
        offs_h, lens_h = host_arrays(offs, lens)
        offs_h, lens_h = check_scatter(offs_h, lens_h, ntokens, max_seq_len)
        if ntokens == 0:
            return past
        if rows is not None:  # whole runs of `unit` rows when every offset and length allow
            # one vectorized reduction: a connector's call spans every run of vLLM's cache
            unit = int(np.gcd.reduce(np.concatenate(([ratio], offs_h, lens_h))))
        index = host_scatter_rows(offs_h, lens_h, ratio, unit, past.device)
    elif ntokens == 0:
        return past
    else:
        index = device_scatter_rows(_on_device(offs, past.device), _on_device(lens, past.device),
                                    ratio, ntokens)
    if rows is None:
        dst.index_put_((index // max_seq_len, index % max_seq_len), new_kv)
    else:
        src = new_kv.view(-1, unit, hidden) if unit > 1 else new_kv
        runs_view(dst, 1, rows, unit).index_copy_(0, index, src)
    return past


# ----------------------------------------------------------------------------- paged load


def _check_out(
    out: object, shapes: tuple[tuple[int, ...], tuple[int, ...]], dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise ValueError("out must be a (key_out, value_out) pair of tensors")
    for name, t, shape in zip(("out[0] (key)", "out[1] (value)"), out, shapes, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} must be {shape}")
        if t.dtype != dtype:
            raise ValueError(f"{name} dtype {t.dtype} must equal the caches' dtype {dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the caches are on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return out[0], out[1]


def _out_rows(out: object) -> int | None:
    """The token count a well-formed ``out`` pair implies, if any (read without a sync)."""
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0].shape[0] if out[0].dim() else None
    return None


def _gather(cache: torch.Tensor, slot_dim: int, rows: RowLayout | None,
            unit: int, index: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[k] = cache[row index[k]]`` with the non-token dims kept, into ``dst``.

    With ``unit > 1`` each index moves ``unit`` consecutive slots. Without a row view the
    index is ``block * block_size + slot``, split up for advanced indexing.
    """
    if rows is None:
        block_size = cache.shape[slot_dim]
        b, s = index // block_size, index % block_size
        picked = cache[b, s] if slot_dim == 1 else cache[b, :, s]
        dst.copy_(picked.reshape(dst.shape))
        return
    view = runs_view(cache, slot_dim, rows, unit)
    if unit > 1:  # runs of `unit` slots are contiguous rows both in the cache and in the output
        dst = dst.view(-1, *view.shape[1:])
    torch.index_select(view, 0, index, out=dst)


def _load_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: AnyInts,
                 out: object) -> tuple[torch.Tensor, torch.Tensor]:
    """A load of whole blocks (ND): one block-id index, one ``index_select`` per cache.

    Selecting blocks along dim 0 of the cache itself is right for any strides (a pool view,
    padded blocks, even block-innermost caches), so it needs no row view.
    """
    num_tokens = len(blocks) * key_cache.shape[1]
    shapes = ((num_tokens, *key_cache.shape[2:]), (num_tokens, *value_cache.shape[2:]))
    if out is not None:
        out = _check_out(out, shapes, key_cache.dtype, key_cache.device)
    if not num_tokens:
        return out or (key_cache.new_empty(shapes[0]), value_cache.new_empty(shapes[1]))
    # The same table comes once per layer: its device copy is reused (``RecentIndices``).
    index = recent_block_indices.get(np.asarray(blocks), key_cache.device)
    if out is None:  # index_select's own outputs, seen as tokens: no separate allocation
        return (torch.index_select(key_cache, 0, index).view(shapes[0]),
                torch.index_select(value_cache, 0, index).view(shapes[1]))
    for cache, dst in zip((key_cache, value_cache), out, strict=True):
        torch.index_select(cache, 0, index, out=dst.view(-1, *cache.shape[1:]))
    return out


def paged_cache_load(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    layout: str = "ND",
    cumsum: bool = False,
    seq_starts: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's tokens from paged K/V caches into contiguous ``(key, value)``.

    ND caches are ``[num_blocks, block_size, num_heads, head_size]`` and give
    ``[num_tokens, num_heads, head_size]``; NZ caches are
    ``[num_blocks, num_heads*head_size // a, block_size, a]`` (``a`` elements = 32 bytes) and
    give ``[num_tokens, num_heads*head_size]``. Sequence ``i`` reads tokens
    ``[seq_starts[i], seq_starts[i] + len_i)`` through row ``i`` of ``block_table``.
    ``check=False`` skips the value checks that would read device memory (see module doc).
    """
    if layout not in ("ND", "NZ"):
        raise ValueError(f"layout must be 'ND' or 'NZ', got {layout!r}")
    _check_cache("key_cache", key_cache, 4)
    _check_cache("value_cache", value_cache, 4)
    dtype, device = key_cache.dtype, key_cache.device
    if value_cache.dtype != dtype:
        raise ValueError(
            f"value_cache dtype {value_cache.dtype} must equal key_cache dtype {dtype}"
        )
    if value_cache.device != device:
        raise ValueError(f"value_cache is on {value_cache.device} but key_cache is on {device}")
    k_shape, v_shape = key_cache.shape, value_cache.shape
    if layout == "ND":
        slot_dim, same = 1, _ND_SAME
    else:
        if cumsum or seq_starts is not None:
            raise ValueError("layout='NZ' supports neither cumsum=True nor seq_starts")
        slot_dim, same = 2, _NZ_SAME
        a = nz_align(dtype)
        for name, shape in (("key_cache", k_shape), ("value_cache", v_shape)):
            if shape[3] != a:
                raise ValueError(
                    f"{name} NZ last dim is {shape[3]} elements but must be {a} "
                    f"(32 bytes of {dtype})"
                )
    for dim, what in same:
        if k_shape[dim] != v_shape[dim]:
            raise ValueError(
                f"key_cache and value_cache differ in {what}: {k_shape[dim]} vs {v_shape[dim]} "
                f"(shapes {tuple(k_shape)} and {tuple(v_shape)})"
            )
    num_blocks, block_size = k_shape[0], k_shape[slot_dim]
    if block_size <= 0:
        raise ValueError(f"key_cache block_size must be > 0, got shape {tuple(k_shape)}")

    table = _index("block_table", block_table, 2)
    batch, width = table.shape
    cl = _index("context_lens", context_lens, 1)
    if cumsum and cl.shape[0] != batch + 1:
        raise ValueError(
            f"context_lens with cumsum=True must be [batch+1={batch + 1}] "
            f"(block_table has {batch} rows), got {tuple(cl.shape)}"
        )
    if not cumsum and cl.shape[0] != batch:
        raise ValueError(
            f"context_lens must be [batch={batch}] (block_table rows), got {tuple(cl.shape)}"
        )
    starts = None if seq_starts is None else _index("seq_starts", seq_starts, 1)
    if starts is not None and starts.shape[0] != batch:
        raise ValueError(f"seq_starts must be [batch={batch}], got {tuple(starts.shape)}")

    host = check or _on_host(device, table, cl, starts)
    if host:
        if starts is None:
            table_h, cl_h = host_arrays(table, cl)
            starts_h = None
            if layout == "ND":  # the usual load: whole blocks, no per-token index
                blocks = whole_blocks(table_h, cl_h, cumsum, block_size, num_blocks)
                if blocks is not None:
                    return _load_blocks(key_cache, value_cache, blocks, out)
        else:
            table_h, cl_h, starts_h = host_arrays(table, cl, starts)
    k_rows = row_layout(key_cache, slot_dim)
    v_rows = row_layout(value_cache, slot_dim)
    # Without a row view, an index is block * block_size + slot, split up in _gather.
    ratios = (k_rows[0] if k_rows else block_size, v_rows[0] if v_rows else block_size)
    unit = 1
    if host:
        lens, starts_n = check_load(cl_h, starts_h, cumsum, width, block_size)
        num_tokens = int(lens.sum())
    else:
        table_d, cl_d = _on_device(table, device), _on_device(cl, device)
        lens_d = cl_d[1:] - cl_d[:-1] if cumsum else cl_d
        starts_d = None if starts is None else _on_device(starts, device)
        # The one value read left unchecked: the output size, unless `out` gives it.
        out_rows = _out_rows(out)
        num_tokens = out_rows if out_rows is not None else int(lens_d.sum()) if batch else 0

    if layout == "ND":
        shapes = ((num_tokens, *k_shape[2:]), (num_tokens, *v_shape[2:]))
    else:
        shapes = ((num_tokens, k_shape[1] * k_shape[3]), (num_tokens, v_shape[1] * v_shape[3]))
    if out is None:
        key_out = torch.empty(shapes[0], dtype=dtype, device=device)
        value_out = torch.empty(shapes[1], dtype=dtype, device=device)
    else:
        key_out, value_out = _check_out(out, shapes, dtype, device)
    if num_tokens == 0:
        return key_out, value_out

    if host:
        # Move runs of `unit` tokens at once when every sequence's start and length, the block
        # size and the caches' row ratios are multiples of it (block-aligned starts, say).
        if layout == "ND" and k_rows is not None and v_rows is not None:
            unit = int(np.gcd.reduce(np.concatenate(([block_size, *ratios], starts_n, lens))))
        k_index, v_index = host_load_rows(table_h, lens, starts_n, block_size, unit, num_blocks,
                                          ratios, device)
    else:
        k_index, v_index = device_load_rows(table_d, lens_d, starts_d, block_size, num_tokens,
                                            ratios)
    if layout == "ND":
        _gather(key_cache, 1, k_rows, unit, k_index, key_out)
        _gather(value_cache, 1, v_rows, unit, v_index, value_out)
    else:
        _gather(key_cache, 2, k_rows, 1, k_index,
                key_out.view(num_tokens, key_cache.shape[1], -1))
        _gather(value_cache, 2, v_rows, 1, v_index,
                value_out.view(num_tokens, value_cache.shape[1], -1))
    return key_out, value_out
