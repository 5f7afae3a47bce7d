"""The block codec (docs/design.md §3.2): bitwise round trips; every damage is caught on read."""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import (
    BlockHeader,
    block_nbytes,
    decode_block,
    encode_block,
    encode_block_into,
    payload_offset,
    payload_view,
    read_header,
    verify_block,
    verify_block_self,
)
from kvstore.block_batch import verify_blocks
from kvstore.constants import ALIGN
from kvstore.errors import BlockCorrupted, BlockMismatch, NamespaceMismatch
from kvstore.keys import BlockHasher, Namespace

DTYPES = ["float16", "bfloat16", "float32", "int8", "uint8"]
#: A cluster data key: a namespace built with it is keyed (its blocks carry a 16-byte MAC).
DATA_KEY = b"block-tests-data-key-0123456789!"
KEYED = pytest.mark.parametrize("key", [None, DATA_KEY], ids=["xxh3", "keyed"])


def make_namespace(**over: object) -> Namespace:
    fields: dict[str, object] = dict(model_fingerprint="fp-block-tests", dtype="float16",
                                     block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    fields.update(over)
    return Namespace(**fields)  # type: ignore[arg-type]


def make_payload(ns: Namespace, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if ns.dtype == "int8":
        return torch.randint(-128, 128, ns.payload_shape, dtype=torch.int8, generator=gen)
    if ns.dtype == "uint8":  # a quantized cache's bytes
        return torch.randint(0, 256, ns.payload_shape, dtype=torch.uint8, generator=gen)
    return torch.randn(ns.payload_shape, generator=gen).to(ns.torch_dtype)


def make_block(ns: Namespace, tokens: list[int] | None = None, seed: int = 0):
    """An encoded block with its key, tokens and payload."""
    tokens = tokens if tokens is not None else list(range(7, 7 + ns.block_size))
    key = BlockHasher(ns).block_keys(tokens)[0]
    payload = make_payload(ns, seed)
    return encode_block(ns, key, ns.root, tokens, payload), key, tokens, payload


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def address(buf: bytearray) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@KEYED
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bitwise(dtype, key):
    ns = make_namespace(dtype=dtype, data_key=key)
    buf, key, tokens, payload = make_block(ns)
    assert len(buf) == block_nbytes(ns)
    got = decode_block(buf, ns, key, tokens)
    assert got.dtype == ns.torch_dtype and tuple(got.shape) == ns.payload_shape
    assert torch.equal(bits(got), bits(payload))
    header = read_header(buf)
    assert header.key == key and header.parent_key == ns.root
    assert header.token_list() == tokens


def test_special_float_values_survive():
    ns = make_namespace(dtype="float32")
    payload = make_payload(ns)
    payload.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    tokens = [1, 2, 3, 4]
    key = BlockHasher(ns).block_keys(tokens)[0]
    buf = encode_block(ns, key, ns.root, tokens, payload)
    assert torch.equal(bits(decode_block(buf, ns, key, tokens)), bits(payload))


def test_payload_is_aligned_and_block_size_is_fixed_per_namespace():
    ns = make_namespace()
    assert payload_offset(ns) % ALIGN == 0
    a = make_block(ns, tokens=[0, 0, 0, 0])[0]
    b = make_block(ns, tokens=[2**62, -1, 123456789, 5])[0]
    assert len(a) == len(b) == block_nbytes(ns)


def test_decode_is_a_view_into_the_buffer():
    ns = make_namespace()
    buf, key, tokens, _ = make_block(ns)
    got = decode_block(buf, ns, key, tokens)
    start = address(buf)
    assert start + payload_offset(ns) == got.data_ptr()
    assert got.data_ptr() + ns.payload_nbytes <= start + len(buf)
    buf[payload_offset(ns)] ^= 0xFF  # a write to the buffer shows through the view
    assert bits(got).reshape(-1)[0] == buf[payload_offset(ns)]


def test_encode_into_a_caller_bytearray_with_room_to_spare():
    ns = make_namespace(dtype="bfloat16")
    tokens = [5, 6, 7, 8]
    key = BlockHasher(ns).block_keys(tokens)[0]
    payload = make_payload(ns)
    buf = bytearray(block_nbytes(ns) + 100)
    assert encode_block_into(buf, ns, key, ns.root, tokens, payload) == block_nbytes(ns)
    assert torch.equal(bits(decode_block(buf, ns, key, tokens)), bits(payload))
    assert buf == encode_block(ns, key, ns.root, tokens, payload) + bytearray(100)


def test_encode_into_a_tensor_and_decode_from_it():
    ns = make_namespace(dtype="int8")
    tokens = [9, 9, 9, 9]
    key = BlockHasher(ns).block_keys(tokens)[0]
    payload = make_payload(ns).transpose(2, 3).contiguous().transpose(2, 3)  # strided source
    arena = torch.zeros(2 * block_nbytes(ns), dtype=torch.uint8)
    slot = arena[block_nbytes(ns):]
    encode_block_into(slot, ns, key, ns.root, tokens, payload)
    got = decode_block(slot, ns, key, tokens)
    assert torch.equal(got, payload)
    assert got.data_ptr() == slot.data_ptr() + payload_offset(ns)
    assert int(arena[: block_nbytes(ns)].count_nonzero()) == 0  # wrote only its slot
    assert torch.equal(payload_view(slot, ns), got)


def test_decode_from_read_only_bytes():
    ns = make_namespace()
    buf, key, tokens, payload = make_block(ns)
    assert torch.equal(bits(decode_block(bytes(buf), ns, key, tokens)), bits(payload))


@KEYED
@pytest.mark.parametrize("where", [0, 1, 64, -1])
def test_flipped_payload_byte_is_corruption(where, key):
    ns = make_namespace(data_key=key)
    buf, key, tokens, _ = make_block(ns)
    off = payload_offset(ns)
    pos = off + where if where >= 0 else len(buf) - 1
    buf[pos] ^= 0x01
    with pytest.raises(BlockCorrupted, match="MAC" if ns.keyed else "checksum"):
        decode_block(buf, ns, key, tokens)
    verify_block(buf, ns, key, tokens, verify_checksum=False)  # only the checksum sees it


@KEYED
def test_every_flipped_header_byte_is_rejected(key):
    ns = make_namespace(data_key=key)
    buf, key, tokens, _ = make_block(ns)
    header_end = 4 + int.from_bytes(buf[:4], "little")
    for pos in range(header_end):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(buf)
            bad[pos] ^= flip
            with pytest.raises((BlockCorrupted, BlockMismatch)):
                decode_block(bad, ns, key, tokens)


def test_wrong_tokens_or_key_is_a_mismatch():
    ns = make_namespace()
    buf, key, tokens, _ = make_block(ns)
    with pytest.raises(BlockMismatch, match="other tokens"):
        decode_block(buf, ns, key, [tokens[0] + 1, *tokens[1:]])
    other_key = BlockHasher(ns).block_keys([0, 0, 0, 0])[0]
    with pytest.raises(BlockMismatch, match="key"):
        decode_block(buf, ns, other_key, tokens)


@pytest.mark.parametrize(
    "over",
    [{"cache_salt": "other-tenant"}, {"model_fingerprint": "other-model"},
     {"num_layers": 3}, {"head_dim": 16}, {"dtype": "bfloat16"}, {"schema_version": 2}],
)
def test_other_namespace_or_layout_is_a_namespace_mismatch(over):
    ns = make_namespace()
    buf, key, tokens, _ = make_block(ns)
    with pytest.raises(NamespaceMismatch):
        decode_block(buf, make_namespace(**over), key, tokens)
    # The same with keys: a reader in the same namespace with another data key (or none), or
    # in another namespace with the same key, finds the block foreign.
    keyed = make_namespace(data_key=DATA_KEY)
    buf, key, tokens, _ = make_block(keyed)
    for reader in (make_namespace(**over, data_key=DATA_KEY), make_namespace(),
                   make_namespace(data_key=DATA_KEY[::-1])):
        with pytest.raises(NamespaceMismatch):
            decode_block(buf, reader, key, tokens)


@pytest.mark.parametrize("keep", [0, 3, 10, "payload_start", "last_byte"])
def test_truncated_buffer_is_corruption(keep):
    ns = make_namespace()
    buf, key, tokens, _ = make_block(ns)
    cut = {"payload_start": payload_offset(ns), "last_byte": len(buf) - 1}.get(keep, keep)
    with pytest.raises(BlockCorrupted):
        decode_block(bytes(buf[:cut]), ns, key, tokens)


def test_encode_rejects_bad_input_with_a_reason():
    ns = make_namespace()
    tokens = [1, 2, 3, 4]
    key = BlockHasher(ns).block_keys(tokens)[0]
    payload = make_payload(ns)
    with pytest.raises(ValueError, match="payload shape"):
        encode_block(ns, key, ns.root, tokens, payload[:1])
    with pytest.raises(ValueError, match="payload dtype"):
        encode_block(ns, key, ns.root, tokens, payload.float())
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        encode_block(ns, key, ns.root, tokens[:3], payload)
    with pytest.raises(ValueError, match="32-byte"):
        encode_block(ns, key[:16], ns.root, tokens, payload)
    with pytest.raises(ValueError, match="too small"):
        encode_block_into(bytearray(100), ns, key, ns.root, tokens, payload)
    with pytest.raises(ValueError, match="writable"):
        encode_block_into(bytes(block_nbytes(ns)), ns, key, ns.root, tokens, payload)


# -- fuzz: the header decoder meets hostile bytes ---------------------------------------------

_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_FIELD = st.one_of(st.none(), st.booleans(), _INT, st.floats(allow_nan=True),
                   st.text(max_size=12), st.binary(max_size=48), st.lists(_INT, max_size=3))


def _checked(buf: bytes, ns: Namespace, key: bytes, tokens: list[int]) -> None:
    """Every verifier either accepts or raises a typed block error, nothing else."""
    for call in (lambda: verify_block(buf, ns, key, tokens), lambda: read_header(buf),
                 lambda: verify_block_self(buf, key),
                 lambda: verify_blocks(np.frombuffer(buf, dtype=np.uint8)[None, :], ns, [key])):
        try:
            out = call()
        except (BlockCorrupted, BlockMismatch):
            continue
        if isinstance(out, list) and isinstance(out[0], Exception):
            assert isinstance(out[0], (BlockCorrupted, BlockMismatch)), out[0]


@KEYED
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_blocks_only_ever_raise_block_errors(key, data):
    ns = make_namespace(data_key=key)
    good, bkey, tokens, _ = make_block(ns)
    how = data.draw(st.sampled_from(["bytes", "splice", "fields"]))
    if how == "bytes":
        buf = data.draw(st.binary(max_size=len(good) + 64))
    elif how == "splice":
        buf = bytearray(good)
        for _ in range(data.draw(st.integers(1, 6))):
            pos = data.draw(st.integers(0, len(buf) - 1))
            chunk = data.draw(st.binary(min_size=1, max_size=8))
            buf[pos:pos + len(chunk)] = chunk
        buf = bytes(buf[: data.draw(st.integers(0, len(buf)))])
    else:  # a well-formed msgpack header whose fields are any values
        fields = [getattr(read_header(good), f) for f in BlockHeader.__slots__]
        for _ in range(data.draw(st.integers(1, 4))):
            fields[data.draw(st.integers(0, len(fields) - 1))] = data.draw(_FIELD)
        if data.draw(st.booleans()):
            fields = fields[: data.draw(st.integers(0, len(fields)))]
        header = msgpack.packb(fields)
        off = payload_offset(ns)
        buf = struct.pack("<I", len(header)) + header
        buf = buf + bytes(max(0, off - len(buf))) + good[off:]
    _checked(bytes(buf), ns, bkey, tokens)
