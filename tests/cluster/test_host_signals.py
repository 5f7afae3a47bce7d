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


def test_the_hosts_handler_is_back_after_ray_took_sigterm_over():
    done = run("""
        signal.signal(signal.SIGTERM, host)
        with sigterm_kept():
            taken_over()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not stopped")
    """)
    assert done.stdout.splitlines() == ["host handler"], done.stderr
    assert done.returncode == 0


def test_without_it_the_host_loses_its_handler():
    """The same, unguarded: the process dies by the signal, its handler never runs (so the
    first test can fail)."""
    done = run("""
        signal.signal(signal.SIGTERM, host)
        taken_over()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not stopped")
    """)
    assert "host handler" not in done.stdout
    assert done.returncode == -15


def test_without_a_handler_of_its_own_the_process_keeps_rays_python_one():
    """A command that never set one: Ray's ``sys.exit`` stays (it unwinds, and stops what it
    started), the native handler beneath it does not."""
    done = run("""
        with sigterm_kept():
            taken_over()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not stopped")
    """)
    assert done.stdout.splitlines() == ["ray handler"], done.stderr
    assert done.returncode == 15


def test_sigterm_ignored_stays_ignored():
    done = run("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with sigterm_kept():
            taken_over()
        os.kill(os.getpid(), signal.SIGTERM)
        print("not stopped")
    """)
    assert done.stdout.splitlines() == ["not stopped"], done.stderr


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
        time.sleep(5)
    """)
    assert done.stdout.splitlines() == ["host handler"], done.stderr
