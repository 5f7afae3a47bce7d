"""Joining Ray leaves a process's own SIGTERM handling as it was (``host_signals``).

Each case runs in a process of its own (signal handlers are process-wide): the process installs
its own handler, as vLLM's engine and ``kvstore serve`` do, then does inside ``sigterm_kept``
what ``ray.init`` does to a process that joins it (a Python handler of its own, and a native
one set beneath Python, through libc), then sends itself SIGTERM. The real thing, with vLLM
and Ray, is ``test_vllm_engines``'s instance stopping without Ray's stack dump.
"""

from __future__ import annotations

import os
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


OUTLIVES = """
import sys, time
from kvstore.cluster.host_signals import outlive_the_cluster
from kvstore.cluster.lifecycle import ensure_ray
outlive_the_cluster()  # what the vLLM connector does before it joins
ensure_ray(sys.argv[1], start_local=False)
import ray
ray.nodes()
time.sleep(5)  # up a while, as an instance is: one whose GCS goes within moments of
# joining was still ended once (Ray judges a connection by when it last saw it up)
print("UP", flush=True)
sys.stdin.readline()  # the cluster is gone now
time.sleep(64)  # past Ray's minute without its GCS (gone before this line)
print("ALIVE", flush=True)
"""


@pytest.mark.ray
@pytest.mark.timeout(240)
def test_a_guest_process_outlives_the_cluster_it_joined(tmp_path: Path) -> None:
    """Ray ends a process whose cluster's GCS has been gone a minute; a process kvstore is a
    guest in (vLLM's, through the connector) must go on serving, recomputing what it cannot
    load. Without ``outlive_the_cluster`` this process dies ~60 s after the head."""
    from kvstore.cluster import head

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "RAY_"))}
    env.update(KVSTORE_STATE_DIR=str(tmp_path / "state"), RAY_AUTH_MODE="disabled",
               PYTHONPATH=str(ROOT), **head.LOOPBACK_ENV)
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        cluster = head.start_head()
    finally:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE")
        else:
            os.environ["RAY_AUTH_MODE"] = before
    proc = subprocess.Popen([sys.executable, "-c", OUTLIVES, cluster.address], env=env,
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "UP"
    finally:
        head.stop_head(cluster)
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=150)
    assert out.split() == ["ALIVE"], err[-2000:]
    assert proc.returncode == 0, err[-2000:]
