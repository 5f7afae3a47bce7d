"""Arena files in a shared-memory directory: whose they are, and the sweep of orphaned ones.

An arena is RAM (tmpfs) that outlives its process: a store node killed by SIGKILL, a Ray head
ended by SIGTERM or a Ctrl-C'd job never unlinks its file. So every arena names its owner, and
anything that finds an arena whose owner is gone may remove it::

    kvstore-arena-<label>-<pid>-<start ticks>-<pid namespace inode>
                  |        |     |             `-- which PIDs the pid counts in
                  |        |     `-- field 22 of /proc/<pid>/stat: a reused pid differs here
                  |        `-- the process that mapped it
                  `-- the Ray node id's first 16 digits (or a random tag)

The owner is gone when no process has that pid, the process with that pid started at another
time (the pid was reused), or it is a zombie (it has exited and unmapped everything). An owner
in another PID namespace (a container sharing ``/dev/shm``), a pid whose ``/proc`` entry cannot
be read, and files that do not follow this naming (an older kvstore's
``kvstore-arena-<node>-<pid>``) are never judged gone: nothing is removed on a guess.
``kvstore doctor`` lists all of them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ARENA_PREFIX = "kvstore-arena-"

#: The owned naming of the module docstring.
_OWNED = re.compile(
    r"kvstore-arena-(?P<label>[0-9a-zA-Z]+)-(?P<pid>\d+)-(?P<start>\d+)-(?P<pidns>\d+)")
#: An older kvstore's naming: the pid only, so its owner cannot be checked.
_LEGACY = re.compile(r"kvstore-arena-(?P<label>[0-9a-zA-Z]+)-(?P<pid>\d+)")

OwnerState = Literal["alive", "gone", "unknown"]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process as it cannot be mistaken for another: pid, start time, PID namespace."""

    pid: int
    start_ticks: int
    pid_namespace: int


@dataclass(frozen=True, slots=True)
class ArenaFile:
    """One arena file found in a shm directory; ``owner`` is None when its name records none."""

    path: str
    label: str
    nbytes: int
    owner: ProcessIdentity | None
    legacy_pid: int | None = None  # an older kvstore's file: the pid it names, unverifiable


@dataclass(slots=True)
class SweepResult:
    """What a sweep removed (count and bytes) and what it left because it could not judge."""

    num_freed: int = 0
    freed_bytes: int = 0
    num_unjudged: int = 0


#: Run states of a process that has exited: a zombie has already unmapped everything; only its
#: exit status waits to be reaped.
EXITED_STATES = ("Z", "X")


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` from field 3 on (after the command name, which may hold spaces)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def start_ticks(pid: int) -> int:
    """Field 22 of ``/proc/<pid>/stat``: when the process started, in ticks since boot."""
    return int(stat_fields(pid)[19])


def _pid_namespace(pid: int | str = "self") -> int:
    link = os.readlink(f"/proc/{pid}/ns/pid")  # "pid:[4026531836]"
    return int(link[link.index("[") + 1:-1])


def this_process() -> ProcessIdentity:
    """This process's identity, as an arena it creates records it."""
    pid = os.getpid()
    return ProcessIdentity(pid, start_ticks(pid), _pid_namespace())


def owned_name(label: str, owner: ProcessIdentity | None = None) -> str:
    """The file name of an arena ``owner`` (default: this process) creates, tagged ``label``."""
    if not re.fullmatch(r"[0-9a-zA-Z]+", label):
        raise ValueError(f"arena label {label!r} must be letters and digits only")
    owner = owner or this_process()
    return f"{ARENA_PREFIX}{label}-{owner.pid}-{owner.start_ticks}-{owner.pid_namespace}"


def parse(path: str, nbytes: int = 0) -> ArenaFile | None:
    """The arena ``path`` names, or None when its name is not an arena's."""
    name = os.path.basename(path)
    if (owned := _OWNED.fullmatch(name)) is not None:
        owner = ProcessIdentity(int(owned["pid"]), int(owned["start"]), int(owned["pidns"]))
        return ArenaFile(path, owned["label"], nbytes, owner)
    if (legacy := _LEGACY.fullmatch(name)) is not None:
        return ArenaFile(path, legacy["label"], nbytes, None, legacy_pid=int(legacy["pid"]))
    return None


def owner_state(owner: ProcessIdentity | None) -> OwnerState:
    """``gone`` only when certain (see the module docstring); ``unknown`` when it cannot tell."""
    if owner is None:
        return "unknown"
    try:
        if owner.pid_namespace != _pid_namespace():
            return "unknown"  # its pid counts in another namespace than our /proc
    except OSError:
        return "unknown"
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # another user's process: it exists; its start time says whether it is the owner
    try:
        fields = stat_fields(owner.pid)
        started, run_state = int(fields[19]), fields[0]
    except FileNotFoundError:
        return "gone"  # exited between the two looks
    except (OSError, ValueError, IndexError):
        return "unknown"  # e.g. /proc mounted with hidepid
    if started != owner.start_ticks:
        return "gone"  # the pid was reused
    return "gone" if run_state in EXITED_STATES else "alive"


def scan(shm_dir: str = "/dev/shm") -> list[ArenaFile]:
    """Every arena file in ``shm_dir`` (owned or legacy), by name; other files are not read."""
    found = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(ARENA_PREFIX):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            nbytes = entry.stat(follow_symlinks=False).st_blocks * 512  # RAM held, not length
        except OSError:
            continue
        arena = parse(entry.path, nbytes)
        if arena is not None:
            found.append(arena)
    return sorted(found, key=lambda a: a.path)


def sweep_leftovers(shm_dir: str = "/dev/shm") -> SweepResult:
    """Unlink every arena in ``shm_dir`` whose owner is certainly gone; never a live one's."""
    result = SweepResult()
    for arena in scan(shm_dir):
        state = owner_state(arena.owner)
        if state == "unknown":
            result.num_unjudged += 1
        if state != "gone":
            continue
        try:
            os.unlink(arena.path)
        except FileNotFoundError:
            continue  # another sweep got there first
        except PermissionError:
            result.num_unjudged += 1
            continue
        result.num_freed += 1
        result.freed_bytes += arena.nbytes
    return result


def size_text(nbytes: int) -> str:
    """``1.2 GiB``: a byte count as people read it."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size, unit = nbytes / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def freed_line(result: SweepResult) -> str | None:
    """The one line a command prints after a sweep that freed something, else None."""
    if not result.num_freed:
        return None
    plural = "arena" if result.num_freed == 1 else "arenas"
    return (f"freed {result.num_freed} leftover {plural} ({size_text(result.freed_bytes)}) "
            "from processes that are gone")
