"""Starting a kvstore gRPC server and opening a channel to one, with the same size limits,
credential check and TLS on both ends.

Used by the store node and the coordinator's index service (servers) and by their clients
(channels), so the message limit a server accepts is the one its clients send with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from kvstore.config import ClientConfig, ServerConfig
from kvstore.errors import ConfigError
from kvstore.node.auth import AuthGate, AuthInterceptor
from kvstore.security.tls import client_ca, server_cert_and_key

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
