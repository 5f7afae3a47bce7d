"""A server on the data path (a store node, the coordinator) undoes Ray's worker niceness, in
every thread of its process, where it may; where it may not, it stays as it was and says how to
start it at normal priority."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvstore import process_priority
from kvstore.process_priority import serve_at_normal_priority

CHILD = textwrap.dedent("""
    import os, threading
    from kvstore.process_priority import serve_at_normal_priority
    os.nice(15)  # as Ray starts its workers
    started, stop = threading.Event(), threading.Event()
    def other():
        started.set()
        stop.wait()
    t = threading.Thread(target=other, daemon=True)
    t.start()  # a thread of Ray's, already running at 15
    started.wait()
    ok = serve_at_normal_priority("the store node")
    later = threading.Thread(target=lambda: print("later", os.getpriority(os.PRIO_PROCESS, 0)))
    later.start()
    later.join()
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            print("thread", os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:  # "later", joined but still leaving the kernel's list
            continue
    print("ok", ok)
    stop.set()
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="raising a priority needs root (or CAP_SYS_NICE) on Linux")
def test_every_thread_of_a_niced_process_serves_at_normal_priority() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60, check=True)
    lines = done.stdout.split("\n")
    threads = [int(x.split()[1]) for x in lines if x.startswith("thread ")]
    assert len(threads) >= 2 and set(threads) == {0}, done.stdout
    assert "later 0" in lines and "ok True" in lines, done.stdout


def test_without_the_right_to_it_the_server_says_how_and_runs_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(process_priority.os, "getpriority", lambda *_: 15)
    monkeypatch.setattr(process_priority.os, "setpriority", refused)
    with caplog.at_level(logging.WARNING, logger=process_priority.__name__):
        assert serve_at_normal_priority("the coordinator") is False
    assert "the coordinator runs at" in caplog.text and "RAY_worker_niceness=0" in caplog.text


def test_a_process_at_normal_priority_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(process_priority.os, "getpriority", lambda *_: 0)
    monkeypatch.setattr(process_priority.os, "setpriority", lambda *a: calls.append(a))
    assert serve_at_normal_priority("the store node") is True and calls == []
