"""``kvstore ls | pin | unpin | invalidate``: see what the cache holds and steer it by prompt.

An operator names a system prompt (``--prompts FILE.jsonl`` or ``--text``, with the worker's
``--model``) or the full keys ``kvstore ls`` prints; the prompt's keys are computed by the
worker's own code (``kvstore.workers.jobs.prompt_keys``), loaded only when a prompt is given, so
every other path here starts without torch. Every command reads ``--config`` (a missing file is an
error).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from kvstore.command_flags import (
    RUNNING_CLUSTER,
    WORKER_FLAGS,
    add_config_flags,
    config_from_flags,
    flag_settings,
)
from kvstore.config import KVStoreConfig
from kvstore.constants import KEY_NBYTES
from kvstore.errors import ClusterUnavailable, ConfigError, KVStoreError


def operator_config(args: argparse.Namespace, *, worker_flags: bool = False) -> KVStoreConfig:
    """The settings a command runs with: read (and checked) before anything connects.

    With ``worker_flags`` the command's ``--model``, ``--seed``, ``--block-size``, ``--salt``,
    ``--dtype`` and ``--numerics`` stand for the workers' settings, so a prompt's keys are the
    ones its prefill publishes.
    """
    worker = flag_settings(args, WORKER_FLAGS) if worker_flags else {}
    return config_from_flags(args, {"worker": worker})


def connect(args: argparse.Namespace) -> None:
    """Join the Ray cluster an operator command acts on (never start a new one)."""
    from kvstore.cluster.lifecycle import ensure_ray

    ensure_ray(args.address, start_local=False)


def with_cluster_data_key(args: argparse.Namespace, config: KVStoreConfig) -> KVStoreConfig:
    """A secure cluster's roots are keyed with its data key, which an operator's settings rarely
    carry: take it from the running cluster (over Ray, as every client does) when they lack it."""
    if config.security.data_key:
        return config
    from kvstore.cluster.lifecycle import cluster_config

    try:
        connect(args)
    except ClusterUnavailable:  # no cluster: no data key to take (the call itself will say so)
        return config
    return cluster_config(config)


def parse_keys(hexes: Sequence[str]) -> list[bytes]:
    """Block keys from hex; each must be a 32-byte sha256 digest (64 hex digits)."""
    keys = []
    for text in hexes:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ConfigError(f"{text!r} is not hex; a block key is 64 hex digits "
                              "(as `kvstore ls` prints)") from None
        if len(key) != KEY_NBYTES:
            raise ConfigError(f"{text!r} has {len(key)} bytes; a block key is 64 hex digits "
                              "(as `kvstore ls` prints)")
        keys.append(key)
    return keys


def size_text(n: float) -> str:
    """Bytes in binary units, at most 8 characters (``1023 B``, ``256.0M``, ``4.0G``)."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """Name blocks by prompt, with the settings the prefill workers run with."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompts", metavar="FILE.jsonl",
                   help='prompts as the jobs read them ({"token_ids": [...]} or {"text": ...} '
                        "a line): their full blocks")
    g.add_argument("--text", help="one prompt's text (tokenized as the jobs do)")
    p.add_argument("--model", help="the workers' model: preset (tiny, small) or weights "
                                    "directory (default: worker.model of --config)")
    p.add_argument("--seed", type=int, help="weights seed of a random preset, as the workers")
    p.add_argument("--block-size", type=int, help="tokens per block (default: worker.block_size)")
    p.add_argument("--salt", help="the tenant's cache salt (default: worker.cache_salt)")
    p.add_argument("--dtype", help="the workers' dtype (default: worker.dtype; auto is "
                   "bfloat16 on a GPU worker, float32 on a CPU one)")
    p.add_argument("--numerics", metavar="TAG",
                   help="the workers' numerics tag as `kvstore status --wide` shows it, or "
                   "portable (default: worker.numerics, computed for this machine)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="local tokenizer directory, as the workers (default: the model "
                   "directory's own; bytes for a preset)")


def prompt_keys(args: argparse.Namespace) -> tuple[list[bytes], str]:
    """Keys of ``--prompts``/``--text`` (or the positional ones) and a line that says whence."""
    config = operator_config(args, worker_flags=True)
    if args.prompts is None and args.text is None:
        if not args.keys:
            raise ConfigError("name blocks: full keys (as `kvstore ls` prints), "
                              "--prompts FILE.jsonl or --text TEXT")
        return parse_keys(args.keys), ""
    if args.keys:
        raise ConfigError("give keys or --prompts/--text, not both")
    from kvstore.workers.jobs.prompt_keys import (
        prompt_blocks,
        read_prompt_tokens,
        unique_keys,
        worker_namespace,
    )

    prompts = read_prompt_tokens(args.prompts, args.text, args.tokenizer,
                                 config.worker.model)
    ns = worker_namespace(with_cluster_data_key(args, config))
    blocks = prompt_blocks(ns, prompts)
    lines = [f"namespace {ns.root.hex()} ({config.worker.model}, {ns.dtype}, "
             f"block {ns.block_size})"]
    lines += [f"  {b.prompt_id}: {b.num_tokens} tokens, {len(b.keys)} blocks, ends at "
              f"{b.keys[-1].hex()}" for b in blocks]
    return unique_keys(blocks), "\n".join(lines)


def cmd_pin(args: argparse.Namespace) -> int:
    """Pin blocks; without --ahead only cached ones, and none cached is an error."""
    if args.ttl is not None and not args.soft:
        raise ConfigError("--ttl applies to soft pins only; add --soft")
    if args.ttl is not None and args.ttl <= 0:
        raise ConfigError("--ttl must be > 0 seconds")
    keys, whence = prompt_keys(args)
    from kvstore.cluster import operations

    connect(args)
    pinned, cached = operations.pin(keys, hard=not args.soft, ttl_s=args.ttl, ahead=args.ahead)
    if whence:
        print(whence)
    kind = "soft" if args.soft else "hard"
    if not cached and not args.ahead:
        raise KVStoreError(f"none of the {len(keys)} blocks is cached, nothing pinned; publish "
                           "them first (kvstore prefill) or pass --ahead to pin them before")
    print(f"pinned {pinned} of {len(keys)} blocks ({len(keys) - cached} not cached; {kind}"
          + (", the rest apply when published)" if args.ahead and cached < len(keys) else ")"))
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    """Release pins; a call that releases none is an error (wrong keys or prompt)."""
    keys, whence = prompt_keys(args)
    from kvstore.cluster import operations

    connect(args)
    unpinned, cached = operations.unpin(keys)
    if whence:
        print(whence)
    if not unpinned:
        raise KVStoreError(f"none of the {len(keys)} blocks was pinned ({cached} cached); "
                           "nothing unpinned")
    print(f"unpinned {unpinned} of {len(keys)} blocks ({cached} cached)")
    return 0


def namespace_root(args: argparse.Namespace) -> bytes:
    """The root to invalidate: --namespace ROOTHEX, the workers' --model, or every field."""
    if args.namespace:
        return parse_keys([args.namespace])[0]
    if args.model:
        from kvstore.workers.jobs.prompt_keys import worker_namespace

        return worker_namespace(with_cluster_data_key(
            args, operator_config(args, worker_flags=True))).root
    fields = {"model_fingerprint": args.model_fingerprint, "dtype": args.dtype,
              "block_size": args.block_size, "num_layers": args.num_layers,
              "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim}
    missing = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is None]
    if missing:
        raise ConfigError("give --namespace ROOTHEX (as `kvstore ls` prints), --model, or every "
                          "namespace field; missing: " + " ".join(missing))
    from kvstore.keys import Namespace
    from kvstore.security.data_keys import parse_data_key

    # With the cluster's data key (security.data_key) roots are keyed, as the workers make them.
    data_key = parse_data_key(with_cluster_data_key(args, operator_config(args)).security.data_key)
    numerics = "" if args.numerics in (None, "portable") else args.numerics
    return Namespace(cache_salt=args.salt or "", data_key=data_key,  # type: ignore[arg-type]
                     numerics=numerics, **fields).root


def cmd_invalidate(args: argparse.Namespace) -> int:
    """Evict every block of one namespace, or exactly a prompt's blocks, everywhere."""
    operator_config(args)
    from kvstore.cluster import operations

    if args.prompts is not None or args.text is not None:
        if args.namespace:
            raise ConfigError("give --namespace or --prompts/--text, not both")
        keys, whence = prompt_keys(args)
        connect(args)
        n = operations.invalidate_keys(keys)
        print(whence)
        print(f"invalidated {n} of {len(keys)} blocks ({len(keys) - n} not cached)")
        return 0
    root = namespace_root(args)
    connect(args)
    n = operations.invalidate(root)
    print(f"invalidated namespace {root.hex()}: {n} blocks evicted")
    return 0


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _prefix_line(p: dict[str, Any], now: float) -> str:
    """One cached prefix's facts in under 80 columns (the key is on the line above)."""
    tokens = f"{p['tokens']} tokens" if p["tokens"] is not None else "? tokens"
    holders = (p["holders"][0][:12] if p["holders"] else "-") + (
        f" +{len(p['holders']) - 1}" if len(p["holders"]) > 1 else "")
    used = f"used {_ago(now - p['last_use'])} ago" if p["last_use"] else "never used"
    facts = (f"    {tokens}, {p['blocks']} blocks{'' if p['complete'] else ' (partial)'}, "
             f"{p['pinned_blocks']} pinned, {used}")
    where = f"ns {(p['namespace_root'] or '?')[:8]}, on {holders}"
    return f"{facts}, {where}" if len(facts) + len(where) < 78 else f"{facts}\n    {where}"


def cmd_ls(args: argparse.Namespace) -> int:
    """Namespaces and cached prefixes, with the full keys the other commands take."""
    if args.limit < 1:
        raise ConfigError("--limit must be >= 1")
    operator_config(args)
    from kvstore.cluster import operations

    connect(args)
    view = operations.ls(args.limit)
    if args.json:
        print(json.dumps(view, sort_keys=True))
        return 0
    print(f"namespaces ({len(view['namespaces'])}):")
    for ns in view["namespaces"]:
        print(f"  {ns['root'] or '(unknown root)'}")
        if ns["described"]:
            print(f"    {ns['model']} {ns['dtype']}, block {ns['block_size']}, salt "
                  f"{ns['salt']}, {ns['blocks']} blocks, {size_text(ns['bytes'])}")
            print(f"    fingerprint {ns['model_fingerprint']}")
        else:
            print(f"    (no worker described it) {ns['blocks']} blocks, "
                  f"{size_text(ns['bytes'])}")
    print(f"cached prefixes ({len(view['prefixes'])} of {view['num_prefixes']}, most recent "
          "first; the key names the whole prefix):")
    now = time.time()
    for p in view["prefixes"]:
        print(f"  {p['key']}")
        print(_prefix_line(p, now))
    return 0


def register(sub: Any) -> None:
    """Add ``ls``, ``pin``, ``unpin`` and ``invalidate`` to the ``kvstore`` parser."""
    p = sub.add_parser("ls", help="namespaces and cached prefixes, with full keys")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--limit", type=int, default=20,
                   help="cached prefixes to list, most recently used first (default 20)")
    p.set_defaults(func=cmd_ls)

    for name, helptext, func in (
            ("pin", "keep blocks from eviction: full keys, or a prompt's blocks", cmd_pin),
            ("unpin", "release pins: full keys, or a prompt's blocks", cmd_unpin)):
        p = sub.add_parser(name, help=helptext)
        add_config_flags(p, address_fallback=RUNNING_CLUSTER)
        p.add_argument("keys", nargs="*", metavar="KEYHEX",
                       help="full block keys (64 hex digits, as `kvstore ls` prints)")
        add_prompt_args(p)
        if name == "pin":
            p.add_argument("--soft", action="store_true",
                           help="evictable when nothing else is left (default: hard)")
            p.add_argument("--ttl", type=float, metavar="S", help="soft pin lifetime in seconds")
            p.add_argument("--ahead", action="store_true",
                           help="also pin blocks not cached yet (they stay pinned once published)")
        p.set_defaults(func=func)

    p = sub.add_parser("invalidate", help="evict a namespace, or a prompt's blocks, everywhere")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--prompts", metavar="FILE.jsonl",
                   help="evict exactly these prompts' blocks (with --model), not a namespace")
    g.add_argument("--text", help="evict exactly this prompt's blocks (with --model)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="local tokenizer directory, as the workers (default: the model "
                   "directory's own; bytes for a preset)")
    p.add_argument("--namespace", metavar="ROOTHEX",
                   help="the namespace root (64 hex digits, as `kvstore ls` prints)")
    p.add_argument("--model", help="the workers' model (preset or weights directory): its "
                                    "namespace, with --block-size, --salt and --config")
    p.add_argument("--seed", type=int, help="weights seed of a random preset, with --model")
    p.add_argument("--model-fingerprint", help="namespace field: the model's sha256 fingerprint")
    p.add_argument("--dtype", help="namespace field: float32, float16, bfloat16, int8 or "
                   "uint8 (a quantized cache's bytes)")
    p.add_argument("--block-size", type=int, help="namespace field: tokens per block")
    p.add_argument("--num-layers", type=int, help="namespace field: the model's layers")
    p.add_argument("--num-kv-heads", type=int, help="namespace field: KV heads per layer")
    p.add_argument("--head-dim", type=int, help="namespace field: size of one head")
    p.add_argument("--salt", help="namespace field: the tenant's cache salt (default none)")
    p.add_argument("--numerics", metavar="TAG",
                   help="namespace field: the workers' numerics tag (`kvstore status --wide`; "
                   "none or portable: no tag); with --model: default worker.numerics")
    p.set_defaults(func=cmd_invalidate, keys=[])
