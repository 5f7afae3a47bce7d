"""``kvstore rotate-credentials``: a new cluster token (and node certificates) without a restart.

Two steps, so no caller is ever refused in between:

1. ``rotate()``: a new token is made and saved (the old one kept as the previous token); every
   store node and the coordinator's index service first accept both, then present the new one
   in their own calls; the running config clients fetch carries the new one; new node
   certificates are issued (taken up when a node's server next starts). Blocks are untouched:
   the data key is not rotated, so everything stored stays readable.
2. ``rotate(finish=True)``, once every client has reconnected (tenant credentials re-issued
   under the new token): the previous token is dropped everywhere; calls presenting it, and
   credentials signed under it, are refused from then on.

The current tokens are also kept in Ray's internal KV (``OVERLAY_KEY``), so a watcher or a
running-config reader restarted by Ray with its original arguments still uses the rotated ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import ray

from kvstore.cluster.credentials import NodeInfo, alive_nodes, cert_hosts
from kvstore.cluster.names import RAY_NAMESPACE, WATCHER_NAME, coordinator_handle, store_actor_name
from kvstore.config import KVStoreConfig
from kvstore.errors import ConfigError, NodeUnavailable
from kvstore.security.ca import issue_server_cert
from kvstore.security.grants import new_cluster_token
from kvstore.security.secrets_store import ClusterSecrets, SecretsStore

#: Where the current tokens live in Ray's internal KV (namespace ``RAY_NAMESPACE``).
OVERLAY_KEY = b"kvstore:credentials"
_CALL_TIMEOUT_S = 30.0


@dataclass(slots=True)
class RotationReport:
    """What a rotation step did (no secret in it)."""

    step: str  # "rotate" | "finish"
    secrets_dir: str
    nodes_live: list[str] = field(default_factory=list)  # took the tokens without a restart
    nodes_restart: list[str] = field(default_factory=list)  # keep old tokens until restarted
    coordinator_live: bool = False


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv


def save_overlay(token: str | None, previous: str | None) -> None:
    _kv()._internal_kv_put(OVERLAY_KEY, json.dumps({"token": token, "previous": previous}),
                           overwrite=True, namespace=RAY_NAMESPACE)


def clear_overlay() -> None:
    """Forget the rotated tokens (``kvstore stop``: the next start begins afresh)."""
    try:
        _kv()._internal_kv_del(OVERLAY_KEY, namespace=RAY_NAMESPACE)
    except Exception:  # noqa: BLE001 - nothing was stored, or Ray has no KV here
        pass


def apply_overlay(config: KVStoreConfig) -> KVStoreConfig:
    """``config`` with the tokens of the last rotation, if any was made on this cluster."""
    if not config.server.auth_token:
        return config
    try:
        raw = _kv()._internal_kv_get(OVERLAY_KEY, namespace=RAY_NAMESPACE)
    except Exception:  # noqa: BLE001 - no KV (not connected): the config as given
        return config
    if not raw:
        return config
    tokens = json.loads(raw)
    return _with_tokens(config, tokens["token"], tokens["previous"])


def _with_tokens(config: KVStoreConfig, token: str, previous: str | None) -> KVStoreConfig:
    client_token = config.client.auth_token
    if client_token in (config.server.auth_token, config.server.previous_auth_token, None):
        client_token = token  # a cluster component: it uses the cluster token
    return dataclasses.replace(
        config, server=dataclasses.replace(config.server, auth_token=token,
                                           previous_auth_token=previous),
        client=dataclasses.replace(config.client, auth_token=client_token))


def _store_actors() -> dict[str, Any]:
    out = {}
    for node in alive_nodes():
        try:
            out[node.node_id] = ray.get_actor(store_actor_name(node.node_id),
                                              namespace=RAY_NAMESPACE)
        except ValueError:
            continue
    return out


def rotate(running: KVStoreConfig, *, finish: bool = False, store: SecretsStore | None = None
           ) -> RotationReport:
    """One step of the rotation (module docstring) on the cluster ``running`` describes."""
    if not running.server.auth_token:
        raise ConfigError("kvstore runs without authentication here: there is no token to "
                          "rotate (start it secure: see docs/security.md)")
    store = store or SecretsStore.for_config(running.security)
    if not store.exists():
        raise ConfigError(
            f"no cluster secrets in {store.path}: run rotate-credentials on the host that ran "
            "`kvstore start` (or pass --secrets-dir); a token set by hand in server.auth_token "
            "is rotated by hand (set previous_auth_token)")
    current = store.load()
    if current.token != running.server.auth_token:
        raise ConfigError(f"the running cluster token is not the one in {store.path}: "
                          "rotate where this cluster's secrets are kept (--secrets-dir)")
    if finish:
        if not current.previous_token:
            raise ConfigError("no rotation to finish: no previous token is accepted")
        new = dataclasses.replace(current, previous_token=None)
    else:
        if current.previous_token:
            raise ConfigError("a rotation is still in progress: run `kvstore "
                              "rotate-credentials --finish` first")
        new = dataclasses.replace(current, token=new_cluster_token(),
                                  previous_token=current.token)
    store.save(new)
    save_overlay(new.token, new.previous_token)
    report = RotationReport("finish" if finish else "rotate", str(store.path))
    _push(running, new, report, issue_certs=not finish and not _operator_tls(running))
    return report


def _operator_tls(config: KVStoreConfig) -> bool:
    return bool(config.server.tls_cert_file)


def _push(running: KVStoreConfig, new: ClusterSecrets, report: RotationReport, *,
          issue_certs: bool) -> None:
    actors = _store_actors()
    coordinator = coordinator_handle()
    nodes = {n.node_id: n for n in alive_nodes()}
    # Phase 1: every server accepts both tokens; phase 2: every caller presents the new one.
    for client_token in (None, new.token):
        calls = {}
        for node_id, actor in actors.items():
            cert: tuple[str | None, str | None] = (None, None)
            if client_token and issue_certs and running.client.tls_ca_pem:
                cert = _node_cert(running, new, nodes.get(node_id))
            calls[node_id] = actor.reload_credentials.remote(
                new.token, new.previous_token, client_token, *cert)
        live = {}
        for node_id, ref in calls.items():
            try:
                live[node_id] = bool(ray.get(ref, timeout=_CALL_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a dead node: the watcher restarts it rotated
                live[node_id] = False
        report.coordinator_live = bool(ray.get(coordinator.reload_credentials.remote(
            new.token, new.previous_token, new.token), timeout=_CALL_TIMEOUT_S))
    report.nodes_live = sorted(n for n, ok in live.items() if ok)
    report.nodes_restart = sorted(n for n, ok in live.items() if not ok)
    try:
        watcher = ray.get_actor(WATCHER_NAME, namespace=RAY_NAMESPACE)
    except ValueError:
        return
    ray.get(watcher.set_tokens.remote(new.token, new.previous_token), timeout=_CALL_TIMEOUT_S)


def _node_cert(running: KVStoreConfig, new: ClusterSecrets, node: NodeInfo | None
               ) -> tuple[str | None, str | None]:
    if node is None:
        return None, None
    return issue_server_cert(new.ca, cert_hosts(running, [node]))


def check_running(running: KVStoreConfig | None) -> KVStoreConfig:
    if running is None:
        raise NodeUnavailable("kvstore is not running on this Ray cluster: nothing to rotate "
                              "(run `kvstore start`)")
    return running
