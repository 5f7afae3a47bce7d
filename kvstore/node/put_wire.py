"""How a Put travels: the stream's messages, and a batch that fits one message as the
serialized bytes of a unary ``PutBatch`` (``kvstore.client.node_client`` sends them; design.md §4).

Kept apart from the client because these are pure functions of the blocks, tested against the
protobuf-built messages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from kvstore.protos import kvstore_pb2 as pb

#: Bytes of whole blocks per batch Put message: big enough that per-message costs vanish,
#: small enough that the server verifies one batch while the next is on the wire.
BATCH_BYTES = 1 << 20
#: A batch encoded back to back (``StoreNodeClient.put_rows``) up to this size travels as one
#: unary ``PutBatch``: no request-streaming thread, no message objects, one verify pass. Past
#: it, the stream overlaps the node's verification with the transfer (worth it on a slow link).
UNARY_PUT_BYTES = 8 << 20


def put_messages(views: list[tuple[bytes, memoryview]], chunk: int, per_batch: int
                 ) -> Iterator[pb.PutChunk]:
    """The Put stream for ``views``: batch messages for runs of equal small blocks, chunks
    (key, offset, data) for a block larger than ``per_batch``."""
    run: list[tuple[bytes, memoryview]] = []

    def batch() -> pb.PutChunk:
        return pb.PutChunk(keys=[k for k, _ in run], total_nbytes=len(run[0][1]),
                           data=b"".join(v for _, v in run))

    for key, view in views:
        total = len(view)
        if run and (total != len(run[0][1]) or (len(run) + 1) * total > per_batch):
            yield batch()
            run = []
        if total <= per_batch:
            run.append((key, view))
            continue
        for off in range(0, total, chunk):
            yield pb.PutChunk(key=key, total_nbytes=total, offset=off,
                              data=bytes(view[off : off + chunk]))
    if run:
        yield batch()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_put_batch(spec: pb.NamespaceSpec, keys: list[bytes], block_nbytes: int,
                     data: Sequence[Any]) -> bytes:
    """A serialized ``PutBatchRequest`` of one batch ``PutChunk``: ``len(keys)`` blocks of
    ``block_nbytes`` each, whose bytes are ``data`` joined (one buffer per block, or the whole
    batch encoded back to back in one).

    Protobuf accepts fields in any order, so the chunk is its small fields serialized by
    protobuf followed by ``data`` (field 5) written here; the block bytes are copied once, by
    the join. Tests parse it back against the protobuf-built message.
    """
    nbytes = sum(memoryview(d).nbytes for d in data)
    if nbytes != block_nbytes * len(keys):
        raise ValueError(f"{nbytes} bytes are not {len(keys)} blocks of {block_nbytes}")
    head = pb.PutChunk(namespace=spec, keys=keys, total_nbytes=block_nbytes).SerializeToString()
    data_field = b"\x2a" + _varint(nbytes)  # field 5, length-delimited
    chunk_len = len(head) + len(data_field) + nbytes
    return b"".join([b"\x0a", _varint(chunk_len), head, data_field,  # PutBatchRequest.chunks
                     *data])
