"""The engines ``kvstore serve`` can put behind its front end, and what their replicas ask of Ray.

The front end (``app``, ``generation``, ``routing``) drives two Serve deployments through a small
interface, whoever computes behind it:

- prefill: ``prefill(EngineCall)`` returns an object with ``first_token``, ``cached_tokens``,
  ``num_prefix_blocks`` (the prompt's leading blocks the store holds or will hold) and ``tail``
  (KV the decode side needs besides the store's, or None); ``namespace(cache_salt)`` (the
  namespace its blocks are published in, for routing lookups); ``stats()`` (for ``/health``);
- decode: ``stream(call, first_token, tail, wait_for_blocks)`` yields ``{"token_ids": [...]}``
  after the first token, then ``{"done": {...}}``; ``first_token=None`` generates from scratch
  with the store bypassed; ``stats()``.

kvstore's own engine (``serve_replicas``) is the default. Another engine is handed in from above
as a ``ServeEngine``: the CLI passes vLLM's (``kvstore.integrations.vllm``), because the front
end sits below the integrations (design §2) and must not name them, even in a string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import KVStoreConfig

#: The engine ``kvstore serve`` runs unless told otherwise.
DEFAULT_ENGINE = "kvstore"


@dataclass(slots=True)
class ServeEngine:
    """One engine behind the front end: its two deployments and what each replica needs."""

    name: str
    #: ``() -> (prefill deployment, decode deployment)``, Serve-decorated classes whose
    #: constructors take ``(config, *bind_args)``; imported only when the application is built.
    deployments: Callable[[], tuple[Any, Any]]
    bind_args: tuple[Any, ...] = ()
    #: CPUs each replica asks Ray for (kvstore's replicas fix their own threads: none).
    num_cpus: float = 0.0
    #: Environment variables of each prefill / decode replica (e.g. CPU core binding).
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    #: ``(config, tokenizer_path) -> None``, raising ``ConfigError`` for a model the engine
    #: cannot serve; None: kvstore's own check (``launch.check_model``).
    check_model: Callable[[KVStoreConfig, str | None], None] | None = None
    #: The engine's context length when it is shorter than the checkpoint's.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")

    def actor_options(self, role: str, num_gpus: float) -> dict[str, Any]:
        """``ray_actor_options`` of a ``prefill`` or ``decode`` replica."""
        env = self.prefill_env if role == "prefill" else self.decode_env
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": num_gpus}
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        return options


def _kvstore_deployments() -> tuple[Any, Any]:
    from kvstore.frontend.serve_replicas import DecodeServer, PrefillServer

    return PrefillServer, DecodeServer


def kvstore_engine() -> ServeEngine:
    """kvstore's own engine: ``PrefillWorker`` and ``DecodeWorker`` replicas."""
    return ServeEngine(DEFAULT_ENGINE, _kvstore_deployments)
