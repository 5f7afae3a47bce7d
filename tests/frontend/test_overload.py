"""Overload: past its replicas' ongoing and queued limits the server answers 503 at once, in
OpenAI's error shape with ``Retry-After``, and goes on serving once the burst has passed."""

from __future__ import annotations

import asyncio
import collections
import json
import urllib.request

import openai
import pytest

from tests.support.serve_process import start_serve

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("overload")
    (work / "kvstore.yaml").write_text("pool:\n  capacity_bytes: 32MiB\n"
                                       "serve:\n  max_ongoing_requests: 1\n"
                                       "  max_queued_requests: 2\n")
    proc = start_serve(["--model", "tiny", "--threads", "1", "--config",
                        str(work / "kvstore.yaml")], work)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_a_burst_past_the_limits_gets_503_and_the_rest_is_served(server) -> None:
    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                    max_retries=0, timeout=120)

        async def one(i: int) -> str:
            try:
                # Long enough that the burst overlaps at the decode replica too.
                await client.completions.create(model="tiny", prompt=f"request {i} " * 8,
                                                max_tokens=120, temperature=0,
                                                extra_body={"ignore_eos": True})
                return "ok"
            except openai.APIStatusError as exc:
                assert exc.response.headers.get("retry-after") == "1"
                assert isinstance(exc.body, dict) and exc.body.get("code") == "overloaded", \
                    exc.body
                return str(exc.status_code)

        try:
            return await asyncio.gather(*[one(i) for i in range(12)])
        finally:
            await client.close()

    outcomes = collections.Counter(asyncio.run(burst()))
    assert set(outcomes) == {"ok", "503"}, outcomes
    assert outcomes["ok"] >= 3  # one computing and two queued per deployment got through
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    assert (f'kvstore_serve_requests_total{{endpoint="completions",status="overloaded"}} '
            f'{float(outcomes["503"])}') in text
    assert "kvstore_serve_requests_in_flight 0.0" in text
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model="tiny", prompt="after the burst", max_tokens=2,
                                     temperature=0).usage.completion_tokens == 2
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as reply:
        assert json.loads(reply.read())["status"] == "ok"
