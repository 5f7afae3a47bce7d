"""A process and everything it started, found by /proc parent links and stopped by PID.

Ray retitles its workers (``ray::StoreNode``, ``ray::DashboardAgent``), so their command lines
no longer name the head's temp dir; their parent links still lead to the process that started
them. Identities carry the start time, so a pid reused after a process ended is never stopped.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvstore.node import arena_files
from kvstore.node.arena_files import ProcessIdentity, this_process


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants now."""
    for _ in range(64):
        if pid == ancestor:
            return True
        parent = parent_of(pid)
        if parent is None or parent <= 1:
            return False
        pid = parent
    return False


def process_tree(root: int) -> list[ProcessIdentity]:
    """``root`` and its descendants now, as identities a reused pid cannot match."""
    namespace = this_process().pid_namespace
    tree = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and descends_from(int(entry.name), root):
            try:
                started = arena_files.start_ticks(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue  # ended meanwhile
            tree.append(ProcessIdentity(int(entry.name), started, namespace))
    return tree


def kill_survivors(tree: list[ProcessIdentity]) -> None:
    """SIGKILL each process of ``tree`` that is still the same process."""
    for process in tree:
        if arena_files.owner_state(process) == "alive":
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
