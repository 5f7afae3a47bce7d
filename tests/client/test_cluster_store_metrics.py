"""A reader's metrics reach its store node exactly once: tallied in the reader, pushed on close,
recorded and served by the node; the node's own figures (served, stored) match the run."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvstore import metrics, reader_metrics
from kvstore.api import MISS_MISMATCH, MISS_NOT_FOUND, FetchedBlock, Miss
from kvstore.block import block_nbytes
from kvstore.client.cluster_store import ClusterStore
from tests.client.test_cluster_store import FAST, cluster, make_puts  # noqa: F401 - fixture by name
from tests.node.test_store_server import make_blocks, make_namespace

SERIES = [("kvstore_hits_total", {}),
          ("kvstore_misses_total", {"reason": MISS_NOT_FOUND}),
          ("kvstore_misses_total", {"reason": MISS_MISMATCH}),
          ("kvstore_rejected_blocks_total", {"reason": MISS_MISMATCH}),
          ("kvstore_stored_blocks_total", {"source": "put"}),
          ("kvstore_stored_bytes_total", {"source": "put"})]
SERIES += [(f"kvstore_{what}_total", {"path": p}) for p in reader_metrics.PATHS
           for what in ("fetched_blocks", "fetched_bytes", "served_blocks", "served_bytes")]
SERIES += [("kvstore_fetch_latency_seconds_count", {"path": p}) for p in reader_metrics.PATHS]


def snapshot() -> dict[str, float]:
    return {f"{n}{sorted(lb.items())}": metrics.REGISTRY.get_sample_value(n, lb) or 0.0
            for n, lb in SERIES}


def key(name: str, **labels: str) -> str:
    return f"{name}{sorted(labels.items())}"


def wait_exact(want: dict[str, float], flush: Callable[[], object], before: dict[str, float]
               ) -> None:
    """Every series moved by exactly ``want`` (others not at all). Polled: another store left
    open in this process may hold the tally for a moment before handing it back."""
    deadline = time.monotonic() + 10.0
    while True:
        flush()
        now = snapshot()
        moved = {k: now[k] - before[k] for k in now if now[k] != before[k]}
        if moved == want or time.monotonic() > deadline:
            assert moved == want
            return
        time.sleep(0.05)


@pytest.mark.parametrize("reader", ["node-a", "node-b"])  # same node (shm), remote (bulk)
def test_a_run_is_counted_exactly_once_where_it_is_served(cluster, reader: str) -> None:  # noqa: F811
    index, _, directory = cluster
    ns = make_namespace()
    puts, tokens = make_puts(ns, 6)
    absent, absent_tokens, _ = make_blocks(ns, 2, seed=99)
    reader_metrics.take_pending()
    before = snapshot()
    ClusterStore("node-a", index, directory.__getitem__, FAST).batch_put(ns, puts)
    store = ClusterStore(reader, index, directory.__getitem__, FAST)
    wrong = [list(t) for t in tokens]
    wrong[5][0] += 1  # the sixth block comes back, but for other tokens: a mismatch
    got = store.batch_get(ns, [p.key for p in puts] + absent, wrong + absent_tokens)
    assert [type(r) for r in got] == [FetchedBlock] * 5 + [Miss] * 3
    assert [r.reason for r in got[5:]] == [MISS_MISMATCH, MISS_NOT_FOUND, MISS_NOT_FOUND]
    store.close()  # the push on close: a short job is counted too
    path = "shm" if reader == "node-a" else "bulk"
    nbytes = block_nbytes(ns)
    wait_exact({
        key("kvstore_hits_total"): 5,
        key("kvstore_misses_total", reason=MISS_NOT_FOUND): 2,
        key("kvstore_misses_total", reason=MISS_MISMATCH): 1,
        key("kvstore_rejected_blocks_total", reason=MISS_MISMATCH): 1,
        key("kvstore_stored_blocks_total", source="put"): 6,
        key("kvstore_stored_bytes_total", source="put"): 6 * nbytes,
        key("kvstore_fetched_blocks_total", path=path): 5,
        key("kvstore_fetched_bytes_total", path=path): 5 * nbytes,
        key("kvstore_served_blocks_total", path=path): 6,  # the mismatched one was served too
        key("kvstore_served_bytes_total", path=path): 6 * nbytes,
        key("kvstore_fetch_latency_seconds_count", path=path): 1,  # one batch, one node
    }, store.flush_metrics, before)


def test_a_reader_whose_node_is_gone_keeps_its_tally(cluster) -> None:  # noqa: F811
    index, nodes, directory = cluster
    reader_metrics.take_pending()
    store = ClusterStore("node-x", index, directory.__getitem__, FAST)  # not in the directory
    reader_metrics.record_hits(4)
    assert store.flush_metrics() is False
    assert reader_metrics.take_pending().hits == 4  # still pending, not lost
    store.close()


def test_a_node_refuses_a_report_with_an_unknown_label(cluster) -> None:  # noqa: F811
    from kvstore.client.node_client import StoreNodeClient
    from kvstore.errors import KVStoreError
    from kvstore.reader_metrics import ReaderTally

    _, _, directory = cluster
    hits = metrics.REGISTRY.get_sample_value("kvstore_hits_total") or 0.0
    bad = ReaderTally(hits=7)
    bad.misses["bored"] = 1
    with StoreNodeClient(directory["node-a"].grpc_address, config=FAST) as client:
        with pytest.raises(KVStoreError, match="unknown metrics miss reason"):
            client.report_reads(bad)
        client.report_reads(ReaderTally(hits=7))  # a good one lands
    assert metrics.REGISTRY.get_sample_value("kvstore_hits_total") == hits + 7
