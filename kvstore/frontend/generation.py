"""One request through the replicas: prompt to tokens, prefill, decode stream, text.

The front end tokenizes (and renders chat messages with the checkpoint's template), checks the
prompt against the model's context, sends the prompt to a prefill replica (which reuses what the
store holds and publishes the rest) and streams the remaining tokens from a decode replica
(which fetches the published blocks). ``bypass_cache`` generates on a decode replica with the
store neither read nor written: the ``--no-cache`` reference, through the same API.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from kvstore.errors import ConfigError, RequestCancelled
from kvstore.frontend.coalesce import InFlightPrefills
from kvstore.frontend.detokenize import TextStream
from kvstore.frontend.protocol import APIError, GenerationRequest, ModelCard
from kvstore.frontend.responses import Usage
from kvstore.frontend.serve_replicas import EngineCall
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.model.tokenizer import Tokenizer


@dataclass(slots=True)
class Piece:
    """New text and the tokens it came from; ``finish_reason`` on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    ttft_s: float | None = None  # on the first piece


@dataclass(slots=True)
class Prepared:
    """A checked request, tokenized, with its sampling settings."""

    request_id: str
    prompt_ids: list[int]
    call: EngineCall
    max_tokens: int
    stop_ids: tuple[int, ...]
    usage: Usage = field(default_factory=Usage)
    arrived: float = field(default_factory=time.perf_counter)


def _overloaded(exc: BaseException) -> APIError:
    return APIError(503, f"the server is overloaded ({type(exc).__name__}); retry later",
                    type="server_error", code="overloaded")


def replica_error(exc: BaseException) -> APIError:
    """A replica's failure as the client should see it."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(exc, (BackPressureError, DeploymentUnavailableError)):
        return _overloaded(exc)
    if isinstance(cause, ConfigError):
        return APIError(400, str(cause))
    if isinstance(cause, RequestCancelled):
        return APIError(504, str(cause), type="server_error", code="timeout")
    return APIError(500, f"the request failed on a replica: {type(cause).__name__}: {cause}",
                    type="server_error")


class Generator:
    """Turns checked requests into streams of ``Piece`` over the two deployments."""

    def __init__(self, card: ModelCard, tokenizer: Tokenizer, prefill: Any, decode: Any,
                 eos_ids: tuple[int, ...], default_max_tokens: int,
                 coalesce_tokens: int = 256, locator: Any = None) -> None:
        self.card = card
        self.locator = locator  # kvstore.frontend.routing.PrefixLocator, or None: Serve's routing
        self.prefills = InFlightPrefills(coalesce_tokens)
        self.tokenizer = tokenizer
        self.prefill = prefill
        self.decode = decode
        self.eos_ids = eos_ids
        self.default_max_tokens = default_max_tokens

    def prepare(self, req: GenerationRequest) -> Prepared:
        """Tokenize and check against the model; ``APIError`` on anything to fix."""
        try:
            if req.messages is not None:
                ids = self.tokenizer.apply_chat_template(req.messages)
            elif req.prompt_text is not None:
                ids = self.tokenizer.encode(req.prompt_text)
            else:
                ids = list(req.prompt_token_ids or [])
        except ConfigError as exc:
            raise APIError(400, str(exc), param="messages" if req.messages else "prompt") \
                from None
        bad = [t for t in ids if not 0 <= t < self.card.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the model's vocabulary "
                           f"[0, {self.card.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param="prompt")
        room = self.card.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context "
                           f"length is {self.card.max_model_len}. Shorten the prompt.",
                           param="messages" if req.messages else "prompt",
                           code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None \
            else min(self.default_max_tokens, room)
        if max_tokens > room:
            raise APIError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) "
                           f"exceeds this model's context length {self.card.max_model_len}; "
                           f"ask for at most {room} tokens", param="max_tokens",
                           code="context_length_exceeded")
        prefix = "chatcmpl" if req.endpoint == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stop_ids = () if req.ignore_eos else self.eos_ids
        sampling = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature,
                                  top_k=req.top_k, sampling_seed=req.seed % (2**31),
                                  stop_token_ids=stop_ids)
        call = EngineCall(request_id, ids, sampling, req.cache_salt, not req.bypass_cache)
        prepared = Prepared(request_id, ids, call, max_tokens, stop_ids)
        prepared.usage.prompt_tokens = len(ids)
        return prepared

    async def run(self, p: Prepared, stop: list[str]) -> AsyncGenerator[Piece, None]:
        """The request's text as it is generated; the last piece has the finish reason.

        Every failure is an ``APIError``: before the first piece an HTTP status can still be
        sent; after it (the decode deployment refused the request, a replica died) a
        non-streaming request still gets the status and a stream ends with an error event.
        Closing this iterator early cancels the request on its replica.
        """
        text = TextStream(self.tokenizer, stop)
        count = 0
        stream = None
        first_seen = False
        finished = False  # the decode stream ran to its end, or failed: nothing to cancel
        try:
            if p.call.use_cache:
                if self.locator is not None:
                    p.call.node_blocks = await self.locator.locate(p.call.cache_salt,
                                                                   p.prompt_ids)
                try:
                    async with self.prefills.turn(p.request_id, p.call.cache_salt,
                                                  p.prompt_ids):
                        pre = await self.prefill.prefill.remote(p.call)
                except Exception as exc:  # noqa: BLE001 - mapped to a status for the client
                    raise replica_error(exc) from None
                p.usage.cached_tokens = pre.cached_tokens
                tokens = [pre.first_token]
                stream = self.decode.options(stream=True).stream.remote(
                    p.call, pre.first_token, pre.tail, pre.num_prefix_blocks) \
                    if p.max_tokens > 1 and pre.first_token not in p.stop_ids else None
            else:
                tokens = []
                stream = self.decode.options(stream=True).stream.remote(p.call, None, None)
            source = _tokens(tokens, stream)
            async for batch in source:
                pieces: list[int] = []
                delta = ""
                reason = None
                for tok in batch:
                    count += 1
                    pieces.append(tok)
                    delta += text.push(tok)
                    if text.stopped or tok in p.stop_ids:
                        reason = "stop"
                    elif count >= p.max_tokens:
                        reason = "length"
                    if reason:
                        break
                p.usage.completion_tokens = count
                ttft = None if first_seen else time.perf_counter() - p.arrived
                first_seen = True
                if reason:
                    finished = not text.stopped  # EOS and max_tokens end the engine too
                    yield Piece(delta + text.flush(), pieces, reason, ttft)
                    return
                yield Piece(delta, pieces, None, ttft)
            p.usage.completion_tokens = count
            finished = True
            yield Piece(text.flush(), [], "stop" if count < p.max_tokens else "length",
                        None if first_seen else time.perf_counter() - p.arrived)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a status for the client, before or mid-stream
            finished = True
            raise replica_error(exc) from None
        finally:
            if stream is not None and not finished:
                # The caller stopped early (stop string, disconnect): stop the engine, free
                # the KV. Serve's cancel re-raises a refused assignment (BackPressureError),
                # which was already answered above: never let it replace that answer.
                with contextlib.suppress(Exception):
                    stream.cancel()


async def _tokens(first: list[int], stream: Any) -> AsyncIterator[list[int]]:
    """The prefill's first token, then each batch the decode stream yields."""
    if first:
        yield first
    if stream is None:
        return
    async for message in stream:
        if "token_ids" in message:
            yield message["token_ids"]
