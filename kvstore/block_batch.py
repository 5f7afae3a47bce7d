"""The batch half of the block codec (docs/design.md §3.2): a whole Put batch at once.

A namespace fixes every header byte except four fields (key, parent key, tokens, tag), so
a batch is encoded as column writes into one ``[n, block_nbytes]`` array (byte for byte what
``kvstore.block.encode_block_into`` writes), and a block whose header equals the template
outside those fields is verified with slices instead of msgpack. Anything the fast path is not
sure of goes through the one-block ``verify_block``, which gives the verdict and names the error.
The tag column is as wide as the namespace's tag: 8 bytes (xxh3) unkeyed, 16 (the tenant's
MAC, ``kvstore.security.data_keys``) keyed.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore.block import _template, block_nbytes, verify_block
from kvstore.constants import KEY_NBYTES
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.security import data_keys


def encode_blocks_into(
    out: np.ndarray,
    namespace: Namespace,
    keys: Sequence[bytes],
    parent_keys: Sequence[bytes],
    token_ids: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    payloads: Sequence[torch.Tensor],
) -> None:
    """``encode_block_into`` for a batch: block ``i`` into row ``i`` of a uint8 ``out``.

    Byte for byte what the one-block encoder writes (tests compare them), in a handful of
    array writes plus one tag call per block instead of a msgpack pack and a tensor view each.
    """
    n = len(keys)
    if not n == len(parent_keys) == len(token_ids) == len(payloads):
        raise ValueError("keys, parent_keys, token_ids and payloads must have the same length")
    total = block_nbytes(namespace)
    if out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] < n or out.shape[1] < total \
            or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of at least [{n}, {total}]")
    for i, p in enumerate(payloads):
        if tuple(p.shape) != namespace.payload_shape or p.dtype != namespace.torch_dtype:
            raise ValueError(f"payload {i} is {p.dtype}{tuple(p.shape)}, the namespace wants "
                             f"{namespace.torch_dtype}{namespace.payload_shape}")
    # One C call for the common case (lists of ints): numpy infers int64, and floats or
    # out-of-range values give a non-integer dtype, refused below as the one-block path does.
    tokens = np.array([t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t
                       for t in token_ids]) if n else np.empty((0, 0))
    if tokens.shape != (n, namespace.block_size) or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"every block holds exactly {namespace.block_size} integer tokens")
    joined_keys, joined_parents = b"".join(keys), b"".join(parent_keys)
    if len(joined_keys) != n * KEY_NBYTES or len(joined_parents) != n * KEY_NBYTES:
        raise ValueError("keys and parent_keys must be 32-byte sha256 digests")
    t = _template(namespace)
    off = len(t.prefix)
    end = off + namespace.payload_nbytes
    rows = out[:n]
    rows[:, :off] = np.frombuffer(t.prefix, dtype=np.uint8)
    rows[:, t.key] = np.frombuffer(joined_keys, dtype=np.uint8).reshape(n, KEY_NBYTES)
    rows[:, t.parent_key] = np.frombuffer(joined_parents, dtype=np.uint8).reshape(n, KEY_NBYTES)
    rows[:, t.token_ids] = tokens.astype("<i8", copy=False).view(np.uint8)
    # numpy does the strided row copy: torch's copy_ into row views is far slower here.
    src = torch.stack([p.detach().to("cpu") for p in payloads]).reshape(n, -1)
    rows[:, off:end] = src.view(torch.uint8).numpy()
    tags = _tags(namespace, joined_keys, rows, off, end)
    rows[:, t.checksum] = np.frombuffer(b"".join(tags), dtype=np.uint8).reshape(
        n, namespace.tag_nbytes)


def _tags(namespace: Namespace, joined_keys: bytes, rows: np.ndarray, off: int, end: int
          ) -> list[bytes]:
    """Each row's payload tag (``payload_tag``), hashed in place: xxh3 unkeyed, else the
    tenant's MAC under the key in ``joined_keys`` (32 bytes a row)."""
    total = rows.shape[1]
    buf = memoryview(rows.reshape(-1))  # type: ignore[arg-type]
    spans = [buf[i * total + off : i * total + end] for i in range(len(rows))]
    mac = namespace.mac_key
    if mac is None:
        xxh = xxhash.xxh3_64_digest
        return [xxh(s) for s in spans]
    tag, root = data_keys.block_tag, namespace.root
    return [tag(mac, root, joined_keys[i * KEY_NBYTES : (i + 1) * KEY_NBYTES], s)
            for i, s in enumerate(spans)]


@functools.lru_cache(maxsize=256)
def _fixed_columns(namespace: Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The columns of a block's prefix outside the four holes, and the template's bytes there.

    Cached per namespace: ``verify_blocks`` compares these columns of a whole batch against
    the template in one array operation, instead of five slice compares per block.
    """
    t = _template(namespace)
    fixed = np.ones(len(t.prefix), dtype=bool)
    for hole in (t.key, t.parent_key, t.token_ids, t.checksum):
        fixed[hole] = False
    cols = np.flatnonzero(fixed)
    cols.flags.writeable = False
    want = np.frombuffer(t.prefix, dtype=np.uint8)[cols]
    want.flags.writeable = False
    return cols, want


def _verdict(row: np.ndarray, namespace: Namespace, key: bytes, tokens: Any = None
             ) -> bytes | Exception:
    """``verify_block``'s verdict for one row: its parent key, or the error it raises."""
    try:
        return verify_block(row, namespace, key, tokens).parent_key
    except (KVStoreError, ValueError) as exc:
        return exc


def _digests_match(digests: list[bytes], joined: bytes, width: int, ok: np.ndarray) -> None:
    """Clear ``ok[i]`` where ``digests[i]`` is not ``joined``'s ``i``-th ``width`` bytes.

    One compare of the joined digests for a healthy batch; row by row only if it differs.
    Constant-time compares: for MACs a timing difference would leak how much of a tag matched.
    """
    if hmac.compare_digest(b"".join(digests), joined):
        return
    for i, d in enumerate(digests):
        if not hmac.compare_digest(d, joined[i * width : (i + 1) * width]):
            ok[i] = False


def verify_blocks(rows: np.ndarray, namespace: Namespace, keys: Sequence[bytes],
                  token_ids: Sequence[Any] | None = None) -> list[bytes | Exception]:
    """Per-row verdicts of ``verify_block`` for a batch message: the parent key of a good block,
    or the error the one-block check raises for a bad one (raised later, by the caller, when it
    reaches that block: the good blocks before it are kept, as with one message per block).

    The node runs this on every Put batch, so ``verify_block``'s canonical fast path
    (``_verify_canonical``) is taken for the whole batch at once: one compare of the fixed
    template columns, one of the key column, one sha256 (parent || tokens) and one xxh3 per
    block (the tenant's MAC in a keyed namespace), each set of digests compared joined. A row
    failing any of these is not necessarily bad (the one-block path also accepts valid
    non-canonical encodings), so it, and every row
    of a batch the fast path cannot read (narrow rows, keys that are not 32-byte ``bytes``),
    goes through ``verify_block``, which gives the verdict and names the error.

    ``token_ids`` (a reader's: the tokens it asked for, one sequence per row) are compared
    too, in one array compare, as ``verify_block`` compares them.
    """
    keys = keys if isinstance(keys, list) else list(keys)
    n = len(rows)
    tokens: list[Any] = [None] * n if token_ids is None else list(token_ids)
    if len(tokens) != n:
        raise ValueError(f"{len(tokens)} token lists for {n} blocks")
    t = _template(namespace)
    off = len(t.prefix)
    end = off + namespace.payload_nbytes
    if (n != len(keys) or rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[1] < end
            or n == 0 or set(map(type, keys)) != {bytes}):
        return [_verdict(row, namespace, key, tok)
                for row, key, tok in zip(rows, keys, tokens, strict=True)]
    if not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows)  # same bytes, so the same verdicts; rows hash flat
    ok, joined = _canonical_headers(rows, namespace, keys, tokens, token_ids is not None)
    # The tag (xxh3-64, or the MAC bound to the row's key) of each payload, hashed in place.
    # A row whose key column is not its requested key has ok False already; its tag is then
    # computed under the requested key, which can only fail it again.
    _digests_match(_tags(namespace, joined, rows, off, end), rows[:, t.checksum].tobytes(),
                   namespace.tag_nbytes, ok)
    parents = rows[:, t.parent_key].tobytes()
    out: list[bytes | Exception] = [parents[i * KEY_NBYTES : (i + 1) * KEY_NBYTES]
                                    for i in range(n)]
    for i in np.flatnonzero(~ok).tolist():
        out[i] = _verdict(rows[i], namespace, keys[i], tokens[i])
    return out


def canonical_headers(heads: np.ndarray, namespace: Namespace, keys: Sequence[bytes],
                      token_ids: Sequence[Any] | None = None) -> np.ndarray:
    """Per row of ``heads`` (each block's bytes up to its payload, ``[n, payload_offset]``
    uint8), whether the header is the canonical one for its key (and ``token_ids``, a
    reader's), its parent and tokens chaining to the key: ``verify_block``'s checks but the
    payload's tag, for a reader that checks the tag elsewhere (on the device). A False row is
    not necessarily bad: ``verify_block(..., verify_checksum=False)`` gives its verdict."""
    keys = keys if isinstance(keys, list) else list(keys)
    n = len(heads)
    if n == 0 or n != len(keys) or heads.ndim != 2 or heads.dtype != np.uint8 \
            or heads.shape[1] != len(_template(namespace).prefix) \
            or set(map(type, keys)) != {bytes}:
        return np.zeros(n, dtype=bool)
    tokens: list[Any] = [None] * n if token_ids is None else list(token_ids)
    return _canonical_headers(np.ascontiguousarray(heads), namespace, keys, tokens,
                              token_ids is not None)[0]


def _canonical_headers(rows: np.ndarray, namespace: Namespace, keys: list[bytes],
                       tokens: list[Any], check_tokens: bool) -> tuple[np.ndarray, bytes]:
    """Which C-contiguous ``rows`` start with their key's canonical header (the template's
    fixed columns, the key, the tokens asked for, sha256(parent || tokens) == key), and the
    keys joined."""
    n = len(rows)
    t = _template(namespace)
    if set(map(len, keys)) == {KEY_NBYTES}:
        ok, joined = np.ones(n, dtype=bool), b"".join(keys)
    else:  # a key of another length fails verify_block's key compare: those rows fall back
        ok = np.array([len(k) == KEY_NBYTES for k in keys])
        joined = b"".join(k if fit else bytes(KEY_NBYTES) for k, fit in zip(keys, ok, strict=True))
    cols, want = _fixed_columns(namespace)
    ok &= (rows[:, cols] == want).all(axis=1)
    if check_tokens:
        ok &= _tokens_match(rows[:, t.token_ids], tokens, namespace.block_size)
    key_col = rows[:, t.key]
    if key_col.tobytes() != joined:
        ok &= (key_col == np.frombuffer(joined, dtype=np.uint8).reshape(n, KEY_NBYTES)).all(1)
    # The key is sha256(parent || tokens): hash each row of one [n, 32 + 8 * block_size] copy.
    chain = np.concatenate((rows[:, t.parent_key], rows[:, t.token_ids]), axis=1)
    width = chain.shape[1]
    flat = memoryview(chain.reshape(-1))  # type: ignore[arg-type]
    sha256 = hashlib.sha256
    _digests_match([sha256(flat[i * width : (i + 1) * width]).digest() for i in range(n)],
                   joined, KEY_NBYTES, ok)
    return ok, joined


def _tokens_match(token_cols: np.ndarray, tokens: list[Any], block_size: int) -> np.ndarray:
    """Per row, whether the block's token field holds exactly ``tokens[i]`` (as little-endian
    int64, the block's encoding); rows it cannot compare in one go are False (they fall back)."""
    n = len(tokens)
    try:
        want = np.array([t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else t
                         for t in tokens])
    except (ValueError, TypeError):  # ragged or odd input: verify_block says what is wrong
        return np.zeros(n, dtype=bool)
    if want.shape != (n, block_size) or want.dtype.kind != "i":  # uint64, floats: fall back
        return np.zeros(n, dtype=bool)
    got = token_cols.view("<i8") if token_cols.flags.c_contiguous \
        else np.ascontiguousarray(token_cols).view("<i8")
    return (got == want).all(axis=1)


@functools.lru_cache(maxsize=256)
def naming_columns(namespace: Namespace) -> np.ndarray:
    """The header bytes ``named_tags`` reads of a canonical block: from its namespace root to
    the end of its key (the two fields one after the other), then the payload's tag."""
    t = _template(namespace)
    columns = np.r_[np.arange(t.root.start, t.key.stop),
                    np.arange(t.checksum.start, t.checksum.stop)].astype(np.int64)
    columns.flags.writeable = False  # shared by every caller of the cache
    return columns


def named_tags(fields: np.ndarray, namespace: Namespace, keys: Sequence[bytes]
               ) -> list[bytes] | None:
    """Each block's tag from ``fields`` (its ``naming_columns``, ``[n, columns]`` uint8), when
    every row names ``namespace``'s root and its own key ``keys[i]``; None when any does not
    (``canonical_headers`` and ``verify_block`` decide those).

    Enough for a reader of its own node's arena, which asked the node for these keys: the node
    checked each header against its writer's namespace and key at Put (the rest of the layout,
    and the parent and tokens chaining to the key, which names the reader's tokens as the
    reader made it from them), so what is left is whether the bytes there are that block, and
    its payload, checked against this tag, under that key."""
    t = _template(namespace)
    lead = t.key.start - t.root.start  # the root, then the key's msgpack marker
    named, width, n = t.key.stop - t.root.start, namespace.tag_nbytes, len(keys)
    if fields.shape != (n, named + width) or fields.dtype != np.uint8:
        return None
    joined = b"".join(keys)
    if len(joined) != n * KEY_NBYTES or not (fields[:, :lead] == _lead_bytes(namespace)).all() \
            or not (fields[:, lead:named] == np.frombuffer(joined, dtype=np.uint8).reshape(
                n, KEY_NBYTES)).all():
        return None
    tags = fields[:, named:].tobytes()
    return [tags[i * width : (i + 1) * width] for i in range(n)]


@functools.lru_cache(maxsize=256)
def _lead_bytes(namespace: Namespace) -> np.ndarray:
    """A canonical header's bytes from its namespace root to its key (``named_tags``)."""
    t = _template(namespace)
    return np.frombuffer(t.prefix[t.root.start : t.key.start], dtype=np.uint8)
