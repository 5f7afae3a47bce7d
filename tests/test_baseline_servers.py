"""``benchmarks/baselines/servers.py`` and ``instance.py`` where no baseline is installed: a server
is waited for on its port and ended by its PID; a missing venv is a reason, not a crash."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.baselines.instance import _instance, best_xinstance, run_xinstance
from benchmarks.baselines.servers import ServerFailed, Servers, free_port, listening


def test_a_server_is_up_once_it_listens_and_gone_after_stop(tmp_path: Path) -> None:
    port = free_port()
    with Servers(tmp_path) as servers:
        server = servers.start("http", [sys.executable, "-m", "http.server", "--bind",
                                        "127.0.0.1", str(port)], [port])
        assert listening(port)
    assert server.process.poll() is not None
    assert not listening(port)


def test_a_server_that_exits_is_a_failure_naming_its_last_line(tmp_path: Path) -> None:
    with Servers(tmp_path) as servers, pytest.raises(ServerFailed, match="no such flag"):
        servers.start("broken", [sys.executable, "-c", "import sys; sys.exit('no such flag')"],
                      [free_port()])


def test_a_missing_venv_is_a_reason_to_skip(tmp_path: Path) -> None:
    env = {"KVSTORE_BASELINE_VENVS": str(tmp_path)}
    for baseline in ("mooncake", "lmcache"):
        reason = run_xinstance(baseline, "model", [[1]], [[1]], env, block_size=32,
                               max_tokens=1)
        assert reason == f"no venv at {tmp_path / baseline}: run benchmarks/baselines/setup.sh"
        assert best_xinstance(baseline, "model", [[1]], [[1]], env, block_size=32,
                              max_tokens=1) == reason
    assert "unknown baseline" in str(run_xinstance("x", "m", [], [], env, block_size=32,
                                                   max_tokens=1))


def make_venv(root: Path, name: str) -> Path:
    """A venv whose python is this one: no baseline's package, no baseline's binaries."""
    bin_dir = root / name / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    return root


def test_a_venv_without_the_baseline_is_a_reason_naming_what_failed(tmp_path: Path) -> None:
    env = {"KVSTORE_BASELINE_VENVS": str(make_venv(make_venv(tmp_path, "lmcache"), "mooncake"))}
    lmcache = run_xinstance("lmcache", "m", [[1]], [[1]], env, block_size=32, max_tokens=1)
    assert isinstance(lmcache, str)
    assert "lmcache-server exited" in lmcache and "No module named 'lmcache'" in lmcache
    mooncake = run_xinstance("mooncake", "m", [[1]], [[1]], env, block_size=32, max_tokens=1)
    assert isinstance(mooncake, str) and "mooncake_master" in mooncake


def test_a_failed_instance_is_its_exception_line(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                    "echo 'ValueError: no such model' >&2\necho 'INFO shutting down' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3: ValueError: no such model"):
        _instance(fake, {}, {}, tmp_path / "instance.log")
