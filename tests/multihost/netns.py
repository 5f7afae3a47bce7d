"""Real hosts on one machine: Linux network + PID namespaces joined by a bridge.

Each host is a network namespace (its own addresses and ports, so a Ray head may keep 6379 there)
plus a PID and mount namespace (its own /proc), so `ray stop` run inside a host, as `ray up` and
`ray down` do, sees and kills only that host's processes, never another engineer's Ray.

    root ns:  bridge kvsbr<run> 10.77.N.1/24
                 |-- veth kvsv<run>h0 <-> kvsp<run>h0  in netns kvs-<run>-h0  10.77.N.10
                 |-- veth kvsv<run>h1 <-> kvsp<run>h1  in netns kvs-<run>-h1  10.77.N.11
                 `-- ...

Every name carries the run id (the pytest PID), so reruns and crashed runs never collide;
`cleanup_stale` removes what a dead run left behind. Killing a host's PID 1 kills everything
in that host, which is how teardown (and the "host dies" fault) ends only what the harness started.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "kvs-"
BRIDGE_PREFIX = "kvsbr"
_PR_SET_PDEATHSIG = 1

# PID 1 of a host: reaps orphans so killed Ray processes do not linger as zombies.
_INIT = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be built here (not root, or a tool is missing)."""


def check_prerequisites() -> None:
    """Raise NetnsUnavailable with what to fix when hosts cannot be built on this machine."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("multi-host tests need root (ip netns, unshare)")
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"{tool} not found: run .ci/install-system-deps.sh")


def run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run a short command, capturing output; raise with its stderr when check fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _die_with_parent() -> None:
    # If pytest is killed, the host's unshare dies too, and --kill-child takes its PID 1 down.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


@dataclass(slots=True)
class Host:
    """One namespace host: its name, address, and the PID 1 that owns its processes."""

    name: str
    netns: str
    ip: str
    veth: str
    temp_dir: Path
    init: subprocess.Popen | None = None
    init_pid: int = 0

    def argv(self, *cmd: str) -> list[str]:
        """The argv that runs `cmd` inside this host (network, PID and mount namespaces)."""
        return ["nsenter", "-t", str(self.init_pid), "-p", "-m", "-n", "--", *cmd]

    def boot(self) -> None:
        """Start the host's PID 1 (a fresh PID namespace inside the network namespace)."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount-proc",
             "--kill-child", "python3", "-c", _INIT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.init.pid}/task/{self.init.pid}/children")
            try:
                pids = children.read_text().split()
            except FileNotFoundError:
                pids = []
            if pids:
                self.init_pid = int(pids[0])
                return
            time.sleep(0.05)
        raise RuntimeError(f"host {self.name}: PID 1 did not start")

    def kill(self) -> None:
        """Kill every process of this host at once (SIGKILL to its PID 1 ends the namespace)."""
        if self.init_pid:
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.init is not None:
            try:
                self.init.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.init.kill()
                self.init.wait(timeout=10)
        self.init, self.init_pid = None, 0

    def link(self, up: bool) -> None:
        """Cut or restore this host's only network link (the root-side end of its veth)."""
        run(["ip", "link", "set", self.veth, "up" if up else "down"])


@dataclass(slots=True)
class Network:
    """A bridge and N hosts; `create` builds it, `destroy` removes all of it."""

    run_id: str
    subnet: str
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        """The bridge's interface name (15 characters at most, as Linux requires)."""
        return f"{BRIDGE_PREFIX}{self.run_id}"

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge."""
        return f"{self.subnet}.1"

    def spawn(self, host: Host, argv: list[str], log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a long-running process inside `host`, logging to `log`; tracked for teardown."""
        out = open(log, "ab")  # noqa: SIM115 - the child owns it for its whole life
        proc = subprocess.Popen(host.argv(*argv), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        """Kill every host, then delete the namespaces, veths and bridge (errors ignored)."""
        for host in self.hosts:
            host.kill()
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for host in self.hosts:
            run(["ip", "link", "del", host.veth], check=False)
            run(["ip", "netns", "del", host.netns], check=False)
        run(["ip", "link", "del", self.bridge], check=False)


def _free_subnet() -> str:
    used = run(["ip", "-4", "route"]).stdout
    for third in range(int(os.getpid()) % 200 + 20, 256):
        subnet = f"10.77.{third}"
        if f"{subnet}.0/24" not in used:
            return subnet
    raise RuntimeError("no free 10.77.x.0/24 subnet for the test bridge")


def cleanup_stale() -> None:
    """Delete namespaces and bridges left by runs whose pytest process is gone."""
    for line in run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        run_id = name[len(PREFIX):].split("-")[0]
        if run_id.isdigit() and not Path(f"/proc/{run_id}").exists():
            # Anything still running there was started by that crashed run of this harness.
            for pid in run(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run(["ip", "netns", "del", name], check=False)
    for line in run(["ip", "-o", "link", "show"]).stdout.splitlines():
        ifname = line.split(":")[1].strip().split("@")[0]
        for prefix in (BRIDGE_PREFIX, "kvsv"):
            rest = ifname[len(prefix):]
            run_id = rest.split("h")[0]
            if ifname.startswith(prefix) and run_id.isdigit() \
                    and not Path(f"/proc/{run_id}").exists():
                run(["ip", "link", "del", ifname], check=False)


def new_host(net: Network, i: int, temp_root: Path) -> Host:
    """Host number ``i`` of ``net`` (address .1i on its subnet), not yet plugged in."""
    return Host(name=f"h{i}", netns=f"{PREFIX}{net.run_id}-h{i}", ip=f"{net.subnet}.{10 + i}",
                veth=f"kvsv{net.run_id}h{i}", temp_dir=temp_root / f"h{i}")


def plug_host(net: Network, host: Host, i: int, *, default_route: bool) -> None:
    """Give ``host`` its namespace and a veth pair on ``net``'s bridge, with its address;
    ``default_route`` sends its other traffic through the bridge's gateway."""
    peer = f"kvsp{net.run_id}h{i}"
    run(["ip", "netns", "add", host.netns])
    run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer])
    run(["ip", "link", "set", peer, "netns", host.netns])
    run(["ip", "link", "set", host.veth, "master", net.bridge, "up"])
    ns = ["ip", "netns", "exec", host.netns]
    run([*ns, "ip", "addr", "add", f"{host.ip}/24", "dev", peer])
    run([*ns, "ip", "link", "set", peer, "up"])
    run([*ns, "ip", "link", "set", "lo", "up"])
    if default_route:
        run([*ns, "ip", "route", "add", "default", "via", net.gateway])


def create(num_hosts: int, temp_root: Path, run_id: str | None = None) -> Network:
    """Build a bridge and `num_hosts` booted hosts at .10, .11, ... on a free /24."""
    run_id = run_id or str(os.getpid())
    net = Network(run_id=run_id, subnet=_free_subnet())
    try:
        run(["ip", "link", "add", net.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge])
        run(["ip", "link", "set", net.bridge, "up"])
        for i in range(num_hosts):
            host = new_host(net, i, temp_root)
            net.hosts.append(host)
            plug_host(net, host, i, default_route=True)
            host.boot()
    except BaseException:
        net.destroy()
        raise
    return net
