"""Who is calling a kvstore gRPC server: the credential check every call passes first, and
the caller's grant as the servicer sees it (docs/security.md §Credentials).

The check runs twice on purpose, cheaply. ``AuthInterceptor`` refuses a call whose credential
is missing or wrong before its request is read (the deny handler is request-streaming, so gRPC
never receives a 64 MiB message only to refuse it). The servicer then asks ``AuthGate.grant_of``
for the grant, from the same metadata: a verified credential is cached by the
``Authenticator``, so the second check is a dict lookup. Passing the grant through a
contextvar instead would be fragile: gRPC runs the interceptor on its polling thread and the
handler (and a streamed response's generator) on pool threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvstore.config import ServerConfig
from kvstore.errors import Unauthenticated
from kvstore.security.grants import Authenticator, Grant

AUTH_HEADER = "authorization"


def presented_credential(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    """The ``authorization`` metadata value (``Bearer <token>``), or None when absent."""
    for name, value in metadata or ():
        if name == AUTH_HEADER:
            return value.encode() if isinstance(value, str) else bytes(value)
    return None


class AuthGate:
    """The credentials one server accepts: the cluster token, the previous one while a rotation
    hands the new one out, and every tenant credential signed under either. Reloadable: a
    rotation swaps the ``Authenticator``; calls already past the check keep their grant."""

    def __init__(self, auth_token: str | None = None,
                 previous_auth_token: str | None = None) -> None:
        self._auth = Authenticator([auth_token, previous_auth_token])

    @classmethod
    def from_config(cls, config: ServerConfig) -> AuthGate:
        return cls(config.auth_token, config.previous_auth_token)

    def set_tokens(self, auth_token: str | None, previous_auth_token: str | None = None) -> None:
        """Accept ``auth_token`` (and ``previous_auth_token``) from the next call on."""
        self._auth = Authenticator([auth_token, previous_auth_token])

    @property
    def authenticator(self) -> Authenticator:
        return self._auth

    @property
    def enabled(self) -> bool:
        """False when no token is set: auth is off and every caller is admin."""
        return self._auth.enabled

    def authenticate(self, presented: str | bytes | None) -> Grant:
        """The grant of ``presented``; Unauthenticated if it is missing, wrong or expired."""
        return self._auth.authenticate(presented)

    def grant_of(self, context: grpc.ServicerContext) -> Grant:
        """The calling credential's grant (Unauthenticated if it is not valid, e.g. rotated
        away between the interceptor's check and now)."""
        return self._auth.authenticate(presented_credential(context.invocation_metadata()))


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a valid credential (UNAUTHENTICATED) before reading them."""

    def __init__(self, gate: AuthGate) -> None:
        self._gate = gate

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        gate = self._gate
        if not gate.enabled:
            return continuation(details)
        try:
            gate.authenticate(presented_credential(details.invocation_metadata))
        except Unauthenticated as exc:
            return _deny(str(exc))
        return continuation(details)


def _deny(reason: str) -> grpc.RpcMethodHandler:
    """A handler that fails with UNAUTHENTICATED without receiving the request: gRPC reads a
    unary request before calling its handler, a request-streaming handler reads on demand,
    and the wire does not tell the two kinds apart."""
    message = (f"Unauthenticated: {reason} (set client.auth_token to the cluster token or a "
               "credential from `kvstore credentials issue`)")

    def fail(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(fail)
