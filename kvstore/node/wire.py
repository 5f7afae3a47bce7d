"""What both ends of a store node's gRPC channel agree on: auth metadata, size limits, the
wire form of a namespace, and how each ``kvstore.errors`` class travels as a status code.

Kept apart from ``kvstore.node.store_server`` so a client never imports the server, and so the two
directions of the error table sit side by side: the server sends ``ClassName: message`` with the
code of ``status_for``; the client rebuilds the class from the name, else from the code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import (
    BlockCorrupted,
    BlockMismatch,
    BlockNotFound,
    ConfigError,
    InvalidRequest,
    KVStoreError,
    LeaseExpired,
    NamespaceMismatch,
    NodeUnavailable,
    Overloaded,
    PermissionDenied,
    PoolFull,
    RequestCancelled,
    RequestTooLarge,
    Unauthenticated,
)
from kvstore.keys import Namespace
from kvstore.node.auth import AUTH_HEADER as AUTH_HEADER
from kvstore.node.auth import AuthGate, AuthInterceptor
from kvstore.protos import kvstore_pb2 as pb
from kvstore.reader_metrics import ReaderTally
from kvstore.security.tls import client_ca, server_cert_and_key

#: Server side: the status code each error travels as (first match wins: subclasses first).
_STATUS_OF: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (PoolFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BlockNotFound, grpc.StatusCode.NOT_FOUND),
    (LeaseExpired, grpc.StatusCode.FAILED_PRECONDITION),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (BlockCorrupted, grpc.StatusCode.INVALID_ARGUMENT),
    (BlockMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
]
#: Client side: errors rebuilt by the class name the server put in front of the message.
_ERROR_BY_NAME: dict[str, type[KVStoreError]] = {
    cls.__name__: cls
    for cls in (BlockCorrupted, BlockMismatch, NamespaceMismatch, BlockNotFound, ConfigError,
                PoolFull, RequestTooLarge, LeaseExpired, Unauthenticated, PermissionDenied,
                Overloaded)
}
#: Client side: the error a status code stands for when the message names no known class
#: (gRPC's own failures: deadlines, cancellations, a peer that is not a store node).
_ERROR_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RequestTooLarge,
    grpc.StatusCode.NOT_FOUND: BlockNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseExpired,
    grpc.StatusCode.DEADLINE_EXCEEDED: RequestCancelled,
    grpc.StatusCode.CANCELLED: RequestCancelled,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a kvstore error travels as (INTERNAL for anything unexpected)."""
    for cls, code in _STATUS_OF:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_from_rpc(exc: grpc.RpcError, address: str) -> KVStoreError:
    """The kvstore error a failed call stands for (the server sends ``ClassName: message``)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    name = details.split(":", 1)[0]
    cls = _ERROR_BY_NAME.get(name) or _ERROR_BY_CODE.get(code, NodeUnavailable)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "Concurrent RPC limit" in details:
        cls = Overloaded  # gRPC's own refusal past server.max_concurrent_rpcs
    return cls(f"{address}: {code.name}: {details}")


#: Hosts that mean "this machine only": a server on a cluster binds its node's IP instead.
LOCAL_HOSTS = ("127.0.0.1", "localhost")


def bind_node_ip(config: ServerConfig, ip: str) -> ServerConfig:
    """Bind the node's IP (not loopback) so other nodes can reach it; advertise that IP.

    Loopback in both ``host`` and ``advertise_host`` means "this machine only" on purpose (the
    embedded default: ``kvstore.cluster.lifecycle.loopback_only``) and is kept."""
    if config.host in LOCAL_HOSTS and config.advertise_host in LOCAL_HOSTS:
        return config
    host = ip if config.host in LOCAL_HOSTS else config.host
    return dataclasses.replace(config, host=host, advertise_host=config.advertise_host or ip)


def start_grpc_server(config: ServerConfig, port: int, add_servicer: Callable[[grpc.Server], None],
                      *, max_workers: int, thread_prefix: str, max_message_bytes: int,
                      what: str, gate: AuthGate | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server on ``config.host:port`` with ``config``'s credential check
    (``gate``, built from ``config`` if not given: pass one to reload it later), TLS and
    ``server.max_concurrent_rpcs`` (calls past it are refused RESOURCE_EXHAUSTED at once),
    for the store node and the coordinator's index service alike; returns it and its port.
    ``what`` names the setting to change when the port is taken."""
    gate = gate or AuthGate.from_config(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix=thread_prefix),
                         interceptors=[AuthInterceptor(gate)],
                         options=grpc_options(max_message_bytes),
                         maximum_concurrent_rpcs=config.max_concurrent_rpcs)
    add_servicer(server)
    bind = f"{config.host}:{port}"
    pair = server_cert_and_key(config)
    if pair is not None:
        cert, key = pair
        bound = server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))
    else:
        bound = server.add_insecure_port(bind)
    if bound == 0:
        raise ConfigError(f"cannot bind {bind}; pick a free {what}")
    server.start()
    return server, bound


def open_channel(address: str, config: ClientConfig, max_message_bytes: int,
                 tls_server_name: str | None = None) -> grpc.Channel:
    """A channel to a kvstore gRPC server: TLS when the client has a CA (file or PEM)."""
    options: list[tuple[str, Any]] = list(grpc_options(max_message_bytes))
    ca = client_ca(config)
    if ca is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return grpc.secure_channel(address, creds, options=options)


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Explicit size limits: gRPC's 4 MiB default breaks at two 2 MiB blocks in one message."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def namespace_from_spec(spec: pb.NamespaceSpec, data_key: bytes | None = None) -> Namespace:
    """Rebuild the writer's namespace (raises ConfigError on nonsense fields); ``data_key`` is
    the node's copy of the cluster's data secret (the wire never carries it)."""
    return Namespace(data_key=data_key,
        model_fingerprint=spec.model_fingerprint, dtype=spec.dtype, block_size=spec.block_size,
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        cache_salt=spec.cache_salt, schema_version=spec.schema_version,
        numerics=spec.numerics,
    )


def spec_from_namespace(ns: Namespace) -> pb.NamespaceSpec:
    """The wire form of a namespace."""
    return pb.NamespaceSpec(
        schema_version=ns.schema_version, model_fingerprint=ns.model_fingerprint,
        dtype=ns.dtype, block_size=ns.block_size, num_layers=ns.num_layers,
        num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, cache_salt=ns.cache_salt,
        numerics=ns.numerics,
    )


def tally_to_proto(tally: ReaderTally) -> pb.ReaderReport:
    """A reader's metrics tally as the ``ReportReads`` message."""
    return pb.ReaderReport(
        hits=tally.hits, misses=dict(tally.misses), rejected=dict(tally.rejected),
        fetched_blocks=dict(tally.fetched_blocks), fetched_bytes=dict(tally.fetched_bytes),
        fetch_seconds=[pb.FetchTimes(path=p, seconds=s) for p, s in tally.fetch_seconds.items()],
        prefill_tokens=dict(tally.prefill_tokens),
    )


def tally_from_proto(msg: pb.ReaderReport) -> ReaderTally:
    """The tally a ``ReportReads`` message carries (labels are checked when it is applied)."""
    tally = ReaderTally(hits=msg.hits)
    tally.misses.update(dict(msg.misses))
    tally.rejected.update(dict(msg.rejected))
    tally.fetched_blocks.update(dict(msg.fetched_blocks))
    tally.fetched_bytes.update(dict(msg.fetched_bytes))
    tally.prefill_tokens.update(dict(msg.prefill_tokens))
    for times in msg.fetch_seconds:
        tally.fetch_seconds.setdefault(times.path, []).extend(times.seconds)
    return tally
