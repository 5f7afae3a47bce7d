"""init_local_ray starts again after Ray's start-up timeouts (raylet or GCS), and only then."""

from __future__ import annotations

import pytest

from tests.support import local_ray


class FakeRay:
    """Stands in for ray.init/ray.shutdown: raises the queued errors, then starts."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.calls: list[str] = []

    def init(self, **kwargs: object) -> None:
        self.calls.append(f"init address={kwargs['address']}")
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


SLOW = Exception("The current node timed out during startup. This could happen because ...")
GCS_SLOW = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")


@pytest.mark.parametrize("slow", [SLOW, GCS_SLOW], ids=["raylet", "gcs-port-file"])
def test_a_slow_start_is_shut_down_and_started_again(monkeypatch: pytest.MonkeyPatch,
                                                     slow: Exception) -> None:
    fake = FakeRay([slow])
    monkeypatch.setattr(local_ray, "ray", fake)
    local_ray.init_local_ray(num_cpus=2)
    assert fake.calls == ["init address=local", "shutdown", "init address=local"]


def test_two_slow_starts_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_ray, "ray", FakeRay([SLOW, SLOW]))
    with pytest.raises(Exception, match="timed out during startup"):
        local_ray.init_local_ray()


def test_any_other_error_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeRay([ValueError("bad argument")])
    monkeypatch.setattr(local_ray, "ray", fake)
    with pytest.raises(ValueError, match="bad argument"):
        local_ray.init_local_ray()
    assert fake.calls == ["init address=local"]


def test_a_slow_starts_processes_are_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    monkeypatch.setattr(local_ray, "ray", FakeRay([]))
    spawned: list[subprocess.Popen[bytes]] = []

    def start() -> str:
        spawned.append(subprocess.Popen(["sleep", "60"]))  # a raylet that never registered
        if len(spawned) == 1:
            raise SLOW
        return "started"

    try:
        assert local_ray.start_surviving_slow(start) == "started"
        assert spawned[0].poll() is not None  # the first start's process was killed
        assert spawned[1].poll() is None  # the second start's is left running
    finally:
        for proc in spawned:
            proc.kill()
            proc.wait()
