"""``benchmarks/bench_gpu.py`` where CI runs: without a GPU it skips and exits 0, and its
``--device cpu`` smoke run goes through every step (store node, same-node and bulk reads, the
floor) with every warm run bitwise equal to the store-less reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_without_a_gpu_it_says_it_skipped_and_exits_0() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = run("--quick")
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stdout


def test_the_cpu_smoke_run_measures_every_step_and_outputs_are_equal(tmp_path: Path) -> None:
    out = tmp_path / "bench_gpu.json"
    done = run("--quick", "--device", "cpu", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["outputs_equal"] == 1.0
    for n in (256,):
        for key in ("ratio_cold_vs_warm_ttft", "ratio_warm_vs_floor", "cold_ttft_s",
                    "warm_ttft_remote_s", "publish_background_s"):
            assert figures[f"{key}_{n}"] > 0
