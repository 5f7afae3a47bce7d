"""Running the worker jobs through ``kvstore.cli.main.main`` in-process, as a user types them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstore.cli.main import main


def write_prompts(path: Path, rows: list[dict[str, Any]]) -> str:
    """A prompts file, one JSON object a line; its path as a string for argv."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(capsys: Any, *argv: str) -> tuple[int, list[dict[str, Any]]]:
    """The exit code and the ``--json`` lines a command printed."""
    rc = main(list(argv))
    out = capsys.readouterr().out
    return rc, [json.loads(line) for line in out.splitlines() if line.startswith("{")]
