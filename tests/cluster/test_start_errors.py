"""``start`` is all or nothing, and an error raised in an actor comes back as kvstore's own.

On the session's private in-process Ray (``ray_local``): a second start with other settings is
refused and names the difference, the same settings change nothing, a start that fails inside
the coordinator leaves no actor behind (no watcher re-creating store nodes), and Ray's wrappers
unwrap to the original class, without colour codes.
"""

from __future__ import annotations

import time

import pytest
import ray

from kvstore.cli.main import error_line, exit_code
from kvstore.cluster import lifecycle
from kvstore.cluster.names import RAY_NAMESPACE
from kvstore.cluster.remote_errors import unwrap
from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config
from kvstore.errors import (
    ClusterConflict,
    ClusterUnavailable,
    ConfigError,
    IndexAuthError,
    IndexUnavailable,
    KVStoreError,
    NodeUnavailable,
)
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(240)


def make_config(capacity: int = 8 << 20, **index: str) -> KVStoreConfig:
    return load_config(env={}, overrides={"pool": {"capacity_bytes": capacity},
                                          "index": dict(index)})


def kvstore_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == RAY_NAMESPACE)


def test_second_start_refuses_other_settings_and_repeats_same(ray_local: None) -> None:
    asked = make_config(8 << 20)
    first = lifecycle.start(asked)
    try:
        assert not first.already_running and first.capacity_bytes == 8 << 20
        with pytest.raises(ClusterConflict) as err:
            lifecycle.start(make_config(4 << 20))
        assert "pool.capacity_bytes: running 8388608, asked 4194304" in str(err.value)
        again = lifecycle.start(make_config(8 << 20))
        assert again.already_running and again.capacity_bytes == 8 << 20
        assert again.epoch == first.epoch  # the same coordinator, not a new one
    finally:
        lifecycle.stop(asked)
    assert kvstore_actors() == []


def test_redis_url_difference_is_shown_masked(ray_local: None) -> None:
    running = make_config(backend="redis", redis_url="redis://:old-secret@10.0.0.1:6380/0")
    asked = make_config(backend="redis", redis_url="redis://:new-secret@10.0.0.2:6380/0")
    (line,) = lifecycle.config_differences(running, asked)
    assert "old-secret" not in line and "new-secret" not in line
    assert "redis://:***@10.0.0.1:6380/0" in line and "redis://:***@10.0.0.2:6380/0" in line


def test_failed_start_undoes_everything(ray_local: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Skip the up-front Redis check, so the failure happens later: in the actor.
    monkeypatch.setattr(lifecycle, "check_index", lambda config: None)
    url = f"redis://:hidden-pw@127.0.0.1:{free_port()}/0"  # nobody listens there
    with pytest.raises(Exception) as err:
        lifecycle.start(make_config(backend="redis", redis_url=url))
    original = unwrap(err.value)
    assert isinstance(original, IndexUnavailable), repr(original)
    assert ":***@127.0.0.1" in str(original) and "hidden-pw" not in str(original)
    assert exit_code(original) == 4
    assert kvstore_actors() == []
    time.sleep(2 * lifecycle.WATCH_INTERVAL_S)  # a live watcher would have re-created a node
    assert kvstore_actors() == []


@ray.remote(num_cpus=0)
class Raiser:
    """Raises a given kvstore error in its constructor or in a method."""

    def __init__(self, in_init: KVStoreError | None) -> None:
        if in_init is not None:
            raise in_init

    def fail(self, exc: KVStoreError) -> None:
        raise exc


@pytest.mark.parametrize("exc", [IndexAuthError("Redis index at redis://:***@h:1/0 refused"),
                                 ClusterConflict("already runs with other settings")])
def test_actor_errors_unwrap_to_the_original(ray_local: None, exc: KVStoreError) -> None:
    in_method = Raiser.remote(None)  # type: ignore[attr-defined]
    with pytest.raises(Exception) as err:
        ray.get(in_method.fail.remote(exc))
    got = unwrap(err.value)
    assert type(got) is type(exc) and str(got) == str(exc)

    in_init = Raiser.remote(exc)  # type: ignore[attr-defined]
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(in_init.fail.remote(exc))
    assert "\x1b[" in str(died.value)  # what operators would see without unwrap
    got = unwrap(died.value)
    assert type(got) is type(exc) and str(got) == str(exc)
    line = error_line(got)
    assert line == f"kvstore: error: {exc}" and "\x1b" not in line


@pytest.mark.parametrize("exc, code", [
    (ConfigError("x"), 2), (ValueError("x"), 2), (ClusterUnavailable("x"), 3),
    (NodeUnavailable("x"), 3), (IndexUnavailable("x"), 4), (IndexAuthError("x"), 4),
    (ClusterConflict("x"), 5), (KVStoreError("x"), 1), (RuntimeError("x"), 1),
    (KeyboardInterrupt(), 130),
])
def test_exit_code_per_kind(exc: BaseException, code: int) -> None:
    assert exit_code(exc) == code
