"""The operators' two index paths and their ``check`` flag, against the reference loops.

The index is built on the host when the cache or all metadata live there, else on the device;
CPU machines reach the device path only by pretending (``device_path``). ``check=False`` skips
only the checks that would read device memory.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.ops import kv_cache_scatter, nz_align, paged_cache_load
from tests.test_ops import (
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
    monkeypatch.setattr("kvstore.ops._on_host", lambda *args: False)


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
    monkeypatch.setattr("kvstore.ops._on_host", lambda *args: False)
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
            monkeypatch.setattr("kvstore.ops._on_host", lambda *args: False)
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
