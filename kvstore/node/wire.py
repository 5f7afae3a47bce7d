"""What both ends of a store node's gRPC channel agree on: auth metadata, size limits, and
the wire form of a namespace. Kept apart from ``kvstore.node.server`` so a client never imports the
server.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

from kvstore.keys import Namespace
from protos import kvstore_pb2 as pb

AUTH_HEADER = "authorization"


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Explicit size limits: gRPC's 4 MiB default breaks at two 2 MiB blocks in one message."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def namespace_from_spec(spec: pb.NamespaceSpec) -> Namespace:
    """Rebuild the writer's namespace (raises ConfigError on nonsense fields)."""
    return Namespace(
        model_fingerprint=spec.model_fingerprint, dtype=spec.dtype, block_size=spec.block_size,
        num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        cache_salt=spec.cache_salt, schema_version=spec.schema_version,
    )


def spec_from_namespace(ns: Namespace) -> pb.NamespaceSpec:
    """The wire form of a namespace."""
    return pb.NamespaceSpec(
        schema_version=ns.schema_version, model_fingerprint=ns.model_fingerprint,
        dtype=ns.dtype, block_size=ns.block_size, num_layers=ns.num_layers,
        num_kv_heads=ns.num_kv_heads, head_dim=ns.head_dim, cache_salt=ns.cache_salt,
    )


class AuthInterceptor(grpc.ServerInterceptor):
    """Rejects calls whose ``authorization: Bearer <token>`` metadata is missing or wrong."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        for name, value in details.invocation_metadata or ():
            if name == AUTH_HEADER:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that fails with UNAUTHENTICATED."""

    def fail(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong auth token "
                      "(set client.auth_token to the server's server.auth_token)")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(fail)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(fail)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(fail)
    return grpc.unary_unary_rpc_method_handler(fail)
