"""Session fixtures: three namespace hosts with a Ray cluster, torn down at the end."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import netns
from tests.cluster.harness import RayCluster, boot_cluster

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
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def network(work_dir: Path) -> Iterator[netns.Network]:
    """Three hosts h0..h2 on a private bridge; stale leftovers of crashed runs removed first."""
    _require_netns()
    netns.cleanup_stale()
    net = netns.create(3, work_dir / "hosts")
    try:
        yield net
    finally:
        net.destroy()


@pytest.fixture(scope="session")
def ray_cluster(network: netns.Network, work_dir: Path) -> RayCluster:
    """Redis + Ray head in h0, Ray workers in h1 and h2, token auth on."""
    return boot_cluster(network, work_dir / "logs")


@pytest.fixture(scope="session")
def recovery_log() -> Iterator[dict[str, float]]:
    """Recovery times by fault, written to /tmp/kvstore-netns-recovery.json for the notes."""
    times: dict[str, float] = {}
    yield times
    if times:
        RECOVERY_FILE.write_text(json.dumps(times, indent=2, sort_keys=True))
        print(f"\nrecovery times (s): {times} -> {RECOVERY_FILE}")
