"""Failures of the ``kvstore`` console script: one line, the exit code of its kind, --debug.

Run as subprocesses, as operators run them, with a private ``KVSTORE_STATE_DIR`` and no
``RAY_*`` variables, so nothing here can find (or touch) another Ray on the machine. None of
these starts Ray: each fails before it would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvstore.cluster import address
from kvstore.cluster.address import RecordedCluster
from tests.conftest import require_redis_server
from tests.support.redis_server import RedisProcess, free_port, start_redis_server

pytestmark = pytest.mark.timeout(180)


def operator_env(tmp_path: Path) -> dict[str, str]:
    """An operator's environment: no kvstore or Ray settings, the cluster record and any
    secrets a secure start makes in the test's own directory (never ~/.ray/kvstore)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env[address.STATE_DIR_ENV] = str(tmp_path)
    env["KVSTORE_SECURITY_SECRETS_DIR"] = str(tmp_path / "secrets")
    return env


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = operator_env(tmp_path)
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], capture_output=True,
                          text=True, env=env, timeout=120)


#: What `kvstore start` says first when --redis carries a password (it still works).
ARGV_PASSWORD_WARNING = "kvstore: warning: the Redis password in --redis is visible"


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr's lines without the argv-password warning, which must be there exactly when
    the command line had a password in a Redis URL."""
    lines = proc.stderr.strip().splitlines()
    warned = [ln for ln in lines if ln.startswith(ARGV_PASSWORD_WARNING)]
    with_password = any(str(a).startswith("redis") and urlsplit(str(a)).password
                        for a in proc.args)
    assert len(warned) == int(bool(with_password)), proc.stderr
    return [ln for ln in lines if not ln.startswith(ARGV_PASSWORD_WARNING)]


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvstore: error: ") and "Traceback" not in proc.stderr
    return lines[0]


def test_dead_redis_is_exit_4_naming_redis_masked(tmp_path: Path) -> None:
    url = f"redis://:hidden-pw@127.0.0.1:{free_port()}/0"
    proc = run_cli(tmp_path, "start", "--redis", url)
    assert proc.returncode == 4
    line = one_error_line(proc)
    assert "Redis" in line and f":***@127.0.0.1:{url.rsplit(':', 1)[1]}" in line
    assert "hidden-pw" not in proc.stderr
    assert address.recorded({address.STATE_DIR_ENV: str(tmp_path)}) is None  # nothing started


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    plain = run_cli(tmp_path, "start", "--redis", url)
    debug = run_cli(tmp_path, "start", "--redis", url, "--debug")
    assert plain.returncode == debug.returncode == 4
    assert "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == one_error_line(plain)


@pytest.mark.redis
def test_password_for_a_redis_without_one_is_an_error(tmp_path: Path,
                                                      redis_server: RedisProcess) -> None:
    assert redis_server.password is None
    url = f"redis://:anything@127.0.0.1:{redis_server.port}/0"
    proc = run_cli(tmp_path, "start", "--redis", url)
    assert proc.returncode == 4
    line = one_error_line(proc)
    assert "none configured" in line and "anything" not in line


@pytest.mark.redis
def test_wrong_redis_password_is_exit_4(tmp_path: Path) -> None:
    require_redis_server()
    server = start_redis_server(password="right-pw")
    try:
        proc = run_cli(tmp_path, "start", "--redis", server.url.replace("right-pw", "wrong-pw"))
    finally:
        server.stop()
    assert proc.returncode == 4
    line = one_error_line(proc)
    assert "Redis" in line and "wrong-pw" not in line and ":***@" in line


@pytest.mark.redis
def test_wrong_redis_password_from_a_file_is_exit_4_without_argv_warning(tmp_path: Path) -> None:
    """The documented way: the URL has no password, --redis-password-file names it."""
    require_redis_server()
    server = start_redis_server(password="right-pw")
    pw = tmp_path / "redis_password"
    pw.write_text("wrong-pw\n")
    try:
        proc = run_cli(tmp_path, "start", "--redis", f"redis://127.0.0.1:{server.port}/0",
                       "--redis-password-file", str(pw))
    finally:
        server.stop()
    assert proc.returncode == 4
    line = one_error_line(proc)  # and no argv-password warning: nothing secret in argv
    assert "rejected the credentials" in line and "wrong-pw" not in proc.stderr


def test_no_cluster_is_exit_3_saying_what_to_run(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "status")
    assert proc.returncode == 3
    assert "run `kvstore start`" in one_error_line(proc)


def test_stale_record_is_ignored_with_a_note(tmp_path: Path) -> None:
    stale = f"127.0.0.1:{free_port()}"
    address.record(RecordedCluster(stale, "disabled"), {address.STATE_DIR_ENV: str(tmp_path)})
    proc = run_cli(tmp_path, "status")
    assert proc.returncode == 3
    note, error = error_lines(proc)
    assert note.startswith("kvstore: note: ignoring") and stale in note
    assert error.startswith("kvstore: error: no Ray cluster")


def test_address_must_be_host_port_or_keyword(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "status", "--address", "localhost")
    assert proc.returncode == 2
    assert "'local' (a private Ray instance)" in one_error_line(proc)


#: The CLI with the up-front Redis check switched off, so a bad Redis URL fails later:
#: inside the coordinator actor, after `kvstore start` has started a Ray head of its own.
_NO_PRECHECK = ("import sys; from kvstore.cluster import lifecycle; "
                "lifecycle.check_index = lambda config: None; "
                "from kvstore.cli.main import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.timeout(300)
def test_start_failing_in_an_actor_undoes_the_head_it_started(tmp_path: Path) -> None:
    env = operator_env(tmp_path)
    url = f"redis://:hidden-pw@127.0.0.1:{free_port()}/0"
    proc = subprocess.run([sys.executable, "-c", _NO_PRECHECK, "start", "--redis", url],
                          capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 4, proc.stderr  # the actor's IndexUnavailable, unwrapped
    note, error = error_lines(proc)
    head_address = note.split(" at ")[1].split()[0]
    assert note.startswith("kvstore: started a local Ray head")
    assert error.startswith("kvstore: error: Redis index at redis://:***@127.0.0.1:")
    assert "\x1b" not in proc.stderr and "hidden-pw" not in proc.stderr
    assert address.recorded({address.STATE_DIR_ENV: str(tmp_path)}) is None
    assert not address.answers(head_address)  # the head it started is gone again


def test_a_capacity_shm_cannot_hold_is_refused_before_a_head_starts(tmp_path: Path) -> None:
    from kvstore.node.shm_space import free_bytes

    too_big = free_bytes("/dev/shm") + (1 << 30)
    proc = run_cli(tmp_path, "start", "--capacity", str(too_big))
    assert proc.returncode == 2
    line = one_error_line(proc)  # and no "started a local Ray head" note before it
    assert "does not fit in /dev/shm" in line and "--capacity" in line
    assert address.recorded({address.STATE_DIR_ENV: str(tmp_path)}) is None


def test_stop_with_nothing_running_says_so_without_suggesting_a_command(tmp_path: Path) -> None:
    proc = run_cli(tmp_path, "stop")
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert line.startswith("kvstore: error: nothing to stop") and "`kvstore" not in line


@pytest.mark.parametrize("command", ["start", "status"])
def test_an_address_nobody_answers_at_suggests_dropping_it(tmp_path: Path, command: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    proc = run_cli(tmp_path, command, "--address", dead)
    assert proc.returncode == 3
    line = one_error_line(proc)
    assert f"no Ray cluster answers at {dead} (from --address)" in line
    assert line.endswith("check it, or leave --address out")
