"""The bulk channel's client: reads blocks from one node's bulk channel into the caller's
buffers (why the channel exists, and what the server checks: ``kvstore.node.bulk_server``).

Every request carries the client's credential (``client.auth_token``: the cluster token, or a
tenant credential) and, for a tenant's read, the namespace it reads: the node serves only that
namespace's blocks, and only to a credential granting its tenant.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import NodeUnavailable
from kvstore.keys import Namespace
from kvstore.node.bulk_frames import (
    COUNT,
    MAGIC,
    MAX_REQUEST_BYTES,
    MISSING,
    RESP_HEAD,
    STATUS_ERROR,
    STATUS_OK,
    encode_call,
    encode_request,
    raise_for_status,
    recv_exact,
    recv_exact_into_many,
    send_all,
    set_kernel_timeouts,
)
from kvstore.node.proto_forms import spec_from_namespace

log = logging.getLogger(__name__)

_MAX_AHEAD_BYTES = 64 << 10  # requests in flight must fit the peer's socket buffer


def _shifted(alloc: Callable[[int, int], memoryview], lo: int
             ) -> Callable[[int, int], memoryview]:
    """``alloc`` for the request that starts at key ``lo`` of the call."""
    return lambda i, nbytes: alloc(lo + i, nbytes)


def _split(num: int, parts: int) -> list[tuple[int, int]]:
    """``[0, num)`` as ``parts`` contiguous ranges of near-equal length."""
    bounds = [num * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]


class BulkClient:
    """Reads blocks from one node's bulk channel; idle connections are kept for reuse."""

    def __init__(self, address: str, *, auth_token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, tls_ca_file: str | None = None,
                 timeout_s: float = 30.0, server_hostname: str | None = None,
                 reader_node_id: str = "", request_blocks: int = 32,
                 pipeline_depth: int = 4, streams: int = 1) -> None:
        """TLS: ``ssl_context`` (``kvstore.security.tls.client_ssl_context`` of the client's
        config: the CA as a file or PEM text), or a CA file; neither means plaintext."""
        host, _, port = address.rpartition(":")
        self.request_blocks, self.pipeline_depth = request_blocks, pipeline_depth
        self.streams = max(1, streams)
        self.host, self.port = host.strip("[]"), int(port)
        self.address = address
        self.timeout_s = timeout_s
        self.reader_node_id = reader_node_id
        token = auth_token or ""
        self._credential = (token[len("Bearer "):] if token.startswith("Bearer ")
                            else token).encode()
        self._ssl = ssl_context
        if self._ssl is None and tls_ca_file:
            self._ssl = ssl.create_default_context(cafile=tls_ca_file)
            self._ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        self._server_hostname = server_hostname or self.host
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            raise NodeUnavailable(f"cannot reach bulk channel {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is None:
            set_kernel_timeouts(sock, self.timeout_s, self.timeout_s)
        else:  # keeps create_connection's Python timeout: ssl retries a kernel one forever
            try:
                sock = self._ssl.wrap_socket(sock, server_hostname=self._server_hostname)
            except (OSError, ssl.SSLError) as exc:
                sock.close()
                raise NodeUnavailable(f"TLS handshake with {self.address} failed: {exc}") from exc
        return sock

    def fetch_into(self, keys: Sequence[bytes], alloc: Callable[[int, int], memoryview],
                   on_batch: Callable[[int, list[int | None]], None] | None = None, *,
                   namespace: Namespace | None = None) -> list[int | None]:
        """Fetch ``keys``; block ``i`` of ``n`` bytes goes into ``alloc(i, n)``.

        ``namespace``: the namespace the blocks are read in; the node serves only blocks of
        it (others come back as absent) and only if the credential grants its tenant
        (PermissionDenied otherwise). Only the cluster token may leave it out (replication).
        Many keys go out as requests of ``request_blocks``, up to ``pipeline_depth`` of them
        in flight on one connection, so the node never idles waiting for the next request;
        a read of more than one request's blocks is split over up to ``streams``
        connections, each a contiguous share of the requests on a thread of its own (one TCP
        stream, and one sending thread on the node, cap a read well below what the bytes
        allow). ``on_batch(first_index, sizes)`` runs as each request's blocks are in (e.g.
        to verify them while the node is already sending the next ones), from the thread of
        the connection that read them: several may run at once, on disjoint indices.
        Returns each block's size (None for a key the node does not hold). Raises
        NodeUnavailable if the node dies mid-stream: then no block of the call is valid.
        """
        if not keys:
            return []
        spec = None if namespace is None else spec_from_namespace(namespace).SerializeToString()
        step = self.request_blocks
        spans = [(lo, min(lo + step, len(keys))) for lo in range(0, len(keys), step)]
        requests = [encode_request(self._credential, keys[lo:hi], self.reader_node_id, spec)
                    for lo, hi in spans]
        shares = _split(len(spans), min(self.streams, len(spans)))
        if len(shares) == 1:
            return self._fetch_spans(spans, requests, keys, alloc, on_batch)
        results: list[list[int | None] | BaseException | None] = [None] * len(shares)

        def run(i: int, first: int, last: int) -> None:
            try:
                results[i] = self._fetch_spans(spans[first:last], requests[first:last], keys,
                                               alloc, on_batch)
            except BaseException as exc:  # re-raised on the caller's thread below
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i, first, last), daemon=True,
                                    name="kvstore-bulk-stream")
                   for i, (first, last) in enumerate(shares[1:], start=1)]
        for thread in threads:
            thread.start()
        run(0, *shares[0])
        for thread in threads:
            thread.join()
        out: list[int | None] = []
        for got in results:
            if isinstance(got, BaseException):
                raise got
            assert got is not None
            out += got
        return out

    def _fetch_spans(self, spans: list[tuple[int, int]], requests: list[bytes],
                     keys: Sequence[bytes], alloc: Callable[[int, int], memoryview],
                     on_batch: Callable[[int, list[int | None]], None] | None
                     ) -> list[int | None]:
        """The blocks of ``spans`` (key ranges, one request each) over one connection."""
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
                head = recv_exact(sock, RESP_HEAD.size)
            except (OSError, NodeUnavailable) as exc:
                sock.close()
                if reused and attempt == 0 and not timed_out(exc):
                    continue  # the server closed an idle connection: one fresh try
                raise NodeUnavailable(f"bulk request to {self.address} failed: {exc}") from exc
            break
        out: list[int | None] = []
        try:
            for j, (lo, hi) in enumerate(spans):
                if j:
                    if sent < len(requests):
                        send_all(sock, requests[sent])
                        sent += 1
                    head = recv_exact(sock, RESP_HEAD.size)
                sizes = self._read_body(sock, head, keys[lo:hi], _shifted(alloc, lo))
                out += sizes
                if on_batch is not None:
                    on_batch(lo, sizes)
        except BaseException:
            sock.close()  # the stream is out of step: never reuse it
            raise
        self._checkin(sock)
        return out

    def _read_body(self, sock: socket.socket, head: bytes, keys: Sequence[bytes],
                   alloc: Callable[[int, int], memoryview]) -> list[int | None]:
        magic, status, msg_len = RESP_HEAD.unpack(head)
        if magic != MAGIC:
            raise NodeUnavailable(f"{self.address} does not speak the kvstore bulk protocol "
                                  f"{MAGIC!r}")
        if msg_len > 64 << 10:
            raise NodeUnavailable(f"{self.address} sent a {msg_len}-byte status message")
        msg = recv_exact(sock, msg_len).decode(errors="replace") if msg_len else ""
        raise_for_status(status, msg, self.address)
        (n,) = COUNT.unpack(recv_exact(sock, COUNT.size))
        if n != len(keys):
            raise NodeUnavailable(f"bulk channel answered {n} blocks for {len(keys)} keys")
        sizes = list(struct.unpack(f"<{n}Q", recv_exact(sock, 8 * n)))
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
        recv_exact_into_many(sock, views)
        return out

    def call(self, method: str, payload: bytes) -> bytes:
        """The node's serialized answer to ``method`` (one of ``bulk_frames.CALLS``) with a
        serialized request, sent as a call frame. A refusal raises as ``raise_for_status``
        says (the node's own refusal of the request: NodeUnavailable with its message); the
        caller may then ask gRPC, which answers with the typed error."""
        frame = encode_call(self._credential, method, payload)
        while True:
            sock, reused = self._checkout()
            try:
                sock.sendall(frame)
                magic, status, msg_len = RESP_HEAD.unpack(recv_exact(sock, RESP_HEAD.size))
            except (OSError, NodeUnavailable) as exc:
                sock.close()
                if reused and not timed_out(exc):  # closed while idle: once more on another
                    continue
                raise
            except BaseException:
                sock.close()
                raise
            break
        try:
            if magic != MAGIC:
                raise NodeUnavailable(f"{self.address} does not speak the kvstore bulk "
                                      f"protocol {MAGIC!r}")
            if msg_len > 4 * MAX_REQUEST_BYTES:
                raise NodeUnavailable(f"{self.address} sent a {msg_len}-byte answer")
            answer = recv_exact(sock, msg_len) if msg_len else b""
        except BaseException:
            sock.close()
            raise
        if status in (STATUS_OK, STATUS_ERROR):  # the node keeps the connection open
            self._checkin(sock)
        else:  # a refusal: the node closes it
            sock.close()
        raise_for_status(status, answer.decode(errors="replace"), self.address)
        return answer

    def try_call(self, method: str, request: Any, response_type: Any) -> Any:
        """``call`` with protobuf messages; None when it failed for any reason: the caller
        then asks gRPC, which judges again and answers with the typed error."""
        try:
            return response_type.FromString(self.call(method, request.SerializeToString()))
        except Exception as exc:  # noqa: BLE001 - whatever it was, gRPC asks again
            log.debug("%s over the bulk channel %s failed, asking gRPC: %s", method,
                      self.address, exc)
            return None

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


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or the socket error it wraps) is a send or receive that ran out of
    time. A node that closed an idle connection fails the next request at once, and a fresh
    connection fixes that; a silent one (a host cut off) would only make the fresh
    connection wait out the same timeout again."""
    cause = exc.__cause__ if isinstance(exc, NodeUnavailable) and exc.__cause__ else exc
    return isinstance(cause, TimeoutError) or (
        isinstance(cause, OSError) and cause.errno in (errno.EAGAIN, errno.EWOULDBLOCK))
