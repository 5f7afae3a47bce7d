"""The HTTP front end's answers that need no replica: a path or method no route serves.

Driven through the FastAPI application's ASGI interface directly (no Ray, no Serve, no HTTP
client library): the same application Serve's proxy hands every request to.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvstore.frontend.app import ROUTES, api


def call(method: str, path: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """``(status, headers, JSON body)`` of one request to the application."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(api(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body)


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing-here", 404),
    ("POST", "/v2/completions", 404),
    ("GET", "/v1/completions", 405),  # a route, but POST only
])
def test_an_unserved_path_or_method_answers_in_openais_shape(method: str, path: str,
                                                             status: int) -> None:
    got, headers, body = call(method, path)
    assert got == status
    assert body == {"error": {
        "message": f"Invalid URL ({method} {path}): this server answers {', '.join(ROUTES)}",
        "type": "invalid_request_error", "param": None, "code": None}}
    if status == 405:
        assert headers.get("allow") == "POST"
