"""The OpenAI-compatible HTTP front end: a Ray Serve ingress deployment (FastAPI).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health`` (asks one prefill and one decode
replica), ``GET /metrics`` (Prometheus). With ``serve.api_key`` set, ``/v1/*`` needs
``Authorization: Bearer KEY``. Every client error is OpenAI's ``{"error": {...}}`` with a 4xx
status, a path or method no route serves included (FastAPI's own would be ``{"detail": ...}``);
a streamed request reports its status before the first byte is sent (the first token is computed
first), and a failure after that ends the stream with an error event, never a hang.
"""

# No `from __future__ import annotations`: FastAPI reads the route parameters' types at runtime.

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.exceptions import HTTPException

from kvstore.config import KVStoreConfig
from kvstore.frontend import metrics
from kvstore.frontend.generation import Generator, Piece, Prepared
from kvstore.frontend.protocol import APIError, Endpoint, ModelCard, parse_request
from kvstore.frontend.responses import Outcome, ResponseBuilder, sse
from kvstore.frontend.routing import PrefixLocator
from kvstore.workers.model.tokenizer import tokenizer_for

log = logging.getLogger(__name__)
api = FastAPI(title="kvstore", docs_url=None, redoc_url=None)

#: Seconds /health waits for a replica's answer.
HEALTH_TIMEOUT_S = 10.0


def error_response(exc: APIError) -> JSONResponse:
    # A 503 says when to come back; the openai client honours Retry-After on its retries.
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


#: The routes, as the error for an unknown path lists them.
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
          "GET /metrics")


@api.exception_handler(HTTPException)
async def unrouted(request: Request, exc: HTTPException) -> JSONResponse:
    """An error FastAPI raises itself, a path or method no route serves (404, 405) above all,
    answered in OpenAI's shape as OpenAI answers it."""
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        message = (f"Invalid URL ({request.method} {request.url.path}): this server answers "
                   f"{', '.join(ROUTES)}")
    response = error_response(APIError(exc.status_code, message))
    response.headers.update(exc.headers or {})  # 405's Allow
    return response


def _status_label(status: int) -> str:
    return {401: "unauthorized", 404: "not_found", 503: "overloaded"}.get(
        status, "bad_request" if status < 500 else "error")


@serve.deployment(name="frontend", ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=1000)
@serve.ingress(api)
class OpenAIServer:
    """Checks requests, tokenizes, and drives the prefill and decode deployments."""

    def __init__(self, card: ModelCard, config: KVStoreConfig, tokenizer_path: str | None,
                 eos_ids: tuple[int, ...], prefill: Any, decode: Any) -> None:
        self.card = card
        self.serve_config = config.serve
        self.api_key = config.serve.api_key
        self.tokenizer = tokenizer_for(config.worker.model, tokenizer_path)
        # A shared prefix of at least one prefill chunk is worth waiting for.
        self.generator = Generator(card, self.tokenizer, prefill, decode, eos_ids,
                                   config.serve.default_max_tokens,
                                   config.worker.prefill_chunk_tokens,
                                   PrefixLocator(config, prefill))
        self.prefill = prefill
        self.decode = decode

    def _authorize(self, request: Request) -> None:
        if not self.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer "
                           "KEY' with the key this server was started with",
                           code="invalid_api_key")

    @api.get("/health")
    async def health(self) -> JSONResponse:
        try:
            prefill, decode = await asyncio.wait_for(asyncio.gather(
                self.prefill.stats.remote(), self.decode.stats.remote()), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - unhealthy, and why
            return JSONResponse({"status": "unavailable", "reason": f"{type(exc).__name__}: "
                                 f"{exc}"[:500]}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.card.name, "prefill": prefill,
                             "decode": decode,
                             "coalesced_prefills": self.generator.prefills.waited,
                             "routed_by_prefix": self.generator.locator.located})

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except APIError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [{
            "id": self.card.name, "object": "model", "created": self.card.created,
            "owned_by": "kvstore", "max_model_len": self.card.max_model_len}]})

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, endpoint: Endpoint) -> Response:
        metrics.IN_FLIGHT.inc()
        status = "error"
        streaming = False
        try:
            self._authorize(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise APIError(400, f"the request body is not valid JSON: {exc}") from None
            req = parse_request(endpoint, body, self.card, self.serve_config.max_stop_sequences)
            prepared = self.generator.prepare(req)
            builder = ResponseBuilder(req, prepared.request_id, self.card.name,
                                      int(time.time()))
            pieces = self.generator.run(prepared, req.stop)
            first = await anext(pieces)  # errors here still get their HTTP status
            if req.stream:
                streaming = True
                return StreamingResponse(self._events(endpoint, builder, prepared, first,
                                                      pieces),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Request-Id": prepared.request_id})
            outcome = await self._collect(prepared, first, pieces)
            status = "ok"
            return JSONResponse(builder.final(outcome))
        except APIError as exc:
            status = _status_label(exc.status)
            return error_response(exc)
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            if not streaming:
                metrics.IN_FLIGHT.dec()
                metrics.record_request(endpoint, status)

    async def _collect(self, p: Prepared, first: Piece, pieces: AsyncGenerator[Piece, None]
                       ) -> Outcome:
        out = Outcome(prompt_token_ids=p.prompt_ids)
        ttft = first.ttft_s
        piece: Piece | None = first
        try:
            while piece is not None:
                out.text += piece.text
                out.token_ids += piece.token_ids
                out.finish_reason = piece.finish_reason or out.finish_reason
                piece = None if piece.finish_reason else await anext(pieces, None)
        finally:
            await pieces.aclose()
        out.usage = p.usage
        metrics.record_usage(p.usage.prompt_tokens, p.usage.cached_tokens,
                             p.usage.completion_tokens, ttft)
        return out

    async def _events(self, endpoint: Endpoint, builder: ResponseBuilder, p: Prepared,
                      first: Piece, pieces: AsyncGenerator[Piece, None]
                      ) -> AsyncIterator[bytes]:
        """The SSE body; a disconnect cancels this generator, and with it the request."""
        status = "cancelled"
        try:
            if builder.chat:  # the role first, as OpenAI sends it
                yield sse(builder.chunk("", [], first=True))
            piece: Piece | None = first
            sent_prompt = False
            while piece is not None:
                if piece.text or piece.finish_reason or (piece.token_ids
                                                          and builder.req.return_token_ids):
                    yield sse(builder.chunk(piece.text, piece.token_ids, piece.finish_reason,
                                            prompt_token_ids=None if sent_prompt
                                            else p.prompt_ids))
                    sent_prompt = True
                piece = None if piece.finish_reason else await anext(pieces, None)
            if builder.req.include_usage:
                yield sse(builder.usage_chunk(p.usage))
            yield sse("[DONE]")
            status = "ok"
        except APIError as exc:
            status = _status_label(exc.status)
            yield sse(exc.body())
            yield sse("[DONE]")
        except Exception as exc:  # noqa: BLE001 - a replica died mid-stream: say so, end
            status = "error"
            log.exception("stream %s failed", p.request_id)
            yield sse(APIError(500, f"generation failed: {type(exc).__name__}: {exc}",
                               type="server_error").body())
            yield sse("[DONE]")
        finally:
            await pieces.aclose()
            metrics.record_usage(p.usage.prompt_tokens, p.usage.cached_tokens,
                                 p.usage.completion_tokens, first.ttft_s)
            metrics.IN_FLIGHT.dec()
            metrics.record_request(endpoint, status)
