"""The attacker's side of tests/multihost/test_attacks.py: raw gRPC stubs and raw sockets.

Run inside a namespace host that is not part of the Ray cluster, as ``python3 -m
tests.multihost.attacker FUNCTION`` with its keyword arguments as one JSON line on stdin
(credentials never go into argv, where any local user reads them): prints one ``ATTACK=<json>``
line with what came back (and ``READY=<json>`` first for the attacks the test measures while they
hold the node). Written from the wire format (protos/kvstore.proto, the bulk frame of
kvstore/node/bulk_server.py, the block layout of docs/design.md §3.2) and deliberately NOT with
kvstore's client or codec: the product's client might refuse a bad request on its own before
the node ever sees it, and an attacker does not use it either. The test also calls these
functions in-process with the cluster token, as the legitimate reader.

Every call has a deadline; a function never runs longer than its ``hold_s`` plus a few seconds.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import math
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import msgpack
import xxhash

from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pbg
from tests.multihost.attacker_bulk import CALL_TIMEOUT_S, bulk_flood, bulk_read, recv_all

ALIGN = 64


# --- channels and metadata --------------------------------------------------------------------

def channel(target: str, ca_pem: str | None) -> grpc.Channel:
    """TLS when a CA is given (the CA is public: an attacker may hold it too), else plaintext."""
    opts = [("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", 64 << 20)]
    if ca_pem:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(ca_pem.encode()), opts)
    return grpc.insecure_channel(target, opts)


def metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token is not None else []


def has_field(message: type, name: str) -> bool:
    return name in message.DESCRIPTOR.fields_by_name


def spec(fields: dict[str, Any] | None) -> pb.NamespaceSpec | None:
    return None if fields is None else pb.NamespaceSpec(**fields)


def keys_request(keys: list[str], namespace: dict | None, reader: str = "") -> pb.KeysRequest:
    req = pb.KeysRequest(keys=[bytes.fromhex(k) for k in keys], reader_node_id=reader)
    if namespace is not None and has_field(pb.KeysRequest, "namespace"):
        req.namespace.CopyFrom(spec(namespace))
    return req


def lease_request(keys: list[str], ttl_s: float, namespace: dict | None) -> pb.LeaseRequest:
    req = pb.LeaseRequest(keys=[bytes.fromhex(k) for k in keys], ttl_s=ttl_s)
    if namespace is not None and has_field(pb.LeaseRequest, "namespace"):
        req.namespace.CopyFrom(spec(namespace))
    return req


def outcome(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``{"code": "OK", ...what fn returned}`` or ``{"code": <status>, "details": ...}``."""
    try:
        out = fn()
    except grpc.RpcError as exc:
        return {"code": exc.code().name, "details": (exc.details() or "")[:300]}
    return {"code": "OK", **out}


# --- the block layout, as an outsider writes it (public root, xxh3 checksum) ------------------

def public_root(ns: dict[str, Any]) -> bytes:
    """sha256 of the canonical namespace encoding: the root anyone could compute before keyed
    roots (docs/design.md §3.1)."""
    fields = [ns["schema_version"], ns["model_fingerprint"], ns["dtype"], ns["block_size"],
              ns["num_layers"], ns["num_kv_heads"], ns["head_dim"], ns["cache_salt"]]
    if ns.get("numerics"):  # the writer's numerics tag, appended when there is one
        fields.append(ns["numerics"])
    return hashlib.sha256(msgpack.packb(fields)).digest()


def chain(root: bytes, token_ids: list[int], block_size: int) -> list[tuple[bytes, bytes, bytes]]:
    """(key, parent, token bytes) of every full block of ``token_ids`` from ``root``."""
    out, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        key = hashlib.sha256(parent + tokens).digest()
        out.append((key, parent, tokens))
        parent = key
    return out


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


def payload_nbytes(ns: dict[str, Any]) -> int:
    return (ns["num_layers"] * 2 * ns["block_size"] * ns["num_kv_heads"] * ns["head_dim"]
            * _ITEMSIZE[ns["dtype"]])


def encode_block(ns: dict[str, Any], root: bytes, key: bytes, parent: bytes, tokens: bytes,
                 fill: int) -> bytes:
    """A block in the documented layout with a payload of ``fill`` bytes and a matching xxh3
    checksum: as valid as a writer without the cluster's secrets can make one."""
    payload = bytes([fill]) * payload_nbytes(ns)
    header = msgpack.packb([ns["schema_version"], root, key, parent, tokens, ns["dtype"],
                            ns["num_layers"], ns["block_size"], ns["num_kv_heads"],
                            ns["head_dim"], xxhash.xxh3_64_digest(payload)])
    head = struct.pack("<I", len(header)) + header
    pad = -len(head) % ALIGN
    return head + bytes(pad) + payload


# --- attacks on the gRPC service --------------------------------------------------------------

def rpc_matrix(target: str, ca_pem: str | None, token: str | None, keys: list[str],
               namespace: dict | None) -> dict[str, Any]:
    """Every StoreNode RPC once with ``token`` (None: no metadata at all): each one's status
    and what it returned (blocks found, bytes, keys listed)."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    md = metadata(token)
    kw = {"metadata": md, "timeout": CALL_TIMEOUT_S}
    ns = namespace or {"schema_version": 1, "model_fingerprint": "x" * 64, "dtype": "float32",
                       "block_size": 16, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                       "cache_salt": ""}
    first = keys[0] if keys else "00" * 32

    def get() -> dict[str, Any]:
        found, nbytes = 0, 0
        for chunk in stub.Get(keys_request(keys, namespace), **kw):
            found += int(chunk.found)
            nbytes += len(chunk.data)
        return {"found": found, "bytes": nbytes}

    def list_keys() -> dict[str, Any]:
        return {"keys": sum(len(p.keys) for p in stub.ListKeys(pb.ListKeysRequest(), **kw))}

    def put() -> dict[str, Any]:
        chunk = pb.PutChunk(namespace=spec(ns), key=bytes.fromhex(first), total_nbytes=64,
                            offset=0, data=b"\0" * 64)
        r = stub.Put(iter([chunk]), **kw)
        return {"stored": r.num_stored}

    calls: dict[str, Callable[[], dict[str, Any]]] = {
        "Health": lambda: {"node": stub.Health(pb.Empty(), **kw).node_id},
        "Stats": lambda: {"blocks": stub.Stats(pb.Empty(), **kw).num_blocks},
        "ListKeys": list_keys,
        "Exists": lambda: {"present": sum(stub.Exists(keys_request(keys, namespace),
                                                      **kw).present)},
        "Get": get,
        "Lease": lambda: {"locations": len(stub.Lease(lease_request(keys, 5.0, namespace),
                                                      **kw).locations)},
        "RenewLease": lambda: {"expires_at": stub.RenewLease(
            pb.RenewLeaseRequest(lease_id="1", ttl_s=5.0), **kw).expires_at},
        "ReleaseLease": lambda: (stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="1"), **kw)
                                 and {}),
        "Put": put,
        "PutBatch": lambda: {"stored": stub.PutBatch(pb.PutBatchRequest(chunks=[pb.PutChunk(
            namespace=spec(ns), key=bytes.fromhex(first), total_nbytes=64, offset=0,
            data=b"\0" * 64)]), **kw).num_stored},
        "Delete": lambda: {"deleted": stub.Delete(keys_request(keys, namespace),
                                                  **kw).num_deleted},
        "Evict": lambda: {"freed": stub.Evict(keys_request(keys, namespace), **kw).bytes_freed},
        "ReportReads": lambda: (stub.ReportReads(pb.ReaderReport(hits=10**6), **kw) and {}),
    }
    return {name: outcome(fn) for name, fn in calls.items()}


def reads(target: str, ca_pem: str | None, token: str | None, keys: list[str],
          namespace: dict | None) -> dict[str, Any]:
    """Get, Exists, Lease and ListKeys as a reader: statuses, blocks found and the raw bytes
    served (hex), to look for another tenant's token ids in them."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    kw = {"metadata": metadata(token), "timeout": CALL_TIMEOUT_S}
    raw = bytearray()

    def get() -> dict[str, Any]:
        found = 0
        for chunk in stub.Get(keys_request(keys, namespace), **kw):
            found += int(chunk.found)
            raw.extend(chunk.data)
        return {"found": found}

    def lease() -> dict[str, Any]:
        r = stub.Lease(lease_request(keys, 5.0, namespace), **kw)
        if r.lease_id:
            stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=r.lease_id), **kw)
        return {"locations": len(r.locations), "shm_path": r.shm_path}

    def list_keys() -> dict[str, Any]:
        n = 0
        for page in stub.ListKeys(pb.ListKeysRequest(), **kw):
            n += len(page.keys)
        return {"keys": n}

    out = {"Get": outcome(get),
           "Exists": outcome(lambda: {"present": sum(
               stub.Exists(keys_request(keys, namespace), **kw).present)}),
           "Lease": outcome(lease), "ListKeys": outcome(list_keys)}
    out["raw_hex"] = bytes(raw).hex()
    return out


def plaintext_probe(target: str) -> dict[str, Any]:
    """A client that does not speak TLS: a plaintext gRPC Health, and the first bytes the port
    answers to an HTTP/2 connection preface on a raw socket."""
    stub = pbg.StoreNodeStub(grpc.insecure_channel(target))
    health = outcome(lambda: {"node": stub.Health(pb.Empty(), timeout=5.0).node_id})
    host, _, port = target.rpartition(":")
    reply = b""
    try:
        with socket.create_connection((host, int(port)), timeout=5.0) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and len(reply) < 4096:
                got = sock.recv(4096)
                if not got:
                    break
                reply += got
    except OSError as exc:
        reply += f"<{type(exc).__name__}>".encode()
    return {"health": health, "raw_reply_hex": reply[:64].hex(),
            # An HTTP/2 server answers the preface with a SETTINGS frame (type 4 at byte 3).
            "http2_settings": len(reply) >= 9 and reply[3] == 4}


# --- Puts -------------------------------------------------------------------------------------

def stalled_puts(target: str, ca_pem: str | None, token: str, streams: int,
                 namespace: dict, total_nbytes: int, first_bytes: int, hold_s: float
                 ) -> dict[str, Any]:
    """``streams`` Put streams that each send the first ``first_bytes`` of a ``total_nbytes``
    block and then go silent for ``hold_s``; READY once each has handed gRPC all it sends
    (or has ended). Per stream: its final status and whether the node ended it before the
    attacker let go."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    release = threading.Event()
    sent = [threading.Event() for _ in range(streams)]
    t0 = time.monotonic()

    def one(i: int) -> dict[str, Any]:
        key = hashlib.sha256(b"stall%d" % i).digest()

        def messages() -> Iterator[pb.PutChunk]:
            # ``first_bytes`` in chunks of at most 4 MiB (a message under gRPC's size limits)
            for off in range(0, first_bytes, 4 << 20):
                chunk = pb.PutChunk(key=key, total_nbytes=total_nbytes, offset=off,
                                    data=b"\x01" * min(4 << 20, first_bytes - off))
                if off == 0:
                    chunk.namespace.CopyFrom(spec(namespace))
                yield chunk
            sent[i].set()  # gRPC asked for the message after the last one
            release.wait(hold_s)

        res = outcome(lambda: {"stored": stub.Put(messages(), metadata=metadata(token),
                                                  timeout=hold_s + 30).num_stored})
        res["ended_by_node"] = not release.is_set()
        res["after_s"] = round(time.monotonic() - t0, 1)
        return res

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futs = [pool.submit(one, i) for i in range(streams)]
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline and not all(
                e.is_set() or f.done() for e, f in zip(sent, futs, strict=True)):
            time.sleep(0.1)
        time.sleep(0.5)  # the last messages are on the wire
        print("READY=" + json.dumps({"streams": streams, "refused_at_once": sum(
            f.done() for f in futs)}), flush=True)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline and not all(f.done() for f in futs):
            time.sleep(0.2)
        release.set()
        results = [f.result() for f in futs]
    return {"streams": results}


def put_blocks(target: str, ca_pem: str | None, token: str | None, namespace: dict,
               token_ids: list[int], junk_bytes: int = 0, unary: bool = True,
               root_hex: str | None = None, fill: int = 0x3C) -> dict[str, Any]:
    """Encode every full block of ``token_ids`` under the public root (or ``root_hex``) as an
    outsider can, each followed by ``junk_bytes`` of junk, and Put them (PutBatch, or a Put
    stream of chunks). Returns the status and the keys sent."""
    root = bytes.fromhex(root_hex) if root_hex else public_root(namespace)
    blocks = [(key, encode_block(namespace, root, key, parent, tokens, fill)
               + b"\xee" * junk_bytes) for key, parent, tokens in
              chain(root, token_ids, namespace["block_size"])]
    return _put_blocks(target, ca_pem, token, namespace, blocks, unary)


def _put_blocks(target: str, ca_pem: str | None, token: str | None, namespace: dict,
                blocks: list[tuple[bytes, bytes]], unary: bool) -> dict[str, Any]:
    """Put ``(key, encoded bytes)`` pairs as one PutBatch or one Put stream: the status, the
    keys sent and the size of a block as sent."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    kw = {"metadata": metadata(token), "timeout": 30.0}
    chunks = [pb.PutChunk(key=key, total_nbytes=len(data), offset=0, data=data)
              for key, data in blocks]
    chunks[0].namespace.CopyFrom(spec(namespace))
    if unary:
        res = outcome(lambda: _put_counts(stub.PutBatch(pb.PutBatchRequest(chunks=chunks), **kw)))
    else:
        res = outcome(lambda: _put_counts(stub.Put(iter(chunks), **kw)))
    return {**res, "keys": [k.hex() for k, _ in blocks], "block_nbytes": len(blocks[0][1])}


def _put_counts(r: pb.PutResponse) -> dict[str, Any]:
    return {"stored": r.num_stored, "existing": r.num_existing}


def huge_put(target: str, ca_pem: str | None, token: str | None, namespace: dict,
             total_nbytes: int, data_bytes: int, requests: int) -> dict[str, Any]:
    """A tiny Put whose first chunk declares ``total_nbytes`` (its namespace's block size, or
    not), ``requests`` times: each status."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    out = []
    for i in range(requests):
        chunk = pb.PutChunk(namespace=spec(namespace), key=hashlib.sha256(b"huge%d" % i).digest(),
                            total_nbytes=total_nbytes, offset=0, data=b"\x02" * data_bytes)
        out.append(outcome(lambda c=chunk: _put_counts(stub.Put(
            iter([c]), metadata=metadata(token), timeout=CALL_TIMEOUT_S))))
    return {"requests": out, "message_bytes": pb.PutChunk(
        namespace=spec(namespace), key=b"\0" * 32, total_nbytes=total_nbytes, offset=0,
        data=b"\x02" * data_bytes).ByteSize()}


def put_tenant_blocks(target: str, ca_pem: str | None, token: str, namespace: dict,
                      tenant_key_hex: str, token_ids: list[int], junk_bytes: int = 0,
                      unary: bool = True) -> dict[str, Any]:
    """Blocks as tenant A's own writer makes them (its tenant key, kvstore's codec: valid in
    every respect), each followed by ``junk_bytes`` of junk, Put with ``token``."""
    import torch

    from kvstore.block import encode_block as product_encode
    from kvstore.keys import BlockHasher, Namespace

    ns = Namespace(**namespace, tenant_key=bytes.fromhex(tenant_key_hex))
    keys = BlockHasher(ns).block_keys(token_ids)
    gen = torch.Generator().manual_seed(7)
    blocks = []
    for i, key in enumerate(keys):
        parent = keys[i - 1] if i else ns.root
        tokens = token_ids[i * ns.block_size:(i + 1) * ns.block_size]
        payload = torch.randn(ns.payload_shape, generator=gen).to(ns.torch_dtype)
        blocks.append((key, bytes(product_encode(ns, key, parent, tokens, payload))
                       + b"\xee" * junk_bytes))
    return _put_blocks(target, ca_pem, token, namespace, blocks, unary)


def health(target: str, ca_pem: str | None, token: str | None) -> dict[str, Any]:
    """The node's Health answer (its bulk address among it)."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))

    def call() -> dict[str, Any]:
        r = stub.Health(pb.Empty(), metadata=metadata(token), timeout=CALL_TIMEOUT_S)
        return {"node_id": r.node_id, "grpc_address": r.grpc_address,
                "bulk_address": r.bulk_address, "serving": r.serving}
    return outcome(call)


def exists(target: str, ca_pem: str | None, token: str | None, keys: list[str],
           namespace: dict | None) -> dict[str, Any]:
    """Exists: which keys the node holds (and their sizes)."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))

    def call() -> dict[str, Any]:
        r = stub.Exists(keys_request(keys, namespace), metadata=metadata(token),
                        timeout=CALL_TIMEOUT_S)
        return {"present": list(r.present), "nbytes": list(r.nbytes)}
    return outcome(call)


def redis_plaintext(target: str) -> dict[str, Any]:
    """A plaintext RESP ``PING`` to the index's Redis port: a TLS-only Redis answers no RESP."""
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = recv_all(sock, 256, time.monotonic() + 5.0)
    except OSError as exc:
        return {"connected": False, "error": type(exc).__name__, "reply": ""}
    return {"connected": True, "reply": reply.decode(errors="replace"),
            "resp": reply[:1] in (b"+", b"-", b"$", b"*", b":")}


# --- leases -----------------------------------------------------------------------------------

def lease_attacks(target: str, ca_pem: str | None, token: str, keys: list[str],
                  namespace: dict | None, victim_lease_id: str) -> dict[str, Any]:
    """Leases with unbounded ttls, and a release and renewal of someone else's lease by its id
    and by guessed ids."""
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    kw = {"metadata": metadata(token), "timeout": CALL_TIMEOUT_S}
    ttls: dict[str, Any] = {}
    own_ids = []
    for name, ttl in (("inf", math.inf), ("nan", math.nan), ("huge", 1e12), ("negative", -5.0)):
        def lease(ttl: float = ttl) -> dict[str, Any]:
            r = stub.Lease(lease_request(keys, ttl, namespace), **kw)
            own_ids.append(r.lease_id)
            return {"lease_id": r.lease_id, "expires_in_s": r.expires_at - time.time(),
                    "locations": len(r.locations)}
        ttls[name] = outcome(lease)
    guesses = {victim_lease_id}
    for lid in own_ids:
        if lid.isdigit():
            guesses |= {str(int(lid) + d) for d in range(-3, 4)}
    guesses |= {str(i) for i in range(1, 20)}
    release = {g: outcome(lambda g=g: stub.ReleaseLease(
        pb.ReleaseLeaseRequest(lease_id=g), **kw) and {}) for g in sorted(guesses)}
    renew = outcome(lambda: {"expires_in_s": stub.RenewLease(pb.RenewLeaseRequest(
        lease_id=victim_lease_id, ttl_s=math.inf), **kw).expires_at - time.time()})
    for lid in own_ids:
        if lid:
            outcome(lambda lid=lid: stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lid),
                                                      **kw) and {})
    return {"ttls": ttls, "own_ids": own_ids, "release_victim": release.pop(victim_lease_id),
            "release_guesses": release, "renew_victim": renew}


def take_lease(target: str, ca_pem: str | None, token: str, keys: list[str],
               namespace: dict | None, ttl_s: float) -> dict[str, Any]:
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    return outcome(lambda: {"lease_id": (r := stub.Lease(lease_request(keys, ttl_s, namespace),
                                                          metadata=metadata(token),
                                                          timeout=CALL_TIMEOUT_S)).lease_id,
                            "locations": len(r.locations)})


def renew_lease(target: str, ca_pem: str | None, token: str, lease_id: str,
                ttl_s: float) -> dict[str, Any]:
    stub = pbg.StoreNodeStub(channel(target, ca_pem))
    return outcome(lambda: {"expires_in_s": stub.RenewLease(pb.RenewLeaseRequest(
        lease_id=lease_id, ttl_s=ttl_s), metadata=metadata(token),
        timeout=CALL_TIMEOUT_S).expires_at - time.time()})


FUNCTIONS = {f.__name__: f for f in (rpc_matrix, reads, plaintext_probe, bulk_read, bulk_flood,
                                     stalled_puts, put_blocks, put_tenant_blocks, huge_put,
                                     lease_attacks, take_lease, renew_lease, health, exists,
                                     redis_plaintext)}


def main(argv: list[str]) -> int:
    kwargs = json.loads(sys.stdin.readline())
    result = FUNCTIONS[argv[0]](**kwargs)
    print("ATTACK=" + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
