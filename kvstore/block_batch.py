"""The batch half of the block codec (docs/design.md §3.2): a whole Put batch at once.

A namespace fixes every header byte except four fields (key, parent key, tokens, checksum), so
a batch is encoded as column writes into one ``[n, block_nbytes]`` array (byte for byte what
``kvstore.block.encode_block_into`` writes), and a block whose header equals the template
outside those fields is verified with slices instead of msgpack. Anything the fast path is not
sure of goes through the one-block ``verify_block``, which gives the verdict and names the error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from kvstore.block import _template, block_nbytes, verify_block
from kvstore.constants import KEY_NBYTES
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace


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
    array writes plus one xxh3 call per block instead of a msgpack pack and a tensor view each.
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
    # numpy does the strided row copy (torch's copy_ into row views was 10x slower here).
    src = torch.stack([p.detach().to("cpu") for p in payloads]).reshape(n, -1)
    rows[:, off:end] = src.view(torch.uint8).numpy()
    digest = xxhash.xxh3_64_digest
    rows[:, t.checksum] = np.frombuffer(b"".join(digest(r) for r in rows[:, off:end]),
                                        dtype=np.uint8).reshape(n, 8)


def verify_blocks(rows: np.ndarray, namespace: Namespace, keys: Sequence[bytes]
                  ) -> list[bytes | Exception]:
    """Per-row verdicts of ``verify_block`` for a batch message: the parent key of a good block,
    or the error the one-block check raises for a bad one (raised later, by the caller, when it
    reaches that block: the good blocks before it are kept, as with one message per block).

    Each row takes ``verify_block``'s canonical fast path (``_verify_canonical``) first, so a
    healthy batch costs slices, one sha256 and one xxh3 per block, never msgpack.
    """
    out: list[bytes | Exception] = []
    for row, key in zip(rows, keys, strict=True):
        try:
            out.append(verify_block(row, namespace, key).parent_key)
        except (KVStoreError, ValueError) as exc:
            out.append(exc)
    return out
