"""StoreNodeClient against real servers, in-process and in another process."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import (
    InvalidRequest,
    LeaseExpired,
    NodeUnavailable,
    RequestTooLarge,
    Unauthenticated,
)
from kvstore.node.block_pool import BlockPool
from kvstore.node.bulk_server import MAGIC
from kvstore.node.store_server import StoreServer
from tests.node.test_store_server import make_blocks, make_namespace, make_self_signed

ROOT = Path(__file__).resolve().parents[2]  # the repository: its kvstore is the one under test
FAST = ClientConfig(timeout_s=5, retries=1)


@pytest.fixture
def server():
    pool = BlockPool(16 << 20)
    srv = StoreServer(pool, "n1", ServerConfig())
    srv.start()
    yield srv, pool
    srv.stop(0)
    pool.close()


def clients(srv: StoreServer, pool: BlockPool) -> dict[str, StoreNodeClient]:
    grpc_addr, bulk_addr = srv.addresses
    return {
        "grpc": StoreNodeClient(grpc_addr, config=FAST),
        "bulk": StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=FAST),
        "shm": StoreNodeClient(grpc_addr, shm_path=pool.path, same_node=True, config=FAST),
    }


@pytest.mark.parametrize("unary_limit", [8 << 20, 1])
def test_put_rows_stores_exactly_what_put_blocks_does(server, monkeypatch,
                                                      unary_limit: int) -> None:
    """A batch encoded back to back goes as one unary PutBatch, or (past UNARY_PUT_BYTES) as
    the stream: the node holds the same bytes either way, and held keys count as existing."""
    import numpy as np

    import kvstore.client.node_client as client_module

    monkeypatch.setattr(client_module, "UNARY_PUT_BYTES", unary_limit)
    srv, pool = server
    client = clients(srv, pool)["grpc"]
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 6)
    rows = np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(6, len(blocks[0]))
    assert client.put_rows(ns, keys[:2], rows[:2]).num_stored == 2
    result = client.put_rows(ns, keys, rows)
    assert (result.num_stored, result.num_existing) == (4, 2)
    assert [pool.get(k) for k in keys] == [bytes(b) for b in blocks]
    with pytest.raises(ValueError, match="6 keys for 5 encoded blocks"):
        client.put_rows(ns, keys, rows[:5])


@pytest.mark.parametrize("path", ["grpc", "bulk", "shm"])
def test_round_trip_is_bitwise_on_every_path(server, path: str) -> None:
    srv, pool = server
    client = clients(srv, pool)[path]
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 5)
    assert client.put_blocks(ns, list(zip(keys, blocks, strict=True))).num_stored == 5
    absent = b"\7" * 32
    bufs = [bytearray(len(blocks[0])) for _ in range(6)]
    sizes = client.get_blocks_into([*keys, absent], bufs)
    assert sizes == [len(b) for b in blocks] + [None]
    assert bufs[:5] == blocks
    assert client.get_blocks([keys[3], absent]) == [blocks[3], None]
    # Every path lets go of its lease (the bulk server does so just after its last send).
    deadline = time.monotonic() + 5
    while pool.stats().num_leased and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stats().num_leased == 0
    client.close()


def test_bulk_pipelines_small_requests_and_keeps_the_stream_in_step(server) -> None:
    """Many keys go out as several pipelined requests; blocks land in order, absent ones are
    None, and the connection stays usable for the next call."""
    srv, pool = server
    grpc_addr, bulk_addr = srv.addresses
    cfg = ClientConfig(timeout_s=5, retries=1, bulk_request_blocks=2, bulk_pipeline_depth=3,
                       bulk_streams=1)
    client = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=cfg)
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 7)
    client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    absent = [bytes([i]) * 32 for i in (1, 2, 3)]
    ask = [absent[0], *keys[:3], absent[1], *keys[3:], absent[2]]  # 5 requests of 2, 1 left
    for _ in range(2):  # the second call reuses the connection the first one left
        bufs = [bytearray(len(blocks[0])) for _ in ask]
        sizes = client.get_blocks_into(ask, bufs)
        want = [None if k in absent else blocks[keys.index(k)] for k in ask]
        assert sizes == [None if w is None else len(w) for w in want]
        assert [b if w is not None else None for b, w in zip(bufs, want, strict=True)] == want
    assert len(client._bulk._idle) == 1  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="bulk_request_blocks"):
        ClientConfig(bulk_request_blocks=0)
    client.close()


@pytest.mark.parametrize("path", ["grpc", "bulk", "shm"])
def test_every_read_path_names_the_reader_node(path: str) -> None:
    pool = BlockPool(4 << 20)
    reads: list[tuple[list[bytes], str]] = []
    srv = StoreServer(pool, "n1", ServerConfig(),
                      on_read=lambda keys, reader: reads.append((list(keys), reader)))
    srv.start()
    grpc_addr, bulk_addr = srv.addresses
    cfg = ClientConfig(timeout_s=5, retries=1, node_id="reader-b")
    client = {
        "grpc": StoreNodeClient(grpc_addr, config=cfg),
        "bulk": StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=cfg),
        "shm": StoreNodeClient(grpc_addr, shm_path=pool.path, same_node=True, config=cfg,
                               reader_node_id="explicit-a"),
    }[path]
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 2)
    client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    assert reads == []  # a put is not a read
    client.get_blocks_into([keys[1], b"\7" * 32, keys[0]], [bytearray(len(blocks[0]))] * 3)
    want = "explicit-a" if path == "shm" else "reader-b"
    assert sorted(k for ks, _ in reads for k in ks) == sorted(keys)  # the absent key is not
    assert {r for _, r in reads} == {want}
    client.close()
    srv.stop(0)
    pool.close()


def test_admin_calls(server) -> None:
    srv, pool = server
    client = clients(srv, pool)["bulk"]
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    assert client.exists([keys[0], b"\1" * 32]) == [True, False]
    health = client.health()
    assert health.serving and health.node_id == "n1" and health.bulk_address == srv.addresses[1]
    assert client.stats().num_blocks == 3
    assert sorted(b.key for b in client.list_keys(page_size=2)) == sorted(keys)
    lease = client.lease(keys[:1], 10)
    assert client.evict(keys) == 2 * len(blocks[0])  # the leased block stays
    client.renew(lease.lease_id, 10)
    client.release(lease.lease_id)
    assert client.delete(keys) == 1 and client.stats().num_blocks == 0
    with pytest.raises(InvalidRequest):  # a malformed key comes back as a typed error
        client.lease([b"short"], 1)


def test_wrong_token_and_oversized_are_typed() -> None:
    pool = BlockPool(4 << 20)
    srv = StoreServer(pool, "n1", ServerConfig(auth_token="t0ken", max_message_bytes=4 << 20))
    srv.start()
    try:
        grpc_addr, bulk_addr = srv.addresses
        ns = make_namespace()
        keys, _, blocks = make_blocks(ns, 1)
        bad = StoreNodeClient(grpc_addr, bulk_address=bulk_addr,
                              config=ClientConfig(auth_token="nope", timeout_s=5))
        with pytest.raises(Unauthenticated):
            bad.stats()
        with pytest.raises(Unauthenticated):
            bad.get_blocks(keys)
        good = StoreNodeClient(grpc_addr, config=ClientConfig(auth_token="t0ken", timeout_s=5,
                                                              max_message_bytes=64 << 20))
        big = bytearray(5 << 20)  # the client chunks at 64 MiB; the server only takes 4 MiB
        with pytest.raises(RequestTooLarge):
            good.put_blocks(ns, [(keys[0], big)])
        assert good.put_blocks(ns, [(keys[0], blocks[0])]).num_stored == 1
    finally:
        srv.stop(0)
        pool.close()


def test_unreachable_node_is_node_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    client = StoreNodeClient(f"127.0.0.1:{port}", bulk_address=f"127.0.0.1:{port}",
                             config=ClientConfig(timeout_s=2, retries=1))
    with pytest.raises(NodeUnavailable):
        client.health()
    with pytest.raises(NodeUnavailable):
        client.get_blocks([b"\0" * 32])


def test_bulk_peer_dying_mid_block_gives_no_partial_block() -> None:
    """A fake node answers with a full table, sends half a block, and dies."""
    lst = socket.create_server(("127.0.0.1", 0))
    port = lst.getsockname()[1]

    def fake() -> None:
        conn, _ = lst.accept()
        head = conn.recv(10, socket.MSG_WAITALL)
        _, cred_len, body_len = struct.unpack("<4sHI", head)
        conn.recv(cred_len + body_len, socket.MSG_WAITALL)
        conn.sendall(struct.pack("<4sBI", MAGIC, 0, 0) + struct.pack("<I2Q", 2, 100, 100))
        conn.sendall(b"x" * 150)
        conn.close()

    t = threading.Thread(target=fake)
    t.start()
    client = StoreNodeClient("127.0.0.1:1", bulk_address=f"127.0.0.1:{port}", config=FAST)
    with pytest.raises(NodeUnavailable):
        client.get_blocks([b"\1" * 32, b"\2" * 32])
    t.join()
    lst.close()


SERVER_SCRIPT = """
import sys, time
from kvstore.config import ServerConfig
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
pool = BlockPool(64 << 20)
srv = StoreServer(pool, "sub", ServerConfig())
g, b = srv.start()
print(g, b, pool.path, flush=True)
time.sleep(600)
"""


def start_subprocess_server() -> tuple[subprocess.Popen, str, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    grpc_port, bulk_port, path = proc.stdout.readline().split()
    return proc, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{bulk_port}", path


def test_subprocess_server_round_trip_then_killed_mid_stream() -> None:
    proc, grpc_addr, bulk_addr, path = start_subprocess_server()
    try:
        ns = make_namespace(num_layers=32, head_dim=128)  # 1 MiB blocks
        keys, _, blocks = make_blocks(ns, 24)
        client = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=FAST)
        client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
        assert client.get_blocks(keys) == blocks
        shm = StoreNodeClient(grpc_addr, shm_path=path, same_node=True, config=FAST)
        bufs = [bytearray(len(b)) for b in blocks]
        shm.get_blocks_into(keys, bufs)
        assert bufs == blocks
        shm.close()
        # Kill the server while a client reads in a loop: every call either returns all
        # blocks bitwise or raises NodeUnavailable; nothing else, nothing partial.
        outcomes: list[object] = []

        def reader() -> None:
            for _ in range(200):
                try:
                    got = client.get_blocks(keys)
                    outcomes.append(got == blocks)
                except NodeUnavailable as exc:
                    outcomes.append(exc)
                    return

        t = threading.Thread(target=reader)
        t.start()
        while not outcomes:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        t.join(timeout=30)
        assert isinstance(outcomes[-1], NodeUnavailable)
        assert all(o is True for o in outcomes[:-1])
        with pytest.raises(NodeUnavailable):
            client.stats()
    finally:
        proc.kill()
        proc.wait()
        if os.path.exists(path):
            os.unlink(path)  # SIGKILL skipped the arena's own cleanup


def test_concurrent_clients_lose_nothing(server) -> None:
    srv, pool = server
    ns = make_namespace()
    grpc_addr, bulk_addr = srv.addresses
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            client = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=FAST)
            keys, _, blocks = make_blocks(ns, 6, seed=100 + seed)
            client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
            for _ in range(5):
                assert client.get_blocks(keys) == blocks
            client.close()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.stats().num_blocks == 48


def test_tls_client(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    pool = BlockPool(4 << 20)
    srv = StoreServer(pool, "n1", ServerConfig(tls_cert_file=cert, tls_key_file=key,
                                               auth_token="tok"))
    srv.start()
    try:
        grpc_addr, bulk_addr = srv.addresses
        client = StoreNodeClient(grpc_addr, bulk_address=bulk_addr,
                                 config=ClientConfig(tls_ca_file=cert, auth_token="tok",
                                                     timeout_s=5))
        ns = make_namespace()
        keys, _, blocks = make_blocks(ns, 3)
        client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
        assert client.get_blocks(keys) == blocks
        client.close()
    finally:
        srv.stop(0)
        pool.close()


def test_slow_same_node_copy_renews_its_lease_and_a_lost_lease_is_typed(server, monkeypatch
                                                                         ) -> None:
    """The lease is renewed between blocks once a third of its TTL is gone; if the node no
    longer knows the lease, the read fails with LeaseExpired instead of trusting the bytes."""
    import kvstore.client.shm_reader as shm_reader_module

    srv, pool = server
    grpc_addr, _ = srv.addresses
    client = StoreNodeClient(grpc_addr, shm_path=pool.path, same_node=True, config=FAST,
                             lease_ttl_s=0.3)
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 3)
    client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    reader = client._reader()
    renewals: list[str] = []
    real_copy, real_renew = reader.copy_verified_into, client.renew
    real_gather = reader.gather_into

    def slow_copy(*args, **kwargs):
        time.sleep(0.12)
        return real_copy(*args, **kwargs)

    def slow_gather(*args, **kwargs):  # small blocks: gathered, then verified as a batch
        time.sleep(0.12)
        return real_gather(*args, **kwargs)

    def counting_renew(lease_id: str, ttl_s: float) -> float:
        renewals.append(lease_id)
        return real_renew(lease_id, ttl_s)

    reader.copy_verified_into = slow_copy  # type: ignore[method-assign]
    reader.gather_into = slow_gather  # type: ignore[method-assign]
    monkeypatch.setattr(shm_reader_module, "GATHER_BYTES", 1)  # one block per gather
    client.renew = counting_renew  # type: ignore[method-assign]
    bufs = [bytearray(len(blocks[0])) for _ in keys]
    got = client.get_verified_into(ns, keys, tokens, bufs)
    assert got == [len(b) for b in blocks] and bufs == blocks and renewals

    def forgetting_renew(lease_id: str, ttl_s: float) -> float:
        client.release(lease_id)  # the node forgets the lease (as if it expired there)
        return real_renew(lease_id, ttl_s)

    client.renew = forgetting_renew  # type: ignore[method-assign]
    with pytest.raises(LeaseExpired):
        client.get_verified_into(ns, keys, tokens, bufs)
    client.close()


def test_small_same_node_blocks_verify_as_a_batch_with_the_per_block_verdicts(
        server, monkeypatch) -> None:
    """Small blocks are copied out of the arena and verified a batch at a time: every verdict
    (good, damaged payload, damaged header, wrong tokens, absent) and every byte handed out
    equals the one-pass per-block path's, which the test forces as the reference."""
    import kvstore.client.shm_reader as shm_reader_module

    srv, pool = server
    grpc_addr, _ = srv.addresses
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 6, seed=11)
    writer = StoreNodeClient(grpc_addr, config=FAST)
    writer.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    client = StoreNodeClient(grpc_addr, shm_path=pool.path, same_node=True, config=FAST)
    lease = pool.lease(keys, 30.0)
    where = {loc.key: loc for loc in lease.locations}
    pool.release(lease.lease_id)
    arena = pool._arena.view  # the node's own memory: what a bad disk or a bug would do
    arena[where[keys[1]].offset + where[keys[1]].nbytes - 1] ^= 0xFF  # payload
    arena[where[keys[3]].offset + 40] ^= 0x01  # header
    asked = [*keys[:5], b"\5" * 32]  # the last is not held
    wanted = list(tokens)
    wanted[4] = [t + 1 for t in tokens[4]]  # the reader asked for other tokens
    results = []
    for small in (0, shm_reader_module.SMALL_BLOCK_BYTES):  # 0: one block at a time
        monkeypatch.setattr(shm_reader_module, "SMALL_BLOCK_BYTES", small)
        bufs = [bytearray(len(blocks[0])) for _ in asked]
        got = client.get_verified_into(ns, asked, wanted, bufs)
        results.append(([(type(v), str(v)) if isinstance(v, Exception) else v for v in got],
                        [bytes(b) for i, b in enumerate(bufs) if got[i] == len(blocks[0])]))
    assert results[0] == results[1]
    verdicts = results[1][0]
    assert verdicts[0] == verdicts[2] == len(blocks[0]) and verdicts[5] is None
    assert [v[0].__name__ for v in (verdicts[1], verdicts[3], verdicts[4])] == \
        ["BlockCorrupted", "BlockCorrupted", "BlockMismatch"]
    assert results[1][1] == [bytes(blocks[0]), bytes(blocks[2])]
    with pytest.raises(ValueError, match="too small"):
        client.get_verified_into(ns, keys[:2], tokens[:2], [bytearray(8), bytearray(8)])
    client.close()
    writer.close()


def test_a_finished_lease_is_released_by_the_next_read_or_soon_after(server, monkeypatch
                                                                     ) -> None:
    """``release_nowait`` costs no call of its own when the reader reads again: the next
    Lease carries it. Otherwise the release thread sends it within RELEASE_DELAY_S, and a
    Lease that fails hands its releases back to be sent."""
    import kvstore.client.node_client as client_module

    srv, pool = server
    grpc_addr, _ = srv.addresses
    client = StoreNodeClient(grpc_addr, shm_path=pool.path, same_node=True, config=FAST)
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    client.put_blocks(ns, list(zip(keys, blocks, strict=True)))
    sent: list[str] = []
    real_release = client.release

    def counting_release(lease_id: str) -> None:
        sent.append(lease_id)
        real_release(lease_id)

    client.release = counting_release  # type: ignore[method-assign]
    monkeypatch.setattr(client_module, "RELEASE_DELAY_S", 0.5)
    first = client.lease(keys[:1], 30.0)
    client.release_nowait(first.lease_id)
    assert pool.stats().num_leased == 1
    second = client.lease(keys[1:2], 30.0)  # carries the first one's release
    assert pool.stats().num_leased == 1
    with pytest.raises(LeaseExpired):
        srv.lease_of(first.lease_id)
    client.release_nowait(second.lease_id)
    assert wait_until(lambda: pool.stats().num_leased == 0, 5.0)
    assert sent == [second.lease_id]  # the thread sent only what no read carried
    third = client.lease(keys[2:], 30.0)
    client.release_nowait(third.lease_id)
    real_unary = client._unary

    def failing(method, request):
        if type(request).__name__ == "LeaseRequest":
            raise NodeUnavailable("node went away")
        return real_unary(method, request)

    client._unary = failing  # type: ignore[method-assign]
    with pytest.raises(NodeUnavailable):
        client.lease(keys[:1], 30.0)
    client._unary = real_unary  # type: ignore[method-assign]
    assert wait_until(lambda: pool.stats().num_leased == 0, 5.0)
    assert sent == [second.lease_id, third.lease_id]
    client.close()


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
