"""The bulk byte channel: remote block reads over plain TCP, straight from the arena.

Why not gRPC for the bytes: Python gRPC copies every payload at least three times (arena ->
``bytes`` for protobuf -> HTTP/2 frames -> the caller's ``bytes``) and pays a per-message cost
in Python, so gRPC stays for control and puts and payloads move on this channel. The server
sends each run of adjacent leased blocks with one ``sendall`` from the pool's read-only view of
the arena (``leased_bytes``), and the reader scatters a whole reply into the buffers it
preallocated with one ``recvmsg_into``: the kernel's two copies only. It sends from memory
rather than with ``sendfile`` from the arena file, whose page-by-page splice costs the sender
more CPU than the copy it saves. A many-block read is pipelined: the client sends requests of
a bounded number of blocks, several in flight on one connection. The frame format is
``kvstore.node.bulk_frames``; the client is ``kvstore.client.bulk_client``.

What a hostile peer cannot do (docs/security.md):

- read without a credential: each request's credential (at most 4 KiB) is checked before its
  body is read; a wrong one is answered UNAUTHENTICATED and the connection closed;
- read another tenant's blocks: a request names the reader's namespace, the credential must
  grant its tenant (cache salt), and only blocks whose stored namespace root equals that
  namespace's root (keyed with the cluster's data secret) are served; others read as absent.
  Only the cluster token (admin: replication) may omit the namespace;
- hold the node's threads or memory: connections are capped in total and per peer address
  (beyond the caps a connection is closed at once; one thread per admitted connection only),
  a connection must deliver its first whole frame within ``server.bulk_header_timeout_s`` and
  every later frame within that deadline once it starts, and a request body is capped;
- multiply replication orders: the reader node a request names is believed only from the
  cluster token (cluster components); a tenant's reads count as from an unknown node.

The server leases the blocks for the duration of the send (eviction cannot reuse the bytes
under the socket) and serves each connection on its own thread with a send timeout, so a
stalled or vanished client only ends its own connection.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore import metrics
from kvstore.block import read_header
from kvstore.config import ServerConfig
from kvstore.errors import (
    BlockCorrupted,
    KVStoreError,
    NodeUnavailable,
    PermissionDenied,
    Unauthenticated,
)
from kvstore.node.block_pool import ServedPool
from kvstore.node.bulk_frames import (
    CALL_MAGIC,
    IDLE_TIMEOUT_S,
    LEASE_TTL_S,
    MAGIC,
    MAX_CREDENTIAL_BYTES,
    MAX_REQUEST_BYTES,
    MISSING,
    REQ_HEAD,
    RESP_HEAD,
    SEND_TIMEOUT_S,
    STATUS_BAD_REQUEST,
    STATUS_BUSY,
    STATUS_ERROR,
    STATUS_FORBIDDEN,
    STATUS_OK,
    STATUS_TOO_LARGE,
    STATUS_UNAUTHENTICATED,
    CallRequest,
    HeaderTimeout,
    decode_body,
    decode_call,
    recv_by,
    recv_exact,
    set_kernel_timeouts,
    set_recv_timeout,
    status_frame,
)
from kvstore.node.proto_forms import namespace_from_spec
from kvstore.protos import kvstore_pb2 as pb
from kvstore.security.grants import Authenticator, Grant
from kvstore.security.tls import server_ssl_context

__all__ = ["MAGIC", "MISSING", "BulkServer"]

log = logging.getLogger(__name__)
_ACCEPT_RETRY = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                 errno.EPROTO, errno.EPERM)
_MAX_NAMESPACES = 1024  # namespaces whose root the server remembers (a dict; cleared when full)


class _Refused(Exception):
    """A request answered with an error status; the connection closes."""

    def __init__(self, status: int, reason: str, msg: str) -> None:
        super().__init__(msg)
        self.status, self.reason = status, reason


class BulkServer:
    """Serves leased blocks of one pool to remote readers, one thread per admitted connection."""

    def __init__(self, pool: ServedPool, config: ServerConfig,
                 on_read: Callable[[list[bytes], str], None] | None = None, *,
                 data_key: bytes | None = None,
                 root_of: Callable[[bytes], bytes | None] | None = None) -> None:
        """``on_read(keys, reader_node_id)`` hears of every served batch (see StoreServer).
        ``data_key``: the cluster's data secret, to compute a reader's namespace root as the
        writers did. ``root_of(key)``: the namespace root of a held block if the caller
        remembers it (StoreServer's metadata cache), else None and the header is read."""
        self.pool = pool
        self.config = config
        self.on_read = on_read
        self.data_key = data_key
        self.root_of = root_of
        #: method -> ``answer(grant, request bytes) -> response bytes``: the node's gRPC
        #: methods that call frames may name (StoreServer sets them); each raises the error
        #: gRPC would answer with. A method missing here is refused as a bad request.
        self.calls: dict[str, Callable[[Grant, bytes], bytes]] = {}
        self._auth = Authenticator([config.auth_token, config.previous_auth_token])
        self._ssl: ssl.SSLContext | None = server_ssl_context(config)
        self._listener: socket.socket | None = None
        self._conns: dict[socket.socket, str] = {}  # admitted connection -> peer address
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._roots: dict[bytes, tuple[str, bytes]] = {}  # spec bytes -> (cache salt, root)
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    # -- credentials --------------------------------------------------------------------
    def set_authenticator(self, auth: Authenticator) -> None:
        """Swap the credentials checked from the next request on (rotation: open connections
        present their credential with every request, so none keeps a revoked one)."""
        self._auth = auth

    def set_tokens(self, auth_token: str | None, previous_auth_token: str | None = None) -> None:
        self.set_authenticator(Authenticator([auth_token, previous_auth_token]))

    @property
    def num_connections(self) -> int:
        """Connections admitted and open now (each has one thread)."""
        with self._lock:
            return len(self._conns)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> int:
        """Bind, start accepting, and return the port."""
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

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError as exc:
                if self._stopped.is_set() or exc.errno not in _ACCEPT_RETRY:
                    return
                # Out of descriptors or memory: a flood must not end the channel for good.
                time.sleep(0.05)
                continue
            peer = str(addr[0])
            reason = self._admit(conn, peer)
            if reason is None:
                try:
                    threading.Thread(target=self._serve, args=(conn, peer),
                                     name="kvstore-bulk-conn", daemon=True).start()
                    continue
                except RuntimeError:  # no thread to be had: refuse like a full house
                    self._release_slot(conn)
                    reason = "threads"
            self._refuse_connection(conn, reason)

    def _admit(self, conn: socket.socket, peer: str) -> str | None:
        """Take a connection slot, or say which cap is reached."""
        with self._lock:
            if len(self._conns) >= self.config.max_bulk_connections:
                return "connections"
            if self._per_peer[peer] >= self.config.max_bulk_connections_per_peer:
                return "peer_connections"
            self._conns[conn] = peer
            self._per_peer[peer] += 1
        return None

    def _release_slot(self, conn: socket.socket) -> None:
        with self._lock:
            peer = self._conns.pop(conn, None)
            if peer is not None:
                self._per_peer[peer] -= 1
                if self._per_peer[peer] <= 0:
                    del self._per_peer[peer]

    def _refuse_connection(self, conn: socket.socket, reason: str) -> None:
        """Close at once; a plaintext peer first gets a BUSY answer if its buffer takes it."""
        metrics.record_bulk_refused(reason)
        if self._ssl is None:
            with contextlib.suppress(OSError):
                conn.send(status_frame(STATUS_BUSY, f"the node has too many bulk connections "
                                       f"({reason.replace('_', ' ')}); retry later"),
                          socket.MSG_DONTWAIT)
        with contextlib.suppress(OSError):
            conn.close()

    # -- one connection -------------------------------------------------------------------
    def _serve(self, raw: socket.socket, peer: str) -> None:
        conn: socket.socket = raw
        header_s = self.config.bulk_header_timeout_s
        deadline = time.monotonic() + header_s  # the handshake and first frame, all of it
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                # Python's timeout (see set_recv_timeout): ssl counts it as one deadline for
                # the whole handshake, so a hello trickled a byte at a time does not outlive it.
                raw.settimeout(header_s)
                conn = self._ssl.wrap_socket(raw, server_side=True)
            else:
                set_kernel_timeouts(raw, header_s, SEND_TIMEOUT_S)
            first = True
            while not self._stopped.is_set():
                if first:
                    head = recv_by(conn, REQ_HEAD.size, deadline)
                else:
                    set_recv_timeout(conn, IDLE_TIMEOUT_S)
                    try:
                        head = recv_exact(conn, REQ_HEAD.size)
                    except NodeUnavailable:
                        return  # the client closed (or idled out) between requests
                    deadline = time.monotonic() + header_s
                first = False
                try:
                    self._serve_one(conn, head, deadline)
                except _Refused as exc:
                    metrics.record_bulk_refused(exc.reason)
                    with contextlib.suppress(OSError):
                        conn.sendall(status_frame(exc.status, str(exc)))
                    return
        except HeaderTimeout:
            metrics.record_bulk_refused("header_timeout")
        except (OSError, ssl.SSLError, NodeUnavailable):
            return  # a vanished or broken client ends only its own connection
        except Exception:  # a bug here must end one connection, never the channel, silently
            log.exception("bulk connection from %s failed", peer)
        finally:
            self._release_slot(raw)
            with contextlib.suppress(OSError):
                conn.close()

    def _read_request(self, conn: socket.socket, head: bytes, deadline: float
                      ) -> tuple[Grant, Any]:
        """Check the head, then the credential, and only then read the body (a fetch's or,
        under ``CALL_MAGIC``, a call's)."""
        magic, cred_len, body_len = REQ_HEAD.unpack(head)
        if magic not in (MAGIC, CALL_MAGIC):
            raise _Refused(STATUS_BAD_REQUEST, "bad_request",
                           f"not a kvstore bulk request (expected {MAGIC!r} frames: is the "
                           "client older than the node?)")
        if cred_len > MAX_CREDENTIAL_BYTES:
            raise _Refused(STATUS_UNAUTHENTICATED, "unauthenticated",
                           f"credential of {cred_len} bytes exceeds {MAX_CREDENTIAL_BYTES}")
        if body_len > MAX_REQUEST_BYTES:
            raise _Refused(STATUS_TOO_LARGE, "too_large",
                           f"request of {body_len} bytes exceeds {MAX_REQUEST_BYTES}; split "
                           "the keys over several requests")
        credential = recv_by(conn, cred_len, deadline)
        try:
            grant = self._auth.authenticate(credential)
        except Unauthenticated as exc:
            raise _Refused(STATUS_UNAUTHENTICATED, "unauthenticated", str(exc)) from None
        try:
            body = recv_by(conn, body_len, deadline)
            req = decode_call(body) if magic == CALL_MAGIC else decode_body(body)
        except ValueError as exc:
            raise _Refused(STATUS_BAD_REQUEST, "bad_request", str(exc)) from None
        return grant, req

    def _reader_root(self, grant: Grant, spec: bytes | None) -> bytes | None:
        """The namespace root the reader may see (None: an admin's unfiltered read)."""
        if spec is None:
            if not grant.admin:
                raise _Refused(STATUS_FORBIDDEN, "forbidden",
                               f"credential {grant.subject!r} must name the namespace it reads "
                               "(only the cluster token may read without one)")
            return None
        known = self._roots.get(spec)
        if known is None:
            try:
                ns = namespace_from_spec(pb.NamespaceSpec.FromString(spec), self.data_key)
            except Exception as exc:  # DecodeError, ConfigError: the client's fault
                raise _Refused(STATUS_BAD_REQUEST, "bad_request",
                               f"the request's namespace is not valid: {exc}") from None
            known = (ns.cache_salt, ns.root)
            if len(self._roots) >= _MAX_NAMESPACES:
                self._roots.clear()
            self._roots[spec] = known
        try:
            grant.check_read(known[0])
        except PermissionDenied as exc:
            raise _Refused(STATUS_FORBIDDEN, "forbidden", str(exc)) from None
        return known[1]

    def _stored_root(self, loc: Any) -> bytes | None:
        if self.root_of is not None:
            root = self.root_of(loc.key)
            if root is not None:
                return root
        view = self.pool.leased_bytes(loc.offset, loc.nbytes)
        try:
            return read_header(view).namespace_root
        except BlockCorrupted:
            return None
        finally:
            with contextlib.suppress(BufferError):
                view.release()

    def _serve_one(self, conn: socket.socket, head: bytes, deadline: float) -> None:
        """Answer one request (raises _Refused to answer with an error and close)."""
        grant, req = self._read_request(conn, head, deadline)
        if isinstance(req, CallRequest):
            self._serve_call(conn, grant, req)
            return
        want_root = self._reader_root(grant, req.namespace)
        keys = req.keys
        reader = req.reader if grant.admin else ""  # see the module docstring
        try:
            lease = self.pool.lease(keys, LEASE_TTL_S)
        except KVStoreError as exc:
            raise _Refused(STATUS_ERROR, "error", f"{type(exc).__name__}: {exc}") from None
        try:
            where = {loc.key: loc for loc in lease.locations}
            if want_root is not None:  # another tenant's (or namespace's) block: absent
                where = {k: loc for k, loc in where.items()
                         if self._stored_root(loc) == want_root}
            # Reported before the bytes go out, so a reader that has its blocks can rely on the
            # read being counted (hot-prefix replication; tests that check it do not race).
            if self.on_read is not None and where:
                self.on_read([k for k in keys if k in where], reader)
            locs = [where.get(k) for k in keys]
            if isinstance(conn, ssl.SSLSocket):
                conn.settimeout(SEND_TIMEOUT_S)  # it bounded the request's reads until now
            table = struct.pack(f"<I{len(keys)}Q", len(keys),
                                *(MISSING if loc is None else loc.nbytes for loc in locs))
            out = RESP_HEAD.pack(MAGIC, STATUS_OK, 0) + table
            if where and not isinstance(conn, ssl.SSLSocket):
                # MSG_MORE: the header leaves with the first payload bytes, not as a tiny
                # segment of its own that wakes the reader for nothing (TCP_NODELAY is on).
                conn.sendall(out, socket.MSG_MORE)
            else:
                conn.sendall(out)
            total = 0
            for offset, nbytes in _coalesce([loc for loc in locs if loc is not None]):
                view = self.pool.leased_bytes(offset, nbytes)
                try:
                    conn.sendall(view)
                finally:
                    with contextlib.suppress(BufferError):
                        view.release()
                total += nbytes
            metrics.record_served("bulk", len(where), total)
        finally:
            self.pool.release(lease.lease_id)


    def _serve_call(self, conn: socket.socket, grant: Grant, call: CallRequest) -> None:
        """Answer a call frame. The node's refusal (a bad key, a namespace not granted, too
        many leases) is an error answer on a connection that stays open: the reader asks
        gRPC then, which answers with the typed error."""
        answer = self.calls.get(call.method)
        if answer is None:
            raise _Refused(STATUS_BAD_REQUEST, "bad_request",
                           f"this node answers no {call.method} calls on its bulk channel")
        try:
            response = answer(grant, call.payload)
        except (KVStoreError, ValueError) as exc:
            conn.sendall(status_frame(STATUS_ERROR, f"{type(exc).__name__}: {exc}"))
            return
        conn.sendall(RESP_HEAD.pack(MAGIC, STATUS_OK, len(response)) + response)


def _coalesce(locs: Sequence[Any]) -> list[tuple[int, int]]:
    """Merge blocks that lie back to back in the arena into one send."""
    ranges: list[tuple[int, int]] = []
    for loc in locs:
        if ranges and ranges[-1][0] + ranges[-1][1] == loc.offset:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + loc.nbytes)
        else:
            ranges.append((loc.offset, loc.nbytes))
    return ranges
