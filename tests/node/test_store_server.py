"""StoreServer over real gRPC on port 0: verified two-phase put, get, limits, auth, TLS, bulk."""

from __future__ import annotations

import datetime
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from kvstore.block import encode_block
from kvstore.client.bulk_client import BulkClient
from kvstore.config import ServerConfig
from kvstore.errors import Unauthenticated
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.auth import AUTH_HEADER
from kvstore.node.block_pool import BlockPool
from kvstore.node.bulk_frames import encode_request
from kvstore.node.bulk_server import MAGIC
from kvstore.node.grpc_setup import grpc_options
from kvstore.node.proto_forms import spec_from_namespace
from kvstore.node.store_server import StoreServer
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc

NODE = "node-a"


def make_namespace(num_layers: int = 2, head_dim: int = 8, salt: str = "") -> Namespace:
    return Namespace("test-model", "float16", 16, num_layers, 2, head_dim, cache_salt=salt)


def make_blocks(ns: Namespace, num_blocks: int, seed: int = 0
                ) -> tuple[list[bytes], list[list[int]], list[bytearray]]:
    """Chained keys, their tokens, and encoded blocks with random payloads."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_blocks * ns.block_size,), generator=gen).tolist()
    keys = BlockHasher(ns).block_keys(tokens)
    per_block = [tokens[i * ns.block_size : (i + 1) * ns.block_size] for i in range(num_blocks)]
    parents = [ns.root, *keys[:-1]]
    blocks = [
        encode_block(ns, k, p, t, torch.randn(ns.payload_shape, generator=gen).to(ns.torch_dtype))
        for k, p, t in zip(keys, parents, per_block, strict=True)
    ]
    return list(keys), per_block, blocks


def put_messages(ns: Namespace | None, keys: list[bytes], blocks: list[bytearray]
                 ) -> Iterator[pb.PutChunk]:
    for i, (key, blk) in enumerate(zip(keys, blocks, strict=True)):
        msg = pb.PutChunk(key=key, total_nbytes=len(blk), offset=0, data=bytes(blk))
        if i == 0 and ns is not None:
            msg.namespace.CopyFrom(spec_from_namespace(ns))
        yield msg


@pytest.fixture
def node():
    pool = BlockPool(8 << 20)
    index = InMemoryIndex()
    server = StoreServer(pool, NODE, ServerConfig(max_message_bytes=4 << 20),
                         on_publish=index.publish)
    server.start()
    channel = grpc.insecure_channel(server.addresses[0],
                                    options=grpc_options(16 << 20))
    yield server, pb_grpc.StoreNodeStub(channel), index, pool
    channel.close()
    server.stop(0)
    pool.close()


def test_put_then_get_is_bitwise_and_visible_when_put_returns(node) -> None:
    server, stub, index, pool = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 4)
    resp = stub.Put(put_messages(ns, keys, blocks))
    assert resp.num_stored == 4
    # Visible in the index the moment Put returned, with the header's parent and namespace.
    assert index.lookup_prefix(keys).num_blocks == 4
    info = index.info(keys[1:2])[0]
    assert info is not None and info.parent_key == keys[0] and info.namespace_root == ns.root
    chunks = list(stub.Get(pb.KeysRequest(keys=[keys[2], b"\1" * 32, keys[0]])))
    assert [c.found for c in chunks] == [True, False, True]
    assert chunks[0].data == bytes(blocks[2]) and chunks[2].data == bytes(blocks[0])
    # Blocks are immutable: a second put of the same keys stores nothing new.
    assert stub.Put(put_messages(ns, keys, blocks)).num_existing == 4


def test_chunked_put_and_list_keys(node) -> None:
    _, stub, _, _ = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 2)
    blk = bytes(blocks[0])

    def chunks() -> Iterator[pb.PutChunk]:
        for off in range(0, len(blk), 1000):
            msg = pb.PutChunk(key=keys[0], total_nbytes=len(blk), offset=off,
                              data=blk[off : off + 1000])
            if off == 0:
                msg.namespace.CopyFrom(spec_from_namespace(ns))
            yield msg

    assert stub.Put(chunks()).num_stored == 1
    listed = [k for page in stub.ListKeys(pb.ListKeysRequest(page_size=1)) for k in page.keys]
    assert [(k.key, k.nbytes, k.parent_key) for k in listed] == [(keys[0], len(blk), ns.root)]


def test_corrupted_block_is_rejected_and_server_keeps_serving(node) -> None:
    _, stub, index, pool = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    blocks[1][-1] ^= 0xFF  # flip one payload byte: the checksum no longer holds
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(put_messages(ns, keys, blocks))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "checksum" in err.value.details()
    assert not pool.contains(keys[1]) and not pool.contains(keys[2])
    assert index.lookup_prefix(keys).num_blocks == 1  # the good block before it is published
    good_keys, _, good = make_blocks(ns, 2, seed=1)
    assert stub.Put(put_messages(ns, good_keys, good)).num_stored == 2


@pytest.mark.parametrize("case", ["no_namespace", "short_key", "bad_offset", "truncated",
                                  "wrong_key", "bad_namespace"])
def test_malformed_put_is_invalid_argument_and_frees_space(node, case: str) -> None:
    _, stub, _, pool = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 1)
    blk = bytes(blocks[0])
    spec = spec_from_namespace(ns)
    msg = pb.PutChunk(namespace=spec, key=keys[0], total_nbytes=len(blk), offset=0, data=blk)
    if case == "no_namespace":
        msg.ClearField("namespace")
    elif case == "short_key":
        msg.key = b"abc"
    elif case == "bad_offset":
        msg.offset = 7
    elif case == "truncated":
        msg.data = blk[:100]
    elif case == "wrong_key":
        msg.key = b"\2" * 32  # a valid block filed under another key
    elif case == "bad_namespace":
        msg.namespace.dtype = "complex128"
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter([msg]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pool.stats().used_bytes == 0  # the aborted reservation gave its space back
    assert stub.Put(put_messages(ns, keys, blocks)).num_stored == 1


def test_oversized_message_and_block_are_resource_exhausted(node) -> None:
    _, stub, _, _ = node
    ns = make_namespace()
    keys, _, _ = make_blocks(ns, 1)
    big = pb.PutChunk(namespace=spec_from_namespace(ns), key=keys[0], total_nbytes=5 << 20,
                      offset=0, data=bytes(5 << 20))  # above the server's 4 MiB limit
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter([big]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    huge = pb.PutChunk(namespace=spec_from_namespace(ns), key=keys[0], total_nbytes=1 << 30,
                       offset=0, data=b"x")  # larger than the whole pool
    with pytest.raises(grpc.RpcError) as err:
        stub.Put(iter([huge]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Health(pb.Empty()).serving


def test_two_2mib_blocks_in_one_stream(node) -> None:
    _, stub, _, _ = node
    ns = Namespace("test-model", "float16", 16, 32, 8, 128)  # 2 MiB payloads
    keys, _, blocks = make_blocks(ns, 2)
    assert len(blocks[0]) > 2 << 20
    assert stub.Put(put_messages(ns, keys, blocks)).num_stored == 2
    got = {c.key: c.data for c in stub.Get(pb.KeysRequest(keys=keys))}
    assert got[keys[1]] == bytes(blocks[1])


def test_leases_pin_blocks_against_eviction(node) -> None:
    _, stub, _, pool = node
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 2)
    stub.Put(put_messages(ns, keys, blocks))
    lease = stub.Lease(pb.LeaseRequest(keys=[keys[0], b"\3" * 32], ttl_s=30))
    assert [loc.key for loc in lease.locations] == [keys[0]] and lease.missing == [b"\3" * 32]
    assert lease.shm_path == pool.path
    with open(pool.path, "rb") as f:
        f.seek(lease.locations[0].offset)
        assert f.read(lease.locations[0].nbytes) == bytes(blocks[0])
    assert stub.Evict(pb.KeysRequest(keys=keys)).bytes_freed == len(blocks[1])
    assert pool.contains(keys[0])
    stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=30))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id))
    with pytest.raises(grpc.RpcError) as err:
        stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Evict(pb.KeysRequest(keys=keys)).bytes_freed == len(blocks[0])


def test_auth_token_is_required_on_grpc_and_bulk() -> None:
    pool = BlockPool(4 << 20)
    server = StoreServer(pool, NODE, ServerConfig(auth_token="s3cret"))
    server.start()
    try:
        channel = grpc.insecure_channel(server.addresses[0])
        stub = pb_grpc.StoreNodeStub(channel)
        for metadata in (None, ((AUTH_HEADER, "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Stats(pb.Empty(), metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Get(pb.KeysRequest(keys=[b"\0" * 32]), metadata=metadata))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Stats(pb.Empty(), metadata=((AUTH_HEADER, "Bearer s3cret"),)).node_id == NODE
        bulk_addr = server.addresses[1]
        with pytest.raises(Unauthenticated):
            BulkClient(bulk_addr, auth_token="wrong").fetch_into([b"\0" * 32], _no_alloc)
        assert BulkClient(bulk_addr, auth_token="s3cret").fetch_into(
            [b"\0" * 32], _no_alloc) == [None]
        channel.close()
    finally:
        server.stop(0)
        pool.close()


def _no_alloc(i: int, n: int) -> memoryview:
    raise AssertionError("no block expected")


def test_bulk_survives_garbage_and_vanishing_clients(node) -> None:
    server, stub, _, pool = node
    ns = Namespace("test-model", "float16", 16, 32, 8, 128)  # 2 MiB: larger than socket buffers
    keys, _, blocks = make_blocks(ns, 3)
    stub.Put(put_messages(ns, keys, blocks))
    host, port = server.addresses[1].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:  # not the protocol at all
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert s.recv(5)[:4] == MAGIC  # answered with an error status, then closed
    with socket.create_connection((host, int(port))) as s:  # a huge declared body
        s.sendall(struct.pack("<4sHI", MAGIC, 0, 1 << 30))
        assert s.recv(5)[:4] == MAGIC
    with socket.create_connection((host, int(port))) as s:  # asks, then vanishes mid-stream
        s.sendall(encode_request(b"", keys, "", None))
        s.recv(1000)
    deadline = time.monotonic() + 10
    while pool.stats().num_leased and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.stats().num_leased == 0  # the server released its lease
    bufs = [bytearray(len(b)) for b in blocks]
    assert BulkClient(server.addresses[1]).fetch_into(
        keys, lambda i, n: memoryview(bufs[i])) == [len(b) for b in blocks]
    assert bufs == blocks


def make_self_signed(tmp_path: Path) -> tuple[str, str]:
    """A throwaway cert for localhost / 127.0.0.1 and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_tls_round_trip_grpc_and_bulk(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    pool = BlockPool(4 << 20)
    server = StoreServer(pool, NODE, ServerConfig(tls_cert_file=cert, tls_key_file=key))
    server.start()
    try:
        ns = make_namespace()
        keys, _, blocks = make_blocks(ns, 2)
        creds = grpc.ssl_channel_credentials(Path(cert).read_bytes())
        with grpc.secure_channel(server.addresses[0], creds) as channel:
            stub = pb_grpc.StoreNodeStub(channel)
            assert stub.Put(put_messages(ns, keys, blocks)).num_stored == 2
        with grpc.insecure_channel(server.addresses[0]) as plain:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                pb_grpc.StoreNodeStub(plain).Health(pb.Empty(), timeout=2)
        bufs = [bytearray(len(b)) for b in blocks]
        BulkClient(server.addresses[1], tls_ca_file=cert).fetch_into(
            keys, lambda i, n: memoryview(bufs[i]))
        assert bufs == blocks
    finally:
        server.stop(0)
        pool.close()
