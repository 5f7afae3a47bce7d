"""The Ray head `kvstore start` makes for the user is private: nothing of it answers off-machine.

The head is started as a user starts it (`kvstore start`, a subprocess, no cluster named). A
second host is a network namespace on a private bridge (``tests/multihost/netns``): the bridge's
address in this namespace is how another machine on the network would reach this one. From
there, no port that the head's processes listen on (the GCS, the raylet, the store node's gRPC
and bulk ports, the coordinator's index service, ...) accepts a connection; a listener of the
test's own on every interface does, so the path itself is known to work.

A head's end is not its guests' end: a process that joined it (vLLM's, through the connector)
goes on after it stops. That check waits out Ray's minute without a GCS, under this module's
other tests (``guest_of_a_stopped_head``; the check is the module's last test).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cluster import address, head
from kvstore.node import arena_files
from tests.multihost import netns
from tests.support.processes import kill_survivors, process_tree

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("guest_of_a_stopped_head")]

KVSTORE = [sys.executable, "-m", "kvstore.cli.main"]

#: Run inside the other host: try each port of TARGET once, 2 s at most each.
PROBE = """
import json, socket, sys
target, ports = sys.argv[1], json.loads(sys.argv[2])
seen = {}
for port in ports:
    try:
        with socket.create_connection((target, port), timeout=2):
            seen[port] = "answers"
    except OSError as exc:
        seen[port] = type(exc).__name__
print(json.dumps(seen))
"""


#: A guest of a cluster: it joins the head, is up a while, says so, and once told the head
#: is gone, sleeps past Ray's minute without a GCS and says it is still there.
GUEST = """
import sys, time
from kvstore.cluster.host_signals import outlive_the_cluster
from kvstore.cluster.lifecycle import ensure_ray
outlive_the_cluster()  # what the vLLM connector does before it joins
ensure_ray(sys.argv[1], start_local=False)
import ray
ray.nodes()
time.sleep(5)  # up a while, as an instance is: one whose GCS goes within moments of
# joining was still ended once (Ray judges a connection by when it last saw it up)
print("UP", flush=True)
sys.stdin.readline()  # the cluster is gone now
time.sleep(64)  # past Ray's minute without its GCS (gone before this line)
print("ALIVE", flush=True)
"""


@pytest.fixture(scope="module")
def guest_of_a_stopped_head(tmp_path_factory: pytest.TempPathFactory
                            ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A process that joined a head as `kvstore start` makes it, that head stopped under it:
    the process and its log. Its minute runs while the module's other tests do."""
    work = tmp_path_factory.mktemp("guest")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env.update(KVSTORE_STATE_DIR=str(work / "state"), RAY_AUTH_MODE="disabled",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]), **head.LOOPBACK_ENV)
    with pytest.MonkeyPatch.context() as patch:  # the head's auth mode, the guest's too
        patch.setenv("RAY_AUTH_MODE", "disabled")
        cluster = head.start_head()
    log_path = work / "guest.log"
    with open(log_path, "w") as log:  # a file: nobody reads a pipe while other tests run
        proc = subprocess.Popen([sys.executable, "-c", GUEST, cluster.address], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True)
    try:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "UP", \
                log_path.read_text()[-2000:]
        finally:
            head.stop_head(cluster)
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, env=env,
                          timeout=180)


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (``ss``)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+),", line)}
        if owners & pids:
            local = line.split()[3]
            host, _, port = local.rpartition(":")
            found.append((host.strip("[]").split("%")[0], int(port)))
    return found


def on_loopback(host_ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``); ``ss``'s
    ``*`` (every address) is not."""
    if host_ip == "*":
        return False
    ip = ipaddress.ip_address(host_ip)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.fixture
def other_host(tmp_path: Path) -> Iterator[tuple[netns.Host, str]]:
    """One namespace host and the address this namespace has on its bridge."""
    try:
        netns.check_prerequisites()
    except netns.NetnsUnavailable as exc:
        if os.environ.get("KVSTORE_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVSTORE_REQUIRE_NETNS=1 but {exc}")
        pytest.skip(str(exc))
    netns.cleanup_stale()
    net = netns.create(1, tmp_path / "hosts")
    try:
        yield net.hosts[0], net.gateway
    finally:
        net.destroy()


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not on PATH")
def test_the_local_head_answers_nothing_from_another_host(
        tmp_path: Path, other_host: tuple[netns.Host, str]) -> None:
    host, this_machine = other_host
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env[address.STATE_DIR_ENV] = str(tmp_path / "state")
    env["KVSTORE_SECURITY_SECRETS_DIR"] = str(tmp_path / "secrets")
    env["RAY_AUTH_MODE"] = "disabled"  # every process of this test: the head's comes from here
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    control = socket.create_server(("0.0.0.0", 0))  # answers from the other host, if any does
    rec = None
    try:
        started = run_cli("start", "--capacity", "8MiB", env=env)
        rec = address.recorded(env)
        assert started.returncode == 0, started.stderr
        assert rec is not None and rec.head_pid is not None and rec.temp_dir
        assert "reachable from this machine only" in started.stderr
        assert "security: off" in started.stdout  # store nodes on loopback: plain, as documented

        status = run_cli("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        facts = json.loads(status.stdout)
        assert facts["ray"]["loopback"] and facts["ray"]["node_ips"] == ["127.0.0.1"]
        assert not facts["security"]["auth"]
        shown = " ".join(run_cli("status", env=env).stdout.split())
        assert "reachable from this machine only" in shown and "loopback only" in shown

        gcs_port = int(rec.address.rpartition(":")[2])
        store_port = int(facts["nodes"][0]["address"].rpartition(":")[2])
        sockets = listening({p.pid for p in process_tree(rec.head_pid)})  # workers included
        ports = sorted({port for _, port in sockets})
        assert gcs_port in ports and store_port in ports, sockets
        assert [s for s in sockets if not on_loopback(s[0])] == []

        control_port = control.getsockname()[1]
        probe = subprocess.run(
            host.argv(sys.executable, "-c", PROBE, this_machine,
                      json.dumps([control_port, *ports])),
            capture_output=True, text=True, timeout=30 + 3 * len(ports))
        assert probe.returncode == 0, probe.stderr
        seen = {int(port): result for port, result in json.loads(probe.stdout).items()}
        assert seen.pop(control_port) == "answers"  # the other host does reach this machine
        assert "answers" not in seen.values(), seen
    finally:
        control.close()
        if rec is not None:
            run_cli("stop", env=env)
            head.stop_head(rec)  # whatever `stop` left, by its process group and temp dir


def test_the_demo_stopped_while_starting_listens_on_loopback_and_leaves_nothing(
        tmp_path: Path) -> None:
    """`kvstore demo` always starts a Ray of its own, as every command on the embedded default
    does (`generate` with nothing started; ``lifecycle.ensure_ray``): it serves that process
    only, so it listens on loopback only. SIGTERM to its process group while its replicas
    start (as `timeout` sends it) stops what had started in order: no process of it left, and
    no arena in /dev/shm."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env[address.STATE_DIR_ENV] = str(tmp_path / "state")
    env["RAY_AUTH_MODE"] = "disabled"
    arenas_before = set(Path("/dev/shm").glob("kvstore-arena-*"))
    log_path = tmp_path / "demo.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*KVSTORE, "demo", "--model", "tiny", "--threads", "1"],
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    tree = []
    try:
        deadline = time.monotonic() + 180
        while "starting the store" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        tree = process_tree(proc.pid)
        sockets = listening({p.pid for p in tree})
        assert sockets, "the private Ray listens somewhere"
        assert [s for s in sockets if not on_loopback(s[0])] == []
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
        out = log_path.read_text(errors="replace")
        assert "stopping the replicas and the store" in out, out
        time.sleep(2)
        assert [p for p in tree if arena_files.owner_state(p) == "alive"] == []
        assert set(Path("/dev/shm").glob("kvstore-arena-*")) - arenas_before == set()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        kill_survivors(tree)


def test_every_port_of_the_head_is_distinct() -> None:
    """Chosen one at a time, two of Ray's ports could be the same free port, and Ray then
    refuses to start the head; they are chosen together, and apart from the GCS port."""
    for _ in range(200):
        argv = head.head_command(head._free_port(), "/tmp/x")
        ports = [int(a.rpartition("=")[2]) for a in argv if a.startswith("--") and "port=" in a]
        assert len(ports) == 8 and len(set(ports)) == 8, argv


def test_a_zombie_head_counts_as_gone_and_a_live_one_does_not() -> None:
    """`kvstore stop` runs in another process than the `kvstore start` that spawned the head,
    so the head it kills stays a zombie until someone else reaps it: stop must not wait on
    that, nor take a live process for gone."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        stat = Path(f"/proc/{dead.pid}/stat")
        for _ in range(200):  # exited, not yet reaped (Popen reaps only when asked)
            if stat.read_text().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.05)
        assert not head.is_running(dead.pid)
        assert head.is_running(live.pid)
    finally:
        live.kill()
        live.wait()
        dead.wait()
    assert not head.is_running(dead.pid)  # reaped: no such process at all


@pytest.mark.ray
def test_a_guest_process_outlives_the_head_it_joined(
        guest_of_a_stopped_head: tuple[subprocess.Popen[str], Path]) -> None:
    """Ray ends a process whose cluster's GCS has been gone a minute; a process kvstore is a
    guest in (vLLM's, through the connector) must go on serving, recomputing what it cannot
    load. Without ``outlive_the_cluster`` this process dies ~60 s after the head. (Last in
    the module: the other tests ran during its minute.)"""
    proc, log_path = guest_of_a_stopped_head
    out, _ = proc.communicate(timeout=150)
    assert out.split() == ["ALIVE"], log_path.read_text()[-2000:]
    assert proc.returncode == 0, log_path.read_text()[-2000:]
