"""Faults on the namespace cluster, each during a `kvstore generate` job.

Each test ends with outputs equal to the --no-cache reference and no block lost from a live
node (held by its store node and indexed, compared with a snapshot taken before the fault), and
records its recovery time in /tmp/kvstore-netns-recovery.json (printed at the end of the run).
"""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.config_loader import load_config
from tests.multihost.harness import (
    RayCluster,
    generate_argv,
    kvstore_generate,
    kvstore_start,
    kvstore_status,
    kvstore_stop,
    node_of_ip,
    probe,
    read_rows,
    redis_ping,
    restart_redis,
    start_workers,
    wait_for,
)

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

NUM_HOSTS = 3


def submit_async(cluster: RayCluster, argv: list[str]) -> subprocess.Popen:
    """`ray job submit` without waiting: the fault is injected while the job runs."""
    return subprocess.Popen(["ray", "job", "submit", "--address", cluster.dashboard_url, "--",
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=cluster.env)


def finish(proc: subprocess.Popen, output: Path, timeout: float = 180.0) -> list[dict]:
    """Wait for an async job; its output rows (the job must have succeeded)."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"job failed:\n{out[-4000:]}"
    return read_rows(output)


def assert_exact(rows: list[dict], reference: dict[str, list[int]]) -> None:
    """Bitwise the --no-cache tokens, request by request."""
    assert rows, "the job produced no output"
    assert {r["id"]: r["output_token_ids"] for r in rows} == {r["id"]: reference[r["id"]]
                                                              for r in rows}


def save(work_dir: Path, name: str, snapshot: dict) -> Path:
    path = work_dir / f"snapshot-{name}.json"
    path.write_text(json.dumps(snapshot))
    return path


def wait_healthy(cluster: RayCluster, before: Path, gone: tuple[str, ...] = (),
                 timeout: float = 90.0, since: float | None = None) -> dict:
    """Three store nodes serving (not the ``gone`` ones) and nothing lost from a node alive
    before and after; ``since`` (wall time of the fault) adds ``since_fault_s``."""
    extra = ["--since", repr(since)] if since is not None else []
    result = probe(cluster, "wait-healthy", "--nodes", str(NUM_HOSTS), "--before", str(before),
                   "--timeout", str(timeout), *extra, "--gone", *gone, timeout=timeout + 60)
    assert result["ok"], f"not restored after {result['elapsed_s']}s: {result.get('why')}; " \
                         f"now {result['snapshot']}"
    return result


def seed_on_h2(cluster: RayCluster, name: str, files: dict[str, Path], work_dir: Path,
               reference: dict[str, list[int]], job_config: Path) -> None:
    """Publish the set's blocks on h2 (prefill and decode there): the blocks the fault takes."""
    rows = kvstore_generate(cluster, files[name], work_dir / f"{name}-seed.jsonl",
                            prefill_resource="host_h2", decode_resource="host_h2",
                            config=job_config)
    assert_exact(rows, reference)


def restart_host(cluster: RayCluster, index: int) -> None:
    """A host whose Ray node was declared dead comes back as a new node (fresh processes)."""
    host = cluster.net.hosts[index]
    host.kill()
    host.boot()
    start_workers(cluster, [host])


def lose_h2_during_job(cluster: RayCluster, name: str, files: dict[str, Path],
                       work_dir: Path, reference: dict[str, list[int]], job_config: Path,
                       recovery_log: dict[str, float], cut_link: bool) -> None:
    """h2 holds the set's blocks; a job on h0 (prefill) and h1 (decode) reads them while h2's
    link is cut (or its processes killed): readers time out or are refused, recompute, and the
    job's outputs stay exact. Then h2 comes back and gets a store node again."""
    h2 = cluster.net.hosts[2]
    seed_on_h2(cluster, name, files, work_dir, reference, job_config)
    before = probe(cluster, "snapshot")
    h2_node = node_of_ip(before, h2.ip)
    assert len(before[h2_node]["held"]) >= 6
    snap = save(work_dir, name, {k: v for k, v in before.items() if k != h2_node})
    output = work_dir / f"{name}-fault.jsonl"
    job = submit_async(cluster, generate_argv(files[name], output, prefill_resource="host_h0",
                                              decode_resource="host_h1", config=job_config))
    probe(cluster, "wait-reads", "--ip", h2.ip, "--timeout", "120")
    fault_at = time.time()
    if cut_link:
        h2.link(up=False)
    else:
        h2.kill()
    # Ray's verdict is watched while the job runs (the job uses no probe), so its time is
    # when Ray declared h2 dead, not when the job happened to end.
    watcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wait-dead")
    dead = watcher.submit(probe, cluster, "wait-dead", "--ip", h2.ip, "--since",
                          repr(fault_at), "--timeout", "60")
    try:
        rows = finish(job, output)
        recovery_log[f"{name}_job_done_after_fault_s"] = round(time.time() - fault_at, 1)
        assert_exact(rows, reference)
        # The fault hit the job: requests after it read nothing from h2 and recomputed.
        assert any(h2_node not in r["sources"] for r in rows), rows
        recovery_log[f"{name}_requests_served_by_h2_before_fault"] = sum(
            h2_node in r["sources"] for r in rows)
        recovery_log[f"{name}_ray_declares_h2_dead_s"] = dead.result(timeout=120)[
            "since_fault_s"]
    finally:
        watcher.shutdown(wait=True)
        if cut_link:
            h2.link(up=True)
    restart_at = time.time()
    restart_host(cluster, 2)
    result = wait_healthy(cluster, snap, gone=(h2_node,), since=restart_at)
    recovery_log[f"{name}_h2_store_node_back_s"] = result["since_fault_s"]
    assert h2_node not in result["snapshot"]  # a new Ray node, a new store node
    # That the restored h2 serves jobs again is shown by the next job placed there (the kill
    # test seeds on h2; the coordinator test decodes on h2), not by one more job here.


def test_link_cut_mid_fetch(kvstore_cluster: RayCluster, prompt_files: dict[str, Path],
                            work_dir: Path, reference: dict[str, list[int]], job_config: Path,
                            recovery_log: dict[str, float]) -> None:
    """`ip link set ... down` on the host holding the blocks while another host fetches them."""
    lose_h2_during_job(kvstore_cluster, "cut", prompt_files, work_dir, reference, job_config,
                       recovery_log, cut_link=True)


def test_worker_host_killed(kvstore_cluster: RayCluster, prompt_files: dict[str, Path],
                            work_dir: Path, reference: dict[str, list[int]], job_config: Path,
                            recovery_log: dict[str, float]) -> None:
    """Every process of the host holding the blocks killed at once (its PID 1)."""
    lose_h2_during_job(kvstore_cluster, "kill", prompt_files, work_dir, reference, job_config,
                       recovery_log, cut_link=False)


def test_coordinator_killed_and_restarted(kvstore_cluster: RayCluster,
                                          prompt_files: dict[str, Path], work_dir: Path,
                                          reference: dict[str, list[int]], job_config: Path,
                                          recovery_log: dict[str, float]) -> None:
    """ray.kill(coordinator, no_restart=False) during a job: Ray restarts it, the nodes
    re-announce, nothing is lost, the job's outputs stay exact."""
    snap = save(work_dir, "coord", probe(kvstore_cluster, "snapshot"))
    output = work_dir / "coord.jsonl"
    job = submit_async(kvstore_cluster, generate_argv(prompt_files["coord"], output,
                                                      config=job_config))
    # The decode on h2 reading h1's blocks: the job is fetching now (waiting for its replicas
    # in the state API raced with short jobs, which could finish before they were listed).
    probe(kvstore_cluster, "wait-reads", "--ip", kvstore_cluster.net.hosts[1].ip,
          "--timeout", "120")
    # Kill, then wait (in the same driver) for every node to re-announce, timed from the kill.
    killed = probe(kvstore_cluster, "kill-coordinator", "--nodes", str(NUM_HOSTS), "--before",
                   str(snap), "--timeout", "90", timeout=240)
    assert killed["new_epoch"] != killed["old_epoch"]
    healthy = killed["healthy"]
    assert healthy["ok"], f"not restored after {healthy['elapsed_s']}s: " \
                          f"{healthy.get('why')}; now {healthy['snapshot']}"
    recovery_log["coordinator_answers_s"] = killed["answers_after_s"]
    recovery_log["coordinator_nodes_reannounced_s"] = healthy["since_fault_s"]
    assert_exact(finish(job, output), reference)
    wait_healthy(kvstore_cluster, snap)


def test_redis_restarted(kvstore_cluster: RayCluster, prompt_files: dict[str, Path],
                         work_dir: Path, reference: dict[str, list[int]], job_config: Path,
                         recovery_log: dict[str, float]) -> None:
    """Redis (the index) killed and restarted empty during a job: the coordinator finds its
    epoch marker gone, bumps the epoch, every live node re-announces, the index is rebuilt,
    nothing is lost, the job's outputs stay exact."""
    snap = save(work_dir, "redis", probe(kvstore_cluster, "snapshot"))
    resets = kvstore_status(kvstore_cluster)["metrics"].get("index_resets", 0)
    output = work_dir / "redis.jsonl"
    job = submit_async(kvstore_cluster, generate_argv(prompt_files["redis"], output,
                                                      config=job_config))
    # The decode on h2 reading h1's blocks: the job is fetching now (waiting for its replicas
    # in the state API raced with short jobs, which could finish before they were listed).
    probe(kvstore_cluster, "wait-reads", "--ip", kvstore_cluster.net.hosts[1].ip,
          "--timeout", "120")
    fault_at = time.time()
    restart_redis(kvstore_cluster)
    wait_for(lambda: redis_ping(kvstore_cluster), 30, "Redis answering again", 0.2)
    recovery_log["redis_answers_s"] = round(time.time() - fault_at, 1)
    result = wait_healthy(kvstore_cluster, snap, since=fault_at)
    recovery_log["redis_index_rebuilt_s"] = result["since_fault_s"]
    assert_exact(finish(job, output), reference)
    wait_healthy(kvstore_cluster, snap)
    assert kvstore_status(kvstore_cluster)["metrics"]["index_resets"] == resets + 1


def test_pool_filled_past_high_watermark(kvstore_cluster: RayCluster,
                                         prompt_files: dict[str, Path], work_dir: Path,
                                         reference: dict[str, list[int]], job_config: Path,
                                         recovery_log: dict[str, float]) -> None:
    """A job publishing ~3x a node's capacity: the coordinator evicts, the pool never overflows,
    outputs stay exact. Runs last: it restarts kvstore with a small capacity."""
    assert kvstore_stop(kvstore_cluster).returncode == 0
    capacity = 128 << 10  # about fifteen tiny-model blocks; the job publishes about forty-eight
    proc = kvstore_start(kvstore_cluster, capacity=str(capacity), config=job_config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    t0 = time.monotonic()
    rows = kvstore_generate(kvstore_cluster, prompt_files["fill"], work_dir / "fill.jsonl",
                            config=job_config)
    assert_exact(rows, reference)
    h1_ip = kvstore_cluster.net.hosts[1].ip
    high = load_config(str(job_config)).coordinator.high_watermark  # what the cluster runs with

    def settled() -> dict | None:
        status = kvstore_status(kvstore_cluster)
        (h1,) = [n for n in status["nodes"] if n.get("alive", True)
                 and n["address"].startswith(h1_ip + ":")]
        return h1 if h1["evictions"] > 0 and h1["used_bytes"] <= high * capacity else None

    h1 = wait_for(settled, 30, "h1's pool back under its high watermark", 0.5)
    recovery_log["pool_under_high_watermark_after_job_start_s"] = round(time.monotonic() - t0, 1)
    assert h1["capacity_bytes"] == capacity and h1["blocks"] > 0
