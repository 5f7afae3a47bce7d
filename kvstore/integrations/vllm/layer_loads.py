"""One step's synchronous loads written layer by layer under vLLM's forward, and the
buffers loads are fetched into (``kvstore.integrations.vllm.worker_side`` drives them)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.client.block_buffers import new_rows
from kvstore.integrations.vllm.paged_layout import LayerCache, plan_scatter, scatter_layer
from kvstore.integrations.vllm.plans import BlockTransfer

log = logging.getLogger(__name__)


@dataclass
class Fetched:
    """A transfer's verified leading blocks: ``payloads`` ``[good, L, 2, block_size, H, D]``."""

    transfer: BlockTransfer
    payloads: torch.Tensor | None

    @property
    def block_ids(self) -> list[int]:
        n = 0 if self.payloads is None else self.payloads.shape[0]
        return self.transfer.block_ids[:n]


def touched_rows(rows: int, nbytes: int) -> torch.Tensor:
    """``new_rows`` with every page faulted in now, so no load pays for faulting its buffer's
    pages in inside the copy (several times the copy's own cost); synchronous loads reuse one
    such buffer, made before the first request and grown twice over when a load outgrows it."""
    buffer = new_rows(rows, nbytes)
    buffer.fill_(0)
    return buffer


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


class LayerLoads:
    """One step's synchronous loads, written layer by layer on the loader thread.

    On a GPU the writes are kernels on the loader thread's stream: each layer records a CUDA
    event that the forward's stream waits for (``wait``), so the attention of layer ``i`` reads
    it only once it is written, whichever stream vLLM computes on."""

    def __init__(self, layers: Sequence[LayerCache], fetched: list[Fetched]) -> None:
        self.device = layers[0].key.device
        self.written: list[Any] = [None] * len(layers)  # CUDA events, on a GPU
        self.done = [threading.Event() for _ in layers]
        self.waited: set[int] = set()
        self.block_ids = [b for f in fetched for b in f.transfer.block_ids]
        self.error: BaseException | None = None
        self._work = [(f, plan_scatter(layers[0], f.block_ids)) for f in fetched
                      if f.payloads is not None]
        self._layers = layers

    def wait(self, index: int) -> None:
        """Until layer ``index`` is written (on a GPU: the current stream waits for it)."""
        self.done[index].wait()
        event = self.written[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def run(self) -> None:
        try:
            if on_cuda(self.device):
                torch.cuda.set_device(self.device)  # this thread's kernels on the caches' GPU
            for i, layer in enumerate(self._layers):
                for fetched, plan in self._work:
                    assert fetched.payloads is not None
                    scatter_layer(layer, i, plan, fetched.payloads)
                if on_cuda(self.device):
                    self.written[i] = torch.cuda.Event()
                    self.written[i].record()
                self.done[i].set()
        except Exception as exc:  # every block of the step becomes a load error (finish_loads)
            log.exception("kvstore: writing loaded blocks failed; vLLM recomputes them")
            self.error = exc
            for event in self.done:
                event.set()
