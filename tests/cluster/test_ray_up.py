"""`ray up deploy/cluster.yaml` for real: the local provider over SSH into three namespace hosts.

Runs last (file order): it reboots the session's hosts, ending their harness-started Ray, and
brings the cluster up the way a user does. The rendered YAML differs from deploy/cluster.yaml
only where this machine needs it: addresses, user and key, no pip install (every host already
shares this machine's installed kvstore and no index is reachable), and a small --capacity.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster import netns, sshd
from tests.cluster.conftest import make_prompts, write_jsonl
from tests.cluster.harness import GENERATE_FLAGS, HEALTH_ENV, read_rows, wait_for

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
    """`ray up`/`ray job submit` from the root namespace: a private HOME holding the token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HEALTH_ENV)
    env.update({"HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                "RAY_USAGE_STATS_ENABLED": "0",
                "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"})
    return env


def ray_cli(env: dict[str, str], *args: str, timeout: float = 300.0
            ) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def num_alive(env: dict[str, str], head: netns.Host) -> int:
    """Alive Ray nodes, asked from the head host."""
    proc = subprocess.run(head.argv(
        "python3", "-c", "import ray; ray.init(address='auto', logging_level='ERROR');"
        "print('ALIVE=%d' % sum(n['Alive'] for n in ray.nodes()))"), capture_output=True,
        text=True, timeout=60, env=env)
    counts = [ln for ln in proc.stdout.splitlines() if ln.startswith("ALIVE=")]
    return int(counts[-1][len("ALIVE="):]) if counts else 0


@pytest.mark.xfail(strict=True, raises=TimeoutError, reason=(
    "open: `ray up -y` succeeds over SSH and the head runs Ray, Redis and kvstore start, but "
    "the head's autoscaler never brings up worker_ips within 150 s (its monitor log is in the "
    "head's private /tmp/ray); not diagnosed yet"))
def test_ray_up_job_submit_ray_down(network: netns.Network, work_dir: Path) -> None:
    """ray up -y (head + two workers over SSH), ray job submit kvstore generate, ray down -y."""
    hosts = network.hosts
    logs, keys = work_dir / "logs", work_dir / "ssh"
    logs.mkdir(exist_ok=True)
    for host in hosts:  # fresh hosts: whatever the harness started in them ends here
        host.kill()
        host.boot()
    _, user_key = sshd.make_keys(keys)
    for host in hosts:
        sshd.private_home(host)
        sshd.start_sshd(network, host, keys, logs)
    home = work_dir / "launcher-home"
    token = secrets.token_hex(32)
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    (home / ".ray" / "auth_token").write_text(token)
    env = launcher_env(home, token)
    config = work_dir / "cluster-up.yaml"
    config.write_text(yaml.safe_dump(render(hosts, user_key)))

    up = ray_cli(env, "up", "-y", "--no-config-cache", str(config), timeout=300)
    (logs / "ray-up.log").write_text(up.stdout + up.stderr)
    try:
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        wait_for(lambda: num_alive(env, hosts[0]) == 3, 150, "both workers joined", 3)
        prompts = write_jsonl(work_dir / "up-prompts.jsonl", make_prompts()["base"])
        rows = {}
        for mode in ("cached", "no-cache"):
            out = work_dir / f"up-{mode}.jsonl"
            entry = ["kvstore", "generate", "--prompts", str(prompts), *GENERATE_FLAGS,
                     "--output", str(out)] + (["--no-cache"] if mode == "no-cache" else [])
            job = ray_cli(env, "job", "submit", "--address", f"http://{hosts[0].ip}:8265",
                          "--", *entry, timeout=240)
            assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
            rows[mode] = read_rows(out)
        assert [r["output_token_ids"] for r in rows["cached"]] == \
            [r["output_token_ids"] for r in rows["no-cache"]]
        assert [r["cached_tokens"] for r in rows["cached"]] == [0, 96, 96]
        status = subprocess.run(hosts[0].argv("kvstore", "status", "--json"),
                                capture_output=True, text=True, timeout=60, env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        nodes = json.loads(status.stdout)["nodes"]
        assert {n["address"].rpartition(":")[0] for n in nodes if n.get("alive", True)} == \
            {h.ip for h in hosts}
    finally:
        down = ray_cli(env, "down", "-y", str(config), timeout=180)
        (logs / "ray-down.log").write_text(down.stdout + down.stderr)
    assert down.returncode == 0, (down.stdout + down.stderr)[-3000:]
