"""The coordinator's index on the data path over gRPC: lookups and publishes without Ray.

A request makes one index lookup (the reader) and one publish (its store node, before the Put
returns), both answered by the coordinator. A Ray actor call goes through Ray's task path
(the caller's core worker, the actor's, their scheduling) and costs several times what the
same call over a gRPC channel does, and more than the core's own work. So the coordinator
actor also serves these three calls on a small gRPC server (``IndexServer``), and readers and
store nodes use it (``IndexClient``) when the actor hands them its address
(``Coordinator.index_address``).

It is a second door to the same ``CoordinatorCore``, not a copy: the actor is threaded and the
core locked, so an answer is the one the actor call would give, and "Put returns once every
key is visible" holds the same way (``Publish`` replies after the core recorded the entries).
Everything else (registration, heartbeats, eviction, pins, status) stays on Ray. The server
binds and authenticates as a store node does (``server.host``, ``server.auth_token``, TLS
files); ``coordinator.index_port: null`` turns it off and every caller uses the actor. Any
valid credential may look keys up (a tenant can only name keys it could compute); only the
cluster token (admin: store nodes) may publish.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvstore.config import ClientConfig, ServerConfig
from kvstore.constants import KEY_NBYTES
from kvstore.errors import KVStoreError, PermissionDenied, Unauthenticated
from kvstore.index.base import IndexEntry
from kvstore.index.packed import unpack_entries
from kvstore.node.auth import AUTH_HEADER, AuthGate
from kvstore.node.grpc_setup import open_channel, start_grpc_server
from kvstore.node.grpc_status import error_from_rpc
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from kvstore.records import PrefixHit

#: Largest message either way: a lookup of 2,048 keys is 64 KiB, a reply a few more.
MAX_MESSAGE_BYTES = 64 << 20


def join_keys(keys: Sequence[bytes]) -> bytes:
    """Keys back to back; each must be a 32-byte key (the caller checked them)."""
    return b"".join(keys)


def split_keys(joined: bytes) -> list[bytes]:
    """``join_keys`` undone; a length that is not a whole number of keys is refused."""
    if len(joined) % KEY_NBYTES:
        raise ValueError(f"{len(joined)} bytes of keys is not a whole number of "
                         f"{KEY_NBYTES}-byte keys")
    k = KEY_NBYTES
    return [joined[i : i + k] for i in range(0, len(joined), k)]


def encode_holders(holders: Sequence[Sequence[str]]) -> pb.HoldersReply:
    """Holder lists as their distinct sets plus one set index per key."""
    index: dict[tuple[str, ...], int] = {}
    of_key = array("I", [index.setdefault(tuple(h), len(index)) for h in holders])
    return pb.HoldersReply(num_keys=len(holders),
                           sets=[pb.HolderSet(node_ids=s) for s in index],
                           set_of_key=of_key.tobytes())


def decode_holders(reply: pb.HoldersReply) -> list[list[str]]:
    """``encode_holders`` undone: a fresh list per key (callers may keep or change them)."""
    sets = [list(s.node_ids) for s in reply.sets]
    of_key = array("I")
    of_key.frombytes(reply.set_of_key)
    if len(of_key) != reply.num_keys or any(i >= len(sets) for i in set(of_key)):
        raise ValueError("a malformed holders reply (set indices do not match the sets)")
    return [sets[i][:] for i in of_key]


def encode_publish(node_id: str, entries: Sequence[IndexEntry]) -> pb.PublishRequest:
    """A node's entries as columns (roots named once)."""
    roots = list(dict.fromkeys(e.namespace_root for e in entries))
    root_at = {r: i for i, r in enumerate(roots)}
    return pb.PublishRequest(
        node_id=node_id, keys=b"".join(e.key for e in entries),
        parent_keys=b"".join(e.parent_key for e in entries),
        nbytes=array("q", [e.nbytes for e in entries]).tobytes(), roots=roots,
        root_of_entry=array("I", [root_at[e.namespace_root] for e in entries]).tobytes())


def decode_publish(msg: pb.PublishRequest) -> list[IndexEntry]:
    """``encode_publish`` undone, every column checked against the others' lengths (the
    core then checks the entries themselves as it does for an actor call)."""
    n = len(msg.nbytes) // 8
    if (len(msg.nbytes) % 8 or len(msg.keys) != n * KEY_NBYTES
            or len(msg.parent_keys) != n * KEY_NBYTES or len(msg.root_of_entry) != n * 4):
        raise ValueError("a malformed publish: the key, parent, size and root columns "
                         "do not describe the same number of entries")
    roots = list(msg.roots)
    idx = array("I")
    idx.frombytes(msg.root_of_entry)
    if n and max(idx) >= len(roots):
        raise ValueError("a malformed publish: a root index past the roots sent")
    return unpack_entries(msg.keys, msg.parent_keys, msg.nbytes, roots, msg.root_of_entry,
                          [msg.node_id], bytes(4 * n))


class _Servicer(pb_grpc.CoordinatorIndexServicer):
    def __init__(self, core: Any, gate: AuthGate | None = None) -> None:
        self.core = core
        self.gate = gate or AuthGate()

    def LookupPrefix(self, request: pb.JoinedKeys, context: grpc.ServicerContext
                     ) -> pb.HoldersReply:
        hit = self._run(context, lambda: self.core.lookup_prefix(split_keys(request.keys)))
        return encode_holders(hit.holders)

    def Holders(self, request: pb.JoinedKeys, context: grpc.ServicerContext
                ) -> pb.HoldersReply:
        return encode_holders(self._run(context,
                                        lambda: self.core.holders(split_keys(request.keys))))

    def Publish(self, request: pb.PublishRequest, context: grpc.ServicerContext) -> pb.Empty:
        """Store nodes' publishes: the cluster token only (a tenant must not announce blocks
        as held by a node, nor make the coordinator track keys for it)."""
        try:
            self.gate.grant_of(context).check_admin("Publish")
        except Unauthenticated as exc:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Unauthenticated: {exc}")
        except PermissionDenied as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"PermissionDenied: {exc}")
        self._run(context, lambda: self.core.publish(request.node_id, decode_publish(request)))
        return pb.Empty()

    @staticmethod
    def _run(context: grpc.ServicerContext, fn: Any) -> Any:
        try:
            return fn()
        except (KVStoreError, ValueError, TypeError) as exc:  # the caller's input: say why
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")


class IndexServer:
    """The gRPC door to ``core``'s lookups and publishes, on ``config.host`` and ``port``."""

    def __init__(self, core: Any, config: ServerConfig, port: int) -> None:
        self._core, self._config, self._port = core, config, port
        self._gate = AuthGate.from_config(config)
        self._server: grpc.Server | None = None
        self.address = ""

    def set_auth_tokens(self, auth_token: str | None, previous_auth_token: str | None = None
                        ) -> None:
        """Accept ``auth_token`` (and ``previous_auth_token``) from the next call on."""
        self._gate.set_tokens(auth_token, previous_auth_token)

    def start(self) -> str:
        """Bind and serve; returns the ``host:port`` callers dial."""
        cfg = self._config
        self._server, port = start_grpc_server(
            cfg, self._port, lambda server: pb_grpc.add_CoordinatorIndexServicer_to_server(
                _Servicer(self._core, self._gate), server),
            max_workers=8, thread_prefix="kvstore-index", max_message_bytes=MAX_MESSAGE_BYTES,
            what="coordinator.index_port", gate=self._gate)
        self.address = f"{cfg.advertise_host or cfg.host}:{port}"
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)
            self._server = None


class IndexClient:
    """A reader's or store node's channel to an ``IndexServer``; failures are kvstore errors
    (``NodeUnavailable`` when it cannot be reached: the caller falls back to the actor)."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        cfg = config or ClientConfig()
        self.address = address
        self._timeout = cfg.timeout_s
        self._channel = open_channel(address, cfg, MAX_MESSAGE_BYTES)
        self._stub = pb_grpc.CoordinatorIndexStub(self._channel)
        self._metadata = ((AUTH_HEADER, f"Bearer {cfg.auth_token}"),) if cfg.auth_token else None

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        holders = decode_holders(self._call(self._stub.LookupPrefix,
                                            pb.JoinedKeys(keys=join_keys(keys))))
        return PrefixHit(num_blocks=len(holders), holders=holders)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        return decode_holders(self._call(self._stub.Holders, pb.JoinedKeys(keys=join_keys(keys))))

    def publish(self, node_id: str, entries: Sequence[IndexEntry]) -> None:
        self._call(self._stub.Publish, encode_publish(node_id, entries))

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"coordinator index {self.address}") from None


class NoAnswer:
    """``FastPath.attempt``'s "ask the actor" (a type of its own: ``None`` is an answer)."""


NO_ANSWER = NoAnswer()
T = TypeVar("T")


class FastPath:
    """Which ``IndexClient`` to use, if any: the address comes from ``resolve`` (an actor call
    to ``Coordinator.index_address``; None when the service is off), asked on first use and
    again after a failure (a restarted coordinator listens on a new port), at most once per
    ``retry_s``; in between, and when there is none, callers use the actor."""

    def __init__(self, resolve: Callable[[], str | None], config: ClientConfig | None = None, *,
                 retry_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._resolve, self._config, self._retry_s = resolve, config, retry_s
        self._clock = clock
        self._client: IndexClient | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    def client(self) -> IndexClient | None:
        with self._lock:
            if self._client is None and self._clock() >= self._next_try:
                self._next_try = self._clock() + self._retry_s
                try:
                    address = self._resolve()
                except Exception:  # the actor is restarting: the actor path will say why
                    address = None
                if address:
                    self._client = IndexClient(address, self._config)
            return self._client

    def attempt(self, use: Callable[[IndexClient], T]) -> T | NoAnswer:
        """``use(client)``, or ``NO_ANSWER`` when there is no client or it failed (then it is
        dropped): the caller asks the actor instead."""
        client = self.client()
        if client is None:
            return NO_ANSWER
        try:
            return use(client)
        except KVStoreError:  # restarted or unreachable: the actor answers this one
            self.failed(client)
            return NO_ANSWER

    def failed(self, client: IndexClient) -> None:
        """``client`` could not be reached: drop it; the next try resolves again."""
        with self._lock:
            if self._client is client:
                self._client = None
                client.close()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
