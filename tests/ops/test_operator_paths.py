"""The operators' two index paths and their ``check`` flag, against the reference loops.

The index is built on the host when the cache or all metadata live there, else on the device;
CPU machines reach the device path only by pretending (``device_path``). ``check=False`` skips
only the checks that would read device memory.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvstore.ops.operators import kv_cache_scatter, nz_align, paged_cache_load
from tests.ops.test_operators import (
    INDEX_DTYPES,
    _load_args,
    _scatter_args,
    assert_load_equal,
    make_caches,
    make_table,
    make_tensor,
    ref_load,
    ref_scatter,
)


@pytest.fixture
def device_path(monkeypatch):
    """Route every call through the device-side index (check=False), even for CPU tensors."""
    monkeypatch.setattr("kvstore.ops.operators._on_host", lambda *args: False)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("index_dtypes", [(torch.int32, torch.int64), (torch.int64, torch.int32)])
@pytest.mark.parametrize("mode", ["plain", "cumsum", "seq_starts", "out", "nz"])
@pytest.mark.parametrize("kind", ["contiguous", "pool", "slot_major"])
def test_load_check_flag_and_paths_agree(check, index_dtypes, mode, kind, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    layout, bs, dtype = ("NZ" if mode == "nz" else "ND"), 8, torch.bfloat16
    head = nz_align(dtype) if layout == "NZ" else 16
    kc, vc = make_caches(10, bs, 2, head, head, dtype, layout=layout, kind=kind, gen=gen)
    lens = [3 * bs - 1, 0, bs, 5]
    starts = [bs + 3, 0, 2, 0] if mode == "seq_starts" else [0] * 4
    table = make_table(lens, starts, bs, 10, width=5, index_dtype=index_dtypes[0], gen=gen)
    cl = torch.tensor(lens, dtype=index_dtypes[1])
    if mode == "cumsum":
        cl = torch.tensor([0, *torch.cumsum(cl, 0).tolist()], dtype=index_dtypes[1])
    ss = torch.tensor(starts, dtype=index_dtypes[1]) if mode == "seq_starts" else None
    kw = dict(layout=layout, cumsum=mode == "cumsum", seq_starts=ss)
    want_k, want_v = ref_load(kc, vc, table, cl, **kw)
    out = (torch.empty_like(want_k), torch.empty_like(want_v)) if mode == "out" else None
    assert_load_equal(paged_cache_load(kc, vc, table, cl, out=out, check=check, **kw),
                      want_k, want_v, kc, vc, layout)
    monkeypatch.setattr("kvstore.ops.operators._on_host", lambda *args: False)
    got = paged_cache_load(kc, vc, table, cl, out=out, check=check, **kw)
    assert_load_equal(got, want_k, want_v, kc, vc, layout)


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("kind", ["contiguous", "pool", "slot_major"])
def test_scatter_check_flag_and_paths_agree(check, index_dtype, kind, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    layers, batch, max_seq, hidden = 2, 3, 16, 8
    shape = {"contiguous": (layers, batch, max_seq, hidden), "pool": (batch, layers, max_seq,
             hidden), "slot_major": (layers, max_seq, batch, hidden)}[kind]
    base = make_tensor(shape, torch.int8, gen)
    past = {"contiguous": base, "pool": base.transpose(0, 1),
            "slot_major": base.transpose(1, 2)}[kind]
    seq_len = torch.tensor([4, 16, 2], dtype=index_dtype)
    token_offset = torch.tensor([12, 16, 2], dtype=index_dtype)  # gcd 2: runs of two rows
    new_kv = make_tensor((22, hidden), torch.int8, gen)
    want = ref_scatter(past, new_kv, 1, token_offset, seq_len)
    for host in (True, False):
        if not host:
            monkeypatch.setattr("kvstore.ops.operators._on_host", lambda *args: False)
        got = past.clone()
        kv_cache_scatter(got, new_kv, 1, token_offset, seq_len, check=check)
        assert torch.equal(got, want)


def test_device_path_takes_the_output_size_from_out(device_path):
    kc, vc = make_caches(4, 4, 1, 2, 2, torch.float32)
    table, cl = torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 2])
    want_k, want_v = ref_load(kc, vc, table, cl)
    out = (torch.empty_like(want_k), torch.empty_like(want_v))
    got = paged_cache_load(kc, vc, table, cl, out=out, check=False)
    assert got[0] is out[0] and torch.equal(got[0], want_k) and torch.equal(got[1], want_v)


def test_host_metadata_is_checked_even_with_check_false():
    """check=False skips only checks that would read device memory; host ones cost nothing."""
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\] = 4"):
        paged_cache_load(**_load_args(block_table=torch.tensor([[0, 4], [2, -1]])), check=False)
    with pytest.raises(ValueError, match="sum\\(seq_len\\)"):
        kv_cache_scatter(**_scatter_args(new_kv=torch.ones(6, 4)), check=False)


# ----------------------------------------------------------------------------- whole blocks
# ND loads whose every length is a multiple of block_size, without starts, take a path of their
# own (kvstore.ops.row_index.whole_blocks): the index is the used table entries, no per-token index.


@pytest.fixture
def general_path_spy(monkeypatch):
    """Counts calls of the general host index builder, so a test sees which path ran."""
    import kvstore.ops.operators

    calls = []
    real = kvstore.ops.operators.host_load_rows

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr("kvstore.ops.operators.host_load_rows", spy)
    return calls


@pytest.mark.parametrize("kind", ["contiguous", "pool", "padded", "slot_major"])
@pytest.mark.parametrize("lens", [[3 * 4], [2 * 4, 0, 4, 5 * 4], [0, 0]])
@pytest.mark.parametrize("cumsum", [False, True])
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("use_out", [False, True])
@pytest.mark.parametrize("check", [True, False])
def test_whole_block_loads_match_reference(kind, lens, cumsum, index_dtype, use_out, check,
                                           general_path_spy):
    gen = torch.Generator().manual_seed(10)
    bs = 4
    kc, vc = make_caches(9, bs, 2, 8, 8 if kind == "pool" else 4, torch.float16, kind=kind,
                         gen=gen)
    table = make_table(lens, [0] * len(lens), bs, 9, width=6, index_dtype=index_dtype, gen=gen)
    cl = torch.tensor(lens, dtype=index_dtype)
    if cumsum:
        cl = torch.tensor([0, *torch.cumsum(cl, 0).tolist()], dtype=index_dtype)
    want_k, want_v = ref_load(kc, vc, table, cl, cumsum=cumsum)
    out = None
    if use_out:
        n = sum(lens)
        out = (torch.empty(n, 2, 8, dtype=kc.dtype), torch.empty(n, *vc.shape[2:], dtype=vc.dtype))
    got = paged_cache_load(kc, vc, table, cl, cumsum=cumsum, out=out, check=check)
    if out is not None:
        assert got[0] is out[0] and got[1] is out[1]
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert got[0].shape == (sum(lens), 2, 8) and got[1].shape == (sum(lens), *vc.shape[2:])
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")
    assert not general_path_spy


def test_whole_block_load_reads_a_strided_table(general_path_spy):
    kc, vc = make_caches(6, 4, 1, 2, 2, torch.float32)
    wide = torch.tensor([[5, -9, 0, -9, 3, -9, -1, -9]])
    table = wide[:, ::2]  # [[5, 0, 3, -1]], not contiguous
    want_k, want_v = ref_load(kc, vc, table, torch.tensor([12]))
    got = paged_cache_load(kc, vc, table, torch.tensor([12]))
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")
    assert not general_path_spy


@pytest.mark.parametrize(
    ("lens", "starts"),
    [([8, 5], None), ([7], None), ([8, 4], [4, 0]), ([8], [4]), ([1, 8], None)],
    ids=["partial-last-block", "one-partial-sequence", "aligned-starts", "one-start",
         "partial-first-sequence"],
)
def test_loads_that_are_not_whole_blocks_take_the_general_path(lens, starts, general_path_spy):
    gen = torch.Generator().manual_seed(11)
    kc, vc = make_caches(8, 4, 2, 4, 4, torch.bfloat16, gen=gen)
    starts_l = starts or [0] * len(lens)
    table = make_table(lens, starts_l, 4, 8, width=4, gen=gen)
    ss = None if starts is None else torch.tensor(starts)
    want_k, want_v = ref_load(kc, vc, table, torch.tensor(lens), seq_starts=ss)
    got = paged_cache_load(kc, vc, table, torch.tensor(lens), seq_starts=ss)
    assert_load_equal(got, want_k, want_v, kc, vc, "ND")
    assert len(general_path_spy) == 1


@pytest.mark.parametrize(
    ("table", "lens", "cumsum", "message"),
    [
        ([[0, 4], [2, -1]], [8, 4], False,
         "block_table[0][1] = 4 is outside [0, num_blocks=4) but sequence 0 uses it (token 4)"),
        ([[1, -1, 3]], [12], False,
         "block_table[0][1] = -1 is outside [0, num_blocks=4) but sequence 0 uses it (token 4)"),
        ([[1, 2], [0, 0], [3, 7]], [0, 4, 8, 16], True,
         "block_table[2][1] = 7 is outside [0, num_blocks=4) but sequence 2 uses it (token 4)"),
        ([[1, 2]], [12], False,
         "context_lens[0] = 12 but with its seq_starts it needs a block_table position past the "
         "table's width 2 (block_size 4)"),
        ([[1, 2], [0, 3]], [4, -4], False,
         "context_lens[1] = -4 but context lengths must be >= 0"),
        ([[1, 2], [0, 3]], [0, 8, 4], True,
         "context_lens[1] = 4 but cumulative sums must not decrease "
         "(context_lens[i+1] < context_lens[i])"),
        ([[1, 2], [0, 3]], [4, 8, 12], True,
         "context_lens[0] = 4 but cumulative sums start at 0"),
    ],
)
@pytest.mark.parametrize("check", [True, False])
def test_whole_block_errors_read_as_before(table, lens, cumsum, message, check):
    """Bad values in an otherwise whole-block load get the general path's exact messages."""
    kc, vc = make_caches(4, 4, 2, 8, 8, torch.float16)
    with pytest.raises(ValueError) as raised:
        paged_cache_load(kc, vc, torch.tensor(table, dtype=torch.int32),
                         torch.tensor(lens, dtype=torch.int32), cumsum=cumsum, check=check)
    assert str(raised.value) == message


@pytest.mark.parametrize(("offset", "length"), [(16, 16), (12, 5), (16, 8), (1, 1)])
@pytest.mark.parametrize("kind", ["contiguous", "pool"])
def test_scatter_of_one_sequence_matches_reference(offset, length, kind):
    """One sequence (the engine's scatter_blocks) builds its index from plain ints."""
    gen = torch.Generator().manual_seed(12)
    if kind == "pool":  # [batch=1, layers, seq, hidden] seen as [layers, 1, ...]
        past = make_tensor((1, 3, 16, 8), torch.bfloat16, gen).transpose(0, 1)
    else:
        past = make_tensor((3, 1, 16, 8), torch.bfloat16, gen)
    new_kv = make_tensor((length, 8), torch.bfloat16, gen)
    lens, offs = torch.tensor([length], dtype=torch.int32), torch.tensor([offset])
    want = ref_scatter(past, new_kv, 2, offs, lens)
    kv_cache_scatter(past, new_kv, 2, offs, lens, check=False)
    assert torch.equal(past, want)
    with pytest.raises(ValueError, match=re.escape("token_offset[0] = 17 but token_offset[i] "
                                                   "must be <= max_seq_len = 16")):
        kv_cache_scatter(past, new_kv, 2, torch.tensor([17]), lens)


@pytest.mark.parametrize(
    ("table", "lens", "starts", "message"),
    [
        ([[-1, -1, 9, 0]], [5], [9], "block_table[0][2] = 9 is outside [0, num_blocks=4) but "
         "sequence 0 uses it (token 9)"),  # starts mid-block: tokens one by one
        ([[-1, 2, 7]], [8], [4], "block_table[0][2] = 7 is outside [0, num_blocks=4) but "
         "sequence 0 uses it (token 8)"),  # aligned start: runs of four tokens
        ([[1, 2], [3, -2]], [4, 7], [0, 0], "block_table[1][1] = -2 is outside "
         "[0, num_blocks=4) but sequence 1 uses it (token 4)"),
    ],
)
def test_general_path_errors_name_the_first_bad_entry(table, lens, starts, message):
    kc, vc = make_caches(4, 4, 2, 8, 8, torch.float16)
    with pytest.raises(ValueError) as raised:
        paged_cache_load(kc, vc, torch.tensor(table), torch.tensor(lens),
                         seq_starts=torch.tensor(starts))
    assert str(raised.value) == message
