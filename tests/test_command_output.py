"""How commands report progress and print results: live on a terminal, plain lines elsewhere.

Phase times are never asserted (they are wall-clock): only that each phase is reported, in
which form, on which stream, and that results off a terminal are never wrapped.
"""

from __future__ import annotations

import re

import pytest
from rich.table import Table

from kvstore.command_output import PLAIN_REPORTS, Steps, is_interactive, output_console

#: A plain phase line: ``kvstore: LABEL: 12.3 s``.
PLAIN_PHASE = re.compile(r"^kvstore: (?P<label>.+): \d+\.\d s$")
#: A terminal's control sequences (colours, cursor moves).
CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both streams count as terminals, as rich sees them."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")


def test_off_a_terminal_each_phase_is_one_plain_line_on_stderr(capsys) -> None:
    steps = Steps.for_command()
    assert not steps.live  # pytest's captured streams are not terminals
    with steps.phase("starting a private Ray instance"):
        pass
    with steps.phase("loading the model"):
        print("result")
    out, err = capsys.readouterr()
    assert out == "result\n"
    labels = [PLAIN_PHASE.match(line)["label"] for line in err.splitlines()]
    assert labels == ["starting a private Ray instance", "loading the model"]


def test_a_phase_that_raises_reports_nothing(capsys) -> None:
    with pytest.raises(RuntimeError), Steps(live=False).phase("failing"):
        raise RuntimeError("boom")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("total, lines", [(4, 4), (120, PLAIN_REPORTS), (0, 1)])
def test_counted_work_reports_each_tenth_off_a_terminal(capsys, total: int, lines: int) -> None:
    with Steps(live=False).counted("generate", total) as advance:
        for _ in range(total):
            advance()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == lines
    assert err[-1].startswith(f"kvstore: generate: {total}/{total} requests (" if total
                              else "kvstore: generate: 0 requests: ")


def test_on_a_terminal_phases_end_with_a_check_mark(capsys, terminal) -> None:
    steps = Steps.for_command()
    assert steps.live and is_interactive()
    with steps.phase("cold request"):
        pass
    with steps.counted("warm requests", 2) as advance:
        advance()
        advance()
    out, err = capsys.readouterr()
    assert out == ""
    shown = CONTROL.sub("", err).replace("\r", "\n")  # what stays on the screen, a line each
    assert re.search(r"^✓ cold request  \d+\.\d s$", shown, re.MULTILINE)
    assert re.search(r"^✓ warm requests: 2 requests  \d+\.\d s$", shown, re.MULTILINE)


def test_json_output_is_never_live(terminal) -> None:
    assert not Steps.for_command(json_output=True).live
    assert not is_interactive(json_output=True)


def test_silent_steps_print_nothing(capsys, terminal) -> None:
    steps = Steps.silent()
    with steps.phase("x"), steps.counted("y", 3) as advance:
        advance()
    steps.line("z")
    assert capsys.readouterr() == ("", "")


def test_off_a_terminal_results_are_not_wrapped(capsys) -> None:
    phrase = "security: authentication, TLS and tenant checks on " * 4
    table = Table(title="kvstore generate")
    table.add_column("tokens")
    table.add_row(" ".join(str(i) for i in range(60)))
    console = output_console()
    console.print(phrase.strip())
    console.print(table)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == phrase.strip()
    assert any(" ".join(str(i) for i in range(60)) in line for line in out)
    assert "\x1b" not in "".join(out)  # no colour codes into a pipe


def test_on_a_terminal_results_keep_rich_wrapping(terminal, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    console = output_console()
    assert console.is_terminal and console.width == 80
