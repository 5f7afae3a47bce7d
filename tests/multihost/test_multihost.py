"""Multi-host tests: a real Ray cluster across network namespaces, driven by `ray job submit`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multihost.harness import (
    RayCluster,
    job_submit,
    kvstore_generate,
    kvstore_status,
    node_of_ip,
    probe,
)

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


def test_generate_across_hosts_equals_no_cache(kvstore_cluster: RayCluster, work_dir: Path,
                                               prompt_files: dict[str, Path],
                                               reference: dict[str, list[int]],
                                               job_config: Path) -> None:
    """Prefill on h1, decode on h2: the decode reads h1's blocks over gRPC; outputs equal the
    --no-cache reference. A second job, submitted from h1 with prefill on h2 and decode on h0,
    starts from the first job's system-prompt blocks."""
    hosts = kvstore_cluster.net.hosts
    first = kvstore_generate(kvstore_cluster, prompt_files["base"], work_dir / "first.jsonl",
                             config=job_config)
    assert [r["output_token_ids"] for r in first] == [reference[r["id"]] for r in first]
    nodes = probe(kvstore_cluster, "snapshot")
    h1_node, h2_node = node_of_ip(nodes, hosts[1].ip), node_of_ip(nodes, hosts[2].ip)
    # Every block the decode on h2 read came from h1's store node: it crossed hosts.
    assert [r["cached_tokens"] for r in first] == [0, 96, 96]
    for row in first:
        assert set(row["sources"]) == {h1_node}, row
        assert h2_node not in row["sources"]
    assert len(nodes[h1_node]["held"]) >= 6  # the system prompt: three chunks, six blocks

    second = kvstore_generate(kvstore_cluster, prompt_files["base"], work_dir / "second.jsonl",
                              prefill_resource="host_h2", decode_resource="host_h0",
                              config=job_config, from_host=hosts[1])
    assert [r["output_token_ids"] for r in second] == [reference[r["id"]] for r in second]
    assert all(r["cached_tokens"] >= 96 for r in second), second
    # The system prompt came from the first job's blocks: h1's, or h2's hot replica of them
    # (h2 read them three times, the coordinator's hot_fetch_threshold), never recomputed.
    assert all(set(r["sources"]) <= {h1_node, h2_node} and r["sources"] for r in second), second


def test_status_reports_a_store_node_per_host(kvstore_cluster: RayCluster) -> None:
    """`kvstore status --json` sees one live store node on each of the three hosts."""
    status = kvstore_status(kvstore_cluster)
    live = [n for n in status["nodes"] if n.get("alive", True)]
    ips = {n["address"].rpartition(":")[0] for n in live}
    assert ips == {h.ip for h in kvstore_cluster.net.hosts}
    assert status["totals"]["blocks"] > 0
