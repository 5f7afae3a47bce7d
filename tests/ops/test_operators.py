"""kv_cache_scatter and paged_cache_load against the plain reference loops (docs/design.md §3.3)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.ops.operators import kv_cache_scatter, nz_align, paged_cache_load

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8]
INDEX_DTYPES = [torch.int32, torch.int64]


# ----------------------------------------------------------------------------- references
# Written literally as in the design, one token at a time: slow and obviously right.


def ref_scatter(past, new_kv, layer_id, token_offset, seq_len):
    past = past.clone()
    new_kv = new_kv.reshape(-1, past.shape[-1])
    batch = len(seq_len)
    prefix = 0
    for i in range(batch):
        for j in range(int(seq_len[i])):
            past[layer_id][i][int(token_offset[i]) - int(seq_len[i]) + j] = new_kv[prefix + j]
        prefix += int(seq_len[i])
    return past


def ref_load(key_cache, value_cache, block_table, cl, layout="ND", cumsum=False,
             seq_starts=None):
    batch = block_table.shape[0]
    block_size = key_cache.shape[1] if layout == "ND" else key_cache.shape[2]
    lens = [int(cl[i + 1]) - int(cl[i]) for i in range(batch)] if cumsum else [int(x) for x in cl]
    key, value = [], []
    for i in range(batch):
        start = int(seq_starts[i]) if seq_starts is not None else 0
        for t in range(start, start + lens[i]):
            b, s = int(block_table[i][t // block_size]), t % block_size
            if layout == "ND":
                key.append(key_cache[b, s])
                value.append(value_cache[b, s])
            else:
                key.append(key_cache[b, :, s, :].reshape(-1))
                value.append(value_cache[b, :, s, :].reshape(-1))
    if not key:
        return None, None
    return torch.stack(key), torch.stack(value)


# ----------------------------------------------------------------------------- factories


def make_tensor(shape, dtype, gen=None):
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    if dtype == torch.uint8:  # a quantized cache's bytes (vLLM's fp8)
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def make_caches(num_blocks, block_size, num_heads, head_k, head_v, dtype, layout="ND",
                kind="contiguous", gen=None):
    """K/V caches; ``kind`` picks the memory layout the operator must cope with."""
    if layout == "NZ":
        a = nz_align(dtype)
        kshape = (num_heads * head_k // a, block_size, a)
        vshape = (num_heads * head_v // a, block_size, a)
    else:
        kshape = (block_size, num_heads, head_k)
        vshape = (block_size, num_heads, head_v)
    if kind == "contiguous":
        return (make_tensor((num_blocks, *kshape), dtype, gen),
                make_tensor((num_blocks, *vshape), dtype, gen))
    if kind == "pool":  # per-layer views of a block-major [num_blocks, L, 2, ...] pool
        assert kshape == vshape
        pool = make_tensor((num_blocks, 3, 2, *kshape), dtype, gen)
        return pool[:, 1, 0], pool[:, 1, 1]
    if kind == "padded":  # block stride not a multiple of the slot stride's run length
        slot = 1 if layout == "ND" else 2
        outs = []
        for shape in (kshape, vshape):
            big = list(shape)
            big[slot - 1] += 1
            base = make_tensor((num_blocks, *big), dtype, gen)
            outs.append(base[:, :block_size] if slot == 1 else base[:, :, :block_size])
        return outs[0], outs[1]
    if kind == "slot_major":  # block dim innermost: only advanced indexing can read it
        outs = []
        for shape in (kshape, vshape):
            if layout == "ND":
                base = make_tensor((shape[0], num_blocks, *shape[1:]), dtype, gen)
                outs.append(base.transpose(0, 1))
            else:
                base = make_tensor((shape[1], num_blocks, shape[0], shape[2]), dtype, gen)
                outs.append(base.permute(1, 2, 0, 3))
        return outs[0], outs[1]
    raise AssertionError(kind)


def make_table(lens, starts, block_size, num_blocks, width=None, index_dtype=torch.int32,
               gen=None):
    """A block table with random used entries and -1 padding everywhere else."""
    need = [(s + n + block_size - 1) // block_size if n else 0
            for s, n in zip(starts, lens, strict=True)]
    width = width if width is not None else max([1, *need])
    table = torch.full((len(lens), width), -1, dtype=torch.int64)
    for i, n in enumerate(need):
        first = starts[i] // block_size if lens[i] else n
        for p in range(first, n):
            table[i, p] = int(torch.randint(0, num_blocks, (1,), generator=gen))
    return table.to(index_dtype)


def assert_load_equal(got, want_key, want_value, key_cache, value_cache, layout):
    key, value = got
    if want_key is None:
        assert key.shape[0] == 0 and value.shape[0] == 0
        return
    assert key.dtype == key_cache.dtype and value.dtype == value_cache.dtype
    assert torch.equal(key, want_key) and torch.equal(value, want_value)


# ----------------------------------------------------------------------------- scatter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("four_d", [False, True])
@pytest.mark.parametrize("tensor_layer", [False, True])
def test_scatter_matches_reference(dtype, index_dtype, four_d, tensor_layer):
    gen = torch.Generator().manual_seed(1)
    layers, batch, max_seq, heads, head_size = 3, 4, 24, 2, 8
    past = make_tensor((layers, batch, max_seq, heads * head_size), dtype, gen)
    seq = 5
    seq_len = torch.full((batch,), seq, dtype=index_dtype) if four_d else torch.tensor(
        [3, 1, 7, 2], dtype=index_dtype)
    token_offset = torch.tensor([3, 24, 10, 9], dtype=index_dtype)
    if four_d:
        token_offset = torch.tensor([5, 24, 10, 9], dtype=index_dtype)
        new_kv = make_tensor((batch, seq, heads, head_size), dtype, gen)
    else:
        new_kv = make_tensor((int(seq_len.sum()), heads * head_size), dtype, gen)
    layer = torch.tensor([2], dtype=torch.int32) if tensor_layer else 2
    want = ref_scatter(past, new_kv, 2, token_offset, seq_len)
    got = kv_cache_scatter(past, new_kv, layer, token_offset, seq_len)
    assert got is past
    assert torch.equal(past, want)


@pytest.mark.parametrize("kind", ["pool", "slot_major", "padded_hidden"])
def test_scatter_strided_past(kind):
    gen = torch.Generator().manual_seed(2)
    layers, batch, max_seq, hidden = 2, 3, 16, 12
    if kind == "pool":  # [batch, layers, seq, hidden] storage seen as [layers, batch, ...]
        past = make_tensor((batch, layers, max_seq, hidden), torch.float16, gen).transpose(0, 1)
    elif kind == "slot_major":  # batch innermost of the token dims: fallback path
        past = make_tensor((layers, max_seq, batch, hidden), torch.float16, gen).transpose(1, 2)
    else:
        past = make_tensor((layers, batch, max_seq, hidden + 4), torch.float16, gen)[..., :hidden]
    assert not past.is_contiguous()
    seq_len = torch.tensor([4, 16, 1])
    token_offset = torch.tensor([9, 16, 1])
    new_kv = make_tensor((21, hidden), torch.float16, gen)
    want = ref_scatter(past, new_kv, 1, token_offset, seq_len)
    kv_cache_scatter(past, new_kv, 1, token_offset, seq_len)
    assert torch.equal(past, want)


def test_scatter_writes_through_to_the_pool():
    pool = torch.zeros(2, 3, 8, 4)  # [batch, layers, seq, hidden]
    past = pool.transpose(0, 1)
    new_kv = torch.arange(12.0).reshape(3, 4)
    kv_cache_scatter(past, new_kv, 2, torch.tensor([8, 1]), torch.tensor([2, 1]))
    assert torch.equal(pool[0, 2, 6:8], new_kv[:2])
    assert torch.equal(pool[1, 2, 0], new_kv[2])
    assert int((pool != 0).sum()) == int((new_kv != 0).sum())


def _scatter_args(**over):
    args = dict(
        past=torch.zeros(2, 2, 8, 4),
        new_kv=torch.ones(5, 4),
        layer_id=1,
        token_offset=torch.tensor([3, 8], dtype=torch.int32),
        seq_len=torch.tensor([3, 2], dtype=torch.int32),
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"layer_id": 2}, "layer_id"),
        ({"layer_id": -1}, "layer_id"),
        ({"layer_id": torch.tensor([1.0])}, "layer_id"),
        ({"layer_id": torch.tensor([0, 1], dtype=torch.int32)}, "layer_id"),
        ({"layer_id": True}, "layer_id"),
        ({"seq_len": torch.tensor([3, -1], dtype=torch.int32)}, "seq_len[1]"),
        ({"new_kv": torch.ones(6, 4)}, "sum(seq_len)"),
        ({"token_offset": torch.tensor([2, 8], dtype=torch.int32)}, "token_offset[0]"),
        ({"token_offset": torch.tensor([3, 9], dtype=torch.int32)}, "token_offset[1]"),
        ({"token_offset": torch.tensor([3.0, 8.0])}, "token_offset"),
        ({"seq_len": torch.tensor([[3, 2]], dtype=torch.int32)}, "seq_len"),
        ({"token_offset": torch.tensor([3, 8, 8], dtype=torch.int32)}, "token_offset"),
        ({"seq_len": [3, 2]}, "seq_len"),
        ({"new_kv": torch.ones(5, 4, dtype=torch.float16)}, "new_kv"),
        ({"new_kv": torch.ones(5, 3)}, "new_kv"),
        ({"new_kv": torch.ones(5)}, "new_kv"),
        ({"new_kv": torch.ones(1, 5, 2, 3)}, "new_kv"),
        ({"past": torch.zeros(2, 8, 4)}, "past"),
        ({"past": torch.zeros(2, 2, 8, 4, dtype=torch.float64),
          "new_kv": torch.ones(5, 4, dtype=torch.float64)}, "past"),
        ({"past": torch.zeros(1, 1, 8, 4).expand(2, 2, 8, 4)}, "past"),
    ],
)
def test_scatter_errors_name_the_argument(over, names):
    args = _scatter_args(**over)
    before = args["past"].clone()
    with pytest.raises(ValueError, match=re.escape(names)):
        kv_cache_scatter(**args)
    assert torch.equal(args["past"], before)  # nothing written on error


# ----------------------------------------------------------------------------- paged load


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mode", ["plain", "cumsum", "seq_starts", "both", "out"])
@pytest.mark.parametrize("block_size", [32, 16, 5])
def test_load_nd_matches_reference(dtype, index_dtype, mode, block_size):
    gen = torch.Generator().manual_seed(3)
    kc, vc = make_caches(12, block_size, 2, 16, 8, dtype, gen=gen)
    lens = [block_size * 2 + 3, 0, 1, block_size]
    starts = [block_size + 2, 3, 0, 7] if mode in ("seq_starts", "both") else [0] * 4
    table = make_table(lens, starts, block_size, 12, width=6, index_dtype=index_dtype, gen=gen)
    cl = torch.tensor(lens, dtype=index_dtype)
    cumsum = mode in ("cumsum", "both")
    if cumsum:
        cl = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=index_dtype)
    ss = torch.tensor(starts, dtype=index_dtype) if mode in ("seq_starts", "both") else None
    want_k, want_v = ref_load(kc, vc, table, cl, cumsum=cumsum, seq_starts=ss)
    out = None
    if mode == "out":
        out = (torch.empty(want_k.shape, dtype=dtype), torch.empty(want_v.shape, dtype=dtype))
    got = paged_cache_load(kc, vc, table, cl, cumsum=cumsum, seq_starts=ss, out=out)
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")
    if out is not None:
        assert got[0] is out[0] and got[1] is out[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [32, 16, 3])
@pytest.mark.parametrize("use_out", [False, True])
def test_load_nz_matches_reference(dtype, block_size, use_out):
    gen = torch.Generator().manual_seed(4)
    a = nz_align(dtype)
    kc, vc = make_caches(9, block_size, 2, 2 * a, a, dtype, layout="NZ", gen=gen)
    lens = [block_size + 1, 0, 2 * block_size]
    table = make_table(lens, [0, 0, 0], block_size, 9, width=4, gen=gen)
    cl = torch.tensor(lens, dtype=torch.int32)
    want_k, want_v = ref_load(kc, vc, table, cl, layout="NZ")
    assert want_k.shape == (sum(lens), 2 * 2 * a) and want_v.shape == (sum(lens), 2 * a)
    out = (torch.empty_like(want_k), torch.empty_like(want_v)) if use_out else None
    got = paged_cache_load(kc, vc, table, cl, layout="NZ", out=out)
    assert_load_equal(got, want_k, want_v, kc, vc, "NZ")


@pytest.mark.parametrize("kind", ["pool", "padded", "slot_major"])
@pytest.mark.parametrize("layout", ["ND", "NZ"])
@pytest.mark.parametrize("aligned", [True, False])
def test_load_strided_caches(kind, layout, aligned):
    gen = torch.Generator().manual_seed(5)
    bs, dtype = 8, torch.float16
    head = 16 if layout == "ND" else nz_align(dtype)
    kc, vc = make_caches(10, bs, 2, head, head, dtype, layout=layout, kind=kind, gen=gen)
    assert not kc.is_contiguous()
    # aligned: whole blocks only (exercises the run-of-tokens path); else ragged
    lens = [3 * bs, bs, 2 * bs] if aligned else [3 * bs - 1, 5, 2 * bs + 1]
    table = make_table(lens, [0] * 3, bs, 10, gen=gen)
    cl = torch.tensor(lens)
    want_k, want_v = ref_load(kc, vc, table, cl, layout=layout)
    got = paged_cache_load(kc, vc, table, cl, layout=layout)
    assert_load_equal(got, want_k, want_v, kc, vc, layout)


def test_load_aligned_starts_use_runs_and_stay_exact():
    gen = torch.Generator().manual_seed(6)
    kc, vc = make_caches(16, 8, 2, 4, 6, torch.float32, kind="contiguous", gen=gen)
    lens, starts = [16, 8, 4], [8, 0, 4]  # gcd 4: runs of 4 tokens
    table = make_table(lens, starts, 8, 16, gen=gen)
    ss = torch.tensor(starts)
    want_k, want_v = ref_load(kc, vc, table, torch.tensor(lens), seq_starts=ss)
    got = paged_cache_load(kc, vc, table, torch.tensor(lens), seq_starts=ss)
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")


def test_load_all_empty_and_empty_batch():
    kc, vc = make_caches(4, 16, 2, 8, 8, torch.float16)
    key, value = paged_cache_load(kc, vc, torch.full((2, 3), -1), torch.tensor([0, 0]))
    assert key.shape == (0, 2, 8) and value.shape == (0, 2, 8)
    key, value = paged_cache_load(kc, vc, torch.zeros((0, 1), dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.int32))
    assert key.shape == (0, 2, 8)


def test_load_ignores_garbage_past_the_used_entries():
    kc, vc = make_caches(4, 4, 1, 2, 2, torch.float32)
    table = torch.tensor([[1, 2, 999, -7], [3, -1, -1, -1]])
    cl = torch.tensor([6, 4])
    want_k, want_v = ref_load(kc, vc, table, cl)
    assert_load_equal(paged_cache_load(kc, vc, table, cl), want_k, want_v, kc, vc, "ND")
    # with seq_starts the entries before the start are unused too
    table = torch.tensor([[-1, -1, 2, 0]])
    ss = torch.tensor([9])
    want_k, want_v = ref_load(kc, vc, table, torch.tensor([5]), seq_starts=ss)
    got = paged_cache_load(kc, vc, table, torch.tensor([5]), seq_starts=ss)
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.integers(1, 9),
    batch=st.integers(1, 4),
    num_blocks=st.integers(1, 6),
    cumsum=st.booleans(),
    with_starts=st.booleans(),
)
def test_load_hypothesis(data, block_size, batch, num_blocks, cumsum, with_starts):
    """Random tables with bad entries: either exactly the reference, or a ValueError."""
    width = data.draw(st.integers(1, 5))
    lens = data.draw(st.lists(st.integers(0, 3 * block_size), min_size=batch, max_size=batch))
    starts = data.draw(st.lists(st.integers(0, 2 * block_size), min_size=batch,
                                max_size=batch)) if with_starts else [0] * batch
    entries = st.integers(-2, num_blocks + 1)
    rows = data.draw(st.lists(st.lists(entries, min_size=width, max_size=width),
                              min_size=batch, max_size=batch))
    table = torch.tensor(rows, dtype=torch.int32)
    kc = torch.randn(num_blocks, block_size, 2, 3)
    vc = torch.randn(num_blocks, block_size, 2, 5)
    cl = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()] if cumsum else lens)
    ss = torch.tensor(starts) if with_starts else None
    valid = True
    for i in range(batch):
        for t in range(starts[i], starts[i] + lens[i]):
            p = t // block_size
            if p >= width or not 0 <= rows[i][p] < num_blocks:
                valid = False
    if not valid:
        with pytest.raises(ValueError, match="block_table|context_lens"):
            paged_cache_load(kc, vc, table, cl, cumsum=cumsum, seq_starts=ss)
        return
    want_k, want_v = ref_load(kc, vc, table, cl, cumsum=cumsum, seq_starts=ss)
    got = paged_cache_load(kc, vc, table, cl, cumsum=cumsum, seq_starts=ss)
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")


@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), max_seq=st.integers(1, 12))
def test_scatter_hypothesis(data, batch, max_seq):
    seq_len = data.draw(st.lists(st.integers(0, max_seq), min_size=batch, max_size=batch))
    offsets = [data.draw(st.integers(n, max_seq)) for n in seq_len]
    past = torch.randn(2, batch, max_seq, 3)
    new_kv = torch.randn(sum(seq_len), 3)
    want = ref_scatter(past, new_kv, 0, offsets, seq_len)
    kv_cache_scatter(past, new_kv, 0, torch.tensor(offsets), torch.tensor(seq_len))
    assert torch.equal(past, want)


def _load_args(**over):
    kc, vc = make_caches(4, 4, 2, 8, 8, torch.float16)
    args = dict(key_cache=kc, value_cache=vc, block_table=torch.tensor([[0, 1], [2, -1]]),
                context_lens=torch.tensor([6, 3], dtype=torch.int32))
    args.update(over)
    return args


def _nz(dtype=torch.float16, last=None):
    a = last or nz_align(dtype)
    return torch.zeros(4, 2, 4, a, dtype=dtype), torch.zeros(4, 2, 4, a, dtype=dtype)


@pytest.mark.parametrize(
    ("over", "names"),
    [
        ({"block_table": torch.tensor([[0, 4], [2, -1]])}, r"block_table\[0\]\[1\] = 4"),
        ({"block_table": torch.tensor([[0, 1], [-1, 0]])}, r"block_table\[1\]\[0\] = -1"),
        ({"context_lens": torch.tensor([9, 3])}, r"context_lens\[0\] = 9.*width"),
        ({"seq_starts": torch.tensor([0, 6])}, r"context_lens\[1\].*width"),
        ({"seq_starts": torch.tensor([0, -1])}, r"seq_starts\[1\] = -1"),
        ({"seq_starts": torch.tensor([0])}, "seq_starts"),
        ({"seq_starts": torch.tensor([0.0, 1.0])}, "seq_starts"),
        ({"block_table": torch.tensor([[0.0, 1.0], [2.0, 0.0]])}, "block_table"),
        ({"block_table": torch.tensor([0, 1])}, "block_table"),
        ({"block_table": [[0, 1], [2, -1]]}, "block_table"),
        ({"context_lens": torch.tensor([6, -3])}, r"context_lens\[1\] = -3"),
        ({"context_lens": torch.tensor([6, 3, 1])}, "context_lens"),
        ({"context_lens": torch.tensor([[6, 3]])}, "context_lens"),
        ({"context_lens": torch.tensor([6, 3]), "cumsum": True}, "context_lens"),
        ({"context_lens": torch.tensor([1, 6, 9]), "cumsum": True}, r"context_lens\[0\] = 1"),
        ({"context_lens": torch.tensor([0, 6, 3]), "cumsum": True}, r"context_lens\[1\] = 3"),
        ({"layout": "XY"}, "layout"),
        ({"layout": "NZ", "key_cache": _nz()[0], "value_cache": _nz()[1], "cumsum": True,
          "context_lens": torch.tensor([0, 6, 9])}, "cumsum"),
        ({"layout": "NZ", "key_cache": _nz()[0], "value_cache": _nz()[1],
          "seq_starts": torch.tensor([0, 0])}, "seq_starts"),
        ({"layout": "NZ", "key_cache": _nz(last=8)[0], "value_cache": _nz(last=8)[1]},
         "key_cache NZ last dim"),
        ({"layout": "NZ", "key_cache": _nz(torch.int8, last=16)[0],
          "value_cache": _nz(torch.int8, last=16)[1]}, "32 bytes"),
        ({"value_cache": torch.zeros(4, 4, 3, 8, dtype=torch.float16)}, "num_heads"),
        ({"value_cache": torch.zeros(5, 4, 2, 8, dtype=torch.float16)}, "num_blocks"),
        ({"value_cache": torch.zeros(4, 8, 2, 8, dtype=torch.float16)}, "block_size"),
        ({"value_cache": torch.zeros(4, 4, 2, 8, dtype=torch.float32)}, "value_cache dtype"),
        ({"key_cache": torch.zeros(4, 4, 2, 8, dtype=torch.float64),
          "value_cache": torch.zeros(4, 4, 2, 8, dtype=torch.float64)}, "key_cache dtype"),
        ({"key_cache": torch.zeros(4, 4, 16, dtype=torch.float16)}, "key_cache must be 4-D"),
        ({"out": (torch.empty(9, 2, 8, dtype=torch.float16),)}, "out"),
        ({"out": (torch.empty(8, 2, 8, dtype=torch.float16),
                  torch.empty(9, 2, 8, dtype=torch.float16))}, r"out\[0\] \(key\) shape"),
        ({"out": (torch.empty(9, 2, 8, dtype=torch.float16),
                  torch.empty(9, 2, 8, dtype=torch.float32))}, r"out\[1\] \(value\) dtype"),
        ({"out": (torch.empty(9, 2, 8, dtype=torch.float16),
                  torch.empty(9, 8, 2, dtype=torch.float16).transpose(1, 2))}, "contiguous"),
    ],
)
def test_load_errors_name_the_argument(over, names):
    with pytest.raises(ValueError, match=names):
        paged_cache_load(**_load_args(**over))


def test_load_differing_head_sizes_nd():
    gen = torch.Generator().manual_seed(7)
    kc, vc = make_caches(5, 32, 4, 24, 8, torch.bfloat16, gen=gen)
    lens = [70, 33]
    table = make_table(lens, [0, 0], 32, 5, width=4, index_dtype=torch.int64, gen=gen)
    want_k, want_v = ref_load(kc, vc, table, torch.tensor(lens))
    key, value = paged_cache_load(kc, vc, table, torch.tensor(lens, dtype=torch.int64))
    assert key.shape == (103, 4, 24) and value.shape == (103, 4, 8)
    assert torch.equal(key, want_k) and torch.equal(value, want_v)
