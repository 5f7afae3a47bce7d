"""How a command shows its work while it runs, and consoles for its results that never wrap.

A command's results go to stdout; everything about its progress goes to stderr, so ``--json``
output stays exactly the JSON a pipe parses. Which form the progress takes is decided once per
command (``Steps.for_command``):

- on a terminal (stdout and stderr both, and no ``--json``): a spinner naming the phase that
  runs, then ``✓ phase  12.3 s`` when it ends; a bar for work counted in requests;
- anywhere else: one plain line on stderr per phase as it ends, ``kvstore: phase: 12.3 s``, and
  ``kvstore: generate: 12/120 requests (8.1 s)`` at every tenth of counted work, so a log shows
  where a long run is without any control codes.

A phase that raises prints nothing: the command's one error line follows instead. Off a
terminal rich would wrap every line at 80 columns, mid-phrase; ``output_console`` returns a
console that wraps nothing there.

Torch-free and Ray-free: the operator commands import this module too.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: The width of a console that is not a terminal: wide enough that no line or table wraps.
UNWRAPPED_WIDTH = 10_000
#: Off a terminal, counted work reports each time another tenth of it is done.
PLAIN_REPORTS = 10


def output_console(*, stderr: bool = False) -> Console:
    """A console for a command's results: rich's own on a terminal; anywhere else (a pipe, a
    file, a log) no line is wrapped or cropped, whatever its length, and no colour is sent."""
    console = Console(stderr=stderr)
    if console.is_terminal:
        return console
    return Console(stderr=stderr, soft_wrap=True, width=UNWRAPPED_WIDTH)


def is_interactive(json_output: bool = False) -> bool:
    """Whether progress may be a live display: stdout and stderr are terminals (as rich sees
    them: ``TTY_COMPATIBLE=1`` forces it) and the output is not ``--json``."""
    return not json_output and Console().is_terminal and Console(stderr=True).is_terminal


def seconds_text(seconds: float) -> str:
    """A phase's duration as it is printed: ``12.3 s``."""
    return f"{seconds:.1f} s"


class Steps:
    """The phases of one command, each reported on stderr with its time (module docstring).

    ``live``: a spinner and bars on a terminal, else plain lines; ``quiet``: nothing at all
    (a library caller such as a benchmark, whose own output is its table).
    """

    def __init__(self, *, live: bool = False, quiet: bool = False) -> None:
        self.live = live
        self.quiet = quiet
        # Resolves sys.stderr when it prints, not now: a redirected stderr is honoured.
        self.console = Console(stderr=True)

    @classmethod
    def for_command(cls, json_output: bool = False) -> Steps:
        """The form of progress a command run by a user takes (``is_interactive``)."""
        return cls(live=is_interactive(json_output))

    @classmethod
    def silent(cls) -> Steps:
        """Phases that report nothing."""
        return cls(quiet=True)

    def line(self, text: str) -> None:
        """One line about the command's progress, in this form's style."""
        if self.quiet:
            return
        if self.live:
            self.console.print(escape(text), soft_wrap=True, highlight=False)
        else:
            print(f"kvstore: {text}", file=sys.stderr, flush=True)

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """A phase of the command: shown while it runs (live), reported with its time when it
        ends; nothing when it raises."""
        if self.quiet:
            yield
            return
        start = time.monotonic()
        if self.live:
            with self.console.status(f"{escape(label)}..."):
                yield
        else:
            yield
        self.done(label, time.monotonic() - start)

    def done(self, label: str, seconds: float) -> None:
        """Report a phase that took ``seconds``."""
        if self.quiet:
            return
        if self.live:
            self.console.print(f"[green]✓[/] {escape(label)}  [dim]{seconds_text(seconds)}[/]",
                               soft_wrap=True, highlight=False)
        else:
            print(f"kvstore: {label}: {seconds_text(seconds)}", file=sys.stderr, flush=True)

    @contextmanager
    def counted(self, label: str, total: int, unit: str = "requests"
                ) -> Iterator[Callable[[], None]]:
        """Work of ``total`` items; the callable it yields marks one more item done."""
        if self.quiet:
            yield lambda: None
            return
        start = time.monotonic()
        if self.live:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn(unit), TimeElapsedColumn())
            with Progress(*columns, console=self.console, transient=True) as progress:
                task = progress.add_task(escape(label), total=total)
                yield lambda: progress.advance(task)
            self.done(f"{label}: {total} {unit}", time.monotonic() - start)
            return
        counter = _PlainCounter(label, total, unit, start)
        yield counter.advance
        if total == 0:
            self.done(f"{label}: 0 {unit}", time.monotonic() - start)


class _PlainCounter:
    """Counted work off a terminal: a line at every tenth done, the last one with the total."""

    def __init__(self, label: str, total: int, unit: str, start: float) -> None:
        self.label, self.total, self.unit, self.start = label, total, unit, start
        self._done = 0
        self._lock = threading.Lock()

    def advance(self) -> None:
        with self._lock:
            self._done += 1
            before = (self._done - 1) * PLAIN_REPORTS // max(1, self.total)
            after = self._done * PLAIN_REPORTS // max(1, self.total)
            if after == before:
                return
            text = (f"kvstore: {self.label}: {self._done}/{self.total} {self.unit} "
                    f"({seconds_text(time.monotonic() - self.start)})")
        print(text, file=sys.stderr, flush=True)
