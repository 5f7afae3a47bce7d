"""A vLLM KV connector that does nothing: what vLLM's connector machinery alone costs.

``bench_vllm`` compares a fresh instance loading its prefix from kvstore with vLLM's own prefix
cache in one process, which loads nothing. Part of the difference is no connector's doing:
with any connector configured, vLLM runs its connector hooks in the scheduler and the worker on
every step (the metadata built and sent to the worker, the per-layer calls, the outputs gathered
back). An instance with this connector, measured as the floor is (its own prefix cache, in the
same process), is the floor any connector starts from; the figures show both.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    """Matches nothing, loads nothing, saves nothing."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

