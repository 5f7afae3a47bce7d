"""The operator CLI, ``kvstore``: start/stop/status of the cluster, pins, drains, invalidation.

Worker subcommands (demo, prefill, decode, generate, bench) and ``serve`` come from the
torch-free parsers ``kvstore.workers.jobs.args`` and ``kvstore.frontend.args``, whose ``func``
imports the command itself only when it runs; every subcommand sets
``func(args) -> int | None`` with ``set_defaults``.

Every expected failure, wherever it was raised (in this process or inside a Ray actor), prints
one line ``kvstore: error: ...`` saying what to fix, and exits with the code of its kind (a
usage error argparse finds too: ``kvstore.cli.one_line_parser``); ``--debug`` adds the
traceback:

    0    success
    1    an unexpected failure (a bug): run again with --debug and report the traceback
    2    bad arguments or settings (ConfigError), or settings this machine cannot honour (a
         --port something listens on, a --capacity /dev/shm has no room for): fix the flag,
         file or KVSTORE_* variable
    3    no Ray cluster, or kvstore not running on it (ClusterUnavailable, NodeUnavailable)
    4    the Redis index failed: unreachable, wrong or needless password (IndexBackendError)
    5    kvstore already runs with other settings (ClusterConflict): `kvstore stop` first
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from kvstore.cli import cache as cache_commands
from kvstore.cli import credentials as credential_commands
from kvstore.cli import doctor as doctor_command
from kvstore.cli import status as status_command
from kvstore.cli.one_line_parser import OneLineErrorParser
from kvstore.command_flags import (
    RUNNING_CLUSTER,
    add_config_flags,
    config_from_flags,
    start_flag_overrides,
)
from kvstore.command_output import output_console
from kvstore.config import KVStoreConfig
from kvstore.errors import (
    ClusterConflict,
    ClusterUnavailable,
    ConfigError,
    IndexBackendError,
    KVStoreError,
    NodeUnavailable,
)

#: Subcommands defined here; for these the parser is built without the worker and serve
#: subcommands, whose parsers an operator command has no use for.
OPERATOR_COMMANDS = frozenset({"start", "stop", "status", "ls", "pin", "unpin", "drain",
                               "invalidate", "credentials", "rotate-credentials", "doctor"})

console = output_console()


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    """``start``'s and ``stop``'s settings: defaults < --config < KVSTORE_* < start's flags."""
    return config_from_flags(args, start_flag_overrides(args))


def warn_argv_password(url: str | None) -> None:
    """A password in ``--redis URL`` works, but every user on the host sees it in ``ps``."""
    from urllib.parse import urlsplit

    if url and urlsplit(url).password:
        _note("warning: the Redis password in --redis is visible to every local user (ps, "
              "/proc); pass it with --redis-password-file FILE or KVSTORE_INDEX_REDIS_PASSWORD "
              "and drop it from the URL (docs/security.md)")


def _note(message: str) -> None:
    print(f"kvstore: {message}", file=sys.stderr)


def cmd_start(args: argparse.Namespace) -> int:
    """Start kvstore on the named Ray cluster, else on a local Ray head started here.

    The cluster used is recorded (``kvstore.cluster.address``), so later commands find it
    without flags; a head started here is stopped again if the start fails, and by ``stop``.
    """
    import os

    warn_argv_password(args.redis)
    config = config_from_args(args)  # a bad flag is refused before torch and Ray are imported

    from kvstore.cluster import address, head, lifecycle
    from kvstore.node.shm_space import check_pool_fits

    lifecycle.check_index(lifecycle.with_redis_password(config))  # before any head or actor
    resolved = address.resolve(args.address)
    started_head: address.RecordedCluster | None = None
    target = resolved.address
    if target in (None, address.LOCAL):  # `local` must outlive this command: a head
        check_pool_fits(config.pool)  # the store node will be on this machine: before the head
        with console.status("no Ray cluster named: starting a local Ray head..."):
            started_head = head.start_head()
        os.environ["RAY_AUTH_MODE"] = started_head.auth_mode
        head.keep_loopback_address()  # it listens on 127.0.0.1 only
        target = started_head.address
        _note(f"started a local Ray head at {target} (on loopback: reachable from this "
              f"machine only; Ray auth {started_head.auth_mode}); `kvstore stop` stops it")
    try:
        with console.status("starting the coordinator and one store node per Ray node..."):
            info = lifecycle.start(config, start_local=False, address=resolved if
                                   started_head is None else target)
    except BaseException:
        if started_head is not None:
            _shutdown_ray()
            head.stop_head(started_head)
        raise
    if started_head is not None:
        address.record(started_head)
    elif resolved.source == "--address":  # RAY_ADDRESS stays set in the shell: no need
        address.record(address.RecordedCluster(
            str(target), os.environ.get("RAY_AUTH_MODE", "")))
    verb = "already running" if info.already_running else "started"
    table = Table(title=f"kvstore {verb} (index: {info.index_backend}, epoch {info.epoch})")
    table.add_column("node id")
    table.add_column("gRPC")
    table.add_column("bulk")
    for node_id, addr in sorted(info.nodes.items()):
        table.add_row(node_id, addr.grpc_address, addr.bulk_address or "-")
    console.print(table)
    console.print(f"pool capacity per node: {info.capacity_bytes:,} bytes; "
                  f"Ray: {info.ray_address}")
    _print_security(info)
    return 0


def _print_security(info: Any) -> None:
    if info.security == "secure":
        made = "made now" if info.secrets_created else "loaded"
        where = f" (cluster secrets {made}: {info.secrets_dir})" if info.secrets_dir else ""
        console.print(f"security: authentication, TLS and tenant checks on{where}; clients "
                      "started on the cluster get the credentials from the coordinator")
    elif info.security == "insecure":
        from kvstore.cluster.credentials import INSECURE_WARNING

        _note("WARNING: " + INSECURE_WARNING)
    else:
        console.print("security: off (every store node on loopback: the single-machine "
                      "default)")


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop every kvstore actor; and the Ray head, when `kvstore start` started it."""
    from kvstore.cluster import address, head, lifecycle

    config = config_from_args(args)
    resolved = address.resolve(args.address)
    if resolved.address is None:
        stale = address.recorded()
        if stale is not None and stale.head_pid is not None:
            head.stop_head(stale)  # a head of ours that died still leaves its temp dir
        address.forget()  # a stale record (the note said so) is of no further use
        raise ClusterUnavailable("nothing to stop: no Ray cluster is named (--address, "
                                 "RAY_ADDRESS) or recorded on this machine; to stop kvstore on "
                                 "another cluster, pass its --address")
    num_killed = lifecycle.stop(config, address=resolved, purge=args.purge)
    console.print(f"kvstore stopped ({num_killed} actors)"
                  + ("; disk tiers removed" if args.purge else ""))
    rec = address.recorded()
    if rec is not None and rec.address == resolved.address:
        _shutdown_ray()
        head.stop_head(rec)
        address.forget()
        if rec.head_pid is not None:
            console.print(f"stopped the local Ray head kvstore started at {rec.address}")
    return 0


def build_parser(*, with_workers: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``with_workers`` adds the worker jobs' and ``serve``'s subcommands."""
    parser = OneLineErrorParser(
        prog="kvstore", description="kvstore operator CLI: a distributed KV-cache store on Ray")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, print the traceback too (accepted after the command)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("start", help="start the coordinator and a store node per Ray node")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    p.add_argument("--redis", metavar="URL", help="use Redis as the index (redis://host:port/db "
                   "or rediss:// for TLS); no password here: see --redis-password-file")
    p.add_argument("--redis-password-file", metavar="FILE",
                   help="the Redis password, first line of FILE (or KVSTORE_INDEX_REDIS_PASSWORD)")
    p.add_argument("--capacity", metavar="SIZE", help="pool capacity per node, e.g. 4GiB")
    p.add_argument("--disk-dir", metavar="DIR",
                   help="a disk tier under every store node's pool: blocks evicted for space "
                        "go here and survive a restart (pool.disk_dir; off by default)")
    p.add_argument("--disk-capacity", metavar="SIZE",
                   help="the disk tier's size per node, e.g. 100GiB (pool.disk_capacity_bytes)")
    p.add_argument("--secrets-dir", metavar="DIR",
                   help="where the cluster token, data key and CA are kept or made (default: "
                        "security.secrets_dir, else ~/.ray/kvstore)")
    p.add_argument("--insecure", action="store_true",
                   help="run a cluster without authentication, TLS and tenant checks "
                        "(logged loudly; only for a network you trust completely)")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("stop", help="stop every kvstore actor and free the arenas (disk "
                       "tiers are kept for the next start)")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    p.add_argument("--purge", action="store_true",
                   help="remove every store node's disk tier (pool.disk_dir) too")
    p.set_defaults(func=cmd_stop)

    # Operator views of the cache and the cluster (status, drain, ls, pin, unpin,
    # invalidate) live in their own modules; they import nothing heavy until they run.
    status_command.register(sub)
    cache_commands.register(sub)
    credential_commands.register(sub)
    doctor_command.register(sub)

    if with_workers:
        # Torch-free parsers: each command's own module is imported when the command runs.
        from kvstore.frontend import args as serve_args
        from kvstore.workers.jobs import args as job_args

        job_args.register(sub)
        serve_args.register(sub, engines={"vllm": _vllm_serve_engine})
    return parser


def _vllm_serve_engine(args: argparse.Namespace) -> Any:
    """``kvstore serve --engine vllm``: vLLM's replicas, wired here because the front end sits
    below the integrations (design §2) and takes engines from above."""
    from kvstore.integrations.vllm.serve_engine import serve_engine

    return serve_engine(args)


def _fail(message: str) -> None:
    # Plain print, not rich: rich wraps long lines, and the operator gets exactly one.
    print(message if message.startswith("kvstore") else f"kvstore: {message}", file=sys.stderr)


def exit_code(exc: BaseException) -> int:
    """The documented exit code of an error's kind (the table in the module docstring)."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, IndexBackendError):  # before NodeUnavailable: Redis, not the cluster
        return 4
    if isinstance(exc, ClusterConflict):
        return 5
    if isinstance(exc, NodeUnavailable):
        return 3
    if isinstance(exc, (ConfigError, ValueError)):
        return 2
    return 1


def error_line(exc: BaseException) -> str:
    """One line, colour codes and Ray's wrapping removed; unexpected errors keep their type."""
    from kvstore.cluster.remote_errors import strip_ansi

    text = " ".join(strip_ansi(str(exc)).split())
    if not isinstance(exc, (KVStoreError, ValueError)):
        text = f"{type(exc).__name__}: {text}"
    return f"kvstore: error: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # anywhere: `kvstore start --debug` is what people type
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(with_workers=command not in OPERATOR_COMMANDS)
    args = parser.parse_args(argv)
    try:
        if command in OPERATOR_COMMANDS and command != "doctor":  # doctor lists them first
            doctor_command.sweep_and_say(args)  # RAM a crashed run left: kvstore.cli.doctor
        return int(args.func(args) or 0)
    except (Exception, KeyboardInterrupt) as raised:
        exc: BaseException = raised
        if type(exc).__module__.startswith("ray."):  # raised in an actor: the original error
            from kvstore.cluster.remote_errors import unwrap

            exc = unwrap(exc)
        if debug:
            import traceback

            traceback.print_exception(raised)
        _fail("interrupted" if isinstance(exc, KeyboardInterrupt) else error_line(exc))
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
