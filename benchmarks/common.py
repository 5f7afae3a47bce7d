"""The contract every benchmark follows: ``--quick``, ``--json PATH``, ``ratio_*`` keys.

A benchmark measures ours and a baseline in the same run, prints one rich table, and writes a
flat JSON object of its figures. ``ratio_<what>`` is ours / baseline with higher meaning better.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.table import Table

from kvstore.command_output import output_console


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], object] | None = None
               ) -> argparse.Namespace:
    """The common flags: ``--quick`` (under a minute) and ``--json PATH``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute")
    parser.add_argument("--json", metavar="PATH", help="write the figures as one JSON object")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def timings(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_of(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Best wall time of ``repeats`` calls, in seconds (the least disturbed run)."""
    return min(timings(fn, repeats, warmup))


def median_of(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``repeats`` calls, in seconds."""
    return statistics.median(timings(fn, repeats, warmup))


def report(title: str, rows: list[tuple[str, str, str]], figures: dict[str, Any],
           json_path: str | None) -> None:
    """Print ``rows`` (what, ours, baseline/target) as a table; write ``figures`` as JSON."""
    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("baseline / target", justify="right")
    for row in rows:
        table.add_row(*row)
    output_console().print(table)  # piped or logged: one row a line, never wrapped
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
