"""A single-machine Ray head that `kvstore start` brings up when no cluster was named.

The head is ``ray start --head --block`` in a session of its own: every port is chosen free
(never 6379, which a system Redis may hold, nor Ray's fixed defaults such as 10001, which a
second head on the machine would collide on), its temp dir is private, and its auth mode is
decided explicitly (``address.auth_mode_for_private_ray``). It is stopped by its process group
and the processes naming its temp dir, never by ``ray stop``, which stops every Ray instance of
the user on the machine.

It is private to this machine. ``--node-ip-address=127.0.0.1`` alone is not enough: Ray
replaces a loopback node address with the machine's network address
(``ray._private.services.resolve_ip_for_localhost``) unless ``LOOPBACK_ENV`` marks the head a
single-machine one; with 127.0.0.1 kept, every server of the head binds loopback only,
so nothing of it answers from the network (``tests/cluster/test_head.py`` checks that from
another network namespace) and its store nodes bind loopback and stay plain as documented.
Every process that joins it as a driver needs the same switch (``keep_loopback_address``):
Ray rewrites the ``127.0.0.1`` of the address it is given, too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.cluster.address import RecordedCluster, answers, auth_mode_for_private_ray, state_dir
from kvstore.errors import ClusterUnavailable
from kvstore.node.arena_files import EXITED_STATES, stat_fields

#: How long the head has to accept connections before `kvstore start` gives up.
HEAD_START_TIMEOUT_S = 90.0
#: Ray's switch for single-machine clusters: its node address stays the loopback address
#: given, instead of becoming the machine's network address; workers inherit it.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


_PORT_FLAGS = ("ray-client-server-port", "node-manager-port", "object-manager-port",
               "runtime-env-agent-port", "dashboard-agent-listen-port",
               "dashboard-agent-grpc-port", "metrics-export-port")


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int, exclude: Sequence[int] = ()) -> list[int]:
    """``n`` distinct free loopback ports, none in ``exclude``. The sockets stay bound until
    all are chosen: one at a time, the kernel may hand the same port out twice, and Ray then
    refuses to start ("the same port is used by multiple components")."""
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


#: Ray's bound on draining a node that got SIGTERM (``ray start --block`` handles it).
DRAIN_TIMEOUT_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
#: How long a private head's processes get to exit on SIGTERM before SIGKILL.
HEAD_STOP_GRACE_S = 1.0


def head_command(port: int, temp_dir: str) -> list[str]:
    """The exact ``ray start`` line (all ports explicit); also what an operator could run."""
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS), exclude=[port]), strict=True))
    return ["ray", "start", "--head", "--block", f"--port={port}",
            "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            "--disable-usage-stats", f"--temp-dir={temp_dir}",
            *(f"--{name}={value}" for name, value in ports.items())]


def keep_loopback_address() -> None:
    """Make this process, and every process it starts, keep 127.0.0.1 as Ray's address of
    this machine: what a driver of a head from ``start_head`` needs. Without it Ray rewrites
    ``127.0.0.1:PORT`` to the machine's network address, where nothing of that head listens.

    Ray reads the switch from the environment when it is imported, so the imported value is
    set as well. Only for a loopback head: on a cluster, workers on other machines must reach
    a driver at an address of the network.
    """
    from ray._private import ray_constants

    os.environ.update(LOOPBACK_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_head(extra_args: Sequence[str] = ()) -> RecordedCluster:
    """Start a private Ray head on this machine and wait until its GCS answers.

    ``extra_args`` go to ``ray start`` as they are (tests declare resources the machine lacks,
    e.g. ``--num-gpus=2`` on a CPU-only box).
    """
    ray_exe = shutil.which("ray")
    if ray_exe is None:
        raise ClusterUnavailable("the `ray` command is not on PATH; install ray, or pass "
                                 "--address HOST:PORT of a running cluster")
    auth_mode = auth_mode_for_private_ray()
    # Short: Ray's unix socket paths live under it and must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="kvs-ray-")
    port = _free_port()
    log_dir = state_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "ray-head.log"
    env = {**os.environ, "RAY_AUTH_MODE": auth_mode, **LOOPBACK_ENV}
    env.pop("RAY_ADDRESS", None)
    # On SIGTERM, Ray drains a node before stopping it, so that Serve on Kubernetes can hand
    # replicas over; `kvstore stop` ends this whole private cluster, so draining only delays
    # the stop until it times out. An operator's own setting still wins.
    env.setdefault(DRAIN_TIMEOUT_ENV, "0")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*head_command(port, temp_dir), *extra_args],
                                stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    head = RecordedCluster(f"127.0.0.1:{port}", auth_mode, proc.pid, temp_dir, loopback=True)
    deadline = time.monotonic() + HEAD_START_TIMEOUT_S
    while not answers(head.address, timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_head(head)
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
            raise ClusterUnavailable(
                f"could not start a local Ray head ({' '.join(tail) or 'no output'}); see "
                f"{log_path}, or start Ray yourself and pass --address")
        time.sleep(0.5)
    return head


def stop_head(head: RecordedCluster) -> None:
    """Stop a head `start_head` started: its process group, then stragglers naming its dir.

    Every process of the group gets SIGTERM at once, and SIGKILL after ``HEAD_STOP_GRACE_S``.
    The grace is short: the cluster is private and thrown away whole (kvstore's own actors
    have already shut down and unlinked their arenas), so Ray's graceful exit, one process
    after another, would only delay the stop.
    """
    if head.head_pid is None:
        return
    for sig, wait_s in ((signal.SIGTERM, HEAD_STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(head.head_pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if _wait_gone(head.head_pid, wait_s):
            break
    if head.temp_dir:
        # Ray's workers may leave the process group; they all carry the temp dir in argv.
        for pid in pids_mentioning(head.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)  # our child: reap it
            if done == pid:
                return True
        except ChildProcessError:  # not our child (a later `kvstore stop`): probe it
            if not is_running(pid):
                return True
        time.sleep(0.1)
    return False


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited: a dead head that another process must reap
    (whoever inherited it, on its own schedule) has already let go of everything."""
    try:
        return stat_fields(pid)[0] not in EXITED_STATES
    except OSError:
        return False


def pids_mentioning(text: str) -> list[int]:
    """Processes (not this one) whose command line contains ``text``: a Ray head's processes
    all name its private temp dir, so this finds exactly the ones a head of ours left."""
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
