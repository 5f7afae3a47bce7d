"""A live ``kvstore serve`` in a process of its own, for tests that talk HTTP to it.

It brings up its own private Ray and store (the embedded default), on a free port, and is
stopped by its PID: a signal first, SIGINT or SIGTERM, to it or to its whole process group (the
server deletes its application and stops what it started), then SIGKILL of the group if it does
not exit in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

#: Starting Ray, the store and the Serve replicas takes ~30 s on 2 cores; allow for a busy CI.
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 90.0, sig: int = signal.SIGINT, *,
             whole_group: bool = False) -> int | None:
        """``sig`` (Ctrl-C's by default) to the server, or to its whole process group as GNU
        ``timeout`` sends it; then the group by force. The exit code (None if killed)."""
        if self.proc.poll() is None:
            if whole_group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return None
        return self.proc.returncode


def start_serve(args: list[str], workdir: Path, env: dict[str, str] | None = None
                ) -> ServeProcess:
    """``kvstore serve ARGS --port FREE``; returns once ``/health`` answers."""
    port = free_port()
    ready = workdir / "ready"
    log_path = workdir / "serve.log"
    full_env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli.main", "serve", *args, "--port", str(port),
             "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = ServeProcess(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"kvstore serve exited with {proc.returncode}:\n{server.log()}")
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"kvstore serve did not become ready:\n{server.log()}")
        time.sleep(0.5)
    return server
