"""The batch codec (``encode_blocks_into``) and the canonical-header fast path of
``verify_block``, against the one-block encoder and the field-by-field checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.block import (
    _as_bytes_view,
    _template,
    _verify_canonical,
    block_nbytes,
    encode_block,
    payload_offset,
    verify_block,
)
from kvstore.block_batch import encode_blocks_into, verify_blocks
from kvstore.errors import BlockCorrupted, BlockMismatch, NamespaceMismatch
from kvstore.keys import BlockHasher, Namespace
from kvstore.security.data_keys import tenant_key

DATA_KEY = bytes(range(32))  # a cluster data key: keyed namespaces carry a 16-byte MAC
NAMESPACES = [
    Namespace("m", "float16", 64, 1, 1, 8),
    Namespace("m", "bfloat16", 16, 2, 2, 4, cache_salt="tenant"),
    Namespace("m", "float32", 3, 1, 1, 1),
    Namespace("m", "int8", 8, 3, 1, 5),
    Namespace("m", "float16", 64, 1, 1, 8, data_key=DATA_KEY),
    Namespace("m", "bfloat16", 16, 2, 2, 4, cache_salt="tenant",
              tenant_key=tenant_key(DATA_KEY, "tenant")),
    Namespace("m", "float32", 3, 1, 1, 1, cache_salt="t2", data_key=DATA_KEY),
]


def ns_id(ns: Namespace) -> str:
    return f"{ns.dtype}-keyed" if ns.keyed else ns.dtype


def make_batch(ns: Namespace, n: int, seed: int = 0
               ) -> tuple[list[bytes], list[bytes], list[list[int]], list[torch.Tensor]]:
    """Chained keys, parents, per-block token lists and payloads."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1 << 40, (n * ns.block_size,), generator=g).tolist()
    keys = BlockHasher(ns).block_keys(tokens)
    if ns.torch_dtype == torch.int8:
        payloads = [torch.randint(-128, 127, ns.payload_shape, generator=g, dtype=torch.int8)
                    for _ in range(n)]
    else:
        payloads = [torch.randn(ns.payload_shape, generator=g).to(ns.torch_dtype)
                    for _ in range(n)]
    per_block = [tokens[i * ns.block_size : (i + 1) * ns.block_size] for i in range(n)]
    return list(keys), [ns.root, *keys[:-1]], per_block, payloads


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
@pytest.mark.parametrize("token_form", ["list", "ndarray", "tensor"])
def test_batch_encode_is_byte_identical_to_one_block_encode(ns: Namespace, token_form: str
                                                            ) -> None:
    keys, parents, tokens, payloads = make_batch(ns, 7)
    given = {"list": tokens, "ndarray": [np.array(t) for t in tokens],
             "tensor": [torch.tensor(t) for t in tokens]}[token_form]
    out = np.full((7, block_nbytes(ns) + 5), 0xAB, dtype=np.uint8)  # wider rows: tail kept
    encode_blocks_into(out, ns, keys, parents, given, payloads)
    for i in range(7):
        ref = encode_block(ns, keys[i], parents[i], tokens[i], payloads[i])
        assert out[i, : block_nbytes(ns)].tobytes() == bytes(ref)
        assert (out[i, block_nbytes(ns):] == 0xAB).all()
        header = verify_block(out[i], ns, keys[i], tokens[i])
        assert header == verify_block(ref, ns, keys[i], tokens[i])


def test_batch_encode_refuses_what_the_one_block_encoder_refuses() -> None:
    ns = NAMESPACES[0]
    keys, parents, tokens, payloads = make_batch(ns, 2)
    out = np.empty((2, block_nbytes(ns)), dtype=np.uint8)
    with pytest.raises(ValueError, match="integer tokens"):
        encode_blocks_into(out, ns, keys, parents, [[0.5] * ns.block_size] * 2, payloads)
    with pytest.raises(ValueError, match="integer tokens"):
        encode_blocks_into(out, ns, keys, parents, [t[:-1] for t in tokens], payloads)
    with pytest.raises(ValueError, match="payload 1"):
        encode_blocks_into(out, ns, keys, parents, tokens, [payloads[0], payloads[1].float()])
    with pytest.raises(ValueError, match="32-byte"):
        encode_blocks_into(out, ns, [keys[0], keys[1][:31]], parents, tokens, payloads)
    with pytest.raises(ValueError, match="at least"):
        encode_blocks_into(out[:1], ns, keys, parents, tokens, payloads)


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
def test_fast_path_accepts_exactly_canonical_blocks(ns: Namespace) -> None:
    keys, parents, tokens, payloads = make_batch(ns, 1)
    good = encode_block(ns, keys[0], parents[0], tokens[0], payloads[0])
    assert _verify_canonical(_as_bytes_view(good), ns, keys[0], tokens[0], True) is not None
    # Every single-byte change leaves the fast path; the full path then rejects it, except in
    # the zero pad after the header, which the format does not cover (the fast path is only
    # stricter, never looser).
    header_end = 4 + int.from_bytes(good[:4], "little")
    rng = np.random.default_rng(0)
    positions = list(range(payload_offset(ns))) + rng.integers(
        payload_offset(ns), len(good), 32).tolist()
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 0x01
        assert _verify_canonical(_as_bytes_view(bad), ns, keys[0], tokens[0], True) is None
        if header_end <= pos < payload_offset(ns):
            verify_block(bad, ns, keys[0], tokens[0])
            continue
        with pytest.raises((BlockCorrupted, BlockMismatch, NamespaceMismatch)):
            verify_block(bad, ns, keys[0], tokens[0])
    other = [t + 1 for t in tokens[0]]
    with pytest.raises(BlockMismatch, match="other tokens"):
        verify_block(good, ns, keys[0], other)
    with pytest.raises(NamespaceMismatch):
        verify_block(good, Namespace("other", ns.dtype, ns.block_size, ns.num_layers,
                                     ns.num_kv_heads, ns.head_dim), keys[0])


def _reference(rows: np.ndarray, ns: Namespace, keys: list[bytes]) -> list[object]:
    """Per-row verdicts of the one-block ``verify_block``: parent key or (type, message)."""
    out: list[object] = []
    for row, key in zip(rows, keys, strict=True):
        try:
            out.append(verify_block(row, ns, key).parent_key)
        except Exception as exc:
            out.append((type(exc), str(exc)))
    return out


def _verdicts(rows: np.ndarray, ns: Namespace, keys: list[bytes]) -> list[object]:
    return [(type(v), str(v)) if isinstance(v, Exception) else v
            for v in verify_blocks(rows, ns, keys)]


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
def test_batch_verify_gives_the_one_block_verdicts(ns: Namespace) -> None:
    n = 12
    keys, parents, tokens, payloads = make_batch(ns, n, seed=3)
    rows = np.empty((n, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(rows, ns, keys, parents, tokens, payloads)
    assert _verdicts(rows, ns, keys) == parents
    # One damaged byte per row (header, holes, pad, payload), a swapped key, a wrong key length.
    rng = np.random.default_rng(1)
    bad = rows.copy()
    for i in range(n - 2):
        pos = int(rng.integers(0, payload_offset(ns))) if i % 2 else \
            int(rng.integers(0, bad.shape[1]))
        bad[i, pos] ^= 1 << int(rng.integers(0, 8))
    asked = list(keys)
    asked[n - 2] = keys[0]
    asked[n - 1] = keys[n - 1][:31]
    got = _verdicts(bad, ns, asked)
    assert got == _reference(bad, ns, asked)
    assert any(isinstance(v, tuple) for v in got)
    other = Namespace("other", ns.dtype, ns.block_size, ns.num_layers, ns.num_kv_heads,
                      ns.head_dim)
    assert _verdicts(rows, other, keys) == _reference(rows, other, keys)
    # Longer rows than a block (the format allows trailing bytes) and empty batches.
    wide = np.zeros((n, rows.shape[1] + 64), dtype=np.uint8)
    wide[:, : rows.shape[1]] = rows
    assert _verdicts(wide, ns, keys) == _reference(wide, ns, keys) == parents
    assert verify_blocks(rows[:0], ns, []) == []


BENCH_NS = Namespace("bench-put", "float16", 64, 1, 1, 8)  # benchmarks/bench_put.py's NS


@pytest.mark.parametrize("ns", [BENCH_NS, *NAMESPACES],
                         ids=lambda ns: f"{ns.model_fingerprint}-{ns_id(ns)}")
def test_batch_verify_sorts_mixed_damage_like_the_one_block_check(ns: Namespace) -> None:
    """Every kind of damage, each between good rows, gets ``verify_block``'s exact verdict from
    the vectorized path; a ``verify_blocks`` that passed every row would fail here."""
    n = 40
    keys, parents, tokens, payloads = make_batch(ns, n, seed=7)
    good = np.empty((n, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(good, ns, keys, parents, tokens, payloads)
    # As the server hands it over: a read-only view of the message bytes.
    wire = np.frombuffer(good.tobytes(), dtype=np.uint8).reshape(good.shape)
    assert _verdicts(wire, ns, keys) == parents  # the all-good batch
    t = _template(ns)
    off = payload_offset(ns)
    header_end = 4 + int.from_bytes(good[0, :4].tobytes(), "little")
    root = slice(t.key.start - 2 - len(ns.root), t.key.start - 2)  # bin8 marker, then root
    other = Namespace("other", ns.dtype, ns.block_size, ns.num_layers, ns.num_kv_heads,
                      ns.head_dim)
    o_keys, o_parents, o_tokens, o_payloads = make_batch(other, 1, seed=9)
    foreign = encode_block(other, o_keys[0], o_parents[0], o_tokens[0], o_payloads[0])
    bad = good.copy()
    asked: list[bytes] = list(keys)
    expect: dict[int, type[Exception] | None] = {}  # None: non-canonical but valid

    def flip(i: int, pos: int, want: type[Exception] | None) -> None:
        bad[i, pos] ^= 0x01
        expect[i] = want

    flip(1, off + 5, BlockCorrupted)                        # payload byte
    flip(3, bad.shape[1] - 1, BlockCorrupted)               # last payload byte
    flip(5, t.token_ids.start + 9, BlockCorrupted)          # token byte
    flip(7, t.parent_key.start + 31, BlockCorrupted)        # parent key byte
    flip(9, t.checksum.start + 7, BlockCorrupted)           # checksum byte
    flip(11, t.key.start, BlockMismatch)                    # key byte in the block
    flip(13, root.start + 3, NamespaceMismatch)             # namespace root byte
    flip(15, t.token_ids.stop + 1, NamespaceMismatch)       # dtype name (layout) byte
    flip(17, 5, NamespaceMismatch)                          # schema version byte
    flip(19, t.checksum.start - 3, NamespaceMismatch)       # a layout int byte
    flip(21, 0, BlockCorrupted)                             # header length word
    if header_end < off:
        flip(23, header_end, None)                          # zero pad: not covered, valid
    asked[25] = keys[24]                                    # another block's key asked
    expect[25] = BlockMismatch
    asked[27] = keys[27][:31]                               # key one byte short
    expect[27] = BlockMismatch
    asked[29] = keys[29] + b"\0"                            # key one byte long
    expect[29] = BlockMismatch
    bad[31] = np.frombuffer(bytes(foreign), dtype=np.uint8)  # valid, of another namespace
    asked[31] = o_keys[0]
    expect[31] = NamespaceMismatch
    got = _verdicts(bad, ns, asked)
    assert got == _reference(bad, ns, asked)
    for i in range(n):
        want = expect.get(i)
        if want is None:
            assert got[i] == parents[i], i
        else:
            assert isinstance(got[i], tuple) and got[i][0] is want, (i, got[i])
    # Read-only, non-contiguous (a column slice of wider rows), and a non-list key sequence.
    wide = np.zeros((n, bad.shape[1] + 3), dtype=np.uint8)
    wide[:, : bad.shape[1]] = bad
    ro = np.frombuffer(wide.tobytes(), dtype=np.uint8).reshape(wide.shape)
    assert _verdicts(ro[:, : bad.shape[1]], ns, tuple(asked)) == got
    assert _verdicts(ro, ns, asked) == got
    # Rows narrower than a block (the whole batch falls back): every row is truncated.
    narrow = good[:, :-1]
    got_narrow = _verdicts(narrow, ns, keys)
    assert got_narrow == _reference(narrow, ns, keys)
    assert all(isinstance(v, tuple) and v[0] is BlockCorrupted for v in got_narrow)
    # Keys that are not bytes take the one-block path for the whole batch, same verdicts.
    assert _verdicts(good, ns, [bytearray(k) for k in keys]) == parents
    # A whole batch of another namespace.
    assert _verdicts(good, other, keys) == _reference(good, other, keys)
    assert all(isinstance(v, tuple) and v[0] is NamespaceMismatch
               for v in _verdicts(good, other, keys))
    with pytest.raises(ValueError):
        verify_blocks(good, ns, keys[:-1])


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
@pytest.mark.parametrize("token_form", ["list", "ndarray", "tensor"])
def test_batch_verify_checks_the_readers_tokens_as_the_one_block_check(
        ns: Namespace, token_form: str) -> None:
    """A reader passes the tokens it asked for: a row whose tokens differ (or that cannot be
    compared in one go: a wrong count, floats, values past int64) gets verify_block's own
    verdict with those tokens."""
    n = 8
    keys, parents, tokens, payloads = make_batch(ns, n, seed=5)
    rows = np.empty((n, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(rows, ns, keys, parents, tokens, payloads)
    form = {"list": list, "ndarray": np.array, "tensor": torch.tensor}[token_form]
    asked: list[object] = [form(t) for t in tokens]
    assert verify_blocks(rows, ns, keys, asked) == parents
    wrong = [list(t) for t in tokens]
    wrong[2][0] += 1  # another token at the start
    wrong[5][-1] = -wrong[5][-1] - 1  # and at the end
    cases = [[form(t) for t in wrong],
             [*asked[:3], tokens[3][:-1], *asked[4:]],  # one token short
             [*asked[:1], [float(x) for x in tokens[1]], *asked[2:]],  # floats
             [*asked[:6], [1 << 64] * ns.block_size, *asked[7:]]]  # past int64
    for case in cases:
        want = []
        for row, key, tok in zip(rows, keys, case, strict=True):
            try:
                want.append(verify_block(row, ns, key, tok).parent_key)
            except Exception as exc:
                want.append((type(exc), str(exc)))
        got = [(type(v), str(v)) if isinstance(v, Exception) else v
               for v in verify_blocks(rows, ns, keys, case)]
        assert got == want
        assert any(isinstance(v, tuple) for v in got)
    with pytest.raises(ValueError, match="7 token lists for 8 blocks"):
        verify_blocks(rows, ns, keys, asked[:7])


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
def test_canonical_headers_pass_only_headers_the_one_block_check_passes(ns: Namespace) -> None:
    """``canonical_headers`` (a reader whose payload tags are checked on the device): a row it
    passes is one ``verify_block(..., verify_checksum=False)`` passes, whatever its payload."""
    from kvstore.block_batch import canonical_headers

    n = 24
    keys, parents, tokens, payloads = make_batch(ns, n, seed=11)
    rows = np.empty((n, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(rows, ns, keys, parents, tokens, payloads)
    width = payload_offset(ns)
    assert canonical_headers(rows[:, :width], ns, keys, tokens).all()
    assert canonical_headers(rows[:, :width], ns, keys).all()  # tokens not asked
    rng = np.random.default_rng(5)
    bad = rows.copy()
    for i in range(0, n - 4, 2):  # a flipped bit somewhere in every other header
        pos = int(rng.integers(0, width))
        bad[i, pos] ^= 1 << int(rng.integers(0, 8))
    bad[n - 3, -1] ^= 0xFF  # a damaged payload: the header still passes
    asked = [list(t) for t in tokens]
    asked[n - 2] = [t + 1 for t in asked[n - 2]]  # other tokens asked
    got = canonical_headers(bad[:, :width], ns, keys, asked)
    for i in range(n):
        try:
            verify_block(bad[i], ns, keys[i], asked[i], verify_checksum=False)
            passes = True
        except (BlockCorrupted, BlockMismatch, NamespaceMismatch):
            passes = False
        assert not got[i] or passes, i  # never passes what the full check refuses
    assert got[n - 3] and not got[n - 2] and got[n - 1]
    tag = np.zeros(width, dtype=bool)
    tag[_template(ns).checksum] = True  # a damaged tag is the payload check's to catch
    for i in range(0, n - 4, 2):
        damaged = bad[i, :width] != rows[i, :width]
        assert got[i] == (not damaged[~tag].any()), i
    assert canonical_headers(rows[:0, :width], ns, []).size == 0
    assert not canonical_headers(rows[:, :width - 8], ns, keys).any()  # not a header's width


@pytest.mark.parametrize("ns", NAMESPACES, ids=ns_id)
def test_named_tags_are_the_headers_tags_of_blocks_naming_their_namespace_and_key(
        ns: Namespace) -> None:
    """``named_tags`` (a reader of its own node's arena): the tag each header carries, and
    nothing for a batch in which any block names another key or another namespace."""
    from kvstore.block_batch import named_tags, naming_columns

    n = 12
    keys, parents, tokens, payloads = make_batch(ns, n, seed=13)
    rows = np.empty((n, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(rows, ns, keys, parents, tokens, payloads)
    columns = naming_columns(ns)
    tags = named_tags(rows[:, columns], ns, keys)
    assert tags == [rows[i, _template(ns).checksum].tobytes() for i in range(n)]
    assert all(len(t) == ns.tag_nbytes for t in tags)
    assert named_tags(rows[:, columns], ns, keys[1:] + keys[:1]) is None  # another key's place
    other = Namespace("other", ns.dtype, ns.block_size, ns.num_layers, ns.num_kv_heads,
                      ns.head_dim, ns.cache_salt)
    theirs = np.empty_like(rows)
    encode_blocks_into(theirs, other, keys, parents, tokens, payloads)
    mixed = rows.copy()
    mixed[5] = theirs[5]  # the same key and bytes written in another namespace
    assert named_tags(mixed[:, columns], ns, keys) is None
    marker = rows.copy()
    marker[3, _template(ns).key.start - 1] ^= 1  # the key's msgpack marker
    assert named_tags(marker[:, columns], ns, keys) is None
    assert named_tags(rows[:, columns][:, :-1], ns, keys) is None  # not the columns' width
    assert named_tags(rows[:, columns], ns, keys[:-1]) is None  # a key short
    assert named_tags(rows[:0, columns], ns, []) == []
