"""The OpenAI request bodies kvstore serves, checked into one ``GenerationRequest``.

``/v1/completions`` and ``/v1/chat/completions`` bodies are plain JSON objects; every field is
checked here, before any replica sees the request, and a bad one is an ``APIError`` in OpenAI's
error shape with a 4xx status and a message that names the parameter and says what to fix.
Fields kvstore cannot honour exactly (``n > 1``, ``logprobs``, ``top_p < 1``, penalties) are
refused rather than silently ignored: a client that asked for them would get other outputs than
it expects. Unknown fields are ignored, as vLLM does by default.

Extensions (vLLM's names where vLLM has one): ``cache_salt`` (the tenant namespace),
``top_k``, ``ignore_eos``, ``return_token_ids``, and ``bypass_cache`` (the ``--no-cache``
reference through the API: the store is neither read nor written).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["completions", "chat"]

#: Roles a chat message may have.
ROLES = ("system", "user", "assistant")


class APIError(Exception):
    """An error the client caused (or overload), in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the front end knows of the served model without loading its weights."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int


@dataclass(slots=True)
class GenerationRequest:
    """One checked request: the prompt in its raw form, and how to generate."""

    endpoint: Endpoint
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    bypass_cache: bool = False


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise _bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise _bad(f"'{name}' must be {bound}, got {value}", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _unsupported(body: dict[str, Any]) -> None:
    """Refuse what would change the output in a way kvstore does not implement."""
    n = body.get("n")
    if n not in (None, 1):
        raise _bad(f"'n' must be 1 (one choice per request), got {n!r}", "n")
    if body.get("best_of") not in (None, 1):
        raise _bad("'best_of' must be 1", "best_of")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools",
                 "functions", "response_format"):
        value = body.get(name)
        if value not in (None, False, {}, []) and not (name == "response_format"
                                                      and value == {"type": "text"}):
            raise _bad(f"'{name}' is not supported by this server; leave it out", name)
    top_p = body.get("top_p")
    if top_p is not None and top_p != 1:
        raise _bad(f"'top_p' must be 1 (nucleus sampling is not implemented; use top_k), "
                   f"got {top_p!r}", "top_p")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0) and not (name == "repetition_penalty" and value == 1):
            raise _bad(f"'{name}' is not supported; leave it out or set it to its neutral "
                       "value", name)


def _stop(body: dict[str, Any], limit: int) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > limit:
        raise _bad(f"'stop' takes at most {limit} sequences, got {len(stop)}", "stop")
    return list(stop)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad(f"{where} must be an object with 'role' and 'content'", where)
        role, content = msg.get("role"), msg.get("content")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise _bad(f"{where}.role must be one of {list(ROLES)}, got {role!r}", where)
        if isinstance(content, list):  # content parts: text only
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content parts must be {{'type': 'text', 'text': ...}}; "
                               "this server takes text only", where)
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"{where}.content must be a string", where)
        out.append({"role": str(role), "content": content})
    return out


def _prompt(value: Any, req: GenerationRequest) -> None:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise _bad("'prompt' is empty; give at least one character", "prompt")
        req.prompt_text = value
    elif isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        req.prompt_token_ids = list(value)
    elif isinstance(value, list) and value:
        raise _bad("'prompt' must be one string or one list of token ids; send one request "
                   "per prompt", "prompt")
    else:
        raise _bad("'prompt' is required: a string or a list of token ids", "prompt")


def parse_request(endpoint: Endpoint, body: Any, card: ModelCard,
                  max_stop_sequences: int = 4) -> GenerationRequest:
    """Check a request body; raise ``APIError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise _bad(f"'model' is required; this server serves {card.name!r}", "model")
    if model != card.name:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"'{card.name}' (GET /v1/models)", param="model",
                       code="model_not_found")
    _unsupported(body)
    req = GenerationRequest(endpoint=endpoint)
    if endpoint == "chat":
        req.messages = _messages(body.get("messages"))
        req.max_tokens = _integer(body, "max_completion_tokens", 1)
        if req.max_tokens is None:
            req.max_tokens = _integer(body, "max_tokens", 1)
    else:
        _prompt(body.get("prompt"), req)
        req.max_tokens = _integer(body, "max_tokens", 1)
        if req.max_tokens is None:
            req.max_tokens = 16  # OpenAI's documented default for completions
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_k = _integer(body, "top_k", -1)
    req.top_k = 0 if top_k in (None, -1) else top_k
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    req.seed = secrets.randbits(31) if seed is None else seed
    req.stop = _stop(body, max_stop_sequences)
    req.stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not req.stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        req.include_usage = _flag(options, "include_usage")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise _bad("'cache_salt' must be a non-empty string of at most 256 characters",
                   "cache_salt")
    req.cache_salt = salt
    req.ignore_eos = _flag(body, "ignore_eos")
    req.return_token_ids = _flag(body, "return_token_ids")
    req.bypass_cache = _flag(body, "bypass_cache")
    return req
