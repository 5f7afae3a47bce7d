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


def test_cut_link_node_dies_and_rejoins(ray_cluster: RayCluster,
                                        recovery_log: dict[str, float]) -> None:
    """A worker host's link cut: Ray declares it dead in seconds; restarted, it serves again."""
    import time

    from tests.cluster.harness import alive_nodes, start_node, wait_for

    host = ray_cluster.net.hosts[2]
    t0 = time.monotonic()
    host.link(up=False)
    try:
        wait_for(lambda: host.ip not in alive_nodes(ray_cluster), 60, f"{host.ip} declared dead")
        recovery_log["ray_node_declared_dead_after_link_cut_s"] = round(time.monotonic() - t0, 1)
    finally:
        host.link(up=True)
    # A node the GCS declared dead never comes back by itself: restart the host's Ray.
    t1 = time.monotonic()
    host.kill()
    host.boot()
    start_node(ray_cluster, host)
    wait_for(lambda: host.ip in alive_nodes(ray_cluster), 90, f"{host.ip} alive again", 2)
    recovery_log["ray_node_rejoin_after_restart_s"] = round(time.monotonic() - t1, 1)


# --- kvstore over the CLI contract; skipped until `kvstore generate` exists ---

SYSTEM_PROMPT = list(range(1, 97))  # six 16-token blocks every prompt shares


def _write_prompts(path: Path, ids: list[str]) -> Path:
    rows = [{"id": i, "prompt_token_ids": SYSTEM_PROMPT + [200 + n, 300 + n, 400 + n]}
            for n, i in enumerate(ids)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def kvstore_cluster(ray_cluster: RayCluster) -> RayCluster:
    """kvstore started on the namespace cluster (as deploy/cluster.yaml does on the head)."""
    from tests.cluster.harness import kvstore_cli_ready, kvstore_start

    if not kvstore_cli_ready():
        pytest.skip("kvstore CLI has no start/status/generate yet")
    proc = kvstore_start(ray_cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ray_cluster


def test_generate_across_hosts_equals_no_cache(kvstore_cluster: RayCluster,
                                               work_dir: Path) -> None:
    """Disaggregated generate on the cluster: outputs equal the --no-cache reference, and the
    second job (submitted from another host) reuses the system prompt's blocks from the store."""
    from tests.cluster.harness import kvstore_generate

    prompts = _write_prompts(work_dir / "prompts.jsonl", ["a", "b", "c"])
    ref = kvstore_generate(kvstore_cluster, prompts, work_dir / "ref.jsonl", no_cache=True)
    first = kvstore_generate(kvstore_cluster, prompts, work_dir / "first.jsonl")
    second = kvstore_generate(kvstore_cluster, prompts, work_dir / "second.jsonl",
                              from_host=kvstore_cluster.net.hosts[1])
    for r, a, b in zip(ref, first, second, strict=True):
        assert a["output_token_ids"] == r["output_token_ids"] == b["output_token_ids"]
    assert all(row["cached_tokens"] > 0 for row in second)
    assert any(row["sources"] for row in second), "decode fetched nothing from a store node"


def test_status_reports_a_store_node_per_host(kvstore_cluster: RayCluster) -> None:
    """`kvstore status --json` sees one store node on each of the three hosts."""
    from tests.cluster.harness import kvstore_status

    status = kvstore_status(kvstore_cluster)
    assert len(status.get("nodes", [])) == len(kvstore_cluster.net.hosts)
