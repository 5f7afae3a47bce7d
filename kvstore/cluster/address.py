"""Which Ray cluster a kvstore command acts on, decided in one explicit order.

    --address FLAG  >  RAY_ADDRESS  >  the cluster `kvstore start` recorded  >  none

There is deliberately no fourth source: Ray's own ``auto`` falls back to scanning processes and
attaches to whatever Ray it finds on the machine (another user's, a token-auth one), which an
operator never asked for. ``local`` always means a private instance of this process, never a
host name; ``auto`` (as the deploy files use it right after ``ray start``) means the cluster
``ray start`` recorded on this machine, read from Ray's address file only, never a process scan.

``kvstore start`` records the cluster it started on in ``$KVSTORE_STATE_DIR/cluster.json``
(default ``~/.kvstore``), with the Ray auth mode to use and, when it started the head itself,
how to stop it. A recorded cluster whose GCS no longer answers is ignored with a note.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from kvstore.errors import ClusterUnavailable, ConfigError

#: Where `kvstore start` records its cluster; tests point it at a temporary directory.
STATE_DIR_ENV = "KVSTORE_STATE_DIR"
#: The address meaning "a private Ray instance in this process".
LOCAL = "local"

Source = Literal["--address", "RAY_ADDRESS", "recorded", "none"]


@dataclass(slots=True)
class RecordedCluster:
    """What `kvstore start` wrote down: where Ray is, its auth mode, and the head it owns."""

    address: str
    auth_mode: str
    head_pid: int | None = None  # set when kvstore started the head (and so stops it)
    temp_dir: str | None = None
    loopback: bool = False  # the head binds 127.0.0.1 only (kvstore.cluster.head)


@dataclass(slots=True)
class Resolved:
    """The outcome: ``address`` is host:port, ``ray://...``, ``local`` or None (nothing found)."""

    address: str | None
    source: Source
    recorded: RecordedCluster | None = None


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The directory holding kvstore's per-user state (``KVSTORE_STATE_DIR`` or ~/.kvstore)."""
    env = os.environ if env is None else env
    return Path(env.get(STATE_DIR_ENV) or Path.home() / ".kvstore")


def _record_path(env: Mapping[str, str] | None = None) -> Path:
    return state_dir(env) / "cluster.json"


def record(cluster: RecordedCluster, env: Mapping[str, str] | None = None) -> Path:
    """Write the cluster `kvstore start` used, so later commands find it without flags."""
    path = _record_path(env)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cluster)))
    tmp.replace(path)  # atomic: a concurrent reader sees the old record or the new one
    return path


def recorded(env: Mapping[str, str] | None = None) -> RecordedCluster | None:
    """The recorded cluster, or None when there is none (or the file is unreadable)."""
    try:
        raw = json.loads(_record_path(env).read_text())
        return RecordedCluster(**raw)
    except (OSError, ValueError, TypeError):
        return None


def forget(env: Mapping[str, str] | None = None) -> None:
    """Remove the record (after `kvstore stop`, or when it proved stale)."""
    _record_path(env).unlink(missing_ok=True)


def answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether anything accepts TCP at ``host:port`` (Ray itself retries for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _ray_start_address() -> str:
    """``auto``: the cluster `ray start` last recorded on this machine (its file, no scan)."""
    from ray._private import services

    found = services.find_bootstrap_address(None)
    if not found:
        raise ClusterUnavailable(
            "--address auto: no `ray start` cluster is recorded on this machine; run "
            "`ray start --head` first or give the address as HOST:PORT")
    return str(found)


def resolve(flag: str | None, env: Mapping[str, str] | None = None) -> Resolved:
    """The cluster to use, in the order of the module docstring; never a process scan."""
    env = os.environ if env is None else env
    for value, source in ((flag, "--address"), (env.get("RAY_ADDRESS"), "RAY_ADDRESS")):
        if value is None or not value.strip():
            continue
        value = value.strip()
        if value == "auto":
            value = _ray_start_address()
        elif value != LOCAL and not value.startswith("ray://") and ":" not in value:
            raise ConfigError(f"{source} {value!r} is not HOST:PORT, ray://HOST:PORT, "
                              f"'{LOCAL}' (a private Ray instance) or 'auto'")
        return Resolved(value, source)  # type: ignore[arg-type]
    rec = recorded(env)
    if rec is not None:
        if answers(rec.address):
            return Resolved(rec.address, "recorded", rec)
        print(f"kvstore: note: ignoring the Ray cluster recorded in {_record_path(env)} "
              f"({rec.address} does not answer)", file=sys.stderr)
    return Resolved(None, "none")


def auth_mode_for_private_ray(env: Mapping[str, str] | None = None) -> str:
    """The auth mode of a Ray instance kvstore starts: RAY_AUTH_MODE if set, else disabled.

    Decided here rather than left to Ray, which turns token auth on by itself when
    ``~/.ray/auth_token`` exists, so the same command would behave differently per machine.
    """
    env = os.environ if env is None else env
    return env.get("RAY_AUTH_MODE") or "disabled"
