"""The bulk channel against hostile and careless peers: credentials checked before any body is
read, tenants and namespaces enforced per block, connections capped in total and per peer,
silent or trickling peers dropped at the header deadline, TLS from PEM text, live rotation.

Every server here is a BulkServer over a real BlockPool on loopback. "Another peer" is a
socket bound to 127.0.0.2/127.0.0.3 (Linux routes all of 127/8 to lo), so per-peer caps can
be tested next to a well-behaved client on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import torch

from kvstore import metrics
from kvstore.block import encode_block
from kvstore.client.bulk_client import BulkClient
from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import NodeUnavailable, PermissionDenied, RequestTooLarge, Unauthenticated
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.bulk_frames import (
    MAGIC,
    MAX_CREDENTIAL_BYTES,
    MAX_REQUEST_BYTES,
    REQ_HEAD,
    RESP_HEAD,
    STATUS_BAD_REQUEST,
    STATUS_BUSY,
    STATUS_TOO_LARGE,
    STATUS_UNAUTHENTICATED,
    encode_request,
)
from kvstore.node.bulk_server import BulkServer
from kvstore.security.grants import issue_credential
from kvstore.security.tls import client_ssl_context

TOKEN = "cluster-token-of-the-bulk-tests"
DATA_KEY = bytes(range(32))
WAIT_S = 20.0  # generous bound for "eventually": never a timing assertion


def namespace(salt: str, *, keyed: bool = True, model: str = "m") -> Namespace:
    return Namespace(model, "float16", 16, 2, 2, 8, cache_salt=salt,
                     data_key=DATA_KEY if keyed else None)


def make_blocks(ns: Namespace, n: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    """Chained keys and encoded blocks (random payload) of one prompt in ``ns``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n * ns.block_size,), generator=gen).tolist()
    keys = list(BlockHasher(ns).block_keys(tokens))
    parents = [ns.root, *keys[:-1]]
    blocks = [bytes(encode_block(ns, k, p, tokens[i * 16:(i + 1) * 16],
                                 torch.randn(ns.payload_shape, generator=gen).half()))
              for i, (k, p) in enumerate(zip(keys, parents, strict=True))]
    return keys, blocks


class Node:
    """A pool with tenant A's and tenant B's blocks behind a started BulkServer."""

    def __init__(self, config: ServerConfig, data_key: bytes | None = DATA_KEY,
                 on_read: Callable[[list[bytes], str], None] | None = None) -> None:
        self.pool = BlockPool(8 << 20)
        self.ns_a, self.ns_b = namespace("tenant-a"), namespace("tenant-b")
        self.keys_a, self.blocks_a = make_blocks(self.ns_a, 3, seed=1)
        self.keys_b, self.blocks_b = make_blocks(self.ns_b, 3, seed=2)
        for key, block in zip(self.keys_a + self.keys_b, self.blocks_a + self.blocks_b,
                              strict=True):
            self.pool.put(key, block)
        self.server = BulkServer(self.pool, config, on_read, data_key=data_key)
        self.port = self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def client(self, token: str | None = TOKEN, **kw: object) -> BulkClient:
        return BulkClient(self.address, auth_token=token, timeout_s=10, **kw)  # type: ignore[arg-type]

    def close(self) -> None:
        self.server.stop()
        self.pool.close()


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(**settings: object) -> Node:
        data_key = settings.pop("data_key", DATA_KEY)
        on_read = settings.pop("on_read", None)
        settings.setdefault("auth_token", TOKEN)
        node = Node(ServerConfig(**settings), data_key, on_read)  # type: ignore[arg-type]
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def fetch(client: BulkClient, keys: list[bytes], ns: Namespace | None = None
          ) -> list[bytes | None]:
    out: dict[int, bytearray] = {}

    def alloc(i: int, n: int) -> memoryview:
        out[i] = bytearray(n)
        return memoryview(out[i])

    sizes = client.fetch_into(keys, alloc, namespace=ns)
    return [None if s is None else bytes(out[i]) for i, s in enumerate(sizes)]


def refused(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvstore_bulk_refused_total",
                                             {"reason": reason}) or 0.0


def dial(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(WAIT_S)
    s.connect(("127.0.0.1", port))
    return s


def answer(s: socket.socket) -> tuple[int, str] | None:
    """The status frame the server sent before closing, or None if it just closed."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while len(data) < RESP_HEAD.size:
            more = s.recv(RESP_HEAD.size - len(data))
            if not more:
                return None
            data += more
        magic, status, n = RESP_HEAD.unpack(data)
        assert magic == MAGIC
        msg = s.recv(n, socket.MSG_WAITALL).decode() if n else ""
        return status, msg
    return None


def closed(s: socket.socket) -> bool:
    """Read until the server closes (True) or WAIT_S passes (False)."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def wait_until(cond: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- credentials -------------------------------------------------------------------------------
def test_cluster_token_reads_every_tenant_without_a_namespace(make_node) -> None:
    node = make_node()
    keys = node.keys_a + node.keys_b
    assert fetch(node.client(), keys) == node.blocks_a + node.blocks_b


def test_missing_or_wrong_credentials_are_refused(make_node) -> None:
    node = make_node()
    other = issue_credential("another-cluster", "x", read=["tenant-a"])
    for token in (None, "wrong", other, "Bearer wrong"):
        with pytest.raises(Unauthenticated):
            fetch(node.client(token), node.keys_a, node.ns_a)
    expired = issue_credential(TOKEN, "late", read=["tenant-a"], ttl_s=1e-6)
    time.sleep(0.01)
    with pytest.raises(Unauthenticated, match="expired"):
        fetch(node.client(expired), node.keys_a, node.ns_a)


def test_the_credential_is_checked_before_the_body_is_read(make_node) -> None:
    """A wrong credential announcing the largest body gets its answer without sending any of
    it: the server never waited for (or buffered) the body."""
    node = make_node()
    before = refused("unauthenticated")
    s = dial(node.port)
    s.sendall(REQ_HEAD.pack(MAGIC, 5, MAX_REQUEST_BYTES) + b"wrong")
    status, msg = answer(s)
    assert status == STATUS_UNAUTHENTICATED and "wrong credential" in msg
    assert closed(s)
    assert refused("unauthenticated") == before + 1
    # Oversized credential or body: refused from the head alone.
    for head, want in ((REQ_HEAD.pack(MAGIC, MAX_CREDENTIAL_BYTES + 1, 10),
                        STATUS_UNAUTHENTICATED),
                       (REQ_HEAD.pack(MAGIC, len(TOKEN), MAX_REQUEST_BYTES + 1),
                        STATUS_TOO_LARGE)):
        s = dial(node.port)
        s.sendall(head)
        assert answer(s)[0] == want
        assert closed(s)
    assert wait_until(lambda: node.server.num_connections == 0)


def test_old_kvb1_requests_and_garbage_get_bad_request(make_node) -> None:
    node = make_node()
    for junk in (struct.pack("<4sI", b"KVB1", 20) + b"\0" * 20, b"GET / HTTP/1.1\r\n\r\n"):
        s = dial(node.port)
        s.sendall(junk)
        status, msg = answer(s)
        assert status == STATUS_BAD_REQUEST and "KVB2" in msg
    frame = encode_request(TOKEN.encode(), [], "", None)
    s = dial(node.port)  # a valid credential with a body that is not a request
    s.sendall(frame[:REQ_HEAD.size - 4] + struct.pack("<I", 3) + TOKEN.encode() + b"\xc1xx")
    assert answer(s)[0] == STATUS_BAD_REQUEST


def test_rotation_swaps_credentials_live_on_open_connections(make_node) -> None:
    node = make_node()
    old_tenant = issue_credential(TOKEN, "a", read=["tenant-a"])
    client, tenant = node.client(), node.client(old_tenant)
    assert fetch(client, node.keys_a[:1]) == node.blocks_a[:1]
    node.server.set_tokens("new-token", TOKEN)  # rotation under way: both accepted
    assert fetch(client, node.keys_a[:1]) == node.blocks_a[:1]  # the same open connection
    assert fetch(tenant, node.keys_a[:1], node.ns_a) == node.blocks_a[:1]
    node.server.set_tokens("new-token")  # the old token retired
    for c in (client, tenant):
        with pytest.raises(Unauthenticated):
            fetch(c, node.keys_a[:1], node.ns_a)
    assert fetch(node.client("new-token"), node.keys_a[:1]) == node.blocks_a[:1]


# -- tenants -------------------------------------------------------------------------------------
def test_a_tenant_reads_only_its_own_namespace(make_node) -> None:
    node = make_node()
    reader_a = node.client(issue_credential(TOKEN, "a", read=["tenant-a"]))
    writer_a = node.client(issue_credential(TOKEN, "aw", write=["tenant-a"]))
    both = node.keys_a + node.keys_b
    for c in (reader_a, writer_a):  # B's blocks are absent to A, whatever keys A names
        assert fetch(c, both, node.ns_a) == node.blocks_a + [None] * 3
    with pytest.raises(PermissionDenied, match="tenant-b"):
        fetch(reader_a, node.keys_b, node.ns_b)
    with pytest.raises(PermissionDenied, match="must name the namespace"):
        fetch(reader_a, node.keys_a)
    before = refused("forbidden")
    with pytest.raises(PermissionDenied):
        fetch(node.client(issue_credential(TOKEN, "b", read=["tenant-b"])), node.keys_a,
              node.ns_a)
    assert refused("forbidden") == before + 1
    star = node.client(issue_credential(TOKEN, "all", read=["*"]))
    assert fetch(star, both, node.ns_b) == [None] * 3 + node.blocks_b


def test_blocks_of_another_namespace_or_a_public_root_read_as_absent(make_node) -> None:
    """Same tenant, other model: absent. A block planted under the public (unkeyed) root of
    the very same namespace fields, by someone without the data key: absent to the keyed
    namespace's readers, so it cannot pose as the tenant's KV."""
    node = make_node()
    other_keys, other_blocks = make_blocks(namespace("tenant-a", model="other"), 2, seed=3)
    public_keys, public_blocks = make_blocks(namespace("tenant-a", keyed=False), 2, seed=4)
    for key, block in zip(other_keys + public_keys, other_blocks + public_blocks, strict=True):
        node.pool.put(key, block)
    reader = node.client(issue_credential(TOKEN, "a", read=["tenant-a"]))
    asked = [*node.keys_a[:1], *other_keys, *public_keys]
    assert fetch(reader, asked, node.ns_a) == [node.blocks_a[0], None, None, None, None]
    # The public namespace's own readers (on a node without a data key) get only those.
    plain = make_node(data_key=None)
    for key, block in zip(public_keys, public_blocks, strict=True):
        plain.pool.put(key, block)
    ns_public = namespace("tenant-a", keyed=False)
    assert fetch(plain.client(), [*plain.keys_a, *public_keys], ns_public) == \
        [None] * 3 + public_blocks


def test_the_reader_node_is_believed_only_from_the_cluster_token(make_node) -> None:
    """A tenant cannot name reader nodes to multiply replication orders."""
    heard: list[tuple[list[bytes], str]] = []
    node = make_node(on_read=lambda keys, reader: heard.append((keys, reader)))
    fetch(node.client(reader_node_id="node-7"), node.keys_a[:1], node.ns_a)
    fetch(node.client(issue_credential(TOKEN, "a", read=["tenant-a"]),
                      reader_node_id="node-7"), node.keys_a[:2], node.ns_a)
    assert heard == [(node.keys_a[:1], "node-7"), (node.keys_a[:2], "")]


# -- bounds --------------------------------------------------------------------------------------
def test_connections_are_capped_per_peer_and_in_total(make_node) -> None:
    node = make_node(max_bulk_connections=5, max_bulk_connections_per_peer=3,
                     bulk_header_timeout_s=60)
    good = node.client()
    before_peer, before_total = refused("peer_connections"), refused("connections")
    squatters = [dial(node.port, "127.0.0.2") for _ in range(3)]
    assert wait_until(lambda: node.server.num_connections == 3)
    fourth = dial(node.port, "127.0.0.2")  # over its peer's cap: answered BUSY and closed
    got = answer(fourth)
    assert got is None or got[0] == STATUS_BUSY
    assert closed(fourth)
    assert refused("peer_connections") == before_peer + 1
    assert fetch(good, node.keys_a) == node.blocks_a  # another peer is still served
    good.close()  # its idle connection gives its slot back
    assert wait_until(lambda: node.server.num_connections == 3)
    squatters += [dial(node.port, "127.0.0.3") for _ in range(2)]
    assert wait_until(lambda: node.server.num_connections == 5)
    with pytest.raises(NodeUnavailable):
        fetch(node.client(), node.keys_a)  # the node is full: refused at once, not hung
    assert refused("connections") >= before_total + 1
    for s in squatters:
        s.close()
    assert wait_until(lambda: node.server.num_connections == 0)
    assert fetch(node.client(), node.keys_a) == node.blocks_a


def test_silent_and_trickling_peers_are_dropped_at_the_header_deadline(make_node) -> None:
    node = make_node(bulk_header_timeout_s=0.3)
    before = refused("header_timeout")
    silent = dial(node.port, "127.0.0.2")
    partial = dial(node.port, "127.0.0.2")
    partial.sendall(encode_request(TOKEN.encode(), node.keys_a, "", None)[:7])
    trickle = dial(node.port, "127.0.0.2")
    frame = encode_request(TOKEN.encode(), node.keys_a, "", None)
    stop = threading.Event()

    def drip() -> None:  # a byte every 50 ms: each recv gets data, the frame never ends
        for i in range(len(frame)):
            if stop.wait(0.05):
                return
            try:
                trickle.send(frame[i:i + 1])
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    for s in (silent, partial, trickle):
        assert closed(s)
    stop.set()
    t.join()
    assert refused("header_timeout") >= before + 3
    assert wait_until(lambda: node.server.num_connections == 0)
    assert fetch(node.client(), node.keys_a) == node.blocks_a


def test_a_flood_of_connections_is_bounded_in_threads_and_memory(make_node) -> None:
    """1,000 connections from one attacker host: half silent, half sending a full pre-auth
    frame (4 KiB junk credential, a body announced at the cap). The node holds at most the
    per-peer cap's worth of threads, buffers no body, and keeps serving a well-behaved client
    on another address throughout.

    Only the node's connection threads are counted: the rest of the process (gRPC's pool,
    threads of earlier tests winding down) comes and goes on its own. A connection's slot is
    freed as its thread ends, so the threads of one timed-out generation may still be
    unwinding when their successors are admitted: the bound allows one such generation, which
    still tells a capped node (at most 33) from an uncapped one (hundreds)."""
    node = make_node(max_bulk_connections=32, max_bulk_connections_per_peer=16,
                     bulk_header_timeout_s=2)
    rss_before = _rss_bytes()
    junk = REQ_HEAD.pack(MAGIC, MAX_CREDENTIAL_BYTES, MAX_REQUEST_BYTES) \
        + b"x" * MAX_CREDENTIAL_BYTES + b"y" * (64 << 10)
    peak = [0]
    done = threading.Event()

    def sample() -> None:  # the most threads alive at once, sampled all along
        while not done.wait(0.002):
            peak[0] = max(peak[0], _bulk_connection_threads())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    flood: list[socket.socket] = []
    try:
        for i in range(1000):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))  # one attacker host: its cap leaves room for others
            s.settimeout(WAIT_S)
            s.connect(("127.0.0.1", node.port))
            s.setblocking(False)
            if i % 2:
                with contextlib.suppress(OSError):
                    s.send(junk)
            flood.append(s)
            if i % 100 == 99:
                assert fetch(node.client(), node.keys_a[:1]) == node.blocks_a[:1]
        assert node.server.num_connections <= 16 + 1
        assert _rss_bytes() - rss_before < 200 << 20
        assert fetch(node.client(), node.keys_a) == node.blocks_a
    finally:
        done.set()
        sampler.join()
        for s in flood:
            s.close()
    # The per-peer cap, one unwinding generation of it, the good client's connection.
    assert peak[0] <= 16 + 16 + 1
    assert wait_until(lambda: node.server.num_connections == 0)


def _bulk_connection_threads() -> int:
    return sum(t.name == "kvstore-bulk-conn" for t in threading.enumerate())


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# -- TLS -----------------------------------------------------------------------------------------
def self_signed_pem() -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 and its key, as PEM text."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM).decode(),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode())


def test_tls_from_pem_text_with_tenants_and_a_handshake_deadline(make_node) -> None:
    cert, key = self_signed_pem()
    node = make_node(tls_cert_pem=cert, tls_key_pem=key, bulk_header_timeout_s=0.5)
    ctx = client_ssl_context(ClientConfig(tls_ca_pem=cert))
    reader = node.client(issue_credential(TOKEN, "a", read=["tenant-a"]), ssl_context=ctx)
    assert fetch(reader, node.keys_a + node.keys_b, node.ns_a) == node.blocks_a + [None] * 3
    with pytest.raises(Unauthenticated):
        fetch(node.client("wrong", ssl_context=ctx), node.keys_a, node.ns_a)
    with pytest.raises(NodeUnavailable):  # plaintext to a TLS node
        fetch(node.client(), node.keys_a)
    with pytest.raises(NodeUnavailable):  # a node whose certificate the client does not trust
        fetch(node.client(ssl_context=client_ssl_context(
            ClientConfig(tls_ca_pem=self_signed_pem()[0]))), node.keys_a)
    reader.close()  # its idle connection gives its slot back
    s = dial(node.port)  # connects and never says hello
    assert closed(s)
    trickle = dial(node.port)  # a hello one byte at a time, each within the per-read timeout
    trickle.sendall(b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes follows...
    stop = threading.Event()

    def drip() -> None:
        for _ in range(512):
            if stop.wait(0.05):
                return
            try:
                trickle.send(b"\x01")
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    assert closed(trickle)  # ... but the deadline is for the whole handshake
    stop.set()
    t.join()
    assert wait_until(lambda: node.server.num_connections == 0)


def test_requests_too_large_for_one_frame_are_refused_by_the_client() -> None:
    with pytest.raises(RequestTooLarge):
        encode_request(b"", [b"\0" * 32] * 10_000, "", None)
    with pytest.raises(Unauthenticated):
        encode_request(b"x" * (MAX_CREDENTIAL_BYTES + 1), [], "", None)



def test_call_frames_naming_no_known_call_or_an_unserved_one_are_bad_requests(make_node) -> None:
    """A call frame (``KVC1``) must name one of ``CALLS`` with a bytes payload; one this
    channel does not answer (no ``calls`` set: a bare bulk server) is refused the same way,
    the connection closed, so the client asks gRPC instead."""
    from kvstore.node.bulk_frames import CALL_MAGIC, encode_call

    node = make_node()
    body = msgpack.packb({"c": "Delete", "p": b""})
    frames = [REQ_HEAD.pack(CALL_MAGIC, len(TOKEN), len(body)) + TOKEN.encode() + body,
              encode_call(TOKEN.encode(), "Lease", b"")]
    for frame, says in zip(frames, ("c must be one of", "answers no Lease calls"), strict=True):
        s = dial(node.port)
        s.sendall(frame)
        status, msg = answer(s)
        assert status == STATUS_BAD_REQUEST and says in msg
        assert closed(s)
