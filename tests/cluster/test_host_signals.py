"""Joining Ray leaves a process's own SIGTERM handling as it was (``host_signals``).

Each case runs in a process of its own (signal handlers are process-wide): the process installs
its own handler, as vLLM's engine and ``kvstore serve`` do, then does inside ``sigterm_kept``
what ``ray.init`` does to a process that joins it (a Python handler of its own, and a native
one set beneath Python, through libc), then sends itself SIGTERM. The real thing, with vLLM
and Ray, is ``test_vllm_engines``'s instance stopping without Ray's stack dump.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    from kvstore.cluster.host_signals import sigterm_kept

    def host(signum, frame):  # the host's own: says so, then stops cleanly
        print("host handler", flush=True)
        sys.exit(0)

    def taken_over():  # what ray.init does to the process that calls it
        signal.signal(signal.SIGTERM, lambda *a: (print("ray handler", flush=True),
                                                  sys.exit(15)))
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL beneath Python's back
""")


def run(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("own", "guarded", "printed", "returncode"), [
    # the host's handler is back after Ray took SIGTERM over
    ("host", True, ["host handler"], 0),
    # unguarded, the process dies by the signal and its handler never runs (so the first
    # case can fail)
    ("host", False, [], -15),
    # a command that never set one keeps Ray's sys.exit (it unwinds, and stops what it
    # started), not the native handler beneath it
    (None, True, ["ray handler"], 15),
    # SIGTERM ignored stays ignored
    ("signal.SIG_IGN", True, ["not stopped"], 0),
])
def test_a_process_stops_on_sigterm_as_it_did_before_joining_ray(
        own: str | None, guarded: bool, printed: list[str], returncode: int) -> None:
    done = run(f"""
        if {own!r}:
            signal.signal(signal.SIGTERM, {own or "None"})
        if {guarded}:
            with sigterm_kept():
                taken_over()
        else:
            taken_over()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
        print("not stopped")
    """)
    assert done.stdout.splitlines() == printed, done.stderr
    assert done.returncode == returncode


def test_off_the_main_thread_nothing_is_touched():
    done = run("""
        signal.signal(signal.SIGTERM, host)
        def elsewhere():  # a handler can only be set from the main thread
            try:
                with sigterm_kept():
                    pass
            except Exception as exc:
                print("raised", type(exc).__name__, flush=True)
        t = threading.Thread(target=elsewhere)
        t.start(); t.join()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2)
    """)
    assert done.stdout.splitlines() == ["host handler"], done.stderr
