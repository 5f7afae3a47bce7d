"""`kvstore start` on a cluster is secure by default; --insecure is plain and says so; rotation.

The Ray cluster (``ray.cluster_utils``) is not private to this process and its nodes bind the
host's network address, so a start with no security settings must come up with the cluster
token, TLS with a certificate per node from the cluster's CA, and the data key, all made in the
secrets directory. References: the secrets files themselves, the certificate a node presents
on its port, and payloads this test wrote, compared bitwise.
"""

# ruff: noqa: F811  (the cluster fixtures are imported, then named as test arguments)
from __future__ import annotations

import logging
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from kvstore.api import FetchedBlock
from kvstore.client.node_client import StoreNodeClient
from kvstore.cluster import credentials, lifecycle, operations, rotation
from kvstore.cluster.names import coordinator_handle
from kvstore.config import ClientConfig, KVStoreConfig
from kvstore.config_loader import load_config
from kvstore.errors import KVStoreError, Unauthenticated
from kvstore.keys import Namespace
from kvstore.security.ca import cert_info
from kvstore.security.secrets_store import SecretsStore
from tests.support.ray_cluster import (  # noqa: F401  - fixtures are found by name
    NS,
    make_chain_in,
    make_config,
    ray_cluster,
    ray_nodes,
    store_actor,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cluster-secrets") / "kvstore"


@pytest.fixture(scope="module")
def secure(ray_nodes: list[str], secrets_dir: Path) -> Iterator[tuple[KVStoreConfig, Any]]:
    config = make_config(secure=True)
    config.security.secrets_dir = str(secrets_dir)
    info = lifecycle.start(config)
    try:
        yield config, info
    finally:
        lifecycle.stop(config)


def client(address: str, **fields: Any) -> StoreNodeClient:
    return StoreNodeClient(address, config=ClientConfig(timeout_s=10, retries=0, **fields))


def keyed_namespace(config: KVStoreConfig) -> Namespace:
    data_key = config.security.data_key
    assert data_key
    return Namespace(NS.model_fingerprint, NS.dtype, NS.block_size, NS.num_layers,
                     NS.num_kv_heads, NS.head_dim, "tenant-a", data_key=bytes.fromhex(data_key))


def test_a_cluster_start_is_secure_by_default(secure, secrets_dir: Path) -> None:
    config, info = secure
    assert info.security == "secure" and info.secrets_created
    assert info.secrets_dir == str(secrets_dir)
    stored = SecretsStore(secrets_dir).load()
    running = lifecycle.running_config()
    assert running is not None
    assert running.server.auth_token == stored.token
    assert running.security.data_key == stored.data_key
    assert running.client.tls_ca_pem.strip() == stored.ca.cert_pem.strip()
    assert operations.security() == {
        "auth": True, "tls": True, "tenant_enforcement": True, "keyed_namespaces": True,
        "insecure": False, "rotation_in_progress": False, "secrets_dir": str(secrets_dir),
        "cert_days_left": pytest.approx(90, abs=1)}
    # A second start with the same (unset) security settings finds it running, unchanged.
    again = lifecycle.start(config)
    assert again.already_running and again.security == "secure"
    assert SecretsStore(secrets_dir).load().token == stored.token


def test_each_node_presents_a_certificate_for_its_ip_from_the_cluster_ca(
        secure, secrets_dir: Path) -> None:
    _, info = secure
    ca = SecretsStore(secrets_dir).load().ca
    for addr in info.nodes.values():
        host, _, port = addr.grpc_address.rpartition(":")
        pem = ssl.get_server_certificate((host, int(port)), timeout=10)
        got = cert_info(pem)
        assert host in got.hosts and not got.is_ca
        assert got.subject != cert_info(ca.cert_pem).subject
        ctx = ssl.create_default_context(cadata=ca.cert_pem)
        import socket

        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            pass  # verified against the CA, for this IP


def test_nodes_refuse_no_token_a_wrong_token_and_plaintext(secure) -> None:
    _, info = secure
    running = lifecycle.cluster_config(load_config(env={}))
    ca = running.client.tls_ca_pem
    for addr in info.nodes.values():
        for fields in ({"tls_ca_pem": ca}, {"tls_ca_pem": ca, "auth_token": "wrong" * 9}):
            c = client(addr.grpc_address, **fields)
            try:
                with pytest.raises(Unauthenticated):
                    c.health()
            finally:
                c.close()
        plain = client(addr.grpc_address, auth_token=running.client.auth_token)
        try:
            with pytest.raises(KVStoreError):
                plain.health()
        finally:
            plain.close()
        ok = client(addr.grpc_address, tls_ca_pem=ca, auth_token=running.client.auth_token)
        try:
            assert ok.health() is not None
        finally:
            ok.close()


def round_trip(config: KVStoreConfig, ns: Namespace, node_id: str, chain: Any) -> None:
    cfg = load_config(env={}, overrides={"client": {"node_id": node_id}})
    cfg.coordinator, cfg.index, cfg.pool = config.coordinator, config.index, config.pool
    store = lifecycle.connect(cfg)  # no token, no CA here: both come from the coordinator
    try:
        got = store.batch_get(ns, chain.keys, chain.tokens)
        for r, want in zip(got, chain.payloads, strict=True):
            assert isinstance(r, FetchedBlock), r
            assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))
    finally:
        store.close()


def put(config: KVStoreConfig, ns: Namespace, node_id: str, chain: Any) -> None:
    cfg = load_config(env={}, overrides={"client": {"node_id": node_id}})
    cfg.coordinator, cfg.index, cfg.pool = config.coordinator, config.index, config.pool
    store = lifecycle.connect(cfg)
    try:
        store.batch_put(ns, chain.puts(ns))
    finally:
        store.close()


def test_clients_get_credentials_from_the_running_cluster(secure, ray_nodes: list[str]) -> None:
    config, _ = secure
    running = lifecycle.cluster_config(load_config(env={}))
    ns = keyed_namespace(running)
    chain = make_chain_in(ns, 4)
    put(config, ns, ray_nodes[0], chain)
    round_trip(config, ns, ray_nodes[1], chain)  # the other node: over TLS
    round_trip(config, ns, ray_nodes[0], chain)


def test_a_restarted_store_node_gets_a_certificate_from_the_watcher(
        secure, ray_nodes: list[str]) -> None:
    _, info = secure
    node = ray_nodes[1]
    old = info.nodes[node]
    ray.kill(store_actor(node), no_restart=True)

    def back() -> bool:
        directory = ray.get(coordinator_handle().directory.remote())
        return node in directory and directory[node].grpc_address != old.grpc_address

    wait_for(back, 60, "the watcher to restart the store node")
    addr = ray.get(coordinator_handle().directory.remote())[node]
    running = lifecycle.cluster_config(load_config(env={}))
    c = client(addr.grpc_address, tls_ca_pem=running.client.tls_ca_pem,
               auth_token=running.client.auth_token)
    try:
        assert c.health() is not None
    finally:
        c.close()


def test_rotation_keeps_blocks_and_finish_refuses_the_old_token(
        secure, ray_nodes: list[str], secrets_dir: Path) -> None:
    config, _ = secure
    before = lifecycle.cluster_config(load_config(env={}))
    old_token = before.client.auth_token
    ns = keyed_namespace(before)
    chain = make_chain_in(ns, 3)
    put(config, ns, ray_nodes[0], chain)

    report = rotation.rotate(lifecycle.running_config(), store=SecretsStore(secrets_dir))
    assert report.step == "rotate" and not report.nodes_restart, report
    after = lifecycle.cluster_config(load_config(env={}))
    new_token = after.client.auth_token
    assert new_token != old_token and new_token == SecretsStore(secrets_dir).load().token
    assert after.security.data_key == before.security.data_key  # not rotated
    assert operations.security()["rotation_in_progress"]
    directory = ray.get(coordinator_handle().directory.remote())
    for token in (old_token, new_token):  # both accepted until --finish
        for addr in directory.values():
            c = client(addr.grpc_address, tls_ca_pem=after.client.tls_ca_pem, auth_token=token)
            try:
                assert c.health() is not None
            finally:
                c.close()
    round_trip(config, ns, ray_nodes[1], chain)  # put before the rotation, read after it

    rotation.rotate(lifecycle.running_config(), finish=True, store=SecretsStore(secrets_dir))
    assert not operations.security()["rotation_in_progress"]
    for addr in directory.values():
        c = client(addr.grpc_address, tls_ca_pem=after.client.tls_ca_pem, auth_token=old_token)
        try:
            with pytest.raises(Unauthenticated):
                c.health()
        finally:
            c.close()
    round_trip(config, ns, ray_nodes[0], chain)
    round_trip(config, ns, ray_nodes[1], chain)


def test_insecure_is_plain_and_says_so(secure, caplog: pytest.LogCaptureFixture) -> None:
    """Last in the module: it replaces the secure cluster (the fixture's stop is idempotent)."""
    config, _ = secure
    lifecycle.stop(config)
    plain = make_config()  # security.insecure
    with caplog.at_level(logging.WARNING, logger="kvstore.security"):
        info = lifecycle.start(plain)
    try:
        assert info.security == "insecure"
        assert any("INSECURE" in r.getMessage() for r in caplog.records)
        sec = operations.security()
        assert sec["insecure"] and not sec["auth"] and not sec["tls"]
        for addr in info.nodes.values():
            c = client(addr.grpc_address)
            try:
                assert c.health() is not None  # anyone: that is what insecure means
            finally:
                c.close()
    finally:
        lifecycle.stop(plain)


def test_plan_is_plain_only_on_loopback_or_a_private_ray() -> None:
    cfg = load_config(env={})
    here = [credentials.NodeInfo("n1", "127.0.0.1")]
    there = [credentials.NodeInfo("n1", "127.0.0.1"), credentials.NodeInfo("n2", "10.0.0.2")]
    assert credentials.plan_security(cfg, here).mode == "loopback"
    assert credentials.plan_security(cfg, there, private=True).mode == "loopback"
    insecure = load_config(env={}, overrides={"security": {"insecure": True}})
    assert credentials.plan_security(insecure, there).mode == "insecure"


def test_the_embedded_default_binds_loopback_only() -> None:
    """A private Ray names the host's network address as its node IP; the plain embedded
    default must still bind and advertise 127.0.0.1, or it would serve the network unguarded."""
    from kvstore.node.grpc_setup import bind_node_ip

    cfg = load_config(env={})
    kept = lifecycle.loopback_only(cfg).server
    assert (kept.host, kept.advertise_host) == ("127.0.0.1", "127.0.0.1")
    bound = bind_node_ip(kept, "192.0.2.7")
    assert (bound.host, bound.advertise_host) == ("127.0.0.1", "127.0.0.1")
    # Without loopback_only a store node binds the node's IP (what a cluster needs).
    assert bind_node_ip(cfg.server, "192.0.2.7").host == "192.0.2.7"
    # An operator's own bind address is never overridden.
    own = load_config(env={}, overrides={"server": {"host": "0.0.0.0"}})
    assert lifecycle.loopback_only(own).server.host == "0.0.0.0"
