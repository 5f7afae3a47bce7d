"""No RAM left behind: a crash's arenas are freed by the next kvstore command; `kvstore doctor`.

The crashes are real: a ``generate`` interrupted with SIGINT, a store node killed with SIGKILL
and a ``kvstore start`` head ended with SIGTERM, each a subprocess tree of its own. Only arenas
owned by the processes these tests start are looked at: other runs on the machine have theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.cluster import address, head
from kvstore.node import arena_files
from kvstore.node.arena_files import ArenaFile, ProcessIdentity, owned_name, this_process
from tests.support.processes import descends_from, kill_survivors, process_tree

pytestmark = pytest.mark.timeout(420)

KVSTORE = [sys.executable, "-m", "kvstore.cli.main"]
#: ``kvstore`` as a terminal starts it, with Ctrl-C's default action. A process started in the
#: background by a shell without job control (a CI script's ``&``, ``nohup``) ignores SIGINT,
#: and so does everything it starts, this test's ``kvstore`` included: reset it, then exec.
KVSTORE_AT_A_TERMINAL = [sys.executable, "-c",
                         "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                         "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
                         "-m", "kvstore.cli.main"]
FREED = "leftover arena"
needs_ray = pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not on PATH")


def run_cli(*args: str, env: dict[str, str], timeout: float = 180
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def cli_env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env[address.STATE_DIR_ENV] = str(state_dir)
    env["KVSTORE_SECURITY_SECRETS_DIR"] = str(state_dir / "secrets")
    env["RAY_AUTH_MODE"] = "disabled"  # every process of these tests, the heads' included
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env.update(extra)
    return env


def wait_for(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def arenas_of(ancestor: int) -> list[ArenaFile]:
    """The /dev/shm arenas whose owner is alive and started by ``ancestor``'s process tree."""
    return [a for a in arena_files.scan("/dev/shm")
            if a.owner is not None and arena_files.owner_state(a.owner) == "alive"
            and descends_from(a.owner.pid, ancestor)]


def gone(arenas: list[ArenaFile]) -> bool:
    return all(arena_files.owner_state(a.owner) == "gone" for a in arenas)


def left(arenas: list[ArenaFile]) -> list[str]:
    return [a.path for a in arenas if os.path.exists(a.path)]


# -- doctor, on a directory of its own -----------------------------------------------------------

@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


def test_doctor_lists_arenas_with_their_owners_and_fix_removes_only_leftovers(
        tmp_path: Path, shm_dir: Path) -> None:
    me = this_process()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = shm_dir / owned_name("aa" * 8)
    leftover = shm_dir / owned_name("bb" * 8, ProcessIdentity(dead.pid, 5, me.pid_namespace))
    legacy = shm_dir / f"kvstore-arena-{'cc' * 8}-{dead.pid}"
    for path in (mine, leftover, legacy):
        with open(path, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 1 << 20)
    env = cli_env(tmp_path / "state", KVSTORE_POOL_SHM_DIR=str(shm_dir))

    listed = run_cli("doctor", env=env)
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if str(shm_dir) in line
             and line.startswith("  ")}
    assert f"owner pid {me.pid}" in lines[str(mine)] and "in use" in lines[str(mine)]
    assert "LEFTOVER" in lines[str(leftover)] and "1.0 MiB" in lines[str(leftover)]
    assert "left alone" in lines[str(legacy)]
    assert "recorded cluster: none" in listed.stdout
    assert "`kvstore doctor --fix`" in listed.stdout
    assert leftover.exists()  # listing removes nothing

    as_json = json.loads(run_cli("doctor", "--json", env=env).stdout)
    assert str(leftover) in as_json["leftovers"] and str(mine) not in as_json["leftovers"]

    fixed = run_cli("doctor", "--fix", env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert "from processes that are gone" in fixed.stdout
    assert not leftover.exists() and mine.exists() and legacy.exists()


def test_every_operator_command_sweeps_first_and_says_so(tmp_path: Path, shm_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = shm_dir / owned_name("dd" * 8, ProcessIdentity(
        dead.pid, 5, this_process().pid_namespace))
    with open(leftover, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 << 20)
    env = cli_env(tmp_path / "state", KVSTORE_POOL_SHM_DIR=str(shm_dir))

    proc = run_cli("status", "--json", env=env)  # no cluster: it fails, after sweeping

    assert proc.returncode == 3
    assert not leftover.exists()
    assert FREED in proc.stderr and "from processes that are gone" in proc.stderr
    assert proc.stdout == ""  # --json output stays the command's own


# -- real crashes ----------------------------------------------------------------------------------

@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[dict[str, str], address.RecordedCluster]]:
    """`kvstore start` with a local head of its own; whatever is left is stopped by PID after."""
    env = cli_env(tmp_path / "state")
    proc = run_cli("start", "--capacity", "8MiB", env=env)
    rec = address.recorded(env)
    try:
        assert proc.returncode == 0, proc.stderr
        assert rec is not None and rec.head_pid is not None
        yield env, rec
    finally:
        if rec is not None:
            head.stop_head(rec)  # by its process group and temp dir, never `ray stop`


@needs_ray
def test_a_killed_store_node_and_a_killed_head_leave_no_arena(
        started: tuple[dict[str, str], address.RecordedCluster]) -> None:
    env, rec = started
    head_pid = rec.head_pid
    wait_for(lambda: arenas_of(head_pid), 60, "the store node's arena")
    first = arenas_of(head_pid)

    # A live owner's arena survives every sweep, doctor --fix's included.
    fixed = run_cli("doctor", "--fix", env=env)
    assert fixed.returncode == 0, fixed.stderr
    assert left(first) == [a.path for a in first]
    assert "in use" in fixed.stdout

    for arena in first:
        assert arena.owner is not None
        os.kill(arena.owner.pid, signal.SIGKILL)  # the OOM killer, say
    wait_for(lambda: gone(first), 30, "the killed store node to be gone")
    status = run_cli("status", env=env)
    assert status.returncode == 0, status.stderr
    assert left(first) == []  # freed by the restarted store node or by `status` itself

    # Ray restarts the node (the watcher); its arena is then the one in use.
    wait_for(lambda: arenas_of(head_pid), 60, "the restarted store node's arena")
    second = arenas_of(head_pid)
    os.kill(head_pid, signal.SIGTERM)  # what a crash or `ray stop` does to the head
    wait_for(lambda: gone(second), 60, "the head's processes to end")
    stopped = run_cli("stop", env=env)
    assert left(second) == [], stopped.stderr
    assert address.recorded(env) is None


@needs_ray
def test_an_interrupted_generate_leaves_no_arena(tmp_path: Path) -> None:
    env = cli_env(tmp_path / "state")
    # Far more work than is done before the Ctrl-C, so a run that ends on its own means the
    # Ctrl-C went unheeded, never that it came too late; interrupted, its size costs nothing.
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "text": f"prompt {i} " * 40}) + "\n"
                               for i in range(200)))
    log = open(tmp_path / "generate.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([*KVSTORE_AT_A_TERMINAL, "generate", "--prompts", str(prompts),
                             "--model", "tiny",
                             "--max-new-tokens", "256", "--ignore-eos",
                             "--output", str(tmp_path / "int.jsonl")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    tree: list[ProcessIdentity] = []

    def said() -> str:  # the phases first, and whatever ended the run last
        text = (tmp_path / "generate.log").read_text()
        return text if len(text) < 3000 else f"{text[:1500]}\n...\n{text[-1500:]}"

    try:
        # The Ctrl-C once the store is up (its phase reported): the store node's arena then
        # exists, and the command is past bringing the store up, which undoes itself on any
        # error; the replicas start or requests run when it comes.
        wait_for(lambda: "kvstore: starting the store" in said() or proc.poll() is not None,
                 180, "generate's store to start")
        arenas = arenas_of(proc.pid)
        assert arenas, said()
        tree = process_tree(proc.pid)  # its private Ray: stopped by PID below if it outlives it
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=120) == 130, said()
        wait_for(lambda: gone(arenas), 60, "generate's Ray processes to end")

        status = run_cli("status", env=env)  # the next kvstore command

        assert left(arenas) == [], status.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_survivors(tree)
