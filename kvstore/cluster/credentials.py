"""Secure by default: what `kvstore start` runs the cluster with, and how each part gets it.

The decision (``plan_security``), in this order:

1. ``security.insecure`` (``kvstore start --insecure``): plain, no auth, no TLS, logged loudly
   and shown by ``kvstore status``. Meant for a private network the operator vouches for.
2. the operator's own ``server.auth_token`` (and TLS files): used as given; whatever is missing
   (the CA, the data key) comes from the secrets directory.
3. every store node would bind loopback (the embedded single-machine default, and the Ray head
   `kvstore start` makes itself on 127.0.0.1), or Ray is private to this process: plain.
4. otherwise (a cluster: some node binds a network address): the cluster token, the data key
   and a private CA are loaded from the secrets directory or made there
   (``kvstore.security.secrets_store``); every store node gets a certificate for its own IP and
   host name, the coordinator's index service one for the head's, and clients the CA and the
   token through the running config (``client_config``).

Secrets travel only inside Ray (actor arguments and the coordinator's config, both behind
Ray's own token auth), never in argv or logs. docs/security.md describes the whole path.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.config import KVStoreConfig
from kvstore.node.grpc_setup import bind_node_ip
from kvstore.security.ca import CertificateAuthority, issue_server_cert
from kvstore.security.secrets_store import ClusterSecrets, SecretsStore

log = logging.getLogger("kvstore.security")

Mode = Literal["secure", "insecure", "loopback"]

INSECURE_WARNING = (
    "kvstore runs INSECURE (security.insecure / --insecure): no authentication, no TLS, no "
    "tenant checks, public namespace keys; anyone who reaches a store node's port can read, "
    "plant and delete KV. Use this only on a network you trust completely.")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A Ray node as placement and certificates need it."""

    node_id: str
    ip: str
    hostname: str = ""
    is_head: bool = False


@dataclass(slots=True)
class SecurityPlan:
    """What a start runs with; ``repr`` shows no secret."""

    mode: Mode
    reason: str
    token: str | None = field(default=None, repr=False)
    previous_token: str | None = field(default=None, repr=False)
    data_key: str | None = field(default=None, repr=False)
    ca: CertificateAuthority | None = field(default=None, repr=False)  # issues node certs
    ca_pem: str | None = field(default=None, repr=False)  # what clients trust
    operator_tls: bool = False  # the operator's own server.tls_* files: no certs issued here
    secrets_dir: str | None = None
    created: bool = False  # the secrets were made by this start

    @property
    def tls(self) -> bool:
        return self.operator_tls or self.ca is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def alive_nodes() -> list[NodeInfo]:
    """The alive Ray nodes with their IPs (the head marked)."""
    import ray

    return [NodeInfo(n["NodeID"], n.get("NodeManagerAddress", ""),
                     n.get("NodeManagerHostname", ""),
                     "node:__internal_head__" in (n.get("Resources") or {}))
            for n in ray.nodes() if n.get("Alive")]


def ray_is_private() -> bool:
    """Whether this process started the Ray instance it is connected to (``ray.init`` with
    no address): it lives and dies with this process, so it is the embedded default."""
    from ray._private import worker

    node = getattr(worker.global_worker, "node", None)
    return bool(node is not None and node.is_head())


def binds_network(config: KVStoreConfig, nodes: Iterable[NodeInfo]) -> bool:
    """Whether any store node (as ``bind_node_ip`` decides its bind address) leaves loopback."""
    return any(not is_loopback(bind_node_ip(config.server, n.ip).host) for n in nodes)


def plan_security(config: KVStoreConfig, nodes: list[NodeInfo], *, private: bool = False,
                  store: SecretsStore | None = None) -> SecurityPlan:
    """The security a start runs with (the order of the module docstring)."""
    sec, server = config.security, config.server
    if sec.insecure:
        log.warning(INSECURE_WARNING)
        return SecurityPlan("insecure", "security.insecure is set")
    if not server.auth_token and (private or not binds_network(config, nodes)):
        why = ("Ray is private to this process" if private else "every store node binds "
               "loopback")
        return SecurityPlan("loopback", f"{why}: the embedded single-machine default")
    operator_tls = server.tls_enabled
    needs_store = not (server.auth_token and sec.data_key and operator_tls)
    stored: ClusterSecrets | None = None
    created = False
    store = store or SecretsStore.for_config(sec)
    if needs_store:
        stored, created = store.load_or_create()
    token = server.auth_token or (stored.token if stored else None)
    previous = server.previous_auth_token or (stored.previous_token if stored else None)
    ca = None if operator_tls or stored is None else stored.ca
    ca_pem = config.client.tls_ca_pem or (ca.cert_pem if ca is not None else None)
    return SecurityPlan(
        "secure", "the operator's server.auth_token" if server.auth_token else
        f"store nodes bind network addresses; secrets in {store.path}",
        token=token, previous_token=previous,
        data_key=sec.data_key or (stored.data_key if stored else None), ca=ca, ca_pem=ca_pem,
        operator_tls=operator_tls, secrets_dir=str(store.path) if needs_store else None,
        created=created)


def secured_config(config: KVStoreConfig, plan: SecurityPlan) -> KVStoreConfig:
    """``config`` carrying the plan's token, data key and client trust (no node certificate)."""
    if plan.mode != "secure":
        return config
    server = dataclasses.replace(config.server, auth_token=plan.token,
                                 previous_auth_token=plan.previous_token)
    if not plan.operator_tls:
        server = dataclasses.replace(server, tls_cert_pem=None, tls_key_pem=None)
    client = dataclasses.replace(
        config.client, auth_token=config.client.auth_token or plan.token,
        tls_ca_pem=None if config.client.tls_ca_file else plan.ca_pem)
    security = dataclasses.replace(config.security, data_key=plan.data_key,
                                   secrets_dir=plan.secrets_dir or config.security.secrets_dir)
    return dataclasses.replace(config, server=server, client=client, security=security)


def cert_hosts(config: KVStoreConfig, nodes: Iterable[NodeInfo]) -> list[str]:
    """What a certificate for ``nodes`` must name: each node's bind and advertised address and
    host name."""
    hosts: list[str] = []
    for n in nodes:
        bound = bind_node_ip(config.server, n.ip)
        hosts += [bound.advertise_host or n.ip, bound.host, n.ip, n.hostname]
    return [h for h in dict.fromkeys(hosts) if h and h not in ("0.0.0.0", "::")]


def with_certificate(config: KVStoreConfig, plan: SecurityPlan, nodes: Iterable[NodeInfo]
                     ) -> KVStoreConfig:
    """``config`` with a new certificate for ``nodes`` (a store node's own, or the set the
    coordinator may land on), when the plan issues certificates."""
    if plan.ca is None:
        return config
    cert, key = issue_server_cert(plan.ca, cert_hosts(config, nodes))
    return dataclasses.replace(config, server=dataclasses.replace(
        config.server, tls_cert_pem=cert, tls_key_pem=key))


def summary(config: KVStoreConfig) -> dict[str, Any]:
    """What ``kvstore status`` shows about a running config: on/off only, never a secret."""
    auth = bool(config.server.auth_token)
    cert_days: float | None = None
    if config.server.tls_cert_pem:
        from kvstore.security.ca import cert_info

        cert_days = round(cert_info(config.server.tls_cert_pem).days_left(), 1)
    return {
        "auth": auth,
        "tls": config.server.tls_enabled,
        "tenant_enforcement": auth,  # grants are checked wherever a credential is
        "keyed_namespaces": bool(config.security.data_key),
        "insecure": bool(config.security.insecure),
        "rotation_in_progress": bool(config.server.previous_auth_token),
        "secrets_dir": config.security.secrets_dir,
        "cert_days_left": cert_days,  # the coordinator's (issued with the nodes')
    }


def with_redis_password(config: KVStoreConfig) -> KVStoreConfig:
    """``config`` with ``index.redis_password_file`` read into ``index.redis_password`` and
    ``redis_ca_file`` into ``redis_ca_pem`` (the files exist where `kvstore start` runs, while
    every store node opens the index itself); a ``rediss://`` URL with no CA named trusts the
    cluster CA from the secrets directory."""
    from kvstore.index.factory import redis_password

    index = config.index
    if index.backend != "redis":
        return config
    if index.redis_password_file:
        index = dataclasses.replace(index, redis_password=redis_password(index),
                                    redis_password_file=None)
    if index.redis_ca_file:  # likewise the CA of a rediss:// Redis
        try:
            with open(index.redis_ca_file) as f:
                ca = f.read()
        except OSError as exc:
            from kvstore.errors import ConfigError

            raise ConfigError(f"cannot read index.redis_ca_file {index.redis_ca_file}: "
                              f"{exc.strerror or exc}") from None
        index = dataclasses.replace(index, redis_ca_pem=ca, redis_ca_file=None)
    if ((index.redis_url or "").startswith("rediss://") and not index.redis_ca_pem
            and not config.security.insecure):
        # Redis's certificate from `kvstore credentials redis-conf --tls-host`: the cluster CA.
        store = SecretsStore.for_config(config.security)
        if store.exists():
            index = dataclasses.replace(index, redis_ca_pem=store.load().ca.cert_pem)
    return dataclasses.replace(config, index=index)


def client_config(config: KVStoreConfig, running: KVStoreConfig | None) -> KVStoreConfig:
    """A client's ``config`` completed from the running cluster's: the token (unless the
    client brings a tenant credential), the CA and the data key. Nothing is overridden."""
    if running is None:
        return config
    client = config.client
    if not client.auth_token and running.client.auth_token:
        client = dataclasses.replace(client, auth_token=running.client.auth_token)
    if not (client.tls_ca_file or client.tls_ca_pem) and running.client.tls_ca_pem:
        client = dataclasses.replace(client, tls_ca_pem=running.client.tls_ca_pem)
    security = config.security
    if not security.data_key and running.security.data_key:
        security = dataclasses.replace(security, data_key=running.security.data_key)
    return dataclasses.replace(config, client=client, security=security)
