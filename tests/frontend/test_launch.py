"""``kvstore serve``'s start: a port that is taken is refused before anything slow starts, and
a stop asked for while it starts is taken at the next phase.

Only the last test starts anything (a private Ray and the store, no replicas): the refusals
come before the model, Ray or Serve (tests/frontend/test_serve runs the real server).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstore.config import ServeConfig
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


def test_a_free_port_passes() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = int(probe.getsockname()[1])
    check_port("127.0.0.1", free)


def test_port_zero_is_refused_as_a_setting() -> None:
    """A free port picked by the proxy would be an address nobody, the server included,
    knows: the start would wait its whole timeout for a health check that cannot answer."""
    with pytest.raises(ConfigError, match=r"serve.port must be in \[1, 65535\]"):
        ServeConfig(port=0)


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


@pytest.mark.ray
def test_a_stop_asked_for_while_starting_is_taken_at_the_next_phase(tmp_path) -> None:
    """SIGTERM once the private Ray is up (the store is starting): what started is stopped in
    order and nothing more starts; the server never says it is ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env.update(KVSTORE_STATE_DIR=str(tmp_path / "state"), RAY_AUTH_MODE="disabled")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", "serve", "--model",
                                 "tiny", "--threads", "1", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "starting a private Ray instance:" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    out = log_path.read_text(errors="replace")
    assert "kvstore: stopping the application" in out, out
    assert "Ctrl-C stops it" not in out and "starting Ray Serve" not in out, out
