"""The flags the ``kvstore`` commands share, and how their flags become settings.

Every command reads its settings one way: defaults < ``--config FILE`` < ``KVSTORE_*`` variables
< its flags. Which flag overrides which setting is written once here, so ``--chunk-tokens`` is
``worker.prefill_chunk_tokens`` for the worker jobs, ``serve`` and the operator commands alike.

Torch-free and Ray-free: ``kvstore --help`` and every operator command import this module, and
an operator command must not pay for the worker stack it does not use.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config

#: ``--config``'s help: on every command a file that is given must exist and parse.
CONFIG_HELP = "YAML settings (see docs/configuration.md); must exist if given"

#: ``--address``'s fallback for a command that acts on a running cluster and never starts one.
RUNNING_CLUSTER = "else the running one"
#: ``--address``'s fallback for a command that starts a private Ray when no cluster is named
#: or recorded (``kvstore.cluster.address.resolve`` reads the record for every command).
EMBEDDED_CLUSTER = "the cluster `kvstore start` recorded, else an embedded one"

#: A worker flag (its argparse ``dest``) -> the ``worker`` setting it overrides.
WORKER_FLAGS: dict[str, str] = {
    "model": "model",
    "seed": "seed",
    "block_size": "block_size",
    "chunk_tokens": "prefill_chunk_tokens",
    "salt": "cache_salt",
    "threads": "num_threads",
    "device": "device",
    "attn_implementation": "attn_implementation",
    "dtype": "dtype",
    "gpus_per_replica": "gpus_per_replica",
    "numerics": "numerics",
    "max_new_tokens": "max_new_tokens",
}

#: A ``kvstore serve`` flag -> the ``serve`` setting it overrides.
SERVE_FLAGS: dict[str, str] = {
    "host": "host",
    "port": "port",
    "model_name": "model_name",
    "prefill_replicas": "prefill_replicas",
    "decode_replicas": "decode_replicas",
    "max_ongoing_requests": "max_ongoing_requests",
}

#: ``{section: {setting: value}}``: the settings flags override, as ``load_config`` takes them.
Overrides = dict[str, dict[str, Any]]


def add_config_flags(parser: argparse.ArgumentParser, *, address_fallback: str) -> None:
    """Add ``--config FILE`` and ``--address RAY_ADDRESS``.

    ``address_fallback`` completes ``--address``'s help: which Ray cluster the command uses when
    neither the flag nor ``RAY_ADDRESS`` names one (``RUNNING_CLUSTER``, ``EMBEDDED_CLUSTER``).
    """
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    parser.add_argument("--address", metavar="RAY_ADDRESS",
                        help=f"Ray cluster to use (default: RAY_ADDRESS, {address_fallback})")


def flag_settings(args: argparse.Namespace, flags: Mapping[str, str]) -> dict[str, Any]:
    """``{setting: value}`` of the ``flags`` given on the command line.

    A flag the command's parser does not define, or one left at ``None``, overrides nothing;
    ``0`` and ``""`` are values (``--max-new-tokens 0`` is a warm-up, not "unset").
    """
    return {setting: value for flag, setting in flags.items()
            if (value := getattr(args, flag, None)) is not None}


def start_flag_overrides(args: argparse.Namespace) -> Overrides:
    """The index, pool and security settings of ``kvstore start``'s flags.

    ``--redis URL`` switches the index to Redis as well as naming it; without ``--insecure`` the
    file's or the environment's ``security.insecure`` stands. A flag given as an empty string
    overrides nothing.
    """
    overrides: Overrides = {}
    if getattr(args, "redis", None):
        overrides["index"] = {"backend": "redis", "redis_url": args.redis}
    if getattr(args, "redis_password_file", None):
        overrides.setdefault("index", {})["redis_password_file"] = args.redis_password_file
    if getattr(args, "capacity", None):
        overrides["pool"] = {"capacity_bytes": args.capacity}
    if getattr(args, "disk_dir", None):
        overrides.setdefault("pool", {})["disk_dir"] = os.path.abspath(args.disk_dir)
    if getattr(args, "disk_capacity", None):
        overrides.setdefault("pool", {})["disk_capacity_bytes"] = args.disk_capacity
    if getattr(args, "insecure", False):
        overrides["security"] = {"insecure": True}
    if getattr(args, "secrets_dir", None):
        overrides.setdefault("security", {})["secrets_dir"] = args.secrets_dir
    return overrides


def config_from_flags(args: argparse.Namespace,
                      overrides: Mapping[str, Mapping[str, Any]] | None = None) -> KVStoreConfig:
    """The settings a command runs with: defaults < ``--config`` < ``KVSTORE_*`` < ``overrides``.

    Read and validated before anything connects or loads, so a bad flag, file or variable fails
    at once with a ``ConfigError`` that names it.
    """
    return load_config(getattr(args, "config", None), overrides=overrides)
