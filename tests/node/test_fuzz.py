"""Fuzzing what a hostile peer controls: bulk channel frames, Put streams and PutBatch messages,
and the block header a reader decodes (hypothesis, bounded: the file runs in well under a
minute on two cores).

Each server fuzz runs against a live server on loopback and then checks what must still hold:
no connection thread died with a traceback, a well-behaved client on another connection is
served, the process's RSS did not grow past a generous bound, and (Put) the pool holds only
blocks that verify, with its used bytes exactly those blocks' (no leaked reservation).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import grpc
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import encode_block, payload_view, read_header, verify_block, verify_block_self
from kvstore.block_batch import verify_blocks
from kvstore.client.bulk_client import BulkClient
from kvstore.config import ServerConfig
from kvstore.constants import align_up
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.auth import AUTH_HEADER
from kvstore.node.block_pool import BlockPool
from kvstore.node.bulk_frames import MAGIC, REQ_HEAD, RESP_HEAD, encode_request
from kvstore.node.bulk_server import BulkServer
from kvstore.node.grpc_setup import grpc_options
from kvstore.node.proto_forms import spec_from_namespace
from kvstore.node.store_server import StoreServer
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from kvstore.security.grants import issue_credential

TOKEN = "cluster-token-of-the-fuzz-tests"
DATA_KEY = bytes(range(100, 132))
RSS_BOUND = 200 << 20
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


def namespace(salt: str = "tenant-a", *, keyed: bool = True, block_size: int = 16) -> Namespace:
    return Namespace("fuzz-model", "float16", block_size, 2, 2, 8, cache_salt=salt,
                     data_key=DATA_KEY if keyed else None)


def make_blocks(ns: Namespace, n: int, seed: int = 0
                ) -> tuple[list[bytes], list[list[int]], list[bytes]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * ns.block_size,), generator=gen).tolist()
    keys = list(BlockHasher(ns).block_keys(tokens))
    per_block = [tokens[i * ns.block_size:(i + 1) * ns.block_size] for i in range(n)]
    parents = [ns.root, *keys[:-1]]
    blocks = [bytes(encode_block(ns, k, p, t, torch.randn(ns.payload_shape, generator=gen)
                                 .to(ns.torch_dtype)))
              for k, p, t in zip(keys, parents, per_block, strict=True)]
    return keys, per_block, blocks


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
def thread_deaths() -> Iterator[list[str]]:
    """Tracebacks of threads that died, and errors the node logged, while the test ran."""
    deaths: list[str] = []
    old_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        deaths.append(f"{args.thread.name if args.thread else '?'}: {args.exc_value!r}")

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                deaths.append(f"{record.name}: {record.getMessage()}")

    handler = Catch()
    logging.getLogger("kvstore").addHandler(handler)
    threading.excepthook = hook
    try:
        yield deaths
    finally:
        threading.excepthook = old_hook
        logging.getLogger("kvstore").removeHandler(handler)


# -- (a) the bulk frame parser ---------------------------------------------------------------------
NS = namespace()
KEYS, TOKENS, BLOCKS = make_blocks(NS, 3, seed=5)
TENANT = issue_credential(TOKEN, "fuzz", read=["tenant-a"])
CREDENTIALS = [TOKEN, TENANT, "wrong", "", issue_credential("other", "x", read=["*"]),
               TENANT[:-3] + "AAA"]

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=20),
                    st.binary(max_size=40), st.floats(allow_nan=True))
_keys = st.lists(st.one_of(st.sampled_from(KEYS), st.binary(min_size=32, max_size=32),
                           st.binary(max_size=40), _scalar), max_size=40)
_spec = st.one_of(
    st.just(spec_from_namespace(NS).SerializeToString()),
    st.just(spec_from_namespace(namespace("tenant-b")).SerializeToString()),
    st.binary(max_size=80),
    st.builds(lambda bs, dt, salt, fp: pb.NamespaceSpec(
        model_fingerprint=fp, dtype=dt, block_size=bs, num_layers=2, num_kv_heads=2,
        head_dim=8, cache_salt=salt, schema_version=1).SerializeToString(),
        st.integers(0, 2**32 - 1), st.sampled_from(["float16", "int3", ""]),
        st.sampled_from(["tenant-a", "tenant-b", "", "*"]), st.sampled_from(["fuzz-model", ""])),
)
_body = st.one_of(
    st.binary(max_size=300),
    st.builds(msgpack.packb, st.dictionaries(st.sampled_from(["k", "r", "n", "t", "x"]),
                                             st.one_of(_scalar, _keys, _spec), max_size=4)),
    st.builds(lambda k, r, n: msgpack.packb({"k": k, "r": r, "n": n}), _keys,
              st.one_of(st.text(max_size=10), _scalar), st.one_of(st.none(), _spec)),
    st.builds(msgpack.packb, st.recursive(_scalar, lambda c: st.lists(c, max_size=4)
                                          | st.dictionaries(st.text(max_size=3), c, max_size=4),
                                          max_leaves=20)),
)


def _frame(magic: bytes, credential: str, body: bytes, cred_len: int | None,
           body_len: int | None, cut: int | None) -> bytes:
    cred = credential.encode()
    frame = REQ_HEAD.pack(magic, len(cred) if cred_len is None else cred_len,
                          len(body) if body_len is None else body_len) + cred + body
    return frame if cut is None else frame[:cut]


_frames = st.one_of(
    st.binary(max_size=400),
    st.builds(lambda cred, body: _frame(MAGIC, cred, body, None, None, None),  # past the auth
              st.sampled_from([TOKEN, TENANT]), _body),
    st.builds(lambda cred, keys, n: _frame(MAGIC, cred, msgpack.packb({"k": keys, "n": n}),
                                           None, None, None),
              st.sampled_from([TOKEN, TENANT]),
              st.lists(st.one_of(st.sampled_from(KEYS), st.binary(min_size=32, max_size=32)),
                       max_size=40), st.one_of(st.none(), _spec)),
    st.builds(_frame, st.sampled_from([MAGIC, MAGIC, b"KVB1", b"\0\0\0\0"]),
              st.sampled_from(CREDENTIALS), _body,
              st.one_of(st.none(), st.integers(0, 65535)),
              st.one_of(st.none(), st.integers(0, 2**32 - 1)),
              st.one_of(st.none(), st.integers(0, 600))),
    st.builds(lambda cred, keys, spec, n: encode_request(cred.encode(), keys, "r", spec) * n,
              st.sampled_from(CREDENTIALS), st.lists(st.sampled_from(KEYS), max_size=5),
              st.one_of(st.none(), _spec), st.integers(1, 3)),
)


def _check_answer(data: bytes) -> None:
    """Whatever came back is nothing (closed) or starts with a well-formed response head."""
    if not data:
        return
    assert len(data) >= RESP_HEAD.size, data
    magic, status, msg_len = RESP_HEAD.unpack_from(data)
    assert magic == MAGIC and status <= 6, data[:32]
    if status:  # an error: the message, then the server closed
        assert len(data) == RESP_HEAD.size + msg_len, data
        data[RESP_HEAD.size:].decode()


def test_fuzz_bulk_frames_never_break_the_server(thread_deaths) -> None:
    pool = BlockPool(4 << 20)
    for key, block in zip(KEYS, BLOCKS, strict=True):
        pool.put(key, block)
    server = BulkServer(pool, ServerConfig(auth_token=TOKEN, bulk_header_timeout_s=2,
                                           max_bulk_connections_per_peer=4),
                        data_key=DATA_KEY)
    port = server.start()
    good = BulkClient(f"127.0.0.1:{port}", auth_token=TENANT, timeout_s=10)
    rss_before = rss_bytes()

    @FUZZ
    @given(frame=_frames)
    def one(frame: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            with contextlib.suppress(OSError):  # the server may close before all is sent
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)  # then EOF: the server never waits for more
            data = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(1 << 16):
                    data += chunk
        _check_answer(data)

    try:
        one()
        bufs = [bytearray(len(b)) for b in BLOCKS]
        assert good.fetch_into(KEYS, lambda i, n: memoryview(bufs[i]), namespace=NS) \
            == [len(b) for b in BLOCKS]
        assert [bytes(b) for b in bufs] == BLOCKS
        assert not thread_deaths
        assert rss_bytes() - rss_before < RSS_BOUND
        good.close()
        deadline_polls = 500
        while server.num_connections and deadline_polls:
            threading.Event().wait(0.02)
            deadline_polls -= 1
        assert server.num_connections == 0
        assert pool.stats().num_leased == 0
    finally:
        server.stop()
        pool.close()


# -- (b) the Put stream and PutBatch ---------------------------------------------------------------
PUT_NS = namespace("tenant-w")
PUT_KEYS, PUT_TOKENS, PUT_BLOCKS = make_blocks(PUT_NS, 3, seed=7)
BLOCK = len(PUT_BLOCKS[0])
WRITER = issue_credential(TOKEN, "writer", write=["tenant-w"])


def _flip(block: bytes, at: int, bit: int) -> bytes:
    out = bytearray(block)
    out[at % len(out)] ^= 1 << bit
    return bytes(out)


_i = st.integers(0, 2)
_msg = st.one_of(
    st.builds(lambda i: pb.PutChunk(key=PUT_KEYS[i], total_nbytes=BLOCK, data=PUT_BLOCKS[i]), _i),
    st.builds(lambda i, at, bit: pb.PutChunk(key=PUT_KEYS[i], total_nbytes=BLOCK,
                                             data=_flip(PUT_BLOCKS[i], at, bit)),
              _i, st.integers(0, BLOCK - 1), st.integers(0, 7)),
    st.builds(lambda i, junk: pb.PutChunk(key=PUT_KEYS[i], total_nbytes=BLOCK + len(junk),
                                          data=PUT_BLOCKS[i] + junk),
              _i, st.binary(min_size=1, max_size=9000)),
    st.builds(lambda i, junk: pb.PutChunk(key=PUT_KEYS[i], total_nbytes=BLOCK,
                                          data=PUT_BLOCKS[i] + junk),
              _i, st.binary(min_size=1, max_size=100)),
    st.builds(lambda key, total, off, data: pb.PutChunk(key=key, total_nbytes=total, offset=off,
                                                        data=data),
              st.one_of(st.sampled_from(PUT_KEYS), st.binary(max_size=40)),
              st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 1 << 26, 1 << 27, 1 << 40,
                               2**64 - 1]),
              st.sampled_from([0, 0, 1, BLOCK // 2, BLOCK, 1 << 40]),
              st.one_of(st.binary(max_size=64), st.just(PUT_BLOCKS[0][:BLOCK // 2]),
                        st.just(PUT_BLOCKS[0][BLOCK // 2:]))),
    st.builds(lambda idx, total, extra: pb.PutChunk(
        keys=[PUT_KEYS[i] for i in idx], total_nbytes=total,
        data=b"".join(PUT_BLOCKS[i] for i in idx) + extra),
        st.lists(_i, min_size=1, max_size=4),
        st.sampled_from([BLOCK, BLOCK - 64, BLOCK + 64, 1, 1 << 26, 0]),
        st.one_of(st.just(b""), st.binary(max_size=200))),
    st.builds(lambda keys, data: pb.PutChunk(keys=keys, total_nbytes=BLOCK, data=data),
              st.lists(st.binary(max_size=40), min_size=1, max_size=3),
              st.binary(max_size=3 * BLOCK)),
)
_bad_spec = st.one_of(
    st.just(spec_from_namespace(namespace("tenant-a"))),  # not the writer's tenant
    st.just(spec_from_namespace(namespace("tenant-w", block_size=32))),  # other block size
    st.builds(lambda bs, layers, dt: pb.NamespaceSpec(
        model_fingerprint="fuzz-model", dtype=dt, block_size=bs, num_layers=layers,
        num_kv_heads=2, head_dim=8, cache_salt="tenant-w", schema_version=1),
        st.sampled_from([0, 1, 16, 1 << 20, 2**32 - 1]), st.sampled_from([0, 2, 1 << 16]),
        st.sampled_from(["float16", "float32", "nope"])),
    st.none(),
)
# Half the time the writer's own namespace, so the fuzzed messages get past the first checks.
_put_spec = st.booleans().flatmap(
    lambda bad: _bad_spec if bad else st.just(spec_from_namespace(PUT_NS)))

ALLOWED_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE}


@pytest.fixture
def put_node() -> Iterator[tuple[StoreServer, pb_grpc.StoreNodeStub, BlockPool]]:
    pool = BlockPool(1 << 20)  # room for the three blocks, far less than a hostile total_nbytes
    server = StoreServer(pool, "fuzz-node", ServerConfig(auth_token=TOKEN, put_idle_timeout_s=5,
                                                         max_message_bytes=4 << 20),
                         on_publish=lambda entries: None, data_key=DATA_KEY)
    server.start()
    channel = grpc.insecure_channel(server.addresses[0], options=grpc_options(16 << 20))
    yield server, pb_grpc.StoreNodeStub(channel), pool
    channel.close()
    server.stop(0)
    pool.close()


def _pool_is_sound(pool: BlockPool) -> None:
    """Only blocks that verify in their namespace, and not a byte of unaccounted space."""
    held = pool.keys()
    for key in held:
        block = pool.get(key)
        verify_block(block, PUT_NS, key, PUT_TOKENS[PUT_KEYS.index(key)])
        assert block == PUT_BLOCKS[PUT_KEYS.index(key)]
    assert pool.used_bytes() == sum(align_up(pool.nbytes_of(k) or 0) for k in held)


def test_fuzz_put_streams_and_batches_are_refused_cleanly(put_node, thread_deaths) -> None:
    server, stub, pool = put_node
    auth = ((AUTH_HEADER, f"Bearer {WRITER}"),)
    admin = ((AUTH_HEADER, f"Bearer {TOKEN}"),)
    rss_before = rss_bytes()

    @FUZZ
    @given(spec=_put_spec, msgs=st.lists(_msg, min_size=1, max_size=5), unary=st.booleans())
    def one(spec: pb.NamespaceSpec | None, msgs: list[pb.PutChunk], unary: bool) -> None:
        if spec is not None:
            msgs[0].namespace.CopyFrom(spec)
        try:
            if unary:
                stub.PutBatch(pb.PutBatchRequest(chunks=msgs), metadata=auth, timeout=20)
            else:
                stub.Put(iter(msgs), metadata=auth, timeout=20)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED_CODES, (exc.code(), exc.details())
        _pool_is_sound(pool)
        if held := pool.keys():  # an empty pool for the next example: stores, not "existing"
            stub.Delete(pb.KeysRequest(keys=held), metadata=admin, timeout=20)

    one()
    assert not thread_deaths
    assert rss_bytes() - rss_before < RSS_BOUND
    # A well-behaved writer and reader are still served, and what they read verifies.
    stub.Put(iter([pb.PutChunk(namespace=spec_from_namespace(PUT_NS), key=PUT_KEYS[0],
                               total_nbytes=BLOCK, data=PUT_BLOCKS[0])]), metadata=auth,
             timeout=20)
    bufs = [bytearray(BLOCK)]
    BulkClient(server.addresses[1], auth_token=WRITER, timeout_s=10).fetch_into(
        PUT_KEYS[:1], lambda i, n: memoryview(bufs[i]), namespace=PUT_NS)
    verify_block(bufs[0], PUT_NS, PUT_KEYS[0], PUT_TOKENS[0])
    _pool_is_sound(pool)


# -- (c) the header decoder and block verification ------------------------------------------------
DEC_NS = {True: namespace("tenant-d"), False: namespace("tenant-d", keyed=False)}
DEC = {keyed: make_blocks(ns, 2, seed=11) for keyed, ns in DEC_NS.items()}


def _mutate(block: bytes, edits: list[tuple[int, int]], cut: int | None, tail: bytes) -> bytes:
    out = bytearray(block)
    for at, value in edits:
        out[at % len(out)] = value
    if cut is not None:
        out = out[:cut]
    return bytes(out + tail)


_edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4)


def _same_kv(got: bytes, want: bytes, ns: Namespace) -> bool:
    """Whether ``got`` decodes to the KV, key and tokens of ``want``."""
    a, b = read_header(got), read_header(want)
    return (a.key, a.token_ids, a.namespace_root) == (b.key, b.token_ids, b.namespace_root) \
        and torch.equal(payload_view(bytearray(got), ns), payload_view(bytearray(want), ns))


@FUZZ
@given(keyed=st.booleans(), i=st.integers(0, 1), edits=_edits,
       cut=st.one_of(st.none(), st.integers(0, 3000)), tail=st.binary(max_size=8),
       garbage=st.one_of(st.none(), st.binary(max_size=3000)))
def test_fuzz_block_decoder_raises_only_kvstore_errors_and_accepts_no_wrong_kv(
        keyed: bool, i: int, edits: list[tuple[int, int]], cut: int | None, tail: bytes,
        garbage: bytes | None) -> None:
    ns = DEC_NS[keyed]
    keys, tokens, blocks = DEC[keyed]
    buf = garbage if garbage is not None else _mutate(blocks[i], edits, cut, tail)
    for check in (lambda: read_header(buf), lambda: verify_block_self(buf, keys[i])):
        with contextlib.suppress(KVStoreError):
            check()
    try:
        verify_block(buf, ns, keys[i], tokens[i])
    except KVStoreError:
        pass
    else:  # accepted: it must be the block asked for, KV and all
        assert _same_kv(buf, blocks[i], ns)
    # The batch verifier on rows of the block's width: the same verdicts.
    width = len(blocks[0])
    row = (buf + bytes(width))[:width]
    rows = np.frombuffer(blocks[1 - i] + row, dtype=np.uint8).reshape(2, width).copy()
    verdicts = verify_blocks(rows, ns, [keys[1 - i], keys[i]], [tokens[1 - i], tokens[i]])
    assert verdicts[0] == read_header(blocks[1 - i]).parent_key  # its good neighbour is kept
    if isinstance(verdicts[1], Exception):
        assert isinstance(verdicts[1], KVStoreError), repr(verdicts[1])
    else:
        assert _same_kv(row, blocks[i], ns)
