"""`ray up deploy/cluster.yaml` for real: the local provider over SSH into three namespace hosts.

Runs last (file order): it reboots the session's hosts, ending their harness-started Ray, and
brings the cluster up the way a user does. The rendered YAML differs from deploy/cluster.yaml
only where this machine needs it: addresses, user and key, no pip install (every host already
shares this machine's installed kvstore and no index is reachable), and a small --capacity.
Then the stop steps of the YAML's header: `ray exec ... "kvstore stop"`, `ray down -y`, and
`ray stop` on each worker over SSH, checking that no Ray process is left on any host.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.multihost import netns, sshd
from tests.multihost.conftest import make_prompts, write_jsonl
from tests.multihost.harness import GENERATE_FLAGS, HEALTH_ENV, read_rows, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.timeout(420)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def render(hosts: list[netns.Host], user_key: Path) -> dict:
    """deploy/cluster.yaml with this machine's addresses, key and install step."""
    text = (DEPLOY / "cluster.yaml").read_text()
    subs = {"YOUR_HEAD_NODE_IP": hosts[0].ip, "YOUR_WORKER_NODE_IP_1": hosts[1].ip,
            "YOUR_WORKER_NODE_IP_2": hosts[2].ip, "YOUR_SSH_USER": "root",
            "--capacity=4GiB": "--capacity=64MiB"}
    for placeholder, value in subs.items():
        text = text.replace(placeholder, value)
    config = yaml.safe_load(text)
    config["auth"]["ssh_private_key"] = str(user_key)
    # kvstore is installed on this machine and the hosts share its filesystem: check, not pip.
    config["setup_commands"] = ["kvstore --help > /dev/null"] + [
        c for c in config["setup_commands"] if not c.startswith("pip ")]
    return config


def launcher_env(home: Path, token: str) -> dict[str, str]:
    """`ray up`/`ray job submit` from the root namespace: a private HOME and TMPDIR.

    HOME holds the token; TMPDIR keeps the launcher's local-provider state file
    ($TMPDIR/ray/cluster-kvstore.state) out of this machine's shared /tmp/ray.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HEALTH_ENV)
    tmp = home / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "TMPDIR": str(tmp), "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0",
                "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"})
    return env


def ray_cli(env: dict[str, str], *args: str, timeout: float = 300.0
            ) -> subprocess.CompletedProcess:
    """A `ray` CLI call in its own session, so a timeout kills its ssh/rsync children too."""
    proc = subprocess.Popen(["ray", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[killed after {timeout:.0f}s]"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def num_alive(env: dict[str, str], head: netns.Host) -> int:
    """Alive Ray nodes, asked from the head host."""
    proc = subprocess.run(head.argv(
        "python3", "-c", "import ray; ray.init(address='auto', logging_level='ERROR');"
        "print('ALIVE=%d' % sum(n['Alive'] for n in ray.nodes()))"), capture_output=True,
        text=True, timeout=60, env=env)
    counts = [ln for ln in proc.stdout.splitlines() if ln.startswith("ALIVE=")]
    return int(counts[-1][len("ALIVE="):]) if counts else 0


def host_processes(host: netns.Host) -> list[str]:
    """Command lines of every process in the host's PID namespace (its own /proc)."""
    proc = subprocess.run(host.argv("ps", "-e", "-o", "args="), capture_output=True, text=True,
                          timeout=30)
    return proc.stdout.splitlines()


def ray_processes(host: netns.Host) -> list[str]:
    """The host's Ray processes: GCS, raylet, agents (run from Ray's package) and workers."""
    return [a for a in host_processes(host)
            if "site-packages/ray/" in a or a.startswith("ray::")]


def monitor_tail(head: netns.Host, lines: int = 40) -> str:
    """The end of the head's autoscaler log (in its private /tmp/ray), for failure messages."""
    logs = sorted((head.temp_dir / "ray-tmp").glob("session_2*/logs/monitor.log"))
    return "\n".join(logs[-1].read_text().splitlines()[-lines:]) if logs else "(no monitor.log)"


def kill_marked(marker: str) -> list[int]:
    """SIGKILL processes in this namespace whose command line holds ``marker`` (ssh masters).

    The marker is this run's private key path, so only what this test's `ray` calls started
    matches (ControlPersist masters outlive the `ray` process that spawned them).
    """
    killed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace"):
                pid = int(cmdline.parent.name)
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return killed


#: The last `kvstore status` answer store_node_ips saw (its error, or its output), for the
#: failure message when the store nodes never all show.
LAST_STATUS: dict[str, str] = {}


def store_node_ips(env: dict[str, str], head: netns.Host) -> set[str]:
    """Addresses of the live store nodes `kvstore status --json` reports, asked from the head.

    The cluster is named (RAY_ADDRESS, as an operator elsewhere than the head's own login
    would): kvstore's operator commands never scan for a Ray cluster, and the record `kvstore
    start` left is in the head's home, not in the launcher's HOME this env carries."""
    proc = subprocess.run(head.argv("kvstore", "status", "--json"), capture_output=True,
                          text=True, timeout=60, env={**env, "RAY_ADDRESS": f"{head.ip}:6379"})
    if proc.returncode != 0:
        LAST_STATUS["error"] = f"kvstore status exit {proc.returncode}: {proc.stderr[-2000:]}"
        return set()
    LAST_STATUS["error"] = proc.stdout[-2000:]
    nodes = json.loads(proc.stdout)["nodes"]
    return {n["address"].rpartition(":")[0] for n in nodes if n.get("alive", True)}


def test_ray_up_job_submit_ray_down(network: netns.Network, work_dir: Path,
                                    reference: dict[str, list[int]]) -> None:
    """ray up -y (head + two workers over SSH), ray job submit kvstore generate (its outputs
    equal the --no-cache reference), ray down -y."""
    hosts = network.hosts
    logs, keys = work_dir / "logs", work_dir / "ssh"
    logs.mkdir(exist_ok=True)
    for host in hosts:  # fresh hosts: whatever the harness started in them ends here
        host.kill()
        host.boot()
    _, user_key = sshd.make_keys(keys)
    home = work_dir / "launcher-home"
    token = secrets.token_hex(32)
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    (home / ".ray" / "auth_token").write_text(token)
    env = launcher_env(home, token)
    config = work_dir / "cluster-up.yaml"
    config.write_text(yaml.safe_dump(render(hosts, user_key)))
    down = None
    try:
        for host in hosts:
            sshd.private_home(host)
            sshd.start_sshd(network, host, keys, logs)
        up = ray_cli(env, "up", "-y", "--no-config-cache", str(config), timeout=300)
        (logs / "ray-up.log").write_text(up.stdout + up.stderr)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        try:
            # The head's autoscaler SSHes into worker_ips; kvstore's watcher then gives each
            # joined node a store node.
            wait_for(lambda: num_alive(env, hosts[0]) == 3, 150, "both workers joined", 3)
            want = {h.ip for h in hosts}
            wait_for(lambda: store_node_ips(env, hosts[0]) == want, 60,
                     f"a store node on each of {sorted(want)}", 2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nlast kvstore status: {LAST_STATUS.get('error')}\n"
                                 f"head autoscaler log:\n{monitor_tail(hosts[0])}") from exc
        prompts = write_jsonl(work_dir / "up-prompts.jsonl", make_prompts()["base"])
        out = work_dir / "up-cached.jsonl"
        job = ray_cli(env, "job", "submit", "--address", f"http://{hosts[0].ip}:8265", "--",
                      "kvstore", "generate", "--prompts", str(prompts), *GENERATE_FLAGS,
                      "--output", str(out), timeout=240)
        assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
        rows = read_rows(out)
        # The session's --no-cache reference (the same flags, computed without Ray).
        assert {r["id"]: r["output_token_ids"] for r in rows} == \
            {r["id"]: reference[r["id"]] for r in rows}
        assert [r["cached_tokens"] for r in rows] == [0, 96, 96]

        stop = ray_cli(env, "exec", str(config), "kvstore stop", timeout=120)
        (logs / "kvstore-stop.log").write_text(stop.stdout + stop.stderr)
        assert stop.returncode == 0, (stop.stdout + stop.stderr)[-3000:]
        wait_for(lambda: not any(a.startswith(("ray::StoreNode", "ray::Coordinator"))
                                 for h in hosts for a in host_processes(h)),
                 30, "the store node and coordinator actors to exit after kvstore stop")
        down = ray_cli(env, "down", "-y", str(config), timeout=180)
        (logs / "ray-down.log").write_text(down.stdout + down.stderr)
        assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
        # `ray down` with the local provider runs `ray stop` on the head only (it just marks the
        # workers terminated in its state file; their raylets exit ~50 s later, agents linger)...
        assert not ray_processes(hosts[0]), f"Ray left on the head: {ray_processes(hosts[0])}"
        # ... so stop each worker's Ray over SSH (deploy/cluster.yaml's header); none may be left.
        for host in hosts[1:]:
            stop_worker = sshd.ssh(user_key, host, "ray stop")
            assert stop_worker.returncode == 0, stop_worker.stderr[-2000:]
        left = {h.name: ray_processes(h) for h in hosts}
        assert not any(left.values()), f"Ray processes left after ray down: {left}"
    finally:
        if down is None:  # failed before ray down: still stop the cluster the way a user would
            down = ray_cli(env, "down", "-y", str(config), timeout=120)
            (logs / "ray-down.log").write_text(down.stdout + down.stderr)
        for host in hosts:  # everything this test started in the hosts (sshd, Ray, Redis)
            host.kill()
            host.boot()
        kill_marked(str(user_key))  # the launcher's ssh ControlPersist masters
