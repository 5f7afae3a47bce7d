"""Worker subcommands of the ``kvstore`` CLI: prefill, decode, generate, demo, bench.

Their parser is ``kvstore.workers.jobs.args``, which imports this module only when a command
runs (this one imports torch); nothing here imports the parser back. Every command runs on the
running kvstore cluster, or starts an embedded one (local Ray, in-memory index) when none is up;
``--in-process`` runs everything in this process on a LocalStore (no Ray at all).
Progress goes to stderr (``kvstore.command_output``: live on a terminal, else a plain line per
phase), so ``--json`` output on stdout stays one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from kvstore.command_flags import WORKER_FLAGS, config_from_flags, flag_settings
from kvstore.command_output import Steps, output_console, seconds_text
from kvstore.config import KVStoreConfig
from kvstore.errors import ConfigError
from kvstore.workers.jobs.deployment import Deployment, RequestOutput, parse_resource
from kvstore.workers.jobs.prompts import read_prompts
from kvstore.workers.model.causal_lm import generation_stop_ids
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.model.tokenizer import ByteTokenizer, tokenizer_for
from kvstore.workers.replicas.request_pipeline import JobKind


def make_config(args: argparse.Namespace) -> KVStoreConfig:
    """Defaults < --config < KVSTORE_* < flags; a command's own defaults (the demo's
    ``model_default`` and ``max_new_default``) stand in for the flags it was not given."""
    worker = flag_settings(args, WORKER_FLAGS)
    if not worker.get("model"):
        worker["model"] = getattr(args, "model_default", None)
    # setdefault, not ``or``: 0 is a warm-up (prefill and publish only), not "unset".
    worker.setdefault("max_new_tokens", getattr(args, "max_new_default", None))
    return config_from_flags(args, {"worker": worker})


def make_sampling(args: argparse.Namespace, config: KVStoreConfig) -> SamplingParams:
    """The request's sampling; it stops at the checkpoint's end-of-sequence tokens (its
    ``generation_config``) and ``--stop-token-ids``, or only the latter with ``--ignore-eos``."""
    stop = tuple(args.stop_token_ids)
    if not getattr(args, "ignore_eos", False):
        stop += tuple(t for t in generation_stop_ids(config.worker.model) if t not in stop)
    return SamplingParams(max_new_tokens=config.worker.max_new_tokens,
                          temperature=args.temperature, sampling_seed=args.sampling_seed,
                          stop_token_ids=stop)


def check_output(path: str | None) -> None:
    """Fail before any work when ``--output`` cannot be written (missing or unwritable dir)."""
    if not path:
        return
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise ConfigError(f"--output {path} is a directory; give a file path")
    if not parent.is_dir():
        raise ConfigError(f"--output {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"--output {path}: not writable")


def write_output(path: str, rows: list[dict[str, Any]]) -> None:
    """Write the results; if that fails after all the compute, keep them in a temp file."""
    text = "".join(json.dumps(r) + "\n" for r in rows)
    try:
        Path(path).write_text(text)
    except OSError as exc:
        fd, rescue = tempfile.mkstemp(prefix="kvstore-results-", suffix=".jsonl")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        raise ConfigError(f"cannot write --output {path} ({exc}); the results are in "
                          f"{rescue}") from exc


def emit(args: argparse.Namespace, results: list[RequestOutput], title: str) -> None:
    """JSON lines and/or a JSONL file, and a table on stderr."""
    rows = [r.to_json() for r in results]
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    table = Table(title=title)
    for col in ("id", "prompt", "cached", "ttft ms", "bytes fetched", "sources", "replicas",
                "tokens"):
        table.add_column(col)
    for r in results:
        toks = " ".join(map(str, r.output_token_ids[:8]))
        table.add_row(r.id, str(r.num_prompt_tokens), str(r.cached_tokens),
                      f"{r.ttft_s * 1e3:.1f}", str(r.bytes_fetched),
                      ",".join(f"{k[:8]}:{v}" for k, v in r.sources.items()),
                      " ".join(n for n in (r.prefill_replica, r.decode_replica) if n),
                      f"({len(r.output_token_ids)}) {toks}"
                      + (" ..." if len(r.output_token_ids) > 8 else ""))
    output_console(stderr=args.json).print(table)
    if args.output:  # last: a failed write still leaves the results printed above
        write_output(args.output, rows)


def _resource(spec: str | None) -> dict[str, float] | None:
    return parse_resource(spec) if spec else None


def _run(args: argparse.Namespace, kind: JobKind) -> int:
    check_output(args.output)  # before the models load and the compute runs
    config = make_config(args)
    tokenizer = tokenizer_for(config.worker.model, args.tokenizer)
    prompts = read_prompts(args.prompts, tokenizer)
    sampling = make_sampling(args, config)
    steps = Steps.for_command(args.json)
    dep = Deployment(config, num_prefill=getattr(args, "prefill_replicas", 1),
                     num_decode=getattr(args, "decode_replicas", 1),
                     mode="inprocess" if args.in_process else "ray", address=args.address,
                     prefill_resources=_resource(getattr(args, "prefill_resource", None)),
                     decode_resources=_resource(getattr(args, "decode_resource", None)),
                     steps=steps)
    job: JobKind = "reference" if kind == "generate" and args.no_cache else kind
    try:
        label = "generate --no-cache" if job == "reference" else kind
        with steps.counted(label, len(prompts)) as advance:
            results = dep.run(job, prompts, sampling, on_done=advance)
        reuse = dep.reuse
    finally:
        dep.close()
    if not isinstance(tokenizer, ByteTokenizer):  # a real tokenizer: its text is meaningful
        for out in results:
            out.text = tokenizer.decode(out.output_token_ids)
    emit(args, results, f"kvstore {kind} (reuse {reuse['mode']}: resume at {reuse['resume']} "
                        f"boundaries, {'bitwise' if reuse['exact'] else 'approximate'})")
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    return _run(args, "prefill")


def cmd_decode(args: argparse.Namespace) -> int:
    return _run(args, "decode")


def cmd_generate(args: argparse.Namespace) -> int:
    return _run(args, "generate")


def cmd_demo(args: argparse.Namespace) -> int:
    from kvstore.workers.jobs.demo import run_demo

    return run_demo(args, make_config(args), Steps.for_command(args.json))


def cmd_bench(args: argparse.Namespace) -> int:
    """Run each ``benchmarks/bench_*.py`` (they print their own tables)."""
    root = Path(__file__).resolve().parents[3] / "benchmarks"  # the repository's, beside kvstore/
    scripts = sorted(root.glob("bench_*.py"))
    if args.names:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.names
                   or s.stem in args.names]
    if not scripts:
        raise ConfigError(f"no benchmarks found in {root} (names: {args.names or 'all'})")
    # Lines only, never a spinner: the benchmarks print to the same terminal while they run.
    steps = Steps.for_command()
    failed = 0
    for i, script in enumerate(scripts, 1):
        # As modules from the repository root: benchmarks import benchmarks.common.
        cmd = [sys.executable, "-m", f"benchmarks.{script.stem}"]
        cmd += ["--quick"] if args.quick else []
        if args.json_dir:
            cmd += ["--json", str(Path(args.json_dir) / f"{script.stem}.json")]
        steps.line(f"benchmark {i}/{len(scripts)}: {script.stem}")
        start = time.monotonic()
        code = subprocess.run(cmd, cwd=root.parent, check=False).returncode
        outcome = "done" if code == 0 else f"failed (exit {code})"
        steps.line(f"{script.stem}: {outcome} in {seconds_text(time.monotonic() - start)}")
        failed += code != 0
    return 1 if failed else 0
