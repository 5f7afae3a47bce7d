"""A private ``redis-server`` for tests, benchmarks and ``kvstore start``.

It binds 127.0.0.1 on a free port, keeps nothing on disk (``--save "" --appendonly no``), works
in its own temporary directory, and is stopped by its PID only (never by name: other Redis
servers on the machine, including the system one, are not ours). ``restart()`` keeps the port and
settings, which is how fault tests play "Redis restarted": the data is gone, the URL still works.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvstore.errors import NodeUnavailable

_START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class TLSFiles:
    """A self-signed CA and a server certificate it signed, valid for 127.0.0.1 and localhost."""

    ca_file: str
    cert_file: str
    key_file: str


def make_tls_files(directory: str | Path) -> TLSFiles:
    """Write a throwaway CA and a server cert/key for 127.0.0.1 and localhost into ``directory``
    (tests and local clusters), made by the cluster CA code ``kvstore start`` uses."""
    from kvstore.security.ca import issue_server_cert, new_ca

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = new_ca("kvstore test CA", days=30)
    cert_pem, key_pem = issue_server_cert(ca, ["127.0.0.1", "localhost"], days=30)
    files = TLSFiles(str(d / "ca.crt"), str(d / "server.crt"), str(d / "server.key"))
    Path(files.ca_file).write_text(ca.cert_pem)
    Path(files.cert_file).write_text(cert_pem)
    Path(files.key_file).write_text(key_pem)
    os.chmod(files.key_file, 0o600)
    return files


@dataclass(slots=True)
class RedisProcess:
    """A running private redis-server; ``url`` is what clients connect with."""

    port: int
    password: str | None
    tls: TLSFiles | None
    workdir: str
    argv: list[str]
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """``redis://[:pw@]127.0.0.1:port/0``, or ``rediss://...`` under TLS."""
        scheme = "rediss" if self.tls else "redis"
        auth = f":{self.password}@" if self.password else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> str | None:
        """The CA bundle a TLS client needs (``ssl_ca_certs``), or None without TLS."""
        return self.tls.ca_file if self.tls else None

    @property
    def pid(self) -> int:
        """The server's process id (the only handle used to stop it)."""
        if self._proc is None:
            raise NodeUnavailable(f"redis-server on port {self.port} is not running")
        return self._proc.pid

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client for this server (tests use it to inspect or FLUSHDB)."""
        if self.tls is not None:
            kwargs.setdefault("ssl_ca_certs", self.tls.ca_file)
        return redis.Redis.from_url(self.url, **kwargs)

    def stop(self) -> None:
        """Stop the server and delete its working directory."""
        self._kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restart(self) -> None:
        """Kill and start again on the same port with the same settings (the data is gone)."""
        self._kill()
        self._spawn()

    def _spawn(self) -> None:
        log_path = Path(self.workdir) / "redis.log"
        self._proc = subprocess.Popen(self.argv, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                # Timeouts: if something else holds the port, it may accept and never answer.
                with self.client(socket_timeout=1, socket_connect_timeout=1, retry=None) as c:
                    c.ping()
                return
            except redis.RedisError as exc:
                last_error = exc
                time.sleep(0.05)
        log = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        self._kill()
        raise NodeUnavailable(
            f"redis-server on port {self.port} did not answer PING within {_START_TIMEOUT_S}s "
            f"(last error: {last_error}); its log ends with:\n{log}")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def start_redis_server(*, port: int | None = None, password: str | None = None,
                       tls_dir: str | Path | None = None) -> RedisProcess:
    """Start a private redis-server and return once it answers PING.

    Args:
        port: the port to listen on; a free one when None.
        password: set ``requirepass``; the URL then carries it.
        tls_dir: serve TLS only (``--port 0 --tls-port``), with a CA and cert written here.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise NodeUnavailable("redis-server is not on PATH; install Redis >= 6 "
                              "(e.g. apt-get install redis-server) or use index.backend=memory")
    # A free port can be taken between the probe and the bind: try a few before giving up.
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        chosen = port if port is not None else free_port()
        workdir = tempfile.mkdtemp(prefix="kvstore-redis-")
        tls = make_tls_files(tls_dir) if tls_dir is not None else None
        argv = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", workdir, "--logfile", str(Path(workdir) / "redis.log"),
                "--daemonize", "no", "--protected-mode", "yes"]
        if tls is not None:
            argv += ["--port", "0", "--tls-port", str(chosen), "--tls-cert-file", tls.cert_file,
                     "--tls-key-file", tls.key_file, "--tls-ca-cert-file", tls.ca_file,
                     "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(chosen)]
        if password:
            argv += ["--requirepass", password]
        server = RedisProcess(chosen, password, tls, workdir, argv)
        try:
            server._spawn()
            return server
        except NodeUnavailable:
            shutil.rmtree(workdir, ignore_errors=True)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
