"""kvstore's own error back out of Ray's wrappers, so an operator sees one plain line.

An exception raised in an actor method reaches the caller as ``RayTaskError(Cause)``, whose text
is the remote traceback with ANSI colour codes; its ``cause`` is the original exception. One
raised in an actor's constructor reaches it as ``ActorDiedError``, which keeps only the
traceback text: its last ``module.Class: message`` line names the original, and when that is a
class of ``kvstore.errors`` it is rebuilt, so the exit code is the same as for the same error
raised in-process (``--in-process``).
"""

from __future__ import annotations

import re

from kvstore import errors
from kvstore.errors import KVStoreError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.+)$")


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes."""
    return _ANSI.sub("", text)


def unwrap(exc: BaseException) -> BaseException:
    """The error that was raised remotely, or ``exc`` itself when Ray did not wrap it."""
    import ray.exceptions

    for _ in range(8):  # an actor calling an actor nests the wrappers
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = getattr(exc, "cause", None)
            if not isinstance(cause, BaseException):
                return KVStoreError(_last_line(str(exc)))
            exc = cause
        elif isinstance(exc, ray.exceptions.RayActorError):
            return _from_traceback_text(str(getattr(exc, "error_msg", "") or exc))
        else:
            return exc
    return exc


def _from_traceback_text(text: str) -> BaseException:
    text = strip_ansi(text)
    for line in reversed(text.strip().splitlines()):
        match = _RAISED.match(line.strip())
        if match is None:
            continue
        path, message = match.groups()
        if not (path.startswith("kvstore.") or path.endswith(("Error", "Exception"))):
            continue  # "actor_id: ...", "class_name: ...": Ray's own fields, not a raise
        cls = getattr(errors, path.rpartition(".")[2], None)
        if path.startswith("kvstore.") and isinstance(cls, type) and issubclass(
                cls, KVStoreError):
            return cls(message)
        if path == "ValueError":  # a bad value, as in-process (exit 2 either way)
            return ValueError(message)
        return KVStoreError(f"{path.rpartition('.')[2]}: {message}")
    # Not a raise (killed, out of memory, node lost): Ray's first line says what happened.
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return KVStoreError(lines[0] if lines else "a Ray actor died")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in strip_ansi(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else "a Ray actor failed"
