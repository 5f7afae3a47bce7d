"""The bulk channel's wire format and socket helpers, shared by its server and its client.

Protocol (all integers little-endian; connections are reused, requests on one are answered
in order, and a client may send the next before the last answer has arrived)::

    request : "KVB2" | u16 cred_len | u32 body_len | credential | msgpack body
              body = {"k": [key, ...], "r": reader node id, "n": NamespaceSpec bytes (optional)}
    response: "KVB2" | u8 status | u32 msg_len | msg (utf-8)
              then, if status == OK: u32 n | n x u64 nbytes (MISSING if absent) | payloads

    call    : "KVC1" | u16 cred_len | u32 body_len | credential | msgpack body
              body = {"c": a StoreNode method (Lease, Exists), "p": its serialized request}
    answer  : "KVB2" | u8 status | u32 msg_len | msg: the serialized response if status == OK,
              else the error (utf-8); nothing follows

Calls are the gRPC methods a same-node reader makes on every warm read, judged by the same
code on the node (``StoreServer``'s ``lease_for``, ``exists_for``): a Python gRPC unary costs
about a millisecond on a busy host, a request on an open socket a small part of that. They
have a magic of their own, so a node without them refuses one as a bad request (and closes
the connection) instead of reading it as a fetch.

The credential comes before the body and is capped (``MAX_CREDENTIAL_BYTES``), so a server
reads at most the fixed head and that many bytes from a peer it has not authenticated; the
declared body length is checked against ``MAX_REQUEST_BYTES`` before anything else is read.
A frame with any other magic gets a BAD_REQUEST answer and the connection closes: store nodes
and their clients are one package, upgraded together, so there is no version negotiation.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from kvstore.constants import KEY_NBYTES
from kvstore.errors import (
    InvalidRequest,
    NodeUnavailable,
    PermissionDenied,
    RequestTooLarge,
    Unauthenticated,
)

MAGIC = b"KVB2"
CALL_MAGIC = b"KVC1"
#: The StoreNode methods a call frame may name.
CALLS = ("Lease", "Exists")
MISSING = (1 << 64) - 1
(STATUS_OK, STATUS_UNAUTHENTICATED, STATUS_BAD_REQUEST, STATUS_TOO_LARGE, STATUS_ERROR,
 STATUS_FORBIDDEN, STATUS_BUSY) = range(7)
MAX_CREDENTIAL_BYTES = 4096  # a cluster token is 43 bytes, a tenant credential a few hundred
# ~7,000 keys: above the largest request a client makes (client.bulk_request_blocks <= 4096
# keys, 140 KiB), and small enough that every allowed connection at once buffers < 64 MiB.
MAX_REQUEST_BYTES = 256 << 10
SEND_TIMEOUT_S = 30.0  # a client that stops reading for this long loses its connection
IDLE_TIMEOUT_S = 300.0  # an authenticated connection idle between requests this long is closed
LEASE_TTL_S = 120.0  # outlives SEND_TIMEOUT_S; released explicitly once the send ends

REQ_HEAD = struct.Struct("<4sHI")
RESP_HEAD = struct.Struct("<4sBI")
COUNT = struct.Struct("<I")
_IOV_MAX = 1024  # Linux's UIO_MAXIOV: buffers per recvmsg_into call


class HeaderTimeout(NodeUnavailable):
    """A peer did not send a whole request frame before the server's header deadline."""


@dataclass(frozen=True, slots=True)
class BulkRequest:
    """One decoded request body."""

    keys: list[bytes]
    reader: str
    namespace: bytes | None  # a serialized NamespaceSpec; None only for admin credentials


def encode_request(credential: bytes, keys: Sequence[bytes], reader: str,
                   namespace: bytes | None) -> bytes:
    """One request frame; RequestTooLarge if the keys do not fit one request."""
    if len(credential) > MAX_CREDENTIAL_BYTES:
        raise Unauthenticated(f"the credential is {len(credential)} bytes; at most "
                              f"{MAX_CREDENTIAL_BYTES} are accepted (is client.auth_token a "
                              "kvstore credential?)")
    fields: dict[str, object] = {"k": list(keys), "r": reader}
    if namespace is not None:
        fields["n"] = namespace
    body = msgpack.packb(fields)
    if len(body) > MAX_REQUEST_BYTES:
        raise RequestTooLarge(f"{len(keys)} keys exceed one bulk request; split them")
    return REQ_HEAD.pack(MAGIC, len(credential), len(body)) + credential + body


@dataclass(frozen=True, slots=True)
class CallRequest:
    """One decoded call body: a StoreNode method and its serialized request."""

    method: str
    payload: bytes


def encode_call(credential: bytes, method: str, payload: bytes) -> bytes:
    """A call frame for ``method`` (one of ``CALLS``) with its serialized request."""
    body = msgpack.packb({"c": method, "p": payload})
    if len(body) > MAX_REQUEST_BYTES:
        raise RequestTooLarge(f"the {method} request exceeds one bulk frame; split its keys")
    return REQ_HEAD.pack(CALL_MAGIC, len(credential), len(body)) + credential + body


def _msgpack_map(raw: bytes, what: str) -> dict:
    """A frame body as a msgpack map (bounded), or InvalidRequest naming ``what``."""
    try:
        fields = msgpack.unpackb(raw, max_bin_len=MAX_REQUEST_BYTES,
                                 max_str_len=MAX_REQUEST_BYTES)
    except Exception as exc:  # any parse failure is the client's fault, not ours
        raise InvalidRequest(f"malformed {what}: {type(exc).__name__}: {exc}") from None
    if not isinstance(fields, dict):
        raise InvalidRequest(f"malformed {what}: the body must be a msgpack map")
    return fields


def decode_call(raw: bytes) -> CallRequest:
    """The call a body carries; InvalidRequest (naming the field) on anything else."""
    fields = _msgpack_map(raw, "bulk call")
    method, payload = fields.get("c"), fields.get("p")
    if method not in CALLS or not isinstance(payload, bytes):
        raise InvalidRequest(f"malformed bulk call: c must be one of {CALLS} and p bytes")
    return CallRequest(method, payload)


def decode_body(raw: bytes) -> BulkRequest:
    """The request a body carries; InvalidRequest (naming the field) on anything else."""
    fields = _msgpack_map(raw, "bulk request")
    keys, reader, namespace = fields.get("k"), fields.get("r", ""), fields.get("n")
    if not isinstance(keys, list) or not isinstance(reader, str):
        raise InvalidRequest("malformed bulk request: k must be a list and r a string")
    if namespace is not None and not isinstance(namespace, bytes):
        raise InvalidRequest("malformed bulk request: n must be a serialized NamespaceSpec")
    if any(not isinstance(k, bytes) or len(k) != KEY_NBYTES for k in keys):
        raise InvalidRequest(f"keys must be {KEY_NBYTES}-byte digests")
    return BulkRequest(keys, reader, namespace)


def status_frame(status: int, msg: str = "") -> bytes:
    body = msg.encode()
    return RESP_HEAD.pack(MAGIC, status, len(body)) + body


def raise_for_status(status: int, msg: str, address: str) -> None:
    """The typed error a refusal stands for (nothing for STATUS_OK)."""
    if status == STATUS_OK:
        return
    where = f"bulk channel {address}: {msg}"
    if status == STATUS_UNAUTHENTICATED:
        raise Unauthenticated(where)
    if status == STATUS_FORBIDDEN:
        raise PermissionDenied(where)
    if status == STATUS_TOO_LARGE:
        raise RequestTooLarge(where)
    if status == STATUS_BAD_REQUEST:
        raise InvalidRequest(where)
    raise NodeUnavailable(f"bulk channel {address} refused the request: {msg}")


# -- sockets ------------------------------------------------------------------------------------
def _timeval(secs: float) -> bytes:
    secs = max(secs, 0.001)  # 0 would mean "no timeout"
    return struct.pack("ll", int(secs), int(secs % 1 * 1e6))


def set_kernel_timeouts(sock: socket.socket, recv_s: float, send_s: float) -> None:
    """Blocking socket with kernel-side timeouts: MSG_WAITALL and sendall then work in one
    syscall, where Python's own timeouts would make the socket non-blocking and poll. Plain
    sockets only: a TLS socket would retry the timeout forever (``set_recv_timeout``)."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_s))


def set_recv_timeout(sock: socket.socket, recv_s: float) -> None:
    """Bound the next reads. A TLS socket takes Python's timeout instead (which bounds its
    sends too): ``ssl`` retries a blocking socket's kernel timeout (EAGAIN) forever."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(recv_s)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(recv_s))


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
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


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them before ``deadline`` (monotonic), else HeaderTimeout: a peer
    that trickles a byte at a time cannot stretch one frame past the deadline."""
    buf = bytearray(n)
    view = memoryview(buf)
    plain = not isinstance(sock, ssl.SSLSocket)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HeaderTimeout(f"no whole request within the header deadline ({got}/{n} bytes)")
        set_recv_timeout(sock, left)
        try:
            r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL if plain else 0)
        except (BlockingIOError, TimeoutError, ssl.SSLWantReadError) as exc:
            raise HeaderTimeout(f"no whole request within the header deadline: {exc}") from exc
        except OSError as exc:
            raise NodeUnavailable(f"bulk connection failed mid-request: {exc}") from exc
        if r == 0:
            raise NodeUnavailable(f"bulk peer closed the connection after {got}/{n} bytes")
        got += r
    return bytes(buf)


def recv_exact_into_many(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view in order, scattering with ``recvmsg_into``: one syscall and one wake-up
    for a whole batch rather than one per block, which would cost small blocks more than their
    bytes."""
    if isinstance(sock, ssl.SSLSocket):  # TLS has no scatter read
        for view in views:
            recv_exact_into(sock, view)
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
            recv_exact_into(sock, views[i][got:])
            i += 1


def send_all(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise NodeUnavailable(f"bulk connection failed mid-stream: {exc}") from exc
