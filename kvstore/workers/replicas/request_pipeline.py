"""Keeps several requests in flight over a deployment's replicas; results come in input order.

    request i    [prefill on prefill-a] --> [decode on decode-b]
    request i+1        [prefill on prefill-c] --> [decode on decode-d]
    request i+2                  [prefill on prefill-a] --> [decode on decode-b] ...

Each stage picks its replica with a ``Router`` (most cached prefix on the replica's node, then
least load) among the replicas with fewer than ``max_in_flight`` requests, so the prefill of
the next request overlaps the decode of the previous one and every replica has work. A replica
runs one model forward at a time (``Engine``), so a second request there overlaps only its
fetches and setup with the first one's compute. A prompt whose first uncached block another
in-flight prefill is computing waits for that prefill, so a shared prefix is still computed
once when its requests arrive together (and the outputs stay those of a sequential run).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvstore.api import PrefixHit
from kvstore.keys import BlockKey
from kvstore.workers.engine.results import DecodeResult, PrefillResult
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.router import Router

#: ``reference`` is ``generate --no-cache``: each prompt computed once, on a decode replica.
JobKind = Literal["prefill", "decode", "generate", "reference"]

#: How far down the queue the pipeline looks for a prefill to start when the head must wait.
LOOKAHEAD = 8


@dataclass(slots=True)
class RequestOutput:
    """One finished request, as jobs print it."""

    id: str
    output_token_ids: list[int]
    cached_tokens: int
    num_prompt_tokens: int
    ttft_s: float
    bytes_fetched: int
    sources: dict[str, int]
    decode_tokens_per_s: float
    prefill_replica: str = ""
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    unreused_shared_tokens: int = 0
    resume: str = ""  # where the prefill may resume from cached blocks: "block" or "chunk"
    decode_replica: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "output_token_ids": self.output_token_ids,
            "cached_tokens": self.cached_tokens, "num_prompt_tokens": self.num_prompt_tokens,
            "ttft_s": round(self.ttft_s, 6), "bytes_fetched": self.bytes_fetched,
            "sources": self.sources, "prefill_replica": self.prefill_replica,
            "decode_replica": self.decode_replica,
            "unreused_shared_tokens": self.unreused_shared_tokens,
        }
        if self.resume:
            out["resume"] = self.resume
        if self.text is not None:
            out["text"] = self.text
        return out


class Calls(Protocol):
    """How replica methods are called: now (in-process) or as Ray futures."""

    def submit(self, replica: Any, method: str, *args: Any) -> Any: ...

    def wait(self, futures: list[Any]) -> list[Any]: ...

    def result(self, future: Any) -> Any: ...


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity, like an ObjectRef
class _Done:
    value: Any


class InlineCalls:
    """In-process replicas: a call runs at once in this thread; its errors raise at once."""

    def submit(self, replica: Any, method: str, *args: Any) -> Any:
        return _Done(getattr(replica, method)(*args))

    def wait(self, futures: list[Any]) -> list[Any]:
        return futures

    def result(self, future: Any) -> Any:
        return future.value


class RayCalls:
    """Actor replicas: ``.remote()`` futures, waited for with ``ray.wait``."""

    def submit(self, replica: Any, method: str, *args: Any) -> Any:
        return getattr(replica, method).remote(*args)

    def wait(self, futures: list[Any]) -> list[Any]:
        import ray

        ready, _ = ray.wait(futures, num_returns=1)
        return list(ready)

    def result(self, future: Any) -> Any:
        import ray

        return ray.get(future)


@dataclass(slots=True)
class _Request:
    index: int
    request_id: str
    token_ids: list[int]
    busy_keys: list[BlockKey] = field(default_factory=list)  # blocks its prefill computes
    prefill: PrefillResult | None = None
    prefill_replica: str = ""


class RequestPipeline:
    """Runs a job's requests through prefill and decode replicas, several at a time."""

    def __init__(self, calls: Calls, prefills: Sequence[Any], decodes: Sequence[Any],
                 prefill_router: Router, decode_router: Router, max_in_flight: int,
                 resume: str) -> None:
        self.calls = calls
        self.prefills, self.decodes = list(prefills), list(decodes)
        self.prefill_router, self.decode_router = prefill_router, decode_router
        self.max_in_flight = max_in_flight
        self.resume = resume

    def run(self, kind: JobKind, requests: Sequence[tuple[str, Sequence[int]]],
            sampling: SamplingParams, on_done: Callable[[], None] | None = None
            ) -> list[RequestOutput]:
        """Every request of the job; the outputs in the order of ``requests``."""
        reqs = [_Request(i, rid, list(ids)) for i, (rid, ids) in enumerate(requests)]
        outputs: list[RequestOutput | None] = [None] * len(reqs)
        prefill_first = kind in ("prefill", "generate")
        waiting: deque[_Request] = deque(reqs if prefill_first else [])
        to_decode: deque[_Request] = deque([] if prefill_first else reqs)
        pending: dict[Any, tuple[str, _Request, int]] = {}
        busy: Counter[BlockKey] = Counter()
        while waiting or to_decode or pending:
            self._start_decodes(kind, to_decode, pending, sampling)
            # Prefill runs ahead of decode by one round of decode slots at most: finished
            # prefills wait here holding their tails, so the queue must stay short.
            if len(to_decode) < self.max_in_flight * len(self.decodes):
                self._start_prefills(waiting, pending, busy, sampling)
            if not pending:
                raise RuntimeError("request pipeline stalled with requests left")  # cannot happen
            for future in self.calls.wait(list(pending)):
                stage, req, replica = pending.pop(future)
                result = self.calls.result(future)
                if stage == "prefill":
                    self.prefill_router.done(replica)
                    busy.subtract(req.busy_keys)
                    req.prefill = result
                    req.prefill_replica = self.prefill_router.replicas[replica].name
                    if kind == "generate" and sampling.max_new_tokens > 0:
                        to_decode.append(req)
                        continue
                    outputs[req.index] = self._prefill_output(req, result, sampling)
                else:
                    self.decode_router.done(replica)
                    outputs[req.index] = self._decode_output(kind, req, result, replica)
                if on_done is not None:
                    on_done()
        assert all(o is not None for o in outputs)
        return [o for o in outputs if o is not None]

    def _start_prefills(self, waiting: deque[_Request], pending: dict[Any, Any],
                        busy: Counter[BlockKey], sampling: SamplingParams) -> None:
        for req in list(waiting)[:LOOKAHEAD]:
            if not self.prefill_router.has_room(self.max_in_flight):
                return  # every prefill replica is full: no index lookup for nothing
            keys, hit = self.prefill_router.lookup(req.token_ids)
            first_uncached = hit.num_blocks
            if first_uncached < len(keys) and busy[keys[first_uncached]] > 0:
                continue  # another prefill is computing this prefix: reuse it, do not race it
            replica = self.prefill_router.choose(req.token_ids, hit=hit,
                                                 max_in_flight=self.max_in_flight)
            assert replica is not None  # has_room said so, and only this thread chooses
            waiting.remove(req)
            req.busy_keys = keys[first_uncached:]
            busy.update(req.busy_keys)
            future = self.calls.submit(self.prefills[replica], "prefill", req.token_ids,
                                       f"{req.request_id}-{req.index}-p", sampling, True)
            pending[future] = ("prefill", req, replica)

    def _start_decodes(self, kind: JobKind, to_decode: deque[_Request],
                       pending: dict[Any, Any], sampling: SamplingParams) -> None:
        while to_decode:
            req = to_decode[0]
            # The reference run reads no blocks: no index lookup, pick by load alone.
            hit = PrefixHit(0, []) if kind == "reference" else None
            replica = self.decode_router.choose(req.token_ids, hit=hit,
                                                max_in_flight=self.max_in_flight)
            if replica is None:
                return  # every decode replica is full
            to_decode.popleft()
            handle, rid = self.decodes[replica], f"{req.request_id}-{req.index}-d"
            if kind == "reference":
                future = self.calls.submit(handle, "generate", req.token_ids, rid, sampling,
                                           False)
            else:
                pre = req.prefill
                future = self.calls.submit(handle, "decode", req.token_ids,
                                           pre.first_token if pre else None, rid,
                                           pre.tail if pre else None, sampling, True)
            pending[future] = ("decode", req, replica)

    def _prefill_output(self, req: _Request, pre: PrefillResult,
                        sampling: SamplingParams) -> RequestOutput:
        """A prefill job's request, or a warm-up (``max_new_tokens == 0``) of generate."""
        return RequestOutput(
            req.request_id, [pre.first_token] if sampling.max_new_tokens else [],
            pre.cached_tokens, pre.num_prompt_tokens, pre.ttft_s, pre.bytes_fetched,
            pre.sources, 0.0, req.prefill_replica,
            unreused_shared_tokens=pre.unreused_shared_tokens, resume=self.resume)

    def _decode_output(self, kind: JobKind, req: _Request, result: Any,
                       replica: int) -> RequestOutput:
        name = self.decode_router.replicas[replica].name
        if kind == "decode":
            dec: DecodeResult = result
            return RequestOutput(req.request_id, dec.output_token_ids, dec.fetched_tokens,
                                 len(req.token_ids), dec.timings["setup_s"], dec.bytes_fetched,
                                 dec.sources, dec.decode_tokens_per_s, decode_replica=name)
        if kind == "reference":
            pre, dec = result  # computed once, here: the prefill half gives the TTFT
            prefill_replica = name
        else:
            pre, dec, prefill_replica = req.prefill, result, req.prefill_replica
        assert pre is not None
        return RequestOutput(
            id=req.request_id, output_token_ids=dec.output_token_ids,
            cached_tokens=pre.cached_tokens, num_prompt_tokens=pre.num_prompt_tokens,
            ttft_s=pre.ttft_s, bytes_fetched=pre.bytes_fetched + dec.bytes_fetched,
            sources=_merge(pre.sources, dec.sources),
            decode_tokens_per_s=dec.decode_tokens_per_s, prefill_replica=prefill_replica,
            unreused_shared_tokens=pre.unreused_shared_tokens, resume=self.resume,
            decode_replica=name)


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
