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


def test_the_breakdown_times_each_phase_of_each_variant(tmp_path: Path) -> None:
    """``tools/gpu_breakdown.py`` on the CPU: every variant's runs and the phases of its median
    run; the same-node reads lease, the bulk reads do not (they read over the channel)."""
    out = tmp_path / "breakdown.json"
    done = subprocess.run([sys.executable, "-m", "tools.gpu_breakdown", "--device", "cpu",
                           "--repeats", "1", "--variants", "floor,warm,host_checks,remote",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    for name in ("floor", "warm", "host_checks", "remote"):
        run_ = got[f"256/{name}"]
        assert run_["ttft_best_ms"] > 0 and {"request", "chunks", "cache"} <= set(run_["phases"])
    assert "lease" in got["256/warm"]["phases"] and "lease" not in got["256/remote"]["phases"]
    assert "lookup" not in got["256/floor"]["phases"]
