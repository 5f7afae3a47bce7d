"""The bulk-channel attacks of tests/multihost/attacker.py (raw sockets, KVB2 frames written
from kvstore/node/bulk_frames.py's wire format, not with the product's client): reads with bad
credentials and the pre-authentication connection flood. Run through ``attacker``'s
``FUNCTIONS`` like every other attack."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any

import msgpack

from kvstore.protos import kvstore_pb2 as pb

#: Every call's deadline, the gRPC attacks' too (attacker.py takes it from here).
CALL_TIMEOUT_S = 10.0
BULK_MAGIC = b"KVB2"
BULK_MISSING = (1 << 64) - 1
#: The bulk channel's caps (kvstore/node/bulk_frames.py MAX_CREDENTIAL_BYTES and
#: MAX_REQUEST_BYTES, 256 KiB): a flood declares the largest credential and a body one byte
#: under the cap, so its head passes the node's size checks and only the credential stops it.
BULK_MAX_CREDENTIAL = 4096
BULK_MAX_BODY = 256 << 10

# --- the bulk channel -------------------------------------------------------------------------

def bulk_socket(target: str, ca_pem: str | None, timeout: float = 5.0) -> socket.socket:
    host, _, port = target.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    if ca_pem:
        ctx = ssl.create_default_context(cadata=ca_pem)
        sock = ctx.wrap_socket(sock, server_hostname=host)
    return sock


def bulk_frame(token: bytes, keys: list[str], namespace: dict | None, reader: str = "") -> bytes:
    """A request frame: "KVB2" | u16 credential length | u32 body length | credential | body."""
    body: dict[str, Any] = {"k": [bytes.fromhex(k) for k in keys], "r": reader}
    if namespace is not None:
        body["n"] = pb.NamespaceSpec(**namespace).SerializeToString()
    raw = msgpack.packb(body)
    return BULK_MAGIC + struct.pack("<HI", len(token), len(raw)) + token + raw


def recv_all(sock: socket.socket, limit: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < limit and time.monotonic() < deadline:
        try:
            got = sock.recv(min(1 << 16, limit - len(out)))
        except (OSError, ssl.SSLError):
            break
        if not got:
            break
        out += got
    return bytes(out)


def _recv_response(sock: socket.socket, limit: int, deadline: float) -> bytes:
    """One response frame (the node keeps the connection open after it): read until the frame
    is whole by its own lengths, the node closes, ``limit`` bytes, or the deadline."""
    raw = bytearray()

    def want(n: int) -> bool:
        if len(raw) < n:
            raw.extend(recv_all(sock, min(n, limit) - len(raw), deadline))
        return len(raw) >= n

    if not want(9) or raw[:4] != BULK_MAGIC:
        return bytes(raw)
    end = 9 + struct.unpack("<I", raw[5:9])[0]
    if not want(end) or raw[4] != 0 or not want(end + 4):
        return bytes(raw)
    (n,) = struct.unpack("<I", raw[end:end + 4])
    end += 4 + 8 * n
    if want(end):
        sizes = struct.unpack(f"<{n}Q", raw[end - 8 * n:end])
        want(end + sum(s for s in sizes if s != BULK_MISSING))
    return bytes(raw)


def bulk_read(target: str, ca_pem: str | None, token: str, keys: list[str],
              namespace: dict | None, expect_bytes: int = 0) -> dict[str, Any]:
    """One bulk request with ``token`` (``""``: empty): the status byte, the message, each
    block's size and every byte the node sent (hex, to look for token ids)."""
    try:
        sock = bulk_socket(target, ca_pem)
    except (OSError, ssl.SSLError) as exc:
        return {"connected": False, "error": f"{type(exc).__name__}: {exc}", "received": 0,
                "raw_hex": ""}
    with sock:
        try:
            sock.sendall(bulk_frame(token.encode(), keys, namespace))
        except (OSError, ssl.SSLError) as exc:
            return {"connected": True, "error": f"send: {exc}", "received": 0, "raw_hex": ""}
        raw = _recv_response(sock, 9 + 4096 + 4 + 8 * len(keys) + expect_bytes,
                             time.monotonic() + CALL_TIMEOUT_S)
    out: dict[str, Any] = {"connected": True, "received": len(raw), "raw_hex": raw.hex()}
    if len(raw) >= 9 and raw[:4] == BULK_MAGIC:
        status, msg_len = raw[4], struct.unpack("<I", raw[5:9])[0]
        out.update(status=status, message=raw[9:9 + msg_len].decode(errors="replace"))
        rest = raw[9 + msg_len:]
        if status == 0 and len(rest) >= 4:
            (n,) = struct.unpack("<I", rest[:4])
            sizes = struct.unpack(f"<{n}Q", rest[4:4 + 8 * n])
            out["sizes"] = [None if s == BULK_MISSING else s for s in sizes]
            out["payload_bytes"] = len(rest) - 4 - 8 * n
    return out


def bulk_flood(target: str, ca_pem: str | None, connections: int, body_bytes: int,
               hold_s: float) -> dict[str, Any]:
    """Open ``connections`` bulk connections with no credential: every other one sends a head
    declaring the largest credential and a body just under the cap, then junk where the
    credential goes and up to ``body_bytes`` of body; the rest go silent after the TLS
    handshake (they hold a connection slot until the node's header deadline). Print READY,
    hold them ``hold_s``, then report how many the node let in, how many bytes it took, and
    how many it had closed by then."""
    chunk = b"\xa5" * (BULK_MAX_CREDENTIAL + min(body_bytes, BULK_MAX_BODY - 1))
    head = BULK_MAGIC + struct.pack("<HI", BULK_MAX_CREDENTIAL, BULK_MAX_BODY - 1)

    def one(i: int) -> tuple[socket.socket | None, int, str]:
        try:
            sock = bulk_socket(target, ca_pem, timeout=2.0)
        except (OSError, ssl.SSLError) as exc:
            return None, 0, type(exc).__name__
        if i % 2:
            return sock, 0, ""  # silent
        sent = 0
        try:
            sock.settimeout(1.0)
            sock.sendall(head)
            view = memoryview(chunk)
            while sent < len(view):
                sent += sock.send(view[sent:sent + (1 << 16)])
        except (OSError, ssl.SSLError) as exc:
            return sock, sent, type(exc).__name__
        return sock, sent, ""

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(connections)))
    socks = [s for s, _, _ in results if s is not None]
    errors: dict[str, int] = {}
    for _, _, err in results:
        if err:
            errors[err] = errors.get(err, 0) + 1
    summary = {"opened": len(socks), "bytes_sent": sum(n for _, n, _ in results),
               "errors": errors}
    print("READY=" + json.dumps(summary), flush=True)
    _wait(hold_s)
    closed = 0
    for sock in socks:
        try:
            sock.setblocking(False)
            if sock.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except (OSError, ssl.SSLError):
            closed += 1
        finally:
            sock.close()
    return {**summary, "closed_by_node": closed}


def _wait(hold_s: float) -> None:
    """Hold until ``hold_s`` passed or stdin closes (the test is done measuring)."""
    done = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    done.wait(hold_s)
