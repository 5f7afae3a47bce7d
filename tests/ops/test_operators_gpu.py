"""kv_cache_scatter and paged_cache_load on CUDA against the reference loops of
tests/ops/test_operators.py.

Every test is marked ``gpu`` and skips where torch sees no CUDA device. Caches move to the GPU
with their strides kept; the metadata stays on the host (the usual case) or moves too.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvstore.ops.operators import kv_cache_scatter, nz_align, paged_cache_load
from tests.ops.test_operators import (
    DTYPES,
    _load_args,
    _scatter_args,
    assert_load_equal,
    make_caches,
    make_table,
    make_tensor,
    ref_load,
    ref_scatter,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def on_cuda(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the GPU with its strides kept: a view of a pool stays a view of a pool."""
    base = t if t._base is None else t._base
    return base.to(CUDA).as_strided(t.shape, t.stride(), t.storage_offset())


def place(t: torch.Tensor | None, where: str) -> torch.Tensor | None:
    return t if t is None or where == "host" else t.to(CUDA)


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["plain", "cumsum", "seq_starts", "out", "nz"])
@pytest.mark.parametrize("where", ["host", "device", "mixed"])  # mixed: only the table moves
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["contiguous", "pool", "slot_major"])
@pytest.mark.parametrize("aligned", [True, False])
def test_load_on_cuda_matches_reference(dtype, mode, where, check, kind, aligned):
    gen = torch.Generator().manual_seed(11)
    layout, bs = ("NZ" if mode == "nz" else "ND"), 16
    a = nz_align(dtype)
    head_k = 2 * a if layout == "NZ" else 16
    head_v = head_k if kind == "pool" else head_k // 2  # K and V differ where they may
    kc, vc = make_caches(12, bs, 2, head_k, head_v, dtype, layout=layout, kind=kind, gen=gen)
    # aligned: whole blocks only, so the operator moves runs of block_size rows
    lens = [2 * bs, bs, 0, 3 * bs] if aligned else [3 * bs - 1, 0, bs + 5, 1]
    starts = [bs, 0, 0, 0] if aligned else [bs + 3, 2, 0, 7]
    starts = starts if mode == "seq_starts" else [0] * 4
    table = make_table(lens, starts, bs, 12, width=5, gen=gen)
    cl = torch.tensor(lens, dtype=torch.int32)
    if mode == "cumsum":
        cl = torch.tensor([0, *torch.cumsum(cl, 0).tolist()])
    ss = torch.tensor(starts) if mode == "seq_starts" else None
    kw = dict(layout=layout, cumsum=mode == "cumsum")
    want_k, want_v = ref_load(kc, vc, table, cl, seq_starts=ss, **kw)
    kc_d, vc_d = on_cuda(kc), on_cuda(vc)
    out = None
    if mode == "out":
        out = (torch.empty_like(want_k, device=CUDA), torch.empty_like(want_v, device=CUDA))
    lens_where = "host" if where == "mixed" else where
    got = paged_cache_load(kc_d, vc_d, place(table, "host" if where == "host" else "device"),
                           place(cl, lens_where), seq_starts=place(ss, lens_where), out=out,
                           check=check, **kw)
    assert got[0].device.type == "cuda" and got[1].device.type == "cuda"
    if out is not None:
        assert got[0] is out[0] and got[1] is out[1]
    assert_load_equal((got[0].cpu(), got[1].cpu()), want_k, want_v, kc, vc, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kind", ["contiguous", "pool", "slot_major"])
@pytest.mark.parametrize("four_d", [False, True])
def test_scatter_on_cuda_matches_reference(dtype, where, check, kind, four_d):
    gen = torch.Generator().manual_seed(12)
    layers, batch, max_seq, heads, head_size = 3, 4, 24, 2, 8
    hidden = heads * head_size
    if kind == "pool":  # [batch, layers, seq, hidden] storage seen as [layers, batch, ...]
        past = make_tensor((batch, layers, max_seq, hidden), dtype, gen).transpose(0, 1)
    elif kind == "slot_major":  # batch innermost of the token dims: advanced indexing
        past = make_tensor((layers, max_seq, batch, hidden), dtype, gen).transpose(1, 2)
    else:
        past = make_tensor((layers, batch, max_seq, hidden), dtype, gen)
    if four_d:  # equal lengths, offsets all even: runs of two rows
        seq_len = torch.full((batch,), 6)
        token_offset = torch.tensor([6, 24, 10, 8])
        new_kv = make_tensor((batch, 6, heads, head_size), dtype, gen)
    else:
        seq_len = torch.tensor([3, 1, 7, 2], dtype=torch.int32)
        token_offset = torch.tensor([3, 24, 10, 9], dtype=torch.int32)
        new_kv = make_tensor((13, hidden), dtype, gen)
    want = ref_scatter(past, new_kv, 2, token_offset, seq_len)
    past_d = on_cuda(past)
    got = kv_cache_scatter(past_d, on_cuda(new_kv), 2, place(token_offset, where),
                           place(seq_len, where), check=check)
    assert got is past_d
    assert torch.equal(past_d.cpu(), want)


# ----------------------------------------------------------------------------- errors


def _cuda_args(args: dict, where: str) -> dict:
    caches = ("key_cache", "value_cache", "past", "new_kv")
    return {k: (on_cuda(v) if k in caches else place(v, where))
            if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"block_table": torch.tensor([[0, 4], [2, -1]])}, r"block_table[0][1] = 4"),
        ({"block_table": torch.tensor([[0, 1], [-1, 0]])}, r"block_table[1][0] = -1"),
        ({"context_lens": torch.tensor([9, 3])}, "context_lens[0] = 9"),
        ({"context_lens": torch.tensor([6, -3])}, "context_lens[1] = -3"),
        ({"context_lens": torch.tensor([1, 6, 9]), "cumsum": True}, "context_lens[0] = 1"),
        ({"seq_starts": torch.tensor([0, -1])}, "seq_starts[1] = -1"),
        ({"seq_starts": torch.tensor([0, 6])}, "context_lens[1]"),
    ],
)
def test_load_errors_on_cuda_name_the_argument(where, over, names):
    with pytest.raises(ValueError, match=re.escape(names)):
        paged_cache_load(**_cuda_args(_load_args(**over), where))


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"new_kv": torch.ones(6, 4)}, "sum(seq_len)"),
        ({"token_offset": torch.tensor([2, 8], dtype=torch.int32)}, "token_offset[0]"),
        ({"token_offset": torch.tensor([3, 9], dtype=torch.int32)}, "token_offset[1]"),
    ],
)
def test_scatter_errors_on_cuda_name_the_argument(where, over, names):
    args = _cuda_args(_scatter_args(**over), where)
    before = args["past"].clone()
    with pytest.raises(ValueError, match=re.escape(names)):
        kv_cache_scatter(**args)
    assert torch.equal(args["past"], before)  # nothing written on error


# ----------------------------------------------------------------------------- no host syncs


def _sync_case(where: str):
    """Operator calls on bf16 pool views; returns ``(run, check)`` closures."""
    gen = torch.Generator().manual_seed(13)
    kc, vc = make_caches(64, 16, 2, 64, 64, torch.bfloat16, kind="pool", gen=gen)
    lens, starts = [40, 16, 0, 33], [0, 16, 0, 5]
    table = torch.randint(0, 64, (4, 4), dtype=torch.int32, generator=gen)
    cl = torch.tensor(lens, dtype=torch.int32)
    cum = torch.tensor([0, *torch.cumsum(cl, 0).tolist()], dtype=torch.int32)
    ss = torch.tensor(starts, dtype=torch.int32)
    whole = torch.tensor([32, 16, 0, 48], dtype=torch.int32)  # whole blocks: block ids, no math
    past = make_tensor((2, 4, 64, 128), torch.bfloat16, gen).transpose(0, 1)
    seq_len, token_offset = torch.tensor([33, 16]), torch.tensor([40, 64])
    new_kv = make_tensor((49, 128), torch.bfloat16, gen)
    loads = [ref_load(kc, vc, table, cl), ref_load(kc, vc, table, cum, cumsum=True),
             ref_load(kc, vc, table, cl, seq_starts=ss), ref_load(kc, vc, table, whole)]
    want_past = ref_scatter(past, new_kv, 1, token_offset, seq_len)
    kc, vc, past, new_kv = on_cuda(kc), on_cuda(vc), on_cuda(past), on_cuda(new_kv)
    table, cl, cum, ss, whole, seq_len, token_offset = (
        place(t, where) for t in (table, cl, cum, ss, whole, seq_len, token_offset))
    # Device metadata unchecked: `out` gives the output size, so no length is read back.
    outs = [(torch.empty_like(k, device=CUDA), torch.empty_like(v, device=CUDA))
            for k, v in loads]
    got: list = []

    def run() -> None:
        got.clear()
        got.append(paged_cache_load(kc, vc, table, cl, out=outs[0], check=False))
        got.append(paged_cache_load(kc, vc, table, cum, cumsum=True, out=outs[1], check=False))
        got.append(paged_cache_load(kc, vc, table, cl, seq_starts=ss, out=outs[2], check=False))
        got.append(paged_cache_load(kc, vc, table, whole, out=outs[3], check=False))
        if where == "host":  # host metadata is checked at no sync, and sizes are known
            got.append(paged_cache_load(kc, vc, table, cl))
            got.append(paged_cache_load(kc, vc, table, whole))
        kv_cache_scatter(past, new_kv, 1, token_offset, seq_len, check=False)

    def check() -> None:
        torch.cuda.synchronize()
        for (k, v), (want_k, want_v) in zip(got, [*loads, loads[0], loads[3]], strict=False):
            assert torch.equal(k.cpu(), want_k) and torch.equal(v.cpu(), want_v)
        assert torch.equal(past.cpu(), want_past)

    return run, check


@pytest.mark.parametrize("where", ["host", "device"])
def test_unchecked_calls_never_synchronise(where, monkeypatch):
    """Under sync debug mode "error" any synchronising CUDA call raises; the mode does not
    see a non_blocking copy from pageable memory (silently synchronous), so copies to the GPU
    are watched too: they must be non-blocking and from pinned memory."""
    run, check = _sync_case(where)
    run()  # warm up: first calls may initialise CUDA state lazily
    check()
    real_to = torch.Tensor.to

    def watched_to(self, *args, **kwargs):
        moved = real_to(self, *args, **kwargs)
        if self.device.type == "cpu" and moved.device.type == "cuda":
            assert kwargs.get("non_blocking") and self.is_pinned(), "a blocking copy to the GPU"
        return moved

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "to", watched_to)
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    check()


def test_a_repeated_block_table_is_copied_to_the_device_once() -> None:
    """The same table, layer after layer, reuses one device index; another table, or the
    same one changed in place on the host, gets its own; each load stays exact."""
    from kvstore.ops.row_index import RecentIndices, recent_block_indices

    dev = torch.device("cuda", torch.cuda.current_device())
    key_cache = torch.randn(12, 16, 2, 8, device=dev)
    value_cache = torch.randn(12, 16, 2, 8, device=dev)
    table = torch.tensor([[3, 1, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([64], dtype=torch.int32)
    calls: list[object] = []
    real = RecentIndices.get

    def spy(self, index, device):
        got = real(self, index, device)
        calls.append(got)
        return got

    RecentIndices.get = spy  # type: ignore[method-assign]
    try:
        for _ in range(3):
            k, v = paged_cache_load(key_cache, value_cache, table, lens)
            assert torch.equal(k, key_cache[[3, 1, 7, 0]].flatten(0, 1))
        table[0, 0] = 5  # changed in place: a new index, not the cached one
        k, v = paged_cache_load(key_cache, value_cache, table, lens)
        assert torch.equal(k, key_cache[[5, 1, 7, 0]].flatten(0, 1))
        assert torch.equal(v, value_cache[[5, 1, 7, 0]].flatten(0, 1))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # another stream waits for the copy it reuses
            k, _ = paged_cache_load(key_cache, value_cache, table, lens)
        side.synchronize()
        assert torch.equal(k, key_cache[[5, 1, 7, 0]].flatten(0, 1))
    finally:
        RecentIndices.get = real  # type: ignore[method-assign]
    assert calls[0] is calls[1] is calls[2] and calls[3] is not calls[0]
    assert calls[4] is calls[3]
    assert len(recent_block_indices._entries) <= recent_block_indices.capacity
