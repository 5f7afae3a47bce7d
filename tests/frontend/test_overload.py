"""A server on the ``tiny`` preset, unauthenticated, as the README starts it: its examples print
what the README shows, and past its replicas' ongoing and queued limits it answers 503 at once,
in OpenAI's error shape with ``Retry-After``, and goes on serving once the burst has passed."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import subprocess
import urllib.request
from pathlib import Path

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


def _readme_blocks() -> tuple[str, str]:
    """The README's serve example: its curl line and its openai snippet (with its output)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text[text.index("## Serve it over HTTP"):text.index("## From Python")]
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return bash, python


def test_the_readme_examples_do_what_the_readme_says(server, capsys) -> None:
    bash, python = _readme_blocks()
    curl = bash[bash.index("curl"):].replace("\\\n", " ").replace(
        "http://127.0.0.1:8000", server.url)
    reply = subprocess.run(["bash", "-c", curl.strip()], capture_output=True, text=True,
                           timeout=120, check=True)
    body = json.loads(reply.stdout)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
    code = python.replace("http://127.0.0.1:8000", server.url)
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - the README's own example
    printed = capsys.readouterr().out.split()
    shown = " ".join(line.lstrip("# ") for line in code.splitlines()
                     if line.startswith("# ")).split()
    assert printed == shown
