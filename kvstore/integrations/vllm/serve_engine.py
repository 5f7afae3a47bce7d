"""``kvstore serve --engine vllm``: the ``ServeEngine`` that puts vLLM engines behind the front end.

The CLI builds it from the command's flags and hands it to ``kvstore.frontend.launch``, which
knows engines only by this description (the front end sits below the integrations). It says:
which deployments to run (``serve_replicas``), the vLLM engine arguments both roles share
(``--engine-args``, checked here against ``AsyncEngineArgs`` so a typo fails before Ray
starts), the cores each role's engine threads are bound to on a CPU (``--prefill-cpus``,
``--decode-cpus``: ``VLLM_CPU_OMP_THREADS_BIND``), and one CPU per replica for Ray's
accounting: a replica's event loop and vLLM's engine process keep about one core busy
besides the model's threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from kvstore.config import KVStoreConfig
from kvstore.errors import ConfigError
from kvstore.frontend.engines import ServeEngine

#: Engine arguments ``kvstore serve`` sets itself (the model comes from ``--model``, the
#: connector and its role from the replica's kind).
RESERVED_ARGS = frozenset({"model", "kv_transfer_config"})
#: CPUs each vLLM replica asks Ray for.
REPLICA_CPUS = 1.0


def parse_engine_args(text: str | None) -> dict[str, Any]:
    """``--engine-args``: a JSON object of ``AsyncEngineArgs`` keyword arguments."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--engine-args is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--engine-args must be a JSON object of vLLM engine arguments")
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for name in value:
        if name in RESERVED_ARGS:
            raise ConfigError(f"--engine-args: {name!r} is set by kvstore serve (--model; the "
                              "connector's role follows the replica's kind)")
        if name not in known:
            raise ConfigError(f"--engine-args: {name!r} is not one of vLLM's engine arguments")
    return value


def check_checkpoint(config: KVStoreConfig, tokenizer_path: str | None) -> None:
    """What the front end and the connector need of ``--model``, before anything starts:
    a checkpoint directory with safetensors weights (the connector fingerprints them), a
    config and a tokenizer. vLLM checks the rest when its replicas load it."""
    from transformers import AutoConfig

    from kvstore.workers.model.tokenizer import tokenizer_for

    model = Path(config.worker.model)
    if not model.is_dir() or not any(model.glob("*.safetensors")):
        raise ConfigError(f"--engine vllm serves a checkpoint directory with safetensors "
                          f"weights; {config.worker.model!r} is not one")
    AutoConfig.from_pretrained(str(model), local_files_only=True)
    tokenizer_for(config.worker.model, tokenizer_path)


def _deployments() -> tuple[Any, Any]:
    from kvstore.integrations.vllm.serve_replicas import VLLMDecodeServer, VLLMPrefillServer

    return VLLMPrefillServer, VLLMDecodeServer


def _bind(cpus: str | None) -> dict[str, str]:
    if cpus is None:
        return {}
    if not cpus.strip():
        raise ConfigError("--prefill-cpus and --decode-cpus need a core list, e.g. 0 or 0-3")
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus.strip()}


def serve_engine(args: argparse.Namespace) -> ServeEngine:
    """The vLLM engine ``kvstore serve --engine vllm`` runs, from the command's flags."""
    engine_args = parse_engine_args(getattr(args, "engine_args", None))
    max_len = engine_args.get("max_model_len")
    return ServeEngine(
        "vllm", _deployments, bind_args=(engine_args,), num_cpus=REPLICA_CPUS,
        prefill_env=_bind(getattr(args, "prefill_cpus", None)),
        decode_env=_bind(getattr(args, "decode_cpus", None)),
        check_model=check_checkpoint, max_model_len=int(max_len) if max_len else None)
