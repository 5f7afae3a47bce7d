"""What ``kvstore serve`` asks of Ray per engine, and how ``--engine`` reaches the launcher."""

from __future__ import annotations

import pytest

from kvstore.cli.main import build_parser
from kvstore.frontend.engines import ServeEngine, kvstore_engine


def make_engine(**overrides) -> ServeEngine:
    return ServeEngine("fake", lambda: (None, None), **overrides)


def test_kvstores_engine_asks_for_no_cpu_and_sets_no_environment() -> None:
    engine = kvstore_engine()
    assert engine.actor_options("prefill", 0.5) == {"num_cpus": 0.0, "num_gpus": 0.5}
    assert engine.check_model is None and engine.max_model_len is None


def test_each_role_gets_its_own_environment() -> None:
    engine = make_engine(num_cpus=1.0, prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
                         decode_env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert engine.actor_options("prefill", 0) == {
        "num_cpus": 1.0, "num_gpus": 0,
        "runtime_env": {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}}
    assert engine.actor_options("decode", 0)["runtime_env"]["env_vars"] == {
        "VLLM_CPU_OMP_THREADS_BIND": "1"}
    with pytest.raises(ValueError, match="num_cpus"):
        make_engine(num_cpus=-1)


def test_serve_parses_the_engine_and_its_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--engine", "vllm", "--model", "/ck", "--engine-args", '{"block_size": 32}',
         "--prefill-cpus", "0", "--decode-cpus", "1", "--max-ongoing-requests", "8"])
    assert (args.engine, args.engine_args, args.prefill_cpus, args.decode_cpus,
            args.max_ongoing_requests) == ("vllm", '{"block_size": 32}', "0", "1", 8)
    assert build_parser().parse_args(["serve"]).engine == "kvstore"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "sglang"])
