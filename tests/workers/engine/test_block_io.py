"""``BlockIO.fetch``'s early path: what ``prepare`` makes while the read runs is kept only for a
read whose blocks arrive layer after layer (the one that uses it), and it is made for the
blocks asked for."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstore.client.early_fetch import LayerFeed
from kvstore.config import WorkerConfig
from kvstore.workers.engine.block_io import BlockIO


class EarlyStore:
    """A store whose early reads offer ``n`` blocks, layer after layer or not."""

    node_id = "here"

    def __init__(self, by_layer: bool) -> None:
        self.by_layer = by_layer

    def batch_get_early(self, namespace: Any, keys: list[bytes], tokens: list[list[int]], *,
                        device: torch.device) -> Any:
        store = self

        class Handle:
            feed = None

            def leading(self, by_layer: bool = False) -> tuple[list[torch.Tensor], bool]:
                blocks = torch.zeros(len(keys), 2, 2, 4, 1, 2)
                if by_layer and store.by_layer:
                    self.feed = LayerFeed(blocks, [None, None])
                return list(blocks.unbind(0)), not store.by_layer

            def result(self) -> list[Any]:
                return []

        return Handle()


@pytest.mark.parametrize("by_layer", [True, False])
def test_what_prepare_made_is_kept_only_for_a_layered_read(by_layer: bool) -> None:
    io = BlockIO(EarlyStore(by_layer), WorkerConfig(model="tiny", block_size=4,
                                                    publish_backlog_blocks=0),
                 torch.device("cpu"))
    asked: list[int] = []

    def prepare(num_blocks: int) -> str:
        asked.append(num_blocks)
        return "a cache"

    fetch = io.fetch(None, list(range(20)), [bytes([i]) * 32 for i in range(5)], 3,  # type: ignore[arg-type]
                     early=True, prepare=prepare)
    assert asked == [3] and len(fetch.payloads) == 3
    assert (fetch.made == "a cache") is by_layer and (fetch.feed is not None) is by_layer
