"""Early fetches (``kvstore.client.early_fetch``): rows offered before their verdicts, the verdicts
after; a read that offers nothing early hands over only verified blocks; a failed read raises
from ``result``. On the CPU with a scripted read (the CUDA offer is the direct path's, run by
the ``gpu`` tests through ``ClusterStore``), and end to end on the CPU through a store node,
where nothing is offered early: tests/workers/engine/test_engine_nodes.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.api import MISS_CORRUPTED, FetchedBlock, Miss
from kvstore.block import block_nbytes, payload_offset
from kvstore.client.device_copy import DeviceRows, EarlyRows
from kvstore.client.early_fetch import EarlyFetch
from kvstore.errors import NodeUnavailable
from kvstore.keys import Namespace

NS = Namespace("m", "float16", 4, 1, 1, 8)


def rows(n: int) -> DeviceRows:
    return DeviceRows(torch.device("cpu"), n, block_nbytes(NS), payload_offset=payload_offset(NS))


def scripted(offer: list[int] | None, gate: threading.Event, bad: int | None = None,
             error: BaseException | None = None):
    """A read that offers ``offer`` rows, waits for ``gate``, then returns its verdicts."""

    def read(ns, keys, tokens, sink):
        for i in range(len(keys)):
            sink.dst[i, sink.payload_offset:sink.payload_offset + NS.payload_nbytes] = i + 1
        if offer is not None:
            sink.issued(offer)
        assert gate.wait(10)
        if error is not None:
            raise error
        payloads = sink.payloads(ns)
        return [Miss(k, MISS_CORRUPTED) if i == bad else FetchedBlock(k, payloads[i], "n1")
                for i, k in enumerate(keys)]

    return read


def test_offered_rows_are_usable_before_their_verdicts() -> None:
    gate = threading.Event()
    keys = [bytes([i]) * 32 for i in range(5)]
    fetch = EarlyFetch(scripted([0, 1, 2, 4], gate, bad=1), NS, keys, [[0]] * 5, rows(5))
    payloads, verified = fetch.leading()  # returns while the read still waits for the gate
    assert not verified and len(payloads) == 3  # rows 0-2 lead; row 3 was not offered
    assert [int(p.view(torch.uint8).reshape(-1)[0]) for p in payloads] == [1, 2, 3]
    gate.set()
    got = fetch.result()
    assert isinstance(got[0], FetchedBlock) and isinstance(got[1], Miss)


def test_a_read_that_offers_nothing_hands_over_verified_blocks_only() -> None:
    gate = threading.Event()
    gate.set()
    keys = [bytes([i]) * 32 for i in range(4)]
    fetch = EarlyFetch(scripted(None, gate, bad=2), NS, keys, [[0]] * 4, rows(4))
    payloads, verified = fetch.leading()
    assert verified and len(payloads) == 2


def test_a_failed_read_raises_from_result_and_offers_nothing() -> None:
    gate = threading.Event()
    gate.set()
    fetch = EarlyFetch(scripted(None, gate, error=NodeUnavailable("gone")), NS,
                       [b"k" * 32], [[0]], rows(1))
    assert fetch.leading() == ([], True)
    with pytest.raises(NodeUnavailable, match="gone"):
        fetch.result()


def test_a_read_lets_the_caller_take_its_rows_before_it_goes_on(monkeypatch) -> None:
    """After offering rows, the read waits (bounded) until the caller has taken them: a read
    busy in Python would otherwise hold the GIL the caller needs to start computing."""
    took: list[bool] = []

    def read(ns, keys, tokens, sink):
        sink.issued([0, 1])
        sink.early.wait_taken()
        took.append(sink.early._taken.is_set())
        return [FetchedBlock(k, p, "n1") for k, p in zip(keys, sink.payloads(ns), strict=True)]

    keys = [bytes([i]) * 32 for i in range(2)]
    fetch = EarlyFetch(read, NS, keys, [[0]] * 2, rows(2))
    payloads, verified = fetch.leading()
    assert len(payloads) == 2 and not verified
    fetch.result()
    assert took == [True], "the read went on once the rows were taken"
    monkeypatch.setattr(EarlyRows, "TAKE_WAIT_S", 0.01)
    alone = EarlyRows()
    alone.offer([0], None)
    alone.wait_taken()  # nobody takes them: the read goes on after TAKE_WAIT_S
    assert not alone._taken.is_set()
