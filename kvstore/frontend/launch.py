"""``kvstore serve``: bring up the store (if needed) and the Serve application; run until Ctrl-C.

On the embedded default (no cluster named, none recorded) it starts a private local Ray, the
coordinator and a store node, as ``kvstore generate`` does, and takes them down again on exit.
On a running kvstore cluster it deploys the application there and deletes only the application
on exit. The model is checked in this process first, so a checkpoint the adapter cannot serve
exactly fails here with its message, before any replica starts; before even that, a port that
something else listens on is refused (``check_port``). Each slow step of the start is a phase
on stderr (``kvstore.command_output``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstore.command_flags import SERVE_FLAGS, WORKER_FLAGS, config_from_flags, flag_settings
from kvstore.command_output import Steps
from kvstore.config import KVStoreConfig, ServeConfig
from kvstore.errors import ConfigError
from kvstore.frontend.engines import ServeEngine, kvstore_engine

log = logging.getLogger(__name__)

#: The Serve application's name (``serve status`` shows it).
APP_NAME = "kvstore"
#: How long to wait for the HTTP endpoint to answer after deploying.
READY_TIMEOUT_S = 300.0


def make_config(args: argparse.Namespace) -> KVStoreConfig:
    """Defaults < --config < KVSTORE_* < flags; the API key read from ``serve.api_key_file``."""
    config = config_from_flags(args, {"worker": flag_settings(args, WORKER_FLAGS),
                                      "serve": flag_settings(args, SERVE_FLAGS)})
    key_file = config.serve.api_key_file
    if key_file and not config.serve.api_key:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"serve.api_key_file {key_file}: {exc.strerror or exc}") from None
        if len(key) < 8:
            raise ConfigError(f"serve.api_key_file {key_file}: the key must be at least 8 "
                              "characters")
        config.serve.api_key = key
    return config


def model_card(config: KVStoreConfig, max_model_len: int | None = None) -> Any:
    """The served model's name, context length and vocabulary, from its config only.

    ``max_model_len``: an engine's own limit, when it is shorter than the checkpoint's.
    """
    from kvstore.frontend.protocol import ModelCard
    from kvstore.workers.model.causal_lm import PRESETS

    spec = config.worker.model
    if spec in PRESETS:
        shape = PRESETS[spec]
        max_len, vocab, name = shape["max_position_embeddings"], shape["vocab_size"], spec
    else:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(spec, local_files_only=True)
        max_len, vocab = int(cfg.max_position_embeddings), int(cfg.vocab_size)
        name = os.path.basename(os.path.normpath(spec))
    if max_model_len is not None:
        max_len = min(max_len, max_model_len)
    return ModelCard(config.serve.model_name or name, max_len, vocab, int(time.time()))


def initial_replicas(sc: ServeConfig, replicas: int) -> int:
    """How many replicas of one kind the application starts with (autoscaling: in bounds)."""
    return max(sc.min_replicas, min(replicas, sc.max_replicas)) if sc.autoscaling else replicas


def build_app(config: KVStoreConfig, tokenizer_path: str | None,
              gpus_per_replica: float = 0.0, engine: ServeEngine | None = None) -> Any:
    """The Serve application: the HTTP front end bound to prefill and decode deployments.

    ``gpus_per_replica`` (``kvstore.workers.replicas.placement``, resolved against the cluster) is
    what each prefill and decode replica asks Ray for; the front end itself asks for none.
    ``engine`` says what computes in the replicas (default: kvstore's own engine).
    """
    from kvstore.frontend.app import OpenAIServer
    from kvstore.workers.model.causal_lm import generation_stop_ids

    sc = config.serve
    engine = engine or kvstore_engine()
    prefill_cls, decode_cls = engine.deployments()

    def scaled(replicas: int, role: str) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_ongoing_requests": sc.max_ongoing_requests,
                                "max_queued_requests": sc.max_queued_requests,
                                # The prefix's node first, then Serve's own choice.
                                "request_router_config": {"request_router_class":
                                                          "kvstore.frontend.routing."
                                                          "PrefixAffinityRouter"},
                                # Replaces the decorator's options, so num_cpus is repeated.
                                "ray_actor_options": engine.actor_options(role,
                                                                          gpus_per_replica)}
        if sc.autoscaling:
            opts["autoscaling_config"] = {
                "min_replicas": sc.min_replicas, "max_replicas": sc.max_replicas,
                "initial_replicas": initial_replicas(sc, replicas),
                "target_ongoing_requests": sc.target_ongoing_requests}
        else:
            opts["num_replicas"] = replicas
        return opts

    # Serve's decorator turns the classes into Deployments, which mypy cannot see.
    prefill = prefill_cls.options(**scaled(sc.prefill_replicas, "prefill")).bind(
        config, *engine.bind_args)
    decode = decode_cls.options(**scaled(sc.decode_replicas, "decode")).bind(
        config, *engine.bind_args)
    eos = tuple(generation_stop_ids(config.worker.model))
    return OpenAIServer.bind(  # type: ignore[attr-defined]
        model_card(config, engine.max_model_len), config, tokenizer_path, eos, prefill, decode)


def check_model(config: KVStoreConfig, tokenizer_path: str | None) -> None:
    """Load the tokenizer and (for a directory) the model here: refusals come out now."""
    from kvstore.workers.model.causal_lm import PRESETS, load_worker_model
    from kvstore.workers.model.tokenizer import tokenizer_for

    tokenizer_for(config.worker.model, tokenizer_path)
    if config.worker.model not in PRESETS:
        # On the host's CPU: the check must not take GPU memory the replicas will want.
        load_worker_model(dataclasses.replace(config.worker, device="cpu"), keep_threads=True)


def check_port(host: str, port: int) -> None:
    """Refuse, before anything slow starts, a ``host:port`` this machine cannot listen on.

    Bound and released at once with ``SO_REUSEADDR``, as the HTTP proxy binds it, so a port
    whose last connections linger in TIME_WAIT passes and only a listener refuses it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is already in use: pick a free one "
                                  "with --port (or serve.port)") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"port {port} needs privileges to listen on: pick one "
                                  "above 1023 with --port (or serve.port)") from None
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): check "
                              "--host and --port (or serve.host, serve.port)") from None


def _wait_ready(url: str, stop: threading.Event, gpus_per_replica: float = 0.0) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set():
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=15) as reply:
                if reply.status == 200:
                    return
        if time.monotonic() > deadline:
            waiting = (f" (each replica asks Ray for {gpus_per_replica:g} GPU(s), and Ray "
                       "waits while other actors hold them: `serve status` shows replicas "
                       "pending; lower worker.gpus_per_replica or the replica counts)"
                       if gpus_per_replica > 0 else "")
            raise ConfigError(f"the server did not answer at {url}/health within "
                              f"{READY_TIMEOUT_S:.0f}s{waiting}")
        stop.wait(0.5)


def _shutdown_serve_if_unused(serve: Any) -> None:
    """On a shared cluster, stop Serve's proxy and controller when no application is left.

    A running Serve keeps its HTTP options: left up, it would make the next ``kvstore serve
    --port P`` listen on the old port instead (Serve only warns). Other users' applications
    keep it running.
    """
    with contextlib.suppress(Exception):
        if not serve.status().applications:
            serve.shutdown()


def cmd_serve(args: argparse.Namespace, engine: ServeEngine | None = None) -> int:
    """Run ``kvstore serve`` until Ctrl-C; ``engine``: what the replicas compute with."""
    from kvstore.cluster.address import LOCAL, resolve

    engine = engine or kvstore_engine()
    config = make_config(args)
    sc = config.serve
    resolved = resolve(args.address)
    if not str(resolved.address).startswith("ray://"):  # else the proxy listens elsewhere
        check_port(sc.host, sc.port)
    steps = Steps.for_command()
    with steps.phase(f"checking the model {config.worker.model}"):
        (engine.check_model or check_model)(config, args.tokenizer)
    import ray
    from ray import serve

    from kvstore.cluster import lifecycle
    from kvstore.cluster.names import coordinator_handle
    from kvstore.errors import NodeUnavailable
    from kvstore.workers.replicas.placement import replica_gpus

    # Serve's own INFO lines here (started, connecting, ready, deleting) repeat the phases in
    # another format, one of them a needless alarm about http_options; warnings still show.
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with steps.phase("starting a private Ray instance" if resolved.address in (None, LOCAL)
                     else f"connecting to Ray at {resolved.address}"):
        lifecycle.ensure_ray(resolved)
    started_cluster = False
    try:
        # A stop asked for while starting (Ctrl-C, SIGTERM) is taken at the next phase: what
        # has started is stopped in order, and nothing more is started.
        if stop.is_set():
            return 0
        num_prefill = initial_replicas(sc, sc.prefill_replicas)
        num_decode = initial_replicas(sc, sc.decode_replicas)
        # Decided before anything starts: too few GPUs in the cluster fail here, at once.
        gpus = replica_gpus(config.worker, num_prefill + num_decode)
        try:
            coordinator_handle()
        except NodeUnavailable:  # nothing running: the embedded default
            with steps.phase("starting the store (a coordinator and a store node)"):
                lifecycle.start(config)
            started_cluster = True
        if stop.is_set():
            return 0
        host = "127.0.0.1" if sc.host in ("0.0.0.0", "::") else sc.host
        url = f"http://{host}:{sc.port}"
        with steps.phase(f"starting Ray Serve: {num_prefill} prefill and {num_decode} decode "
                         f"replicas, until {url}/health answers"):
            serve.start(http_options={"host": sc.host, "port": sc.port})
            serve.run(build_app(config, args.tokenizer, gpus, engine), name=APP_NAME,
                      route_prefix="/", blocking=False)
            _wait_ready(url, stop, gpus)
        if stop.is_set():  # never said to be ready
            return 0
        if args.ready_file:
            Path(args.ready_file).write_text(url + "\n")
        engines = "" if engine.name == kvstore_engine().name else f" {engine.name}"
        print(f"kvstore serve: {model_card(config).name} at {url}/v1 "
              f"({sc.prefill_replicas} prefill, {sc.decode_replicas} decode{engines} replicas"
              f"{f', {gpus:g} GPU each' if gpus else ''}"
              f"{', autoscaling' if sc.autoscaling else ''}"
              f"{', API key required' if sc.api_key else ''}); Ctrl-C stops it",
              file=sys.stderr, flush=True)
        stop.wait()
    finally:
        with steps.phase("stopping the application" + (" and the store" if started_cluster
                                                       else "")):
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)
            if started_cluster:  # Serve itself goes with the private Ray
                lifecycle.stop(config)
            else:
                _shutdown_serve_if_unused(serve)
            ray.shutdown()
    return 0
