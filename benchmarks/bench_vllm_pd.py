"""Disaggregated prefill with vLLM engines through kvstore, against one vLLM instance, in one run.

8 users share a system prompt and ask 8 different questions at once (greedy, ``ignore_eos``,
the same number of new tokens each), in rounds; each round has a system prompt of its own, so
neither setup starts a round with its prefix cached. Both setups are driven by the same HTTP
client (``/v1/completions``, prompts as token ids, 8 requests in flight):

- **P/D**: ``kvstore serve --engine vllm`` on a kvstore cluster (``kvstore start``, a private
  Ray head): one prefill vLLM instance (``kv_producer``) with its threads bound to core 0, one
  decode instance (``kv_consumer``) bound to core 1, kvstore's front end and prefix-aware
  router before them;
- **single**: vLLM's own OpenAI server (``vllm serve``), one instance doing both, no
  connector, its own prefix cache on, bound to cores ``0-1``.

Fairness: both setups get the same two cores for their engines, so the ratio compares two ways
of spending one machine, not more hardware against less. What each setup runs besides its
engines (Ray, Serve's proxy and front end, the store for P/D; vLLM's API server for the single
instance) is not pinned and shares the same cores: that overhead is part of what is measured.
The machine is shared, so the figures are medians over rounds.

``ratio_throughput_pd_vs_single`` is P/D's generated tokens per second over the single
instance's (medians over rounds; higher is better for P/D); ``ratio_ttft_single_vs_pd`` the
single instance's median time to the first token over P/D's (streamed requests);
``outputs_equal`` compares every answer of the two setups token for token. ``--quick`` takes
minutes, not one: three engines load (~20 s each, more on a busy machine) before anything is
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_vllm import build_model, start_kvstore
from benchmarks.common import parse_args, report

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
USERS = 8
START_TIMEOUT_S = 600.0


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and logs")
    parser.add_argument("--rounds", type=int, help="rounds of 8 users (default: 2, quick 2)")


def workload(rounds: int, system_tokens: int, seed: int = 7) -> list[list[list[int]]]:
    """Per round, 8 prompts: the round's system prompt plus one question each (token ids)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds + 1):  # the first is the warm-up
        system = torch.randint(5, 390, (system_tokens,), generator=g).tolist()
        out.append([system + torch.randint(5, 390, (16 + 2 * u,), generator=g).tolist()
                    for u in range(USERS)])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """An HTTP server in a process group of its own, stopped by its PID."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, url: str) -> None:
        self.url, self.log = url, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"{argv[2:4]} did not start:\n{tail}")
            time.sleep(1.0)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as reply:
                return reply.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def complete(url: str, model: str, prompt: list[int], max_tokens: int
             ) -> tuple[float, list[int]]:
    """One streamed completion: seconds to its first token, and its token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, tokens = 0.0, list[int]()
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
            new = choices[0].get("token_ids") or []
            if new and not tokens:
                ttft = time.perf_counter() - t0
            tokens += new
    return ttft, tokens


@dataclass
class Measured:
    """One setup's timed rounds."""

    rates: list[float] = field(default_factory=list)  # generated tokens/s, per round
    ttfts: list[float] = field(default_factory=list)  # every request's
    answers: list[list[int]] = field(default_factory=list)


def measure(url: str, model: str, rounds: list[list[list[int]]], max_tokens: int) -> Measured:
    """Tokens per second of each timed round (8 users at once), TTFTs, every answer."""
    out = Measured()
    with ThreadPoolExecutor(USERS) as pool:
        for i, prompts in enumerate(rounds):
            t0 = time.perf_counter()
            done = list(pool.map(lambda p: complete(url, model, p, max_tokens), prompts))
            elapsed = time.perf_counter() - t0
            if i:  # round 0 warms both setups up alike
                out.rates.append(sum(len(tokens) for _, tokens in done) / elapsed)
                out.ttfts += [ttft for ttft, _ in done]
                out.answers += [tokens for _, tokens in done]
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pd-"))
    env = {**os.environ, "KVSTORE_STATE_DIR": str(work / "state"), "RAY_AUTH_MODE": "disabled",
           "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    try:
        run(args, env, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    model = build_model(work / "model", args.quick)
    system_tokens = 512 if args.quick else 1024
    rounds = workload(args.rounds or 2, system_tokens)
    new_tokens = 32 if args.quick else 64
    engine = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 2048,
              "gpu_memory_utilization": 0.15, "enforce_eager": True}
    port = free_port()
    # vLLM's OpenAI server by module: the `vllm` command of vllm-cpu 0.32 looks up the
    # package metadata of "vllm" and fails before parsing its arguments.
    server = Server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                     model, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                     "--block-size", str(BLOCK), "--max-model-len", "2048",
                     "--gpu-memory-utilization", "0.15", "--enforce-eager",
                     "--enable-prefix-caching"],
                    {**env, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}, work / "single.log",
                    f"http://127.0.0.1:{port}")
    try:
        single = measure(server.url, model, rounds, new_tokens)
    finally:
        server.stop()
    kvstore = start_kvstore(env)
    try:
        port = free_port()
        pd = Server([*kvstore, "serve", "--engine", "vllm", "--model", model,
                     "--engine-args", json.dumps(engine), "--prefill-cpus", "0",
                     "--decode-cpus", "1", "--max-ongoing-requests", str(USERS),
                     "--port", str(port)], env, work / "pd.log", f"http://127.0.0.1:{port}")
        try:
            split = measure(pd.url, "model", rounds, new_tokens)
            with urllib.request.urlopen(f"{pd.url}/health", timeout=30) as reply:
                health = json.loads(reply.read())
        finally:
            pd.stop()
    finally:
        subprocess.run([*kvstore, "stop"], env=env, capture_output=True, timeout=300)
    pd_rate, single_rate = statistics.median(split.rates), statistics.median(single.rates)
    pd_ttft, single_ttft = statistics.median(split.ttfts), statistics.median(single.ttfts)
    decode = health.get("decode", {})
    figures: dict[str, Any] = {
        "users": USERS, "rounds": len(split.rates), "system_tokens": system_tokens,
        "new_tokens": new_tokens, "block_size": BLOCK,
        "throughput_pd_tok_s": pd_rate, "throughput_single_tok_s": single_rate,
        "throughput_pd_rounds": split.rates, "throughput_single_rounds": single.rates,
        "ratio_throughput_pd_vs_single": pd_rate / single_rate,
        "ttft_pd_s": pd_ttft, "ttft_single_s": single_ttft,
        "ratio_ttft_single_vs_pd": single_ttft / pd_ttft,
        "outputs_equal": split.answers == single.answers,
        "decode_cached_tokens": decode.get("cached_tokens"),
        "decode_peak_running_requests": decode.get("peak_running_requests"),
        "decode_peak_tokens_per_step": decode.get("peak_tokens_per_step"),
        "cores": {"pd": {"prefill": "0", "decode": "1"}, "single": "0-1"},
    }
    report(f"vLLM P/D through kvstore vs one vLLM instance ({USERS} users, CPU, 2 cores)", [
        ("throughput, P/D via kvstore (tok/s)", f"{pd_rate:.1f}", ""),
        ("throughput, single instance (tok/s)", f"{single_rate:.1f}", "the baseline"),
        ("P/D / single", f"{pd_rate / single_rate:.2f}", "> 1.0"),
        ("TTFT median, P/D / single (s)", f"{pd_ttft:.3f}", f"{single_ttft:.3f}"),
        ("decode batch, most requests in one step", str(decode.get("peak_running_requests")),
         f"<= {USERS}"),
        ("outputs equal", str(figures["outputs_equal"]), "True"),
    ], figures, args.json)


if __name__ == "__main__":
    main()
