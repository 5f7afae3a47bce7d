"""tools.vllm_timeline: the connector's calls land on one timeline, and a request's summary
lists the calls inside it, relative to its start, per-layer calls only when asked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from kvstore.integrations.vllm.connector import KVStoreConnector  # noqa: E402
from tools import vllm_timeline  # noqa: E402


@pytest.fixture
def timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "timeline.log"
    monkeypatch.setenv("KVSTORE_TIMELINE", str(path))
    return path


def test_every_hook_is_timed_and_still_called(timeline: Path) -> None:
    for name in vllm_timeline.HOOKS:  # the timed connector's hooks wrap the connector's own
        assert getattr(vllm_timeline.TimedKVStoreConnector, name).__wrapped__ is \
            getattr(KVStoreConnector, name)
    # and so is the work inside them: the lease, the headers, the spare core's writes and check
    from kvstore.client.arena_blocks import ArenaBlocks
    from kvstore.client.cluster_store import ClusterStore
    from kvstore.integrations.vllm import spare_core
    for fn in (ClusterStore.lease_prefix, ClusterStore.arena_blocks, spare_core.scatter_layer,
               ArenaBlocks.verify):
        assert hasattr(fn, "__wrapped__"), fn
    calls = []

    def lookup(request: object, computed: int) -> tuple[int, bool]:
        calls.append((request, computed))
        return 32, False

    assert vllm_timeline.timed("lookup", lookup)("r", 0) == (32, False)
    assert calls == [("r", 0)]
    [line] = timeline.read_text().splitlines()
    pid, name, start, end = line.split()
    assert int(pid) == os.getpid() and name == "lookup" and float(start) <= float(end)


def test_a_request_lists_the_calls_inside_it(timeline: Path) -> None:
    lines = ["7 get_num_new_matched_tokens 10.0010 10.0015",
             "8 start_load_kv 10.0030 10.0070",
             "8 wait_for_layer_load 10.0080 10.0080",
             "8 wait_for_save 10.0150 10.0151",
             "8 start_load_kv 10.0300 10.0301",  # after the request: not in it
             "1 REQUEST:warm-0 10.0000 10.0200"]
    text = vllm_timeline.summarize(lines)
    assert text.splitlines()[0] == "warm-0: 20.00 ms"
    rows = [r.split() for r in text.splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("7", "get_num_new_matched_tokens", "+1.00"), ("8", "start_load_kv", "+3.00"),
        ("8", "wait_for_save", "+15.00")]
    assert rows[1][4] == "4.00"  # its duration
    with_layers = vllm_timeline.summarize(lines, layers=True)
    assert "wait_for_layer_load" in with_layers


def test_marks_and_calls_from_one_process_summarize(timeline: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    vllm_timeline.record("start_load_kv", 5.0, 5.002)
    vllm_timeline.mark("cold", 4.999, 5.01)
    vllm_timeline.main([str(timeline)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cold: 11.00 ms" and "start_load_kv" in out[1]


def test_a_missing_or_unmarked_timeline_is_one_line_and_exit_2(
        timeline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for setup in (lambda: None, lambda: vllm_timeline.record("start_load_kv", 5.0, 5.002)):
        setup()
        with pytest.raises(SystemExit) as exited:
            vllm_timeline.main([str(timeline)])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("vllm_timeline: error:")
