"""``kvstore serve`` end to end: the official ``openai`` client against a live local server.

One server for the module, on a real-format checkpoint built offline (random Llama weights, a
BPE tokenizer trained in-process, a chat template, a generation_config whose EOS the model
actually emits), with an API key from the environment. References: the same engine with no store
at all (in this process), plain ``transformers`` greedy decoding, and the API's own
``bypass_cache`` path; never the cached path against itself.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvstore.config import WorkerConfig
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams
from tests.support.checkpoint import build_checkpoint
from tests.support.serve_process import ServeProcess, start_serve

pytestmark = pytest.mark.ray

API_KEY = "test-key-0123456789"
MAX_LEN = 512
SYSTEM = ("You are a helpful assistant. Answer briefly and clearly. The store keeps the key and "
          "value tensors of every prompt block so that the next request starts from the cache. "
          "Every replica shares this system prompt.")
QUESTIONS = [f"Question {i}: tell me about the number {i * 7} and the city." for i in range(16)]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def hf_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_greedy(model, ids: list[int], eos: int | None, max_new: int) -> list[int]:
    model.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """``(dir, eos)``: EOS is a token greedy decoding of the first chat emits after a few."""
    base = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "base",
                            config_overrides={"max_position_embeddings": MAX_LEN})
    model = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    free = hf_greedy(model, hf_ids(AutoTokenizer.from_pretrained(base), chat(QUESTIONS[0])),
                     None, 12)
    n = next(i for i in range(3, 12) if free[i - 1] not in free[:i - 1])
    path = build_checkpoint(tmp_path_factory.mktemp("ckpt") / "chat-model",
                            eos_token_id=free[n - 1],
                            config_overrides={"max_position_embeddings": MAX_LEN})
    return path, free[n - 1]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    work = tmp_path_factory.mktemp("serve")
    (work / "kvstore.yaml").write_text("pool:\n  capacity_bytes: 64MiB\n"
                                       "serve:\n  max_ongoing_requests: 8\n"
                                       "  prefix_routing: always\n")
    proc = start_serve(["--model", str(path), "--block-size", "16", "--chunk-tokens", "32",
                        "--threads", "1", "--config", str(work / "kvstore.yaml")], work,
                       env={"KVSTORE_SERVE_API_KEY": API_KEY})
    yield proc
    # As GNU `timeout` stops it: SIGTERM to the whole process group. The private Ray it started
    # is out of that group, so it still stops everything in order and exits 0.
    code = proc.stop(sig=signal.SIGTERM, whole_group=True)
    assert code == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same engine with no store at all: what every cached answer must equal bitwise."""
    path, _ = checkpoint
    model = load_model(str(path))
    engine = Engine(model, None, WorkerConfig(model=str(path), block_size=16,
                                              prefill_chunk_tokens=32))
    tok = AutoTokenizer.from_pretrained(path)

    def run(ids: list[int], max_new: int, eos: tuple[int, ...] = (), temperature: float = 0.0,
            seed: int = 0) -> list[int]:
        sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                  sampling_seed=seed, stop_token_ids=eos)
        _, dec = engine.generate(ids, sampling=sampling, use_cache=False)
        return dec.output_token_ids

    return run, tok


def health(server: ServeProcess) -> dict:
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as reply:
        return json.loads(reply.read())


def test_models_health_and_metrics(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["chat-model"]
    state = health(server)
    assert state["status"] == "ok" and state["decode"]["active_requests"] == 0
    client.completions.create(model="chat-model", prompt="Hello there", max_tokens=2,
                              temperature=0)
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    assert 'kvstore_serve_requests_total{endpoint="completions",status="ok"}' in text
    assert "kvstore_serve_ttft_seconds_bucket" in text


def test_completion_equals_no_cache_and_transformers(client, reference, checkpoint) -> None:
    run, tok = reference
    path, eos = checkpoint
    prompt = SYSTEM + " Now a completion prompt."
    ids = tok.encode(prompt)
    outs = [client.completions.create(model="chat-model", prompt=prompt, max_tokens=12,
                                      temperature=0, extra_body={"return_token_ids": True,
                                                                 "ignore_eos": True})
            for _ in range(2)]
    bypass = client.completions.create(model="chat-model", prompt=prompt, max_tokens=12,
                                       temperature=0, extra_body={"return_token_ids": True,
                                                                  "ignore_eos": True,
                                                                  "bypass_cache": True})
    want = run(ids, 12)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert want == hf_greedy(hf, ids, None, 12)
    for out in [*outs, bypass]:
        choice = out.choices[0].model_dump()
        assert choice["prompt_token_ids"] == ids
        assert choice["token_ids"] == want
        assert out.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    assert outs[1].usage.prompt_tokens_details.cached_tokens >= len(ids) // 16 * 16 - 16 > 0
    assert bypass.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stops_at_the_checkpoint_eos(client, reference, checkpoint) -> None:
    run, tok = reference
    _, eos = checkpoint
    ids = hf_ids(tok, chat(QUESTIONS[0]))
    want = run(ids, 12, (eos,))
    assert want[-1] == eos and len(want) < 12  # the fixture made EOS reachable
    out = client.chat.completions.create(model="chat-model", messages=chat(QUESTIONS[0]),
                                         max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert out.choices[0].model_dump()["token_ids"] == want
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    longer = client.chat.completions.create(model="chat-model", messages=chat(QUESTIONS[0]),
                                            max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True,
                                                        "return_token_ids": True})
    assert longer.choices[0].model_dump()["token_ids"] == run(ids, 12)
    assert longer.choices[0].finish_reason == "length"


def test_streaming_matches_non_streaming(client) -> None:
    kwargs = dict(model="chat-model", messages=chat(QUESTIONS[1]), max_tokens=10,
                  temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    comp = client.completions.create(model="chat-model", prompt="Hello there, streaming",
                                     max_tokens=6, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    assert sum(1 for c in comp if c.choices[0].finish_reason == "length") == 1


def test_sixteen_concurrent_requests_share_the_system_prompt(server, reference) -> None:
    run, tok = reference

    async def main() -> list:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                     max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[
                aclient.chat.completions.create(
                    model="chat-model", messages=chat(q), max_tokens=4, temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                "cache_salt": "concurrent"}) for q in QUESTIONS])
        finally:
            await aclient.close()

    outs = asyncio.run(main())
    cached = [o.usage.prompt_tokens_details.cached_tokens for o in outs]
    # One computes the shared prompt; the others wait for it or come later, and reuse it.
    assert sum(c > 0 for c in cached) >= 15, cached
    state = health(server)
    assert state["coalesced_prefills"] > 0
    assert state["routed_by_prefix"] > 0  # the locator found the prefix for the router
    for q, out in zip(QUESTIONS, outs, strict=True):
        assert out.choices[0].model_dump()["token_ids"] == run(hf_ids(tok, chat(q)), 4)


def test_two_salts_never_share_blocks(client) -> None:
    def cached(salt: str) -> int:
        out = client.completions.create(model="chat-model", prompt=SYSTEM + " salted",
                                        max_tokens=1, temperature=0,
                                        extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_stop_string_ends_the_text(client) -> None:
    base = client.completions.create(model="chat-model", prompt="Hello there, stop here",
                                     max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    cut = next(i for i in range(1, len(text)) if text[i:i + 2].strip())
    stop = text[cut:cut + 2]
    out = client.completions.create(model="chat-model", prompt="Hello there, stop here",
                                    max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[:text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_cancels_and_frees(server, client) -> None:
    before = health(server)["decode"]["cancelled"]
    stream = client.completions.create(model="chat-model", prompt="Hello there, go on",
                                       max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while True:
        state = health(server)["decode"]
        if state["cancelled"] > before and state["active_requests"] == 0:
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    # The server goes on serving.
    assert client.completions.create(model="chat-model", prompt="still there?", max_tokens=2,
                                     temperature=0).choices[0].finish_reason


def test_every_error_is_openai_shaped(server, client) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    too_long = "word " * MAX_LEN
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="chat-model", prompt=too_long, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="chat-model", prompt="x", max_tokens=MAX_LEN)
    for bad in ({"temperature": 5}, {"n": 2}, {"top_p": 0.5}, {"logprobs": 2},
                {"max_tokens": 0}, {"stop": [""]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="chat-model", prompt="x",
                                      **{"max_tokens": 1, **bad})
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="chat-model", max_tokens=1,
                                       messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="chat-model", prompt=[10**6], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model="chat-model", prompt="x", max_tokens=1,
                                  stream_options={"include_usage": True})
    # A streamed request that is bad gets its status before any event.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="chat-model", prompt=too_long, max_tokens=1,
                                  stream=True)
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    request = urllib.request.Request(f"{server.url}/v1/completions", data=b"{not json",
                                     headers={"Authorization": f"Bearer {API_KEY}",
                                              "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert "not valid JSON" in json.loads(info.value.read())["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{server.url}/v1/nothing-here", timeout=30)
    assert info.value.code == 404
    error = json.loads(info.value.read())["error"]
    assert error["message"].startswith("Invalid URL (GET /v1/nothing-here)")
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)
    assert health(server)["status"] == "ok"  # nothing above hurt the server


def test_the_start_reported_its_phases(server) -> None:
    """Off a terminal (the log file), one plain line per phase of the start, before the
    ready line."""
    lines = server.log_path.read_text().splitlines()
    ready = next(i for i, ln in enumerate(lines) if ln.startswith("kvstore serve: chat-model"))
    phases = [ln.removeprefix("kvstore: ").rsplit(": ", 1)[0] for ln in lines[:ready]
              if ln.startswith("kvstore: ")]
    assert [p.split(" ")[0] for p in phases] == ["checking", "starting", "starting",
                                                 "starting"], lines[:ready]
    assert phases[1] == "starting a private Ray instance"
    assert not [ln for ln in lines[:ready] if ln.startswith("INFO ")]  # Serve's own chatter
    assert phases[3].startswith("starting Ray Serve: 1 prefill and 1 decode replicas")
