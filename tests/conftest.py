"""Shared fixtures: a private redis-server per session and an index on every backend.

Integration fixtures start the real thing (docs/design.md §2). Without ``redis-server`` the Redis
tests skip, unless ``KVSTORE_REQUIRE_REDIS=1`` (CI), where a missing server is a failure.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from kvstore.index.base import Index
from kvstore.index.memory import InMemoryIndex

if TYPE_CHECKING:  # the redis client is imported where a test needs Redis: a GPU machine has none
    from tests.support.redis_server import RedisProcess

# Ray 2.60 turns token auth on for any process that finds ~/.ray/auth_token and no
# RAY_AUTH_MODE, and its C++ side reads the mode once per process. A fixture that set the
# variable and later removed it left this process "disabled" while the next GCS it started
# demanded a token (InvalidAuthToken). One mode for the whole session, set before anything
# imports Ray: every process a test starts inherits it (multi-host tests set their own).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# A new GCS has 30 s to write its port file. On a loaded 2-core CI box one start missed it
# (a module's cluster fixture failed: "Timed out waiting for file .../gcs_server_port_...").
# Ray's documented override, inherited by every Ray process a test starts; a start that
# still misses it is retried once (tests/support/local_ray.py). Not longer: a GCS that died
# at start (seen once, re-starting the session's Ray after a multi-node module) never writes
# the file, and the suite waited out all 120 s of an earlier setting before the retry.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "60")
# A Ray node that gets SIGTERM drains for up to 30 s first (for Serve on Kubernetes). Every
# cluster a test starts is thrown away whole, so each stop would only wait that drain out.
os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip where torch sees no CUDA device (CI, these CPU machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_redis_server() -> None:
    """Skip (or, with KVSTORE_REQUIRE_REDIS=1, fail) when redis-server is not installed."""
    if shutil.which("redis-server") is not None:
        return
    message = "redis-server is not on PATH (apt-get install redis-server)"
    if os.environ.get("KVSTORE_REQUIRE_REDIS") == "1":
        pytest.fail(f"{message}; KVSTORE_REQUIRE_REDIS=1 makes this a failure")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One private redis-server on a free port for the whole session."""
    require_redis_server()
    from tests.support.redis_server import start_redis_server

    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def index(request: pytest.FixtureRequest) -> Iterator[Index]:
    """A clean index on each backend; Redis ones get a unique key prefix, so tests never meet."""
    if request.param == "memory":
        idx: Index = InMemoryIndex()
    else:
        from kvstore.index.redis import RedisIndex

        server = request.getfixturevalue("redis_server")
        idx = RedisIndex(server.url, key_prefix=f"test-{uuid.uuid4().hex[:12]}:")
    yield idx
    idx.clear()
    idx.close()


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the operator's ``~/.kvstore``: the cluster `kvstore start`
    records (kvstore.cluster.address) lives in a directory of this session's own, which every
    subprocess a test starts inherits."""
    from kvstore.cluster.address import STATE_DIR_ENV

    # The cluster secrets a secure start makes (kvstore.security.secrets_store) likewise: never
    # ~/.ray/kvstore.
    names = (STATE_DIR_ENV, "KVSTORE_SECURITY_SECRETS_DIR")
    before = {name: os.environ.get(name) for name in names}
    os.environ[STATE_DIR_ENV] = str(tmp_path_factory.mktemp("kvstore-state"))
    os.environ["KVSTORE_SECURITY_SECRETS_DIR"] = str(tmp_path_factory.mktemp("kvstore-secrets"))
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray instance for the whole session (2 CPUs, no dashboard)."""
    import ray

    from tests.support.local_ray import init_local_ray

    if not ray.is_initialized():
        # address="local": always a private instance, never one another process left running.
        init_local_ray(num_cpus=2, include_dashboard=False, namespace="kvstore-tests")
    yield
    ray.shutdown()


@pytest.fixture
def fresh_redis() -> Iterator[RedisProcess]:
    """A redis-server of this test's own: restarting it disturbs no other test."""
    require_redis_server()
    from tests.support.redis_server import start_redis_server

    server = start_redis_server()
    yield server
    server.stop()
