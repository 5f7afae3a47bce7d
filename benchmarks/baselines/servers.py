"""The baselines' own servers, started and stopped by PID on free loopback ports.

LMCache shares KV across vLLM processes through ``python -m lmcache.v1.server``; Mooncake's store
through ``mooncake_master`` (metadata and an HTTP metadata service) and a standalone
``mooncake_client`` that owns the memory, so data outlives each vLLM process. Every one of them
is a child of this process: ``Servers.stop`` ends exactly those PIDs, last started first, and
nothing is looked up by name.

Every server runs on the cores the benchmarked vLLM instances do not compute on
(``off_forward_cores``), as a deployment puts a cache's servers beside the engine rather than
on its cores; kvstore's cluster is started the same way.

Mooncake's master binds its HTTP metadata port, and its client its transfer-engine ports, on
every interface whatever the host flags say; the traffic itself stays on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"


#: The core every vLLM instance of ``bench_vllm`` computes on (``VLLM_CPU_OMP_THREADS_BIND``).
FORWARD_CORE = 0


def off_forward_cores() -> Callable[[], None] | None:
    """A ``preexec_fn`` that keeps a server (and every process it starts) off
    ``FORWARD_CORE``; None on a one-core machine."""
    cores = os.sched_getaffinity(0) - {FORWARD_CORE}
    if not cores:
        return None
    return lambda: os.sched_setaffinity(0, cores)


class ServerFailed(RuntimeError):
    """A baseline server exited or never listened; the message ends with its log's last line."""


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts TCP connections on the loopback ``port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((LOOPBACK, port)) == 0


@dataclass(slots=True)
class Server:
    """One started server: its name, process and log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"


@dataclass(slots=True)
class Servers:
    """The servers one baseline run started; a context manager that stops them all."""

    work: Path
    started: list[Server] = field(default_factory=list)

    def start(self, name: str, argv: list[str], ports: list[int], timeout_s: float = 60.0
              ) -> Server:
        """Run ``argv`` with its output in ``work/NAME.log`` until all ``ports`` listen."""
        log = self.work / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL,
                                       preexec_fn=off_forward_cores())
        server = Server(name, process, log)
        self.started.append(server)
        deadline = time.monotonic() + timeout_s
        while not all(listening(port) for port in ports):
            if process.poll() is not None:
                raise ServerFailed(f"{name} exited with {process.returncode}: "
                                   f"{server.last_line()}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"{name} did not listen on {ports} in {timeout_s:.0f} s: "
                                   f"{server.last_line()}")
            time.sleep(0.2)
        return server

    def stop(self) -> None:
        """End every started server by its PID, the last started first."""
        while self.started:
            process = self.started.pop().process
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_lmcache_server(servers: Servers, python: Path) -> str:
    """LMCache's KV server, holding chunks in its memory; returns the ``remote_url``."""
    port = free_port()
    servers.start("lmcache-server", [str(python), "-m", "lmcache.v1.server", LOOPBACK,
                                     str(port), "cpu"], [port])
    return f"lm://{LOOPBACK}:{port}"


def start_mooncake(servers: Servers, bin_dir: Path, segment: str = "2 GB") -> dict[str, str]:
    """Mooncake's master and a standalone client owning ``segment`` of memory.

    Returns the master's and metadata service's addresses, as vLLM's ``MOONCAKE_CONFIG_PATH``
    file names them.
    """
    rpc, http, metrics, client = (free_port() for _ in range(4))
    servers.start("mooncake-master", [
        str(bin_dir / "mooncake_master"), f"-rpc_address={LOOPBACK}", f"-rpc_port={rpc}",
        "-enable_http_metadata_server=true", f"-http_metadata_server_host={LOOPBACK}",
        f"-http_metadata_server_port={http}", f"-metrics_host={LOOPBACK}",
        f"-metrics_port={metrics}"], [rpc, http])
    addresses = {"metadata_server": f"http://{LOOPBACK}:{http}/metadata",
                 "master_server_address": f"{LOOPBACK}:{rpc}"}
    servers.start("mooncake-client", [
        str(bin_dir / "mooncake_client"), f"-host={LOOPBACK}", f"-port={client}",
        "-protocol=tcp", f"-metadata_server={addresses['metadata_server']}",
        f"-master_server_address={addresses['master_server_address']}",
        f"-global_segment_size={segment}"], [client])
    return addresses
