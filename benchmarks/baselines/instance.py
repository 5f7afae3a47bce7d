"""Cross-instance reuse through another project's KV connector: the baselines of bench_vllm.

``run_xinstance`` does for Mooncake's store or LMCache what bench_vllm does for kvstore: start the
baseline's servers, let instance A publish the first questions through its connector, then ask a
fresh instance B the second ones, whose prefix exists only in the baseline's store. Each instance
is ``python -m benchmarks.vllm_instance`` (the same measurement as kvstore's, RESULTS line and
all) run by the baseline's venv from ``setup.sh``, because neither baseline installs beside
kvstore. When something is missing or fails, the answer is a one-line reason instead of results,
for the bench's ``skipped``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.baselines.servers import (
    LOOPBACK,
    ServerFailed,
    Servers,
    start_lmcache_server,
    start_mooncake,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENVS = Path("/work/venvs")
BASELINES = ("mooncake", "lmcache")
# The settings a baseline is tried at, its best kept: LMCache saves whole chunks only.
CHUNK_SIZES = {"mooncake": (256,), "lmcache": (256, 128)}
INSTANCE_TIMEOUT_S = 1800


def venv_dir(name: str, env: Mapping[str, str]) -> Path:
    """The baseline's venv: ``$KVSTORE_BASELINE_VENVS/NAME`` (default /work/venvs/NAME)."""
    return Path(env.get("KVSTORE_BASELINE_VENVS") or DEFAULT_VENVS) / name


def _lmcache(servers: Servers, venv: Path, work: Path, chunk_size: int
             ) -> tuple[dict[str, Any], dict[str, str]]:
    """LMCache's connector (ours for the CPU copy) and a config pointing at its KV server."""
    url = start_lmcache_server(servers, venv / "bin" / "python")
    config = work / "lmcache.yaml"
    # Only whole chunks are saved. sha256_cbor: LMCache's default pre-caching hash differs
    # between vLLM's scheduler and worker processes, so nothing would ever hit.
    config.write_text(f"chunk_size: {chunk_size}\nlocal_cpu: true\nmax_local_cpu_size: 2.0\n"
                      "pre_caching_hash_algorithm: sha256_cbor\n"
                      f'remote_url: "{url}"\nremote_serde: "naive"\n')
    prometheus = work / "prometheus"
    prometheus.mkdir()
    return ({"kv_connector": "LMCacheCPUConnector",
             "kv_connector_module_path": "benchmarks.baselines.lmcache_cpu"},
            {"LMCACHE_CONFIG_FILE": str(config), "PYTHONHASHSEED": "0",
             "PROMETHEUS_MULTIPROC_DIR": str(prometheus)})


def _mooncake(servers: Servers, venv: Path, work: Path, chunk_size: int
              ) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's own Mooncake store connector, over TCP, against a standalone client's memory."""
    addresses = start_mooncake(servers, venv / "bin")
    config = work / "mooncake.json"
    # global_segment_size 0: vLLM contributes no memory, the standalone client owns it all.
    config.write_text(json.dumps({**addresses, "protocol": "tcp", "device_name": "",
                                  "mode": "standalone-store", "global_segment_size": 0,
                                  "local_buffer_size": "512MB"}))
    return ({"kv_connector": "MooncakeStoreConnector"},
            {"MOONCAKE_CONFIG_PATH": str(config), "VLLM_HOST_IP": LOOPBACK})


CONNECTORS = {"lmcache": _lmcache, "mooncake": _mooncake}


def _instance(python: Path, env: dict[str, str], job: dict[str, Any], log: Path
              ) -> list[dict[str, Any]]:
    """One vLLM instance in the baseline's venv; its RESULTS, or RuntimeError with the cause.

    The instance leads a session of its own, so a timeout ends it together with the engine
    processes vLLM spawned (its process group, by the instance's PID).
    """
    with log.open("w") as err:
        process = subprocess.Popen(
            [str(python), "-m", "benchmarks.vllm_instance", json.dumps(job)], env=env,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=INSTANCE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    lines = [x for x in stdout.splitlines() if x.startswith("RESULTS ")]
    if process.returncode != 0 or not lines:
        text = log.read_text(errors="replace").splitlines()
        raised = [x for x in text if re.match(r"^[\w.]*(Error|Exception)\b", x.strip())]
        cause = (raised or [x for x in text if x.strip()] or ["(no output)"])[-1].strip()
        raise RuntimeError(f"a vLLM instance exited with {process.returncode}: {cause[:300]}")
    return json.loads(lines[-1].removeprefix("RESULTS "))


def run_xinstance(baseline: str, model: str, first: list[list[int]], second: list[list[int]],
                  env: Mapping[str, str], *, block_size: int, max_tokens: int,
                  chunk_size: int = 256, work: Path | None = None, kv_cache_dtype: str = "auto"
                  ) -> list[dict[str, Any]] | str:
    """Instance A publishes ``first`` through ``baseline``; fresh B answers ``second``.

    Returns B's per-prompt results (``ttft_s``, ``tokens``, ``logprobs``, ``cached``), or why
    the baseline could not run. ``chunk_size`` is LMCache's (Mooncake keys vLLM's blocks).
    ``work`` keeps the configs and logs (default: a temporary directory, removed after).
    """
    if baseline not in CONNECTORS:
        return f"unknown baseline {baseline!r} (known: {', '.join(BASELINES)})"
    venv = venv_dir(baseline, env)
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no venv at {venv}: run benchmarks/baselines/setup.sh"
    own = work is None
    root = Path(tempfile.mkdtemp(prefix=f"bl-{baseline}-")) if work is None else work
    root.mkdir(parents=True, exist_ok=True)
    try:
        with Servers(root) as servers:
            kv, extra_env = CONNECTORS[baseline](servers, venv, root, chunk_size)
            # vLLM's and the connectors' IPC sockets go here instead of /tmp.
            rpc = Path(tempfile.mkdtemp(prefix="rpc-", dir=root))
            paths = [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
            run_env = {**env, **extra_env, "VLLM_RPC_BASE_PATH": str(rpc),
                       "PYTHONPATH": ":".join(paths)}
            # warmup: one unrelated request first, untimed, as bench_vllm's instances do.
            job = {"model": model, "block_size": block_size, "max_tokens": max_tokens,
                   "warmup": True, "kv_transfer_config": {**kv, "kv_role": "kv_both"},
                   "kv_cache_dtype": kv_cache_dtype}
            _instance(python, run_env, {**job, "prompts": first, "salts": [None] * len(first)},
                      root / "instance-a.log")
            return _instance(python, run_env,
                             {**job, "prompts": second, "salts": [None] * len(second)},
                             root / "instance-b.log")
    except (ServerFailed, RuntimeError, subprocess.TimeoutExpired, OSError) as failure:
        return f"{baseline}: {failure}"
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


@dataclass(slots=True)
class Fresh:
    """Fresh instance B's results through a baseline, at the chunk size where it was fastest."""

    results: list[dict[str, Any]]
    ttft_s: float  # median over the prompts
    chunk_size: int
    ttft_s_by_chunk_size: dict[int, float]


def best_xinstance(baseline: str, model: str, first: list[list[int]], second: list[list[int]],
                   env: Mapping[str, str], *, block_size: int, max_tokens: int,
                   kv_cache_dtype: str = "auto") -> Fresh | str:
    """``run_xinstance`` at each of the baseline's ``CHUNK_SIZES``; the fastest B, or why not."""
    timed: dict[int, tuple[float, list[dict[str, Any]]]] = {}
    reasons = []
    for chunk_size in CHUNK_SIZES.get(baseline, (256,)):
        fresh = run_xinstance(baseline, model, first, second, env, block_size=block_size,
                              max_tokens=max_tokens, chunk_size=chunk_size,
                              kv_cache_dtype=kv_cache_dtype)
        if isinstance(fresh, str):
            reasons.append(fresh)
        else:
            timed[chunk_size] = (statistics.median(r["ttft_s"] for r in fresh), fresh)
    if not timed:
        return "; ".join(dict.fromkeys(reasons))
    best = min(timed, key=lambda c: timed[c][0])
    return Fresh(timed[best][1], timed[best][0], best, {c: t for c, (t, _) in timed.items()})
