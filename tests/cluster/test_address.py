"""Which Ray cluster a command uses: --address > RAY_ADDRESS > recorded > none, and nothing else.

No Ray is started here: "answers" is a plain listening socket, "stale" a port nobody holds.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cluster import address
from kvstore.cluster.address import RecordedCluster, Resolved, resolve
from kvstore.errors import ConfigError
from tests.support.redis_server import free_port


@pytest.fixture
def listening() -> Iterator[str]:
    """host:port of a socket that accepts connections (a stand-in for a live GCS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def make_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {address.STATE_DIR_ENV: str(tmp_path), **extra}


def test_nothing_named_nothing_recorded_is_none(tmp_path: Path) -> None:
    assert resolve(None, make_env(tmp_path)) == Resolved(None, "none")


@pytest.mark.parametrize("flag, env_addr, want, source", [
    ("10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.1:6379", "--address"),
    (None, "10.0.0.2:6379", "10.0.0.2:6379", "RAY_ADDRESS"),
    ("", " 10.0.0.2:6379 ", "10.0.0.2:6379", "RAY_ADDRESS"),
    ("local", "10.0.0.2:6379", "local", "--address"),
    (None, "local", "local", "RAY_ADDRESS"),
    ("ray://head:10001", None, "ray://head:10001", "--address"),
])
def test_flag_beats_env_beats_record(tmp_path: Path, listening: str, flag: str | None,
                                     env_addr: str | None, want: str, source: str) -> None:
    address.record(RecordedCluster(listening, "disabled"), make_env(tmp_path))
    env = make_env(tmp_path, **({"RAY_ADDRESS": env_addr} if env_addr is not None else {}))
    got = resolve(flag, env)
    assert (got.address, got.source, got.recorded) == (want, source, None)


def test_recorded_cluster_that_answers_is_used(tmp_path: Path, listening: str) -> None:
    rec = RecordedCluster(listening, "disabled", head_pid=123, temp_dir="/tmp/x")
    path = address.record(rec, make_env(tmp_path))
    assert path == tmp_path / "cluster.json"
    assert resolve(None, make_env(tmp_path)) == Resolved(listening, "recorded", rec)


def test_stale_record_is_ignored_with_a_note(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stale = f"127.0.0.1:{free_port()}"  # nobody listens there
    address.record(RecordedCluster(stale, "disabled"), make_env(tmp_path))
    assert resolve(None, make_env(tmp_path)) == Resolved(None, "none")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "note" in err[0] and stale in err[0]


def test_local_is_never_a_host_name(tmp_path: Path) -> None:
    # "local" has no port: read as a host it would be refused below, so it must be the keyword.
    assert resolve("local", make_env(tmp_path)).address == address.LOCAL
    with pytest.raises(ConfigError, match="not HOST:PORT"):
        resolve("localhost", make_env(tmp_path))


def test_record_round_trip_and_forget(tmp_path: Path) -> None:
    env = make_env(tmp_path)
    assert address.recorded(env) is None
    rec = RecordedCluster("127.0.0.1:1", "token", head_pid=7, temp_dir="/tmp/kvs-ray-x")
    address.record(rec, env)
    assert address.recorded(env) == rec
    address.forget(env)
    assert address.recorded(env) is None
    address.forget(env)  # forgetting twice is fine


def test_unreadable_record_counts_as_none(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text("{not json")
    assert address.recorded(make_env(tmp_path)) is None


def test_private_ray_auth_mode_is_explicit() -> None:
    assert address.auth_mode_for_private_ray({}) == "disabled"
    assert address.auth_mode_for_private_ray({"RAY_AUTH_MODE": "token"}) == "token"
