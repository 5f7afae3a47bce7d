"""``kvstore doctor``: what kvstore left on this machine, and the sweep every operator command runs.

``doctor`` lists the recorded cluster, the Ray heads `kvstore start` started, and every arena
file in the shared-memory directories with its owner process and whether that owner is alive;
``--fix`` removes what nothing owns any more: arenas whose owner is gone, and a recorded head
whose process is gone (its stragglers and temp dir, then the record). It judges owners as
``kvstore.node.arena_files`` does, so it never removes what a live process still uses.

Every other operator command sweeps orphaned arenas first (``sweep_and_say``) and says what it
freed in one line on stderr; stdout stays the command's own (``--json`` stays parseable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.command_flags import CONFIG_HELP
from kvstore.node import arena_files

DEFAULT_SHM_DIR = "/dev/shm"
#: What every kvstore-started head's command line carries (``kvstore.cluster.head``).
_HEAD_MARKS = ("ray", "start", "--head", "kvs-ray-")


@dataclass(slots=True)
class HeadProcess:
    """A `ray start --head` of kvstore's found running on this machine."""

    pid: int
    command: str
    recorded: bool


@dataclass(slots=True)
class ArenaReport:
    """One arena file as doctor shows it."""

    path: str
    nbytes: int
    owner_pid: int | None
    owner_command: str
    owner: str  # alive | gone | unknown


@dataclass(slots=True)
class Findings:
    """Everything doctor found; ``leftovers`` are the paths ``--fix`` removes."""

    recorded: dict[str, Any] | None
    recorded_state: str  # none | answers | head gone | not answering
    heads: list[HeadProcess] = field(default_factory=list)
    arenas: list[ArenaReport] = field(default_factory=list)

    @property
    def leftovers(self) -> list[ArenaReport]:
        return [a for a in self.arenas if a.owner == "gone"]


def shm_dirs(args: argparse.Namespace) -> list[str]:
    """``/dev/shm`` and the configured ``pool.shm_dir`` (a bad config is the command's to
    report, not the sweep's)."""
    from kvstore.command_flags import config_from_flags
    from kvstore.errors import ConfigError

    dirs = [DEFAULT_SHM_DIR]
    try:
        configured = config_from_flags(args).pool.shm_dir
    except (ConfigError, ValueError, OSError):
        return dirs
    return dirs if os.path.realpath(configured) == DEFAULT_SHM_DIR else [*dirs, configured]


def sweep_and_say(args: argparse.Namespace) -> None:
    """Remove arenas whose owner is gone; one line on stderr when something was freed."""
    total = arena_files.SweepResult()
    for shm_dir in shm_dirs(args):
        swept = arena_files.sweep_leftovers(shm_dir)
        total.num_freed += swept.num_freed
        total.freed_bytes += swept.freed_bytes
    line = arena_files.freed_line(total)
    if line:
        print(f"kvstore: {line}", file=sys.stderr)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _command_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(raw.decode(errors="replace").split("\0")).strip()


def _kvstore_heads(recorded_pid: int | None) -> list[HeadProcess]:
    heads = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        command = _command_of(int(entry.name))
        if all(mark in command for mark in _HEAD_MARKS) and "--block" in command:
            heads.append(HeadProcess(int(entry.name), command, int(entry.name) == recorded_pid))
    return sorted(heads, key=lambda h: h.pid)


def _arenas(dirs: list[str]) -> list[ArenaReport]:
    out = []
    for shm_dir in dirs:
        for arena in arena_files.scan(shm_dir):
            pid = arena.owner.pid if arena.owner else arena.legacy_pid
            state = arena_files.owner_state(arena.owner)
            command = _command_of(pid) if pid is not None and state == "alive" else ""
            out.append(ArenaReport(arena.path, arena.nbytes, pid, command, state))
    return out


def find(args: argparse.Namespace) -> Findings:
    """What is on this machine now (reads only)."""
    from kvstore.cluster import address

    rec = address.recorded()
    if rec is None:
        state = "none"
    elif address.answers(rec.address, timeout_s=1.0):
        state = "answers"
    elif rec.head_pid is not None and not _is_alive(rec.head_pid):
        state = "head gone"
    else:
        state = "not answering"
    return Findings(asdict(rec) if rec else None, state,
                    _kvstore_heads(rec.head_pid if rec else None), _arenas(shm_dirs(args)))


def fix(found: Findings) -> list[str]:
    """Remove the leftovers ``found`` lists; returns one line per thing removed."""
    from kvstore.cluster import address, head

    done = []
    freed, nbytes = 0, 0
    for report in found.leftovers:
        arena = arena_files.parse(report.path)
        if arena is None or arena_files.owner_state(arena.owner) != "gone":
            continue  # judged again at the last moment: never a live owner's
        try:
            os.unlink(report.path)
        except FileNotFoundError:
            continue
        freed, nbytes = freed + 1, nbytes + report.nbytes
    line = arena_files.freed_line(arena_files.SweepResult(freed, nbytes))
    if line:
        done.append(line)
    rec = address.recorded()
    if rec is not None and found.recorded_state == "head gone":
        head.stop_head(rec)  # its process group and temp dir: what the dead head left
        address.forget()
        done.append(f"forgot the recorded cluster {rec.address} (its head is gone) and "
                    "removed what that head left")
    return done


def _print(found: Findings, shm: list[str]) -> None:
    rec = found.recorded
    if rec is None:
        print("recorded cluster: none (`kvstore start` records the cluster it starts on)")
    else:
        head = f", head pid {rec['head_pid']}" if rec.get("head_pid") else ""
        print(f"recorded cluster: {rec['address']} (Ray auth {rec.get('auth_mode') or '?'}"
              f"{head}): {found.recorded_state}")
    print(f"kvstore Ray heads running: {len(found.heads)}")
    for h in found.heads:
        shown = " ".join(w for w in h.command.split() if w.startswith(("--port=", "--temp-dir=")))
        print(f"  pid {h.pid}{' (recorded)' if h.recorded else ''}: ray start --head {shown}")
    print(f"arenas in {', '.join(shm)}: {len(found.arenas)}")
    for a in found.arenas:
        owner = (f"owner pid {a.owner_pid}" if a.owner_pid is not None else "no owner") + (
            f" ({a.owner_command.split(' ')[0]})" if a.owner_command else "")
        verdict = {"alive": "in use", "gone": "LEFTOVER (owner gone)",
                   "unknown": "owner not checkable (no start time in the name, another PID "
                              "namespace): left alone"}[a.owner]
        print(f"  {a.path}  {arena_files.size_text(a.nbytes)}  {owner}: {verdict}")
    leftovers = found.leftovers
    stale = found.recorded_state == "head gone"
    if leftovers or stale:
        total = arena_files.size_text(sum(a.nbytes for a in leftovers))
        arenas = "arena" if len(leftovers) == 1 else "arenas"
        print(f"leftovers: {len(leftovers)} {arenas} ({total})"
              f"{', a recorded head that is gone' if stale else ''}: `kvstore doctor --fix` "
              "removes them")
    else:
        print("leftovers: none")


def cmd_doctor(args: argparse.Namespace) -> int:
    """List what kvstore has on this machine; with ``--fix``, remove the leftovers."""
    found = find(args)
    if args.json:
        out = asdict(found)
        out["leftovers"] = [a.path for a in found.leftovers]
        if args.fix:
            out["fixed"] = fix(found)
        print(json.dumps(out, sort_keys=True))
        return 0
    _print(found, shm_dirs(args))
    if args.fix:
        for line in fix(found) or ["nothing to fix"]:
            print(line)
    return 0


def register(sub: Any) -> None:
    """Add ``doctor`` to the ``kvstore`` parser."""
    p = sub.add_parser("doctor", help="what kvstore left on this machine: cluster, heads, "
                                      "arenas and their owners; --fix removes leftovers")
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)  # its pool.shm_dir
    p.add_argument("--fix", action="store_true",
                   help="remove arenas whose owner process is gone and a dead recorded head")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_doctor)
