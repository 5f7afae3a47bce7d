"""The background publisher: bounded backlog (wait or drop, counted), queued blocks readable by
their engine, a request never waiting for its own publish, and close publishing what is left."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore import metrics
from kvstore.client.local_store import LocalStore
from kvstore.config import WorkerConfig
from kvstore.keys import Namespace
from kvstore.workers.engine.background_publisher import BackgroundPublisher, PublishBatch
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

NS = Namespace("f" * 64, "float32", 4, 1, 1, 2)


class GatedStore(LocalStore):
    """A LocalStore whose puts wait for ``gate``: the publish backlog stays full meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.puts = 0

    def batch_put(self, namespace, blocks) -> None:
        assert self.gate.wait(30)
        self.puts += 1
        super().batch_put(namespace, blocks)


def batch(request_id: str, first_token: int, n: int) -> PublishBatch:
    keys = [bytes([first_token + i]) * 32 for i in range(n)]
    tokens = [[first_token + i] * 4 for i in range(n)]
    blocks = torch.arange(n * 16, dtype=torch.float32).reshape(n, 1, 2, 4, 1, 2) + first_token
    return PublishBatch(request_id, NS, keys, [NS.root] + keys[:-1], tokens, blocks)


def counter(outcome: str) -> float:
    return metrics.PUBLISH_BLOCKS.labels(outcome=outcome)._value.get()


def test_queued_blocks_are_readable_until_put_and_then_in_the_store() -> None:
    store = GatedStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=16)
    b = batch("r1", 10, 3)
    want = b.blocks.clone()
    assert pub.submit(b) == 3
    got = pub.pending(NS, [b.keys[0], b"x" * 32, b.keys[2]])
    assert sorted(got) == [0, 2] and torch.equal(got[2], want[2])
    assert pub.backlog_blocks == 3 and metrics.PUBLISH_BACKLOG._value.get() == 3
    store.gate.set()
    assert pub.wait("r1", timeout=30) == 3
    assert pub.pending(NS, b.keys) == {} and pub.backlog_blocks == 0
    assert set(store.blocks) == set(b.keys)
    pub.close()


def test_a_full_backlog_drops_and_counts_when_told_to() -> None:
    store = GatedStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=4, when_full="drop")
    dropped = counter("dropped")
    assert pub.submit(batch("a", 10, 3)) == 3
    assert pub.submit(batch("b", 20, 2)) == 0  # 3 + 2 > 4: dropped, not queued
    assert counter("dropped") - dropped == 2
    store.gate.set()
    assert pub.flush(30)
    assert len(store.blocks) == 3
    pub.close()


def test_a_full_backlog_makes_the_next_submit_wait_for_room() -> None:
    store = GatedStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=4, when_full="wait")
    waited = metrics.PUBLISH_WAIT._value.get()
    assert pub.submit(batch("a", 10, 3)) == 3
    done = threading.Event()
    t = threading.Thread(target=lambda: (pub.submit(batch("b", 20, 2)), done.set()))
    t.start()
    assert not done.wait(0.3)  # blocked: no room until the first batch is put
    store.gate.set()
    assert done.wait(30)
    t.join()
    assert pub.flush(30) and len(store.blocks) == 5
    assert metrics.PUBLISH_WAIT._value.get() > waited
    pub.close()


def test_the_backlog_is_bounded_in_bytes_of_device_memory_too() -> None:
    """Blocks queue as copies on the device: past ``max_backlog_bytes`` a submit drops (or
    waits) although the block count has room; the bytes are given back as batches are put."""
    store = GatedStore()
    one = batch("x", 0, 1).blocks.numel() * 4  # bytes of one block
    pub = BackgroundPublisher(store, max_backlog_blocks=100, max_backlog_bytes=4 * one,
                              when_full="drop")
    assert pub.submit(batch("a", 10, 3)) == 3
    assert pub.submit(batch("b", 20, 2)) == 0  # 5 blocks' bytes > 4: dropped
    assert pub.submit(batch("c", 30, 1)) == 1  # exactly 4: room
    store.gate.set()
    assert pub.flush(30)
    assert pub.submit(batch("d", 40, 4)) == 4  # the bytes came back with the puts
    assert pub.flush(30) and len(store.blocks) == 8
    pub.close()


def test_a_batch_larger_than_the_backlog_still_goes_in_alone() -> None:
    store = LocalStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=2)
    assert pub.submit(batch("big", 10, 5)) == 5
    assert pub.flush(30) and len(store.blocks) == 5
    pub.close()


def test_close_publishes_what_is_queued() -> None:
    store = GatedStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=64)
    for i in range(3):
        pub.submit(batch(f"r{i}", 10 * (i + 1), 2))
    store.gate.set()
    pub.close()
    assert len(store.blocks) == 6


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


def test_the_request_does_not_wait_for_its_publish_and_a_hit_equals_no_cache(model) -> None:
    """With the store's puts held back, a prefill returns (its blocks queued), the next request
    on the same engine hits them from the queue, and both match the store-less reference."""
    store = GatedStore()
    engine = Engine(model, store, WorkerConfig(block_size=16, prefill_chunk_tokens=64))
    tokens = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    sampling = SamplingParams(max_new_tokens=4)
    pre, dec = engine.generate(tokens, sampling=sampling, request_id="cold")
    assert pre.num_published_blocks == 6 and store.puts == 0  # still queued: not waited for
    pre2, dec2 = engine.generate(tokens, sampling=sampling, request_id="warm")
    assert pre2.cached_tokens == 96 and pre2.bytes_fetched == 0  # from the queue
    ref = Engine(model, None, engine.config).generate(tokens, sampling=sampling)
    assert dec.output_token_ids == dec2.output_token_ids == ref[1].output_token_ids
    store.gate.set()
    engine.wait_published()
    assert len(store.blocks) == 6
    engine.close()


def test_an_idle_publisher_thread_ends_and_the_next_submit_restarts_it(monkeypatch) -> None:
    """An engine nobody uses keeps no thread (and so no store) alive."""
    import time

    from kvstore.workers.engine import background_publisher as publish

    monkeypatch.setattr(publish, "IDLE_EXIT_S", 0.05)
    store = LocalStore()
    pub = BackgroundPublisher(store, max_backlog_blocks=8)
    assert pub._thread is None  # nothing submitted: no thread
    pub.submit(batch("a", 10, 2))
    assert pub.flush(30)
    deadline = time.monotonic() + 10
    while pub._thread is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pub._thread is None
    pub.submit(batch("b", 20, 2))
    assert pub.flush(30) and len(store.blocks) == 4
    pub.close()
