"""Multi-round chat through the OpenAI API (``kvstore serve``): TTFT with the store vs bypassed.

Shaped like LMCache's multi-round QA benchmark: ``--users`` conversations of ``--rounds``
rounds each, every one opening with the same system prompt (``--system-tokens``). Round r of a
user sends, as chat ``messages``, the system prompt, every earlier question with the model's
answer, and a new question (``--question-tokens``); the answer (``--answer-tokens``, with
``ignore_eos`` so every answer has that length) goes into the next round's history. Each user
is one asyncio task that waits for its answer before asking again; at most ``--concurrency``
requests are in flight. Requests are streamed chat completions sent with the official
``openai`` package (``AsyncOpenAI``) to ONE server: ``kvstore serve`` started here on a free
port (``--model``, default ``tiny``; ``--chunk-tokens``/``--block-size``/replicas passed on) and
stopped at the end, or the one at ``--url``.

Two arms, back to back against the same server, after untimed warm-up requests of both kinds:

* ``cache``: the store is used, under a cache salt fresh for this run (so a repeated run does
  not start warm) and the same for every user (so the system prompt is shared across users);
* ``nocache``: the same conversations with ``bypass_cache: true`` (the store neither read nor
  written: the server's ``--no-cache`` reference through the same API). Histories are built
  from the cache arm's answers and replayed here message for message, so both arms send the
  same prompts, and ``outputs_equal`` says whether every (user, round) generated the same token
  ids in both (``temperature: 0``, ``return_token_ids: true``).

Per request: TTFT (request sent to the first streamed chunk carrying content or token ids; the
chat role chunk alone does not count), latency to the last chunk, prompt tokens and
``usage.prompt_tokens_details.cached_tokens``. Per arm: TTFT p50/p99, latency p50, requests/s
and generated tokens/s (over the arm's wall time) and the mean cached fraction of the prompt.
``ratio_ttft_p50_nocache_vs_cache`` is the bypass arm's p50 over the cache arm's (higher is
better; target >= 3 on the tiny preset). ``ttft_p50_ms_*_round0`` and ``*_later_rounds`` split
the first round (the system prompt is cold for the users that start together: each of them
computes and publishes it) from the rest; the cache arm's p99 is mostly those cold requests.
Random weights generate mostly ids without a byte, so the answers add little text to the
histories: the context grows by about the question's length a round. Token counts are the
presets' byte tokenizer's (one token per character of the ASCII text used here); with a
checkpoint's tokenizer they are characters. The bypass arm prefills and decodes on a decode
replica alone, while the cache arm prefills on a prefill replica and decodes on a decode
replica, so its requests/s also has the two replicas' overlap.

Defaults (tiny preset, 2 cores): a 3072-token system prompt in a 4096-token context (long shared
context, 48-token questions), 16 users x 8 rounds of 32-token answers, 4 requests in flight;
--quick: 4 users x 4 rounds of 16-token answers. The server's own block and chunk sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import parse_args, report

#: Defaults: (full run, --quick). Sized for a 2-core machine on the tiny preset: a long shared
#: context and short new turns, as in multi-round QA, the full run a few minutes including the
#: server's start, --quick about a minute.
DEFAULTS = {"users": (16, 4), "rounds": (8, 4), "system_tokens": (3072, 3072),
            "question_tokens": (48, 48), "answer_tokens": (32, 16)}
#: Requests in flight by default (at most one per user): a replica's default
#: serve.max_ongoing_requests, so requests queue at the client rather than inside Serve.
CONCURRENCY = 4
#: Seconds to wait for a server started here to answer /health, and to exit after SIGINT.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0

WORDS = ("cache", "block", "prefix", "token", "layer", "store", "replica", "lease", "node",
         "query", "answer", "system", "prompt", "decode", "prefill", "chunk", "index", "shard",
         "memory", "tensor", "model", "request", "latency", "batch", "stream", "policy")


def _flags(parser: argparse.ArgumentParser) -> None:
    full = {k: v[0] for k, v in DEFAULTS.items()}
    parser.add_argument("--model", default="tiny",
                        help="preset or weights directory for the server started here (tiny)")
    parser.add_argument("--url", help="use the server already running at this base URL "
                        "(http://HOST:PORT) instead of starting one")
    parser.add_argument("--users", type=int, help=f"conversations ({full['users']}; "
                        f"--quick {DEFAULTS['users'][1]})")
    parser.add_argument("--rounds", type=int, help=f"rounds per conversation "
                        f"({full['rounds']}; --quick {DEFAULTS['rounds'][1]})")
    parser.add_argument("--system-tokens", type=int,
                        help=f"shared system prompt length ({full['system_tokens']})")
    parser.add_argument("--question-tokens", type=int,
                        help=f"length of each new question ({full['question_tokens']})")
    parser.add_argument("--answer-tokens", type=int, help=f"max_tokens of every answer "
                        f"({full['answer_tokens']}; --quick {DEFAULTS['answer_tokens'][1]})")
    parser.add_argument("--concurrency", type=int,
                        help=f"requests in flight at most (default: {CONCURRENCY}, at most one "
                        "per user)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed warm-up requests of each arm before the timed run (2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' text (0)")
    parser.add_argument("--chunk-tokens", type=int,
                        help="server --chunk-tokens (default: the server's)")
    parser.add_argument("--block-size", type=int,
                        help="server --block-size (default: the server's)")
    parser.add_argument("--prefill-replicas", type=int, help="server --prefill-replicas")
    parser.add_argument("--decode-replicas", type=int, help="server --decode-replicas")
    parser.add_argument("--config", metavar="FILE", help="server --config")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the size flags not given from ``DEFAULTS`` (full or --quick); check them."""
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.concurrency is None:
        args.concurrency = min(args.users, CONCURRENCY)
    for name in ("users", "rounds", "system_tokens", "question_tokens", "answer_tokens",
                 "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"bench_serve: --{name.replace('_', '-')} must be >= 1")
    if args.question_tokens < 16:
        raise SystemExit("bench_serve: --question-tokens must be >= 16 (a question names its "
                         "user and round)")
    return args


# ---------------------------------------------------------------------------------------------
# The server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``kvstore serve`` in its own session; ``stop()`` sends SIGINT, then SIGKILLs its group."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="bench-serve-")
        self.ready = Path(self.dir.name) / "ready"
        self.log_path = Path(self.dir.name) / "server.log"
        cmd = [sys.executable, "-m", "kvstore.cli.main", "serve", "--model", args.model,
               "--port", str(_free_port()), "--ready-file", str(self.ready)]
        for flag in ("chunk_tokens", "block_size", "prefill_replicas", "decode_replicas",
                     "config"):
            value = getattr(args, flag)
            if value is not None:
                cmd += [f"--{flag.replace('_', '-')}", str(value)]
        self.cmd = cmd
        env = dict(os.environ)
        env.setdefault("RAY_AUTH_MODE", "disabled")
        self.log = self.log_path.open("wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            self.url = self._wait(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _wait(self, t0: float) -> str:
        while not self.ready.exists() or not self.ready.read_text().strip():
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_serve: the server exited with {self.proc.returncode}:"
                                 f"\n{' '.join(self.cmd)}\n{self._tail()}")
            if time.perf_counter() - t0 > START_TIMEOUT_S:
                raise SystemExit(f"bench_serve: the server did not answer within "
                                 f"{START_TIMEOUT_S:.0f}s:\n{self._tail()}")
            time.sleep(0.25)
        return self.ready.read_text().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        self.dir.cleanup()


# ---------------------------------------------------------------------------------------------
# The conversations


def make_text(rng: random.Random, n: int, head: str = "") -> str:
    """ASCII text of exactly ``n`` characters (``n`` byte-tokenizer tokens): ``head``, words."""
    parts = [head] if head else []
    size = len(head)
    while size < n:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word) + (1 if len(parts) > 1 else 0)
    return " ".join(parts)[:n]


def system_prompt(tokens: int, seed: int) -> str:
    return make_text(random.Random(f"system-{seed}"), tokens,
                     "You are a helpful assistant for a distributed KV cache. Notes:")


def question(user: int, rnd: int, tokens: int, seed: int) -> str:
    text = make_text(random.Random(f"q-{seed}-{user}-{rnd}"), tokens - 1,
                     f"User {user} round {rnd}: explain")
    return text + "?"


@dataclass(slots=True)
class Result:
    """One streamed request, as the client saw it."""

    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Arm:
    """One arm's requests by (user, round), and its wall time."""

    name: str
    results: dict[tuple[int, int], Result] = field(default_factory=dict)
    wall_s: float = 0.0


class Client:
    """Streamed chat completions with the kvstore extensions, timed at the client."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        from openai import AsyncOpenAI

        base = url.rstrip("/")
        base = base if base.endswith("/v1") else base + "/v1"
        self.openai = AsyncOpenAI(base_url=base, api_key=os.environ.get(
            "KVSTORE_SERVE_API_KEY", "unused"), max_retries=0, timeout=600.0)
        self.args = args
        self.model = ""

    async def model_card(self) -> tuple[str, int | None]:
        models = await self.openai.models.list()
        card = models.data[0]
        self.model = card.id
        extra = card.model_extra or {}
        return card.id, extra.get("max_model_len")

    async def chat(self, messages: list[dict[str, str]], *, bypass: bool, salt: str | None,
                   max_tokens: int) -> Result:
        extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True,
                                 "bypass_cache": bypass}
        if salt is not None:
            extra["cache_salt"] = salt
        t0 = time.perf_counter()
        ttft: float | None = None
        ids: list[int] = []
        text: list[str] = []
        usage = None
        stream = await self.openai.chat.completions.create(  # type: ignore[call-overload]
            model=self.model, messages=messages,
            max_tokens=max_tokens, temperature=0, seed=self.args.seed, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                tokens = getattr(choice, "token_ids", None) or []
                content = choice.delta.content or ""
                if ttft is None and (tokens or content):
                    ttft = time.perf_counter() - t0
                ids += tokens
                text.append(content)
        latency = time.perf_counter() - t0
        if ttft is None or usage is None:
            raise RuntimeError("the stream ended without tokens or without a usage chunk")
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        return Result(ttft, latency, usage.prompt_tokens, cached, ids, "".join(text))

    async def close(self) -> None:
        await self.openai.close()


async def run_cache_arm(client: Client, args: argparse.Namespace, salt: str
                        ) -> tuple[Arm, dict[tuple[int, int], list[dict[str, str]]]]:
    """Every user's conversation with the store; the messages each request sent."""
    arm, sent = Arm("cache"), {}
    gate = asyncio.Semaphore(args.concurrency)
    system = {"role": "system", "content": system_prompt(args.system_tokens, args.seed)}

    async def user(u: int) -> None:
        history = [system]
        for r in range(args.rounds):
            history.append({"role": "user",
                            "content": question(u, r, args.question_tokens, args.seed)})
            sent[(u, r)] = list(history)
            async with gate:
                res = await client.chat(history, bypass=False, salt=salt,
                                        max_tokens=args.answer_tokens)
            arm.results[(u, r)] = res
            history.append({"role": "assistant", "content": res.text})

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(args.users)))
    arm.wall_s = time.perf_counter() - t0
    return arm, sent


async def run_bypass_arm(client: Client, args: argparse.Namespace,
                         sent: dict[tuple[int, int], list[dict[str, str]]]) -> Arm:
    """The same messages with ``bypass_cache``; each user still waits for its answers."""
    arm = Arm("nocache")
    gate = asyncio.Semaphore(args.concurrency)

    async def user(u: int) -> None:
        for r in range(args.rounds):
            async with gate:
                arm.results[(u, r)] = await client.chat(sent[(u, r)], bypass=True, salt=None,
                                                         max_tokens=args.answer_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(args.users)))
    arm.wall_s = time.perf_counter() - t0
    return arm


async def warm_up(client: Client, args: argparse.Namespace) -> None:
    """Untimed requests of both kinds, on text the timed run does not share (own salt too)."""
    if args.warmup < 1:
        return
    salt = f"bench-serve-warmup-{uuid.uuid4().hex}"
    for bypass in (False, True):
        await asyncio.gather(*(client.chat(
            [{"role": "system", "content": system_prompt(args.system_tokens, 10_000 + i)},
             {"role": "user", "content": question(0, 0, args.question_tokens, 10_000 + i)}],
            bypass=bypass, salt=salt, max_tokens=min(4, args.answer_tokens))
            for i in range(args.warmup)))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def arm_figures(arm: Arm) -> dict[str, float]:
    res = list(arm.results.values())
    ttft = [r.ttft_s for r in res]
    tokens = sum(len(r.token_ids) for r in res)
    n = arm.name
    out = {f"ttft_p50_ms_{n}": 1e3 * percentile(ttft, 50),
           f"ttft_p99_ms_{n}": 1e3 * percentile(ttft, 99),
           f"ttft_mean_ms_{n}": 1e3 * statistics.fmean(ttft),
           f"latency_p50_ms_{n}": 1e3 * percentile([r.latency_s for r in res], 50),
           f"requests_per_s_{n}": len(res) / arm.wall_s,
           f"generated_tokens_per_s_{n}": tokens / arm.wall_s,
           f"cached_fraction_{n}": statistics.fmean(r.cached_tokens / r.prompt_tokens
                                                    for r in res),
           f"prompt_tokens_mean_{n}": statistics.fmean(r.prompt_tokens for r in res),
           f"wall_s_{n}": arm.wall_s}
    first = [r.ttft_s for (_, rnd), r in arm.results.items() if rnd == 0]
    later = [r.ttft_s for (_, rnd), r in arm.results.items() if rnd > 0]
    out[f"ttft_p50_ms_{n}_round0"] = 1e3 * percentile(first, 50)
    if later:
        out[f"ttft_p50_ms_{n}_later_rounds"] = 1e3 * percentile(later, 50)
    return out


def last_prompt(args: argparse.Namespace) -> int:
    """The last round's prompt with the byte tokenizer's template, if every answer's text
    were one byte a token (random weights give fewer: most of their ids have no byte)."""
    per_message = 16  # "<|assistant|>\n" ... "\n"
    return (args.system_tokens + per_message
            + args.rounds * (args.question_tokens + per_message)
            + (args.rounds - 1) * (args.answer_tokens + per_message) + per_message)


async def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    client = Client(url, args)
    try:
        model, max_len = await client.model_card()
        if max_len is not None and last_prompt(args) + args.answer_tokens > max_len:
            raise SystemExit(f"bench_serve: the last round would need about "
                             f"{last_prompt(args) + args.answer_tokens} tokens; {model} takes "
                             f"{max_len}: lower --system-tokens, --rounds or --answer-tokens")
        await warm_up(client, args)
        salt = f"bench-serve-{uuid.uuid4().hex}"
        cache, sent = await run_cache_arm(client, args, salt)
        nocache = await run_bypass_arm(client, args, sent)
    finally:
        await client.close()
    keys = sorted(cache.results)
    equal = all(cache.results[k].token_ids == nocache.results[k].token_ids
                and len(cache.results[k].token_ids) == args.answer_tokens for k in keys)
    figures: dict[str, Any] = {"model": model, "max_model_len": max_len}
    figures |= arm_figures(cache) | arm_figures(nocache)
    figures |= {
        "ratio_ttft_p50_nocache_vs_cache":
            figures["ttft_p50_ms_nocache"] / figures["ttft_p50_ms_cache"],
        "ratio_ttft_p99_nocache_vs_cache":
            figures["ttft_p99_ms_nocache"] / figures["ttft_p99_ms_cache"],
        "ratio_requests_per_s_cache_vs_nocache":
            figures["requests_per_s_cache"] / figures["requests_per_s_nocache"],
        "outputs_equal": equal,
        "outputs_differing": sum(cache.results[k].token_ids != nocache.results[k].token_ids
                                 for k in keys),
        "requests_per_arm": len(keys),
        "prompt_tokens_max": max(r.prompt_tokens for r in cache.results.values()),
    }
    return figures


def main() -> None:
    args = resolve(parse_args(__doc__.splitlines()[0], _flags))
    server = None
    try:
        if args.url:
            url = args.url
        else:
            print(f"bench_serve: starting kvstore serve --model {args.model} ...",
                  file=sys.stderr, flush=True)
            server = Server(args)
            url = server.url
        figures = asyncio.run(bench(url, args))
    finally:
        if server is not None:
            server.stop()
    figures |= {"users": args.users, "rounds": args.rounds, "system_tokens": args.system_tokens,
                "question_tokens": args.question_tokens, "answer_tokens": args.answer_tokens,
                "concurrency": args.concurrency, "chunk_tokens": args.chunk_tokens,
                "block_size": args.block_size, "prefill_replicas": args.prefill_replicas,
                "decode_replicas": args.decode_replicas, "warmup": args.warmup,
                "seed": args.seed, "server_started": server is not None,
                "server_start_s": server.start_s if server is not None else None}
    f = figures
    report(f"multi-round chat over the OpenAI API ({f['model']}, {args.users} users x "
           f"{args.rounds} rounds, {args.system_tokens}-token system prompt, "
           f"{args.answer_tokens}-token answers, {args.concurrency} in flight)", [
        ("TTFT p50, store (ms)", f"{f['ttft_p50_ms_cache']:.1f}",
         f"bypass {f['ttft_p50_ms_nocache']:.1f}"),
        ("TTFT p99, store (ms)", f"{f['ttft_p99_ms_cache']:.1f}",
         f"bypass {f['ttft_p99_ms_nocache']:.1f}"),
        ("bypass / store TTFT p50", f"{f['ratio_ttft_p50_nocache_vs_cache']:.2f}x", ">= 3"),
        ("bypass / store TTFT p99", f"{f['ratio_ttft_p99_nocache_vs_cache']:.2f}x", ""),
        ("TTFT p50 round 0, store (ms)", f"{f['ttft_p50_ms_cache_round0']:.1f}",
         f"bypass {f['ttft_p50_ms_nocache_round0']:.1f}"),
        *([("TTFT p50 rounds 1+, store (ms)", f"{f['ttft_p50_ms_cache_later_rounds']:.1f}",
            f"bypass {f['ttft_p50_ms_nocache_later_rounds']:.1f}")]
          if "ttft_p50_ms_cache_later_rounds" in f else []),
        ("latency p50, store (ms)", f"{f['latency_p50_ms_cache']:.1f}",
         f"bypass {f['latency_p50_ms_nocache']:.1f}"),
        ("requests/s, store", f"{f['requests_per_s_cache']:.2f}",
         f"bypass {f['requests_per_s_nocache']:.2f}"),
        ("generated tokens/s, store", f"{f['generated_tokens_per_s_cache']:.1f}",
         f"bypass {f['generated_tokens_per_s_nocache']:.1f}"),
        ("cached / prompt tokens, store (mean)", f"{f['cached_fraction_cache']:.3f}",
         f"bypass {f['cached_fraction_nocache']:.3f}"),
        ("prompt tokens, mean / max", f"{f['prompt_tokens_mean_cache']:.0f} / "
         f"{f['prompt_tokens_max']}", "same in both arms"),
        ("outputs: store = bypass (token ids)", str(f["outputs_equal"]), "True"),
    ], figures, args.json)


if __name__ == "__main__":
    main()
