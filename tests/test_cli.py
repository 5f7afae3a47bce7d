"""The ``kvstore`` console script, run as operators run it: subprocesses against a real Ray head.

The Ray head is private to this module (its own port, temp dir and process group) and is torn
down by its own PIDs, never by ``ray stop``, which would kill every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import build_parser, namespace_root, parse_keys, status_json
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(240)

KVSTORE = [sys.executable, "-m", "kvstore.cli"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    # Ray turns token auth on by itself when ~/.ray/auth_token exists: pin one mode for all.
    env["RAY_AUTH_MODE"] = "disabled"
    return env


# -- no Ray needed ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["start", "--capacity", "lots"], "pool.capacity_bytes: 'lots'"),
    (["start", "--config", "/nonexistent/kvstore.yaml"], "cannot read config file"),
    (["pin", "zz"], "is not hex"),
    (["pin", "ab" * 16], "a block key is 64 hex digits"),
    (["pin", "--ttl", "5", "ab" * 32], "--ttl applies to soft pins only"),
    (["invalidate", "--model-fingerprint", "m"], "missing: --dtype"),
])
def test_bad_input_prints_one_line_and_exits_2(args: list[str], needle: str) -> None:
    proc = run_cli(*args, env=_base_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_config_file_section_names_the_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "kvstore.yaml"
    cfg.write_text("coordinator:\n  high_watermark: 0.5\n  low_watermark: 0.7\n")
    proc = run_cli("start", "--config", str(cfg), env=_base_env())
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "low_watermark" in proc.stderr


def test_status_without_ray_is_one_line_error() -> None:
    env = _base_env()
    env["RAY_ADDRESS"] = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = run_cli("status", env=env, timeout=180)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_parse_keys_and_namespace_root() -> None:
    key = bytes(range(32))
    assert parse_keys([key.hex()]) == [key]
    with pytest.raises(ConfigError):
        parse_keys([key.hex()[:-2]])
    ns = Namespace("fp", "float16", 16, 2, 2, 8, cache_salt="tenant")
    parser = build_parser()
    args = parser.parse_args(["invalidate", "--model-fingerprint", "fp", "--dtype", "float16",
                              "--block-size", "16", "--num-layers", "2", "--num-kv-heads", "2",
                              "--head-dim", "8", "--salt", "tenant"])
    assert namespace_root(args) == ns.root
    args = parser.parse_args(["invalidate", "--namespace", ns.root.hex()])
    assert namespace_root(args) == ns.root


def test_status_json_totals_fill_in() -> None:
    raw = {"nodes": [
        {"node_id": "a", "capacity_bytes": 10, "used_bytes": 4, "blocks": 2, "hits": 3,
         "misses": 1, "evictions": 0, "alive": True},
        {"node_id": "b", "capacity_bytes": 10, "used_bytes": 9, "blocks": 5, "alive": False},
    ]}
    out = status_json(raw)
    assert out["totals"]["capacity_bytes"] == 10  # dead nodes do not count
    assert out["totals"]["blocks"] == 2
    assert out["totals"]["hit_rate"] == 0.75
    assert out["nodes"][1]["hits"] == 0


# -- against a private Ray head ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    """A Ray head on a free port (never 6379: Redis holds it) in its own process group."""
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    temp_dir = tempfile.mkdtemp(prefix="kvs-cli-ray-")
    port = free_port()
    env = _base_env()
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--disable-usage-stats", "--include-dashboard=false",
         f"--temp-dir={temp_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        _wait_for_head(env, head)
        yield env
    finally:
        _kill_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_head(env: dict[str, str], head: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 90
    probe = "import ray; ray.init(); print(len(ray.nodes()))"
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited with {head.returncode}")
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode == 0:
            return
        time.sleep(1)
    pytest.fail("the private Ray head did not come up within 90 s")


def _kill_head(head: subprocess.Popen[bytes], temp_dir: str) -> None:
    """SIGTERM the head's process group, then any straggler that names our temp dir."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(head.pid, sig)
            head.wait(timeout=wait_s)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in _pids_mentioning(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _pids_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def test_start_status_stop(ray_head: dict[str, str]) -> None:
    env = ray_head
    started = run_cli("start", "--capacity", "8MiB", env=env)
    assert started.returncode == 0, started.stderr
    try:
        again = run_cli("start", "--capacity", "8MiB", env=env)  # idempotent
        assert again.returncode == 0, again.stderr

        proc = run_cli("status", "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        status = json.loads(proc.stdout)  # exactly one JSON object on stdout
        assert len(status["nodes"]) == 1
        node = status["nodes"][0]
        assert node["capacity_bytes"] == 8 << 20
        assert node["used_bytes"] == 0 and node["blocks"] == 0
        assert status["totals"]["capacity_bytes"] == 8 << 20

        table = run_cli("status", env=env)
        assert table.returncode == 0, table.stderr
        assert node["node_id"][:12] in table.stdout

        pinned = run_cli("pin", "--soft", "--ttl", "60", "ab" * 32, env=env)
        assert pinned.returncode == 0, pinned.stderr
    finally:
        stopped = run_cli("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not list(Path("/dev/shm").glob(f"kvstore-arena-{node['node_id'][:16]}-*"))

    after = run_cli("status", "--json", env=env)
    assert after.returncode == 1
    assert "kvstore start" in after.stderr
    assert len(after.stderr.strip().splitlines()) == 1
