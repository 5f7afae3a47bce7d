"""Prometheus series of the HTTP front end, served at its ``/metrics``.

A registry of its own (not ``kvstore.metrics.REGISTRY``): the front end runs in its own Serve
replica process, and a store node's scrape must not show series it never records. With several
front-end replicas each serves its own; Prometheus sums them. docs/metrics.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

#: How a request ended: ok, bad_request (4xx), unauthorized, overloaded (503), cancelled
#: (client gone), error (5xx: a bug or a replica that died).
STATUSES = ("ok", "bad_request", "unauthorized", "not_found", "overloaded", "cancelled",
            "error")
ENDPOINTS = ("completions", "chat")

REQUESTS = Counter("kvstore_serve_requests", "HTTP generation requests by endpoint and outcome",
                   ["endpoint", "status"], registry=REGISTRY)
IN_FLIGHT = Gauge("kvstore_serve_requests_in_flight", "Generation requests being served now",
                  registry=REGISTRY)
TTFT = Histogram("kvstore_serve_ttft_seconds",
                 "Time from a request's arrival to its first token, by whether the store "
                 "served part of its prompt", ["cached"],
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
                 registry=REGISTRY)
PROMPT_TOKENS = Counter("kvstore_serve_prompt_tokens", "Prompt tokens of served requests",
                        registry=REGISTRY)
CACHED_TOKENS = Counter("kvstore_serve_cached_tokens",
                        "Prompt tokens whose KV came from the store (usage.prompt_tokens_details"
                        ".cached_tokens)", registry=REGISTRY)
COMPLETION_TOKENS = Counter("kvstore_serve_completion_tokens", "Tokens generated",
                            registry=REGISTRY)
HIT_RATE = Gauge("kvstore_serve_cache_hit_rate",
                 "Cached prompt tokens / prompt tokens since this front end started",
                 registry=REGISTRY)

_totals = {"prompt": 0, "cached": 0}


def record_request(endpoint: str, status: str) -> None:
    if endpoint not in ENDPOINTS or status not in STATUSES:
        raise ValueError(f"unknown metric label {endpoint!r}/{status!r}")
    REQUESTS.labels(endpoint, status).inc()


def record_usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int,
                 ttft_s: float | None) -> None:
    """One finished (or cancelled after its first token) request's token counts."""
    PROMPT_TOKENS.inc(prompt_tokens)
    CACHED_TOKENS.inc(cached_tokens)
    COMPLETION_TOKENS.inc(completion_tokens)
    _totals["prompt"] += prompt_tokens
    _totals["cached"] += cached_tokens
    if _totals["prompt"]:
        HIT_RATE.set(_totals["cached"] / _totals["prompt"])
    if ttft_s is not None:
        TTFT.labels("yes" if cached_tokens else "no").observe(ttft_s)
