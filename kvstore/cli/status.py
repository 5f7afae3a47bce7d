"""``kvstore status`` and ``kvstore drain``: the cluster at a glance, in 80 columns.

The default table fits an 80-column terminal: node ids are cut to 12 digits, which ``drain``
accepts as a unique prefix; ``--wide`` prints every column and full ids, ``--json`` everything.
Top prefixes are printed with their full keys, which ``pin`` and ``unpin`` take.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from kvstore.cli.cache import connect, operator_config, size_text
from kvstore.command_flags import RUNNING_CLUSTER, add_config_flags
from kvstore.command_output import output_console

#: Digits of a node id the narrow table shows (Ray's ids are 56; 12 stay unique in practice,
#: and ``drain`` refuses an ambiguous prefix).
SHORT_ID = 12


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
    return f"{hits / total:.0%}" if total else "-"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _print_disk_tiers(console: Any, nodes: list[dict[str, Any]],
                      ident: Callable[[str], str]) -> None:
    """The disk tier of each node that has one (``tiers.disk.capacity_bytes`` > 0); nothing
    when none has."""
    disks = [n for n in nodes if (n.get("tiers") or {}).get("disk", {}).get("capacity_bytes")]
    if not disks:
        return
    rows = []
    for n in disks:
        d = n["tiers"]["disk"]
        use = d["used_bytes"] / d["capacity_bytes"]
        rows.append([ident(n["node_id"]), size_text(d["used_bytes"]),
                     size_text(d["capacity_bytes"]), f"{use:.0%}", str(d["blocks"]),
                     str(d["hits"])])
    console.print(_table("disk tiers (under each node's arena; kept across restarts)",
                         ["node id", "used", "capacity", "use", "blocks", "disk hits"], rows))


def cmd_status(args: argparse.Namespace) -> int:
    """Per-node use, hit rate and evictions; workers; the most used prefixes."""
    operator_config(args)
    from rich.console import Console

    from kvstore.cluster import operations

    connect(args)
    status = status_json(operations.status())
    status["security"] = operations.security()
    status["ray"] = operations.ray_reach()
    if args.json:
        print(json.dumps(status, default=str, sort_keys=True))
        return 0
    # --wide is for wide terminals and for grep: never squeeze it into the terminal's width;
    # off a terminal (a pipe, a log) no line is wrapped at all (command_output).
    console = Console(soft_wrap=False, width=400) if args.wide else output_console()
    ident = (lambda s: s) if args.wide else (lambda s: s[:SHORT_ID])
    rows = []
    for n in status["nodes"]:
        use = n["used_bytes"] / n["capacity_bytes"] if n["capacity_bytes"] else 0.0
        rows.append([ident(n["node_id"]), "yes" if n.get("alive", True) else "no",
                     size_text(n["used_bytes"]), size_text(n["capacity_bytes"]), f"{use:.0%}",
                     str(n["blocks"]), _ratio(n["hits"], n["misses"]), str(n["evictions"])])
    console.print(_table("nodes (drain takes the id or a unique prefix)",
                         ["node id", "alive", "used", "capacity", "use", "blocks", "hits",
                          "evicted"], rows))
    _print_disk_tiers(console, status["nodes"], ident)
    t = status["totals"]
    console.print(f"total: {t['nodes_alive']} alive, {size_text(t['used_bytes'])} of "
                  f"{size_text(t['capacity_bytes'])}, {t['blocks']} blocks, hit rate "
                  f"{t['hit_rate']:.1%}, {t['evictions']} evictions")
    console.print(security_line(status["security"]))
    console.print(ray_line(status["ray"]))
    _print_workers(console, status.get("workers") or [], wide=args.wide)
    drift = status.get("drift")
    if drift and any(drift.values()):
        console.print(f"drift found at re-registration: {drift}")
    top = status.get("top_prefixes") or []
    if top:
        console.print(_table("most used blocks (full keys: pin/unpin take them)", ["key", "uses"],
                             [[str(i.get("key")), str(i.get("touches", i.get("count", 0)))]
                              for i in top]))
    return 0


def _on(value: Any) -> str:
    return "on" if value else "off"


def security_line(sec: dict[str, Any]) -> str:
    """One line: auth, TLS, tenant checks, keyed namespaces; INSECURE loudly (rich markup)."""
    if not sec:
        return "security: unknown (no running config)"
    line = (f"security: auth {_on(sec.get('auth'))}, TLS {_on(sec.get('tls'))}, tenant "
            f"checks {_on(sec.get('tenant_enforcement'))}, keyed namespaces "
            f"{_on(sec.get('keyed_namespaces'))}")
    if sec.get("rotation_in_progress"):
        line += "; rotation in progress (the previous token is still accepted: --finish)"
    if sec.get("cert_days_left") is not None:
        line += f"; certificates expire in {sec['cert_days_left']:.0f} days"
    if sec.get("insecure"):
        return ("[bold red]WARNING: INSECURE (--insecure): no authentication, no TLS, no "
                "tenant checks; anyone reaching a node can read, plant and delete KV[/]\n"
                + line)
    if not sec.get("auth"):
        line += " (loopback only: the single-machine default)"
    return line


def ray_line(reach: dict[str, Any]) -> str:
    """One line: where Ray itself answers and with what auth (``operations.ray_reach``)."""
    where = f"ray: {reach['gcs_address']}"
    auth = reach.get("auth_mode") or "disabled"
    if reach.get("loopback"):
        return f"{where}, loopback only: reachable from this machine only"
    nodes = ", ".join(reach.get("node_ips") or []) or "?"
    if auth == "token":
        return f"{where} on the network (nodes {nodes}), Ray token auth on"
    return (f"[yellow]{where} on the network (nodes {nodes}) with Ray auth {auth}: anyone "
            "reaching it runs code as its user (docs/security.md)[/yellow]")


def _exactness(w: dict[str, Any]) -> str:
    """``yes`` (bitwise equal to --no-cache), ``close`` (portable numerics: blocks from other
    hardware, numerically close), or ``no`` (an approximate reuse policy)."""
    if not (w.get("reuse") or {}).get("exact"):
        return "no"
    return "close" if w.get("numerics") == "" else "yes"


def _print_workers(console: Any, workers: list[dict[str, Any]], *, wide: bool) -> None:
    if not workers:
        return
    columns = ["worker", "node id", "model", "reuse", "exact"]
    if wide:
        columns += ["device", "attention", "resume at", "smallest piece", "numerics",
                    "namespace"]
    rows = []
    for w in workers:
        reuse = w.get("reuse") or {}
        row = [str(w.get("worker_id")), str(w.get("node_id", ""))[:None if wide else SHORT_ID],
               f"{w.get('model')} {w.get('dtype')}", str(reuse.get("mode")), _exactness(w)]
        if wide:
            row += [str(w.get("device", "-")), str(w.get("attn")),
                    f"{reuse.get('resume')} boundaries",
                    str((reuse.get("piece_sizes") or ["any"])[0]),
                    str(w.get("numerics", "-")) or "portable",
                    str((w.get("namespace") or {}).get("root", "-"))]
        rows.append(row)
    console.print(_table("workers (exact = bitwise equal to --no-cache)", columns, rows))
    if any(w.get("numerics") == "" for w in workers):
        console.print("[yellow]numerics: portable (worker.numerics) — blocks are shared across "
                      "hardware and attention implementations; outputs are numerically close "
                      "to --no-cache, not bitwise[/yellow]")


def cmd_drain(args: argparse.Namespace) -> int:
    """Move a node's blocks elsewhere (or evict them) and stop using it."""
    operator_config(args)
    from kvstore.cluster import operations

    connect(args)
    node_id, n = operations.drain(args.node_id)
    print(f"draining {node_id}: {n} blocks to move or evict")
    return 0


def register(sub: Any) -> None:
    """Add ``status`` and ``drain`` to the ``kvstore`` parser."""
    p = sub.add_parser("status", help="per-node use, hit rate, evictions, top prefixes")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    p.add_argument("--json", action="store_true", help="print one JSON object (full ids)")
    p.add_argument("--wide", action="store_true",
                   help="every column and full node ids (wider than 80 columns)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("drain", help="move a node's blocks elsewhere (or evict) and stop using it")
    add_config_flags(p, address_fallback=RUNNING_CLUSTER)
    p.add_argument("node_id", metavar="NODE_ID",
                   help="the node id, or a unique prefix of it (as `kvstore status` prints)")
    p.set_defaults(func=cmd_drain)
