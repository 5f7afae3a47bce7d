"""Session fixtures: three namespace hosts with a Ray cluster, torn down at the end."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.node import arena_files
from tests.multihost import netns
from tests.multihost.harness import (
    GENERATE_FLAGS,
    Prober,
    RayCluster,
    boot_cluster,
    kvstore_start,
    read_rows,
)

RECOVERY_FILE = Path(tempfile.gettempdir()) / "kvstore-netns-recovery.json"


def _require_netns() -> None:
    """Skip when namespaces are unavailable, unless KVSTORE_REQUIRE_NETNS=1 makes that a failure."""
    try:
        netns.check_prerequisites()
    except netns.NetnsUnavailable as exc:
        if os.environ.get("KVSTORE_REQUIRE_NETNS") == "1":
            pytest.fail(f"KVSTORE_REQUIRE_NETNS=1 but {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def work_dir() -> Iterator[Path]:
    """A short-pathed temp dir (Ray's unix sockets must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=f"kvs{os.getpid()}-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    if os.environ.get("KVSTORE_KEEP_LOGS") != "1":  # keep logs and snapshots to debug a run
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def network(work_dir: Path) -> Iterator[netns.Network]:
    """Three hosts h0..h2 on a private bridge; stale leftovers of crashed runs removed first."""
    _require_netns()
    netns.cleanup_stale()
    # The hosts share /dev/shm; arenas of store nodes this session kills with their host (RAM
    # on tmpfs) are removed at the end. Files that were there before are not ours to touch, nor
    # are new ones whose owner is alive in this namespace (another run's store node): the
    # hosts' owners count in PID namespaces of their own, which are gone with the hosts.
    before = set(glob.glob("/dev/shm/kvstore-arena-*"))
    net = netns.create(3, work_dir / "hosts")
    try:
        yield net
    finally:
        net.destroy()
        for path in set(glob.glob("/dev/shm/kvstore-arena-*")) - before:
            arena = arena_files.parse(path)
            if arena is not None and arena_files.owner_state(arena.owner) == "alive":
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.fixture(scope="session")
def reference_run(work_dir: Path) -> Iterator[subprocess.Popen]:
    """The --no-cache reference, computed without Ray (`generate --in-process --no-cache`)
    while the cluster boots: a path that shares no store, no gRPC and no Ray with the tests."""
    everything = [row for rows in make_prompts().values() for row in rows]
    prompts = write_jsonl(work_dir / "prompts-all.jsonl", everything)
    argv = ["kvstore", "generate", "--in-process", "--no-cache", "--prompts", str(prompts),
            *GENERATE_FLAGS, "--output", str(work_dir / "reference.jsonl")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def ray_cluster(network: netns.Network, work_dir: Path, reference_run: subprocess.Popen
                ) -> RayCluster:
    """Redis + Ray head in h0, Ray workers in h1 and h2, token auth on (the reference is
    computed meanwhile)."""
    return boot_cluster(network, work_dir / "logs")


#: Short client deadlines so a reader facing a cut link gives up in seconds and recomputes.
JOB_CONFIG = "client:\n  timeout_s: 4\n  retries: 1\n"


@pytest.fixture(scope="session")
def job_config(work_dir: Path) -> Path:
    """The --config of every job and of `kvstore start` (short client deadlines)."""
    path = work_dir / "kvstore.yaml"
    path.write_text(JOB_CONFIG)
    return path


@pytest.fixture(scope="session")
def kvstore_cluster(ray_cluster: RayCluster, job_config: Path) -> Iterator[RayCluster]:
    """kvstore started on the namespace cluster with Redis as index (as deploy/cluster.yaml),
    and the session's probe driver in the head host."""
    proc = kvstore_start(ray_cluster, config=job_config)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ray_cluster.prober = Prober.start(ray_cluster)
    yield ray_cluster
    ray_cluster.prober.stop()


@pytest.fixture(scope="session")
def recovery_log() -> Iterator[dict[str, float]]:
    """Recovery times by fault, written to /tmp/kvstore-netns-recovery.json for the notes."""
    times: dict[str, float] = {}
    yield times
    if times:
        RECOVERY_FILE.write_text(json.dumps(times, indent=2, sort_keys=True))
        print(f"\nrecovery times (s): {times} -> {RECOVERY_FILE}")


#: Prompt sets: each test publishes its own system prompt (three 32-token chunks, six blocks)
#: so the blocks it reads or loses are its own; "fill" is many distinct prompts (eviction).
#: A host fault needs a few requests after it (they recompute), not dozens.
PROMPT_SETS = {"base": 3, "cut": 8, "kill": 8, "coord": 6, "redis": 6,
               # test_attacks: tenant A's own prompts, and the public prompt an attacker plants
               "tenant": 2, "plant": 2}
NUM_FILL_PROMPTS = 6


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


def make_prompts() -> dict[str, list[dict]]:
    """Every prompt set, deterministic: {set: [{"id", "token_ids"}]}."""
    rng = random.Random(1234)
    sets: dict[str, list[dict]] = {}
    for name, count in PROMPT_SETS.items():
        system = _tokens(rng, 96)
        sets[name] = [{"id": f"{name}-{i}", "token_ids": system + _tokens(rng, 20 + i)}
                      for i in range(count)]
    sets["fill"] = [{"id": f"fill-{i}", "token_ids": _tokens(rng, 130)}
                    for i in range(NUM_FILL_PROMPTS)]
    return sets


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """One JSON object a line, as `kvstore generate --prompts` reads."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def prompt_files(work_dir: Path) -> dict[str, Path]:
    """Each prompt set as a JSONL file on the shared filesystem (every host reads it)."""
    return {name: write_jsonl(work_dir / f"prompts-{name}.jsonl", rows)
            for name, rows in make_prompts().items()}


@pytest.fixture(scope="session")
def reference(reference_run: subprocess.Popen, work_dir: Path) -> dict[str, list[int]]:
    """`--no-cache` outputs of every prompt: {id: output_token_ids}."""
    _, err = reference_run.communicate(timeout=300)
    assert reference_run.returncode == 0, f"reference run failed: {err[-3000:]}"
    rows = read_rows(work_dir / "reference.jsonl")
    assert len(rows) == sum(len(prompts) for prompts in make_prompts().values())
    return {row["id"]: row["output_token_ids"] for row in rows}
