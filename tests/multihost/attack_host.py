"""The attacker's host and the test's instruments: an extra namespace host on the cluster's
bridge that is not part of the Ray cluster, a way to run tests/multihost/attacker.py in it, and
the measurements an attack is judged by (a store node's RSS and threads, what crosses the
bridge, every process's argv).

Nothing here sends traffic anywhere but the namespace hosts' private addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.multihost.netns import Host, Network, new_host, plug_host, run

REPO = Path(__file__).resolve().parents[2]
#: The attacker's host number: its veth and namespace names follow netns.create's pattern, so
#: netns.cleanup_stale removes them after a crashed run like any other host's.
ATTACKER_INDEX = 9


def add_attacker_host(net: Network, temp_root: Path) -> Host:
    """One more host on ``net``'s bridge (address .19), booted, NOT in ``net.hosts``: Ray and
    the cluster's teardown never see it. ``remove_host`` takes it down."""
    i = ATTACKER_INDEX
    host = new_host(net, i, temp_root)
    try:
        plug_host(net, host, i, default_route=False)
        host.boot()
    except BaseException:
        remove_host(host)
        raise
    return host


def remove_host(host: Host) -> None:
    """Kill everything in the host (its PID 1), delete its veth and namespace."""
    host.kill()
    run(["ip", "link", "del", host.veth], check=False)
    run(["ip", "netns", "del", host.netns], check=False)


def _attacker_argv(host: Host, function: str) -> list[str]:
    return host.argv("env", f"PYTHONPATH={REPO}", "python3", "-m", "tests.multihost.attacker",
                     function)


def _parse(stdout: str, prefix: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return None


def attack(host: Host, function: str, timeout: float = 90.0, **kwargs: object) -> dict:
    """Run ``attacker.FUNCTION(**kwargs)`` inside ``host`` (kwargs on stdin); its result."""
    proc = subprocess.run(_attacker_argv(host, function), input=json.dumps(kwargs) + "\n",
                          capture_output=True, text=True, timeout=timeout)
    result = _parse(proc.stdout, "ATTACK=")
    if result is None:
        raise RuntimeError(f"attacker {function} failed ({proc.returncode}): "
                           f"{proc.stderr[-3000:]}")
    return result


@dataclass(slots=True)
class RunningAttack:
    """An attack that holds the node while the test measures: ``ready()``, then ``finish()``."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    def ready(self, timeout: float = 90.0) -> dict:
        """Block until the attacker printed READY (its connections or streams are open)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith("READY="):
                return json.loads(line[len("READY="):])
        self.stop()
        raise RuntimeError(f"attacker never became ready: {''.join(self.lines)[-2000:]}")

    def finish(self, timeout: float = 120.0, release: bool = True) -> dict:
        """Let go (close its stdin) when ``release``, else let it run out its own hold; its
        result."""
        assert self.proc.stdout is not None
        if release and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            self.proc.stdin = None  # communicate() must not flush it again
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        result = _parse("".join(self.lines) + out, "ATTACK=")
        if result is None:
            raise RuntimeError(f"attacker failed ({self.proc.returncode}): {err[-3000:]}")
        return result

    def stop(self) -> None:
        """Kill this attacker process (by its own PID, which this harness started)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def attack_async(host: Host, function: str, **kwargs: object) -> RunningAttack:
    """Start ``attacker.FUNCTION(**kwargs)`` in ``host``; stdin stays open as its hold signal."""
    proc = subprocess.Popen(_attacker_argv(host, function), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(kwargs) + "\n")
    proc.stdin.flush()
    return RunningAttack(proc)


# --- measurements -----------------------------------------------------------------------------

def listener_pid(host: Host, port: int) -> int:
    """The PID (in the machine's PID namespace) of the process listening on ``port`` in
    ``host``: the store node serving that port."""
    out = run(["ip", "netns", "exec", host.netns, "ss", "-Htlnp", f"sport = :{port}"]).stdout
    pids = {int(p) for p in re.findall(r"pid=(\d+)", out)}
    if len(pids) != 1:
        raise AssertionError(f"expected one process listening on {host.ip}:{port}: {out!r}")
    return pids.pop()


@dataclass(frozen=True, slots=True)
class Usage:
    """A process's resident memory and threads."""

    rss_bytes: int
    threads: int


def usage(pid: int) -> Usage:
    """From /proc/PID/status (VmRSS in kB, Threads)."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]
    threads = int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    return Usage(rss, threads)


def cmdlines_in(hosts: list[Host]) -> dict[int, str]:
    """The argv (NUL-joined as spaces) of every process living in one of ``hosts``' network
    namespaces: everything the cluster runs, as a local user's ``ps`` shows it."""
    inodes = set()
    for host in hosts:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/run/netns/{host.netns}").st_ino)
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry.name}/ns/net").st_ino not in inodes:
                continue
            raw = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue  # exited meanwhile
        out[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return out


class BridgeCapture:
    """Every frame crossing the cluster's bridge while open (a raw AF_PACKET socket, as
    tcpdump would): what an eavesdropper on the hosts' network sees."""

    def __init__(self, bridge: str, limit_bytes: int = 64 << 20) -> None:
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self._sock.bind((bridge, 0))
        self._sock.settimeout(0.2)
        self._frames: list[bytes] = []
        self._limit = limit_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="bridge-capture")
        self._thread.start()

    def _loop(self) -> None:
        size = 0
        while not self._stop.is_set() and size < self._limit:
            try:
                frame = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            self._frames.append(frame)
            size += len(frame)

    def stop(self) -> list[bytes]:
        """End the capture; the frames seen."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        return self._frames


def tcp_payload(frames: list[bytes], port: int) -> bytes:
    """The TCP payload bytes of IPv4 frames to or from ``port``, concatenated."""
    out = bytearray()
    for f in frames:
        if len(f) < 34 or f[12:14] != b"\x08\x00" or f[23] != 6:  # IPv4, TCP
            continue
        ihl = (f[14] & 0x0F) * 4
        tcp = 14 + ihl
        sport, dport = int.from_bytes(f[tcp:tcp + 2], "big"), int.from_bytes(f[tcp + 2:tcp + 4],
                                                                               "big")
        if port not in (sport, dport):
            continue
        total = int.from_bytes(f[16:18], "big")
        data_off = (f[tcp + 12] >> 4) * 4
        out += f[tcp + data_off:14 + total]
    return bytes(out)
