"""OpenAI response bodies and server-sent-event chunks, built from one request's outcome.

The shapes follow OpenAI's API reference for ``text_completion``, ``chat.completion`` and
``chat.completion.chunk``; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt
tokens whose KV came from the store. ``return_token_ids`` adds vLLM's ``prompt_token_ids`` and
``token_ids`` to the choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvstore.frontend.protocol import GenerationRequest


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(slots=True)
class Outcome:
    """Everything a non-streaming response needs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event (``data: ...`` and a blank line)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ResponseBuilder:
    """Bodies and chunks of one request, with its id, creation time and model name."""

    def __init__(self, req: GenerationRequest, request_id: str, model: str, created: int) -> None:
        self.req = req
        self.id = request_id
        self.model = model
        self.created = created
        self.chat = req.endpoint == "chat"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ids(self, choice: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = outcome.prompt_token_ids
            choice["token_ids"] = outcome.token_ids
        return choice

    def final(self, outcome: Outcome) -> dict[str, Any]:
        """The whole response of a non-streaming request."""
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": outcome.text},
                                      "logprobs": None, "finish_reason": outcome.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": outcome.text, "logprobs": None,
                      "finish_reason": outcome.finish_reason}
            body = self._head("text_completion")
        body["choices"] = [self._ids(choice, outcome)]
        body["usage"] = outcome.usage.body()
        return body

    def chunk(self, text: str, token_ids: list[int], finish_reason: str | None = None,
              *, first: bool = False, prompt_token_ids: list[int] | None = None
              ) -> dict[str, Any]:
        """One streamed piece: new text (and, with ``return_token_ids``, its token ids)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else ({"content": text} if text or finish_reason is None else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._head("text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
            if prompt_token_ids is not None:
                choice["prompt_token_ids"] = prompt_token_ids
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` asked for it: no choices."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage.body()
        return body
