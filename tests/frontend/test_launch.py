"""``kvstore serve``'s start: a port that is taken is refused before anything slow starts.

No server runs here: the refusal comes before the model, Ray or Serve (tests/frontend/test_serve
runs the real server).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvstore.errors import ConfigError
from kvstore.frontend.launch import check_port

#: What `kvstore serve` must not have imported when it refuses a port: the slow parts.
HEAVY = {"torch", "transformers", "ray"}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something listens on, for the length of the test."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def test_a_port_in_use_is_a_config_error_naming_it(taken_port: int) -> None:
    with pytest.raises(ConfigError, match=f"port {taken_port} on 127.0.0.1 is already in use: "
                                          "pick a free one with --port"):
        check_port("127.0.0.1", taken_port)


def test_a_free_port_and_port_zero_pass() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    check_port("127.0.0.1", free)
    check_port("127.0.0.1", 0)


def test_a_host_that_is_not_this_machine_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot listen on 192.0.2.1:8000"):
        check_port("192.0.2.1", 8000)  # TEST-NET-1: never a local address


def test_serve_on_a_taken_port_exits_2_at_once(taken_port: int, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env.update(KVSTORE_STATE_DIR=str(tmp_path), PYTHONPROFILEIMPORTTIME="1")
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "serve", "--model", "tiny",
                           "--port", str(taken_port)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert lines == [f"kvstore: error: port {taken_port} on 127.0.0.1 is already in use: pick "
                     "a free one with --port (or serve.port)"]
    imported = {ln.rsplit("|", 1)[1].strip().split(".")[0] for ln in proc.stderr.splitlines()
                if ln.startswith("import time:") and ln.count("|") == 2}
    assert "kvstore" in imported and not imported & HEAVY, sorted(imported & HEAVY)
