"""No poisoning at the block level (kvstore.security.data_keys): in a keyed
namespace a block is accepted only with the MAC its tenant's key gives, by every verifier a
reader or a node runs (one block, a batch, a same-node copy, a small same-node batch).

The reference for the tag is the construction spelled out with ``hmac`` and ``cryptography``
(AES-GCM with no plaintext = GMAC), not the code under test. Every forgery is checked against an
honest block that the same verifiers accept, so a verifier that refused everything would fail.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest
import torch
import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import (
    BlockHeader,
    _template,
    block_nbytes,
    decode_block,
    encode_block,
    payload_offset,
    read_header,
    verify_block,
    verify_block_self,
)
from kvstore.block_batch import encode_blocks_into, verify_blocks
from kvstore.client.shm_reader import ShmReader, copy_then_verify
from kvstore.constants import align_up
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.security.data_keys import block_tag, tenant_key

DATA_KEY = b"poisoning-tests-cluster-data-key"
FIELDS = dict(model_fingerprint="victim-model", dtype="float16", block_size=4, num_layers=2,
              num_kv_heads=2, head_dim=8)
REJECTED = (BlockCorrupted, BlockMismatch)  # both are a Miss to a reader, never KV


def victim_ns(**over: object) -> Namespace:
    return Namespace(**{**FIELDS, "cache_salt": "victim", "data_key": DATA_KEY, **over})


def chain(ns: Namespace, n: int, seed: int = 0):
    """Keys, parents, per-block tokens and payloads of an ``n``-block prompt."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * ns.block_size,), generator=g).tolist()
    keys = BlockHasher(ns).block_keys(tokens)
    per = [tokens[i * ns.block_size:(i + 1) * ns.block_size] for i in range(n)]
    payloads = [torch.randn(ns.payload_shape, generator=g).to(ns.torch_dtype) for _ in range(n)]
    return keys, [ns.root, *keys[:-1]], per, payloads


def ref_tag(data_key: bytes, salt: str, root: bytes, key: bytes, payload: bytes) -> bytes:
    """docs: tenant key -> MAC key -> per-block key -> GMAC, spelled out."""
    tenant = hmac.new(data_key, b"kvstore tenant key v1\x00" + salt.encode(),
                      hashlib.sha256).digest()
    mac = hmac.new(tenant, b"kvstore block mac v1", hashlib.sha256).digest()
    one_block = hmac.new(mac, root + key, hashlib.sha256).digest()
    return AESGCM(one_block).encrypt(bytes(12), b"", payload)


def raw_block(ns: Namespace, key: bytes, parent: bytes, tokens: list[int],
              payload: torch.Tensor, tag: bytes, root: bytes | None = None) -> bytes:
    """A block as an attacker writes it: any tag, any root, laid out by the format itself."""
    header = BlockHeader(ns.schema_version, ns.root if root is None else root, key, parent,
                         np.asarray(tokens, dtype="<i8").tobytes(), ns.dtype, ns.num_layers,
                         ns.block_size, ns.num_kv_heads, ns.head_dim, tag).pack()
    off = align_up(4 + len(header))
    out = bytearray(off) + payload.contiguous().view(torch.uint8).numpy().tobytes()
    out[:4] = struct.pack("<I", len(header))
    out[4:4 + len(header)] = header
    return bytes(out)


def payload_bytes(p: torch.Tensor) -> bytes:
    return p.contiguous().view(torch.uint8).numpy().tobytes()


def test_the_tag_is_the_reference_gmac_and_binds_the_key():
    ns = victim_ns()
    keys, parents, tokens, payloads = chain(ns, 2)
    for i in range(2):
        buf = encode_block(ns, keys[i], parents[i], tokens[i], payloads[i])
        want = ref_tag(DATA_KEY, "victim", ns.root, keys[i], payload_bytes(payloads[i]))
        assert read_header(buf).checksum == want and len(want) == 16
    # Same payload under another key: another tag (the key is bound).
    assert ref_tag(DATA_KEY, "victim", ns.root, keys[0], payload_bytes(payloads[0])) != \
        block_tag(ns.mac_key, ns.root, keys[1], payload_bytes(payloads[0]))
    # The unkeyed namespace keeps its 8-byte xxh3 (the embedded default is unchanged).
    public = ns.public()
    buf = encode_block(public, BlockHasher(public).block_keys(tokens[0])[0], public.root,
                       tokens[0], payloads[0])
    assert read_header(buf).checksum == xxhash.xxh3_64_digest(payload_bytes(payloads[0]))


def forgeries(ns: Namespace) -> tuple[list[bytes], dict[str, bytes], list[int], bytes]:
    """Honest blocks of a 3-block chain and, for block 1, every forgery a writer without the
    victim's tenant key can make (it knows the victim's keys, tokens and root here)."""
    keys, parents, tokens, payloads = chain(ns, 3, seed=1)
    honest = [bytes(encode_block(ns, keys[i], parents[i], tokens[i], payloads[i]))
              for i in range(3)]
    k, par, tok = keys[1], parents[1], tokens[1]
    evil = torch.full(ns.payload_shape, 7.0, dtype=ns.torch_dtype)  # the attacker's KV
    t = _template(ns)
    flipped = bytearray(honest[1])
    flipped[payload_offset(ns) + 3] ^= 0x01
    moved = bytearray(honest[1])  # block 2's tag on block 1
    moved[t.checksum] = honest[2][t.checksum]
    swapped = bytearray(honest[2])  # block 2's payload and tag in block 1's header
    swapped[: payload_offset(ns)] = honest[1][: payload_offset(ns)]
    swapped[t.checksum] = honest[2][t.checksum]
    b_key = Namespace(**{**FIELDS, "cache_salt": "victim",
                         "tenant_key": tenant_key(DATA_KEY, "attacker")}).mac_key
    assert b_key is not None
    xxh = xxhash.xxh3_64_digest(payload_bytes(evil))
    forged = {
        "flipped payload byte": bytes(flipped),
        "tag moved from another block": bytes(moved),
        "another block's payload and tag": bytes(swapped),
        "MAC under tenant B's key": raw_block(ns, k, par, tok, evil,
                                              block_tag(b_key, ns.root, k, payload_bytes(evil))),
        "no key: xxh3 checksum": raw_block(ns, k, par, tok, evil, xxh),
        "xxh3 padded to 16 bytes": raw_block(ns, k, par, tok, evil, xxh + bytes(8)),
        "zero tag": raw_block(ns, k, par, tok, evil, bytes(16)),
        "MAC under a guessed key": raw_block(
            ns, k, par, tok, evil,
            block_tag(hashlib.sha256(b"guess").digest(), ns.root, k, payload_bytes(evil))),
    }
    return honest, forged, tok, k


@pytest.mark.parametrize("salt_form", ["data_key", "tenant_key"])
def test_one_block_verifiers_refuse_every_forgery(salt_form):
    ns = victim_ns() if salt_form == "data_key" else victim_ns(
        data_key=None, tenant_key=tenant_key(DATA_KEY, "victim"))
    honest, forged, tokens, key = forgeries(ns)
    assert verify_block(honest[1], ns, key, tokens).key == key  # the honest block passes
    for buf in forged.values():
        with pytest.raises(REJECTED):
            decode_block(buf, ns, key, tokens)
        with pytest.raises(REJECTED):
            verify_block(buf, ns, key)


def test_batch_verifier_refuses_every_forgery_among_good_rows():
    ns = victim_ns()
    honest, forged, tokens, key = forgeries(ns)
    width = block_nbytes(ns)
    names = list(forged)
    rows = np.zeros((2 * len(names) + 1, width), dtype=np.uint8)
    asked, want_ok = [], []
    for i, name in enumerate(names):
        good = honest[1]
        rows[2 * i, : len(good)] = np.frombuffer(good, dtype=np.uint8)
        bad = forged[name][:width]
        rows[2 * i + 1, : len(bad)] = np.frombuffer(bad, dtype=np.uint8)
        asked += [key, key]
        want_ok += [True, False]
    rows[-1] = np.frombuffer(honest[0], dtype=np.uint8)
    keys0 = BlockHasher(ns).block_keys(read_header(honest[0]).token_list())
    asked.append(keys0[0])
    want_ok.append(True)
    got = verify_blocks(rows, ns, asked)
    for i, (verdict, ok) in enumerate(zip(got, want_ok, strict=True)):
        assert isinstance(verdict, bytes) == ok, (i, verdict)
        if not ok:
            assert isinstance(verdict, REJECTED), (names[i // 2], verdict)


def test_batch_encoder_writes_the_reference_tags():
    ns = victim_ns()
    keys, parents, tokens, payloads = chain(ns, 5, seed=4)
    rows = np.empty((5, block_nbytes(ns)), dtype=np.uint8)
    encode_blocks_into(rows, ns, keys, parents, tokens, payloads)
    t = _template(ns)
    for i in range(5):
        assert rows[i, t.checksum].tobytes() == ref_tag(DATA_KEY, "victim", ns.root, keys[i],
                                                        payload_bytes(payloads[i]))


@pytest.mark.parametrize("big", [False, True], ids=["small-batch", "one-pass-copy"])
def test_same_node_reads_refuse_forgeries_written_straight_into_the_arena(big):
    """A local writer bypassing the node's checks puts forged bytes in the arena under the
    victim's keys: the reader's copy-and-verify refuses them, honest blocks still pass."""
    ns = victim_ns(num_layers=64 if big else 2)  # 64 layers: 64 KiB blocks, the one-pass path
    honest, forged, tokens, key = forgeries(ns)
    names = list(forged)
    with BlockPool(1 << 22) as pool:
        good_keys = [read_header(h).key for h in honest]
        for k, h in zip(good_keys, honest, strict=True):
            assert pool.put(k, h)
        bad_keys = [hashlib.sha256(n.encode()).digest() for n in names]
        for k, n in zip(bad_keys, names, strict=True):
            assert pool.put(k, forged[n][: block_nbytes(ns)])
        lease = pool.lease(good_keys + bad_keys, ttl_s=30)
        where = {loc.key: loc for loc in lease.locations}
        with ShmReader(pool.path) as reader:
            if not big:
                # The forged rows are asked for under the victim's key (as a reader would).
                for n, k in zip(names, bad_keys, strict=True):
                    fake = {key: where[k], good_keys[0]: where[good_keys[0]]}
                    bufs = [bytearray(block_nbytes(ns)) for _ in range(2)]
                    out = copy_then_verify(reader, fake, [key, good_keys[0]], bufs, ns,
                                           None, lambda: None)
                    assert isinstance(out[0], REJECTED), (n, out[0])
                    assert out[1] == block_nbytes(ns) and bytes(bufs[1]) == honest[0]
            else:
                dst = bytearray(block_nbytes(ns))
                reader.copy_verified_into(where[good_keys[1]], dst, ns, tokens)
                assert bytes(dst) == honest[1]
                for k in bad_keys:
                    loc = type(where[k])(key, where[k].offset, where[k].nbytes)
                    with pytest.raises(REJECTED):
                        reader.copy_verified_into(loc, dst, ns, tokens)
        pool.release(lease.lease_id)


def test_replication_self_check_without_the_tenant_key():
    """``verify_block_self`` has no tenant key: a keyed block passes on structure (key, chain,
    length, a 16-byte tag) and its MAC is left to the reader; unkeyed blocks keep the xxh3
    check; odd tag widths and broken chains are refused."""
    ns = victim_ns()
    honest, forged, tokens, key = forgeries(ns)
    assert verify_block_self(honest[1], key).key == key
    assert verify_block_self(forged["zero tag"], key).key == key  # copied; the reader refuses
    with pytest.raises(BlockCorrupted):
        verify_block(forged["zero tag"], ns, key)
    with pytest.raises(BlockCorrupted, match="checksum"):
        verify_block_self(forged["no key: xxh3 checksum"][:-1] + b"\0", key)
    with pytest.raises(BlockCorrupted, match="8-byte checksum or 16-byte MAC"):
        k, par, tok = read_header(honest[1]).key, read_header(honest[1]).parent_key, tokens
        verify_block_self(raw_block(ns, k, par, tok, torch.zeros(ns.payload_shape,
                                                                 dtype=torch.float16),
                                    bytes(12)), key)
    with pytest.raises(BlockCorrupted, match="truncated"):
        verify_block_self(honest[1][:-1], key)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_of_a_keyed_block_is_refused(pos, bit):
    ns = victim_ns()
    keys, parents, tokens, payloads = chain(ns, 1, seed=9)
    buf = bytearray(encode_block(ns, keys[0], parents[0], tokens[0], payloads[0]))
    header_end = 4 + int.from_bytes(buf[:4], "little")
    pos %= len(buf)
    if header_end <= pos < payload_offset(ns):
        return  # the zero pad after the header is not part of the format
    buf[pos] ^= 1 << bit
    with pytest.raises(REJECTED):
        decode_block(buf, ns, keys[0], tokens[0])
