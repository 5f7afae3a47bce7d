"""The operator CLI, ``kvstore``: start/stop/status of the cluster, pins, drains, invalidation.

Worker subcommands (demo, prefill, decode, generate, bench) come from
``workers.jobs.register(subparsers)`` when the workers package provides it; every subcommand
sets ``func(args) -> int | None`` with ``set_defaults``. Errors print one line, no traceback,
and exit non-zero (2 for bad settings or arguments, 1 for everything else).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstore.config import KVStoreConfig, load_config
from kvstore.constants import KEY_NBYTES
from kvstore.errors import ConfigError, KVStoreError

#: Subcommands defined here; for these the worker subcommands (which import torch and
#: transformers, seconds of start-up) are not loaded.
OPERATOR_COMMANDS = frozenset({"start", "stop", "status", "pin", "unpin", "drain", "invalidate"})

console = Console()


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="YAML settings (see docs/configuration.md)")
    parser.add_argument("--address", metavar="RAY_ADDRESS",
                        help="Ray cluster to use (default: RAY_ADDRESS, else the running one)")


def config_from_args(args: argparse.Namespace) -> KVStoreConfig:
    """Defaults < --config FILE < KVSTORE_* variables < command-line flags."""
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "redis", None):
        overrides["index"] = {"backend": "redis", "redis_url": args.redis}
    if getattr(args, "capacity", None):
        overrides["pool"] = {"capacity_bytes": args.capacity}
    return load_config(getattr(args, "config", None), overrides=overrides)


def parse_keys(hexes: Sequence[str]) -> list[bytes]:
    """Block keys from hex; each must be a 32-byte sha256 digest (64 hex digits)."""
    keys = []
    for text in hexes:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"{text!r} is not hex; a block key is 64 hex digits") from None
        if len(key) != KEY_NBYTES:
            raise ConfigError(f"{text!r} has {len(key)} bytes; a block key is 64 hex digits")
        keys.append(key)
    return keys


def _connect(args: argparse.Namespace) -> None:
    """Join the Ray cluster an operator command acts on (never start a new one)."""
    from kvstore.cluster.lifecycle import ensure_ray

    ensure_ray(args.address, start_local=False)


def cmd_start(args: argparse.Namespace) -> int:
    from kvstore.cluster import lifecycle

    config = config_from_args(args)
    with console.status("starting the coordinator and one store node per Ray node..."):
        info = lifecycle.start(config, address=args.address, start_local=False)
    table = Table(title=f"kvstore started (index: {info.index_backend}, epoch {info.epoch})")
    table.add_column("node id")
    table.add_column("gRPC")
    table.add_column("bulk")
    for node_id, addr in sorted(info.nodes.items()):
        table.add_row(node_id, addr.grpc_address, addr.bulk_address or "-")
    console.print(table)
    console.print(f"pool capacity per node: {config.pool.capacity_bytes:,} bytes; "
                  f"Ray: {info.ray_address}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from kvstore.cluster import lifecycle

    num_killed = lifecycle.stop(config_from_args(args), address=args.address)
    console.print(f"kvstore stopped ({num_killed} actors)")
    return 0


def status_json(raw: dict[str, Any]) -> dict[str, Any]:
    """One object: ``nodes`` as ``{node_id, capacity_bytes, used_bytes, blocks, ...}`` + totals."""
    nodes = []
    for node in raw.get("nodes", []):
        entry = dict(node)
        for name in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions"):
            entry[name] = int(entry.get(name) or 0)
        nodes.append(entry)
    out = dict(raw)
    out["nodes"] = nodes
    live = [n for n in nodes if n.get("alive", True)]
    totals = dict(raw.get("totals") or {})
    totals.setdefault("nodes_alive", len(live))
    for name in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions"):
        totals.setdefault(name, sum(n[name] for n in live))
    lookups = totals["hits"] + totals["misses"]
    totals.setdefault("hit_rate", totals["hits"] / lookups if lookups else 0.0)
    out["totals"] = totals
    return out


def _ratio(hits: int, misses: int) -> str:
    total = hits + misses
    return f"{hits / total:.1%}" if total else "-"


def cmd_status(args: argparse.Namespace) -> int:
    from kvstore.cluster import operations

    _connect(args)
    status = status_json(operations.status())
    if args.json:
        print(json.dumps(status, default=str, sort_keys=True))
        return 0
    table = Table(title="kvstore nodes")
    for col in ("node id", "alive", "capacity", "used", "use", "blocks", "hit rate", "evictions"):
        table.add_column(col, justify="left" if col == "node id" else "right", no_wrap=True)
    for n in status["nodes"]:
        use = n["used_bytes"] / n["capacity_bytes"] if n["capacity_bytes"] else 0.0
        table.add_row(n["node_id"][:12], "yes" if n.get("alive", True) else "no",
                      _size(n["capacity_bytes"]), _size(n["used_bytes"]), f"{use:.0%}",
                      str(n["blocks"]), _ratio(n["hits"], n["misses"]), str(n["evictions"]))
    console.print(table)
    t = status["totals"]
    console.print(f"total: {t['nodes_alive']} nodes alive, {_size(t['used_bytes'])} of "
                  f"{_size(t['capacity_bytes'])}, {t['blocks']} blocks, hit rate "
                  f"{t['hit_rate']:.1%}, {t['evictions']} evictions")
    workers = status.get("workers") or []
    if workers:
        wt = Table(title="workers (reuse: where cache hits resume; exact = bitwise --no-cache)")
        for col in ("worker", "node id", "model", "attention", "reuse", "resume at",
                    "smallest piece", "exact"):
            wt.add_column(col, no_wrap=True)
        for w in workers:
            reuse = w.get("reuse") or {}
            wt.add_row(str(w.get("worker_id")), str(w.get("node_id", ""))[:12],
                       f"{w.get('model')} {w.get('dtype')}", str(w.get("attn")),
                       str(reuse.get("mode")), f"{reuse.get('resume')} boundaries",
                       str((reuse.get("piece_sizes") or ["any"])[0]),
                       "yes" if reuse.get("exact") else "no")
        console.print(wt)
    drift = status.get("drift")
    if drift:
        console.print(f"drift found at re-registration: {drift}")
    top = status.get("top_prefixes") or []
    if top:
        tt = Table(title="most used prefixes (key hashes, never tokens)")
        tt.add_column("key hash")
        tt.add_column("uses", justify="right")
        for item in top:
            count = item.get("touches", item.get("count", 0))
            tt.add_row(str(item.get("key")), str(count))
        console.print(tt)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_pin(args: argparse.Namespace) -> int:
    from kvstore.cluster import operations

    keys = parse_keys(args.keys)
    if args.ttl is not None and not args.soft:
        raise ConfigError("--ttl applies to soft pins only; add --soft")
    if args.ttl is not None and args.ttl <= 0:
        raise ConfigError("--ttl must be > 0 seconds")
    _connect(args)
    n = operations.pin(keys, hard=not args.soft, ttl_s=args.ttl)
    console.print(f"pinned {n} of {len(keys)} blocks ({'soft' if args.soft else 'hard'})")
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    from kvstore.cluster import operations

    keys = parse_keys(args.keys)
    _connect(args)
    n = operations.unpin(keys)
    console.print(f"unpinned {n} of {len(keys)} blocks")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    from kvstore.cluster import operations

    _connect(args)
    n = operations.drain(args.node_id)
    console.print(f"draining {args.node_id}: {n} blocks to move or evict")
    return 0


def namespace_root(args: argparse.Namespace) -> bytes:
    """The root to invalidate: --namespace ROOTHEX, or built from the namespace fields."""
    if args.namespace:
        return parse_keys([args.namespace])[0]
    fields = {"model_fingerprint": args.model_fingerprint, "dtype": args.dtype,
              "block_size": args.block_size, "num_layers": args.num_layers,
              "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    missing = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is None]
    if missing:
        raise ConfigError("give --namespace ROOTHEX, or every namespace field; missing: "
                          + " ".join(missing))
    from kvstore.keys import Namespace

    return Namespace(cache_salt=args.salt, **fields).root  # type: ignore[arg-type]


def cmd_invalidate(args: argparse.Namespace) -> int:
    from kvstore.cluster import operations

    root = namespace_root(args)
    _connect(args)
    n = operations.invalidate(root)
    console.print(f"invalidated namespace {root.hex()[:16]}: {n} blocks evicted")
    return 0


def build_parser(*, with_workers: bool = True) -> argparse.ArgumentParser:
    """The argument parser, worker subcommands included when the workers package is there."""
    parser = argparse.ArgumentParser(
        prog="kvstore", description="kvstore operator CLI: a distributed KV-cache store on Ray")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("start", help="start the coordinator and a store node per Ray node")
    _common(p)
    p.add_argument("--redis", metavar="URL", help="use Redis as the index (redis://host:port/db)")
    p.add_argument("--capacity", metavar="SIZE", help="pool capacity per node, e.g. 4GiB")
    p.set_defaults(func=cmd_start)

    p = sub.add_parser("stop", help="stop every kvstore actor and free the arenas")
    _common(p)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("status", help="per-node use, hit rate, evictions, top prefixes")
    _common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("pin", help="keep blocks from eviction")
    _common(p)
    p.add_argument("keys", nargs="+", metavar="KEYHEX")
    p.add_argument("--soft", action="store_true", help="evictable when nothing else is left")
    p.add_argument("--ttl", type=float, metavar="S", help="soft pin lifetime in seconds")
    p.set_defaults(func=cmd_pin)

    p = sub.add_parser("unpin", help="release pins")
    _common(p)
    p.add_argument("keys", nargs="+", metavar="KEYHEX")
    p.set_defaults(func=cmd_unpin)

    p = sub.add_parser("drain", help="move a node's blocks elsewhere (or evict) and stop using it")
    _common(p)
    p.add_argument("node_id", metavar="NODE_ID")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("invalidate", help="evict every block of a namespace everywhere")
    _common(p)
    p.add_argument("--namespace", metavar="ROOTHEX", help="the namespace root (64 hex digits)")
    p.add_argument("--model-fingerprint")
    p.add_argument("--dtype")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--num-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--salt", default="", help="the tenant's cache salt")
    p.set_defaults(func=cmd_invalidate)

    if with_workers:
        try:
            from workers import jobs
        except ImportError:  # the workers package is optional for operators
            pass
        else:
            if hasattr(jobs, "register"):
                jobs.register(sub)
    return parser


def _fail(message: str) -> None:
    # Plain print, not rich: rich wraps long lines, and the operator gets exactly one.
    print(message if message.startswith("kvstore") else f"kvstore: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(with_workers=command not in OPERATOR_COMMANDS)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except (ConfigError, ValueError) as exc:
        _fail(f"kvstore: error: {exc}")
        return 2
    except KVStoreError as exc:
        _fail(f"kvstore: error: {exc}")
        return 1
    except Exception as exc:  # the operator gets one line; the type says where to look
        _fail(f"kvstore: error: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
