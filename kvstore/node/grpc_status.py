"""How each ``kvstore.errors`` class travels as a gRPC status code, both directions side by side.

The server aborts a call with ``ClassName: message`` and the code of ``status_for``; the client
rebuilds the class from that name, else from the code (``error_from_rpc``), so no
``grpc.RpcError`` reaches a caller. Both directions live in one module so a change to one table
is made beside the other; the client imports this, never the server.
"""

from __future__ import annotations

import grpc

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
    # No server sends it: the node did not answer before the caller's deadline (a cut link,
    # a hung process), which callers treat as unreachable, as they do a refused connection.
    grpc.StatusCode.DEADLINE_EXCEEDED: NodeUnavailable,
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
