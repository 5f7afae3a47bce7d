"""kvstore as vLLM's KV connector: ``kv_connector_module_path: "kvstore.integrations.vllm"``,
``kv_connector: "KVStoreConnector"``.

``KVStoreConnector`` is loaded on first access so that the torch-only parts (``paged_layout``,
``namespace``) import without vLLM installed.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "KVStoreConnector":
        from kvstore.integrations.vllm.connector import KVStoreConnector

        return KVStoreConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
