"""``kvstore serve --engine vllm``'s flags, checked before anything starts."""

from __future__ import annotations

import argparse

import pytest

from kvstore.config import KVStoreConfig, WorkerConfig
from kvstore.errors import ConfigError
from tests.support.checkpoint import build_checkpoint

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from kvstore.integrations.vllm.serve_engine import (  # noqa: E402 - after the skip
    check_checkpoint,
    parse_engine_args,
    serve_engine,
)


def test_engine_args_are_vllms_names_in_a_json_object() -> None:
    assert parse_engine_args(None) == {}
    assert parse_engine_args('{"block_size": 32, "enforce_eager": true}') == {
        "block_size": 32, "enforce_eager": True}
    for text, message in [("{", "not valid JSON"), ("[1]", "JSON object"),
                          ('{"blok_size": 32}', "'blok_size' is not one of vLLM's"),
                          ('{"model": "x"}', "'model' is set by kvstore serve"),
                          ('{"kv_transfer_config": {}}', "is set by kvstore serve")]:
        with pytest.raises(ConfigError, match=message):
            parse_engine_args(text)


def test_the_engine_binds_each_role_to_its_cores_and_knows_its_context() -> None:
    args = argparse.Namespace(engine_args='{"max_model_len": 1024}', prefill_cpus="0",
                              decode_cpus="1-3")
    engine = serve_engine(args)
    assert engine.name == "vllm" and engine.num_cpus == 1.0 and engine.max_model_len == 1024
    assert engine.bind_args == ({"max_model_len": 1024},)
    assert engine.prefill_env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert engine.decode_env == {"VLLM_CPU_OMP_THREADS_BIND": "1-3"}
    with pytest.raises(ConfigError, match="core list"):
        serve_engine(argparse.Namespace(engine_args=None, prefill_cpus=" ", decode_cpus=None))


def test_only_a_checkpoint_directory_is_served(tmp_path) -> None:
    def config(model: str) -> KVStoreConfig:
        return KVStoreConfig(worker=WorkerConfig(model=model))

    with pytest.raises(ConfigError, match="checkpoint directory with safetensors"):
        check_checkpoint(config("tiny"), None)
    check_checkpoint(config(str(build_checkpoint(tmp_path / "m"))), None)
