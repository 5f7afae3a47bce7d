"""The ``kvstore`` console script, run as operators run it: subprocesses against a real Ray head.

The Ray head is private to this module (its own port, temp dir and process group) and is torn
down by its own PIDs, never by ``ray stop``, which would kill every Ray on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli.cache import namespace_root, parse_keys
from kvstore.cli.main import build_parser
from kvstore.cli.status import SHORT_ID, status_json
from kvstore.cluster.head import pids_mentioning
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, chain_keys
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(240)

KVSTORE = [sys.executable, "-m", "kvstore.cli.main"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVSTORE, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVSTORE_", "RAY_"))
           or k in ("KVSTORE_STATE_DIR", "KVSTORE_SECURITY_SECRETS_DIR")}  # tests/conftest.py
    # Ray turns token auth on by itself when ~/.ray/auth_token exists: pin one mode for all.
    env["RAY_AUTH_MODE"] = "disabled"
    return env


# -- no Ray needed ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["start", "--capacity", "lots"], "pool.capacity_bytes: 'lots'"),
    (["start", "--config", "/nonexistent/kvstore.yaml"], "cannot read config file"),
    (["pin", "zz"], "is not hex"),
    (["pin", "ab" * 16], "a block key is 64 hex digits"),
    (["pin", "--ttl", "5", "ab" * 32], "--ttl applies to soft pins only"),
    (["invalidate", "--model-fingerprint", "m"], "missing: --dtype"),
    (["start", "--capacity", "4XB"], "KiB, MiB, GiB, TiB"),
    (["status", "--config", "/does/not/exist.yaml"], "cannot read config file /does/not"),
    (["ls", "--config", "/does/not/exist.yaml"], "cannot read config file /does/not"),
    (["pin", "--config", "/does/not/exist.yaml", "ab" * 32], "cannot read config file"),
    (["unpin", "--config", "/does/not/exist.yaml", "ab" * 32], "cannot read config file"),
    (["drain", "--config", "/does/not/exist.yaml", "node"], "cannot read config file"),
    (["invalidate", "--config", "/does/not/exist.yaml", "--namespace", "ab" * 32],
     "cannot read config file"),
    (["pin"], "name blocks: full keys"),
    (["pin", "--text", "hello", "ab" * 32], "not both"),
    (["ls", "--limit", "0"], "--limit must be >= 1"),
    # argparse's own usage errors, in the same one-line form:
    (["start", "--capacity", "-5GiB"],
     "pool.capacity_bytes: '-5GiB' is not a size; a size is > 0"),
    (["start", "--bogus"], "unrecognized arguments: --bogus (`kvstore start --help` lists"),
    (["start", "--capacity"], "argument --capacity: expected one argument"),
    (["generate", "--prompts", "p.jsonl", "--temperature", "hot"],
     "argument --temperature: invalid float value: 'hot' (`kvstore generate --help`"),
    (["serve", "--port", "http"], "argument --port: invalid int value: 'http'"),
    ([], "the following arguments are required: COMMAND (`kvstore --help` lists"),
    # the disk tier's flags, refused before anything starts:
    (["start", "--disk-dir", "/tmp/kvstore-cli-tier", "--disk-capacity", "lots"],
     "pool.disk_capacity_bytes: 'lots' is not a size"),
    (["start", "--disk-dir", "/tmp/kvstore-cli-tier", "--disk-capacity", "-5GiB"],
     "pool.disk_capacity_bytes: '-5GiB' is not a size; a size is > 0"),
    (["start", "--disk-capacity", "10GiB"], "pool.disk_capacity_bytes needs pool.disk_dir"),
    (["start", "--disk-dir", "/tmp/kvstore-cli-tier"],
     "pool.disk_dir needs pool.disk_capacity_bytes (--disk-capacity)"),
    (["start", "--disk-dir", "/etc/hostname", "--disk-capacity", "1GiB"],
     "pool.disk_dir '/etc/hostname' exists and is not a directory"),
    (["stop", "--purge", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_prints_one_line_and_exits_2(args: list[str], needle: str) -> None:
    proc = run_cli(*args, env=_base_env())
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_config_file_section_names_the_setting(tmp_path: Path) -> None:
    cfg = tmp_path / "kvstore.yaml"
    cfg.write_text("coordinator:\n  high_watermark: 0.5\n  low_watermark: 0.7\n")
    proc = run_cli("start", "--config", str(cfg), env=_base_env())
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "low_watermark" in proc.stderr


def test_status_without_ray_is_one_line_error() -> None:
    env = _base_env()
    env["RAY_ADDRESS"] = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = run_cli("status", env=env, timeout=180)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_parse_keys_and_namespace_root(monkeypatch: pytest.MonkeyPatch) -> None:
    key = bytes(range(32))
    assert parse_keys([key.hex()]) == [key]
    with pytest.raises(ConfigError):
        parse_keys([key.hex()[:-2]])
    ns = Namespace("fp", "float16", 16, 2, 2, 8, cache_salt="tenant")
    parser = build_parser()
    args = parser.parse_args(["invalidate", "--model-fingerprint", "fp", "--dtype", "float16",
                              "--block-size", "16", "--num-layers", "2", "--num-kv-heads", "2",
                              "--head-dim", "8", "--salt", "tenant"])
    assert namespace_root(args) == ns.root
    args = parser.parse_args(["invalidate", "--namespace", ns.root.hex()])
    assert namespace_root(args) == ns.root
    # A secure cluster's roots are keyed with its data key, as its workers make them.
    data_key = bytes(range(16, 48))
    monkeypatch.setenv("KVSTORE_SECURITY_DATA_KEY", data_key.hex())
    keyed = Namespace("fp", "float16", 16, 2, 2, 8, cache_salt="tenant", data_key=data_key)
    args = parser.parse_args(["invalidate", "--model-fingerprint", "fp", "--dtype", "float16",
                              "--block-size", "16", "--num-layers", "2", "--num-kv-heads", "2",
                              "--head-dim", "8", "--salt", "tenant"])
    assert namespace_root(args) == keyed.root != ns.root


def test_status_json_totals_fill_in() -> None:
    raw = {"nodes": [
        {"node_id": "a", "capacity_bytes": 10, "used_bytes": 4, "blocks": 2, "hits": 3,
         "misses": 1, "evictions": 0, "alive": True},
        {"node_id": "b", "capacity_bytes": 10, "used_bytes": 9, "blocks": 5, "alive": False},
    ]}
    out = status_json(raw)
    assert out["totals"]["capacity_bytes"] == 10  # dead nodes do not count
    assert out["totals"]["blocks"] == 2
    assert out["totals"]["hit_rate"] == 0.75
    assert out["nodes"][1]["hits"] == 0


def test_drain_resolves_what_status_prints() -> None:
    from kvstore.cluster.operations import resolve_node_id

    ids = ["0cb333f985fc7729", "0cb3ffff00000000", "77aa000000000000"]
    assert resolve_node_id("0cb333f985fc", ids) == ids[0]
    assert resolve_node_id(ids[2], ids) == ids[2]
    with pytest.raises(ConfigError, match="matches 2 nodes"):
        resolve_node_id("0cb3", ids)
    with pytest.raises(ConfigError, match="no node id starts with 'ff'"):
        resolve_node_id("ff", ids)


def test_status_workers_table_fits_80_columns_and_wide_shows_all() -> None:
    from rich.console import Console

    from kvstore.cli.status import _print_workers

    node_id = "f" * 56
    workers = [{"worker_id": f"prefill-{i}-{40000 + i}", "node_id": node_id, "model": "small",
                "dtype": "bfloat16", "attn": "eager",
                "reuse": {"mode": "exact", "resume": "block", "piece_sizes": [4, 16],
                          "exact": True}, "namespace": {"root": "ab" * 32}} for i in range(3)]
    narrow = Console(width=80, record=True)
    _print_workers(narrow, workers, wide=False)
    text = narrow.export_text()
    assert max(map(len, text.splitlines())) <= 80
    assert node_id[:SHORT_ID] in text and "…" not in text
    wide = Console(width=400, record=True)
    _print_workers(wide, workers, wide=True)
    text = wide.export_text()
    assert node_id in text and "ab" * 32 in text


def test_status_shows_each_nodes_disk_tier_and_none_without_one() -> None:
    from rich.console import Console

    from kvstore.cli.status import _print_disk_tiers

    def node(node_id: str, disk_capacity: int) -> dict:
        return {"node_id": node_id, "tiers": {
            "arena": {"used_bytes": 1, "capacity_bytes": 2, "blocks": 1, "hits": 0},
            "disk": {"used_bytes": disk_capacity // 4, "capacity_bytes": disk_capacity,
                     "blocks": 7, "hits": 3}}}

    out = Console(width=120, record=True)
    _print_disk_tiers(out, [node("a" * 16, 4 << 30), node("b" * 16, 0)], lambda s: s[:12])
    text = out.export_text()
    assert "disk tiers" in text and "a" * 12 in text and "b" * 12 not in text
    row = next(line for line in text.splitlines() if "a" * 12 in line)
    assert "1.0G" in row and "4.0G" in row and "25%" in row and " 7 " in row
    none = Console(width=120, record=True)
    _print_disk_tiers(none, [node("b" * 16, 0)], lambda s: s)
    assert none.export_text() == ""


def test_salt_label_never_shows_the_salt() -> None:
    from kvstore.cluster.operations import salt_label

    assert salt_label("") == "default"
    assert salt_label("\x00reuse=block") == "default+reuse=block"
    label = salt_label("tenant-secret-42")
    assert "secret" not in label and label.startswith("#") and len(label) == 9
    assert salt_label("tenant-secret-42\x00reuse=block") == label + "+reuse=block"
    assert salt_label("other") != label


# -- against a private Ray head ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_head() -> Iterator[dict[str, str]]:
    """A Ray head on a free port (never 6379: Redis holds it) in its own process group."""
    if shutil.which("ray") is None:
        pytest.skip("the ray CLI is not on PATH")
    temp_dir = tempfile.mkdtemp(prefix="kvs-cli-ray-")
    port = free_port()
    env = _base_env()
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--node-ip-address=127.0.0.1",
         "--disable-usage-stats", "--include-dashboard=false",
         f"--temp-dir={temp_dir}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        _wait_for_head(env, head)
        yield env
    finally:
        _kill_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_head(env: dict[str, str], head: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 90
    probe = "import ray; ray.init(); print(len(ray.nodes()))"
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited with {head.returncode}")
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode == 0:
            return
        time.sleep(1)
    pytest.fail("the private Ray head did not come up within 90 s")


def _kill_head(head: subprocess.Popen[bytes], temp_dir: str) -> None:
    """SIGTERM the head's process group, then any straggler that names our temp dir."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(head.pid, sig)
            head.wait(timeout=wait_s)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    for pid in pids_mentioning(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_start_with_a_disk_tier_status_stop_keeps_it_purge_removes_it(
        ray_head: dict[str, str], tmp_path: Path) -> None:
    env = ray_head
    disk_dir = tmp_path / "tier"
    started = run_cli("start", "--capacity", "8MiB", "--disk-dir", str(disk_dir),
                      "--disk-capacity", "64MiB", env=env)
    assert started.returncode == 0, started.stderr
    try:
        proc = run_cli("status", "--json", env=env)
        assert proc.returncode == 0, proc.stderr
        node = json.loads(proc.stdout)["nodes"][0]
        assert node["tiers"]["disk"]["capacity_bytes"] == 64 << 20
        assert node["tiers"]["disk"]["blocks"] == 0
        assert node["tiers"]["arena"]["capacity_bytes"] == 8 << 20
        table = run_cli("status", env=env)
        assert table.returncode == 0, table.stderr
        assert "disk tiers" in table.stdout and "64.0M" in table.stdout
        assert (disk_dir / "tier.json").is_file()
    finally:
        stopped = run_cli("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert (disk_dir / "tier.json").is_file()  # kept for the next start
    restarted = run_cli("start", "--capacity", "8MiB", "--disk-dir", str(disk_dir),
                        "--disk-capacity", "64MiB", env=env)
    assert restarted.returncode == 0, restarted.stderr
    purged = run_cli("stop", "--purge", env=env)
    assert purged.returncode == 0, purged.stderr
    assert "disk tiers removed" in purged.stdout
    assert not disk_dir.exists()


# -- help: instant, complete ------------------------------------------------------------------

HEAVY = ("torch", "transformers", "ray")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _imported(stderr: str) -> set[str]:
    """Top-level packages a process imported, from its PYTHONPROFILEIMPORTTIME report."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("command", [[], *([name] for name in sorted(
    ["start", "stop", "status", "ls", "pin", "unpin", "drain", "invalidate", "prefill",
     "decode", "generate", "demo", "bench", "doctor"]))])
def test_every_help_imports_no_worker_stack(command: list[str]) -> None:
    """`kvstore [COMMAND] --help` as typed: exit 0, usage printed, torch/transformers/ray never
    imported (they cost seconds; Python's own import report says what was loaded)."""
    env = _base_env()
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    proc = run_cli(*command, "--help", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: kvstore {' '.join(command)}".rstrip())
    imported = _imported(proc.stderr)
    assert "kvstore" in imported  # the report is there, so an absence below means something
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_help_lists_every_subcommand_tested_above() -> None:
    assert sorted(_subcommands()) == sorted(["start", "stop", "status", "ls", "pin", "unpin",
                                             "drain", "invalidate", "prefill", "decode",
                                             "generate", "demo", "bench", "serve",
                                             "credentials", "rotate-credentials", "doctor"])


def test_help_states_the_defaults() -> None:
    """``--model``, ``--seed`` and ``--temperature`` say what a command runs with unless told."""
    commands = _subcommands()
    for name in ("generate", "prefill", "decode", "serve"):
        text = " ".join(commands[name].format_help().split())
        assert "(default: worker.model, tiny)" in text, name
        assert "weights seed of a random preset (default: worker.seed, 0)" in text, name
    for name in ("generate", "prefill", "decode", "demo"):
        text = " ".join(commands[name].format_help().split())
        assert "sampling temperature (default 0: greedy)" in text, name
    demo = " ".join(commands["demo"].format_help().split())
    assert "(default: small)" in demo and "per request (default: 8)" in demo


def test_every_flag_has_help_text() -> None:
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in _subcommands().items() for a in p._actions
               if not (a.help or "").strip() and not isinstance(a, argparse._HelpAction)]
    assert not missing, missing


# -- steering the cache by prompt, against a real prefill ----------------------------------------

def _json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_ls_and_pin_by_prompt_name_exactly_what_prefill_published(
        ray_head: dict[str, str], tmp_path: Path) -> None:
    """An operator's session on one cluster, from `start` (twice: idempotent) through `status`,
    a prefill, `ls`, `pin`/`unpin`/`invalidate` by prompt and by key, `drain`, to `stop`
    (its arena gone, `status` then exit 3): one cluster, as each start costs seconds."""
    env = {**ray_head, "COLUMNS": "80"}
    tokens = list(range(1, 50))  # 3 full blocks of 16 and a partial one (no key)
    prompts = tmp_path / "system.jsonl"
    prompts.write_text(json.dumps({"id": "system", "token_ids": tokens}) + "\n")
    started = run_cli("start", "--capacity", "16MiB", env=env)
    assert started.returncode == 0, started.stderr
    try:
        again = run_cli("start", "--capacity", "16MiB", env=env)  # idempotent
        assert again.returncode == 0, again.stderr
        status = _json(run_cli("status", "--json", env=env))  # exactly one JSON object
        (node,) = status["nodes"]
        assert node["capacity_bytes"] == status["totals"]["capacity_bytes"] == 16 << 20
        assert node["used_bytes"] == 0 and node["blocks"] == 0

        filled = run_cli("prefill", "--prompts", str(prompts), "--model", "tiny", env=env,
                         timeout=200)
        assert filled.returncode == 0, filled.stderr[-3000:]

        view = _json(run_cli("ls", "--json", env=env))
        (ns,) = view["namespaces"]
        assert ns["described"] and ns["model"] == "tiny" and ns["salt"] == "default"
        assert (ns["block_size"], ns["blocks"], ns["dtype"]) == (16, 3, "float32")
        assert len(ns["model_fingerprint"]) == 64
        (prefix,) = view["prefixes"]
        # the reference: the chained keys of the prompt's full blocks from the listed root
        want = chain_keys(bytes.fromhex(ns["root"]), b"".join(
            t.to_bytes(8, "little") for t in tokens), 16)
        assert prefix["key"] == want[-1].hex()
        assert (prefix["blocks"], prefix["tokens"], prefix["pinned_blocks"]) == (3, 48, 0)

        listing = run_cli("ls", env=env)
        assert listing.returncode == 0 and prefix["key"] in listing.stdout
        assert max(map(len, listing.stdout.splitlines())) <= 80

        pinned = run_cli("pin", "--prompts", str(prompts), "--model", "tiny", env=env)
        assert pinned.returncode == 0, pinned.stderr[-3000:]
        assert "pinned 3 of 3 blocks (0 not cached; hard)" in pinned.stdout
        assert f"ends at {prefix['key']}" in pinned.stdout
        after = _json(run_cli("ls", "--json", env=env))["prefixes"][0]
        assert after["pinned_blocks"] == 3

        unpinned = run_cli("unpin", "--text", "".join(map(chr, tokens)), "--model", "tiny",
                           env=env)  # bytes tokenizer: the same token ids, typed as text
        assert unpinned.returncode == 0, unpinned.stderr[-3000:]
        assert "unpinned 3 of 3 blocks (3 cached)" in unpinned.stdout
        again = run_cli("unpin", prefix["key"], env=env)
        assert again.returncode == 1 and "none of the 1 blocks was pinned" in again.stderr

        status = _json(run_cli("status", "--json", env=env))
        node_id = status["nodes"][0]["node_id"]
        assert status["top_prefixes"] == [] or len(status["top_prefixes"][0]["key"]) == 64
        table = run_cli("status", env=env)
        assert table.returncode == 0, table.stderr
        # piped, so no line is wrapped: each fact stays on its line for grep
        assert any(line.startswith("security:") and "certificates expire in" in line
                   for line in table.stdout.splitlines()), table.stdout
        # the tables fit 80 columns; the prose lines after them (security, Ray's reach) are
        # never wrapped off a terminal, whatever their length (grep finds them whole)
        prose = ("total:", "security:", "ray:", "WARNING", "drift", "numerics:")
        rows = [line for line in table.stdout.splitlines() if not line.startswith(prose)]
        assert max(map(len, rows)) <= 80, table.stdout
        assert any(line.startswith("ray: ") for line in table.stdout.splitlines())
        assert node_id[:SHORT_ID] in table.stdout and node_id not in table.stdout
        wide = run_cli("status", "--wide", env=env)
        assert wide.returncode == 0 and node_id in wide.stdout

        gone = run_cli("invalidate", "--prompts", str(prompts), "--model", "tiny", env=env)
        assert gone.returncode == 0, gone.stderr[-3000:]
        assert "invalidated 3 of 3 blocks (0 not cached)" in gone.stdout
        assert _json(run_cli("ls", "--json", env=env))["prefixes"] == []

        drained = run_cli("drain", node_id[:SHORT_ID], env=env)  # what status printed
        assert drained.returncode == 0, drained.stderr
        assert f"draining {node_id}: 0 blocks" in drained.stdout
        unknown = run_cli("drain", "zz-no-such-node", env=env)
        assert unknown.returncode == 2 and "no node id starts with" in unknown.stderr

        pinned = run_cli("pin", "--soft", "--ttl", "60", "ab" * 32, env=env)
        assert pinned.returncode == 1  # nobody holds it: nothing pinned, and it says so
        assert "none of the 1 blocks is cached" in pinned.stderr
        pinned = run_cli("pin", "--soft", "--ttl", "60", "--ahead", "ab" * 32, env=env)
        assert pinned.returncode == 0, pinned.stderr
        assert "pinned 1 of 1 blocks (1 not cached" in pinned.stdout
    finally:
        stopped = run_cli("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not list(Path("/dev/shm").glob(f"kvstore-arena-{node_id[:16]}-*"))

    after = run_cli("status", "--json", env=env)
    assert after.returncode == 3  # kvstore not running (the CLI's exit-code table)
    assert "kvstore start" in after.stderr
    assert len(after.stderr.strip().splitlines()) == 1
