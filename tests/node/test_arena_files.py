"""Arena files name their owner; a sweep removes exactly those whose owner is certainly gone."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.node import arena_files
from kvstore.node.arena import Arena
from kvstore.node.arena_files import ProcessIdentity, owned_name, sweep_leftovers, this_process


def make_file(directory: Path, name: str, nbytes: int = 4096) -> Path:
    path = directory / name
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    return path


def ram_of(path: Path) -> int:
    return path.stat().st_blocks * 512


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of ours that is not this one (stopped by its PID at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


def identity_of(pid: int) -> ProcessIdentity:
    me = this_process()
    return ProcessIdentity(pid, arena_files.start_ticks(pid), me.pid_namespace)


def test_an_arena_is_named_after_this_process_and_judged_alive(tmp_path: Path) -> None:
    arena = Arena(1 << 16, shm_dir=str(tmp_path))
    try:
        found = arena_files.parse(arena.path)
        assert found is not None and found.owner == this_process()
        assert arena_files.owner_state(found.owner) == "alive"
        assert sweep_leftovers(str(tmp_path)).num_freed == 0
        assert os.path.exists(arena.path)
    finally:
        arena.close()
    assert not os.path.exists(arena.path)


def test_live_owners_are_kept_and_gone_ones_freed(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    me = this_process()
    live_child = make_file(tmp_path, owned_name("aa" * 8, identity_of(sleeper.pid)))
    mine = make_file(tmp_path, owned_name("bb" * 8))
    gone = make_file(tmp_path, owned_name("cc" * 8, ProcessIdentity(dead_pid(), 7,
                                                                   me.pid_namespace)), 1 << 20)
    # The pid is alive (it is this test's), but started at another time: a reused pid.
    reused = make_file(tmp_path, owned_name("dd" * 8, ProcessIdentity(
        me.pid, me.start_ticks + 1, me.pid_namespace)))
    expected = ram_of(gone) + ram_of(reused)

    result = sweep_leftovers(str(tmp_path))

    assert (result.num_freed, result.freed_bytes) == (2, expected)
    assert live_child.exists() and mine.exists()
    assert not gone.exists() and not reused.exists()

    sleeper.kill()
    sleeper.wait()
    assert arena_files.owner_state(owner_named_by(live_child)) == "gone"
    assert sweep_leftovers(str(tmp_path)).num_freed == 1
    assert not live_child.exists() and mine.exists()


def owner_named_by(path: Path) -> ProcessIdentity | None:
    found = arena_files.parse(str(path))
    return found.owner if found else None


def test_owners_it_cannot_judge_are_left_alone(tmp_path: Path) -> None:
    me, pid = this_process(), dead_pid()
    other_namespace = make_file(tmp_path, owned_name("aa" * 8, ProcessIdentity(
        pid, 1, me.pid_namespace + 1)))
    legacy = make_file(tmp_path, f"kvstore-arena-{'bb' * 8}-{pid}")  # no start time recorded

    result = sweep_leftovers(str(tmp_path))

    assert (result.num_freed, result.num_unjudged) == (0, 2)
    assert other_namespace.exists() and legacy.exists()


def test_only_files_named_as_arenas_are_touched(tmp_path: Path) -> None:
    pid = dead_pid()
    ns = this_process().pid_namespace
    others = [make_file(tmp_path, name) for name in (
        f"kvstore-{pid}-abcd",  # not an arena name
        f"kvstore-arena-{'aa' * 8}-{pid}-1-{ns}.tmp",
        f"kvstore-arena-x-y-{pid}-1-{ns}",
        f"xkvstore-arena-{'aa' * 8}-{pid}-1-{ns}",
        "unrelated")]
    target = make_file(tmp_path, "target")
    link = tmp_path / owned_name("cc" * 8, ProcessIdentity(pid, 1, ns))
    link.symlink_to(target)  # named like a leftover, but not a file: never followed

    assert sweep_leftovers(str(tmp_path)).num_freed == 0
    assert all(p.exists() for p in others) and link.is_symlink() and target.exists()


def test_freed_line_says_how_much() -> None:
    assert arena_files.freed_line(arena_files.SweepResult()) is None
    assert arena_files.freed_line(arena_files.SweepResult(2, 1288490189)) == (
        "freed 2 leftover arenas (1.2 GiB) from processes that are gone")
    assert arena_files.freed_line(arena_files.SweepResult(1, 256 << 20)) == (
        "freed 1 leftover arena (256.0 MiB) from processes that are gone")


@pytest.mark.parametrize("label", ["", "a-b", "a/b", "..", "a b"])
def test_labels_that_would_break_the_name_are_refused(label: str) -> None:
    with pytest.raises(ValueError, match="letters and digits"):
        owned_name(label)
