"""Request checks, streamed text with stop strings, and the Serve options the config gives:
everything of the front end that needs no server."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.config_loader import load_config
from kvstore.frontend.detokenize import TextStream
from kvstore.frontend.protocol import APIError, ModelCard, parse_request
from kvstore.workers.model.tokenizer import ByteTokenizer

CARD = ModelCard("tiny", 4096, 512, 0)


def err(endpoint, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(endpoint, body, CARD)
    return info.value


def test_a_good_completion_request_is_taken_as_sent() -> None:
    req = parse_request("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                        "temperature": 0, "seed": 5, "stop": "x",
                                        "cache_salt": "a", "top_k": 4, "stream": True,
                                        "stream_options": {"include_usage": True}}, CARD)
    assert (req.prompt_text, req.max_tokens, req.temperature, req.seed, req.stop,
            req.cache_salt, req.top_k, req.stream, req.include_usage) == \
        ("hi", 3, 0.0, 5, ["x"], "a", 4, True, True)
    assert parse_request("completions", {"model": "tiny", "prompt": [[1, 2]]},
                         CARD).prompt_token_ids == [1, 2]
    assert parse_request("completions", {"model": "tiny", "prompt": "a"}, CARD).max_tokens == 16


def test_chat_messages_and_content_parts() -> None:
    req = parse_request("chat", {"model": "tiny", "max_completion_tokens": 2, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                    "text": "b"}]}]}, CARD)
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "ab"}]
    assert req.max_tokens == 2 and req.temperature == 1.0  # OpenAI's default temperature


@pytest.mark.parametrize("body,param,status", [
    ({"prompt": "x"}, "model", 400),
    ({"model": "gpt-4", "prompt": "x"}, "model", 404),
    ({"model": "tiny"}, "prompt", 400),
    ({"model": "tiny", "prompt": ""}, "prompt", 400),
    ({"model": "tiny", "prompt": ["a", "b"]}, "prompt", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ({"model": "tiny", "prompt": "x", "max_tokens": "3"}, "max_tokens", 400),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature", 400),
    ({"model": "tiny", "prompt": "x", "temperature": float("nan")}, "temperature", 400),
    ({"model": "tiny", "prompt": "x", "n": 3}, "n", 400),
    ({"model": "tiny", "prompt": "x", "top_p": 0.9}, "top_p", 400),
    ({"model": "tiny", "prompt": "x", "logprobs": 1}, "logprobs", 400),
    ({"model": "tiny", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty", 400),
    ({"model": "tiny", "prompt": "x", "stop": ["a"] * 5}, "stop", 400),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream", 400),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", 400),
    ({"model": "tiny", "prompt": "x", "cache_salt": ""}, "cache_salt", 400),
    ({"model": "tiny", "prompt": "x", "top_k": -2}, "top_k", 400),
])
def test_bad_completion_fields_name_the_parameter(body, param, status) -> None:
    e = err("completions", body)
    assert (e.status, e.param) == (status, param)
    assert e.body()["error"]["message"] == e.message and param in e.message


@pytest.mark.parametrize("messages", [None, [], ["hi"], [{"role": "bot", "content": "x"}],
                                      [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "image_url"}]}]])
def test_bad_messages_are_refused(messages) -> None:
    e = err("chat", {"model": "tiny", "messages": messages})
    assert e.status == 400 and e.param.startswith("messages")


def test_not_an_object() -> None:
    assert err("chat", ["model"]).status == 400


def feed(stream: TextStream, text: str) -> str:
    out = "".join(stream.push(b) for b in text.encode())
    return out + stream.flush()


def test_text_streams_whole_characters_and_stops_before_the_stop_string() -> None:
    assert feed(TextStream(ByteTokenizer()), "héllo 🤖") == "héllo 🤖"
    s = TextStream(ByteTokenizer(), ["lo w"])
    pieces = [s.push(b) for b in b"hello world"]
    assert "".join(pieces) == "hel" and s.stopped and s.text == "hel"
    # held back while it could still become the stop string, released when it cannot
    s = TextStream(ByteTokenizer(), ["abc"])
    assert [s.push(b) for b in b"xab"] == ["x", "", ""]
    assert s.push(ord("d")) == "abd" and not s.stopped
    assert feed(TextStream(ByteTokenizer(), ["zz"]), "abz") == "abz"


def test_serve_options_come_from_the_config(tmp_path) -> None:
    from kvstore.frontend.launch import build_app

    path = tmp_path / "kvstore.yaml"
    path.write_text("serve:\n  autoscaling: true\n  min_replicas: 1\n  max_replicas: 3\n"
                    "  target_ongoing_requests: 1.5\n  max_queued_requests: 7\n")
    app = build_app(load_config(path), None)
    nodes = {d.name: d for d in _deployments(app)}
    assert set(nodes) == {"frontend", "prefill", "decode"}
    for name in ("prefill", "decode"):
        cfg = nodes[name]._deployment_config
        assert cfg.autoscaling_config.max_replicas == 3
        assert cfg.autoscaling_config.target_ongoing_requests == 1.5
        assert nodes[name].max_queued_requests == 7
    fixed = {d.name: d for d in _deployments(build_app(load_config(
        None, env={"KVSTORE_SERVE_DECODE_REPLICAS": "2"}), None))}
    assert fixed["decode"].num_replicas == 2 and fixed["prefill"].num_replicas == 1


def _deployments(app) -> list:
    """The deployments an application binds (the ingress and what it was bound to)."""
    node = app._bound_deployment
    return [node] + [arg._bound_deployment for arg in node.init_args
                     if hasattr(arg, "_bound_deployment")]


def test_shared_prefix_and_waiting_for_the_prefill_that_computes_it() -> None:
    from kvstore.frontend.coalesce import InFlightPrefills, shared_prefix

    assert shared_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert shared_prefix([], [1]) == 0 and shared_prefix([5] * 9, [5] * 9) == 9
    order: list[str] = []

    async def main() -> None:
        flights = InFlightPrefills(min_tokens=4)
        first_in = asyncio.Event()

        async def request(name: str, salt: str, tokens: list[int], hold: float) -> None:
            async with flights.turn(name, salt, tokens):
                order.append(f"{name}+")
                first_in.set()
                await asyncio.sleep(hold)
                order.append(f"{name}-")

        lead = asyncio.create_task(request("a", "s", list(range(10)), 0.05))
        await first_in.wait()
        await asyncio.gather(
            request("b", "s", list(range(6)) + [99], 0),  # shares 6 >= 4: waits for a
            request("c", "t", list(range(10)), 0),  # another tenant: never waits
            request("d", "s", [0, 1, 2, 7], 0))  # shares 3 < 4: does not wait
        await lead
        assert flights.waited == 1

    asyncio.run(main())
    assert order.index("b+") > order.index("a-")
    assert order.index("c+") < order.index("a-") and order.index("d+") < order.index("a-")


def test_serve_is_stopped_on_a_shared_cluster_only_when_no_application_is_left() -> None:
    """A Serve left running keeps its HTTP options, so the next `kvstore serve --port P` would
    listen on the old port: ours stops it when it was the last application, never others'."""
    from types import SimpleNamespace

    from kvstore.frontend.launch import _shutdown_serve_if_unused

    class FakeServe:
        def __init__(self, apps: dict) -> None:
            self.apps, self.stopped = apps, False

        def status(self) -> SimpleNamespace:
            return SimpleNamespace(applications=self.apps)

        def shutdown(self) -> None:
            self.stopped = True

    alone, shared = FakeServe({}), FakeServe({"someone-else": object()})
    _shutdown_serve_if_unused(alone)
    _shutdown_serve_if_unused(shared)
    assert alone.stopped and not shared.stopped


def test_replicas_on_the_node_holding_the_prefix_rank_first() -> None:
    from types import SimpleNamespace

    from kvstore.frontend.routing import PrefixAffinityRouter, rank_by_blocks
    from kvstore.frontend.serve_replicas import EngineCall
    from kvstore.workers.model.sampling import SamplingParams

    replicas = [SimpleNamespace(node_id=n, name=f"r-{n}") for n in ("n2", "n1", "n1", "n3")]
    assert [r.name for r in rank_by_blocks(replicas, {"n1": 3, "n2": 1})] == ["r-n1", "r-n1"]
    assert rank_by_blocks(replicas, {"elsewhere": 4}) == []

    class Router(PrefixAffinityRouter):  # Serve's own ranking stubbed: only ours is tested
        def __init__(self) -> None:
            pass

    async def serve_ranks(self, candidates, pending=None):
        return [candidates[:2]]

    PrefixAffinityRouter.__bases__[0].choose_replicas, saved = \
        serve_ranks, PrefixAffinityRouter.__bases__[0].choose_replicas
    try:
        call = EngineCall("r", [1, 2], SamplingParams(), node_blocks={"n3": 2})
        ranks = asyncio.run(Router().choose_replicas(replicas, SimpleNamespace(args=[call])))
        assert [[r.name for r in rank] for rank in ranks] == [["r-n3"], ["r-n2", "r-n1"]]
        call.node_blocks = {}
        ranks = asyncio.run(Router().choose_replicas(replicas, SimpleNamespace(args=[call])))
        assert [[r.name for r in rank] for rank in ranks] == [["r-n2", "r-n1"]]
    finally:
        PrefixAffinityRouter.__bases__[0].choose_replicas = saved
