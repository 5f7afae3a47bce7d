"""The ``kvstore`` argument parser: argparse, with its errors in the form of every other error.

argparse answers a bad flag with its usage and a ``PROG: error:`` line, four lines or more in
its own format. Every other expected failure of the CLI is one line, ``kvstore: error: ...``
(``kvstore.cli.main``), so scripts and people read one form; a usage error is one such line too,
naming the ``--help`` that lists the command's arguments, with exit code 2 (bad arguments).

A value that starts with a minus and a digit (``--capacity -5GiB``) is taken as the flag's
value, as argparse already does for plain negative numbers, so it reaches the setting's own
check and its message ("must be > 0") instead of argparse's "expected one argument". No kvstore
flag looks like a negative number, so nothing is lost.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from typing import Any, NoReturn

#: A token argparse should take as a value, not a flag: a minus, then a digit.
NEGATIVE_VALUE = re.compile(r"^-\d")


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one ``kvstore: error:`` line (exit 2).

    Subcommand parsers are made by ``add_subparsers().add_parser``, which builds them with the
    parent parser's class, so the whole command tree answers the same way.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse's own pattern takes only plain numbers ("-5", "-0.5") as values.
        self._negative_number_matcher = NEGATIVE_VALUE

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """argparse's, but an argument nobody takes is reported by the subcommand's parser
        (argparse reports it from the top), so the hint names that subcommand's ``--help``."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.chosen(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost parser of the subcommand ``parsed`` names (this one if none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(sub, OneLineErrorParser):
                    return sub.chosen(parsed)
        return self

    def error(self, message: str) -> NoReturn:
        """One line on stderr and exit 2; ``--help`` is named for the full usage."""
        self.exit(2, f"kvstore: error: {message} (`{self.prog} --help` lists the "
                     "arguments)\n")
