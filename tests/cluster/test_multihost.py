"""Multi-host tests: a real Ray cluster across network namespaces, driven by `ray job submit`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.harness import RayCluster, job_submit

pytestmark = [pytest.mark.netns, pytest.mark.timeout(480)]

# One task per node, pinned by the per-host custom resource, each reporting where it ran.
_NODE_IPS_SCRIPT = """
import json, ray
ray.init(address="auto", logging_level="ERROR")
alive = [n for n in ray.nodes() if n["Alive"]]
hosts = sorted(r for n in alive for r in n["Resources"] if r.startswith("host_"))
@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address()
ips = ray.get([where.options(resources={h: 0.01}).remote() for h in hosts])
print("NODE_IPS=" + json.dumps(dict(zip(hosts, ips))))
"""


def _node_ips(stdout: str) -> dict[str, str]:
    for line in stdout.splitlines():
        if line.startswith("NODE_IPS="):
            return json.loads(line[len("NODE_IPS="):])
    raise AssertionError(f"job printed no NODE_IPS line:\n{stdout[-3000:]}")


def test_job_runs_a_task_on_every_host(ray_cluster: RayCluster, work_dir: Path) -> None:
    """A submitted job reaches all three hosts, each answering from its own address."""
    script = work_dir / "node_ips.py"
    script.write_text(_NODE_IPS_SCRIPT)
    proc = job_submit(ray_cluster, ["python3", str(script)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = _node_ips(proc.stdout)
    want = {f"host_{h.name}": h.ip for h in ray_cluster.net.hosts}
    assert got == want


def test_job_without_token_is_refused(ray_cluster: RayCluster, work_dir: Path) -> None:
    """Token auth is really on: a client with the wrong token cannot submit."""
    import subprocess

    env = {**ray_cluster.env, "RAY_AUTH_TOKEN": "0" * 64}
    proc = subprocess.run(["ray", "job", "submit", "--address", ray_cluster.dashboard_url,
                           "--", "true"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
