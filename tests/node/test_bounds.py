"""A store node's gRPC side is bounded by its settings (docs/security.md §Bounds): a Put's
block size is its namespace's, capped, and checked before anything is allocated; Put streams
are capped and a silent one is cancelled; a stalled Put holds no pool space and makes the node
evict nothing; leases are clamped. Every attack runs beside a legitimate client on another
connection that keeps being served.
"""

from __future__ import annotations

import math
import threading
import time
import tracemalloc
from collections.abc import Iterator

import grpc
import pytest

from kvstore.block import block_nbytes
from kvstore.client.node_client import StoreNodeClient
from kvstore.cluster.store_node import EvictingPool
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import Overloaded
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.grpc_setup import grpc_options
from kvstore.node.leases import LeaseTable, clamp_ttl
from kvstore.node.limits import StreamWatchdog
from kvstore.node.proto_forms import spec_from_namespace
from kvstore.node.store_server import StoreServer
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from tests.node.test_store_server import make_blocks, make_namespace

FAST = ClientConfig(timeout_s=10, retries=0)


class Stall:
    """A Put stream that sends ``first`` messages, then waits until released."""

    def __init__(self, stub: pb_grpc.StoreNodeStub, first: list[pb.PutChunk]) -> None:
        self.sent = threading.Event()
        self.release = threading.Event()
        self.first = first
        self.future = stub.Put.future(self._messages(), timeout=60)

    def _messages(self) -> Iterator[pb.PutChunk]:
        yield from self.first
        self.sent.set()
        self.release.wait(60)

    def end(self) -> grpc.StatusCode:
        """Release the stream and return how the call ended."""
        self.release.set()
        try:
            self.future.result(timeout=60)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def chunks_of(ns: Namespace, key: bytes, block: bytes, upto: int, size: int = 1024
              ) -> list[pb.PutChunk]:
    """The first ``upto`` bytes of ``block`` as Put chunks (the first carries the namespace)."""
    out = []
    for off in range(0, upto, size):
        msg = pb.PutChunk(key=key, total_nbytes=len(block), offset=off,
                          data=block[off : min(off + size, upto)])
        if off == 0:
            msg.namespace.CopyFrom(spec_from_namespace(ns))
        out.append(msg)
    return out


def wait_until(cond, timeout_s: float = 30.0) -> bool:
    """Poll ``cond`` (a bound, not a timing assertion)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def node(request) -> Iterator[tuple[StoreServer, pb_grpc.StoreNodeStub, BlockPool, list]]:
    overrides = getattr(request, "param", {})
    pool = BlockPool(8 << 20)
    made_room: list[int] = []

    def make_room(nbytes: int) -> bool:
        made_room.append(nbytes)
        return False

    cfg = ServerConfig(max_message_bytes=4 << 20, **{"put_idle_timeout_s": 60.0, **overrides})
    server = StoreServer(EvictingPool(pool, make_room), "node-a", cfg,
                         on_publish=InMemoryIndex().publish)
    server.start()
    channel = grpc.insecure_channel(server.addresses[0], options=grpc_options(16 << 20))
    yield server, pb_grpc.StoreNodeStub(channel), pool, made_room
    channel.close()
    server.stop(0)
    pool.close()


def legit_reads(server: StoreServer, ns: Namespace, keys: list[bytes],
                blocks: list[bytearray]) -> None:
    """A well-behaved client on its own connection: every block back, bitwise."""
    with StoreNodeClient(server.addresses[0], config=FAST) as c:
        assert c.get_blocks(keys, ns) == [bytes(b) for b in blocks]
        assert c.exists(keys, ns) == [True] * len(keys)
        lease = c.lease(keys, 5.0, namespace=ns)
        assert [loc.key for loc in lease.locations] == keys
        c.release(lease.lease_id)


def stored(server: StoreServer, ns: Namespace, n: int, seed: int = 0
           ) -> tuple[list[bytes], list[bytearray]]:
    keys, _, blocks = make_blocks(ns, n, seed=seed)
    with StoreNodeClient(server.addresses[0], config=FAST) as c:
        assert c.put_blocks(ns, list(zip(keys, blocks, strict=True))).num_stored == n
    return keys, blocks


def test_a_tiny_put_declaring_a_huge_block_allocates_nothing(node) -> None:
    server, stub, pool, _ = node
    ns = make_namespace()
    keys, blocks = stored(server, ns, 2)
    tracemalloc.start()  # every thread's Python allocations: the server's handlers' too
    for block_size in (1 << 26, 1 << 27, (1 << 32) - 1):
        huge = Namespace("test-model", "float16", block_size, 2, 2, 8)
        msg = pb.PutChunk(namespace=spec_from_namespace(huge), key=b"\1" * 32,
                          total_nbytes=1 << 40, offset=0, data=b"x" * 64)
        assert msg.ByteSize() < 256
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(iter([msg]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_block_bytes" in err.value.details()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # Sizing a 2^26-token block's header alone would take 512 MiB: nothing near that happened.
    assert peak < 16 << 20
    assert pool.reserved_bytes() == 0 and server.put_limits.pending_bytes == 0
    legit_reads(server, ns, keys, blocks)


def test_a_block_must_be_exactly_its_namespaces_size(node) -> None:
    server, stub, pool, _ = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3, seed=3)
    size = block_nbytes(ns)
    junk = bytes(blocks[0]) + b"\0" * (64 << 10)  # a valid block, then junk
    for total, data in ((len(junk), junk), (size - 64, bytes(blocks[0])[: size - 64])):
        msg = pb.PutChunk(namespace=spec_from_namespace(ns), key=keys[0], total_nbytes=total,
                          offset=0, data=data)
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(iter([msg]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block size" in err.value.details()
    # A batch message with bytes past its blocks, or blocks of another size.
    batch = pb.PutChunk(namespace=spec_from_namespace(ns), keys=keys[:2], total_nbytes=size,
                        data=bytes(blocks[0]) + bytes(blocks[1]) + b"\0" * 64)
    for msg in (batch, pb.PutChunk(namespace=spec_from_namespace(ns), keys=keys[:1],
                                   total_nbytes=len(junk), data=junk)):
        with pytest.raises(grpc.RpcError) as err:
            stub.PutBatch(pb.PutBatchRequest(chunks=[msg]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not any(pool.contains(k) for k in keys)
    stored_keys, stored_blocks = stored(server, ns, 2, seed=4)
    legit_reads(server, ns, stored_keys, stored_blocks)


@pytest.mark.parametrize("node", [{"max_concurrent_puts": 2}], indirect=True)
def test_stalled_put_streams_never_starve_readers(node) -> None:
    """Eight streams that stall after one message: two are admitted (they hold a worker
    each), the other six are refused at once; reads and a unary Put keep being served."""
    server, stub, pool, _ = node
    ns = make_namespace()
    keys, blocks = stored(server, ns, 3)
    big_ns = Namespace("test-model", "float16", 16, 8, 8, 64)
    bkeys, _, bblocks = make_blocks(big_ns, 1, seed=5)
    stalls = [Stall(stub, chunks_of(big_ns, bkeys[0], bytes(bblocks[0]), 4096))
              for _ in range(8)]
    assert wait_until(lambda: server.put_limits.streams == 2
                      and sum(s.future.done() for s in stalls) == 6)
    refused = [s for s in stalls if s.future.done()]
    for s in refused:
        assert s.future.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Overloaded" in s.future.exception().details()
    for _ in range(3):
        legit_reads(server, ns, keys, blocks)
    more_keys, more = stored(server, ns, 2, seed=6)  # a whole-batch Put needs no stream slot
    legit_reads(server, ns, more_keys, more)
    assert pool.reserved_bytes() == 0  # the stalled blocks hold no pool space
    for s in stalls:
        s.end()
    assert wait_until(lambda: server.put_limits.streams == 0
                      and server.put_limits.pending_bytes == 0)


def test_a_client_retries_a_busy_node_until_a_stream_slot_frees(node) -> None:
    server, stub, _, _ = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 2, seed=8)
    server.put_limits.max_streams = 1
    stall = Stall(stub, chunks_of(ns, keys[0], bytes(blocks[0]), 1024))
    assert wait_until(lambda: server.put_limits.streams == 1)
    with StoreNodeClient(server.addresses[0], config=FAST) as c:
        msgs = chunks_of(ns, keys[1], bytes(blocks[1]), len(blocks[1]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(iter(msgs))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        done = threading.Event()
        result: list[object] = []

        def put() -> None:
            try:
                result.append(c.put_blocks(ns, [(keys[1], blocks[1])]))
            except Exception as exc:  # noqa: BLE001 - reported below
                result.append(exc)
            done.set()

        # The client's put_blocks streams only past one message; force the stream path.
        c._chunk = 512  # noqa: SLF001 - chunked: one block in several messages
        threading.Thread(target=put, daemon=True).start()
        stall.end()
        assert done.wait(30)
        assert not isinstance(result[0], Exception), result[0]
        assert c.get_blocks([keys[1]], ns) == [bytes(blocks[1])]


def test_a_silent_put_stream_is_cancelled_and_holds_nothing(node) -> None:
    server, stub, pool, made_room = node
    ns = make_namespace()
    keys, blocks = stored(server, ns, 2)
    new_keys, _, new_blocks = make_blocks(ns, 1, seed=11)
    stall = Stall(stub, chunks_of(ns, new_keys[0], bytes(new_blocks[0]), 1024))
    assert stall.sent.wait(30)
    assert wait_until(lambda: server.put_limits.pending_bytes == len(new_blocks[0]))
    late = server.watchdog.check(now=time.monotonic() + 61)  # as if a minute passed silently
    assert [w.expired for w in late] == ["idle"]
    assert stall.future.exception(timeout=30).code() == grpc.StatusCode.CANCELLED
    assert wait_until(lambda: server.put_limits.streams == 0
                      and server.put_limits.pending_bytes == 0)
    assert not pool.contains(new_keys[0]) and pool.reserved_bytes() == 0
    assert made_room == []
    stall.end()
    legit_reads(server, ns, keys, blocks)


def test_a_stalled_put_never_makes_the_node_evict_committed_blocks(node) -> None:
    """The pool is nearly full of committed blocks; a Put stream declares a block that would
    need eviction and stalls after its first chunk: nothing is reserved, no room is made,
    every committed block stays and is served; the committed bytes the coordinator sees are
    the committed blocks' alone."""
    server, stub, pool, made_room = node
    ns = Namespace("test-model", "float16", 16, 8, 8, 32)  # 128 KiB blocks
    n = pool.capacity_bytes // block_nbytes(ns) - 1
    keys, blocks = stored(server, ns, n)
    used = pool.used_bytes()
    assert pool.committed_bytes() == used
    extra_keys, _, extra = make_blocks(ns, 3, seed=12)
    stalls = [Stall(stub, chunks_of(ns, k, bytes(b), 4096))
              for k, b in zip(extra_keys, extra, strict=True)]
    assert wait_until(lambda: server.put_limits.pending_bytes == 3 * block_nbytes(ns))
    assert pool.used_bytes() == used and pool.reserved_bytes() == 0 and made_room == []
    legit_reads(server, ns, keys, blocks)
    for s in stalls:
        s.end()
    assert len(pool.keys()) == n and all(pool.contains(k) for k in keys)
    # Reserved (uncommitted) space is not committed use, whoever reserves it.
    res = pool.reserve(b"\7" * 32, block_nbytes(ns))
    assert pool.committed_bytes() == used and pool.used_bytes() > used
    pool.abort(res)


@pytest.mark.parametrize("node", [{"max_lease_ttl_s": 5.0}], indirect=True)
def test_lease_ttls_are_clamped_and_nonsense_refused(node) -> None:
    server, stub, _, _ = node
    ns = make_namespace()
    keys, _ = stored(server, ns, 1)
    for ttl in (math.inf, 1e12, 0.0):  # 0: the node's default (30 s), clamped too
        before = time.time()
        resp = stub.Lease(pb.LeaseRequest(keys=keys, ttl_s=ttl,
                                          namespace=spec_from_namespace(ns)))
        assert resp.expires_at <= time.time() + 5.0 and resp.expires_at > before
        renewed = stub.RenewLease(pb.RenewLeaseRequest(lease_id=resp.lease_id, ttl_s=math.inf))
        assert renewed.expires_at <= time.time() + 5.0
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=resp.lease_id))
    for ttl in (math.nan, -1.0, -math.inf):
        with pytest.raises(grpc.RpcError) as err:
            stub.Lease(pb.LeaseRequest(keys=keys, ttl_s=ttl, namespace=spec_from_namespace(ns)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert clamp_ttl(0.0, 30.0, 300.0) == 30.0 and clamp_ttl(math.inf, 30.0, 300.0) == 300.0
    assert clamp_ttl(2.5, 30.0, 300.0) == 2.5


def test_open_leases_per_credential_are_capped() -> None:
    table = LeaseTable(max_per_subject=2)
    ids = [table.track(i, time.monotonic() + 30, "tenant") for i in range(2)]
    with pytest.raises(Overloaded):
        table.check_room("tenant")
    table.check_room("someone-else")
    assert table.take(ids[0], "someone-else") is None  # not theirs: left alone
    assert table.take(ids[0], "tenant") == 0
    table.check_room("tenant")


def test_the_watchdog_cancels_only_what_went_quiet() -> None:
    dog = StreamWatchdog(idle_s=10.0)
    cancelled: list[str] = []

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def cancel(self) -> None:
            cancelled.append(self.name)

    quiet, busy, dripping = (dog.watch(Ctx(n)) for n in ("quiet", "busy", "dripping"))
    now = time.monotonic()
    busy.last = dripping.last = now + 15
    dripping.block_since = now - 100
    assert {w.expired for w in dog.check(now=now + 20)} == {"idle", "slow block"}
    assert sorted(cancelled) == ["dripping", "quiet"]
    assert dog.check(now=now + 20) == []  # cancelled once
    dog.done(busy)
    assert dog.check(now=now + 1000) == []


def test_the_coordinator_is_told_committed_bytes_only() -> None:
    """A heartbeat's used bytes leave out open reservations: the watermark plan never evicts
    committed blocks because space is reserved and not yet committed."""
    from types import SimpleNamespace

    from kvstore.cluster.store_node import StoreNode

    with BlockPool(1 << 20) as pool:
        pool.put(b"\1" * 32, bytes(4096))
        committed = pool.stats().used_bytes
        res = pool.reserve(b"\2" * 32, 512 << 10)
        assert pool.stats().used_bytes > committed
        assert StoreNode._stats(SimpleNamespace(pool=pool)).used_bytes == committed  # noqa: SLF001
        pool.abort(res)
