"""The bulk byte channel: remote block reads over plain TCP, straight from the arena.

Why not gRPC for the bytes: Python gRPC copies every payload at least three times (arena ->
``bytes`` for protobuf -> HTTP/2 frames -> the caller's ``bytes``) and pays a per-message cost
in Python: it moved ~0.5 GB/s here at 2 MiB and 64 KiB, where a raw loopback socket moves 3-8
GB/s (benchmarks/bench_transfer.py). So gRPC stays for control and puts, and payloads move on
this channel: the server sends each run of adjacent leased blocks with one ``sendall`` from its
read-only mapping of the arena, and the reader scatters a whole reply into the buffers it
preallocated with one ``recvmsg_into`` (the kernel's two copies only). ``sendfile`` from the
arena file was measured and dropped: on loopback from tmpfs it moved 1.6 GB/s at 3x the sender
CPU of ``sendall`` from the mapping (5.0 GB/s), the page-by-page splice costing more than the
copy it saves. A many-block read is pipelined: requests of 32 blocks, 4 in flight.

Protocol (all integers little-endian; connections are reused, requests on one are answered
in order, and a client may send the next before the last answer has arrived)::

    request : "KVB1" | u32 body_len | msgpack {"t": token, "k": [key, ...], "r": reader}
    response: "KVB1" | u8 status | u32 msg_len | msg (utf-8)
              then, if status == OK: u32 n | n x u64 nbytes (MISSING if absent) | payloads

The server leases the blocks for the duration of the send (eviction cannot reuse the bytes
under the socket), checks the token with a constant-time compare, caps the request size, and
serves each connection on its own thread with a send timeout, so a stalled or vanished client
only ends its own connection.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from kvstore import metrics
from kvstore.config import ServerConfig
from kvstore.constants import KEY_NBYTES
from kvstore.errors import (
    KVStoreError,
    NodeUnavailable,
    RequestTooLarge,
    Unauthenticated,
)
from kvstore.node.pool import ServedPool
from kvstore.node.shm_reader import ShmReader

MAGIC = b"KVB1"
MISSING = (1 << 64) - 1
STATUS_OK, STATUS_UNAUTHENTICATED, STATUS_BAD_REQUEST, STATUS_TOO_LARGE, STATUS_ERROR = range(5)
MAX_REQUEST_BYTES = 1 << 20  # ~30k keys: far above one request's prompt, far below a DoS
SEND_TIMEOUT_S = 30.0  # a client that stops reading for this long loses its connection
IDLE_TIMEOUT_S = 300.0
LEASE_TTL_S = 120.0  # outlives SEND_TIMEOUT_S; released explicitly once the send ends

_REQ = struct.Struct("<4sI")
_RESP = struct.Struct("<4sBI")
_COUNT = struct.Struct("<I")
_MAX_AHEAD_BYTES = 64 << 10  # requests in flight must fit the peer's socket buffer
_IOV_MAX = 1024  # Linux's UIO_MAXIOV: buffers per recvmsg_into call


def set_kernel_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Blocking socket with kernel-side timeouts: MSG_WAITALL and sendall then work in one
    syscall, where Python's own timeouts would make the socket non-blocking and poll."""
    sock.settimeout(None)
    for opt, secs in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(secs),
                                                            int(secs % 1 * 1e6)))


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; NodeUnavailable if the peer goes away first."""
    plain = not isinstance(sock, ssl.SSLSocket)
    got, n = 0, len(view)
    while got < n:
        try:
            if plain:
                r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            else:
                r = sock.recv_into(view[got:], n - got)
        except OSError as exc:  # includes socket.timeout
            raise NodeUnavailable(f"bulk connection failed mid-stream: {exc}") from exc
        if r == 0:
            raise NodeUnavailable(f"bulk peer closed the connection after {got}/{n} bytes")
        got += r


def _recv_exact_into_many(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order, scattering with ``recvmsg_into`` (one syscall and one wake-up
    for a whole batch rather than one per block: at 64 KiB blocks those dominated)."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter read
        for view in views:
            _recv_exact_into(sock, view)
        return
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        try:
            got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        except OSError as exc:  # includes socket.timeout
            raise NodeUnavailable(f"bulk connection failed mid-stream: {exc}") from exc
        if got == 0:
            raise NodeUnavailable("bulk peer closed the connection mid-stream")
        # Skip the views filled whole; finish a partly filled one on its own, then go on.
        while got and i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            _recv_exact_into(sock, views[i][got:])
            i += 1


def _shifted(alloc: Callable[[int, int], memoryview], lo: int
             ) -> Callable[[int, int], memoryview]:
    """``alloc`` for the request that starts at key ``lo`` of the call."""
    return lambda i, nbytes: alloc(lo + i, nbytes)


def _send_all(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise NodeUnavailable(f"bulk connection failed mid-stream: {exc}") from exc


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


class BulkServer:
    """Serves leased blocks of one pool to remote readers, one thread per connection."""

    def __init__(self, pool: ServedPool, config: ServerConfig,
                 on_read: Callable[[list[bytes], str], None] | None = None) -> None:
        """``on_read(keys, reader_node_id)`` hears of every served batch (see StoreServer)."""
        self.pool = pool
        self.config = config
        self.on_read = on_read
        self._token = (config.auth_token or "").encode()
        self._ssl: ssl.SSLContext | None = None
        if config.tls_cert_file and config.tls_key_file:
            self._ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ssl.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        self._listener: socket.socket | None = None
        self._arena: ShmReader | None = None  # the pool's arena, mapped read-only to send from
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self) -> int:
        """Bind, start accepting, and return the port."""
        self._arena = ShmReader(self.pool.path)
        lst = socket.create_server((self.config.host, self.config.bulk_port), backlog=128)
        self._listener = lst
        threading.Thread(target=self._accept_loop, name="kvstore-bulk-accept",
                         daemon=True).start()
        return int(lst.getsockname()[1])

    def stop(self) -> None:
        """Close the listener and every open connection (their sends fail, leases released)."""
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._arena is not None:
            with contextlib.suppress(BufferError):  # a send still unwinding holds a view
                self._arena.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kvstore-bulk-conn",
                             daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        conn: socket.socket = raw
        with self._lock:
            self._conns.add(raw)
        try:
            set_kernel_timeouts(raw, IDLE_TIMEOUT_S, SEND_TIMEOUT_S)
            if self._ssl is not None:
                conn = self._ssl.wrap_socket(raw, server_side=True)
            while not self._stopped.is_set():
                try:
                    head = _recv_exact(conn, _REQ.size)
                except NodeUnavailable:
                    return  # the client closed its connection between requests
                if not self._serve_one(conn, head):
                    return
        except (OSError, ssl.SSLError, NodeUnavailable):
            return  # a vanished or broken client ends only its own connection
        finally:
            with self._lock:
                self._conns.discard(raw)
            with contextlib.suppress(OSError):
                conn.close()

    def _reply(self, conn: socket.socket, status: int, msg: str = "") -> None:
        body = msg.encode()
        conn.sendall(_RESP.pack(MAGIC, status, len(body)) + body)

    def _serve_one(self, conn: socket.socket, head: bytes) -> bool:
        """Answer one request; False when the connection must close."""
        magic, body_len = _REQ.unpack(head)
        if magic != MAGIC:
            self._reply(conn, STATUS_BAD_REQUEST, "not a kvstore bulk request")
            return False
        if body_len > MAX_REQUEST_BYTES:
            self._reply(conn, STATUS_TOO_LARGE, f"request of {body_len} bytes exceeds "
                        f"{MAX_REQUEST_BYTES}; split the keys over several requests")
            return False
        try:
            req = msgpack.unpackb(_recv_exact(conn, body_len))
            token, keys = req["t"], req["k"]
            reader = req.get("r", "")  # optional: older clients do not name their node
            if not isinstance(token, bytes) or not isinstance(keys, list) \
                    or not isinstance(reader, str):
                raise TypeError("t must be bytes, k a list and r a string")
        except Exception as exc:  # any parse failure is the client's fault, not ours
            self._reply(conn, STATUS_BAD_REQUEST, f"malformed bulk request: {exc}")
            return False
        if self._token and not hmac.compare_digest(token, self._token):
            self._reply(conn, STATUS_UNAUTHENTICATED, "missing or wrong auth token")
            return False
        if any(not isinstance(k, bytes) or len(k) != KEY_NBYTES for k in keys):
            self._reply(conn, STATUS_BAD_REQUEST, f"keys must be {KEY_NBYTES}-byte digests")
            return False
        try:
            lease = self.pool.lease(keys, LEASE_TTL_S)
        except KVStoreError as exc:
            self._reply(conn, STATUS_ERROR, f"{type(exc).__name__}: {exc}")
            return False
        try:
            arena = self._arena
            assert arena is not None, "start() maps the arena before any connection"
            where = {loc.key: loc for loc in lease.locations}
            # Reported before the bytes go out, so a reader that has its blocks can rely on the
            # read being counted (hot-prefix replication; tests that check it do not race).
            if self.on_read is not None and where:
                self.on_read([k for k in keys if k in where], reader)
            locs = [where.get(k) for k in keys]
            table = struct.pack(f"<I{len(keys)}Q", len(keys),
                                *(MISSING if loc is None else loc.nbytes for loc in locs))
            head = _RESP.pack(MAGIC, STATUS_OK, 0) + table
            if where and not isinstance(conn, ssl.SSLSocket):
                # MSG_MORE: the header leaves with the first payload bytes, not as a tiny
                # segment of its own that wakes the reader for nothing (TCP_NODELAY is on).
                conn.sendall(head, socket.MSG_MORE)
            else:
                conn.sendall(head)
            total = 0
            for offset, nbytes in _coalesce([loc for loc in locs if loc is not None]):
                conn.sendall(arena.view(offset, nbytes))
                total += nbytes
            metrics.record_served("bulk", len(where), total)
        finally:
            self.pool.release(lease.lease_id)
        return True


def _coalesce(locs: Sequence[Any]) -> list[tuple[int, int]]:
    """Merge blocks that lie back to back in the arena into one send."""
    ranges: list[tuple[int, int]] = []
    for loc in locs:
        if ranges and ranges[-1][0] + ranges[-1][1] == loc.offset:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + loc.nbytes)
        else:
            ranges.append((loc.offset, loc.nbytes))
    return ranges


class BulkClient:
    """Reads blocks from one node's bulk channel; idle connections are kept for reuse."""

    def __init__(self, address: str, *, auth_token: str | None = None,
                 tls_ca_file: str | None = None, timeout_s: float = 30.0,
                 server_hostname: str | None = None, reader_node_id: str = "",
                 request_blocks: int = 32, pipeline_depth: int = 4) -> None:
        host, _, port = address.rpartition(":")
        self.request_blocks, self.pipeline_depth = request_blocks, pipeline_depth
        self.host, self.port = host.strip("[]"), int(port)
        self.address = address
        self.timeout_s = timeout_s
        self.reader_node_id = reader_node_id
        self._token = (auth_token or "").encode()
        self._ssl: ssl.SSLContext | None = None
        self._server_hostname = server_hostname or self.host
        if tls_ca_file:
            self._ssl = ssl.create_default_context(cafile=tls_ca_file)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            raise NodeUnavailable(f"cannot reach bulk channel {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_kernel_timeouts(sock, self.timeout_s, self.timeout_s)
        if self._ssl is not None:
            try:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._server_hostname)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise NodeUnavailable(f"TLS handshake with {self.address} failed: {exc}") from exc
        return sock

    def fetch_into(self, keys: Sequence[bytes], alloc: Callable[[int, int], memoryview],
                   on_batch: Callable[[int, list[int | None]], None] | None = None
                   ) -> list[int | None]:
        """Fetch ``keys``; block ``i`` of ``n`` bytes goes into ``alloc(i, n)``.

        Many keys go out as requests of ``request_blocks``, up to ``pipeline_depth`` of them
        in flight on one connection, so the node never idles waiting for the next request.
        ``on_batch(first_index, sizes)`` runs as each request's blocks are in (e.g. to verify
        them while the node is already sending the next ones).
        Returns each block's size (None for a key the node does not hold). Raises
        NodeUnavailable if the node dies mid-stream: then no block of the call is valid.
        """
        if not keys:
            return []
        step = self.request_blocks
        spans = [(lo, min(lo + step, len(keys))) for lo in range(0, len(keys), step)]
        requests = [self._request(keys[lo:hi]) for lo, hi in spans]
        # Requests sent ahead sit unread in the node's socket buffer while it streams to us:
        # keep them small, or both sides could block on full buffers.
        ahead = self.pipeline_depth if sum(map(len, requests[:self.pipeline_depth])) \
            <= _MAX_AHEAD_BYTES else 1
        sent = 0
        for attempt in (0, 1):
            sock, reused = self._checkout()
            try:
                sent = min(ahead, len(requests))
                sock.sendall(b"".join(requests[:sent]))  # one segment, one wake-up of the node
                head = _recv_exact(sock, _RESP.size)
            except (OSError, NodeUnavailable) as exc:
                sock.close()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection: one fresh try
                raise NodeUnavailable(f"bulk request to {self.address} failed: {exc}") from exc
            break
        out: list[int | None] = []
        try:
            for j, (lo, hi) in enumerate(spans):
                if j:
                    if sent < len(requests):
                        _send_all(sock, requests[sent])
                        sent += 1
                    head = _recv_exact(sock, _RESP.size)
                sizes = self._read_body(sock, head, keys[lo:hi], _shifted(alloc, lo))
                out += sizes
                if on_batch is not None:
                    on_batch(lo, sizes)
        except BaseException:
            sock.close()  # the stream is out of step: never reuse it
            raise
        self._checkin(sock)
        return out

    def _request(self, keys: Sequence[bytes]) -> bytes:
        body = msgpack.packb({"t": self._token, "k": list(keys), "r": self.reader_node_id})
        if len(body) > MAX_REQUEST_BYTES:
            raise RequestTooLarge(f"{len(keys)} keys exceed one bulk request; split them")
        return _REQ.pack(MAGIC, len(body)) + body

    def _read_body(self, sock: socket.socket, head: bytes, keys: Sequence[bytes],
                   alloc: Callable[[int, int], memoryview]) -> list[int | None]:
        magic, status, msg_len = _RESP.unpack(head)
        if magic != MAGIC:
            raise NodeUnavailable(f"{self.address} does not speak the kvstore bulk protocol")
        msg = _recv_exact(sock, msg_len).decode(errors="replace") if msg_len else ""
        if status == STATUS_UNAUTHENTICATED:
            raise Unauthenticated(f"bulk channel {self.address}: {msg}")
        if status == STATUS_TOO_LARGE:
            raise RequestTooLarge(f"bulk channel {self.address}: {msg}")
        if status != STATUS_OK:
            raise NodeUnavailable(f"bulk channel {self.address} refused the request: {msg}")
        (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
        if n != len(keys):
            raise NodeUnavailable(f"bulk channel answered {n} blocks for {len(keys)} keys")
        sizes = list(struct.unpack(f"<{n}Q", _recv_exact(sock, 8 * n)))
        out: list[int | None] = []
        views: list[memoryview] = []
        for i, nbytes in enumerate(sizes):
            if nbytes == MISSING:
                out.append(None)
                continue
            dst = alloc(i, nbytes)
            if len(dst) < nbytes:
                raise ValueError(f"buffer {i} has {len(dst)} bytes, block needs {nbytes}")
            views.append(dst[:nbytes])
            out.append(nbytes)
        _recv_exact_into_many(sock, views)
        return out

    def _checkout(self) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def close(self) -> None:
        """Close idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

