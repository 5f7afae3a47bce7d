"""A device fetch the caller may compute on before its blocks are verified.

A same-node read into a GPU copies every leased block with DMA first and verifies the same
arena bytes on the host while the copies run (``kvstore.client.device_reads``). The copies land
long before the verdicts: hashing gigabytes on the host takes longer than the DMA, and as long
as the model's forward on those blocks. So a prefill starts computing on the blocks as soon as
their copies are queued, with its device work ordered after them on the GPU, and asks for the
verdicts only before it lets anything out of the computation (the first token, a publish):

    fetch = EarlyFetch(store, namespace, keys, tokens, device)   # the read runs on a thread
    payloads = fetch.leading()     # copies issued, not yet verified: ordered on the stream
    ... forward on payloads ...    # meanwhile the host verifies
    verdicts = fetch.result()      # the final FetchedBlock / Miss per key, as batch_get's

Where the copies went layer after layer (``leading(by_layer=True)``), not even the copies are
waited for: ``feed`` gives the blocks and a mark per layer, and the caller orders its use of
each layer after that layer's mark (``kvstore.workers.model.layer_fed_cache``).

If a block it used is rejected, the caller throws its computation away and recomputes from
the last good block: a rejected block costs time, never wrong output. Where the read takes any
other way (another node, staging, an arena not page-locked yet), nothing is offered early and
``leading`` returns the verified blocks once the read is done, as ``batch_get`` would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.api import FetchedBlock, Miss, TokenIds
from kvstore.client.device_copy import DeviceRows, EarlyRows
from kvstore.keys import Namespace

#: Runs the store's read into the rows (``ClusterStore._batch_get``).
Read = Callable[[Namespace, list[bytes], Sequence[TokenIds], DeviceRows],
                list[FetchedBlock | Miss]]


@dataclass(frozen=True, slots=True)
class LayerFeed:
    """Leading blocks whose copies went layer after layer: ``blocks`` is their
    ``[n, L, 2, bs, H, D]`` view, and layer ``l`` of every block has landed once ``marks[l]``
    has (CUDA events on the copy stream; None: already there)."""

    blocks: torch.Tensor
    marks: list[Any]

    def wait_layer(self, layer: int) -> None:
        """Order the caller's current stream after layer ``layer``'s copies."""
        mark = self.marks[layer]
        if mark is not None:
            torch.cuda.current_stream(self.blocks.device).wait_event(mark)


class EarlyFetch:
    """One batch read into ``sink`` on a thread of its own, its rows usable as they arrive."""

    def __init__(self, read: Read, namespace: Namespace, keys: list[bytes],
                 token_ids: Sequence[TokenIds], sink: DeviceRows) -> None:
        self.namespace = namespace
        self.sink = sink
        self.early = sink.early = EarlyRows()
        self._result: list[FetchedBlock | Miss] | None = None
        #: Set by ``leading(by_layer=True)`` where the blocks arrive layer after layer.
        self.feed: LayerFeed | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(read, keys, token_ids),
                                        daemon=True, name="kvstore-early-fetch")
        self._thread.start()

    def _run(self, read: Read, keys: list[bytes], token_ids: Sequence[TokenIds]) -> None:
        try:
            self._result = read(self.namespace, keys, token_ids, self.sink)
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc
        finally:
            self.early.close()

    def leading(self, by_layer: bool = False) -> tuple[list[torch.Tensor], bool]:
        """The payloads of the leading blocks usable now, ordered after their copies on the
        caller's current stream, and whether they are verified already (False: offered
        early, ``result`` says which are good).

        ``by_layer``: where the copies went layer after layer, order nothing yet and set
        ``feed`` instead (the leading blocks as one view and a mark per layer): the caller
        must then wait for layer ``l``'s mark before it reads layer ``l`` of any block, and
        must not read the payloads returned here otherwise."""
        rows, mark, layer_marks = self.early.wait()
        if not self._thread.is_alive() or not rows:
            self._thread.join()
            if self._error is not None or self._result is None:
                return [], True
            return _leading_payloads(self._result), True
        n = 0
        while n in rows:
            n += 1
        if by_layer and layer_marks is not None:
            self.feed = LayerFeed(self.sink.blocks(self.namespace, n), layer_marks)
        elif mark is not None:  # CUDA: the caller's work waits on the GPU, not the host
            torch.cuda.current_stream(self.sink.device).wait_event(mark)
        payloads = list(self.sink.payloads(self.namespace)[:n])
        self.early.took()
        return payloads, False

    def result(self) -> list[FetchedBlock | Miss]:
        """Every key's final outcome (as ``batch_get``'s), once verification is done; raises
        what the read raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _leading_payloads(results: list[FetchedBlock | Miss]) -> list[Any]:
    out = []
    for r in results:
        if not isinstance(r, FetchedBlock):
            break
        out.append(r.payload)
    return out
