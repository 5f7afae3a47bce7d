"""The README's "Using it" session, run line by line as an operator types it.

Nothing is started beforehand: the first ``kvstore start`` must bring up a Ray head of its own
(free ports, a private temp dir), record it in a private ``KVSTORE_STATE_DIR``, and the last
``kvstore stop`` must take it down again. ``RAY_ADDRESS`` is removed from the environment, so a
command that attached to any other Ray on the machine (there are others while tests run) would
have to have found it by a process scan, which is what this guards against.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from kvstore.cluster import address, head

pytestmark = pytest.mark.timeout(420)

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_session() -> list[str]:
    """The first bash block of README's "## Using it" section, one command per line."""
    text = README.read_text()
    section = text[text.index("## Using it"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README's 'Using it' has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_session_is_the_documented_path() -> None:
    lines = readme_session()
    commands = [line.split()[1] for line in lines if line.startswith("kvstore ")]
    assert commands[0] == "start" and commands[-1] == "stop"
    assert "generate" in commands and "status" in commands


def _env(state_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env[address.STATE_DIR_ENV] = str(state_dir)
    # The head `kvstore start` makes binds loopback, so the start is plain; were it ever
    # secure, its secrets go to the test's own directory, never the operator's ~/.ray/kvstore.
    env["KVSTORE_SECURITY_SECRETS_DIR"] = str(state_dir.parent / "secrets")
    return env


@pytest.mark.skipif(shutil.which("kvstore") is None or shutil.which("ray") is None,
                    reason="the kvstore and ray commands must be on PATH (pip install -e .)")
def test_readme_using_it_runs_as_written(tmp_path: Path) -> None:
    import subprocess

    state_dir = tmp_path / "state"
    env = _env(state_dir)
    head_pid = None
    try:
        for line in readme_session():
            proc = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode == 0, f"`{line}` exited {proc.returncode}:\n{proc.stderr}"
            assert "Traceback" not in proc.stderr, proc.stderr
            if line.startswith("kvstore start"):
                rec = address.recorded(env)
                assert rec is not None and rec.head_pid is not None  # it started its own head
                assert "started a local Ray head" in proc.stderr
                head_pid = rec.head_pid
            if line.startswith("kvstore status"):
                assert "kvstore nodes" in proc.stdout or "node" in proc.stdout
    finally:
        leftover = address.recorded(env)
        if leftover is not None:  # a failed run: never leave the head behind
            head.stop_head(leftover)

    assert address.recorded(env) is None, "`kvstore stop` left the cluster recorded"
    # Gone, or a zombie its adopter has yet to reap: either way nothing of it runs.
    assert head_pid is not None and not head.is_running(head_pid), "head still runs"
    cached = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    reference = [json.loads(x) for x in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert [r["id"] for r in cached] == [r["id"] for r in reference] == ["q1"]
    assert [r["output_token_ids"] for r in cached] == [r["output_token_ids"] for r in reference]
    assert all(r["output_token_ids"] for r in cached)
