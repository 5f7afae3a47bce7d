"""kvstore: a distributed KV-cache store for LLM inference with disaggregated prefill."""

__version__ = "0.1.0"
