"""The self-describing block format (docs/design.md §3.2), verified on every read.

::

    0        4                 4+header_len      payload_offset (64-byte aligned)
    +--------+-----------------+-----------------+------------------------------------------+
    | u32 LE | header (msgpack)| zero pad to 64  | payload: L x [ K | V ], each [bs, H, D]   |
    | hdrlen |                 |                 | = tensor [L, 2, bs, H, D] in ns dtype    |
    +--------+-----------------+-----------------+------------------------------------------+

Every header field has a fixed width (bytes, not variable-length ints), so a namespace fixes
the block's total size: pools can hand out equal slots. The payload's tag is, in a keyed
namespace (``Namespace(data_key=...)`` or ``tenant_key=``), a 16-byte MAC under the tenant's
key bound to the block key (``kvstore.security.data_keys``): only a holder of that key can
write a block a reader accepts. Unkeyed (the embedded default) it is the xxh3-64 checksum,
which catches faults, not writers. A reader compares the header with what it asked for
(namespace, key, tokens, layout) and the tag with the bytes; any difference raises, so wrong
KV never reaches a model.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from kvstore.constants import KEY_NBYTES, align_up
from kvstore.errors import BlockCorrupted, BlockMismatch, NamespaceMismatch
from kvstore.keys import DTYPES, Namespace, tokens_to_bytes
from kvstore.security import data_keys

_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a block says about itself."""

    schema_version: int
    namespace_root: bytes
    key: bytes
    parent_key: bytes
    token_ids: bytes  # int64 little-endian, block_size of them
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    checksum: bytes  # the payload's tag: keyed, its 16-byte MAC; else xxh3-64, big-endian

    def pack(self) -> bytes:
        return msgpack.packb(
            [
                self.schema_version,
                self.namespace_root,
                self.key,
                self.parent_key,
                self.token_ids,
                self.dtype,
                self.num_layers,
                self.block_size,
                self.num_kv_heads,
                self.head_dim,
                self.checksum,
            ]
        )

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> BlockHeader:
        try:
            fields = msgpack.unpackb(raw)
            return cls(*fields)
        except Exception as exc:  # any parse failure means the bytes are not a block
            raise BlockCorrupted(f"block header cannot be parsed: {exc}") from exc

    def token_list(self) -> list[int]:
        return np.frombuffer(self.token_ids, dtype="<i8").tolist()


def _header_for(
    namespace: Namespace, key: bytes, parent_key: bytes, token_bytes: bytes, checksum: bytes
) -> BlockHeader:
    return BlockHeader(
        namespace.schema_version,
        namespace.root,
        key,
        parent_key,
        token_bytes,
        namespace.dtype,
        namespace.num_layers,
        namespace.block_size,
        namespace.num_kv_heads,
        namespace.head_dim,
        checksum,
    )


@functools.lru_cache(maxsize=256)
def payload_offset(namespace: Namespace) -> int:
    """Byte offset of the payload: fixed for a namespace because every header field is.

    Cached: readers call it per block and it packs a dummy header to measure itself.
    """
    dummy = _header_for(
        namespace, b"\0" * KEY_NBYTES, b"\0" * KEY_NBYTES, b"\0" * (8 * namespace.block_size),
        bytes(namespace.tag_nbytes),
    )
    return align_up(_LEN.size + len(dummy.pack()))


@functools.lru_cache(maxsize=256)
def block_nbytes(namespace: Namespace) -> int:
    """Total encoded size of one block of ``namespace``."""
    return payload_offset(namespace) + namespace.payload_nbytes


def checksum(payload: memoryview | bytes | bytearray) -> bytes:
    """xxh3-64 of the payload bytes, as 8 big-endian bytes (an unkeyed namespace's tag)."""
    return xxhash.xxh3_64_digest(payload)


def payload_tag(namespace: Namespace, key: bytes, payload: object) -> bytes:
    """The tag a block of ``namespace`` with ``key`` carries for ``payload`` (read in place):
    the tenant's MAC bound to the root and key when the namespace is keyed, else xxh3-64."""
    mac = namespace.mac_key
    if mac is None:
        return xxhash.xxh3_64_digest(payload)  # type: ignore[arg-type]
    return data_keys.block_tag(mac, namespace.root, key, payload)


def tag_matches(namespace: Namespace, key: bytes, payload: object, tag: bytes) -> bool:
    """Whether ``tag`` is the right tag of ``payload`` (constant time for a MAC)."""
    if len(tag) != namespace.tag_nbytes:
        return False
    want = payload_tag(namespace, key, payload)
    return data_keys.tags_equal(want, tag) if namespace.keyed else want == tag


def tag_hasher(namespace: Namespace, key: bytes) -> Any:
    """An incremental ``payload_tag``: ``update(chunk)`` then ``digest()``."""
    mac = namespace.mac_key
    if mac is None:
        return xxhash.xxh3_64()
    return data_keys.TagHasher(mac, namespace.root, key)


def _as_bytes_view(buf: object) -> memoryview:
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("block buffer tensor must be a contiguous CPU tensor")
        # Through uint8: numpy has no bfloat16, and a byte view is what the codec wants anyway.
        raw: np.ndarray = buf.reshape(-1).view(torch.uint8).numpy()
        return memoryview(raw)  # type: ignore[arg-type]
    view = memoryview(buf)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _tensor_view(view: memoryview, namespace: Namespace) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only buffers (bytes from the wire) give a read-only-memory warning; the caller
        # owns the buffer and copies before writing, so the view is safe to hand out.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(view, dtype=namespace.torch_dtype, count=namespace.payload_nbytes
                                // namespace.torch_dtype.itemsize) if len(view) else None
    if flat is None:
        raise BlockCorrupted("block payload is empty")
    return flat.view(namespace.payload_shape)


def payload_view(buf: object, namespace: Namespace) -> torch.Tensor:
    """The payload region of a block buffer as a ``[L, 2, bs, H, D]`` tensor view (no copy)."""
    view = _as_bytes_view(buf)
    off = payload_offset(namespace)
    end = off + namespace.payload_nbytes
    if len(view) < end:
        raise BlockCorrupted(f"block is truncated: {len(view)} bytes, expected {end}")
    return _tensor_view(view[off:end], namespace)


def encode_block_into(
    buf: object,
    namespace: Namespace,
    key: bytes,
    parent_key: bytes,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    payload: torch.Tensor,
) -> int:
    """Write one block into ``buf`` (a caller-given writable buffer); returns bytes written.

    The payload is copied once, straight into its place, and the tag (MAC or checksum) is
    computed from the written bytes.
    """
    if tuple(payload.shape) != namespace.payload_shape:
        raise ValueError(
            f"payload shape {tuple(payload.shape)} does not match the namespace layout "
            f"{namespace.payload_shape} ([num_layers, 2, block_size, num_kv_heads, head_dim])"
        )
    if payload.dtype != namespace.torch_dtype:
        raise ValueError(f"payload dtype {payload.dtype} is not the namespace's {namespace.dtype}")
    token_bytes = tokens_to_bytes(token_ids)
    if len(token_bytes) != 8 * namespace.block_size:
        raise ValueError(
            f"a block holds exactly {namespace.block_size} tokens, got {len(token_bytes) // 8}"
        )
    if len(key) != KEY_NBYTES or len(parent_key) != KEY_NBYTES:
        raise ValueError("key and parent_key must be 32-byte sha256 digests")
    view = _as_bytes_view(buf)
    total = block_nbytes(namespace)
    if len(view) < total:
        raise ValueError(f"buffer of {len(view)} bytes is too small for a {total}-byte block")
    if view.readonly:
        raise ValueError("block buffer must be writable")
    dst = payload_view(view, namespace)
    # A numpy copy, not torch's copy_: encoding runs on background threads (a worker's
    # publisher), and a parallel torch op there starts an OpenMP team of that thread whose
    # spinning workers steal cores from the model's next forward.
    np.copyto(dst.view(torch.uint8).numpy(),
              payload.detach().to("cpu").contiguous().view(torch.uint8).numpy().reshape(
                  dst.shape[:-1] + (-1,)))
    off = payload_offset(namespace)
    digest = payload_tag(namespace, key, view[off : off + namespace.payload_nbytes])
    header = _header_for(namespace, key, parent_key, token_bytes, digest).pack()
    start = _LEN.size
    view[:start] = _LEN.pack(len(header))
    view[start : start + len(header)] = header
    view[start + len(header) : off] = bytes(off - start - len(header))
    return total


def encode_block(
    namespace: Namespace,
    key: bytes,
    parent_key: bytes,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    payload: torch.Tensor,
) -> bytearray:
    """Encode one block into a new buffer."""
    buf = bytearray(block_nbytes(namespace))
    encode_block_into(buf, namespace, key, parent_key, token_ids, payload)
    return buf


def read_header(buf: object) -> BlockHeader:
    """Parse the header of an encoded block (no verification of the payload)."""
    return _read_header(_as_bytes_view(buf))[0]


def _read_header(view: memoryview) -> tuple[BlockHeader, int]:
    """The header and the length of its msgpack bytes."""
    if len(view) < _LEN.size:
        raise BlockCorrupted(f"block is truncated: {len(view)} bytes")
    (hlen,) = _LEN.unpack(view[: _LEN.size])
    if _LEN.size + hlen > len(view):
        raise BlockCorrupted(f"block header length {hlen} runs past the {len(view)}-byte block")
    header = BlockHeader.unpack(view[_LEN.size : _LEN.size + hlen])
    if not all(isinstance(f, bytes) for f in (header.namespace_root, header.key,
                                              header.parent_key, header.token_ids,
                                              header.checksum)):
        raise BlockCorrupted("block header fields have the wrong types")
    return header, hlen


def stated_nbytes(buf: object) -> tuple[BlockHeader, int]:
    """A block's header and the whole size its layout says the block has (no payload check):
    what a disk tier compares a file's length with before it trusts the file at all."""
    header, hlen = _read_header(_as_bytes_view(buf))
    dtype = DTYPES.get(header.dtype) if isinstance(header.dtype, str) else None
    dims = (header.num_layers, 2, header.block_size, header.num_kv_heads, header.head_dim)
    if dtype is None or not all(isinstance(d, int) and d > 0 for d in dims):
        raise BlockCorrupted(f"block {header.key.hex()[:16]} header has no valid layout")
    return header, align_up(_LEN.size + hlen) + math.prod(dims) * dtype.itemsize


def verify_block_self(buf: object, key: bytes) -> BlockHeader:
    """Check a block on its own terms, for copies of a namespace the copier does not know.

    Replication moves blocks of any namespace between store nodes, so the layout comes from the
    header itself: the header names ``key``, the parent key and tokens chain to it, and the
    payload is whole. An 8-byte tag is an xxh3 checksum and is checked. A 16-byte tag is a
    tenant's MAC: the header names only the (keyed) root, not the tenant, so without the
    tenant key it cannot be checked here, and is not; a damaged or forged copy is then caught
    by every reader, which verifies the MAC against its own namespace (``verify_block``) before
    the KV is used, and turns it into a miss. Any other tag width is refused.
    """
    view = _as_bytes_view(buf)
    header, hlen = _read_header(view)
    if header.key != key:
        raise BlockMismatch(f"block {header.key.hex()[:16]} was sent for {key.hex()[:16]}")
    if hashlib.sha256(header.parent_key + header.token_ids).digest() != header.key:
        raise BlockCorrupted(f"block {key.hex()[:16]} parent key and tokens do not chain to it")
    dtype = DTYPES.get(header.dtype) if isinstance(header.dtype, str) else None
    dims = (header.num_layers, 2, header.block_size, header.num_kv_heads, header.head_dim)
    if dtype is None or not all(isinstance(d, int) and d > 0 for d in dims):
        raise BlockCorrupted(f"block {key.hex()[:16]} header has no valid layout")
    off = align_up(_LEN.size + hlen)
    end = off + math.prod(dims) * dtype.itemsize
    tag = header.checksum
    if not isinstance(tag, bytes) or len(tag) not in (data_keys.CHECKSUM_NBYTES,
                                                      data_keys.TAG_NBYTES):
        raise BlockCorrupted(f"block {key.hex()[:16]} has no 8-byte checksum or 16-byte MAC")
    if end > len(view):
        raise BlockCorrupted(f"block {key.hex()[:16]} is truncated: {len(view)} bytes, "
                             f"expected {end}")
    if len(tag) == data_keys.CHECKSUM_NBYTES and checksum(view[off:end]) != tag:
        raise BlockCorrupted(f"block {key.hex()[:16]} fails its payload checksum")
    return header


def verify_block(
    buf: object,
    namespace: Namespace,
    key: bytes,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    verify_checksum: bool = True,
) -> BlockHeader:
    """Check a block against what the reader asked for; raises the first mismatch found.

    A block whose header is byte for byte the canonical one (``_verify_canonical``) passes
    without parsing msgpack; anything else takes the field-by-field path below, which is also
    what names the error.
    """
    view = _as_bytes_view(buf)
    fast = _verify_canonical(view, namespace, key, token_ids, verify_checksum)
    if fast is not None:
        return fast
    header = read_header(view)
    if header.schema_version != namespace.schema_version:
        raise NamespaceMismatch(
            f"block schema_version {header.schema_version} != reader's {namespace.schema_version}"
        )
    layout = (header.dtype, header.num_layers, header.block_size, header.num_kv_heads,
              header.head_dim)
    want = (namespace.dtype, namespace.num_layers, namespace.block_size, namespace.num_kv_heads,
            namespace.head_dim)
    if layout != want:
        raise NamespaceMismatch(
            f"block layout (dtype, layers, block_size, kv_heads, head_dim)={layout} "
            f"!= reader's {want}"
        )
    if header.namespace_root != namespace.root:
        raise NamespaceMismatch(
            "block belongs to another namespace (model fingerprint, cache salt or data key differ)"
        )
    if header.key != key:
        raise BlockMismatch(f"block key {header.key.hex()[:16]} != requested {key.hex()[:16]}")
    if token_ids is not None and header.token_ids != tokens_to_bytes(token_ids):
        raise BlockMismatch(f"block {key.hex()[:16]} holds other tokens than requested")
    # The key is sha256(parent || tokens): a damaged parent key or token field breaks it.
    if hashlib.sha256(header.parent_key + header.token_ids).digest() != header.key:
        raise BlockCorrupted(f"block {key.hex()[:16]} parent key and tokens do not chain to it")
    off = payload_offset(namespace)
    end = off + namespace.payload_nbytes
    if len(view) < end:
        raise BlockCorrupted(f"block is truncated: {len(view)} bytes, expected {end}")
    if not isinstance(header.checksum, bytes) or len(header.checksum) != namespace.tag_nbytes:
        raise BlockCorrupted(
            f"block {key.hex()[:16]} carries a {_width(header.checksum)} tag; its namespace "
            + ("is keyed: blocks carry a 16-byte MAC" if namespace.keyed
               else "is unkeyed: blocks carry an 8-byte xxh3 checksum"))
    if verify_checksum and not tag_matches(namespace, key, view[off:end], header.checksum):
        raise BlockCorrupted(f"block {key.hex()[:16]} payload "
                             + ("MAC mismatch (not written with this tenant's key)"
                                if namespace.keyed else "checksum mismatch"))
    return header


def _width(tag: object) -> str:
    return f"{len(tag)}-byte" if isinstance(tag, bytes) else f"non-bytes ({type(tag).__name__})"


def decode_block(
    buf: object,
    namespace: Namespace,
    key: bytes,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    verify_checksum: bool = True,
) -> torch.Tensor:
    """Verify a block and return its payload as a ``[L, 2, bs, H, D]`` view into ``buf``."""
    verify_block(buf, namespace, key, token_ids, verify_checksum=verify_checksum)
    return payload_view(buf, namespace)


# -- the canonical header ------------------------------------------------------------------------
# A namespace fixes every header byte except four fields (key, parent key, tokens, checksum), so
# a whole batch is encoded as column writes into a [n, block_nbytes] array, and a block whose
# header equals the template outside those fields is verified with slices instead of msgpack.


@dataclass(frozen=True, slots=True)
class _Template:
    """A namespace's canonical block prefix (length word + header + pad), where its
    namespace root lies, and its four holes."""

    prefix: bytes  # payload_offset bytes, the four fields zeroed
    root: slice
    key: slice
    parent_key: slice
    token_ids: slice
    checksum: slice


@functools.lru_cache(maxsize=256)
def _template(namespace: Namespace) -> _Template:
    zero = _header_for(namespace, bytes(KEY_NBYTES), bytes(KEY_NBYTES),
                       bytes(8 * namespace.block_size), bytes(namespace.tag_nbytes))
    fields = [zero.schema_version, zero.namespace_root, zero.key, zero.parent_key,
              zero.token_ids, zero.dtype, zero.num_layers, zero.block_size, zero.num_kv_heads,
              zero.head_dim, zero.checksum]
    packed = zero.pack()
    # msgpack writes a list as its array marker followed by each element packed on its own,
    # and a bin field's bytes come last in its packing: that gives each hole's position.
    pos = _LEN.size + len(packed) - sum(len(msgpack.packb(f)) for f in fields)
    holes = []
    for f in fields:
        n = len(msgpack.packb(f))
        if isinstance(f, bytes):
            holes.append(slice(pos + n - len(f), pos + n))
        pos += n
    prefix = bytearray(payload_offset(namespace))
    prefix[: _LEN.size] = _LEN.pack(len(packed))
    prefix[_LEN.size : _LEN.size + len(packed)] = packed
    root, key, parent, tokens, digest = holes
    prefix[root] = namespace.root
    return _Template(bytes(prefix), root, key, parent, tokens, digest)


def _verify_canonical(view: memoryview, namespace: Namespace, key: bytes,
                      token_ids: Sequence[int] | np.ndarray | torch.Tensor | None,
                      verify_checksum: bool) -> BlockHeader | None:
    """``verify_block``'s verdict for a canonical block, or None: let the full path decide.

    Accepting here implies the full path accepts (the header is the template with this key,
    a parent and tokens that chain to it, and the payload's checksum); any doubt returns None.
    """
    t = _template(namespace)
    off = len(t.prefix)
    end = off + namespace.payload_nbytes
    if len(view) < end or view[t.key] != key:
        return None
    parent = view[t.parent_key].tobytes()
    tokens = view[t.token_ids].tobytes()
    digest = view[t.checksum].tobytes()
    p = t.prefix
    if (view[: t.key.start] != p[: t.key.start]
            or view[t.key.stop : t.parent_key.start] != p[t.key.stop : t.parent_key.start]
            or view[t.parent_key.stop : t.token_ids.start]
            != p[t.parent_key.stop : t.token_ids.start]
            or view[t.token_ids.stop : t.checksum.start] != p[t.token_ids.stop : t.checksum.start]
            or view[t.checksum.stop : off] != p[t.checksum.stop :]):
        return None
    if token_ids is not None and tokens != tokens_to_bytes(token_ids):
        return None
    if hashlib.sha256(parent + tokens).digest() != key:
        return None
    if verify_checksum and not tag_matches(namespace, key, view[off:end], digest):
        return None
    return _header_for(namespace, bytes(key), parent, tokens, digest)
