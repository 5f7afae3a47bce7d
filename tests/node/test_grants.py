"""A store node's gRPC side enforces credentials and tenants (docs/security.md): every call
needs a valid credential, reads see only the namespace they name and only with a grant for
its tenant, writes need a write grant, admin calls the cluster token; leases are bound to the
credential that took them. Each refusal is checked against a legitimate reader on another
connection that still gets every one of its blocks, bitwise.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig, KVStoreConfig, ServerConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.index_service import IndexClient, IndexServer
from kvstore.errors import NamespaceMismatch, PermissionDenied, Unauthenticated
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import Namespace
from kvstore.node.auth import AUTH_HEADER
from kvstore.node.block_pool import BlockPool
from kvstore.node.grpc_setup import grpc_options
from kvstore.node.proto_forms import spec_from_namespace
from kvstore.node.store_server import StoreServer
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from kvstore.security.grants import issue_credential
from tests.coordinator.test_core import FakeClock, make_chain, make_entries
from tests.node.test_store_server import make_blocks

TOKEN = "cluster-token-" + "x" * 20
DATA_KEY = bytes(range(32))
FAST = ClientConfig(timeout_s=10, retries=0)


def tenant_ns(salt: str, data_key: bytes | None = DATA_KEY) -> Namespace:
    return Namespace("test-model", "float16", 16, 2, 2, 8, cache_salt=salt, data_key=data_key)


@dataclass
class Node:
    server: StoreServer
    pool: BlockPool
    index: InMemoryIndex
    ns_a: Namespace
    ns_b: Namespace
    keys_a: list[bytes]
    keys_b: list[bytes]
    blocks_a: list[bytes]
    blocks_b: list[bytes]
    reads: list[tuple[int, str]] = field(default_factory=list)
    clients: list[StoreNodeClient] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.addresses[0]

    def client(self, credential: str | None, *, same_node: bool = False,
               bulk: bool = False) -> StoreNodeClient:
        cfg = ClientConfig(timeout_s=10, retries=0, auth_token=credential, node_id="reader-node")
        c = StoreNodeClient(self.address, shm_path=self.pool.path, same_node=same_node,
                            bulk_address=self.server.addresses[1] if bulk else None,
                            config=cfg)
        self.clients.append(c)
        return c

    def stub(self) -> pb_grpc.StoreNodeStub:
        return pb_grpc.StoreNodeStub(grpc.insecure_channel(self.address,
                                                           options=grpc_options(16 << 20)))


def creds(tenant: str, *, write: bool = False) -> str:
    return issue_credential(TOKEN, f"{tenant}-{'w' if write else 'r'}", read=[tenant],
                            write=[tenant] if write else [])


@pytest.fixture
def node() -> Iterator[Node]:
    pool = BlockPool(8 << 20)
    index = InMemoryIndex()
    server = StoreServer(pool, "node-a", ServerConfig(auth_token=TOKEN,
                                                      max_message_bytes=4 << 20),
                         on_publish=index.publish, data_key=DATA_KEY)
    server.start()
    ns_a, ns_b = tenant_ns("tenant-a"), tenant_ns("tenant-b")
    keys_a, _, blocks_a = make_blocks(ns_a, 3, seed=1)
    keys_b, _, blocks_b = make_blocks(ns_b, 3, seed=2)
    n = Node(server, pool, index, ns_a, ns_b, keys_a, keys_b, [bytes(b) for b in blocks_a],
             [bytes(b) for b in blocks_b])
    server.on_read = lambda keys, reader: n.reads.append((len(keys), reader))
    writer_a, writer_b = n.client(creds("tenant-a", write=True)), n.client(
        creds("tenant-b", write=True))
    assert writer_a.put_blocks(ns_a, list(zip(keys_a, blocks_a, strict=True))).num_stored == 3
    assert writer_b.put_blocks(ns_b, list(zip(keys_b, blocks_b, strict=True))).num_stored == 3
    yield n
    for c in n.clients:
        c.close()
    server.stop(0)
    pool.close()


def assert_a_is_served(n: Node) -> None:
    """Tenant A's own reader, on its own connections, gets all of its blocks, bitwise."""
    reader = n.client(creds("tenant-a"))
    assert reader.get_blocks(n.keys_a, n.ns_a) == n.blocks_a
    same = n.client(creds("tenant-a"), same_node=True)
    bufs = [bytearray(len(b)) for b in n.blocks_a]
    assert same.get_blocks_into(n.keys_a, bufs, n.ns_a) == [len(b) for b in n.blocks_a]
    assert [bytes(b) for b in bufs] == n.blocks_a


EVERY_CALL = [
    ("Health", pb.Empty()), ("Stats", pb.Empty()), ("ListKeys", pb.ListKeysRequest()),
    ("Exists", pb.KeysRequest(keys=[b"\1" * 32])), ("Get", pb.KeysRequest(keys=[b"\1" * 32])),
    ("Lease", pb.LeaseRequest(keys=[b"\1" * 32])), ("Delete", pb.KeysRequest(keys=[b"\1" * 32])),
    ("Evict", pb.KeysRequest(keys=[b"\1" * 32])), ("RenewLease", pb.RenewLeaseRequest()),
    ("ReleaseLease", pb.ReleaseLeaseRequest()), ("ReportReads", pb.ReaderReport()),
    ("PutBatch", pb.PutBatchRequest()),
]


def call(stub: pb_grpc.StoreNodeStub, name: str, request: object,
         metadata: tuple | None = None) -> object:
    response = getattr(stub, name)(request, metadata=metadata, timeout=10)
    return list(response) if name in ("Get", "ListKeys") else response


@pytest.mark.parametrize("metadata", [None, ((AUTH_HEADER, "Bearer wrong"),),
                                      ((AUTH_HEADER, "Bearer " + creds("a")[:-4] + "AAAA"),)],
                         ids=["none", "wrong", "forged"])
def test_every_call_without_a_valid_credential_is_unauthenticated(node, metadata) -> None:
    stub = node.stub()
    for name, request in EVERY_CALL:
        with pytest.raises(grpc.RpcError) as err:
            call(stub, name, request, metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    with pytest.raises(grpc.RpcError) as err:  # a Put stream too, before its body is read
        stub.Put(iter([pb.PutChunk(namespace=spec_from_namespace(node.ns_a), key=b"\1" * 32,
                                   total_nbytes=1 << 40, data=b"x")]), metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert node.pool.keys() and len(node.pool.keys()) == 6
    assert_a_is_served(node)


def test_tenant_b_sees_none_of_tenant_a(node) -> None:
    reader_b = node.client(creds("tenant-b"))
    # In its own namespace, A's keys read as absent: no bytes, no token ids, no presence.
    assert reader_b.get_blocks(node.keys_a, node.ns_b) == [None] * 3
    assert reader_b.exists(node.keys_a + node.keys_b, node.ns_b) == [False] * 3 + [True] * 3
    lease = reader_b.lease(node.keys_a + node.keys_b, 30.0, namespace=node.ns_b)
    assert [loc.key for loc in lease.locations] == node.keys_b
    assert lease.missing == node.keys_a
    reader_b.release(lease.lease_id)
    # Naming A's namespace, or none, is refused.
    for attempt in (lambda: reader_b.get_blocks(node.keys_a, node.ns_a),
                    lambda: reader_b.get_blocks(node.keys_a),
                    lambda: reader_b.exists(node.keys_a, node.ns_a),
                    lambda: reader_b.exists(node.keys_a),
                    lambda: reader_b.lease(node.keys_a, 30.0, namespace=node.ns_a),
                    lambda: reader_b.lease(node.keys_a, 30.0)):
        with pytest.raises(PermissionDenied):
            attempt()
    assert node.pool.stats().num_leased == 0
    assert_a_is_served(node)


class CountingCalls:
    """A client's gRPC stub that counts the Lease and Exists calls made through it."""

    def __init__(self, stub: object) -> None:
        self.stub, self.calls = stub, {"Lease": 0, "Exists": 0}

    def __getattr__(self, name: str) -> object:
        if name in self.calls:
            self.calls[name] += 1
        return getattr(self.stub, name)


def test_same_node_calls_on_the_bulk_channel_are_judged_as_on_grpc(node) -> None:
    """A same-node reader leases and asks what is held over the bulk channel; the node applies
    the same rules (the namespace filter, the tenant's grant, leases bound to their
    credential), and a refusal there is asked again on gRPC, which raises the typed error."""
    reader_b = node.client(creds("tenant-b"), same_node=True, bulk=True)
    grpc = reader_b._stub = CountingCalls(reader_b._stub)
    lease = reader_b.lease(node.keys_a + node.keys_b, 30.0, namespace=node.ns_b)
    assert [loc.key for loc in lease.locations] == node.keys_b
    assert lease.missing == node.keys_a
    assert reader_b.exists(node.keys_a + node.keys_b, node.ns_b) == [False] * 3 + [True] * 3
    assert grpc.calls == {"Lease": 0, "Exists": 0}
    for attempt in (lambda: reader_b.lease(node.keys_a, 30.0, namespace=node.ns_a),
                    lambda: reader_b.lease(node.keys_a, 30.0),
                    lambda: reader_b.exists(node.keys_a, node.ns_a)):
        with pytest.raises(PermissionDenied):
            attempt()
    assert grpc.calls == {"Lease": 2, "Exists": 1}  # each refusal asked gRPC for its error
    other = node.client(creds("tenant-a"), same_node=True, bulk=True)
    other.release(lease.lease_id)  # another credential's release is ignored
    assert node.pool.stats().num_leased == 3
    reader_b.release(lease.lease_id)
    assert node.pool.stats().num_leased == 0
    # tenant B's blocks come bitwise through a lease taken on the bulk channel
    bufs = [bytearray(len(b)) for b in node.blocks_b]
    assert reader_b.get_blocks_into(node.keys_b, bufs, node.ns_b) == [len(b) for b in bufs]
    assert [bytes(b) for b in bufs] == node.blocks_b and grpc.calls["Lease"] == 2


def test_another_namespace_of_the_same_tenant_sees_nothing(node) -> None:
    """The filter is the namespace root, not just the tenant: the same tenant reading as
    another model finds none of the blocks (the node computes the root with its own copy of
    the data key; a reader never sends one)."""
    reader = node.client(creds("tenant-a"))
    other_model = Namespace("other-model", "float16", 16, 2, 2, 8, cache_salt="tenant-a")
    assert reader.get_blocks(node.keys_a, other_model) == [None] * 3
    assert reader.exists(node.keys_a, other_model) == [False] * 3
    assert_a_is_served(node)


def test_admin_calls_need_the_cluster_token(node) -> None:
    stub = node.stub()
    for cred in (creds("tenant-a"), creds("tenant-a", write=True)):
        md = ((AUTH_HEADER, f"Bearer {cred}"),)
        for name, request in [("Stats", pb.Empty()), ("ListKeys", pb.ListKeysRequest()),
                              ("Delete", pb.KeysRequest(keys=node.keys_a)),
                              ("Evict", pb.KeysRequest(keys=node.keys_a)),
                              ("ReportReads", pb.ReaderReport(hits=1))]:
            with pytest.raises(grpc.RpcError) as err:
                call(stub, name, request, md)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "admin" in err.value.details()
        assert call(stub, "Health", pb.Empty(), md).node_id == "node-a"  # any valid credential
    assert len(node.pool.keys()) == 6
    assert_a_is_served(node)
    admin = node.client(TOKEN)
    assert len(admin.list_keys()) == 6 and admin.stats().num_blocks == 6
    # The cluster token reads without a namespace (replication) and sees every tenant.
    assert admin.get_blocks(node.keys_a + node.keys_b) == node.blocks_a + node.blocks_b


def test_writes_need_a_write_grant_for_the_namespace_tenant(node) -> None:
    keys, _, blocks = make_blocks(node.ns_a, 2, seed=7)
    pairs = list(zip(keys, blocks, strict=True))
    for cred in (creds("tenant-a"), creds("tenant-b", write=True)):
        with pytest.raises(PermissionDenied):
            node.client(cred).put_blocks(node.ns_a, pairs)
    assert not any(node.pool.contains(k) for k in keys)
    assert node.index.lookup_prefix(keys).num_blocks == 0
    assert node.client(creds("tenant-a", write=True)).put_blocks(node.ns_a, pairs).num_stored == 2


def test_blocks_keyed_without_the_data_key_are_refused(node) -> None:
    """The planting attack: a writer without the data key computes a public prompt's keys
    under the public (sha256) root and Puts first; the node verifies against the keyed root,
    refuses them, and the victim's keyed read is a miss, then its own Put stores its KV."""
    public = tenant_ns("", None)
    keys, _, planted = make_blocks(public, 2, seed=9)
    attacker = node.client(issue_credential(TOKEN, "attacker", write=[""]))
    with pytest.raises(NamespaceMismatch):
        attacker.put_blocks(public, list(zip(keys, planted, strict=True)))
    assert not any(node.pool.contains(k) for k in keys)
    victim_ns = tenant_ns("")
    victim_keys, _, victim_blocks = make_blocks(victim_ns, 2, seed=9)
    victim = node.client(TOKEN)
    assert victim.get_blocks(victim_keys, victim_ns) == [None, None]
    victim.put_blocks(victim_ns, list(zip(victim_keys, victim_blocks, strict=True)))
    assert victim.get_blocks(victim_keys, victim_ns) == [bytes(b) for b in victim_blocks]


def test_reader_node_is_believed_only_from_the_cluster_token(node) -> None:
    node.reads.clear()
    node.client(creds("tenant-a")).get_blocks(node.keys_a, node.ns_a)
    node.client(TOKEN).get_blocks(node.keys_a, node.ns_a)
    assert node.reads == [(1, "")] * 3 + [(1, "reader-node")] * 3


def test_leases_are_bound_to_the_credential_that_took_them(node) -> None:
    owner, other = node.client(creds("tenant-a")), node.client(creds("tenant-b"))
    lease = owner.lease(node.keys_a, 30.0, namespace=node.ns_a)
    assert len(lease.locations) == 3 and len(lease.lease_id) >= 20
    second = owner.lease(node.keys_a[:1], 30.0, namespace=node.ns_a)
    assert second.lease_id != lease.lease_id and not lease.lease_id.isdigit()
    other.release(lease.lease_id)  # ignored, quietly
    with pytest.raises(PermissionDenied):
        other.renew(lease.lease_id, 30.0)
    assert node.pool.stats().num_leased == 3
    owner.renew(lease.lease_id, 30.0)
    owner.release(lease.lease_id)
    owner.release(second.lease_id)
    assert node.pool.stats().num_leased == 0


def test_rotation_swaps_the_accepted_tokens_and_keeps_the_blocks(node) -> None:
    new = "rotated-token-" + "y" * 20
    old_reader = creds("tenant-a")
    node.server.set_auth_tokens(new, TOKEN)  # the hand-over: both accepted
    for cred in (old_reader, TOKEN, new, issue_credential(new, "a", read=["tenant-a"])):
        assert node.client(cred).get_blocks(node.keys_a, node.ns_a) == node.blocks_a
    node.server.set_auth_tokens(new, None)  # the old token and what it signed are void now
    for cred in (old_reader, TOKEN):
        with pytest.raises(Unauthenticated):
            node.client(cred).get_blocks(node.keys_a, node.ns_a)
    fresh = node.client(issue_credential(new, "a", read=["tenant-a"]))
    assert fresh.get_blocks(node.keys_a, node.ns_a) == node.blocks_a


def test_the_index_service_lets_tenants_look_up_and_only_the_cluster_token_publish() -> None:
    core = CoordinatorCore(KVStoreConfig(), clock=FakeClock())
    server = IndexServer(core, ServerConfig(auth_token=TOKEN), 0)
    server.start()
    chain = make_chain(3, uuid.uuid4().hex)
    try:
        tenant = IndexClient(server.address, ClientConfig(timeout_s=5, retries=0,
                                                          auth_token=creds("tenant-a")))
        with pytest.raises(PermissionDenied):
            tenant.publish("node-a", make_entries("node-a", chain))
        assert core.lookup_prefix(chain).num_blocks == 0
        admin = IndexClient(server.address, ClientConfig(timeout_s=5, retries=0,
                                                         auth_token=TOKEN))
        admin.publish("node-a", make_entries("node-a", chain))
        assert tenant.lookup_prefix(chain).num_blocks == 3
        anonymous = IndexClient(server.address, FAST)
        with pytest.raises(Unauthenticated):
            anonymous.lookup_prefix(chain)
        server.set_auth_tokens("another-token-" + "z" * 20)
        with pytest.raises(Unauthenticated):
            admin.lookup_prefix(chain)
        for c in (tenant, admin, anonymous):
            c.close()
    finally:
        server.stop()
