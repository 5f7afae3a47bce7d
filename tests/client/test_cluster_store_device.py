"""``batch_get(..., device=...)`` over real store nodes (in process, in-memory index, no Ray):
the same payloads as ``device=None`` on every read path, and a bad block a miss on each.

Paths: same node with large blocks (straight from the arena, verified beside the copy), same
node with small blocks (gathered and verified as a batch), same node with the arena staged (as
when CUDA will not page-lock it), another node over the bulk channel, and over gRPC Get. Each
with an xxh3 namespace and a keyed (MAC) one. ``device="cpu"`` runs the device code on CI;
the ``gpu`` tests run the same with ``device="cuda"`` where there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

from kvstore import metrics
from kvstore.api import (
    MISS_CORRUPTED,
    MISS_MISMATCH,
    MISS_NOT_FOUND,
    BlockPut,
    FetchedBlock,
    Miss,
    NodeAddress,
)
from kvstore.block import block_nbytes, payload_offset, payload_view
from kvstore.client import device_reads
from kvstore.client.cluster_store import ClusterStore
from kvstore.client.local_store import LocalStore
from kvstore.client.shm_reader import SMALL_BLOCK_BYTES
from kvstore.config import ClientConfig, ServerConfig
from kvstore.constants import align_up
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
from tests.node.test_store_server import make_blocks
from tests.support.arena import corrupt_in_arena

FAST = ClientConfig(timeout_s=5, retries=1)
DATA_KEY = b"device-read-tests-cluster-data-key"
NUM_BLOCKS = 4
#: reader -> (the node the reader runs on, whether node-a is reachable over the bulk channel)
PATHS = {"shm": ("node-a", True), "staged": ("node-a", True), "bulk": ("node-b", True),
         "grpc": ("node-b", False)}


def make_namespace(size: str, keyed: bool) -> Namespace:
    """``small``: 2 KiB payloads (the batch path); ``large``: 384 KiB (block by block)."""
    layers, head_dim = (2, 8) if size == "small" else (24, 128)
    return Namespace("test-model", "float16", 16, layers, 2, head_dim,
                     cache_salt="tenant" if keyed else "", data_key=DATA_KEY if keyed else None)


@dataclass
class Cluster:
    index: InMemoryIndex
    pools: dict[str, BlockPool]
    directory: dict[str, NodeAddress]

    def store(self, reader: str, *, bulk: bool = True) -> ClusterStore:
        def resolve(node: str) -> NodeAddress:
            addr = self.directory[node]
            return addr if bulk else NodeAddress(addr.node_id, addr.grpc_address, None,
                                                 addr.shm_path)

        return ClusterStore(reader, self.index, resolve, FAST)


@pytest.fixture
def make_cluster() -> Iterator[Callable[[bool], Cluster]]:
    """Two started store nodes; ``keyed``: they hold the data key (keyed namespaces only)."""
    servers: list[StoreServer] = []
    pools: list[BlockPool] = []

    def make(keyed: bool) -> Cluster:
        index = InMemoryIndex()
        cluster = Cluster(index, {}, {})
        for node_id in ("node-a", "node-b"):
            pool = BlockPool(16 << 20)
            srv = StoreServer(pool, node_id, ServerConfig(), on_publish=index.publish,
                              data_key=DATA_KEY if keyed else None)
            srv.start()
            servers.append(srv)
            pools.append(pool)
            grpc_addr, bulk_addr = srv.addresses
            cluster.pools[node_id] = pool
            cluster.directory[node_id] = NodeAddress(node_id, grpc_addr, bulk_addr, pool.path)
        return cluster

    yield make
    for srv in servers:
        srv.stop(0)
    for pool in pools:
        pool.close()


def publish(cluster: Cluster, ns: Namespace) -> tuple[list[BlockPut], list[list[int]]]:
    """``NUM_BLOCKS`` blocks written to node-a."""
    keys, tokens, blocks = make_blocks(ns, NUM_BLOCKS, seed=7)
    parents = [ns.root, *keys[:-1]]
    puts = [BlockPut(k, p, t, payload_view(b, ns).clone())
            for k, p, t, b in zip(keys, parents, tokens, blocks, strict=True)]
    writer = cluster.store("node-a")
    writer.batch_put(ns, puts)
    writer.close()
    return puts, tokens


def check_device_batch(got: list[FetchedBlock | Miss], want: list[torch.Tensor | str],
                       ns: Namespace, device: torch.device) -> None:
    """Each result is the wanted payload (bitwise) or a miss with the wanted reason; fetched
    payloads are contiguous views into one buffer of rows on ``device`` (a whole block per
    row, ``ALIGN``-aligned, the payload after its header), and the rows of misses are
    zeros."""
    fetched = [g for g in got if isinstance(g, FetchedBlock)]
    assert fetched, "every batch here has good blocks"
    base = fetched[0].payload.untyped_storage()
    row_nbytes = align_up(block_nbytes(ns))
    rows = torch.empty(0, dtype=torch.uint8, device=device).set_(base).view(-1, row_nbytes)
    assert rows.shape[0] == len(got)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, str):
            assert isinstance(g, Miss) and g.reason == w, (i, g)
            assert not rows[i].any(), f"row {i} of a miss is not zeroed"
            continue
        assert isinstance(g, FetchedBlock), (i, g)
        assert g.payload.device == device and g.payload.shape == ns.payload_shape
        assert g.payload.untyped_storage().data_ptr() == base.data_ptr()
        assert g.payload.is_contiguous()
        assert g.payload.data_ptr() == base.data_ptr() + i * row_nbytes + payload_offset(ns)
        assert torch.equal(g.payload.view(torch.int16).cpu(), w.view(torch.int16).cpu())


def with_bad_blocks(cluster: Cluster, ns: Namespace
                    ) -> tuple[list[bytes], list[list[int]], list[torch.Tensor | str]]:
    """Publish four blocks on node-a and corrupt block 1 in its arena; returns keys and tokens
    to ask for (block 2 with wrong tokens, then an unknown key) and what each result must be."""
    puts, tokens = publish(cluster, ns)
    corrupt_in_arena(cluster.pools["node-a"], puts[1].key)
    keys = [p.key for p in puts] + [b"\7" * 32]
    asked = [*tokens[:2], [t + 1 for t in tokens[2]], tokens[3], tokens[0]]
    return keys, asked, [puts[0].payload, MISS_CORRUPTED, MISS_MISMATCH, puts[3].payload,
                         MISS_NOT_FOUND]


def read(cluster: Cluster, path: str, ns: Namespace, keys: list[bytes], asked: list[list[int]],
         device: str | None, monkeypatch: pytest.MonkeyPatch) -> list[FetchedBlock | Miss]:
    """``batch_get`` through one read path (``PATHS``; ``staged``: large same-node blocks go
    through host staging rows, as when CUDA will not page-lock the arena)."""
    with monkeypatch.context() as patch:
        if path == "staged":
            patch.setattr(device_reads, "reads_directly", lambda sink, reader: False)
        reader, bulk = PATHS[path]
        store = cluster.store(reader, bulk=bulk)
        try:
            return store.batch_get(ns, keys, asked, device=device)
        finally:
            store.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("path", list(PATHS))
def test_device_cpu_reads_equal_cpu_reads_and_bad_blocks_miss(make_cluster, monkeypatch,
                                                              path: str, size: str,
                                                              keyed: bool) -> None:
    cluster, ns = make_cluster(keyed), make_namespace(size, keyed)
    assert (block_nbytes(ns) <= SMALL_BLOCK_BYTES) == (size == "small")
    keys, asked, want = with_bad_blocks(cluster, ns)
    got = read(cluster, path, ns, keys, asked, "cpu", monkeypatch)
    check_device_batch(got, want, ns, torch.device("cpu"))
    # Without a device: today's CPU rows, the same verdicts and bytes.
    plain = read(cluster, path, ns, keys, asked, None, monkeypatch)
    for a, b in zip(got, plain, strict=True):
        assert type(a) is type(b)
        if isinstance(a, FetchedBlock) and isinstance(b, FetchedBlock):
            assert torch.equal(a.payload.view(torch.int16), b.payload.view(torch.int16))
        elif isinstance(a, Miss) and isinstance(b, Miss):
            assert a.reason == b.reason


def test_device_none_and_empty_batches(make_cluster) -> None:
    cluster, ns = make_cluster(False), make_namespace("small", False)
    store = cluster.store("node-a")
    assert store.batch_get(ns, [], [], device="cpu") == []
    puts, tokens = publish(cluster, ns)
    got = store.batch_get(ns, [puts[0].key], tokens[:1], device=torch.device("cpu"))
    assert isinstance(got[0], FetchedBlock) and got[0].payload.is_contiguous()
    with pytest.raises(ValueError, match="device"):
        store.batch_get(ns, [puts[0].key], tokens[:1], device="meta")
    store.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_local_store_device_reads(keyed: bool, size: str, device: str) -> None:
    store = LocalStore()
    ns = make_namespace(size, keyed)
    keys, tokens, blocks = make_blocks(ns, 3, seed=1)
    parents = [ns.root, *keys[:-1]]
    store.batch_put(ns, [BlockPut(k, p, t, payload_view(b, ns).clone())
                         for k, p, t, b in zip(keys, parents, tokens, blocks, strict=True)])
    store.corrupt(keys[1])
    plain = store.batch_get(ns, keys, tokens)
    got = store.batch_get(ns, keys, tokens, device=device)
    assert isinstance(plain[1], Miss) and plain[1].reason == MISS_CORRUPTED
    want: list[torch.Tensor | str] = [
        p.payload.to(device) if isinstance(p, FetchedBlock) else p.reason for p in plain]
    check_device_batch(got, want, ns, torch.device(device) if device == "cpu"
                       else torch.device("cuda", torch.cuda.current_device()))


# -- on a CUDA device (skipped without one) ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("path", list(PATHS))
def test_cuda_reads_equal_cpu_reads_and_bad_blocks_miss(make_cluster, monkeypatch, path: str,
                                                        size: str, keyed: bool) -> None:
    cluster, ns = make_cluster(keyed), make_namespace(size, keyed)
    keys, asked, want = with_bad_blocks(cluster, ns)
    got = read(cluster, path, ns, keys, asked, "cuda", monkeypatch)
    plain = read(cluster, path, ns, keys, asked, None, monkeypatch)  # device=None, then moved
    want = [p.payload.cuda() if isinstance(p, FetchedBlock) else w
            for p, w in zip(plain, want, strict=True)]
    check_device_batch(got, want, ns, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.gpu
def test_cuda_same_node_reads_page_lock_the_arena(make_cluster) -> None:
    """The fast path's premise: the driver page-locks the read-only arena mapping."""
    cluster, ns = make_cluster(False), make_namespace("large", False)
    puts, tokens = publish(cluster, ns)
    store = cluster.store("node-a")
    got = store.batch_get(ns, [p.key for p in puts], tokens, device="cuda")
    assert all(isinstance(g, FetchedBlock) for g in got)
    reader = store._client("node-a")._reader()
    assert reader.pin_for_dma(), "cudaHostRegister(read-only) refused: reads fall back to staging"
    direct = metrics.DEVICE_READS.labels("direct")._value.get()
    got = store.batch_get(ns, [p.key for p in puts], tokens, device="cuda")  # once it is locked
    assert all(isinstance(g, FetchedBlock) for g in got)
    assert metrics.DEVICE_READS.labels("direct")._value.get() == direct + 1
    store.close()  # unregisters before unmapping


@pytest.mark.gpu
@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "mac"])
def test_cuda_early_fetch_offers_rows_before_verdicts_and_then_rejects_bad_ones(
        make_cluster, keyed: bool) -> None:
    """A same-node read into the GPU with the arena page-locked offers its rows as soon as
    the copies are queued (unverified); the verdicts then equal ``batch_get``'s: the corrupted
    block and the one asked with other tokens are misses, the good ones bitwise right."""
    cluster, ns = make_cluster(keyed), make_namespace("large", keyed)
    keys, asked, want = with_bad_blocks(cluster, ns)
    store = cluster.store("node-a")
    assert store.prepare_device_reads("cuda", wait=True) == "direct"
    early = store.batch_get_early(ns, keys, asked, device="cuda")
    payloads, verified = early.leading()
    got = early.result()
    assert verified or len(payloads) == 4  # the four held blocks lead; the unknown key last
    device = torch.device("cuda", torch.cuda.current_device())
    check_device_batch(got, [w.to(device) if isinstance(w, torch.Tensor) else w for w in want],
                       ns, device)
    store.close()
